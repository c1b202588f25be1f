"""`ds4mlx serve`: the HTTP server around one live session (DESIGN.md §1, §3, §6).

Shape::

    HTTP client ─▶ Quart app (ds4mlx.routes) ─▶ FIFO job queue ─▶ one worker thread
                    parse · validate · render                    owns engine.Session
                    ◀── SSE ◀── per-request asyncio.Queue ◀──────  prefill · decode · sample

- Routes parse, validate and render (``ds4mlx.dsml``); they never touch MLX arrays.
- One `Worker` thread owns the engine's ``Session`` and never touches HTTP. Jobs run
  one at a time in arrival order. Events cross back with ``loop.call_soon_threadsafe``
  into the job's own ``asyncio.Queue``.
- A client that goes away sets its job's cancel flag; the worker checks it before every
  prefill chunk and every token, so the session is left consistent.
- What to reuse from the live session is decided by ``ds4mlx.kv.plan.plan_prefill``.

Served by Hypercorn; shutdown (SIGINT/SIGTERM) cancels the running job, fails the
queued ones and joins the worker before the process exits.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("ds4mlx.server")

DEFAULT_MODEL_NAME = "deepseek-v4-flash"
# Alias → thinking default. "deepseek-chat" is DeepSeek's own name for non-thinking mode.
DEFAULT_ALIASES = {"deepseek-chat": False, "deepseek-reasoner": True}
# Defaults of DESIGN.md §6 (also what thinking mode always uses).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.05


# --------------------------------------------------------------------------- config


@dataclass
class ServerConfig:
    """Settings of one server (CLI flags of ``ds4mlx serve``).

    Attributes:
        model_name: the served model id (``--served-model-name``).
        aliases: extra model ids → thinking default (``deepseek-chat`` = non-thinking).
        default_max_tokens: output tokens when a request sets none (``--tokens``);
            None means "until the context is full".
        max_tokens_cap: every request's output limit is capped to this (``--demo``:
            ``--tokens`` or `DEMO_MAX_TOKENS`), or None. The demo model is noise and
            never samples EOS; clients that ask for 32000 tokens would wait minutes.
        api_key: required bearer / ``x-api-key`` value, or None (``--api-key``).
        cors: answer CORS preflights and add ``Access-Control-Allow-Origin: *``.
        trace_path: JSON-lines trace file (``--trace``), or None.
        scripted: enable ``POST /debug/script`` (``--enable-scripted-decoding``; tests).
        keep_billing_header: keep Claude Code's ``x-anthropic-billing-header`` system
            line (DESIGN.md §3).
        keepalive_s: seconds between SSE keepalives while a stream has nothing to send.
        max_body_bytes: larger request bodies get 413.
        host, port: where Hypercorn binds.
        reasoning_key: key of the reasoning carrier (AES-GCM) (Responses ``encrypted_content``,
            Anthropic thinking ``signature``); None derives one (see
            ``ds4mlx.routes.common.load_reasoning_key``).
        kv: ``ds4mlx.kv.policy.KVCacheSettings`` (``--kv-disk-dir``, ``--kv-cache-*``);
            None: no disk cache.
        tool_memory_max_ids: tool-call ids whose exact DSML is remembered
            (``--tool-memory-max-ids``).
        exact_dsml_replay: render replayed tool calls from the exact sampled DSML
            (off with ``--disable-exact-dsml-tool-replay``).
    """

    model_name: str = DEFAULT_MODEL_NAME
    aliases: dict[str, bool] = field(default_factory=lambda: dict(DEFAULT_ALIASES))
    default_max_tokens: int | None = None
    max_tokens_cap: int | None = None
    api_key: str | None = None
    cors: bool = False
    trace_path: str | None = None
    scripted: bool = False
    keep_billing_header: bool = False
    keepalive_s: float = 10.0
    max_body_bytes: int = 32 * 1024 * 1024
    host: str = "127.0.0.1"
    port: int = 8000
    reasoning_key: bytes | None = None
    kv: Any = None
    tool_memory_max_ids: int = 100_000
    exact_dsml_replay: bool = True

    def model_ids(self) -> list[str]:
        """Every model id the server answers to, the served name first."""
        return [self.model_name, *[a for a in self.aliases if a != self.model_name]]

    def thinking_default(self, model: str | None) -> bool:
        """Thinking mode for a request naming ``model`` (unknown names: thinking on)."""
        if model and model in self.aliases and model != self.model_name:
            return self.aliases[model]
        return True


# --------------------------------------------------------------------------- events


@dataclass
class JobStarted:
    """The job left the queue: its prompt is planned and about to be prefilled.

    ``prompt_tokens``: tokens of the prompt as the session holds it;
    ``cached_tokens``: those already in the live state (not prefilled);
    ``decision``: the `ds4mlx.kv.plan.Plan` decision name.
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
class RawText:
    """Raw generated text for ``/v1/completions`` (no thinking/DSML parsing).

    ``tokens`` are the ids this text completes (may be several when a UTF-8 character
    spans tokens); ``logprobs`` per token: ``(token_text, logprob, top: dict[str, float])``
    when the request asked for logprobs, else empty.
    """

    text: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[str, float, dict[str, float]]] = field(default_factory=list)


