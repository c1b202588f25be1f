"""Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Reference: https://docs.anthropic.com/en/api/messages and
https://docs.anthropic.com/en/docs/build-with-claude/streaming (SSE event flow:
``message_start`` → ``content_block_start/delta/stop`` per block → ``message_delta``
→ ``message_stop``, ``ping`` keepalives, ``error`` events).

Claude Code compatibility (captured from the real CLI 2.1.x): ``?beta=true``,
``anthropic-beta``/``anthropic-version`` headers (accepted, not required),
``thinking: {"type": "adaptive"}``, ``output_config`` (``effort``),
``context_management``, ``metadata``, ``cache_control`` on blocks, ``role: "system"``
messages inside ``messages``, ``max_tokens: 32000`` (clamped to the context left).

Thinking blocks carry a ``signature`` that is the server's reasoning carrier
(``ds4mlx.routes.common.ReasoningCarrier``), so a client that got the thinking
without text (``thinking.display: "omitted"``) can replay it exactly. Thinking blocks
coming back with an empty or foreign signature are accepted.

This module owns the whole protocol: the request schema, its mapping onto the neutral
``Conversation`` (`to_conversation`), its names for the planner (`NAMES`), its error
shape (`error_body`) and one encoder (`MessageEncoder`) for
the stream and the JSON body alike.

Mapping rules (docs/ARCHITECTURE.md §4): ``system`` blocks join with ``\\n`` (inserted
only where the previous part lacks one); lines starting with ``x-anthropic-`` (Claude
Code's per-session billing header) are dropped unless ``--keep-billing-header`` (the rest
of their block stays; a block of only such lines is dropped); ``role: "system"``
messages are hoisted after the top-level system text; an assistant message's thinking
blocks (interleaved with its tool calls) become the one DS4 reasoning block, joined by a
blank line; ``tool_result`` blocks become ``tool`` messages (text in the same user
message follows them), ``is_error: true`` prefixing `TOOL_ERROR_PREFIX`; server tools
(no ``input_schema``) are not offered to the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, StrictBool, Tag
from quart import Blueprint, request

from ds4mlx.dsml import (
    Conversation,
    Message,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolSpec,
)
from ds4mlx.jobs import GenRequest, JobDone, JobFailed, JobStarted, LiveLabels
from ds4mlx.routes import constraints
from ds4mlx.routes.access import key_salt
from ds4mlx.routes.body import ContentPart, OpenModel, offload, parse, read_body
from ds4mlx.routes.carrier import carrier
from ds4mlx.routes.common import (
    cache_salt,
    helper_agent,
    json_response,
    model_thinking,
    new_id,
    note_unoffered,
    state,
    state_key,
)
from ds4mlx.routes.errors import APIError, Wording, failed_to_api
from ds4mlx.routes.mapping import (
    WireError,
    checked_choice,
    effort_to_reasoning,
    empty_schema,
    hoisted_system,
    join_blank,
    join_newline,
    late_system,
    placeholder,
    system_in_conversation,
    unique_names,
)
from ds4mlx.routes.pipeline import (
    SHUTDOWN_CANCEL,
    demo_policy,
    prepare,
    respond,
    sampling_params,
    stream,
)
from ds4mlx.routes.sse import sse

bp = Blueprint("anthropic", __name__)


# This protocol's names: its jobs' live decision ``live-anthropic`` with the log detail
# ``match=tool-use-ids ids=N``, and the 400 for a ``tool_use_id`` nothing explains.
NAMES = Wording(
    param="messages",
    id_field="tool_use_id",
    calls="a tool_use block of the messages",
    labels=LiveLabels(live_tools="live-anthropic", ids="tool-use-ids"),
)

# The Messages API's paths: errors there take this protocol's shape (`error_body`).
PATH_PREFIX = "/v1/messages"

# Error "type" per HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(err: APIError) -> dict[str, Any]:
    """The Anthropic error object for ``err``: ``{"type": "error", "error": {"type",
    "message", …fields}}``, the type from the status unless ``err.anthropic_type``.

    A context-length error is worded as the Messages API words it (`prompt_too_long`):
    clients act on that text, not on a code this protocol does not have.
    """
    default = "api_error" if err.status >= 500 else "invalid_request_error"
    return {
        "type": "error",
        "error": {
            "type": err.anthropic_type or _ERROR_TYPES.get(err.status, default),
            "message": prompt_too_long(err) or err.message,
            **err.fields,
        },
    }


def prompt_too_long(err: APIError) -> str | None:
    """The Messages API's wording of a context-length error, or None for another error.

    ``prompt is too long: N tokens > M maximum`` is what Anthropic's API answers, and
    Claude Code keys on it: that text (any case, in a 400 or a stream's ``error`` event)
    makes it compact the conversation and retry, reading N − M as how much to drop;
    other wording ends the session with an API error. M is the largest prompt the
    context takes (one token less than ``--ctx``: the prompt must leave room to answer).
    """
    n, ctx = err.fields.get("n_prompt_tokens"), err.fields.get("n_ctx")
    if err.code != "context_length_exceeded" or not isinstance(n, int) or not isinstance(ctx, int):
        return None
    return (
        f"prompt is too long: {n} tokens > {ctx - 1} maximum (the server's context is {ctx} "
        "tokens; shorten the conversation or restart the server with a larger --ctx)"
    )


BILLING_PREFIX = "x-anthropic-"
# ``tool_result.is_error``: the DS4 format has no error flag, so the text says it.
TOOL_ERROR_PREFIX = "[tool error] "


# --------------------------------------------------------------------------- schemas


class TextBlock(OpenModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(OpenModel):
    type: Literal["tool_use", "server_tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(OpenModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ContentPart] | None = None
    is_error: bool | None = None


class ThinkingBlock(OpenModel):
    type: Literal["thinking"]
    thinking: str = ""
    signature: str | None = None


class OtherBlock(OpenModel):
    """Images, documents, redacted thinking, server-tool results…: rendered as placeholders."""

    type: str


_KNOWN_BLOCKS = {"text", "tool_use", "server_tool_use", "tool_result", "thinking"}


def _block_tag(v: Any) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    if not isinstance(t, str):
        return "other"  # whose ``type: str`` then names the field in the 400
    if t in ("tool_use", "server_tool_use"):
        return "tool_use"
    return t if t in _KNOWN_BLOCKS else "other"


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_tag),
]


class AnthropicMessage(OpenModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class SystemBlock(OpenModel):
    type: str = "text"
    text: str


class AnthropicTool(OpenModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    # Ours, no Anthropic field (docs/ARCHITECTURE.md §4, asynchronous tools): the tool
    # runs in the background.
    async_: StrictBool | None = Field(None, alias="async")


class ThinkingConfig(OpenModel):
    type: Literal["enabled", "disabled", "adaptive"]
    # Anthropic's floor; a cap on the reasoning (`ds4mlx.engine.thinking_budget`).
    budget_tokens: int | None = Field(None, ge=1024)
    display: str | None = None


class CountTokensRequest(OpenModel):
    """Body of ``POST /v1/messages/count_tokens``."""

    model: str = ""
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[SystemBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """Body of ``POST /v1/messages`` (unknown fields tolerated; ``max_tokens`` required)."""

    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = Field(None, max_length=64)
    # Not Anthropic's: reproducible sampling, as OpenAI's APIs take it (any int).
    seed: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None

    refused: ClassVar[dict[str, str]] = {
        "mcp_servers": "the MCP connector is not supported: this server runs no tools "
        "itself; connect the MCP servers in your client",
        "container": "code execution containers are not supported: no tools run on this server",
        "stop": "not a Messages API parameter: use stop_sequences",
        "max_completion_tokens": "not a Messages API parameter: use max_tokens",
        "response_format": "not a Messages API parameter: use output_config.format",
        **dict.fromkeys(
            ("logit_bias", "frequency_penalty", "presence_penalty", "n"),
            "not a Messages API parameter (OpenAI's APIs have it)",
        ),
    }


# --------------------------------------------------------------------------- mapping


def strip_billing_lines(text: str) -> str | None:
    """``text`` without its ``x-anthropic-…`` lines (client metadata, docs/ARCHITECTURE.md §4).

    Returns None when the text was nothing but such lines (the block is dropped, not
    rendered as an empty part), else the remaining lines, unchanged.
    """
    if BILLING_PREFIX not in text:
        return text
    lines = text.splitlines(keepends=True)
    kept = [ln for ln in lines if not ln.startswith(BILLING_PREFIX)]
    if len(kept) == len(lines):
        return text
    return "".join(kept) if kept else None


def system_text(
    system: str | list[SystemBlock] | None, *, keep_billing_header: bool = False
) -> str:
    """The top-level ``system`` (string or text blocks) as one string.

    Blocks are joined with ``\\n`` (inserted only when missing); lines beginning with
    ``x-anthropic-`` are dropped unless ``keep_billing_header`` (the rest of their block
    is kept; a block of only such lines is dropped).
    """
    if system is None:
        return ""
    if isinstance(system, str):
        return system if keep_billing_header else (strip_billing_lines(system) or "")
    parts = [b.text for b in system]
    if not keep_billing_header:
        parts = [p for p in map(strip_billing_lines, parts) if p is not None]
    return join_newline(parts)


def _blocks(content: str | list[Any]) -> list[Any]:
    return [TextBlock(type="text", text=content)] if isinstance(content, str) else content


def _result_text(content: str | list[ContentPart] | None) -> str:
    """A ``tool_result``'s content: text blocks joined by a blank line, other blocks as
    placeholders."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return join_blank((b.text or "") if b.type == "text" else _placeholder(b) for b in content)


def _placeholder(block: Any) -> str:
    """The placeholder of a non-text block (a document names its source's media type)."""
    fields = block if isinstance(block, dict) else {"type": block.type, **(block.model_extra or {})}
    source = fields.get("source")
    media = source.get("media_type") if isinstance(source, dict) else None
    return placeholder(fields.get("type"), media)


def _user_turn(blocks: list[Any]) -> list[Message]:
    """A user message: its tool results (``tool`` messages), then its text blocks, if
    any, joined by a blank line as DeepSeek's own conversion joins them."""
    out: list[Message] = []
    texts: list[str] = []
    for b in blocks:
        if isinstance(b, ToolResultBlock):
            result = _result_text(b.content)
            if b.is_error is True:
                result = TOOL_ERROR_PREFIX + result
            out.append(Message(role="tool", tool_call_id=b.tool_use_id, content=result))
        elif isinstance(b, TextBlock):
            texts.append(b.text)
        else:
            texts.append(_placeholder(b))
    if texts or not out:
        out.append(Message(role="user", content="\n\n".join(texts)))
    return out


def _assistant_turn(
    blocks: list[Any], decode_reasoning: Callable[[str], str | None] | None
) -> Message:
    """An assistant message; its thinking blocks become the one DS4 reasoning block."""
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for b in blocks:
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ThinkingBlock):
            text = decode_reasoning(b.signature) if decode_reasoning and b.signature else None
            reasoning.append(text if text is not None else b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append(ToolCall(id=b.id, name=b.name, arguments=b.input))
        # redacted_thinking and server tool results carry nothing we can render.
    return Message(
        role="assistant",
        content="".join(texts),
        # Interleaved thinking (thinking, tool_use, thinking, tool_use): the DS4 format
        # has one reasoning block; never glue its segments together.
        reasoning=join_blank(reasoning) if reasoning else None,
        tool_calls=calls,
    )


def _unique_tool_use_ids(messages: list[Any]) -> None:
    """Refuse a ``tool_use`` id given twice, as Anthropic's API does: a result names its
    call by id, and the server's tool memory renders a known id from the bytes the model
    sampled under it, so a second call under the same id would be shown to the model as
    the first one.

    Raises:
        WireError: ``messages.I.content.J`` of the repeated block.
    """
    seen: set[str] = set()
    for i, m in enumerate(messages):
        if m.role != "assistant" or isinstance(m.content, str):
            continue
        for j, b in enumerate(m.content):
            if isinstance(b, ToolUseBlock):
                if b.id in seen:
                    path = f"messages.{i}.content.{j}"
                    raise WireError(f"{path}: `tool_use` ids must be unique ({b.id!r})", path)
                seen.add(b.id)


def _tools(req: CountTokensRequest) -> list[ToolSpec]:
    """The callable tools offered (none with ``tool_choice: none``; server tools such as
    ``web_search_20250305`` have no ``input_schema`` and are not offered).

    Raises:
        WireError: a custom tool (no versioned ``type``) without ``input_schema``, two
            tools of one name.
    """
    for i, t in enumerate(req.tools or []):
        if t.input_schema is None and t.type in (None, "custom"):
            raise WireError(
                f"tools[{i}].input_schema: required for a custom tool", f"tools.{i}.input_schema"
            )
    note_unoffered(t.type for t in req.tools or [] if t.input_schema is None and t.type)
    if (req.tool_choice or {}).get("type") == "none":
        return []
    return unique_names(
        [
            ToolSpec(
                name=t.name,
                description=t.description or "",
                parameters=t.input_schema or empty_schema(),
                background=bool(t.async_),
            )
            for t in req.tools or []
            if t.input_schema is not None
        ]
    )


def _tool_choice(choice: dict[str, Any] | None, tools: list[ToolSpec]) -> tuple[bool, str | None]:
    """``tool_choice`` (``{"type": "auto" | "any" | "tool" | "none", "name"}``) →
    ``(tool_required, tool_name)``.

    Raises:
        WireError: an unknown type, ``tool`` without a name, a forced choice without
            tools, a named tool that is not offered, or a ``disable_parallel_tool_use``
            that is not a JSON boolean.
    """
    if choice is None:
        return False, None
    flag = choice.get("disable_parallel_tool_use")
    if flag is not None and not isinstance(flag, bool):
        raise WireError(
            "tool_choice.disable_parallel_tool_use: Input should be a valid boolean",
            "tool_choice.disable_parallel_tool_use",
        )
    typ = choice.get("type")
    if typ in ("auto", "none"):
        return False, None
    if typ == "any":
        return checked_choice(True, None, tools)
    if typ == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise WireError("tool_choice.name: required for type 'tool'", "tool_choice.name")
        return checked_choice(True, name, tools)
    raise WireError(
        f"tool_choice.type: {typ!r} is not one of 'auto', 'any', 'tool', 'none'",
        "tool_choice.type",
    )


def to_conversation(
    req: CountTokensRequest,
    *,
    default_thinking: bool = True,
    keep_billing_header: bool = False,
    decode_reasoning: Callable[[str], str | None] | None = None,
) -> Conversation:
    """Map a validated Messages request onto a `Conversation`.

    Args:
        req: the request (`MessagesRequest` or `CountTokensRequest`).
        default_thinking: the mode when ``thinking`` is absent (the served model's
            default; False for the ``deepseek-chat`` alias).
        keep_billing_header: keep ``x-anthropic-…`` system lines.
        decode_reasoning: maps a thinking block's ``signature`` to the reasoning it
            carries (the server's integrity-checked carrier, None when it does not
            verify); lets a client that received the thinking without its text
            (``display: "omitted"``) replay it exactly. Empty or foreign signatures are
            accepted and the block's own ``thinking`` text is used.
    Raises:
        WireError: an invalid ``tool_choice`` (param ``tool_choice…``).
    """
    system_parts = [system_text(req.system, keep_billing_header=keep_billing_header)]
    late: list[str] = []  # role "system" messages (Claude Code's environment, skills)
    msgs: list[Message] = []
    _unique_tool_use_ids(req.messages)
    for m in req.messages:
        blocks = _blocks(m.content)
        if m.role == "system":
            text = join_newline(b.text for b in blocks if isinstance(b, TextBlock))
            kept = text if keep_billing_header else strip_billing_lines(text)
            if kept is not None:
                system_in_conversation(msgs, late, kept)
        elif m.role == "user":
            msgs.extend(_user_turn(blocks))
        else:
            msgs.append(_assistant_turn(blocks, decode_reasoning))
    if msgs and msgs[-1].role == "assistant":
        # Anthropic's prefill: the reply continues a trailing assistant message.
        msgs[-1].prefix = True
    tools = _tools(req)
    thinking = req.thinking.type != "disabled" if req.thinking else default_thinking
    _, effort = effort_to_reasoning((req.output_config or {}).get("effort"), "output_config.effort")
    required, name = _tool_choice(req.tool_choice, tools)
    return Conversation(
        messages=hoisted_system(msgs, system_parts),
        late_system=late_system(late),
        tools=tools,
        thinking=thinking,
        reasoning_effort=effort if thinking else None,
        tool_required=required,
        tool_name=name,
        tool_none=(req.tool_choice or {}).get("type") == "none",
        single_call=(req.tool_choice or {}).get("disable_parallel_tool_use") is True,
        open_reply=True,
    )


def _conversation(req: CountTokensRequest) -> Conversation:
    """`to_conversation` with the server's settings (400 on a mapping error)."""
    st = state()
    try:
        return demo_policy(
            to_conversation(
                req,
                default_thinking=model_thinking(req.model),
                keep_billing_header=st.config.keep_billing_header,
                decode_reasoning=carrier().open,
            )
        )
    except WireError as e:
        raise APIError(400, e.message, param=e.param) from None


# --------------------------------------------------------------------------- encoder


def _usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


class MessageEncoder:
    """Job events → Messages SSE events, and (fed everything) the ``message`` object.

    Blocks open as the model starts them (``thinking``, ``text``, ``tool_use``) and
    close when another starts or the turn ends; a thinking block closes with its
    ``signature_delta`` (the reasoning carrier). ``omitted`` (``thinking.display:
    "omitted"``) sends thinking blocks without their text. A tool call cut by the end
    of the turn (``ToolCallEnd.closed`` False) was streamed but is left out of the
    message object and does not make the stop reason ``tool_use``.
    """

    def __init__(self, msg_id: str, model: str, *, omitted: bool, carrier):
        self.carrier = carrier
        self.omitted = omitted
        self.started_ = False
        self.blocks: list[dict[str, Any]] = []  # every block, in stream order
        self.cut: list[dict[str, Any]] = []  # tool_use blocks of cut calls
        self.open: dict[str, Any] | None = None
        self.reasoning: list[str] = []  # the open thinking block's text
        self.calls = 0  # complete tool calls
        self.message: dict[str, Any] = {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(0, 0, 0),
        }
        self._feed = {
            ThinkingDelta: self._thinking,
            TextDelta: self._text,
            ToolCallStart: self._tool_start,
            ToolCallArgsDelta: self._tool_args,
            ToolCallEnd: self._tool_end,
        }

    # ---- framing

    @staticmethod
    def _ev(name: str, **data: Any) -> dict[str, Any]:
        return {"type": name, **data}

    def frame(self, ev: dict[str, Any]) -> bytes:
        return sse(ev, ev["type"])

    def opening(self) -> list[Any]:
        return []

    def idle(self) -> dict[str, Any] | None:
        # Before message_start only an SSE comment is valid; after it, a ping event.
        return self._ev("ping") if self.started_ else None

    # ---- blocks

    def _close(self) -> list[dict[str, Any]]:
        block, self.open = self.open, None
        if block is None:
            return []
        index = len(self.blocks) - 1
        out = []
        if block["type"] == "thinking":
            text = "".join(self.reasoning)
            block["signature"] = self.carrier.seal(text)
            block["thinking"] = "" if self.omitted else text
            delta = {"type": "signature_delta", "signature": block["signature"]}
            out.append(self._ev("content_block_delta", index=index, delta=delta))
        out.append(self._ev("content_block_stop", index=index))
        return out

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.blocks.append(block)
        self.open = block
        out.append(
            self._ev("content_block_start", index=len(self.blocks) - 1, content_block=dict(block))
        )
        return out

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return self._ev("content_block_delta", index=len(self.blocks) - 1, delta=delta)

    def _thinking(self, e: ThinkingDelta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != "thinking":
            out = self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.reasoning = []
        self.reasoning.append(e.text)
        if not self.omitted and e.text:
            out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
        return out

    def _text(self, e: TextDelta) -> list[dict[str, Any]]:
        if not e.text:
            return []
        out: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != "text":
            out = self._start({"type": "text", "text": ""})
        self.open["text"] += e.text
        out.append(self._delta({"type": "text_delta", "text": e.text}))
        return out

    def _tool_start(self, e: ToolCallStart) -> list[dict[str, Any]]:
        return self._start({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})

    def _tool_args(self, e: ToolCallArgsDelta) -> list[dict[str, Any]]:
        if self.open is None or self.open["type"] != "tool_use" or not e.text:
            return []
        return [self._delta({"type": "input_json_delta", "partial_json": e.text})]

    def _tool_end(self, e: ToolCallEnd) -> list[dict[str, Any]]:
        if self.open is None or self.open["type"] != "tool_use":
            return []
        if e.closed:
            self.open["input"] = e.call.arguments
            self.calls += 1
        else:
            self.cut.append(self.open)
        return self._close()

    # ---- the job

    def started(self, e: JobStarted) -> list[dict[str, Any]]:
        self.started_ = True
        self.message["usage"] = _usage(e.prompt_tokens, e.cached_tokens, 0)
        return [self._ev("message_start", message={**self.message, "content": []})]

    def feed(self, e: Any) -> list[dict[str, Any]]:
        handler = self._feed.get(type(e))
        return handler(e) if handler is not None else []

    def done(self, e: JobDone) -> list[dict[str, Any]]:
        out = self._close()
        if e.finish == "cancelled":
            err = {"type": "api_error", "message": SHUTDOWN_CANCEL}
            return [*out, self._ev("error", error=err)]
        if e.finish == "length":
            reason = "max_tokens"
        elif e.finish == "context":
            reason = "model_context_window_exceeded"
        elif e.finish == "stop_sequence":
            reason = "stop_sequence"
        else:
            reason = "tool_use" if self.calls else "end_turn"
        usage = _usage(e.prompt_tokens, e.cached_tokens, e.completion_tokens)
        self.message.update(stop_reason=reason, stop_sequence=e.stop_sequence, usage=usage)
        delta = {"stop_reason": reason, "stop_sequence": e.stop_sequence}
        return [*out, self._ev("message_delta", delta=delta, usage=usage), self._ev("message_stop")]

    def failed(self, e: JobFailed) -> list[dict[str, Any]]:
        err = error_body(failed_to_api(e, NAMES))["error"]
        return [*self._close(), self._ev("error", error=err)]

    def result(self) -> dict[str, Any]:
        content = [b for b in self.blocks if not any(b is c for c in self.cut)]
        return {**self.message, "content": content}


# --------------------------------------------------------------------------- routes


@bp.post("/v1/messages/count_tokens")
async def count_tokens():
    """``{"input_tokens": n}``: the prompt tokens the same request to ``/v1/messages``
    would be charged now (its usage ``input_tokens + cache_read_input_tokens``)."""
    key = state_key(request.headers)
    n = await offload(_count, await read_body(), key, key_salt(request.headers))
    return json_response({"input_tokens": n})


def _count(raw: bytes, key: str | None, salt_of_key: str = "") -> int:
    """A count request's prediction (off the event loop): its job as ``/v1/messages``
    builds it, answered by the prompt cache's read-only query (``ServerState.charged``).
    No job is queued, so it answers while a generation runs. A live state the request
    continues counts as the next request's usage does: with the hidden reasoning it
    holds, which the rendering leaves out."""
    req = parse(CountTokensRequest, raw)
    return state().charged(_gen(req, "/v1/messages", key, salt_of_key, count_only=True))


def _job(
    raw: bytes, path: str, key: str | None, salt_of_key: str = "", side: bool = False
) -> tuple[MessagesRequest, GenRequest]:
    """The typed request and its job (off the event loop: parse, validate, map, render)."""
    req = parse(MessagesRequest, raw)
    _check_budget(req)
    return req, _gen(req, path, key, salt_of_key, side)


def _check_budget(req: MessagesRequest) -> None:
    """Anthropic's rule for an enabled thinking's budget: below ``max_tokens`` (else the
    reasoning could take the whole reply, leaving no text). Unlike Anthropic, an enabled
    thinking without a budget is served, uncapped (DeepSeek's reasoning has no budget
    of its own).

    Raises:
        APIError: 400 naming the rule.
    """
    th = req.thinking
    if th is None or th.type != "enabled" or th.budget_tokens is None:
        return
    if th.budget_tokens >= req.max_tokens:
        raise APIError(
            400,
            f"max_tokens must be greater than thinking.budget_tokens "
            f"({req.max_tokens} <= {th.budget_tokens})",
        )


def _gen(
    req: CountTokensRequest,
    path: str,
    key: str | None,
    salt_of_key: str,
    side: bool = False,
    count_only: bool = False,
) -> GenRequest:
    """The job of a validated request (a count request has no output limit nor stops);
    ``key``: its `state_key` (from the headers); the body's ``cache_salt`` and
    ``salt_of_key`` (the API key's `key_salt`) make its cache salt (`cache_salt`);
    ``side``: a helper agent's request (`helper_agent`); ``count_only``: counted, never
    run (`prepare`)."""
    conv = _conversation(req)
    return prepare(
        conv,
        NAMES,
        path=path,
        max_tokens=getattr(req, "max_tokens", None),
        sampling=sampling_params(conv.thinking, req),
        id_prefix="toolu_",
        stops=getattr(req, "stop_sequences", None),
        state_key=key,
        salt=cache_salt((req.model_extra or {}).get("cache_salt"), salt_of_key),
        side=side,
        constraint=constraints.read(constraints.anthropic_constraint, req),
        count_only=count_only,
        thinking_budget=(
            req.thinking.budget_tokens if req.thinking and req.thinking.type == "enabled" else None
        ),
    )


@bp.post("/v1/messages")
async def messages():
    """Anthropic Messages (streaming and not). Errors: Anthropic error shapes."""
    h = request.headers
    key = state_key(h)
    req, gen = await offload(
        _job, await read_body(), request.path, key, key_salt(h), helper_agent(h)
    )
    st = state()
    job = st.submit(gen)
    enc = MessageEncoder(
        new_id("msg_"),
        req.model or st.config.model_name,
        omitted=bool(req.thinking and req.thinking.display == "omitted"),
        carrier=carrier(),
    )
    if req.stream:
        return await stream(job, enc, NAMES)
    return json_response(await respond(job, enc, NAMES))
