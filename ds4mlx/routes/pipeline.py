"""The request pipeline every chat protocol shares, and the one stream driver.

A protocol module maps its typed request onto a neutral ``Conversation`` and hands it
to `prepare`, which does the rest in one place, before the first byte is sent:

1. the tool-result id check (`check_tool_results`: replayed or live, else 400 in the
   protocol's wording, its ``unknown_id``);
2. rendering (`render`: ``dsml.render``, content spans marked);
3. tokenizing off the event loop (`tokenize`: content encodes as plain text);
4. the context check (`context_check`: 400 ``context_length_exceeded``);
5. the `GenRequest` (sampling, clamped ``max_tokens``, the demo cap, stops, tools,
   forced tool choice, the protocol's names for the planner).

The route submits it (``state().submit``) and answers with its protocol's *encoder*
(`Encoder`): the same object encodes the stream (`stream`, `events`) and, fed every
event at once, the non-streaming body (`respond`), so both forms come from one
implementation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from quart import Response

from ds4mlx.dsml import Conversation, Rendered
from ds4mlx.dsml import render as render_conv
from ds4mlx.kv.live import CallerNames, unexplained_tool_ids
from ds4mlx.routes.common import SSE_COMMENT, APIError, failed_to_api, sse_response, state
from ds4mlx.sampling import SamplingParams
from ds4mlx.server.jobs import (
    DEFAULT_MIN_P,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    GenRequest,
    Job,
    JobDone,
    JobFailed,
    JobStarted,
    PrefillProgress,
)

# --------------------------------------------------------------------------- the pipeline


async def prepare(
    conv: Conversation,
    names: CallerNames,
    *,
    unknown_id: Callable[[str], str],
    path: str,
    param: str,
    max_tokens: int | None,
    sampling: SamplingParams,
    id_prefix: str,
    stops: list[str] | None = None,
    top_logprobs: int | None = None,
) -> GenRequest:
    """Check, render, tokenize and size ``conv``; return the job to submit.

    Args:
        conv: the neutral conversation of the request.
        names: the protocol's names for the prompt cache (live-tools decision, id word).
        unknown_id: ``f(tool_id) -> str``: the protocol's 400 text for a tool result
            nothing explains.
        path: the endpoint, for the log line (``/v1/messages``, ``ws /v1/responses``).
        param: the request field holding the prompt (``messages``, ``input``): named by
            the tool-id and context errors.
        max_tokens: the client's output limit (tokens), or None for ``--tokens`` / the
            context left.
        sampling: from `sampling_params`.
        id_prefix: prefix of new tool-call ids (``toolu_``, ``call_``).
        stops: stop strings.
        top_logprobs: chat ``logprobs``: None (off) or alternatives per token.
    Raises:
        APIError: 400 for an unexplained tool-result id, a conversation that cannot be
            rendered, or a prompt that leaves no room in the context.
    """
    check_tool_results(conv, unknown_id, param)
    rendered = render(conv)
    toks = await tokenize(rendered)
    context_check(len(toks), param)
    return GenRequest(
        path=path,
        prompt_tokens=toks,
        prompt_text=rendered,
        sampling=sampling,
        max_tokens=clamp_max_tokens(max_tokens, len(toks)),
        cap_is_eos=demo_cap_ends_turn(max_tokens, len(toks)),
        stops=list(stops or []),
        thinking=conv.thinking,
        tools=conv.tools,
        id_prefix=id_prefix,
        conversation=conv,
        protocol=names,
        tool_required=conv.tool_required,
        tool_name=conv.tool_name,
        top_logprobs=top_logprobs,
    )


# --------------------------------------------------------------------------- steps


def context_check(n_prompt: int, param: str = "messages") -> None:
    """Reject a prompt that leaves no room to generate (before queueing).

    ``param``: the request field holding the prompt (``messages``, ``input``, ``prompt``).

    Raises:
        APIError: 400 ``context_length_exceeded`` with the counts in the message and as
            the error's ``n_prompt_tokens`` / ``n_ctx`` fields.
    """
    ctx = state().ctx_size
    if n_prompt >= ctx:
        raise APIError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, your prompt "
            f"resulted in {n_prompt} tokens, leaving no room for output. Shorten the "
            "conversation or restart the server with a larger --ctx.",
            code="context_length_exceeded",
            param=param,
            fields={"n_prompt_tokens": n_prompt, "n_ctx": ctx},
        )


def clamp_max_tokens(requested: int | None, n_prompt: int) -> int:
    """Output limit: the request's (or ``--tokens``) capped by the context left
    (and by ``--demo``'s per-request cap).

    A limit beyond the context is not an error (docs/ARCHITECTURE.md §6): generation stops when
    the context is full and reports ``length`` / ``max_tokens``.
    """
    st = state()
    room = st.ctx_size - n_prompt
    want = requested if requested is not None else st.config.default_max_tokens
    cap = st.config.max_tokens_cap
    if cap is not None:
        want = cap if want is None else min(int(want), cap)
    if want is None:
        return max(1, room)
    return max(1, min(int(want), room))


def demo_cap_ends_turn(requested: int | None, n_prompt: int) -> bool:
    """True when ``--demo``'s per-request cap, not the request's own limit (nor
    ``--tokens`` for a request that sets none, nor the context), bounds the output.

    The demo model is noise and never samples EOS: the cap stands in for its EOS, so a
    turn that reaches it ends as a natural end of turn (``end_turn`` / ``stop`` /
    ``completed``), not ``max_tokens`` (Claude Code retries those and then fails).
    Real models (no cap) are unaffected.
    """
    st = state()
    cap = st.config.max_tokens_cap
    if cap is None or not st.config.demo_policy:
        return False  # no cap, or --tokens chose a real output limit
    room = st.ctx_size - n_prompt
    if requested is not None:
        return cap < min(int(requested), room)
    default = st.config.default_max_tokens
    return cap < room and (default is None or cap <= default)


def demo_policy(conv: Conversation) -> Conversation:
    """``serve --demo`` without ``--tokens``: ``conv`` runs without thinking.

    The noise model would spend the whole demo cap inside its reasoning, and a client
    (Claude Code turns thinking on) would show nothing: in chat mode every token of the
    cap is visible text. Real models and ``--demo --tokens N`` are unaffected. Returns
    ``conv`` (changed in place).
    """
    if state().config.demo_policy:
        conv.thinking = False
        conv.reasoning_effort = None
    return conv


def sampling_params(thinking: bool, req: Any) -> SamplingParams:
    """``SamplingParams`` for a request (docs/ARCHITECTURE.md §6).

    ``req``: the validated pydantic request; its ``temperature``, ``top_p``, ``top_k``,
    ``min_p`` and ``seed`` are read where the protocol declares them (else the default).
    Thinking mode ignores the client's knobs, as DeepSeek's API does: temperature 1,
    top_p 1, min_p 0.05. Otherwise the client's values with those defaults; top_k
    ``-1`` (vLLM's "off") is 0; a temperature below 1e-4 is greedy. ``seed`` is any
    int (taken modulo 2**64).
    """
    # Declared (validated) fields only: tolerated unknown fields are never read.
    declared = type(req).model_fields
    temperature, top_p, top_k, min_p, seed = (
        getattr(req, k) if k in declared else None
        for k in ("temperature", "top_p", "top_k", "min_p", "seed")
    )
    if seed is not None:
        seed = int(seed) % 2**64  # MLX keys take an unsigned 64-bit seed
    if thinking:
        return SamplingParams(DEFAULT_TEMPERATURE, DEFAULT_TOP_P, 0, DEFAULT_MIN_P, seed)
    if temperature is not None and temperature < 1e-4:
        temperature = 0.0  # 1/T would overflow the logits: this is greedy
    return SamplingParams(
        DEFAULT_TEMPERATURE if temperature is None else float(temperature),
        DEFAULT_TOP_P if top_p is None else float(top_p),
        0 if top_k is None or top_k < 0 else int(top_k),
        DEFAULT_MIN_P if min_p is None else float(min_p),
        seed,
    )


async def tokenize(text: Rendered | str) -> list[int]:
    """Tokenize off the event loop (long prompts take tens of milliseconds).

    ``text``: a rendered conversation (``ds4mlx.dsml.Rendered``: its content is plain
    text, only the renderer's markers are special tokens), or a raw ``str`` (raw
    endpoints: special-token spellings are recognized, users write templates there).
    """
    tok = state().tokenizer
    if isinstance(text, str):
        return await asyncio.to_thread(tok.encode, text)
    return await asyncio.to_thread(lambda: tok.encode(text.text, content=text.content))


def check_tool_results(conv: Conversation, unknown_id: Callable[[str], str], param: str) -> None:
    """Reject tool results whose ids nothing explains, before the job is queued.

    A tool result must answer a call the request replays (an assistant turn with that
    id), or the trailing results must answer exactly the calls the live state just
    sampled (docs/ARCHITECTURE.md §3). The worker checks again when the job runs (the
    live state may change while it waits) and then fails it with the same 400.

    Args:
        conv: the request's ``Conversation``.
        unknown_id: ``f(tool_id) -> str``, the protocol's wording.
        param: the request field holding the history (``messages``, ``input``).
    Raises:
        APIError: 400 with ``unknown_id(id)`` (e.g. ``unknown tool_use_id …;
            replay the full messages history``).
    """
    kv = getattr(state(), "kv", None)
    bound = kv.bound_tool_ids() if kv is not None else frozenset()
    bad = unexplained_tool_ids(conv, bound)
    if bad:
        raise APIError(400, unknown_id(bad[0]), param=param)


def render(conv: Conversation) -> Rendered:
    """Render ``conv`` with the server's context size and tool memory (400 on errors).

    Returns a ``ds4mlx.dsml.Rendered`` (text + content spans, for `tokenize`).
    """
    st = state()
    try:
        return render_conv(conv, context_size=st.ctx_size, tool_memory=st.tool_memory)
    except (ValueError, TypeError, RecursionError) as e:
        raise APIError(400, f"cannot render the conversation: {e}") from None


# --------------------------------------------------------------------------- encoders


class Encoder(Protocol):
    """One protocol's encoding of a job's events, for streaming and non-streaming alike.

    Each method returns the protocol's wire events (dicts, or a str such as chat's
    ``"[DONE]"``) in order; `frame` turns one into SSE bytes. After `done` (or
    `failed`), `result` is the non-streaming body.
    """

    def opening(self) -> list[Any]:
        """Events sent before any job event (e.g. chat's role chunk)."""
        ...

    def idle(self) -> Any:
        """The keepalive to send after ``keepalive_s`` idle seconds (None: a comment)."""
        ...

    def started(self, e: JobStarted) -> list[Any]: ...

    def feed(self, e: Any) -> list[Any]:
        """Events for one decoder/job event (empty when it has no wire form)."""
        ...

    def done(self, e: JobDone) -> list[Any]: ...

    def failed(self, e: JobFailed) -> list[Any]: ...

    def result(self) -> dict[str, Any]:
        """The non-streaming response body (after `done`)."""
        ...

    def frame(self, ev: Any) -> bytes:
        """One wire event as SSE bytes."""
        ...


class Keepalive:
    """Decides when a stream sends a keepalive (idle for ``every`` seconds)."""

    def __init__(self, every: float):
        self.every = every
        self.last = time.monotonic()

    def sent(self) -> None:
        self.last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.every


async def events(
    job: Job, enc: Encoder, keepalive_s: float, *, probe: bool = False
) -> AsyncIterator[Any]:
    """The wire events of ``job`` through ``enc``, keepalives included (None = a
    comment), ending after the job's `JobDone` / `JobFailed`.

    A keepalive goes out when nothing was sent for ``keepalive_s`` seconds while the
    job waits in the queue or prefills (and at a `JobStarted` that has no wire form).

    With ``probe`` (HTTP streams), every `PrefillProgress` between two prefill chunks
    (at most every 0.5 s) also sends a comment, which does not count as a keepalive. A
    write is the only check of a client whose connection the server no longer reads:
    Hypercorn stops reading an HTTP/1.1 connection once the client has sent bytes past
    its request (a pipelined request, a stray CRLF) until the response ends, so such a
    client's close is seen only when a write fails. The probe makes that the next
    prefill chunk instead of the next keepalive or token; the job's cancel flag is
    checked before every chunk.
    """
    ka = Keepalive(keepalive_s)
    for ev in enc.opening():
        ka.sent()
        yield ev
    async for e in job.events(keepalive_s):
        final = isinstance(e, JobDone | JobFailed)
        out = _dispatch(enc, e)
        if out:
            ka.sent()
        elif isinstance(e, JobStarted | PrefillProgress) or e is None:
            if ka.due():
                ka.sent()
                out = [enc.idle()]
            elif probe and isinstance(e, PrefillProgress) and 0 < e.done < e.total:
                out = [None]
        for ev in out:
            yield ev
        if final:
            return


def _dispatch(enc: Encoder, e: Any) -> list[Any]:
    if e is None or isinstance(e, PrefillProgress):
        return []
    if isinstance(e, JobStarted):
        return enc.started(e)
    if isinstance(e, JobDone):
        return enc.done(e)
    if isinstance(e, JobFailed):
        return enc.failed(e)
    return enc.feed(e)


def stream(job: Job, enc: Encoder) -> Response:
    """The SSE response of ``job`` encoded by ``enc``; a client that goes away cancels
    the job."""
    keepalive_s = state().config.keepalive_s

    async def frames() -> AsyncIterator[bytes]:
        # Runs outside the app context (Quart streams bodies after the handler returned).
        async for ev in events(job, enc, keepalive_s, probe=True):
            yield SSE_COMMENT if ev is None else enc.frame(ev)

    return sse_response(guard(job, frames()))


async def respond(job: Job, enc: Encoder) -> dict[str, Any]:
    """The non-streaming body of ``job``: every event through ``enc``, then its result.

    Raises:
        APIError: the job failed (its status), or it was cancelled by a shutdown (503).
    """
    evs, done = await collect(job)
    for e in evs:
        _dispatch(enc, e)
    enc.done(done)
    if done.finish == "cancelled":
        raise APIError(503, "generation cancelled (server shutting down)", type="server_error")
    return enc.result()


async def collect(job) -> tuple[list[Any], Any]:
    """Drain a job for a non-streaming response: ``(events, JobDone)``.

    Cancels the job if the handler is cancelled (client gone).

    Raises:
        APIError: the job failed.
    """
    seen: list[Any] = []
    try:
        async for ev in job.events():
            if isinstance(ev, JobFailed):
                raise failed_to_api(ev)
            if isinstance(ev, JobDone):
                return seen, ev
            seen.append(ev)
    finally:
        if not job.done:
            job.cancel.set()
    raise APIError(500, "job ended without a result", type="server_error")  # pragma: no cover


async def guard(job, gen: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Wrap a streaming generator so that a client disconnect cancels ``job``."""
    try:
        async for chunk in gen:
            yield chunk
    finally:
        if not job.done:
            job.cancel.set()
