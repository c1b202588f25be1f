"""The request pipeline every chat protocol shares, and the one stream driver.

A protocol module reads the body (`ds4mlx.routes.body`), maps its typed request onto a
neutral ``Conversation`` and hands it to `prepare`; all of that runs off the event loop
(``body.offload``). `prepare`:

1. renders (`render`: ``dsml.render``, content spans marked; 400 on a render error);
2. applies the early context bound (`bound`): a rendering longer than ``ctx ×``
   `MAX_TOKEN_CHARS` characters cannot fit and is refused before any tokenizing; a
   rendering longer than ``ctx × 4`` characters has its tokens counted up to ``ctx``
   (in pieces, the GIL released) and is refused once they reach it;
3. builds the `GenRequest`: the engine's ``TurnSpec`` (sampling, the output limit and
   the demo cap, stops, tools, forced tool choice, the id prefix), the rendering, the
   conversation and the protocol's live labels.

The prompt's ids are not made here (a long one is only counted, up to the context): the
worker tokenizes what the plan needs (a live continuation only its suffix) and makes the
exact context check on the planned prompt, and the unknown
tool-id check is the prompt cache's. Their neutral failures come back as the job's
first event: `start` waits for it briefly, so a stream still answers them with the
protocol's 4xx before its first byte.

The route submits the request (``state().submit``) and answers with its protocol's
*encoder* (`Encoder`): the same object encodes the stream (`stream`, `events`) and, fed
every event at once, the non-streaming body (`respond`), so both forms come from one
implementation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol, TypeVar

from quart import Response

from ds4mlx.dsml import JSON_OBJECT, Conversation, Rendered, reply_thinking
from ds4mlx.dsml import render as render_conv
from ds4mlx.jobs import (
    ConstraintError,
    GenRequest,
    Grammar,
    Job,
    JobDone,
    JobFailed,
    JobStarted,
    OutputConstraint,
    PrefillProgress,
    TurnSpec,
    start_compile,
)
from ds4mlx.routes.body import defer
from ds4mlx.routes.common import state
from ds4mlx.routes.errors import APIError, Wording, context_error, failed_to_api
from ds4mlx.routes.mapping import take_unsupported
from ds4mlx.routes.sse import SSE_COMMENT, sse_response
from ds4mlx.sampling import DEFAULT_MIN_P, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, SamplingParams

# What a cancelled job tells a client still reading it: only a shutdown cancels the job of
# a client that is there (a client that went away reads nothing). A client can then tell
# it from a failure and retry once the server is back.
SHUTDOWN_CANCEL = "generation cancelled (server shutting down)"

T = TypeVar("T")

# The longest token of the DeepSeek V4 vocabulary, in characters: 128 (id 70676, a run
# of 128 "." — measured by decoding every id of the package tokenizer). A text of more
# than ctx × 128 characters is more than ctx tokens, whatever it holds.
MAX_TOKEN_CHARS = 128
# `bound` counts the tokens of a rendering longer than ctx × this many characters. Below
# it a prompt that does not fit costs the worker the tokenizing of at most that many
# characters (the GIL released), and a live continuation never tokenizes what it keeps:
# counting every long prompt here would tokenize a long conversation's whole prompt again
# at each turn (Claude Code's are ~100k characters).
COUNT_ABOVE_CHARS_PER_TOKEN = 4

# --------------------------------------------------------------------------- the pipeline


def _log_unsupported(path: str) -> None:
    """One log line naming the content parts the model will not see (placeholders)."""
    from collections import Counter

    parts = take_unsupported()
    kinds = Counter(kind for kind, _ in parts)
    if kinds:
        named = ", ".join(f"{k}×{n}" if n > 1 else k for k, n in kinds.items())
        shown = ", ".join(dict.fromkeys(text for _, text in parts))
        logging.getLogger("ds4mlx.server").info(
            "%s: unsupported content parts %s: the model sees only %s in their place",
            path, named, shown,
        )  # fmt: skip


def tell_format(conv: Conversation, constraint: OutputConstraint | None) -> None:
    """Tell the model ``constraint``'s JSON schema, or that the reply is a JSON object, in
    its system block (``Conversation.response_format``), as DeepSeek's conversion of an
    OpenAI request renders it; the grammar enforces it either way. Nothing without one."""
    if constraint is not None:
        obj = JSON_OBJECT if constraint.json_object else None
        conv.response_format = constraint.schema or obj


def prepare(
    conv: Conversation,
    wording: Wording,
    *,
    path: str,
    max_tokens: int | None,
    sampling: SamplingParams,
    id_prefix: str,
    stops: list[str] | None = None,
    top_logprobs: int | None = None,
    state_key: str | None = None,
    salt: str = "",
    side: bool = False,
    constraint: OutputConstraint | None = None,
    count_only: bool = False,
    thinking_budget: int | None = None,
    wishes: Mapping[str, Any] | None = None,
    show_format: bool = False,
) -> GenRequest:
    """Render and bound ``conv``; return the job to submit (call off the event loop).

    Args:
        conv: the neutral conversation of the request.
        wording: the protocol's `Wording` (the prompt's field, its live labels).
        path: the endpoint, for the log line (``/v1/messages``, ``ws /v1/responses``).
        max_tokens: the client's output limit (tokens), or None for ``--tokens`` / the
            context left.
        sampling: from `sampling_params`.
        id_prefix: prefix of new tool-call ids (``toolu_``, ``call_``).
        stops: stop strings.
        top_logprobs: chat ``logprobs`` / Responses' logprobs include: None (off) or
            alternatives per token.
        state_key: the client's conversation name (`ds4mlx.routes.common.state_key`).
        salt: the prompt cache salt (`ds4mlx.routes.common.cache_salt`).
        side: the client marked it a side request (`ds4mlx.routes.common.helper_agent`).
        constraint: structured output / strict or custom tools to enforce (`grammar`).
        count_only: the job is only counted (``count_tokens``), never run: a prompt the
            context cannot hold is counted, not refused (a client counts to learn that).
        thinking_budget: the most reasoning tokens (Anthropic's ``budget_tokens``), or
            None.
        wishes: the request's other `GenRequest` fields (``logit_bias``, penalties:
            ``ds4mlx.routes.openai.sampling_wishes``), or None for their defaults.
        show_format: the model is also told ``constraint``'s JSON schema or JSON object
            in its system block (``Conversation.response_format``), as DeepSeek's
            conversion of the OpenAI protocols renders it (not of Anthropic's).
    Raises:
        APIError: 400 for a conversation that cannot be rendered, a rendering the
            context cannot hold (`bound`), a constraint that cannot be enforced.
    """
    _log_unsupported(path)
    if show_format:
        tell_format(conv, constraint)
    rendered = render(conv)
    if not count_only:
        bound(rendered.text, wording.param)
    limit, cap_is_eos = turn_limit(max_tokens)
    turn = TurnSpec(
        sampling=sampling,
        max_tokens=limit,
        # A continued assistant message (prefix) with content: the reply is visible text.
        thinking=reply_thinking(conv),
        tools=(*conv.tools, *conv.loaded_tools),
        id_prefix=id_prefix,
        stops=tuple(stops or ()),
        tool_required=conv.tool_required,
        tool_name=conv.tool_name,
        calls=not conv.tool_none,
        parallel_calls=not conv.single_call,
        top_logprobs=top_logprobs,
        # A JSON reply cut by the demo cap is incomplete, never a natural end; a free
        # reply beside strict or custom tools (Codex's apply_patch) ends as without them.
        cap_is_eos=cap_is_eos and not (constraint and constraint.shapes_reply()),
        thinking_budget=thinking_budget,
    )
    gen = GenRequest(
        path=path,
        turn=turn,
        prompt=rendered,
        conversation=conv,
        labels=wording.labels,
        state_key=state_key,
        salt=salt,
        side=side,
        **(wishes or {}),
    )
    if not count_only:  # a count needs no grammar: the prompt is the same without it
        check_end_ban(
            gen, constraint is not None or conv.tool_required or conv.allowed_tools is not None
        )
        constrain(conv, constraint, gen.set_grammar)
    return gen


def check_end_ban(gen: GenRequest, constrained: bool) -> None:
    """Refuse ``min_tokens`` / ``ignore_eos`` beside a grammar: where the grammar lets the
    reply end, EOS is the only token it allows, and a ban on EOS would leave the step
    nothing to sample.

    Raises:
        APIError: 400 naming ``min_tokens`` or ``ignore_eos``.
    """
    if not constrained or not (gen.min_tokens or gen.ignore_eos):
        return
    param = "ignore_eos" if gen.ignore_eos else "min_tokens"
    raise APIError(
        400,
        f"{param}: cannot be combined with a structured output, strict tools or a required "
        "tool call (the grammar ends the reply with EOS)",
        param=param,
    )


# --------------------------------------------------------------------------- steps


def constrain(
    conv: Conversation | None,
    constraint: OutputConstraint | None,
    put: Callable[[Grammar | None], None],
) -> None:
    """Compile the engine grammar enforcing ``constraint`` on ``conv``'s reply (None: a
    raw completion, no tools) and hand it to ``put`` (nothing for no constraint, unless
    ``conv.allowed_tools`` limits the calls or a call is required: the tool-call grammar
    is then the only constraint).

    The compile runs on the bounded compile threads (``ds4mlx.jobs.COMPILE_THREADS``),
    never on the request-parsing pool: under `offload` it is awaited on the event loop
    after the body function returns (`defer`), so a plain request's parsing never waits
    on a client's slow schema; elsewhere it is waited for here. A compile that finds
    every compile thread busy waits its turn within its own ``--grammar-compile-ms``.

    Raises:
        APIError: 400 ``unsupported_constraint`` naming what cannot be enforced (or took
            longer than ``--grammar-compile-ms`` to compile) and its field path; 429
            ``grammar_compilers_busy`` when no compile thread came free within the
            limit (retry). Nothing is queued either way.
    """
    allowed = conv.allowed_tools if conv else None
    required = conv is not None and conv.tool_required and not conv.tool_none
    if constraint is None and conv is not None and (allowed is not None or required):
        # Every tool is rendered (a stable prompt): only the grammar keeps the calls to
        # the client's list, and makes a required call a well-formed one (the loop only
        # forces the block's opener; a block the model then left malformed was dropped
        # and the reply had no call).
        constraint = OutputConstraint(parallel=not conv.single_call)
    if constraint is None:
        return
    st = state()
    ticket = start_compile(
        constraint,
        tools=list(conv.tools) if conv else [],
        calls=conv is not None and not conv.tool_none,
        required=required,
        tool_name=conv.tool_name if conv else None,
        allowed=allowed,
        tokenizer=st.tokenizer,
        param="tools",
        limit_ms=st.config.grammar_compile_ms,
    )

    async def finish() -> None:
        left = max(0.0, ticket.deadline - time.monotonic())
        try:
            gram = await asyncio.wait_for(asyncio.wrap_future(ticket.future), left)
        except TimeoutError:
            raise _constraint_api_error(ticket.expired()) from None
        except ConstraintError as e:
            raise _constraint_api_error(e) from e
        put(gram)

    if defer(finish, ticket.future.cancel):
        return
    try:
        put(ticket.wait())
    except ConstraintError as e:
        raise _constraint_api_error(e) from e


def _constraint_api_error(e: ConstraintError) -> APIError:
    text = f"{e.param}: {e.message}" if e.param else e.message
    if e.busy:
        return APIError(429, text, param=e.param or None, code="grammar_compilers_busy")
    return APIError(400, text, param=e.param or None, code="unsupported_constraint")


def bound(text: str, param: str, room: int = 1) -> None:
    """Refuse a prompt text that cannot fit the context with ``room`` tokens after it
    (0: a scored prompt that generates nothing), before it is queued.

    First without tokenizing: more than ``ctx ×`` `MAX_TOKEN_CHARS` characters is more
    than ``ctx`` tokens. Then, for a text longer than ``ctx ×``
    `COUNT_ABOVE_CHARS_PER_TOKEN` characters (the worker's exact check catches the
    rest), its tokens are counted up to the context (``Tokenizer.count``: in pieces, the GIL released, so the
    event loop answers meanwhile; it stops once past ``ctx``, so a prompt of millions of
    tokens costs the tokenizing of ``ctx`` of them). Not in the body-vetting child, which
    has no tokenizer: there only the character bound applies.

    Raises:
        APIError: 400 ``context_length_exceeded`` naming a lower bound of its tokens.
    """
    st = state()
    ctx = st.ctx_size
    if len(text) > ctx * MAX_TOKEN_CHARS:
        at_least = -(-len(text) // MAX_TOKEN_CHARS)
        raise context_error(at_least, ctx, param, at_least=True)
    tok = st.tokenizer
    if tok is not None and len(text) > ctx * COUNT_ABOVE_CHARS_PER_TOKEN:
        n = tok.count(text, ctx)
        if n + room > ctx:  # the worker's own rule
            raise context_error(n, ctx, param, at_least=True)


def turn_limit(requested: int | None) -> tuple[int, bool]:
    """``(max_tokens, cap_is_eos)`` of a turn: the request's limit (or ``--tokens``)
    capped by ``--demo``'s per-request cap, else the context size; the worker lowers it
    to the room the planned prompt leaves.

    A limit beyond the context is not an error (docs/ARCHITECTURE.md §6): generation stops when
    the context is full and reports ``length`` / ``max_tokens``.

    ``cap_is_eos``: ``--demo``'s cap, not the request's own limit (nor ``--tokens`` for a
    request that sets none), bounds the output. The demo model is noise and never
    samples EOS: the cap stands in for its EOS, so a turn that reaches it ends as a
    natural end of turn (``end_turn`` / ``stop`` / ``completed``), not ``max_tokens``
    (Claude Code retries those and then fails). Real models (no cap) are unaffected.
    """
    st = state()
    cfg = st.config
    want = requested if requested is not None else cfg.default_max_tokens
    cap = cfg.max_tokens_cap
    limit = st.ctx_size if want is None else int(want)
    if cap is not None:
        limit = min(limit, cap)
    if cap is None or not cfg.demo_policy:
        return max(1, limit), False  # no cap, or --tokens chose a real output limit
    if requested is not None:
        return max(1, limit), cap < int(requested)
    default = cfg.default_max_tokens
    return max(1, limit), default is None or cap <= default


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
    ``-1`` (vLLM's "off") is 0; a temperature below 1e-4 is greedy
    (`SamplingParams.greedy`). ``seed`` is any
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
    return SamplingParams(
        DEFAULT_TEMPERATURE if temperature is None else float(temperature),
        DEFAULT_TOP_P if top_p is None else float(top_p),
        0 if top_k is None or top_k < 0 else int(top_k),
        DEFAULT_MIN_P if min_p is None else float(min_p),
        seed,
    )


def tokenize(text: Rendered | str) -> list[int]:
    """Token ids of a prompt (call off the event loop: long prompts take seconds).

    ``text``: a rendered conversation (``ds4mlx.dsml.Rendered``: its content is plain
    text, only the renderer's markers are special tokens), or a raw ``str`` (raw
    endpoints: special-token spellings are recognized, users write templates there).
    """
    tok = state().tokenizer
    if isinstance(text, str):
        return tok.encode(text)
    return tok.encode(text.text, content=text.content)


def render(conv: Conversation) -> Rendered:
    """Render ``conv`` with the server's context size and tool memory (400 on errors).

    Returns a ``ds4mlx.dsml.Rendered`` (text + content spans).
    """
    st = state()
    try:
        return render_conv(conv, context_size=st.ctx_size, tool_memory=st.tool_memory)
    except (ValueError, TypeError, RecursionError) as e:
        raise APIError(400, f"cannot render the conversation: {e}") from None


def drop_oldest_turns(conv: Conversation) -> Conversation:
    """Responses' ``truncation: "auto"``: ``conv`` without as few of its oldest turns as
    make its rendering fit the context (fewer tokens than ``--ctx``, the worker's own
    rule), or ``conv`` itself when it fits already or cannot be made to (the context check
    then refuses it). A turn starts at a user message; system and developer messages stay
    wherever they were; the last user message and what follows it always stay.

    The rendering's tokens are counted up to the context (``Tokenizer.count``) for each
    candidate, found by bisection: a handful of counts however long the history.
    """
    st = state()
    tok, ctx = st.tokenizer, st.ctx_size

    def cut(at: int) -> Conversation:
        kept = [m for m in conv.messages[:at] if m.role == "system"] + conv.messages[at:]
        return dataclasses.replace(conv, messages=kept)

    def fits(c: Conversation) -> bool:
        return tok.count(render(c).text, ctx) < ctx

    starts = [i for i, m in enumerate(conv.messages) if m.role == "user"][1:]
    if tok is None or not starts or fits(conv):
        return conv
    lo, hi = 0, len(starts) - 1  # the first cut that fits lies in starts[lo..hi], if any
    if not fits(cut(starts[hi])):
        return conv
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(cut(starts[mid])):
            hi = mid
        else:
            lo = mid + 1
    return cut(starts[lo])


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


async def start(job: Job, wording: Wording) -> None:
    """Wait (up to one keepalive interval) for ``job`` to leave the queue, so that a
    failure the worker finds before it runs anything — an unknown tool id, a prompt
    over the context — is answered as the protocol's 4xx, not inside a 200 stream. A job
    still queued after that streams on (keepalives) and reports such a failure in the
    stream. A client that goes away meanwhile cancels the job.

    Raises:
        APIError: the job's client failure.
    """
    try:
        first = await job.first(state().config.keepalive_s)
    except BaseException:
        job.cancel.set()
        raise
    if isinstance(first, JobFailed) and first.client_error:
        job.done = True
        raise failed_to_api(first, wording)


async def stream(job: Job, enc: Encoder, wording: Wording) -> Response:
    """The SSE response of ``job`` encoded by ``enc`` (after `start`); a client that
    goes away cancels the job."""
    await start(job, wording)
    keepalive_s = state().config.keepalive_s

    async def frames() -> AsyncIterator[bytes]:
        # Runs outside the app context (Quart streams bodies after the handler returned).
        async for ev in events(job, enc, keepalive_s, probe=True):
            yield SSE_COMMENT if ev is None else enc.frame(ev)

    return sse_response(guard(job, frames()))


async def respond(job: Job, enc: Encoder, wording: Wording) -> dict[str, Any]:
    """The non-streaming body of ``job``: every event through ``enc``, then its result.

    Raises:
        APIError: the job failed (worded by ``wording``), or it was cancelled by a
            shutdown (503).
    """
    evs, done = await collect(job, wording)
    for e in evs:
        _dispatch(enc, e)
    enc.done(done)
    if done.finish == "cancelled":
        raise APIError(503, SHUTDOWN_CANCEL, type="server_error")
    return enc.result()


async def collect(job: Job, wording: Wording) -> tuple[list[Any], JobDone]:
    """Drain a job for a non-streaming response: ``(events, JobDone)``.

    Cancels the job if the handler is cancelled (client gone).

    Raises:
        APIError: the job failed.
    """
    seen: list[Any] = []
    try:
        async for ev in job.events():
            if isinstance(ev, JobFailed):
                raise failed_to_api(ev, wording)
            if isinstance(ev, JobDone):
                return seen, ev
            seen.append(ev)
    finally:
        if not job.done:
            job.cancel.set()
    raise APIError(500, "job ended without a result", type="server_error")  # pragma: no cover


async def guard(job: Job, gen: AsyncIterator[T]) -> AsyncIterator[T]:
    """Pass ``gen`` on; however it ends (the client went away, the handler was
    cancelled), a job that has not finished is cancelled."""
    try:
        async for item in gen:
            yield item
    finally:
        if not job.done:
            job.cancel.set()