@dataclass
class TokenLogprob:
    """Chat ``logprobs``: one token sampled in the visible reply (not in thinking).

    ``token``: its text (U+FFFD for part of a UTF-8 character); ``bytes``: its raw
    bytes; ``top``: the ``top_logprobs`` most likely tokens as ``(text, logprob, bytes)``.
    Emitted just before the events of the text that token completes.
    """

    token: str
    logprob: float
    bytes: bytes
    top: list[tuple[str, float, bytes]] = field(default_factory=list)


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
        finish: ``"stop"`` (EOS), ``"stop_sequence"``, ``"length"`` (max_tokens or a full
            context), ``"cancelled"``.
        stop_sequence: the matched stop string, or None.
        prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens: usage (int).
        tool_calls: the calls sampled, in order.
        reasoning: the hidden reasoning text sampled (for carriers), or "".
        prefill_s, decode_s: seconds spent; prefill/decode rates derive from them.
        decision: the plan decision (also in `JobStarted`).
        text: the visible text sent to the client (after stop sequences), for the
            thinking live-continuation key.
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


@dataclass
class JobFailed:
    """The job failed on the worker. ``status``: HTTP status to report (500 for faults)."""

    message: str
    status: int = 500
    kind: str = "api_error"


# --------------------------------------------------------------------------- jobs


@dataclass
class GenRequest:
    """What a route asks the worker to generate (no JSON, no HTTP).

    Attributes:
        path: the endpoint, for the log line (e.g. ``"/v1/messages"``).
        prompt_tokens: the whole prompt's token ids (tokenized by the route).
        prompt_text: the rendered prompt text, or None for token-id prompts.
        sampling: ``ds4mlx.engine.SamplingParams``.
        max_tokens: output token limit (already clamped to >= 1).
        stops: stop strings (visible text only).
        parse: True for chat protocols (thinking/text/DSML through ``StreamDecoder``);
            False for raw completions.
        thinking: the prompt opened ``<think>``.
        tools: ``ToolSpec`` list offered (the decoder maps arguments by their schemas).
        id_prefix: prefix of new tool-call ids (``toolu_`` / ``call_``).
        logprobs: top-N logprobs per token for completions, or None.
        conversation: the ``Conversation`` (for the prefill planner; issue 5), or None.
        protocol: ``"anthropic"``, ``"chat"``, ``"responses"``, ``"completions"``.
        tool_required: the client forced a tool call (``tool_choice`` required / any /
            a named tool): the worker opens the DSML tool-call block itself as soon as
            the visible reply starts.
        tool_name: with ``tool_required``, the tool it must call (its name is forced
            too), or None for any tool.
        top_logprobs: chat ``logprobs``: None (off) or how many alternatives per token
            (0..20); the worker attaches `TokenLogprob`s to the events it emits.
        cap_is_eos: ``max_tokens`` is ``--demo``'s cap (see
            ``ds4mlx.routes.common.demo_cap_ends_turn``): reaching it ends the job as
            ``"stop"`` (the noise model never samples EOS), not ``"length"``.
    """

    path: str
    prompt_tokens: list[int]
    prompt_text: str | None
    sampling: Any
    max_tokens: int
    stops: list[str] = field(default_factory=list)
    parse: bool = True
    thinking: bool = True
    tools: list[Any] = field(default_factory=list)
    id_prefix: str = "toolu_"
    logprobs: int | None = None
    conversation: Any = None
    protocol: str = "chat"
    tool_required: bool = False
    tool_name: str | None = None
    top_logprobs: int | None = None
    cap_is_eos: bool = False


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


