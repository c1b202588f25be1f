"""The inference thread: one `Worker` runs jobs one at a time on the live session."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from ds4mlx.dsml import Rendered, TextDelta
from ds4mlx.jobs import (
    Failure,
    GenRequest,
    Job,
    JobDone,
    JobFailed,
    JobStarted,
    LiveLabels,
    PrefillProgress,
    Script,
    ToolCallDone,
    TurnSpec,
)
from ds4mlx.kv.live import LIVE_TOOLS, TOOL_RESULT_IDS
from ds4mlx.server.trace import Tracer

log = logging.getLogger("ds4mlx.server")


# --------------------------------------------------------------------------- worker


class LoadInterrupted(KeyboardInterrupt):
    """Ctrl-C while the worker thread loads the engine. The load cannot be stopped midway
    (MLX reads the weights in its own calls) and a process that finalizes the
    interpreter while a thread is inside MLX aborts ("terminate called without an active
    exception", SIGABRT): whoever catches this ends the process with ``os._exit``."""


class Worker:
    """The inference thread: runs `Job`s one at a time on the engine's live session.

    Args:
        tool_memory: ``ds4mlx.dsml.ToolMemory`` the sampled tool calls are stored in.
        tracer: a `Tracer` (may be disabled).
        scripts: deque of scripted continuations (texts or `Script`s) for
            ``--enable-scripted-decoding``; each job pops the next one.
        kv_settings: ``ds4mlx.kv.policy.KVCacheSettings`` of the prompt cache's disk
            tier, or None.

    Attributes:
        cache: the ``ds4mlx.kv.cache.PromptCache`` (set once the engine is loaded): live
            states, what each job reuses, disk snapshots.

    A job is the prompt cache's one call sequence: ``cache.begin`` (a lease on the live
    state to extend, with its plan; the whole prompt is tokenized only if the plan needs
    it; the context check, the one place it is made) → the engine's turn loop
    (``ds4mlx.engine.run_turn``: prefill, sample, feed) with the request's `TurnSpec`, its
    events passed on as `ds4mlx.jobs` events → ``lease.finish`` (what a later prompt may
    continue from). Failures are neutral (`ds4mlx.jobs.JobFailed`): the route words them.
    """

    def __init__(
        self, *, tool_memory, tracer: Tracer | None = None, scripts=None, kv_settings=None
    ):
        self.engine = None
        self.session = None
        self.tokenizer = None
        self.cache: Any = None
        self.kv_settings = kv_settings
        self.tool_memory = tool_memory
        self.tracer = tracer or Tracer(None)
        self.scripts: collections.deque[str | Script] = (
            scripts if scripts is not None else collections.deque()
        )
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self.current: Job | None = None
        self._active = None  # the session the running job uses
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.jobs_done = 0
        self.jobs_submitted = 0
        # Non-zero once a failure stopped the server (`_check_fatal`): serve's exit code.
        self.exit_code = 0

    # ---- event-loop side

    def start(self, load: Callable[[], Any]):
        """Start the thread; it calls ``load()`` to build the engine, then serves jobs.

        MLX arrays belong to the thread that creates them (MLX streams are per thread),
        so the engine is loaded on the inference thread itself. Blocks until loaded and
        returns the engine (read its plain attributes only from other threads).

        Raises:
            Exception: whatever ``load`` raised (the thread has exited).
            LoadInterrupted: Ctrl-C while ``load`` runs (it goes on: the process must
                end without finalizing the interpreter).
        """
        ready = threading.Event()
        box: dict[str, Any] = {}

        def main() -> None:
            import mlx.core as mx

            try:
                if _load(self, load, box):
                    ready.set()
                    self._run()
            finally:
                # Destroy this thread's MLX streams while the thread is alive, however it
                # ends (a failed load too): left to process exit, their destruction aborts
                # the process ("terminate called without an active exception", mlx 0.32).
                mx.clear_streams()
                ready.set()

        self._thread = threading.Thread(target=main, name="ds4mlx-worker", daemon=True)
        try:
            self._thread.start()
            ready.wait()
        except KeyboardInterrupt:
            if self._thread.is_alive():
                raise LoadInterrupted from None
            raise
        if "error" in box:
            self._thread.join()  # its streams are cleared: nothing MLX is left to exit
            raise box["error"]
        return self.engine

    def submit(self, request: GenRequest) -> Job:
        """Queue ``request`` (FIFO) and return its `Job`. Call on the event loop."""
        job = Job(request, asyncio.get_running_loop())
        # Checked and queued under stop()'s lock: a job queued after its drain is never run.
        with self._lock:
            refused = self._stopping.is_set()
            if not refused:
                self._pending += 1
                self.jobs_submitted += 1
                self._queue.put(job)
        if refused:
            log.info("%s job %d refused: the server is shutting down", request.path, job.id)
            job.emit(JobFailed(Failure.SHUTTING_DOWN))
        return job

    @property
    def queued(self) -> int:
        """Jobs waiting or running. A waiting job whose client went away (its cancel set:
        it never runs, the worker drops it when it comes up) no longer counts."""
        with self._lock:
            pending = self._pending
        with self._queue.mutex:  # a snapshot of the waiting jobs (no call blocks here)
            gone = sum(1 for j in self._queue.queue if j is not None and j.cancelled())
        return max(0, pending - gone)

    @property
    def busy(self) -> bool:
        return self.current is not None

    @property
    def stopping(self) -> bool:
        """True once `stop` began: new jobs are refused (the shutdown saves may still run)."""
        return self._stopping.is_set()

    def stop(self, timeout: float = 300.0) -> None:
        """Graceful stop: cancel the running job, fail queued ones, join the thread.

        Idempotent. ``timeout`` (seconds) bounds the wait for the thread, which runs the
        ``on_shutdown`` hooks (e.g. a disk snapshot) before it exits.
        """
        with self._lock:  # see submit
            self._stopping.set()
        cur = self.current
        if cur is not None:
            if not cur.answered:  # (an answered job is only finishing its bookkeeping)
                log.info("shutdown: %s job %d interrupted", cur.request.path, cur.id)
            cur.cancel.set()
        # Fail everything still queued so their clients get an answer.
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                log.info("shutdown: %s job %d refused before it started", job.request.path, job.id)
                job.emit(JobFailed(Failure.SHUTTING_DOWN))
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
            # Recorded before `_refused` looks: a stop() then cancels it or was seen. (After,
            # a stop() in between found no job to cancel or refuse, and it ran to its end.)
            self.current = job
            try:
                if not _refused(self, job):
                    self._run_job(job)
            except BaseException as e:  # noqa: BLE001 - the worker must survive anything
                lost = _lost_rank(self, e)
                if lost is None:
                    log.exception("job %d failed", job.id)
                # A failure inside the model may leave half-fed caches: start clean.
                try:
                    (self._active or self.session).reset()
                except Exception:  # pragma: no cover
                    log.exception("session reset failed")
                job.emit(_failure(e, lost))
                if isinstance(e, KeyboardInterrupt | SystemExit):
                    raise
                if lost is not None:
                    _stop_for(self, f"job {job.id} failed: {lost}")
            finally:
                self.current = None
                self._finish(job)
        _stop_if_gone(self)
        try:
            # After a lost rank nothing more is sent to the ranks: no shutdown snapshot.
            self.cache.shutdown(save=self.exit_code == 0)
        except Exception:
            log.exception("shutdown save failed")

    def _finish(self, job: Job) -> None:
        with self._lock:
            self._pending -= 1
        self.jobs_done += 1

    def _run_job(self, job: Job) -> None:
        from ds4mlx.engine import (
            FINISH_CONTEXT,
            FINISH_LENGTH,
            ContextOverflowError,
            run_turn,
        )
        from ds4mlx.kv.cache import ContextFull, UnknownToolId

        req = job.request
        tok = self.tokenizer
        t_start = time.monotonic()
        try:
            lease = self.cache.begin(cache_prompt(req, tok))
        except UnknownToolId as e:
            job.emit(JobFailed(Failure.UNKNOWN_TOOL_ID, tool_id=e.tool_id))
            return
        except ContextFull as e:
            job.emit(_prompt_error(e.n_prompt, e.n_ctx))
            return
        plan = lease.plan
        s = self._active = lease.session  # with --sessions N: the state it chose
        # After begin's checks: a refused job generates nothing and must not take the
        # next scripted text.
        script = self.scripts.popleft() if self.scripts else None
        decision, detail = _labelled(plan.decision, plan.detail, req.labels)
        self.tracer.write(
            job.id, "prompt", path=req.path, text=_text(req), tokens=plan.prompt_tokens
        )
        self.tracer.write(
            job.id,
            "plan",
            decision=decision,
            cached=plan.cached,
            prompt=plan.prompt_tokens,
            detail=detail,
        )
        job.emit(JobStarted(plan.prompt_tokens, plan.cached, decision))
        spec = _fitted(req.turn, s.ctx_size - plan.prompt_tokens, script)
        hooks = _job_hooks(job)
        try:
            result = run_turn(
                s,
                tok,
                spec,
                prefill=plan,
                emit=self._emitter(job),
                cancel=job.cancelled,
                progress=_throttled_progress(job),
                tool_memory=self.tool_memory,
                after_token=lease.after_token,
                script=_script_ids(script, tok),
                hooks=hooks,
            )
        except ContextOverflowError as e:
            job.emit(_prompt_error(e.have + e.adding, e.ctx_size))
            return
        if self.tracer.enabled:
            self.tracer.write(job.id, "output", text=result.raw, finish=result.finish)
        if result.finish == FINISH_LENGTH and spec.max_tokens < req.turn.max_tokens:
            result.finish = FINISH_CONTEXT  # the room left, not the client's limit, ended it
        at_boundary = hooks.at_boundary and result.prefilled == len(plan.suffix_tokens)
        self._done(job, lease, result, t_start, decision, detail, at_boundary)

    def _emitter(self, job: Job) -> Callable[[Any], None]:
        """``emit`` for the turn loop: its events are job events (the trace sees the
        parser's)."""

        def emit(ev: Any) -> None:
            if self.tracer.enabled and not isinstance(ev, TextDelta):
                self.tracer.write(job.id, "parser", event=ev)
            job.emit(ev)

        return emit

    def _done(
        self, job: Job, lease, result, t_start, decision: str, detail: str, at_boundary=False
    ) -> None:
        """Report the turn (bindings, event, trace, log line); ``at_boundary``: a steered
        or cancelled turn that ends at a turn boundary binds as an end of turn."""
        plan = lease.plan
        outcome = _outcome(result, plan, decision)
        try:
            lease.finish(result, at_boundary=at_boundary)
        except Exception:
            log.exception("after-generation bookkeeping failed")
        self.engine.speculation.add(result)
        job.emit(outcome)
        self.tracer.write(
            job.id,
            "done",
            **{k: v for k, v in dataclasses.asdict(outcome).items() if k != "reasoning"},
        )
        _log_job(job, plan, result, outcome, t_start, detail)


def _load(worker: Worker, load: Callable[[], Any], box: dict[str, Any]) -> bool:
    """On the worker thread: build ``worker``'s engine and open its prompt cache; False
    with ``box["error"]`` set when either raised. The error's frames are cleared here, so
    the arrays they held (a half-built engine) are freed on this thread, before its
    streams are."""
    try:
        engine = load()
        from ds4mlx.kv.cache import PromptCache

        worker.engine = engine
        worker.session = engine.session
        worker.tokenizer = engine.tokenizer
        # On this thread: the disk cache's arrays belong to it.
        worker.cache = PromptCache.open(engine, worker.kv_settings, worker.tool_memory)
        return True
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        traceback.clear_frames(e.__traceback__)
        worker.engine = worker.session = worker.tokenizer = None
        box["error"] = e
        return False


def _outcome(result, plan, decision: str) -> JobDone:
    """The job's final event from its `TurnResult` and plan."""
    return JobDone(
        finish=result.finish,
        stop_sequence=result.stop_sequence,
        prompt_tokens=plan.prompt_tokens,
        cached_tokens=plan.cached,
        completion_tokens=result.completion_tokens,
        reasoning_tokens=result.reasoning_tokens,
        tool_calls=[ToolCallDone(c.id, c.name, c.arguments, c.dsml) for c in result.tool_calls],
        reasoning=result.reasoning,
        prefill_s=result.prefill_s,
        decode_s=result.decode_s,
        decision=decision,
        text=result.text,
    )


def _refused(worker: Worker, job: Job) -> bool:
    """Answer ``job`` ``cancelled`` without running it when its client is gone or the
    server is stopping; True if so."""
    stopping = worker._stopping.is_set()
    if not (job.cancelled() or stopping):
        return False
    why = "the server is shutting down" if stopping else "client gone"
    log.info("%s job %d cancelled before it started: %s", job.request.path, job.id, why)
    job.emit(JobDone("cancelled", None, 0, 0, 0))
    return True


def _lost_rank(worker: Worker, e: BaseException) -> str | None:
    """The lost-rank line (``rank 1 lost: …``) when ``e`` means a rank of a split model is
    gone (``lost_peer``), else None."""
    lost = getattr(worker.engine.model, "lost_peer", None)
    return lost(e) if lost is not None else None


def _failure(e: BaseException, lost: str | None) -> JobFailed:
    """A failed job's event: a lost rank (the server stops: a 503 naming the rank, not a
    fault of the server) or an internal error naming the exception's type."""
    if lost is not None:
        return JobFailed(Failure.RANK_LOST, detail=lost)
    return JobFailed(Failure.INTERNAL, detail=f"{type(e).__name__}: {e}")


def _stop_for(worker: Worker, line: str) -> None:
    """A failure no later job can avoid (a pipeline rank is gone: every forward call needs
    it) stops the server with exit code 1 instead of failing every request after it; one
    log line says why (``line``), no traceback."""
    log.error("%s; stopping the server", line)
    worker.exit_code = 1
    os.kill(os.getpid(), signal.SIGTERM)


def _stop_if_gone(worker: Worker) -> None:
    """Before the shutdown snapshots: a split model's rank that died while the server
    idled (nothing failed; the launcher's SIGTERM is what stopped the server) makes the
    exit code 1 with the lost-rank line, and no snapshot is saved."""
    closed = getattr(worker.engine.model, "peer_closed", None)
    line = closed() if closed is not None and worker.exit_code == 0 else None
    if line is not None:
        log.error("%s; stopping the server without shutdown snapshots", line)
        worker.exit_code = 1


def _log_job(job: Job, plan, result, outcome: JobDone, t_start: float, detail: str) -> None:
    """The one log line per job: path, decision, token counts, rates, finish, queue wait,
    for a drafting turn its drafted / accepted tokens and tokens per target forward, and
    for a constrained turn how its grammar went (``grammar=complete``, `TurnResult`)."""
    from ds4mlx.engine.speculative import draft_words

    n = outcome.completion_tokens
    log.info(
        "%s %s%s prompt=%d cached=%d generated=%d prefill=%s decode=%.1f tok/s finish=%s "
        "wait=%.2fs job=%d%s%s",
        job.request.path,
        outcome.decision,
        f" {detail}" if detail else "",
        outcome.prompt_tokens,
        outcome.cached_tokens,
        n,
        _prefill_words(len(plan.suffix_tokens), result.prefilled, result.prefill_s),
        (n - 1) / result.decode_s if result.decode_s > 0 and n > 1 else 0.0,
        outcome.finish,
        t_start - job.submitted,
        job.id,
        draft_words(result),
        f" grammar={result.grammar}" if result.grammar else "",
    )


def _text(req: GenRequest) -> str | None:
    """The prompt text of a request (a ``Rendered``'s text, a raw string, or None)."""
    return req.prompt.text if isinstance(req.prompt, Rendered) else req.prompt


def cache_prompt(req: GenRequest, tok):
    """The prompt cache's ``Prompt`` of a request: a job's, and `ServerState.charged`'s
    prediction of its usage (the same prompt, so the same plan)."""
    from ds4mlx.kv.cache import Prompt

    return Prompt(
        _prompt_tokens(req, tok),
        req.prompt,
        req.conversation,
        thinking=req.turn.thinking,
        state_key=req.state_key,
        salt=req.salt,
        side=req.side,
        whole=req.turn.prompt_logprobs is not None,
        room=0 if req.turn.prompt_logprobs is not None and req.turn.max_tokens == 0 else 1,
    )


def _prompt_tokens(req: GenRequest, tok) -> list[int] | Callable[[], list[int]]:
    """The request's prompt ids, or a call that tokenizes its rendering (the planner
    makes it only for a rule that needs the whole prompt's tokens)."""
    if req.prompt_tokens is not None:
        return req.prompt_tokens
    prompt = req.prompt
    if isinstance(prompt, Rendered):
        return lambda: tok.encode(prompt.text, content=prompt.content)
    return lambda: tok.encode(prompt or "")


def _labelled(decision: str, detail: str, labels: LiveLabels | None) -> tuple[str, str]:
    """The plan's decision and log detail in the route's names (`LiveLabels`)."""
    if labels is None or decision != LIVE_TOOLS:
        return decision, detail
    return labels.live_tools, detail.replace(f"match={TOOL_RESULT_IDS}", f"match={labels.ids}", 1)


def _prompt_error(n: int, ctx: int) -> JobFailed:
    """The failure of an empty prompt or one the context cannot hold (with its counts)."""
    if n == 0:
        return JobFailed(Failure.EMPTY_PROMPT)
    return JobFailed(Failure.CONTEXT_FULL, n_prompt_tokens=n, n_ctx=ctx)


def _job_hooks(job: Job):
    """The turn-loop hooks of ``job``: its steer flag around its sampling wishes (logit
    bias, then the repetition penalty, then presence and frequency penalties, then the
    EOS ban of ``min_tokens`` / ``ignore_eos``)."""
    from ds4mlx.engine import Steering, chain_hooks
    from ds4mlx.engine.bias import EndBan, LogitBias, Penalties, RepetitionPenalty

    req = job.request
    bias = LogitBias(req.logit_bias) if req.logit_bias else None
    rep = req.repetition_penalty
    repetition = RepetitionPenalty(rep) if rep != 1.0 else None
    pres, freq = req.presence_penalty, req.frequency_penalty
    penalties = Penalties(pres, freq) if pres or freq else None
    # Steer and cancel arrive through the job's flags; a cancelled turn is closed at a
    # turn boundary too, so the next request can continue it.
    ban = None
    if req.ignore_eos or req.min_tokens:
        ban = EndBan(None if req.ignore_eos else req.min_tokens)
    inner = chain_hooks(bias, repetition, penalties, ban)
    return Steering(job.steer.is_set, inner=inner, close_cancelled=True)


def _fitted(spec: TurnSpec, room: int, script: Script | str | None) -> TurnSpec:
    """``spec`` for a prompt that leaves ``room`` tokens: ``max_tokens`` at most the room
    (at least 1; a turn of 0, a scored prompt alone, stays 0); when the room, not the
    route's limit, bounds the turn, a demo cap no longer stands for EOS (the turn ends
    with ``length``)."""
    changes: dict[str, Any] = {"greedy_after_script": bool(getattr(script, "greedy", False))}
    if spec.max_tokens and spec.max_tokens >= room:
        changes.update(max_tokens=max(1, room), cap_is_eos=False)
    if not spec.parse:
        changes["top_logprobs"] = None
    return dataclasses.replace(spec, **changes)


def _prefill_words(planned: int, fed: int, seconds: float) -> str:
    """The log line's prefill field: a rate, how far a cancelled prefill got, or that
    nothing needed prefilling (a rate of 0 would read as a stall)."""
    if planned == 0:
        return "none (all cached)"
    if fed < planned:
        # Cut short: only what was fed counts; a rate over a partial chunk or none at all
        # would be noise.
        return f"cancelled after {fed}/{planned} tokens in {seconds:.2f}s"
    return f"{fed / seconds if seconds > 0 else 0.0:.1f} tok/s"


def _script_ids(script: Script | str | None, tok) -> list[int] | None:
    if script is None:
        return None
    if isinstance(script, str):
        return tok.encode(script)
    return list(script.tokens) if script.tokens is not None else tok.encode(script.text)


def _throttled_progress(job: Job) -> Callable[[int, int], None]:
    """Prefill progress → `PrefillProgress` events, at most every 0.5 s (and the last)."""
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] > 0.5 or done == total:
            last[0] = now
            job.emit(PrefillProgress(done, total))

    return progress
