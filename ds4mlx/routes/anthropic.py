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
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag
from quart import Blueprint, request

from ds4mlx.dsml import (
    ParseError,
    TextDelta,
    ThinkingDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    wire,
)
from ds4mlx.routes.common import (
    SSE_COMMENT,
    APIError,
    Keepalive,
    OpenModel,
    check_tool_results,
    clamp_max_tokens,
    collect,
    context_check,
    demo_cap_ends_turn,
    demo_policy,
    error_body,
    failed_to_api,
    guard,
    json_response,
    model_thinking,
    new_id,
    parse_body,
    render,
    sampling_params,
    sse,
    sse_response,
    state,
    tokenize,
)
from ds4mlx.server.jobs import GenRequest, JobDone, JobFailed, JobStarted, PrefillProgress

bp = Blueprint("anthropic", __name__)


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
    content: str | list[dict[str, Any]] | None = None
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


class ThinkingConfig(OpenModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
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
    stream: bool = False
    metadata: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None


# --------------------------------------------------------------------------- helpers


def _conversation(body: dict[str, Any], model: str):
    st = state()
    try:
        conv = wire.anthropic_to_conversation(
            body,
            default_thinking=model_thinking(model),
            keep_billing_header=st.config.keep_billing_header,
            decode_reasoning=st.carrier.open,
        )
        return demo_policy(conv)
    except wire.WireError as e:
        raise APIError(400, e.message, param=e.param) from None


def _stop_reason(d: JobDone, tools: bool) -> str:
    if d.finish == "length":
        return "max_tokens"
    if d.finish == "stop_sequence":
        return "stop_sequence"
    return "tool_use" if tools else "end_turn"


def _usage(d: JobDone | None, prompt: int, cached: int, output: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


# --------------------------------------------------------------------------- routes


@bp.post("/v1/messages/count_tokens")
async def count_tokens():
    """Token count of the rendered prompt: ``{"input_tokens": n}``."""
    req, body = await parse_body(CountTokensRequest)
    conv = _conversation(body, req.model)
    toks = await tokenize(render(conv))
    return json_response({"input_tokens": len(toks)})


@bp.post("/v1/messages")
async def messages():
    """Anthropic Messages (streaming and not). Errors: Anthropic error shapes."""
    req, body = await parse_body(MessagesRequest)
    st = state()
    conv = _conversation(body, req.model)
    check_tool_results(conv, "anthropic")
    text = render(conv)
    toks = await tokenize(text)
    context_check(len(toks))
    gen = GenRequest(
        path=request.path,
        prompt_tokens=toks,
        prompt_text=text,
        sampling=sampling_params(
            conv.thinking, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k
        ),
        max_tokens=clamp_max_tokens(req.max_tokens, len(toks)),
        cap_is_eos=demo_cap_ends_turn(req.max_tokens, len(toks)),
        stops=list(req.stop_sequences or []),
        thinking=conv.thinking,
        tools=conv.tools,
        id_prefix="toolu_",
        conversation=conv,
        protocol="anthropic",
        tool_required=conv.tool_required,
        tool_name=conv.tool_name,
    )
    job = st.submit(gen)
    omitted = bool(req.thinking and req.thinking.display == "omitted")
    meta = {"id": new_id("msg_"), "model": req.model or st.config.model_name}
    if req.stream:
        return sse_response(
            guard(job, _stream(job, meta, omitted, st.config.keepalive_s, st.carrier))
        )
    events, done = await collect(job)
    if done.finish == "cancelled":
        raise APIError(503, "generation cancelled (server shutting down)", type="server_error")
    content: list[dict[str, Any]] = []
    for ev in events:
        last = content[-1] if content else None
        if isinstance(ev, ThinkingDelta):
            if last is None or last["type"] != "thinking":
                last = {"type": "thinking", "thinking": "", "signature": ""}
                content.append(last)
            last["thinking"] += ev.text
        elif isinstance(ev, TextDelta):
            if last is None or last["type"] != "text":
                last = {"type": "text", "text": ""}
                content.append(last)
            last["text"] += ev.text
        elif isinstance(ev, ToolCallEnd):
            content.append(
                {
                    "type": "tool_use",
                    "id": ev.call.id,
                    "name": ev.call.name,
                    "input": ev.call.arguments,
                }
            )
    for b in content:
        if b["type"] == "thinking":
            b["signature"] = st.carrier.seal(b["thinking"])
            if omitted:
                b["thinking"] = ""
    tools = any(b["type"] == "tool_use" for b in content)
    return json_response(
        {
            "id": meta["id"],
            "type": "message",
            "role": "assistant",
            "model": meta["model"],
            "content": content,
            "stop_reason": _stop_reason(done, tools),
            "stop_sequence": done.stop_sequence,
            "usage": _usage(done, done.prompt_tokens, done.cached_tokens, done.completion_tokens),
        }
    )


async def _stream(job, meta: dict[str, Any], omitted: bool, keepalive_s: float, carrier):
    # Runs outside the app context (Quart streams bodies after the handler returned).
    ka = Keepalive(keepalive_s)
    started = False
    index = -1
    open_kind: str | None = None
    thinking_text: list[str] = []
    saw_tools = False

    def ev(name: str, data: dict[str, Any]) -> bytes:
        return sse({"type": name, **data}, name)

    def close() -> list[bytes]:
        nonlocal open_kind
        out = []
        if open_kind == "thinking":
            sig = carrier.seal("".join(thinking_text))
            out.append(
                ev(
                    "content_block_delta",
                    {"index": index, "delta": {"type": "signature_delta", "signature": sig}},
                )
            )
        if open_kind is not None:
            out.append(ev("content_block_stop", {"index": index}))
        open_kind = None
        return out

    def open_block(kind: str, block: dict[str, Any]) -> list[bytes]:
        nonlocal index, open_kind
        out = close()
        index += 1
        open_kind = kind
        out.append(ev("content_block_start", {"index": index, "content_block": block}))
        return out

    async for e in job.events(keepalive_s):
        out: list[bytes] = []
        if e is None or isinstance(e, PrefillProgress):
            if ka.due():
                ka.sent()
                yield ev("ping", {}) if started else SSE_COMMENT
            continue
        if isinstance(e, JobStarted):
            started = True
            out.append(
                ev(
                    "message_start",
                    {
                        "message": {
                            "id": meta["id"],
                            "type": "message",
                            "role": "assistant",
                            "model": meta["model"],
                            "content": [],
                            "stop_reason": None,
                            "stop_sequence": None,
                            "usage": _usage(None, e.prompt_tokens, e.cached_tokens, 0),
                        }
                    },
                )
            )
        elif isinstance(e, ThinkingDelta):
            if open_kind != "thinking":
                thinking_text.clear()
                out += open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            thinking_text.append(e.text)
            if not omitted and e.text:
                out.append(
                    ev(
                        "content_block_delta",
                        {"index": index, "delta": {"type": "thinking_delta", "thinking": e.text}},
                    )
                )
        elif isinstance(e, TextDelta):
            if not e.text:
                continue
            if open_kind != "text":
                out += open_block("text", {"type": "text", "text": ""})
            out.append(
                ev(
                    "content_block_delta",
                    {"index": index, "delta": {"type": "text_delta", "text": e.text}},
                )
            )
        elif isinstance(e, ToolCallStart):
            saw_tools = True
            out += open_block(
                "tool_use", {"type": "tool_use", "id": e.id, "name": e.name, "input": {}}
            )
        elif isinstance(e, ToolCallArgsDelta):
            if open_kind == "tool_use" and e.text:
                out.append(
                    ev(
                        "content_block_delta",
                        {
                            "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": e.text},
                        },
                    )
                )
        elif isinstance(e, ToolCallEnd):
            if open_kind == "tool_use":
                out += close()
        elif isinstance(e, ParseError):
            continue
        elif isinstance(e, JobFailed):
            out += close()
            out.append(ev("error", {"error": error_body("anthropic", failed_to_api(e))["error"]}))
            for b in out:
                yield b
            return
        elif isinstance(e, JobDone):
            if e.finish == "cancelled":
                out += close()
                out.append(
                    ev("error", {"error": {"type": "api_error", "message": "generation cancelled"}})
                )
            else:
                out += close()
                out.append(
                    ev(
                        "message_delta",
                        {
                            "delta": {
                                "stop_reason": _stop_reason(e, saw_tools),
                                "stop_sequence": e.stop_sequence,
                            },
                            "usage": _usage(
                                e, e.prompt_tokens, e.cached_tokens, e.completion_tokens
                            ),
                        },
                    )
                )
                out.append(ev("message_stop", {}))
            for b in out:
                yield b
            return
        if out:
            ka.sent()
            for b in out:
                yield b