class Job:
    """One queued generation: a `GenRequest` plus its event channel and cancel flag.

    Created on the event loop (`Worker.submit`); the worker calls `emit` from its
    thread, the route consumes `events` on the loop.
    """

    def __init__(self, request: GenRequest, loop: asyncio.AbstractEventLoop):
        self.id = next(_job_ids)
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.submitted = time.monotonic()
        self.done = False

    def emit(self, event: Any) -> None:
        """Hand ``event`` to the route (thread-safe; dropped once the loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # event loop closed during shutdown
            pass

    def cancelled(self) -> bool:
        return self.cancel.is_set()

    async def events(self, keepalive_s: float | None = None) -> AsyncIterator[Any]:
        """Yield worker events until `JobDone`/`JobFailed` (inclusive).

        With ``keepalive_s``, yields None after that many seconds without an event, so
        streaming routes can send keepalives while the job waits in the queue.
        """
        while True:
            try:
                if keepalive_s:
                    ev = await asyncio.wait_for(self.queue.get(), keepalive_s)
                else:
                    ev = await self.queue.get()
            except TimeoutError:
                yield None
                continue
            yield ev
            if isinstance(ev, JobDone | JobFailed):
                self.done = True
                return


# --------------------------------------------------------------------------- trace


class Tracer:
    """``--trace FILE``: JSON lines of prompts, cache decisions, output, parser events.

    One object per line: ``{"t": unix time, "job": id, "kind": ..., ...}``. Thread-safe;
    writes are flushed per job so a crash loses at most the running one.
    """

    def __init__(self, path: str | os.PathLike | None):
        self._lock = threading.Lock()
        self._f = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115

    @property
    def enabled(self) -> bool:
        return self._f is not None

    def write(self, job_id: int, kind: str, **fields: Any) -> None:
        if self._f is None:
            return
        rec = {"t": round(time.time(), 3), "job": job_id, "kind": kind, **fields}
        line = json.dumps(rec, ensure_ascii=False, default=_json_default)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return {"type": type(o).__name__, **dataclasses.asdict(o)}
    return repr(o)


# --------------------------------------------------------------------------- worker


class Worker:
    """The inference thread: runs `Job`s one at a time on the engine's live session.

    Args:
        tool_memory: ``ds4mlx.dsml.ToolMemory`` the sampled tool calls are stored in.
        tracer: a `Tracer` (may be disabled).
        scripts: deque of scripted continuations (texts or `Script`s) for
            ``--enable-scripted-decoding``; each job pops the next one.

    Hooks, all run on the worker thread with the session: ``planner`` (default
    ``ds4mlx.kv.plan.plan_prefill``; may raise ``ds4mlx.kv.plan.PlanRejected`` for a
    client error), ``after_job`` (default ``ds4mlx.kv.plan.after_generation``),
    ``after_token`` (after each generated token is fed, or None) and ``on_shutdown``.
    ``ds4mlx.kv.plan.attach`` installs the full live-continuation / disk-cache planner
    and sets ``kv`` to it.
    """

    def __init__(self, *, tool_memory, tracer: Tracer | None = None, scripts=None):
        from ds4mlx.kv import plan as kvplan

        self.engine = None
        self.session = None
        self.tokenizer = None
        self.tool_memory = tool_memory
        self.tracer = tracer or Tracer(None)
        self.scripts: collections.deque[str | Script] = (
            scripts if scripts is not None else collections.deque()
        )
        self.planner: Callable[..., Any] = kvplan.plan_prefill
        self.after_job: Callable[..., Any] = kvplan.after_generation
        self.after_token: Callable[[Any], Any] | None = None
        self.on_shutdown: list[Callable[[Any], Any]] = []
        self.kv: Any = None
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self.current: Job | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.jobs_done = 0
        self.jobs_submitted = 0

    # ---- event-loop side

    def start(self, load: Callable[[], Any]):
        """Start the thread; it calls ``load()`` to build the engine, then serves jobs.

        MLX arrays belong to the thread that creates them (MLX streams are per thread),
        so the engine is loaded on the inference thread itself. Blocks until loaded and
        returns the engine (read its plain attributes only from other threads).

        Raises:
            Exception: whatever ``load`` raised (the thread has exited).
        """
        ready = threading.Event()
        box: dict[str, Any] = {}

        def main() -> None:
            try:
                engine = load()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
                ready.set()
                return
            self.engine = engine
            self.session = engine.session
            self.tokenizer = engine.tokenizer
            ready.set()
            try:
                self._run()
            finally:
                import mlx.core as mx

                # Destroy this thread's MLX streams while the thread is alive: left to
                # process exit, their destruction intermittently aborts the process
                # ("terminate called without an active exception", mlx 0.32).
                mx.clear_streams()

        self._thread = threading.Thread(target=main, name="ds4mlx-worker", daemon=True)
        self._thread.start()
        ready.wait()
        if "error" in box:
            raise box["error"]
        return self.engine

    def submit(self, request: GenRequest) -> Job:
        """Queue ``request`` (FIFO) and return its `Job`. Call on the event loop."""
        job = Job(request, asyncio.get_running_loop())
        if self._stopping.is_set():
            job.emit(JobFailed("server is shutting down", 503, "overloaded_error"))
            return job
        with self._lock:
            self._pending += 1
            self.jobs_submitted += 1
        self._queue.put(job)
        return job

    @property
    def queued(self) -> int:
        """Jobs waiting or running."""
        with self._lock:
            return self._pending

    @property
    def busy(self) -> bool:
        return self.current is not None

    def stop(self, timeout: float = 300.0) -> None:
        """Graceful stop: cancel the running job, fail queued ones, join the thread.

        Idempotent. ``timeout`` (seconds) bounds the wait for the thread, which runs the
        ``on_shutdown`` hooks (e.g. a disk snapshot) before it exits.
        """
        self._stopping.set()
        cur = self.current
        if cur is not None:
            cur.cancel.set()
        # Fail everything still queued so their clients get an answer.
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit(JobFailed("server is shutting down", 503, "overloaded_error"))
        self._queue.put(None)
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        self.tracer.close()

    # ---- worker thread

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                break
            if job.cancelled() or self._stopping.is_set():
                job.emit(JobDone("cancelled", None, 0, 0, 0))
                self._finish(job)
                continue
            self.current = job
            try:
                self._run_job(job)
            except BaseException as e:  # noqa: BLE001 - the worker must survive anything
                log.exception("job %d failed", job.id)
                # A failure inside the model may leave half-fed caches: start clean.
                try:
                    self.session.reset()
                except Exception:  # pragma: no cover
                    log.exception("session reset failed")
                job.emit(JobFailed(f"internal error: {type(e).__name__}: {e}"))
                if isinstance(e, KeyboardInterrupt | SystemExit):
                    raise
            finally:
                self.current = None
                self._finish(job)
        for hook in self.on_shutdown:
            try:
                hook(self.session)
            except Exception:
                log.exception("shutdown hook failed")

    def _finish(self, job: Job) -> None:
        with self._lock:
            self._pending -= 1
        self.jobs_done += 1

    def _run_job(self, job: Job) -> None:
        from ds4mlx.engine import ContextOverflowError

        req = job.request
        s, tok = self.session, self.tokenizer
        t_start = time.monotonic()
        from ds4mlx.kv.plan import PlanRejected

        try:
            plan = self.planner(s, tok, req.prompt_text, job)
        except PlanRejected as e:
            job.emit(JobFailed(e.message, e.status, e.kind))
            return
        script = None
        if self.scripts:
            script = self.scripts.popleft()
        if plan.restore is not None:
            s.restore(plan.restore)
        elif plan.keep == 0 and s.tokens:
            s.reset()
        if plan.prompt_tokens >= s.ctx_size:
            # The route checked the full tokenization; a text-prefix plan may differ by a
            # few tokens. Refuse rather than overflow.
            job.emit(
                JobFailed(
                    f"prompt is {plan.prompt_tokens} tokens; the context is {s.ctx_size}",
                    400,
                    "context_length_exceeded",
                )
            )
            return
        self.tracer.write(
            job.id, "prompt", path=req.path, text=req.prompt_text, tokens=len(req.prompt_tokens)
        )
        self.tracer.write(
            job.id,
            "plan",
            decision=plan.decision,
            cached=plan.cached,
            prompt=plan.prompt_tokens,
            detail=plan.detail,
        )
        job.emit(JobStarted(plan.prompt_tokens, plan.cached, plan.decision))

        # ---- prefill
        t0 = time.monotonic()
        suffix = plan.suffix_tokens
        last = [0.0]

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] > 0.5 or done == total:
                last[0] = now
                job.emit(PrefillProgress(done, total))

        fed = 0
        if suffix:
            try:
                fed = plan.run_prefill(s, progress=progress, cancel=job.cancelled)
            except ContextOverflowError as e:
                job.emit(JobFailed(str(e), 400, "context_length_exceeded"))
                return
        prefill_s = time.monotonic() - t0
        if fed < len(suffix) or job.cancelled():
            self._done(
                job,
                plan,
                JobDone("cancelled", None, plan.prompt_tokens, plan.cached, 0),
                prefill_s,
                0.0,
                t_start,
                prefilled=fed,
            )
            return
        if s.logits is None:
            job.emit(JobFailed("empty prompt", 400, "invalid_request_error"))
            return

        # ---- decode
        greedy_after_script = False
        if script is not None:
            greedy_after_script = bool(getattr(script, "greedy", False))
            ids = getattr(script, "tokens", None)
            s.set_script(ids if ids is not None else tok.encode(getattr(script, "text", script)))
        if req.sampling.seed is not None:
            s.seed(req.sampling.seed)
        try:
            outcome = self._generate(job, plan, greedy_after_script=greedy_after_script)
        finally:
            if script is not None:
                s.set_script(None)
        outcome.prefill_s = prefill_s
        self._done(job, plan, outcome, prefill_s, outcome.decode_s, t_start)

    def _done(
        self,
        job: Job,
        plan,
        outcome: JobDone,
        prefill_s: float,
        decode_s: float,
        t_start: float,
        *,
        prefilled: int | None = None,
    ) -> None:
        """Report ``outcome`` (hooks, event, trace, log line).

        ``prefilled``: suffix tokens actually fed when the prefill was cut short
        (cancelled); None means the whole suffix was.
        """
        outcome.prefill_s = prefill_s
        outcome.decode_s = decode_s
        outcome.decision = plan.decision
        try:
            self.after_job(self.session, self.tokenizer, job, outcome)
        except Exception:
            log.exception("after-job hook failed")
        job.emit(outcome)
        self.tracer.write(
            job.id,
            "done",
            **{k: v for k, v in dataclasses.asdict(outcome).items() if k != "reasoning"},
        )
        n_suffix = len(plan.suffix_tokens)
        n_pre = n_suffix if prefilled is None else prefilled
        pre_rate = n_pre / prefill_s if prefill_s > 0 else 0.0
        if n_pre < n_suffix:
            # Cut short: only what was fed counts; a rate over a partial chunk or none
            # at all would be noise.
            prefill = f"cancelled after {n_pre}/{n_suffix} tokens in {prefill_s:.2f}s"
        else:
            prefill = f"{pre_rate:.1f} tok/s"
        dec_rate = (
            (outcome.completion_tokens - 1) / decode_s
            if decode_s > 0 and outcome.completion_tokens > 1
            else 0.0
        )
        extra = f" {plan.detail}" if plan.detail else ""
        log.info(
            "%s %s%s prompt=%d cached=%d generated=%d prefill=%s decode=%.1f tok/s finish=%s wait=%.2fs",
            job.request.path,
            plan.decision,
            extra,
            outcome.prompt_tokens,
            outcome.cached_tokens,
            outcome.completion_tokens,
            prefill,
            dec_rate,
            outcome.finish,
            t_start - job.submitted,
        )

    def _generate(self, job: Job, plan, *, greedy_after_script: bool = False) -> JobDone:
        """Sample, feed and stream tokens until EOS, a stop, max_tokens or a full context.

        ``greedy_after_script``: argmax once a script runs out (scripted tests stay
        deterministic whatever the request's sampling).
        """
        from ds4mlx.dsml import StopMatcher, StreamDecoder, TextDelta, ThinkingDelta, ToolCallEnd
        from ds4mlx.dsml.tokens import INVOKE_OPEN, TOOL_CALLS_OPEN, TOOL_CALLS_SEP

        req = job.request
        s, tok = self.session, self.tokenizer
        eos = tok.eos_id
        think_end = tok.think_end_id
        decoder = (
            StreamDecoder(req.thinking, req.tools, id_prefix=req.id_prefix) if req.parse else None
        )
        stopper = StopMatcher(req.stops)
        detok = tok.detokenizer()
        # Sampling n tokens feeds n-1 of them: room + 1 tokens can be sampled.
        budget = max(0, min(req.max_tokens, s.room() + 1))
        n = 0
        reasoning_tokens = 0
        in_thinking = req.thinking and req.parse
        reasoning_parts: list[str] = []
        tool_calls: list[ToolCallDone] = []
        raw: list[str] = []
        finish = "length"
        stop_seq = None
        logprob_fn = _make_logprobs(tok) if req.logprobs is not None else None
        pending_lp: list[tuple[str, float, dict[str, float]]] = []
        pending_ids: list[int] = []
        visible: list[str] = []
        chat_lp = _make_chat_logprobs(tok) if req.parse and req.top_logprobs is not None else None
        after_token = self.after_token
        t0 = time.monotonic()
        t_first = None
        # Forced tool_choice: once the visible reply starts (now in chat mode, after
        # </think> in thinking mode) the tool-call block's opening is fed as if sampled;
        # it is part of the live state and of the sampled DSML, and the model continues
        # from it (the tool name too, unless one was named).
        forced: collections.deque[int] = collections.deque()
        force_text = None
        if req.parse and req.tool_required and req.tools:
            force_text = f'{TOOL_CALLS_SEP}{TOOL_CALLS_OPEN}\n{INVOKE_OPEN} name="'
            if req.tool_name:
                force_text += f'{req.tool_name}">\n'
            if not in_thinking:
                forced.extend(tok.encode(force_text))
                force_text = None

        def emit_text(text: str) -> None:
            visible.append(text)
            job.emit(TextDelta(text))

        def out(events: list[Any]) -> bool:
            """Forward decoder events through the stop matcher; True once a stop matched."""
            for ev in events:
                if isinstance(ev, TextDelta):
                    text, hit = stopper.feed(ev.text)
                    if text:
                        emit_text(text)
                    if hit:
                        return True
                    continue
                held = stopper.flush()
                if held:
                    emit_text(held)
                if isinstance(ev, ThinkingDelta):
                    reasoning_parts.append(ev.text)
                elif isinstance(ev, ToolCallEnd):
                    c = ev.call
                    tool_calls.append(ToolCallDone(c.id, c.name, c.arguments, c.dsml))
                    if c.dsml:
                        self.tool_memory.put(c.id, c.dsml)
                if self.tracer.enabled:
                    self.tracer.write(job.id, "parser", event=ev)
                job.emit(ev)
            return False

        while True:
            if job.cancelled():
                finish = "cancelled"
                break
            if n >= budget:
                finish = "length"
                break
            greedy = bool(decoder is not None and decoder.in_structure) or greedy_after_script
            if logprob_fn is not None:
                lp = logprob_fn(s.logits, req.logprobs)
            visible_token = not in_thinking
            if chat_lp is not None and visible_token:
                clp = chat_lp(s.logits, req.top_logprobs)
            t = forced.popleft() if forced else s.sample(req.sampling, greedy=greedy)
            if t_first is None:
                t_first = time.monotonic()
            n += 1
            if in_thinking:
                reasoning_tokens += 1
                if t == think_end:
                    in_thinking = False
                    if force_text is not None:
                        forced.extend(tok.encode(force_text))
                        force_text = None
            if t == eos:
                finish = "stop"
                break
            piece = detok.add(t)
            raw.append(piece)
            if chat_lp is not None and visible_token:
                job.emit(clp(t))
            if decoder is not None:
                if out(decoder.feed(piece)):
                    finish, stop_seq = "stop_sequence", stopper.matched
                    break
            else:
                pending_ids.append(t)
                if logprob_fn is not None:
                    pending_lp.append(lp(t))
                if piece:
                    text, hit = stopper.feed(piece)
                    if text or hit:
                        job.emit(RawText(text, pending_ids, pending_lp))
                        pending_ids, pending_lp = [], []
                    if hit:
                        finish, stop_seq = "stop_sequence", stopper.matched
                        break
            if n >= budget:
                finish = "length"
                break
            s.decode(t)
            if after_token is not None:
                after_token(s)

        # Flush what the detokenizer, decoder and stop matcher still hold.
        if finish != "stop_sequence":
            tail = detok.flush()
            if decoder is not None:
                evs = decoder.feed(tail) if tail else []
                evs += decoder.finish()
                if out(evs):
                    finish, stop_seq = "stop_sequence", stopper.matched
                held = stopper.flush()
                if held:
                    emit_text(held)
            else:
                text, hit = stopper.feed(tail) if tail else ("", False)
                text += stopper.flush() if not hit else ""
                if text or pending_ids:
                    job.emit(RawText(text, pending_ids, pending_lp))
                if hit:
                    finish, stop_seq = "stop_sequence", stopper.matched
        if finish == "length" and req.cap_is_eos and n >= req.max_tokens:
            finish = "stop"  # --demo: the cap stands in for the noise model's EOS
        if self.tracer.enabled:
            self.tracer.write(job.id, "output", text="".join(raw), finish=finish)
        decode_s = time.monotonic() - (t_first or t0)
        return JobDone(
            finish=finish,
            stop_sequence=stop_seq,
            prompt_tokens=plan.prompt_tokens,
            cached_tokens=plan.cached,
            completion_tokens=n,
            reasoning_tokens=reasoning_tokens if req.thinking else 0,
            tool_calls=tool_calls,
            reasoning="".join(reasoning_parts),
            decode_s=decode_s,
            text="".join(visible),
        )


def _make_logprobs(tokenizer):
    """Return ``f(logits, top_n) -> g(token) -> (text, logprob, {text: logprob})``."""
    import mlx.core as mx

    def f(logits, top_n: int):
        lps = logits - mx.logsumexp(logits, keepdims=True)
        top: dict[str, float] = {}
        if top_n > 0:
            idx = mx.argpartition(-lps, top_n - 1)[:top_n]
            vals = lps[idx]
            mx.eval(idx, vals)
            for i, v in sorted(zip(idx.tolist(), vals.tolist(), strict=True), key=lambda p: -p[1]):
                top[tokenizer.decode([i])] = float(v)

        def g(token: int):
            return tokenizer.decode([token]), float(lps[token].item()), top

        return g

    return f


def _make_chat_logprobs(tokenizer):
    """Return ``f(logits, top_n) -> g(token) -> TokenLogprob`` (log-softmax of the
    logits the session already holds; nothing is recomputed)."""
    import mlx.core as mx

    def f(logits, top_n: int):
        lps = logits.astype(mx.float32)
        lps = lps - mx.logsumexp(lps, keepdims=True)
        top: list[tuple[str, float, bytes]] = []
        if top_n > 0:
            idx = mx.argpartition(-lps, top_n - 1)[:top_n]
            vals = lps[idx]
            mx.eval(idx, vals)
            pairs = sorted(zip(idx.tolist(), vals.tolist(), strict=True), key=lambda p: -p[1])
            top = [(tokenizer.decode([i]), float(v), tokenizer.token_bytes(i)) for i, v in pairs]

        def g(token: int) -> TokenLogprob:
            return TokenLogprob(
                tokenizer.decode([token]),
                float(lps[token].item()),
                tokenizer.token_bytes(token),
                top,
            )

        return g

    return f


# --------------------------------------------------------------------------- state + app


class ServerState:
    """Everything the routes share: engine, worker, config, tool memory, carrier key."""

    def __init__(self, engine, config: ServerConfig, worker: Worker):
        from ds4mlx.routes.common import ReasoningCarrier, load_reasoning_key

        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.ctx_size: int = engine.ctx_size
        self.worker = worker
        self.tool_memory = worker.tool_memory
        self.tracer = worker.tracer
        self.scripts = worker.scripts
        self.kv = worker.kv  # ds4mlx.kv.plan.Planner (live bindings, disk cache)
        self.carrier = ReasoningCarrier(config.reasoning_key or load_reasoning_key())
        self.started = time.time()

    def submit(self, request: GenRequest) -> Job:
        return self.worker.submit(request)


def start_worker(load: Callable[[], Any], config: ServerConfig) -> tuple[Any, Worker]:
    """Start the inference thread, load the engine on it (``load()``), return both.

    Installs the live-continuation / disk-cache planner (``ds4mlx.kv.plan.attach``)
    with ``config.kv``. Raises whatever ``load`` raises, or ``OSError`` when the disk
    cache directory cannot be created.
    """
    from ds4mlx.dsml import ToolMemory
    from ds4mlx.kv.plan import attach

    memory = ToolMemory(config.tool_memory_max_ids, enabled=config.exact_dsml_replay)
    worker = Worker(tool_memory=memory, tracer=Tracer(config.trace_path))

    def load_and_attach():
        engine = load()
        # On the inference thread too: the disk cache's arrays belong to it.
        attach(worker, engine, config.kv)
        return engine

    engine = worker.start(load_and_attach)
    return engine, worker


def create_app(engine, config: ServerConfig, worker: Worker):
    """Build the Quart app serving ``engine`` through the running ``worker``.

    ``engine`` and ``worker`` come from `start_worker`. The worker is stopped
    gracefully in ``after_serving``. Routes: see ``ds4mlx.routes``.
    """
    from quart import Quart

    from ds4mlx.routes import register

    app = Quart("ds4mlx")
    # Generation can take minutes: no response timeout from Quart itself.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 120
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    state = ServerState(engine, config, worker)
    app.extensions["ds4mlx"] = state
    register(app)

    @app.after_serving
    async def _stop() -> None:
        await asyncio.to_thread(state.worker.stop)

    return app


# --------------------------------------------------------------------------- serving


def banner(engine, config: ServerConfig, url: str) -> None:
    """Print the startup banner (model, quant, context, KV bytes, BLAS, URL) with rich."""
    from rich.console import Console
    from rich.table import Table

    from ds4mlx.blas import active_blas

    try:
        import mlx.core as mx

        device = str(mx.default_device())
    except Exception:  # pragma: no cover
        device = "?"
    kv = _kv_estimate(engine)
    t = Table(show_header=False, box=None, padding=(0, 1))
    t.add_row("[bold]model[/]", f"{config.model_name}  ({engine.path})")
    t.add_row(
        "[bold]aliases[/]",
        ", ".join(
            f"{a} ({'thinking' if th else 'non-thinking'})" for a, th in config.aliases.items()
        ),
    )
    t.add_row("[bold]quant[/]", engine.quant_desc)
    t.add_row("[bold]context[/]", f"{engine.ctx_size} tokens")
    if config.max_tokens_cap is not None:
        t.add_row(
            "[bold]output[/]",
            f"at most {config.max_tokens_cap} tokens per request (demo cap, reported as a "
            "natural end of turn: the noise model never samples EOS; change with --tokens)",
        )
    elif config.default_max_tokens is not None:
        t.add_row("[bold]output[/]", f"{config.default_max_tokens} tokens when a request sets none")
    if kv:
        t.add_row("[bold]KV cache[/]", kv)
    t.add_row("[bold]device[/]", f"{device}, BLAS {active_blas()}")
    t.add_row(
        "[bold]url[/]",
        f"[cyan]{url}[/]  (OpenAI /v1/chat/completions, /v1/completions, /v1/responses; Anthropic /v1/messages)",
    )
    if config.api_key:
        t.add_row("[bold]auth[/]", "API key required (Authorization: Bearer / x-api-key)")
    if config.scripted:
        t.add_row("[bold red]scripted[/]", "POST /debug/script enabled (tests only)")
    if config.trace_path:
        t.add_row("[bold]trace[/]", config.trace_path)
    Console(stderr=True).print(t)


def kv_bytes_at(args, n_tokens: int, dtype_bytes: int) -> int:
    """KV-cache bytes of a session holding ``n_tokens`` (DESIGN.md §3 layout).

    Per layer: the raw ring of ``window_size`` rows, plus for compressed layers one row
    per ``ratio`` tokens, plus (ratio-``csa_ratio`` layers) the Lightning Indexer's rows.
    The compressor frontiers (a few rows) are left out.
    """
    total = 0
    ratios = list(args.compress_ratios) or [0] * args.n_layers
    for ratio in ratios[: args.n_layers]:
        rows = min(n_tokens, args.window_size) * args.head_dim
        if ratio:
            rows += (n_tokens // ratio) * args.head_dim
            if ratio == args.csa_ratio:
                rows += (n_tokens // ratio) * args.index_head_dim
        total += rows * dtype_bytes
    return total


def _kv_estimate(engine) -> str:
    """KV bytes at a full context, in the compute dtype (bf16 on GPU, float32 on CPU)."""
    try:
        import mlx.core as mx

        dtype_bytes = 2 if mx.default_device() == mx.gpu else 4
        n = kv_bytes_at(engine.args, engine.ctx_size, dtype_bytes)
    except Exception:  # pragma: no cover - an args object without the layout fields
        return ""
    return f"≈{n / 2**20:.1f} MiB at {engine.ctx_size} tokens (window ring + compressed rows)"


def serve(
    engine, config: ServerConfig, worker: Worker, *, ready: Callable[[str], Any] | None = None
) -> int:
    """Run the server until SIGINT/SIGTERM; return the exit code.

    ``engine``/``worker`` come from `start_worker`.

    Binds ``config.host:config.port``; the URL is printed in the banner and passed to
    ``ready`` once the sockets listen.
    """
    from hypercorn.asyncio import serve as hyper_serve
    from hypercorn.config import Config as HyperConfig

    app = create_app(engine, config, worker)
    hc = HyperConfig()
    hc.bind = [f"{_host_for_bind(config.host)}:{config.port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = 5.0
    hc.keep_alive_timeout = 75.0
    hc.h11_max_incomplete_size = 64 * 1024
    hc.websocket_max_message_size = config.max_body_bytes

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # pragma: no cover - Windows
                pass

        @app.before_serving
        async def _announce() -> None:
            url = _bound_url(hc, config)
            banner(engine, config, url)
            if ready:
                ready(url)

        async def shutdown_trigger() -> None:
            await stop.wait()
            # Stop generating first: the running job is cancelled and queued ones fail,
            # so their streams end with final events now and Hypercorn's graceful close
            # has nothing left to wait for.
            await asyncio.to_thread(worker.stop)

        await hyper_serve(app, hc, shutdown_trigger=shutdown_trigger)

    asyncio.run(main())
    return 0


def _host_for_bind(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _bound_url(hc, config: ServerConfig) -> str:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    return f"http://{_host_for_bind(host)}:{config.port}"


def demo_model_dir() -> Path:
    """The cached tiny demo checkpoint directory (``$XDG_CACHE_HOME/ds4mlx/demo``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ds4mlx" / "demo"


def ensure_demo_model(path: Path | None = None) -> Path:
    """Make the tiny demo checkpoint once (``ds4mlx.model.tiny.make_tiny``) and return it.

    Written to a temporary sibling directory and renamed, so an interrupted first run
    never leaves a half-written model behind.
    """
    import shutil
    import tempfile

    from ds4mlx.model.tiny import make_tiny

    path = path or demo_model_dir()
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=path.parent))
    try:
        make_tiny(tmp, **DEMO_TINY_KWARGS)
        try:
            os.replace(tmp, path)
        except OSError:
            # Another process won the race; use its copy.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# ``serve --demo``: output tokens per request unless --tokens says otherwise. The demo
