"""The inference thread: one `Worker` runs jobs one at a time on the live session."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ds4mlx.server.jobs import (
    GenRequest,
    Job,
    JobDone,
    JobFailed,
    JobStarted,
    PrefillProgress,
    RawText,
    Script,
    TokenLogprob,
    ToolCallDone,
)
from ds4mlx.server.trace import Tracer

log = logging.getLogger("ds4mlx.server")


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
