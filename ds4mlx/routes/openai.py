"""OpenAI Chat Completions: ``POST /v1/chat/completions``.

Reference: https://platform.openai.com/docs/api-reference/chat/create (plus DeepSeek's
``reasoning_content`` and ``thinking`` extensions,
https://api-docs.deepseek.com/guides/thinking_mode).

Streaming uses ``chat.completion.chunk`` SSE frames ending with ``data: [DONE]``;
reasoning streams as ``delta.reasoning_content``; tool calls stream as a header (id,
name) then argument deltas as soon as the DSML is recognized.

This module owns the whole protocol: the request schema, its mapping onto the neutral
``Conversation`` (`to_conversation`), its names for the planner (`NAMES`), and one
encoder (`ChatEncoder`) for the stream and the JSON body alike. Mapping rules
(docs/ARCHITECTURE.md §4): ``system``/``developer`` messages are hoisted into the
leading system block; ``tool`` messages become tool results; assistant
``reasoning_content`` (DeepSeek's field; ``reasoning`` also accepted) is the turn's
reasoning; tool-call arguments that are not a JSON object are kept under
``"arguments"``. The legacy ``/v1/completions`` is `ds4mlx.routes.completions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, StrictBool
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
from ds4mlx.jobs import GenRequest, JobDone, JobFailed, JobStarted, LiveLabels, TokenLogprob
from ds4mlx.routes import constraints
from ds4mlx.routes.access import key_salt
from ds4mlx.routes.body import ContentPart, OpenModel, offload, parse, read_body
from ds4mlx.routes.common import (
    STATE_HEADERS,
    cache_salt,
    json_response,
    model_thinking,
    new_id,
    now,
    state,
    state_key,
)
from ds4mlx.routes.errors import APIError, Wording, failed_to_api, openai_error
from ds4mlx.routes.mapping import (
    WireError,
    allowed_names,
    effort_to_reasoning,
    empty_schema,
    hoisted_system,
    json_object,
    late_system,
    logprob_entries,
    openai_tool_choice,
    parts_text,
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

bp = Blueprint("openai", __name__)

SYSTEM_FINGERPRINT = "ds4mlx"


# This protocol's names: its jobs' live decision ``live-chat`` with the log detail
# ``match=tool-call-ids ids=N``, and the 400 for a ``tool_call_id`` nothing explains.
NAMES = Wording(
    param="messages",
    id_field="tool_call_id",
    calls="an assistant message's tool_calls",
    labels=LiveLabels(live_tools="live-chat", ids="tool-call-ids"),
)


# --------------------------------------------------------------------------- schemas


class FunctionCall(OpenModel):
    name: str
    arguments: str | dict[str, Any] = ""


class ChatToolCall(OpenModel):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(OpenModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    prefix: bool | None = None  # DeepSeek: the trailing assistant message is continued


class FunctionDef(OpenModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Ours (docs/ARCHITECTURE.md §4, asynchronous tools): the tool runs in the background.
    async_: StrictBool | None = Field(None, alias="async")


class ChatTool(OpenModel):
    type: str = "function"
    function: FunctionDef


class StreamOptions(OpenModel):
    include_usage: bool | None = None


class SamplingFields(OpenModel):
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1)
    # OpenAI's ``logit_bias``: token id (a JSON object key) → a bias in [-100, 100] added
    # to that token's logit; the ids' upper bound (the vocabulary) is `logit_bias_of`'s.
    # The key is lax: JSON object keys are strings.
    logit_bias: (
        dict[Annotated[int, Field(ge=0, strict=False)], Annotated[float, Field(ge=-100, le=100)]]
        | None
    ) = None
    # OpenAI's penalties on the reply's own tokens (`ds4mlx.engine.bias.Penalties`).
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # vLLM's extension (`ds4mlx.engine.bias.RepetitionPenalty`): a factor above 0.
    repetition_penalty: float | None = Field(None, gt=0)
    # vLLM's end-of-sequence wishes (`ds4mlx.engine.bias.EndBan`): no EOS before
    # ``min_tokens`` tokens, none at all with ``ignore_eos``.
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: StrictBool | None = None
    # One sample per request: more is refused, never served as one.
    best_of: int | None = Field(None, ge=1, le=1)
    use_beam_search: Literal[False] | None = None


def sampling_wishes(req: SamplingFields) -> dict[str, Any]:
    """The `GenRequest` fields of ``req``'s sampling wishes (chat, completions): the
    ``logit_bias`` pairs (`logit_bias_of`), the presence and frequency penalties (0:
    none) and the repetition penalty (1: none).

    Raises:
        APIError: like `logit_bias_of`.
    """
    return {
        "logit_bias": logit_bias_of(req),
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": req.repetition_penalty or 1.0,
        "min_tokens": req.min_tokens or 0,
        "ignore_eos": bool(req.ignore_eos),
    }


def check_min_tokens(req: SamplingFields, max_tokens: int | None) -> None:
    """vLLM's rule: ``min_tokens`` at most the request's own output limit.

    Raises:
        APIError: 400 naming ``min_tokens`` when it passes ``max_tokens``.
    """
    if req.min_tokens and max_tokens is not None and req.min_tokens > max_tokens:
        raise APIError(
            400,
            f"min_tokens: {req.min_tokens} is more than the output limit ({max_tokens})",
            param="min_tokens",
        )


def logit_bias_of(req: SamplingFields) -> tuple[tuple[int, float], ...]:
    """``req.logit_bias`` as ``(token id, bias)`` pairs in id order.

    Raises:
        APIError: 400 naming ``logit_bias.ID`` for an id outside the vocabulary (the
            schema already refused negative ids and biases outside [-100, 100]).
    """
    bias = req.logit_bias or {}
    tok = state().tokenizer  # None in the body-vetting child: the parent checks the ids
    if tok is not None:
        for t in bias:
            if t >= tok.vocab_size:
                raise APIError(
                    400,
                    f"logit_bias.{t}: token id outside the vocabulary (0..{tok.vocab_size - 1})",
                    param=f"logit_bias.{t}",
                )
    return tuple(sorted(bias.items()))


class ChatRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions`` (unknown fields tolerated)."""

    refused: ClassVar[dict[str, str]] = {
        "modalities": "audio output is not supported: this model writes text output only",
        "audio": "audio output is not supported: this model writes text output only",
        "web_search_options": "web search is not supported: no hosted tools run on this "
        "server; give the model a search tool of your own",
    }

    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: str | None = None
    thinking: dict[str, Any] | bool | None = None
    think: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Streaming tool dispatch (NVIDIA Dynamo's field): strictly a JSON boolean.
    tool_call_dispatch: StrictBool | None = None
    metadata: dict[str, Any] | None = None  # stored-completion tags: checked, not kept


def stops_of(stop: str | list[str] | None) -> list[str]:
    """The ``stop`` field as a list (at most 16 strings).

    Raises:
        APIError: 400 for more than 16 stop sequences.
    """
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 16:
        raise APIError(400, "stop: at most 16 stop sequences", param="stop")
    return stops


def usage_of(d: JobDone) -> dict[str, Any]:
    """OpenAI ``usage`` of a finished job (chat and completions)."""
    return {
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "total_tokens": d.prompt_tokens + d.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": d.reasoning_tokens},
    }


def shutdown_events() -> list[Any]:
    """The end of a stream whose job a shutdown cancelled: an error event, then
    ``[DONE]`` (a ``finish_reason`` would read as a whole answer)."""
    err = {"message": SHUTDOWN_CANCEL, "type": "server_error", "param": None, "code": None}
    return [{"error": err}, "[DONE]"]


def finish_of(d: JobDone, tools: bool) -> str:
    """OpenAI ``finish_reason``: ``length`` (also for a full context: OpenAI has no
    other word for it), ``tool_calls`` or ``stop``."""
    if d.finish in ("length", "context"):
        return "length"
    return "tool_calls" if tools else "stop"


# --------------------------------------------------------------------------- mapping


def chat_thinking(req: ChatRequest, default_thinking: bool) -> tuple[bool, str | None]:
    """Thinking mode and reasoning effort of a chat request.

    Accepted spellings, later ones winning: OpenAI's ``reasoning_effort`` (``"none"``
    disables, ``"max"``/``"xhigh"`` = Think-Max), ``chat_template_kwargs: {"thinking"|
    "enable_thinking": bool}``, ``think: bool``, DeepSeek's ``thinking: {"type":
    "enabled"|"disabled"}`` (or a bool).

    Raises:
        WireError: an unknown effort word or ``thinking.type``, a ``chat_template_kwargs``
            thinking value that is not a boolean.
    """
    thinking = default_thinking
    forced, effort = effort_to_reasoning(req.reasoning_effort)
    if forced is not None:
        thinking = forced
    kw = req.chat_template_kwargs or {}
    for key in ("thinking", "enable_thinking"):
        if key in kw and not isinstance(kw[key], bool):
            # Ignored, "no" (or "false") would have left thinking on.
            raise WireError(
                f"chat_template_kwargs.{key}: a JSON boolean, got {kw[key]!r}",
                f"chat_template_kwargs.{key}",
            )
        if key in kw:
            thinking = kw[key]
    if req.think is not None:
        thinking = req.think
    th = req.thinking
    if isinstance(th, dict) and "type" in th:
        if th["type"] not in _THINKING_TYPES:
            words = ", ".join(repr(t) for t in _THINKING_TYPES)
            raise WireError(f"thinking.type: {th['type']!r} is not one of {words}", "thinking.type")
        thinking = th["type"] != "disabled"
    elif isinstance(th, bool):
        thinking = th
    return thinking, (effort if thinking else None)


def chat_thinking_budget(req: ChatRequest) -> int | None:
    """``thinking.budget_tokens`` of a chat request (the Anthropic spelling some clients
    send through chat): the most reasoning tokens, or None. No floor here: Anthropic's
    1024 is its own API's rule.

    Raises:
        APIError: 400 for a budget that is not a positive integer.
    """
    th = req.thinking
    if not isinstance(th, dict) or th.get("budget_tokens") is None:
        return None
    budget = th["budget_tokens"]
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise APIError(
            400,
            f"thinking.budget_tokens: a positive integer, got {budget!r}",
            param="thinking.budget_tokens",
        )
    return budget


# DeepSeek's ``thinking.type`` words (and Anthropic's ``adaptive``, which thinks).
_THINKING_TYPES = ("enabled", "disabled", "adaptive")


def _assistant_turn(m: ChatMessage) -> Message:
    calls = [
        ToolCall(id=tc.id, name=tc.function.name, arguments=json_object(tc.function.arguments))
        for tc in m.tool_calls or []
    ]
    reasoning = m.reasoning_content
    if reasoning is None:
        reasoning = getattr(m, "reasoning", None)  # an alias some clients send
    return Message(
        role="assistant",
        content=parts_text(m.content),
        reasoning=reasoning if isinstance(reasoning, str) else None,
        tool_calls=calls,
        prefix=bool(m.prefix),
    )


def _tools(req: ChatRequest) -> list[ToolSpec]:
    if req.tool_choice == "none":
        return []
    return unique_names(
        [
            ToolSpec(
                name=t.function.name,
                description=t.function.description or "",
                parameters=t.function.parameters or empty_schema(),
                background=bool(t.function.async_),
            )
            for t in req.tools or []
            if t.type == "function"
        ]
    )


def _allowed(choice: dict[str, Any], key: str) -> Any:
    """Chat's ``allowed_tools`` field ``key`` (``mode``, ``tools``): inside its
    ``allowed_tools`` object, else at the top of the choice."""
    inner = choice.get("allowed_tools")
    return inner.get(key, choice.get(key)) if isinstance(inner, dict) else choice.get(key)


def to_conversation(req: ChatRequest, *, default_thinking: bool = True) -> Conversation:
    """Map a validated chat request onto a `Conversation`.

    Raises:
        WireError: an invalid ``tool_choice`` (param ``tool_choice…``), two tools of one
            name, an unknown ``reasoning_effort``, a tool message without its call's id,
            the deprecated ``functions``/``function_call``.
    """
    for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
        if (req.model_extra or {}).get(legacy) is not None:
            # Ignored, the model would answer as if no function were offered (or forced).
            raise WireError(
                f"{legacy}: OpenAI's deprecated function calling is not supported; send "
                f"{current} instead",
                legacy,
            )
    system_parts: list[str] = []  # leading system/developer messages: the system prompt
    late: list[str] = []  # later ones: instructions met inside the conversation
    msgs: list[Message] = []
    for i, m in enumerate(req.messages):
        if m.role in ("system", "developer"):
            if msgs:
                system_in_conversation(msgs, late, parts_text(m.content))
            else:
                system_parts.append(parts_text(m.content))
        elif m.role == "user":
            msgs.append(Message(role="user", content=parts_text(m.content)))
        elif m.role == "assistant":
            msgs.append(_assistant_turn(m))
        else:  # tool, function
            tool_id = m.tool_call_id or m.name
            if not tool_id:
                what = "tool_call_id" if m.role == "tool" else "name"
                raise WireError(
                    f"messages[{i}].{what}: required for a {m.role} message (the call it answers)",
                    f"messages.{i}.{what}",
                )
            msgs.append(Message(role="tool", tool_call_id=tool_id, content=parts_text(m.content)))
    tools = _tools(req)
    allowed = allowed_names(req.tool_choice, tools, lambda c: _allowed(c, "tools"))
    thinking, effort = chat_thinking(req, default_thinking)
    required, name = openai_tool_choice(
        req.tool_choice,
        tools,
        named_types=("function",),
        name_field="function.name",
        mode_of=lambda c: _allowed(c, "mode"),
    )
    return Conversation(
        messages=hoisted_system(msgs, system_parts),
        late_system=late_system(late),
        tools=tools,
        thinking=thinking,
        reasoning_effort=effort,
        tool_required=required,
        tool_name=name,
        tool_none=req.tool_choice == "none",
        single_call=req.parallel_tool_calls is False,
        open_reply=True,
        allowed_tools=allowed,
    )


def conversation(req: ChatRequest) -> Conversation:
    """`to_conversation` with the server's model default (400 on a mapping error)."""
    try:
        return demo_policy(to_conversation(req, default_thinking=model_thinking(req.model)))
    except WireError as e:
        raise APIError(400, e.message, param=e.param) from None


# --------------------------------------------------------------------------- encoder


def _chat_logprobs(lps: list[TokenLogprob], tok) -> dict[str, Any]:
    """OpenAI chat ``logprobs`` object of the visible reply's tokens (`logprob_entries`)."""
    return {"content": logprob_entries(lps, tok), "refusal": None}


@dataclass(frozen=True)
class _Dispatch:
    """A streaming tool dispatch event (``event: tool_call_dispatch``, NVIDIA Dynamo's
    shape): ``data`` is ``{"choice_index": 0, "tool_call": {"index", "id", "type",
    "function": {"name", "arguments"}}}``, sent the moment the call's DSML closes."""

    data: dict[str, Any]


class ChatEncoder:
    """Job events → ``chat.completion.chunk`` frames, and (fed everything) the
    ``chat.completion`` object.

    A token's logprob entry rides on the next visible chunk (its text may be held back
    across tokens); what is left goes out with the finish chunk. A tool call cut by the
    end of the turn (``ToolCallEnd.closed`` False) was streamed but is left out of the
    object and does not make the finish reason ``tool_calls``. With ``dispatch``
    (streaming tool dispatch) each call that closes well-formed is also sent whole, at
    its close, as ``event: tool_call_dispatch`` (`_Dispatch`): a client may start it
    while the model writes the next one.
    """

    def __init__(
        self,
        meta: dict[str, Any],
        *,
        thinking: bool,
        include_usage: bool,
        logprobs: bool,
        tokenizer=None,
        dispatch: bool = False,
    ):
        self.meta = meta
        self.dispatch = dispatch
        self.tokenizer = tokenizer  # the ids of logprobs → texts (needed with logprobs)
        self.base = {**meta, "object": "chat.completion.chunk"}
        self.thinking = thinking
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.pending: list[TokenLogprob] = []
        self.all_logprobs: list[TokenLogprob] = []
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self._feed = {
            ThinkingDelta: self._thinking,
            TextDelta: self._text,
            ToolCallStart: self._tool_start,
            ToolCallArgsDelta: self._tool_args,
            ToolCallEnd: self._tool_end,
            TokenLogprob: self._logprob,
        }

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        lp = None
        if self.logprobs and (self.pending or finish) and "reasoning_content" not in delta:
            lp = _chat_logprobs(self.pending, self.tokenizer)
            self.pending = []
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {**self.base, "choices": [choice]}

    def frame(self, ev: dict[str, Any] | str) -> bytes:
        if isinstance(ev, _Dispatch):
            return sse(ev.data, "tool_call_dispatch")
        return sse(ev)

    def opening(self) -> list[Any]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def idle(self) -> None:
        return None

    def started(self, e: JobStarted) -> list[Any]:
        return []

    def feed(self, e: Any) -> list[Any]:
        handler = self._feed.get(type(e))
        return handler(e) if handler is not None else []

    def _thinking(self, e: ThinkingDelta) -> list[Any]:
        self.reasoning.append(e.text)
        return [self._chunk({"reasoning_content": e.text})]

    def _text(self, e: TextDelta) -> list[Any]:
        self.content.append(e.text)
        return [self._chunk({"content": e.text})]

    def _tool_start(self, e: ToolCallStart) -> list[Any]:
        fn = {"name": e.name, "arguments": ""}
        call = {"index": e.index, "id": e.id, "type": "function", "function": fn}
        return [self._chunk({"tool_calls": [call]})]

    def _tool_args(self, e: ToolCallArgsDelta) -> list[Any]:
        return [
            self._chunk({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        ]

    def _tool_end(self, e: ToolCallEnd) -> list[Any]:
        if not e.closed:  # a cut call is left out
            return []
        fn = {"name": e.call.name, "arguments": e.arguments_json}
        self.calls.append({"id": e.call.id, "type": "function", "function": fn})
        if not self.dispatch or e.error:
            return []
        call = {"index": e.index, **self.calls[-1]}
        return [_Dispatch({"choice_index": 0, "tool_call": call})]

    def _logprob(self, e: TokenLogprob) -> list[Any]:
        self.pending.append(e)
        self.all_logprobs.append(e)
        return []

    def done(self, e: JobDone) -> list[Any]:
        if e.finish == "cancelled":
            return shutdown_events()
        self.finish = finish_of(e, bool(self.calls))
        self.usage = usage_of(e)
        out = [self._chunk({}, self.finish)]
        if self.include_usage:
            out.append({**self.base, "choices": [], "usage": self.usage})
        return [*out, "[DONE]"]

    def failed(self, e: JobFailed) -> list[Any]:
        return [openai_error(failed_to_api(e, NAMES)), "[DONE]"]

    def result(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content) if (self.content or not self.calls) else None,
        }
        if self.thinking:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = self.calls
        choice = {
            "index": 0,
            "message": message,
            "logprobs": _chat_logprobs(self.all_logprobs, self.tokenizer)
            if self.logprobs
            else None,
            "finish_reason": self.finish,
        }
        return {
            "id": self.meta["id"],
            "object": "chat.completion",
            "created": self.meta["created"],
            "model": self.meta["model"],
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [choice],
            "usage": self.usage,
        }


# --------------------------------------------------------------------------- route


def _job(
    raw: bytes, path: str, headers, key: str = ""
) -> tuple[ChatRequest, Conversation, GenRequest]:
    """The typed request, its conversation and its job (off the event loop); ``headers``
    (a plain dict of the conversation headers) and the body's ``prompt_cache_key`` name
    its resident state (`state_key`); the body's ``cache_salt`` and ``key`` (the API
    key's `key_salt`) its cache salt (`cache_salt`)."""
    req = parse(ChatRequest, raw)
    if req.top_logprobs is not None and not req.logprobs:
        # OpenAI's answer too: alternatives are only ever sent with ``logprobs: true``.
        raise APIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
    extra = req.model_extra or {}
    wishes = sampling_wishes(req)  # its 400s come before the conversation's
    max_tokens = req.max_completion_tokens or req.max_tokens
    check_min_tokens(req, max_tokens)
    conv = conversation(req)
    gen = prepare(
        conv,
        NAMES,
        path=path,
        max_tokens=max_tokens,
        sampling=sampling_params(conv.thinking, req),
        id_prefix="call_",
        stops=stops_of(req.stop),
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        state_key=state_key(headers, extra.get("prompt_cache_key")),
        salt=cache_salt(extra.get("cache_salt"), key),
        constraint=constraints.read(constraints.chat_constraint, req),
        thinking_budget=chat_thinking_budget(req) if conv.thinking else None,
        wishes=wishes,
        show_format=True,
    )
    return req, conv, gen


@bp.post("/v1/chat/completions")
async def chat_completions():
    """OpenAI Chat Completions (streaming and not). Errors: 400 shapes of OpenAI."""
    headers = {h: request.headers.get(h) for h in STATE_HEADERS}
    req, conv, gen = await offload(
        _job, await read_body(), request.path, headers, key_salt(request.headers)
    )
    st = state()
    job = st.submit(gen)
    meta = {
        "id": new_id("chatcmpl-"),
        "created": now(),
        "model": req.model or st.config.model_name,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }
    enc = ChatEncoder(
        meta,
        thinking=conv.thinking,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        logprobs=bool(req.logprobs),
        tokenizer=st.tokenizer,
        dispatch=bool(req.stream) and (req.tool_call_dispatch or st.config.tool_call_dispatch),
    )
    if req.stream:
        return await stream(job, enc, NAMES)
    return json_response(await respond(job, enc, NAMES))