# model's text is noise and it practically never samples EOS.
DEMO_MAX_TOKENS = 256

# make_tiny options for the demo model: float32, unquantized. Measured on the CPU
# (mlx[cpu] + OpenBLAS, 2 cores): decode 45 tok/s float32 vs 30 tok/s with the default
# q4 experts / q8 rest (MLX's CPU quantized matmuls cost more than they save at toy
# size); prefill ~1100 tok/s either way.
DEMO_TINY_KWARGS: dict[str, Any] = {"expert_bits": None, "other_bits": None}


NO_MODEL_MESSAGE = """\
ds4mlx serve: no model given.

  Serve a DeepSeek V4 Flash checkpoint directory (config.json + *.safetensors):
      ds4mlx serve -m /path/to/DeepSeek-V4-Flash-4bit      (or set DS4MLX_MODEL)
  MLX conversions such as mlx-community/DeepSeek-V4-Flash-4bit load directly, e.g.
      huggingface-cli download mlx-community/DeepSeek-V4-Flash-4bit --local-dir ~/models/ds4-flash

  Or try the server right now on the tiny demo model (random weights, real tokenizer
  and protocols; its text is noise):
      ds4mlx serve --demo
"""


def run_serve(args) -> int:
    """``ds4mlx serve``: load the model (or make the demo one) and serve until stopped."""
    import sys

    logging.basicConfig(
        level=logging.WARNING if getattr(args, "quiet", False) else logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    model = args.model or os.environ.get("DS4MLX_MODEL")
    if args.demo:
        if model:
            print("ds4mlx serve: give either --model or --demo, not both", file=sys.stderr)
            return 2
        from rich.console import Console

        path = demo_model_dir()
        if not (path / "config.json").is_file():
            Console(stderr=True).print(f"making the tiny demo model in {path} (once)…")
        model = str(ensure_demo_model(path))
    if not model:
        print(NO_MODEL_MESSAGE, file=sys.stderr, end="")
        return 2
    from ds4mlx.engine import Engine
    from ds4mlx.kv.policy import KVCacheSettings

    try:
        kv = KVCacheSettings.from_args(args)
    except ValueError as e:
        print(f"ds4mlx serve: {e}", file=sys.stderr)
        return 2
    if args.tokens is not None and args.tokens < 1:
        print("ds4mlx serve: --tokens must be >= 1", file=sys.stderr)
        return 2
    cap = (args.tokens or DEMO_MAX_TOKENS) if args.demo else None
    if args.tool_memory_max_ids < 1:
        print("ds4mlx serve: --tool-memory-max-ids must be >= 1", file=sys.stderr)
        return 2
    config = ServerConfig(
        model_name=args.served_model_name,
        default_max_tokens=cap if args.demo else args.tokens,
        max_tokens_cap=cap,
        api_key=args.api_key or os.environ.get("DS4MLX_API_KEY") or None,
        cors=args.cors,
        trace_path=args.trace,
        scripted=args.enable_scripted_decoding,
        keep_billing_header=args.keep_billing_header,
        keepalive_s=args.keepalive,
        host=args.host,
        port=args.port,
        kv=kv,
        tool_memory_max_ids=args.tool_memory_max_ids,
        exact_dsml_replay=not args.disable_exact_dsml_tool_replay,
    )
    try:
        engine, worker = start_worker(lambda: Engine.load(model, ctx_size=args.ctx), config)
    except Exception as e:  # LoadError, TokenizerError, OSError, ValueError…
        print(f"ds4mlx serve: cannot load model {model}: {e}", file=sys.stderr)
        return 2
    try:
        return serve(engine, config, worker)
    except OSError as e:
        print(f"ds4mlx serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
