"""The job vocabulary: what a route asks the inference worker for, and what comes back.

A leaf below both ``ds4mlx.routes`` and ``ds4mlx.server`` (docs/ARCHITECTURE.md §1): it
imports only engine and dsml types, so a route depends on it without pulling in the app
or the worker, and the worker produces its events without knowing any protocol.

- The request (`GenRequest`) carries the engine's own `TurnSpec` (what to generate) and
  the prompt as the route rendered it; nothing here has a protocol default (the tool-id
  prefix, the wording of errors, the live-continuation labels are the route's).
- The events the worker emits: `JobStarted`, `PrefillProgress`, the dsml decoder
  events, the engine's `TokenLogprob` / `RawText` / `PromptLogprobs` (token ids: each
  route turns them into its own texts), and last `JobDone` or `JobFailed`.
- Failures are neutral (`Failure`): a kind with its facts (the unknown id, the token
  counts); each route words them in its protocol.

A route builds a `GenRequest`, submits it (``ds4mlx.server.worker.Worker.submit``) and
reads the `Job`'s events on the event loop; the worker emits them from its thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ds4mlx.dsml import Conversation, Rendered, ToolSpec
from ds4mlx.engine.grammar import (
    Grammar,
    GrammarError,
    ToolRule,
    custom_grammar,
    json_grammar,
    ll_tokenizer,
    turn_grammar,
)
from ds4mlx.engine.turn import PromptLogprobs, RawText, TokenLogprob, TurnSpec

log = logging.getLogger("ds4mlx.server")

__all__ = [
    "ConstraintError",
    "Failure",
    "GenRequest",
    "Grammar",
    "Job",
    "JobDone",
    "JobFailed",
    "JobStarted",
    "LiveLabels",
    "OutputConstraint",
    "PrefillProgress",
    "PromptLogprobs",
    "RawText",
    "Script",
    "TokenLogprob",
    "ToolCallDone",
    "ToolRule",
    "CompileTicket",
    "TurnSpec",
    "start_compile",
]


# --------------------------------------------------------------------------- events


@dataclass
class JobStarted:
    """The job left the queue: its prompt is planned and about to be prefilled.

    ``prompt_tokens``: tokens of the prompt as the session holds it;
    ``cached_tokens``: those already in the live state (not prefilled);
    ``decision``: the plan decision (relabelled with the request's `LiveLabels`).
    """

    prompt_tokens: int
    cached_tokens: int
    decision: str


@dataclass
class PrefillProgress:
    """Prefill progress: ``done`` of ``total`` suffix tokens fed (routes send keepalives)."""

    done: int
    total: int


@dataclass
class ToolCallDone:
    """A complete tool call the model sampled (id, name, JSON arguments, exact DSML)."""

    id: str
    name: str
    arguments: dict[str, Any]
    dsml: str | None


@dataclass
class JobDone:
    """The job ended.

    Attributes:
        finish: ``"stop"`` (EOS), ``"stop_sequence"``, ``"length"`` (the client's
            ``max_tokens``), ``"context"`` (the context filled: the room the prompt left,
            lower than the client's limit, ran out), ``"cancelled"``, ``"steered"``
            (`Job.steer` was set: the turn ended at its next boundary, its live state
            ready for the steering input to be appended).
        stop_sequence: the matched stop string, or None.
        prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens: usage (int).
        tool_calls: the calls sampled, in order.
        reasoning: the hidden reasoning text sampled (for carriers), or "".
        prefill_s, decode_s: seconds spent; prefill/decode rates derive from them.
        decision: the plan decision (also in `JobStarted`).
        text: the visible text sent to the client (after stop sequences).
    """

    finish: str
    stop_sequence: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    tool_calls: list[ToolCallDone] = field(default_factory=list)
    reasoning: str = ""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decision: str = ""
    text: str = ""


class Failure(StrEnum):
    """Why a job failed, without protocol wording (each route words it).

    ``UNKNOWN_TOOL_ID``: a tool result answers no call the live state holds or the
    request replays (`JobFailed.tool_id`); ``CONTEXT_FULL``: the prompt leaves no room to
    generate (`JobFailed.n_prompt_tokens`, `JobFailed.n_ctx`); ``EMPTY_PROMPT``: nothing
    to prefill; ``SHUTTING_DOWN``: the server stopped before the job ran; ``RANK_LOST``: a
    rank of a model split across processes is gone and the server is stopping
    (`JobFailed.detail`: which and why); ``INTERNAL``: a fault of the server
    (`JobFailed.detail`).
    """

    UNKNOWN_TOOL_ID = "unknown_tool_id"
    CONTEXT_FULL = "context_full"
    EMPTY_PROMPT = "empty_prompt"
    SHUTTING_DOWN = "shutting_down"
    RANK_LOST = "rank_lost"
    INTERNAL = "internal"


@dataclass
class JobFailed:
    """The job failed: a neutral `Failure` with its facts.

    Attributes:
        kind: the `Failure`.
        tool_id: ``UNKNOWN_TOOL_ID``: the id nothing explains.
        n_prompt_tokens, n_ctx: ``CONTEXT_FULL``: the prompt's tokens and the context
            size (tokens).
        detail: ``INTERNAL``: what went wrong, for the message and the log;
            ``RANK_LOST``: the lost-rank line (``rank 1 lost: …``).
    """

    kind: Failure
    tool_id: str | None = None
    n_prompt_tokens: int | None = None
    n_ctx: int | None = None
    detail: str = ""

    @property
    def client_error(self) -> bool:
        """The request was at fault (a 4xx), not the server."""
        return self.kind in (Failure.UNKNOWN_TOOL_ID, Failure.CONTEXT_FULL, Failure.EMPTY_PROMPT)


# --------------------------------------------------------------------------- jobs


@dataclass(frozen=True)
class LiveLabels:
    """A route's names for a live tool continuation, for the log line, the trace and
    `JobStarted.decision`: ``live_tools`` replaces the prompt cache's neutral decision
    (``live-tools``) and ``ids`` the id word of its detail (``match=<ids> ids=N``)."""

    live_tools: str
    ids: str


@dataclass
class GenRequest:
    """What a route asks the worker to generate (no JSON, no HTTP).

    Attributes:
        path: the endpoint, for the log line (e.g. ``"/v1/messages"``).
        turn: the engine's `TurnSpec` (sampling, ``max_tokens``, stops, tools, id prefix,
            forced tool choice, logprobs, ``cap_is_eos``). ``max_tokens`` is the route's
            limit; the worker lowers it to the room the planned prompt leaves (and then
            drops ``cap_is_eos``: the context, not the demo cap, bounds the turn).
        prompt: the rendered prompt: a `Rendered` for chat protocols (its content spans
            tokenize as plain text), a ``str`` for a raw text prompt, or None for a
            token-id prompt.
        prompt_tokens: the whole prompt's ids when the route has them (token-id
            prompts, raw text it tokenized), else None: the worker tokenizes the
            rendering only when the plan needs it.
        conversation: the `Conversation` (for the prompt cache's live continuations),
            or None.
        labels: the route's `LiveLabels`, or None for the prompt cache's own names.
        state_key: the client's name of the conversation (Claude Code's agent or session
            id, Codex's ``prompt_cache_key``), or None: the prompt cache keeps each such
            conversation on its own resident state.
        salt: the prompt cache salt (``ds4mlx.routes.common.cache_salt``; ``""``:
            none): live states and snapshots are reused only under the same salt.
        side: the client marked it as a side request (a helper agent of Claude Code,
            ``ds4mlx.routes.common.helper_agent``): it never takes a conversation's state.
        logit_bias: ``(token id, offset)`` pairs added to the logits of every sampled
            step (``ds4mlx.engine.bias.LogitBias``); ``()``: none.
        presence_penalty / frequency_penalty: OpenAI's penalties on the reply's own
            tokens (``ds4mlx.engine.bias.Penalties``); 0: none.
        repetition_penalty: vLLM's factor on every token of the context
            (``ds4mlx.engine.bias.RepetitionPenalty``); 1: none.
        min_tokens: vLLM's ``min_tokens``: no EOS is sampled before the reply has
            this many tokens (``ds4mlx.engine.bias.EndBan``); 0: none.
        ignore_eos: vLLM's ``ignore_eos``: no EOS is sampled at all (the turn ends at
            its limit, a stop string or a full context).
    """

    path: str
    turn: TurnSpec
    prompt: Rendered | str | None
    prompt_tokens: list[int] | None = None
    conversation: Conversation | None = None
    labels: LiveLabels | None = None
    state_key: str | None = None
    salt: str = ""
    side: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False

    def set_grammar(self, grammar: Grammar | None) -> None:
        """Give the turn its compiled grammar (a route compiles it after building the
        job, off the parsing threads). A demo cap then ends the turn as an end of turn
        only where the grammar would let an EOS through (`TurnHooks.may_end`)."""
        self.turn = dataclasses.replace(self.turn, grammar=grammar)


@dataclass
class Script:
    """A scripted continuation for one job (``--enable-scripted-decoding``, tests only).

    ``text`` is tokenized as a whole, or ``tokens`` (ids) are used as given (e.g. a
    non-canonical split that re-tokenizes differently on replay). ``greedy``: once the
    script runs out, decode greedily instead of with the request's sampling.
    """

    text: str = ""
    tokens: list[int] | None = None
    greedy: bool = False


_job_ids = itertools.count(1)

# What `Job.events` yields: a job event, or None after ``keepalive_s`` idle seconds.
Event = Any


class Job:
    """One queued generation: a `GenRequest` plus its event channel, cancel and steer flags.

    Created on the event loop (``Worker.submit``); the worker calls `emit` from its
    thread, the route consumes `events` on the loop.
    """

    def __init__(self, request: GenRequest, loop: asyncio.AbstractEventLoop):
        self.id = next(_job_ids)
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.cancel = threading.Event()
        # Set by the route when steering input is queued: the turn ends ``steered`` at
        # its next boundary (``ds4mlx.engine.Steering``).
        self.steer = threading.Event()
        self.submitted = time.monotonic()
        self.done = False
        # Its last event (`JobDone`/`JobFailed`) was emitted: the worker may still be
        # finishing its bookkeeping, but a shutdown then interrupts nothing.
        self.answered = False
        self._held: list[Event] = []

    def emit(self, event: Event) -> None:
        """Hand ``event`` to the route (thread-safe; dropped once the loop is closed)."""
        if isinstance(event, JobDone | JobFailed):
            self.answered = True
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # event loop closed during shutdown
            pass

    def cancelled(self) -> bool:
        return self.cancel.is_set()

    async def first(self, timeout_s: float) -> Event:
        """The job's first event, waiting at most ``timeout_s`` seconds (None: still
        queued). The event stays readable: `events` yields it first."""
        if not self._held:
            try:
                async with asyncio.timeout(timeout_s):
                    self._held.append(await self.queue.get())
            except TimeoutError:
                return None
        return self._held[0]

    async def events(self, keepalive_s: float | None = None) -> AsyncIterator[Event]:
        """Yield worker events until `JobDone`/`JobFailed` (inclusive).

        With ``keepalive_s``, yields None after that many seconds without an event, so
        streaming routes can send keepalives while the job waits in the queue.

        Cancellation (the client went away and the server cancels the handler) always
        propagates. ``asyncio.wait_for`` on Python 3.11 swallows a cancel that arrives
        while its inner ``get()`` completes (cpython gh-86296): the stream then kept
        reading events and the job ran to ``max_tokens``. ``asyncio.timeout`` tells its
        own deadline from an outside cancel, so it is used instead.
        """
        while True:
            if self._held:
                ev = self._held.pop(0)
            else:
                try:
                    if keepalive_s:
                        async with asyncio.timeout(keepalive_s):
                            ev = await self.queue.get()
                    else:
                        ev = await self.queue.get()
                except TimeoutError:
                    yield None
                    continue
            yield ev
            if isinstance(ev, JobDone | JobFailed):
                self.done = True
                return


# --------------------------------------------------------------------------- constraints


@dataclass
class OutputConstraint:
    """What a request asks the reply to follow, from its protocol's fields (the route
    builds it; `start_compile` turns it into the engine's ``Grammar``).

    Attributes:
        schema: the visible text is one JSON value valid for this JSON schema, or None.
        json_object: the visible text is one JSON object (any), when ``schema`` is None.
        schema_param: the wire path of ``schema`` (for errors), e.g.
            ``response_format.json_schema.schema``.
        tools: tool name → `ToolRule` (strict function tools, custom tools).
        tool_params: tool name → the wire path of its schema or grammar definition.
        parallel: False (``parallel_tool_calls: false``): at most one call per turn.
    """

    schema: dict[str, Any] | None = None
    json_object: bool = False
    schema_param: str = ""
    tools: dict[str, ToolRule] = field(default_factory=dict)
    tool_params: dict[str, str] = field(default_factory=dict)
    parallel: bool = True

    def shapes_reply(self) -> bool:
        """Whether the visible reply itself must be JSON (a schema or ``json_object``),
        not only the tool calls beside it."""
        return self.schema is not None or self.json_object


class ConstraintError(ValueError):
    """A constraint that cannot be enforced: ``message`` names the problem, ``param``
    the wire path of the offending part (a route answers 400 with both; 429 when
    ``busy``)."""

    def __init__(self, message: str, param: str, *, busy: bool = False):
        super().__init__(message)
        self.message = message
        self.param = param
        self.busy = busy  # not the constraint's fault: every compile thread was taken


def _join(base: str, path: str) -> str:
    return f"{base}.{path}" if base and path else base or path


def _check_parts(
    c: OutputConstraint, tools: dict[str, ToolSpec], stage: list[str], llt=None
) -> None:
    """Compile each part on its own first, so an error names its own path; ``stage[0]``
    is set to the wire path being compiled (a timeout names it). A custom grammar is
    compiled against ``llt`` (the llguidance tokenizer, when given) so that one matching
    no text is refused here (`custom_grammar`)."""
    if c.schema is not None:
        stage[0] = c.schema_param
        try:
            json_grammar(c.schema)
        except GrammarError as e:
            raise ConstraintError(e.message, _join(c.schema_param, e.path)) from e
    for name, rule in c.tools.items():
        param = stage[0] = c.tool_params.get(name, "tools")
        spec = tools.get(name)
        try:
            if rule.custom and rule.syntax is not None:
                custom_grammar(rule.syntax, rule.definition, llt)
            elif rule.strict and spec is not None:
                if not isinstance(spec.parameters, dict) or spec.parameters.get("type") != "object":
                    raise GrammarError("strict: true needs a JSON schema of type object")
                json_grammar(spec.parameters)
        except GrammarError as e:
            raise ConstraintError(f"tool {name!r}: {e.message}", _join(param, e.path)) from e


# The clock bound on compiling one request's constraint (``serve --grammar-compile-ms``).
COMPILE_MS = 5000
# Threads compiling constraints, shared by all requests: bounded, so abandoned compiles
# (past their limit, left to finish within llguidance's fuel) never multiply; a compile
# that finds them all busy waits its turn, within its own limit.
COMPILE_THREADS = 2
_compiles: ThreadPoolExecutor | None = None
_compiles_lock = threading.Lock()


def _compile_pool() -> ThreadPoolExecutor:
    global _compiles
    with _compiles_lock:
        if _compiles is None:
            # Its threads are joined at interpreter exit (concurrent.futures' own exit
            # hook): an abandoned compile finishes instead of being finalized under
            # native code that is still running (SIGSEGV).
            _compiles = ThreadPoolExecutor(
                COMPILE_THREADS, thread_name_prefix="ds4mlx-grammar-compile"
            )
        return _compiles


class CompileTicket:
    """A constraint compile handed to the compile threads (`start_compile`).

    ``future``: its ``concurrent.futures.Future`` (the ``Grammar``, or None; or the
    `ConstraintError` it raised). ``deadline``: the ``time.monotonic()`` second its
    ``limit_ms`` ends, counted from the hand-over (waiting for a thread counts).
    `expired` words the refusal once the deadline passes first.
    """

    def __init__(self, future: Future, limit_ms: int, stage: list[str], started: threading.Event):
        self.future = future
        self.limit_ms = limit_ms
        self.deadline = time.monotonic() + limit_ms / 1000
        self._stage = stage
        self._started = started

    def expired(self) -> ConstraintError:
        """The error of a compile past its limit (cancelled if it had not started):
        ``busy`` when every compile thread was taken for the whole limit (the
        constraint itself was never tried)."""
        if self.future.cancel() or not self._started.is_set():
            return ConstraintError(
                f"the server's grammar compilers were busy for the whole {self.limit_ms} ms "
                "limit (serve --grammar-compile-ms): retry",
                self._stage[0],
                busy=True,
            )
        return ConstraintError(
            f"compiling its grammar took longer than the {self.limit_ms} ms limit "
            "(serve --grammar-compile-ms): simplify the schema or grammar",
            self._stage[0],
        )

    def wait(self) -> Grammar | None:
        """Block until the compile ends or its deadline passes (raises `ConstraintError`)."""
        try:
            return self.future.result(max(0.0, self.deadline - time.monotonic()))
        except FutureTimeout:
            raise self.expired() from None


def start_compile(
    c: OutputConstraint,
    *,
    tools: list[ToolSpec],
    calls: bool,
    required: bool,
    tool_name: str | None,
    allowed: frozenset[str] | None = None,
    tokenizer=None,
    param: str = "",
    limit_ms: int = COMPILE_MS,
) -> CompileTicket:
    """Hand the compile of the engine's ``Grammar`` for a request's `OutputConstraint`
    ``c`` to the bounded compile threads; return at once with its `CompileTicket`
    (a route awaits it; ``ticket.wait()`` blocks for it, up to ``limit_ms``).

    Compiling is bounded by llguidance's limits (``ds4mlx.engine.grammar.LIMITS``) and
    by the clock: it runs on the compile threads (`COMPILE_THREADS`), and past
    ``limit_ms`` (waiting for a thread included) the request is refused (a compile
    already running is left to finish within llguidance's fuel limits; llguidance
    releases the GIL while it compiles).

    Args:
        tools: the tools offered to the model (``tool_choice: none`` offers none).
        calls / required / tool_name: the request's tool choice (``TurnSpec`` fields).
        allowed: the names of the tools that may be called (OpenAI's ``allowed_tools``),
            or None for any of ``tools``.
        tokenizer: the ``ds4mlx.tokenizer.Tokenizer`` for the full check (the compiled
            matcher is then kept in the ``Grammar`` for the turn), or None.
        param: the wire field to name when the combined grammar fails.
        limit_ms: milliseconds the whole compile may take.

    The ticket's wait raises ``ConstraintError``: a schema keyword, pattern or grammar
    that cannot be enforced, or a compile past ``limit_ms`` (naming the part being
    compiled then; ``busy`` when it never got a compile thread).
    """
    stage = [param if c.tools else c.schema_param or param]  # named if it never starts
    llt = ll_tokenizer(tokenizer) if tokenizer is not None else None  # cached, not timed
    started = threading.Event()

    def run() -> Grammar | None:
        started.set()
        t0 = time.monotonic()
        log.info("grammar compile start param=%s", stage[0])
        try:
            return _compile(c, tools, calls, required, tool_name, allowed, llt, param, stage)
        finally:
            ms = (time.monotonic() - t0) * 1000
            log.info("grammar compile end param=%s ms=%.0f", stage[0], ms)

    return CompileTicket(_compile_pool().submit(run), limit_ms, stage, started)


def _compile(c, tools, calls, required, tool_name, allowed, llt, param, stage) -> Grammar | None:
    """`start_compile`'s work (on its thread; ``llt``: the llguidance tokenizer)."""
    by_name = {t.name: t for t in tools}
    _check_parts(c, by_name, stage, llt)
    stage[0] = param if c.tools else c.schema_param or param
    try:
        return turn_grammar(
            tools,
            c.tools,
            text_schema=c.schema,
            text_json=c.json_object,
            calls=calls,
            required=required,
            tool_name=tool_name,
            allowed=allowed,
            parallel=c.parallel,
            tokenizer=llt,
        )
    except GrammarError as e:
        raise ConstraintError(e.message, param) from e
