"""OpenAI Chat Completions and (legacy) Completions.

- ``POST /v1/chat/completions`` — https://platform.openai.com/docs/api-reference/chat/create
  (plus DeepSeek's ``reasoning_content`` and ``thinking`` extensions,
  https://api-docs.deepseek.com/guides/thinking_mode).
- ``POST /v1/completions`` — https://platform.openai.com/docs/api-reference/completions/create
  (prompt as text or token ids, ``logprobs`` top-N, ``echo``).

Streaming uses ``chat.completion.chunk`` / ``text_completion`` SSE frames ending with
``data: [DONE]``; reasoning streams as ``delta.reasoning_content``; tool calls stream
as a header (id, name) then argument deltas as soon as the DSML is recognized.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
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
    now,
    parse_body,
    render,
    sampling_params,
    sse,
    sse_response,
    state,
    tokenize,
)
from ds4mlx.server.jobs import (
    GenRequest,
    JobDone,
    JobFailed,
    JobStarted,
    PrefillProgress,
    RawText,
    TokenLogprob,
)

bp = Blueprint("openai", __name__)

SYSTEM_FINGERPRINT = "ds4mlx"


# --------------------------------------------------------------------------- schemas


class ContentPart(OpenModel):
    type: str
    text: str | None = None


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


class FunctionDef(OpenModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


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


class ChatRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions`` (unknown fields tolerated)."""

    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    thinking: dict[str, Any] | bool | None = None
    think: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions`` (unknown fields tolerated)."""

    model: str = ""
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=1)


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 16:
        raise APIError(400, "stop: at most 16 stop sequences", param="stop")
    return stops


def _usage(d: JobDone) -> dict[str, Any]:
    return {
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "total_tokens": d.prompt_tokens + d.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": d.reasoning_tokens},
    }


def _finish(d: JobDone, tools: bool) -> str:
    if d.finish == "length":
        return "length"
    if tools:
        return "tool_calls"
    return "stop"


# --------------------------------------------------------------------------- chat


@bp.post("/v1/chat/completions")
async def chat_completions():
    """OpenAI Chat Completions (streaming and not). Errors: 400 shapes of OpenAI."""
    req, body = await parse_body(ChatRequest)
    st = state()
    try:
        conv = wire.openai_chat_to_conversation(body, default_thinking=model_thinking(req.model))
    except wire.WireError as e:
        raise APIError(400, e.message, param=e.param) from None
    demo_policy(conv)
    check_tool_results(conv, "chat")
    text = render(conv)
    toks = await tokenize(text)
    context_check(len(toks))
    requested = req.max_completion_tokens or req.max_tokens
    max_tokens = clamp_max_tokens(requested, len(toks))
    gen = GenRequest(
        path=request.path,
        prompt_tokens=toks,
        prompt_text=text,
        sampling=sampling_params(
            conv.thinking,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
        ),
        max_tokens=max_tokens,
        cap_is_eos=demo_cap_ends_turn(requested, len(toks)),
        stops=_stops(req.stop),
        thinking=conv.thinking,
        tools=conv.tools,
        id_prefix="call_",
        conversation=conv,
        protocol="chat",
        tool_required=conv.tool_required,
        tool_name=conv.tool_name,
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
    )
    job = st.submit(gen)
    meta = {
        "id": new_id("chatcmpl-"),
        "created": now(),
        "model": req.model or st.config.model_name,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return sse_response(
            guard(
                job,
                _chat_stream(job, meta, include_usage, st.config.keepalive_s, bool(req.logprobs)),
            )
        )
    events, done = await collect(job)
    if done.finish == "cancelled":
        raise APIError(503, "generation cancelled (server shutting down)", type="server_error")
    reasoning, content, calls = [], [], []
    lps = [ev for ev in events if isinstance(ev, TokenLogprob)]
    for ev in events:
        if isinstance(ev, ThinkingDelta):
            reasoning.append(ev.text)
        elif isinstance(ev, TextDelta):
            content.append(ev.text)
        elif isinstance(ev, ToolCallEnd):
            calls.append(
                {
                    "id": ev.call.id,
                    "type": "function",
                    "function": {"name": ev.call.name, "arguments": ev.arguments_json},
                }
            )
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(content) if (content or not calls) else None,
    }
    if conv.thinking:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return json_response(
        {
            **{k: meta[k] for k in ("id",)},
            "object": "chat.completion",
            "created": meta["created"],
            "model": meta["model"],
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": _chat_logprobs(lps) if req.logprobs else None,
                    "finish_reason": _finish(done, bool(calls)),
                }
            ],
            "usage": _usage(done),
        }
    )


def _chat_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI chat ``logprobs`` object of the visible reply's tokens."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.bytes),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(b)} for t, lp, b in e.top
                ],
            }
            for e in lps
        ],
        "refusal": None,
    }


async def _chat_stream(
    job, meta: dict[str, Any], include_usage: bool, keepalive_s: float, logprobs: bool = False
):
    base = {**meta, "object": "chat.completion.chunk"}
    pending_lp: list[TokenLogprob] = []

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        lp = None
        if logprobs and (pending_lp or finish) and "reasoning_content" not in delta:
            # A token's entry rides on the next visible chunk (its text may be held
            # back across tokens); what is left goes out with the finish chunk.
            lp = _chat_logprobs(pending_lp)
            pending_lp.clear()
        return sse(
            {
                **base,
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}],
            }
        )

    ka = Keepalive(keepalive_s)
    yield chunk({"role": "assistant", "content": ""})
    ka.sent()
    saw_tools = False
    async for ev in job.events(keepalive_s):
        if ev is None or isinstance(ev, PrefillProgress | JobStarted):
            if ka.due():
                ka.sent()
                yield SSE_COMMENT
            continue
        if isinstance(ev, ThinkingDelta):
            out = chunk({"reasoning_content": ev.text})
        elif isinstance(ev, TextDelta):
            out = chunk({"content": ev.text})
        elif isinstance(ev, ToolCallStart):
            saw_tools = True
            out = chunk(
                {
                    "tool_calls": [
                        {
                            "index": ev.index,
                            "id": ev.id,
                            "type": "function",
                            "function": {"name": ev.name, "arguments": ""},
                        }
                    ]
                }
            )
        elif isinstance(ev, ToolCallArgsDelta):
            out = chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]})
        elif isinstance(ev, TokenLogprob):
            pending_lp.append(ev)
            continue
        elif isinstance(ev, ToolCallEnd | ParseError):
            continue
        elif isinstance(ev, JobFailed):
            yield sse(error_body("openai", failed_to_api(ev)))
            yield sse("[DONE]")
            return
        elif isinstance(ev, JobDone):
            if ev.finish == "cancelled":
                yield sse(
                    {
                        "error": {
                            "message": "generation cancelled",
                            "type": "server_error",
                            "param": None,
                            "code": None,
                        }
                    }
                )
                yield sse("[DONE]")
                return
            yield chunk({}, _finish(ev, saw_tools))
            if include_usage:
                yield sse({**base, "choices": [], "usage": _usage(ev)})
            yield sse("[DONE]")
            return
        else:
            continue
        ka.sent()
        yield out


# --------------------------------------------------------------------------- completions


@bp.post("/v1/completions")
async def completions():
    """OpenAI legacy Completions: raw text continuation (no chat template).

    A text prompt gets BOS prepended unless it starts with it; token-id prompts are
    used as given. ``echo`` prepends the prompt text; ``logprobs`` (0–20) returns the
    sampled tokens' logprobs with that many alternatives. With ``echo`` the prompt's
    tokens are listed too, with null logprobs (scoring them would need a prefill that
    keeps every position's logits; OpenAI itself gives null for the first token).
    """
    from ds4mlx.dsml.tokens import BOS

    req, _ = await parse_body(CompletionRequest)
    st = state()
    tok = st.tokenizer
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], list | str):
        if len(p) != 1:
            raise APIError(400, "prompt: only one prompt per request is supported", param="prompt")
        p = p[0]
    if isinstance(p, str):
        text = p if p.startswith(BOS) else BOS + p
        toks = await tokenize(text)
        echo_text = p
        echo_ids = toks if p.startswith(BOS) else toks[1:]
    else:
        toks = list(p)
        bad = [t for t in toks if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(
                400,
                f"prompt: token id {bad[0]} outside the vocabulary (0..{tok.vocab_size - 1})",
                param="prompt",
            )
        if not toks:
            raise APIError(400, "prompt: empty", param="prompt")
        text = None
        echo_text = tok.decode(toks)
        echo_ids = toks
    context_check(len(toks), "prompt")
    model_thinking(req.model)  # logs a model name the server does not list
    gen = GenRequest(
        path=request.path,
        prompt_tokens=toks,
        prompt_text=text,
        sampling=sampling_params(
            False,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
        ),
        max_tokens=clamp_max_tokens(
            req.max_tokens if req.max_tokens is not None else 16, len(toks)
        ),
        cap_is_eos=demo_cap_ends_turn(
            req.max_tokens if req.max_tokens is not None else 16, len(toks)
        ),
        stops=_stops(req.stop),
        parse=False,
        thinking=False,
        logprobs=req.logprobs,
        protocol="completions",
    )
    job = st.submit(gen)
    meta = {
        "id": new_id("cmpl-"),
        "object": "text_completion",
        "created": now(),
        "model": req.model or st.config.model_name,
    }
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return sse_response(
            guard(
                job,
                _completion_stream(
                    job,
                    meta,
                    echo_text if req.echo else "",
                    req.logprobs,
                    _echo_logprobs(tok, echo_ids)
                    if req.echo and req.logprobs is not None
                    else None,
                    include_usage,
                    st.config.keepalive_s,
                ),
            )
        )
    events, done = await collect(job)
    if done.finish == "cancelled":
        raise APIError(503, "generation cancelled (server shutting down)", type="server_error")
    pieces = [ev for ev in events if isinstance(ev, RawText)]
    out = (echo_text if req.echo else "") + "".join(ev.text for ev in pieces)
    lp = (
        _logprobs_obj(pieces, len(echo_text) if req.echo else 0)
        if req.logprobs is not None
        else None
    )
    if lp is not None and req.echo:
        head = _echo_logprobs(tok, echo_ids)
        lp = {k: head[k] + lp[k] for k in lp}
    return json_response(
        {
            **meta,
            "choices": [
                {"text": out, "index": 0, "logprobs": lp, "finish_reason": _finish(done, False)}
            ],
            "usage": _usage(done),
        }
    )


def _echo_logprobs(tok, ids: list[int]) -> dict[str, Any]:
    """``logprobs`` entries of echoed prompt tokens: their texts, null logprobs."""
    tokens, offsets, offset = [], [], 0
    for t in ids:
        piece = tok.decode([t])
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
    n = len(tokens)
    return {
        "tokens": tokens,
        "token_logprobs": [None] * n,
        "top_logprobs": [None] * n,
        "text_offset": offsets,
    }


def _logprobs_obj(pieces: list[RawText], offset: int) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for ev in pieces:
        for text, lp, top in ev.logprobs:
            tokens.append(text)
            token_lps.append(lp)
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


async def _completion_stream(
    job,
    meta,
    echo: str,
    logprobs: int | None,
    echo_lp: dict[str, Any] | None,
    include_usage: bool,
    keepalive_s: float,
):
    ka = Keepalive(keepalive_s)
    offset = len(echo)

    def chunk(text: str, lp=None, finish=None) -> bytes:
        return sse(
            {
                **meta,
                "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}],
            }
        )

    if echo:
        yield chunk(echo, echo_lp)
        ka.sent()
    async for ev in job.events(keepalive_s):
        if ev is None or isinstance(ev, PrefillProgress | JobStarted):
            if ka.due():
                ka.sent()
                yield SSE_COMMENT
            continue
        if isinstance(ev, RawText):
            lp = _logprobs_obj([ev], offset) if logprobs is not None else None
            offset += (
                sum(len(t) for t, _, _ in ev.logprobs) if logprobs is not None else len(ev.text)
            )
            ka.sent()
            yield chunk(ev.text, lp)
        elif isinstance(ev, JobFailed):
            yield sse(error_body("openai", failed_to_api(ev)))
            yield sse("[DONE]")
            return
        elif isinstance(ev, JobDone):
            yield chunk("", None, _finish(ev, False))
            if include_usage:
                yield sse({**meta, "choices": [], "usage": _usage(ev)})
            yield sse("[DONE]")
            return
