"""The agent loop: one conversation driven on the live engine session (DESIGN.md §7).

The engine's single live :class:`~ds4mlx.engine.Session` *is* the conversation. The
first user message renders the whole prompt (``dsml.render_prompt``) and prefills it;
after that the loop only ever appends:

- after a turn that made tool calls: exactly the tool-result suffix
  (``dsml.render_tool_results_suffix``: ``EOS <｜User｜><tool_result>…</tool_result>…
  <｜Assistant｜><think>``), tokenized on its own — the same live-continuation path the
  server uses. The sampled thinking and the exact DSML bytes of the calls stay in the
  KV cache; the transcript is never re-rendered over them;
- after a final answer: ``EOS <｜User｜>text<｜Assistant｜><think>`` (or ``</think>`` in
  chat mode), likewise rendered for the new turn only.

Generation samples greedily while the DSML decoder is inside protocol structure and
with the session's sampling otherwise; parsed calls are validated and run through
:class:`~ds4mlx.agent.tools.Toolbox` (permissions ask through the UI) and their sampled
DSML is remembered in :class:`~ds4mlx.dsml.ToolMemory`.

**Live state vs transcript.** The loop keeps one marker, ``Agent.state``:

- ``"empty"``: no tokens;
- ``"turn_end"``: the live tokens end exactly after an assistant turn (its EOS was
  sampled but not fed); the next step appends a rendered suffix;
- ``"dirty"``: the live tokens end anywhere else (a prefill was interrupted, a model
  error reset the session, a snapshot was missing). The next step renders the whole
  transcript; if the live text is a byte prefix of it only the remaining bytes are
  tokenized and prefilled (DESIGN.md §3 rule 5), otherwise the session is rebuilt
  (longest disk-KV prefix, then prefill).

**Ctrl+C** (``interrupt`` or SIGINT while ``send`` runs) stops generation at the next
token, or prefill at the next chunk, and ``send`` returns ``"interrupted"``. An
interrupted turn is *closed*, never thrown away: if it stopped inside its reasoning,
``</think>`` is fed (one token) so the turn reads ``reasoning</think>content``; the
transcript records the partial reasoning and the raw partial text (a half-written tool
call stays as text and is never executed). So after an interrupted generation the live
tokens equal what the transcript renders to and the state is ``"turn_end"``. An
interrupted prefill leaves ``"dirty"``. Ctrl+C while a tool runs (or while asking for
permission) stops that tool; it and the calls not yet run get an error result that is
appended with the next message.

``Agent.exact`` says whether ``render_prompt(transcript)`` reproduces the live text.
It turns False only where the model's output cannot be re-rendered byte for byte
(malformed DSML, text after the tool-call block) or after ``/think``/``/nothink``
changes the mode of a conversation (the renderer has one mode per conversation). The
live state stays the truth either way; exactness only matters when a session must be
rebuilt from its transcript (compaction, a missing snapshot).

**Compaction** (:mod:`ds4mlx.agent.compaction`): before appending, if the session would
reach the soft limit, or the new text plus a reserve would not fit, the loop appends a
summary request (chat mode, tools ignored), generates the summary with the live model,
and rebuilds the session from ``system + summary + verbatim tail``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds4mlx.agent import compaction as cmp
from ds4mlx.agent.permissions import Permissions
from ds4mlx.agent.sessions import SessionBook, SessionRecord, title_of, transcript_digest
from ds4mlx.agent.tools import Toolbox, ToolOutcome
from ds4mlx.dsml import (
    Conversation,
    DecodeResult,
    Event,
    Message,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    ToolMemory,
    render_assistant_turn,
    render_prompt,
    render_segments,
    render_tool_results_suffix,
)
from ds4mlx.dsml.tokens import DSML, EOS, THINK_END
from ds4mlx.engine import (
    DEFAULT_CHUNK,
    FINISH_CANCELLED,
    FINISH_STOP,
    ContextOverflowError,
    SamplingParams,
    SessionState,
    SnapshotError,
    TurnSpec,
    run_turn,
)

# The turn loop's finish reasons as the agent's steps name them.
_AGENT_STOP = {FINISH_STOP: "eos", FINISH_CANCELLED: "interrupted"}

# Error kind of tool results for calls the user interrupted (ToolOutcome.error).
INTERRUPTED = "interrupted"

DEFAULT_SYSTEM_PROMPT = (
    "You are ds4mlx agent, a coding assistant working on the user's machine in the "
    "workspace directory {workspace}. Use the tools to list, read and search files, to "
    "write and edit them, and to run commands; paths are relative to the workspace. "
    "Work in small, verifiable steps: read before you edit, run the tests after a change. "
    "When the task is done, answer briefly with what you did."
)

# Disk snapshots below this many tokens are not worth a file (kv/policy.py default).
ANCHOR_MIN_TOKENS = 512


class AgentError(Exception):
    """A command the agent cannot carry out (unknown session, no session store, …)."""


# --------------------------------------------------------------------------- records


@dataclass
class Step:
    """One thing the loop did to the live session (for the UI, traces and tests).

    Attributes:
        kind: ``prompt`` (first prefill or rebuild), ``user`` (a new user turn appended),
            ``tool_results`` (the tool-result suffix appended), ``summary_request``,
            ``restore`` (from the disk KV store), ``answer``/``summary`` (generation).
        before: live tokens before the step (int).
        tokens: tokens fed by a prefill step, or tokens generated (int).
        planned: tokens the step meant to feed (== ``tokens`` unless interrupted).
        seconds: wall time (float).
        text: the text appended by a prefill step (exact), "" for generation steps.
        stop: for generation steps, why it stopped (``eos``, ``interrupted``,
            ``length``, ``context``).
    """

    kind: str
    before: int
    tokens: int
    planned: int
    seconds: float
    text: str = ""
    stop: str = ""


@dataclass
class Status:
    """Figures for the status line.

    Attributes:
        used: live tokens; ctx: context size (tokens); kv_bytes: KV-cache bytes;
        generated: tokens generated by the last turn; tok_s: its decode speed
        (tokens/s, 0 if unknown); prefilled: tokens prefilled for it; session: the
        session id or None; thinking: mode of new turns.
    """

    used: int
    ctx: int
    kv_bytes: int
    generated: int = 0
    tok_s: float = 0.0
    prefilled: int = 0
    prefill_tok_s: float = 0.0
    session: int | None = None
    thinking: bool = True


@dataclass
class CompactionInfo:
    """What a compaction did (for the UI).

    Attributes:
        reason: ``soft`` or ``hard``; phase: ``start`` or ``done``;
        before: live tokens before; after: tokens after the rebuild;
        summary: the summary text; by_model: the live model wrote it (else mechanical);
        kept: messages kept verbatim; dropped: messages replaced by the summary.
    """

    reason: str
    phase: str
    before: int
    after: int = 0
    summary: str = ""
    by_model: bool = True
    kept: int = 0
    dropped: int = 0


@dataclass
class SendResult:
    """How ``Agent.send`` ended.

    Attributes:
        status: ``done`` (a final answer), ``interrupted``, ``length`` (turn token limit),
            ``context`` (the context is full and compaction could not help), ``steps``
            (tool-step limit reached), ``error`` (engine failure; ``message`` says).
        turns: model turns generated.
        message: detail for ``context``/``error``.
    """

    status: str
    turns: int = 0
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "done"


@dataclass
class _Generated:
    stop: str
    result: DecodeResult
    raw: str
    start: int
    tokens: int
    seconds: float
    call_errors: dict[str, str] = field(default_factory=dict)


# ------------------------------------------------------------------------------ UI


class AgentUI:
    """What the loop tells the user, and asks. Every method is a no-op here.

    Subclass it (:class:`ds4mlx.agent.ui.RichUI`, test recorders). Methods are called on
    the loop's thread.
    """

    def ask(self, tool: str, summary: str) -> str:
        """Permission for ``tool`` doing ``summary``: ``"once"``, ``"always"`` or ``"deny"``."""
        return "deny"

    def prefill_progress(self, done: int, total: int) -> None:
        """Prefill progress in tokens of the current step (``done`` of ``total``)."""

    def prefill_done(self) -> None:
        """The current prefill step ended (completed or interrupted)."""

    def turn_start(self, kind: str) -> None:
        """A generation begins: ``"answer"`` or ``"summary"``."""

    def event(self, ev: Event) -> None:
        """A decoder event of the turn being generated (thinking, text, tool call parts)."""

    def turn_end(self, step: Step) -> None:
        """The generation ended (``step.stop`` says why)."""

    def tool_start(self, call: ToolCall, description: str) -> None:
        """A tool call is about to run."""

    def tool_result(self, call: ToolCall, outcome: ToolOutcome) -> None:
        """A tool call's result (what the model will see)."""

    def notice(self, text: str, level: str = "info") -> None:
        """A message from the agent itself (``info``, ``warn``, ``error``)."""

    def compaction(self, info: CompactionInfo) -> None:
        """Compaction started or finished."""

    def status(self, status: Status) -> None:
        """Status after a ``send`` (context used, speed)."""


# --------------------------------------------------------------------------- agent


class Agent:
    """The terminal agent's loop on an engine's live session.

    Args:
        engine: a loaded :class:`~ds4mlx.engine.Engine`; its ``session`` is used (and
            reset).
        workspace: directory the tools work in.
        ui: :class:`AgentUI` (default: silent, denies permissions).
        store: disk KV store (:class:`~ds4mlx.kv.store.DiskKVStore`) for session
            snapshots and shared prompt prefixes; None disables both.
        book: :class:`~ds4mlx.agent.sessions.SessionBook` for ``/list``/``/switch``;
            None disables sessions.
        yes: allow every tool without asking.
        thinking: thinking mode for new turns.
        sampling: :class:`~ds4mlx.engine.SamplingParams` (default: temperature 1,
            min_p 0.05, DESIGN.md §6).
        max_tokens: most tokens one model turn may generate (default: the context).
        max_steps: most tool rounds per user message (int).
        tool_output_tokens: token budget of one tool result (default ``ctx // 8``
            clamped to 64..4096).
        bash_timeout: default foreground command timeout (seconds).
        policy: :class:`~ds4mlx.agent.compaction.CompactionPolicy`.
        script: scripted decoding (tests only): one completion text per generation,
            consumed in order (answers and compaction summaries alike); an EOS is added
            to entries that lack one. When it runs out the model samples normally.
        system_prompt: system text; ``{workspace}`` is replaced. Default
            :data:`DEFAULT_SYSTEM_PROMPT`.
        chunk_size: prefill chunk (tokens).

    Raises:
        ValueError: ``workspace`` is not a directory.
    """

    def __init__(
        self,
        engine,
        workspace: str | Path,
        *,
        ui: AgentUI | None = None,
        store=None,
        book: SessionBook | None = None,
        yes: bool = False,
        thinking: bool = True,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
        max_steps: int = 100,
        tool_output_tokens: int | None = None,
        bash_timeout: float = 120.0,
        policy: cmp.CompactionPolicy | None = None,
        script: Iterable[str] | None = None,
        system_prompt: str | None = None,
        chunk_size: int = DEFAULT_CHUNK,
    ) -> None:
        self.engine = engine
        self.session = engine.session
        self.tok = engine.tokenizer
        self.ctx = engine.ctx_size
        self.ui = ui or AgentUI()
        self.store = store
        self.book = book
        self.sampling = sampling or SamplingParams(temperature=1.0, top_p=1.0, min_p=0.05)
        self.max_tokens = max_tokens or self.ctx
        self.max_steps = max_steps
        self.policy = policy or cmp.CompactionPolicy()
        self.chunk_size = chunk_size
        budget = tool_output_tokens or max(64, min(4096, self.ctx // 8))
        self.toolbox = Toolbox(
            Path(workspace),
            Permissions(ask=self._ask, yes=yes),
            output_token_budget=budget,
            count_tokens=lambda s: len(self.tok.encode(s)),
            bash_timeout=bash_timeout,
        )
        self.workspace = self.toolbox.workspace
        self.system_prompt = (system_prompt or DEFAULT_SYSTEM_PROMPT).replace(
            "{workspace}", str(self.workspace)
        )
        self.tool_memory = ToolMemory()
        self.script: deque[str] | None = deque(script) if script is not None else None
        self.steps: list[Step] = []
        self.compactions: list[CompactionInfo] = []
        self.record: SessionRecord | None = None
        self._cancel = False
        self._phase = "idle"
        self._last_gen: Step | None = None
        self._last_prefill = (0, 0.0)
        self._fresh(thinking)
        self.session.reset()
        if self.sampling.seed is not None:
            # Seed once per agent: the turn loop reseeds whenever its params carry a seed.
            self.session.seed(self.sampling.seed)
            self.sampling = dataclasses.replace(self.sampling, seed=None)

    # ----------------------------------------------------------------- public API

    @property
    def messages(self) -> list[Message]:
        """The transcript (system message first)."""
        return self.conv.messages

    @property
    def thinking(self) -> bool:
        return self.conv.thinking

    def live_text(self) -> str:
        """The text the live tokens decode to."""
        return self.tok.decode(self.session.tokens)

    def consistent(self) -> bool:
        """True if ``render_prompt(transcript)`` is exactly the live text.

        A transcript that ends with an assistant turn renders that turn's EOS, which the
        live state does not hold yet (it is fed with the next suffix); that EOS is
        allowed for.
        """
        full = self.render()
        live = self.live_text()
        if self.messages and self.messages[-1].role == "assistant":
            live += EOS
        return full == live

    def render(self) -> str:
        """``render_prompt`` of the transcript with this agent's context and tool memory."""
        return render_prompt(self.conv, context_size=self.ctx, tool_memory=self.tool_memory)

    def interrupt(self) -> None:
        """Stop the running generation at the next token (prefill: next chunk)."""
        self._cancel = True

    def send(self, text: str) -> SendResult:
        """Add a user message and run the model (and its tool calls) until it answers.

        Returns a :class:`SendResult`; never raises for model or tool behaviour.

        Raises:
            ValueError: ``text`` is empty.
        """
        if not text.strip():
            raise ValueError("empty message")
        self._cancel = False
        if self.record is None and self.book is not None:
            self.record = SessionRecord(
                id=self.book.new_id(), workspace=str(self.workspace), title=title_of(text)
            )
        self.messages.append(Message("user", text))
        self._last_gen = None
        self._last_prefill = (0, 0.0)
        with self._sigint():
            try:
                result = self._loop()
            except ContextOverflowError as e:
                self._resync()
                result = SendResult("context", message=str(e))
            except KeyboardInterrupt:
                self._resync()
                result = SendResult("interrupted")
            except Exception as e:  # an engine failure must not kill the REPL
                self._resync()
                result = SendResult("error", message=f"{type(e).__name__}: {e}")
            finally:
                self._phase = "idle"
        if result.status == "error":
            self.ui.notice(f"error: {result.message}", "error")
        self._persist()
        self.ui.status(self.status())
        return result

    def status(self) -> Status:
        """Current :class:`Status`."""
        g = self._last_gen
        pre_n, pre_s = self._last_prefill
        return Status(
            used=len(self.session.tokens),
            ctx=self.ctx,
            kv_bytes=self.session.kv_bytes(),
            generated=g.tokens if g else 0,
            tok_s=(g.tokens / g.seconds) if g and g.seconds > 0 else 0.0,
            prefilled=pre_n,
            prefill_tok_s=(pre_n / pre_s) if pre_s > 0 else 0.0,
            session=self.record.id if self.record else None,
            thinking=self.conv.thinking,
        )

    def set_thinking(self, on: bool) -> None:
        """Thinking mode for the next turns (``/think``, ``/nothink``).

        The renderer has one mode per conversation, so after a switch with earlier
        turns the transcript no longer re-renders to the live text (``exact`` False);
        the live session continues unaffected.
        """
        if on == self.conv.thinking:
            return
        if any(m.role == "assistant" for m in self.messages):
            self.exact = False
        self.conv.thinking = on

    # ---- sessions

    def sessions(self) -> list[SessionRecord]:
        """Stored sessions of this workspace, plus the current one (by id)."""
        if self.book is None:
            raise AgentError("sessions are off (no session directory)")
        recs = {r.id: r for r in self.book.list(str(self.workspace))}
        if self.record is not None:
            recs[self.record.id] = self.record
        return [recs[k] for k in sorted(recs)]

    def save(self, reason: str = "continued") -> SessionRecord | None:
        """Snapshot the live state to the disk KV store and write the transcript.

        Returns the session record (None when the session is empty). A snapshot that
        does not fit the store's budget is skipped (``kv_key`` None, with a notice).
        """
        if self.record is None:
            return None
        rec = self.record
        rec.messages = self.messages
        rec.thinking = self.conv.thinking
        rec.exact = self.exact
        if self.store is not None and self.session.tokens:
            snap = self.session.snapshot()
            try:
                entry = self.store.save(
                    text=self.live_text(),
                    tokens=self.session.tokens,
                    arrays=snap.arrays,
                    reason=reason,
                    meta=snap.meta,
                    tool_memory=self.tool_memory.entries(),
                )
            except (OSError, ValueError) as e:
                entry = None
                self.ui.notice(f"could not save the KV snapshot: {e}", "warn")
            if entry is None:
                self.ui.notice("KV snapshot not saved (over the disk budget?)", "warn")
            rec.kv_key = entry.key if entry else None
            rec.kv_tokens = entry.tokens if entry else 0
            rec.state = self.state
            rec.kv_digest = transcript_digest(self.messages)
        if self.book is not None:
            self.book.put(rec)
        return rec

    def new_session(self) -> None:
        """Save the current session (``evict`` snapshot) and start an empty one."""
        if self.record is not None and len(self.messages) > 1:
            self.save("evict")
        self.record = None
        self._fresh(self.conv.thinking)
        self.session.reset()
        self.toolbox.permissions.reset()

    def switch(self, sid: int) -> str:
        """Make session ``sid`` current: restore its disk-KV snapshot (no prefill).

        The current session is saved first (``evict``). When the target's snapshot is
        gone (evicted, budget), the transcript is loaded and the next message rebuilds
        the live state from it (longest disk prefix, then prefill).

        Returns:
            A one-line description of what happened.
        Raises:
            AgentError: sessions are off, or ``sid`` is unknown / of another workspace.
        """
        if self.book is None:
            raise AgentError("sessions are off (no session directory)")
        if self.record is not None and sid == self.record.id:
            return f"session {sid} is already the current one"
        rec = self.book.get(sid)
        if rec is None:
            raise AgentError(f"no session {sid}; /list shows the sessions")
        if rec.workspace != str(self.workspace):
            raise AgentError(f"session {sid} belongs to workspace {rec.workspace}")
        if self.record is not None and len(self.messages) > 1:
            self.save("evict")
        t0 = time.monotonic()
        self.record = rec
        self.conv = Conversation(
            messages=list(rec.messages), tools=self.toolbox.specs, thinking=rec.thinking
        )
        self.exact = rec.exact
        self.toolbox.permissions.reset()
        self.session.reset()
        self.state = "dirty"
        loaded = self._load_snapshot(rec.kv_key)
        if loaded is None:
            return (
                f"switched to session {sid} ({len(rec.messages)} messages); its KV snapshot "
                "is not on disk, the next message rebuilds it"
            )
        # A snapshot older than the transcript (no clean exit since): the live tokens
        # end somewhere before it, so continue by rendered-text prefix.
        self.state = rec.state if rec.snapshot_matches() else "dirty"
        n = len(self.session.tokens)
        self.steps.append(Step("restore", 0, n, n, time.monotonic() - t0))
        return (
            f"switched to session {sid}: restored {n} tokens from the disk KV cache in "
            f"{(time.monotonic() - t0) * 1e3:.0f} ms (no prefill)"
        )

    def close(self) -> None:
        """Save the session (``shutdown`` snapshot) and stop background jobs."""
        try:
            if self.record is not None and len(self.messages) > 1:
                self.save("shutdown")
        finally:
            self.toolbox.close()

    # --------------------------------------------------------------------- internals

    def _fresh(self, thinking: bool) -> None:
        self.conv = Conversation(
            messages=[Message("system", self.system_prompt)],
            tools=self.toolbox.specs,
            thinking=thinking,
        )
        self.state = "empty"
        self.exact = True

    def _ask(self, tool: str, summary: str) -> str:
        return self.ui.ask(tool, summary)

    @contextlib.contextmanager
    def _sigint(self) -> Iterator[None]:
        """Route SIGINT to ``interrupt`` while the model runs; to KeyboardInterrupt in tools."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        prev = signal.getsignal(signal.SIGINT)

        def handler(signum, frame):
            # A running command or a permission prompt is stopped by the exception;
            # MLX work must not be (Session resets itself on exceptions mid-forward).
            if self._phase == "tools":
                raise KeyboardInterrupt
            self._cancel = True

        signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, prev)

    def _resync(self) -> None:
        """After an unexpected exit: the live tokens no longer sit on a known boundary."""
        self.session.set_script(None)
        self.state = "dirty" if self.session.tokens else "empty"

    def _persist(self) -> None:
        """Write the transcript (not the KV state: that is saved at switch/save/quit)."""
        if self.book is None or self.record is None:
            return
        self.record.messages = self.messages
        self.record.thinking = self.conv.thinking
        self.record.exact = self.exact
        try:
            self.book.put(self.record)
        except OSError as e:
            self.ui.notice(f"could not write the session file: {e}", "warn")

    def _load_snapshot(self, key: str | None):
        """Restore the snapshot ``key`` into the session; return the Loaded, or None."""
        if not key or self.store is None:
            return None
        entry = next((e for e in self.store.entries() if e.key == key), None)
        if entry is None:
            return None
        return self._restore(entry)

    def _restore(self, entry):
        from ds4mlx.kv.store import KVStoreError

        try:
            loaded = self.store.load(entry)
            self.session.restore(SessionState(loaded.tokens, loaded.arrays, loaded.meta))
        except (KVStoreError, SnapshotError, ContextOverflowError) as e:
            self.ui.notice(f"disk KV snapshot unusable: {e}", "warn")
            self.session.reset()
            return None
        self.tool_memory.load(loaded.tool_memory.items())
        return loaded

    # ---- the loop

    def _loop(self) -> SendResult:
        turns = 0
        rounds = 0
        while True:
            st = self._advance()
            if st is not None:
                return SendResult(st, turns)
            gen = self._generate(
                thinking=self.conv.thinking, tools=True, max_tokens=self.max_tokens, kind="answer"
            )
            turns += 1
            msg = self._close_turn(gen, self.conv.thinking)
            self.messages.append(msg)
            if gen.stop != "eos":
                if gen.stop == "interrupted":
                    self.ui.notice("interrupted", "warn")
                return SendResult(gen.stop, turns)
            if msg.tool_calls:
                for c in msg.tool_calls:
                    if c.dsml:
                        self.tool_memory.put(c.id, c.dsml)
                if not self._run_tools(msg.tool_calls, gen.call_errors):
                    self.ui.notice("interrupted", "warn")
                    return SendResult("interrupted", turns)
            elif gen.result.errors and DSML in gen.raw:
                # It tried to call a tool and nothing parsed: say so instead of stopping.
                self.messages.append(
                    Message(
                        "user",
                        "[agent] error: your tool call could not be parsed ("
                        + "; ".join(gen.result.errors[:3])
                        + "). Nothing was run. Write the call again in the DSML format.",
                    )
                )
            else:
                return SendResult("done", turns)
            rounds += 1
            if rounds >= self.max_steps:
                self.ui.notice(f"stopped after {rounds} tool rounds (--max-steps)", "warn")
                return SendResult("steps", turns)

    def _pending_from(self) -> int:
        """Index of the first message not yet in the live state (after the last assistant)."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == "assistant":
                return i + 1
        return 1

    def _suffix(self, conv: Conversation) -> str:
        """Text to append after the live assistant turn: EOS + the turns that follow it."""
        if any(m.role == "tool" for m in conv.messages[self._last_assistant(conv) + 1 :]):
            return render_tool_results_suffix(
                conv, context_size=self.ctx, tool_memory=self.tool_memory
            )
        segs = render_segments(conv, context_size=self.ctx, tool_memory=self.tool_memory)
        k = max(i for i, s in enumerate(segs) if s.role == "assistant")
        return EOS + "".join(s.text for s in segs[k + 1 :])

    @staticmethod
    def _last_assistant(conv: Conversation) -> int:
        for i in range(len(conv.messages) - 1, -1, -1):
            if conv.messages[i].role == "assistant":
                return i
        return -1

    def _advance(self) -> str | None:
        """Bring the live state up to the transcript; compact first when needed.

        Returns None when ready to generate, else a ``SendResult`` status.
        """
        s = self.session
        if self.state == "turn_end":
            suffix = self._suffix(self.conv)
            ids = self.tok.encode(suffix)
            why = self.policy.check(len(s.tokens), len(ids), self.ctx)
            if why is not None:
                return self._compact(why)
            has_results = "<tool_result>" in suffix and any(
                m.role == "tool" for m in self.messages[self._pending_from() :]
            )
            kind = "tool_results" if has_results else "user"
            return None if self._append(suffix, ids, kind) else "interrupted"
        # empty or dirty: render everything and continue by text prefix if possible.
        full = self.render()
        live = self.live_text() if s.tokens else ""
        if live and full.startswith(live):
            rest = full[len(live) :]
            ids = self.tok.encode(rest)
            why = self.policy.check(len(s.tokens), len(ids), self.ctx)
            if why is not None:
                return self._compact(why)
            return None if self._append(rest, ids, "user") else "interrupted"
        n = len(self.tok.encode(full))
        why = self.policy.check(0, n, self.ctx)
        if why == "hard":
            return self._compact(why)
        return self._rebuild(full)

    def _append(self, text: str, ids: list[int], kind: str) -> bool:
        """Prefill ``ids`` (the tokens of ``text``); False if interrupted (state dirty)."""
        s = self.session
        before = len(s.tokens)
        self._phase = "model"
        t0 = time.monotonic()
        try:
            n = s.prefill(
                ids,
                chunk_size=self.chunk_size,
                progress=self.ui.prefill_progress,
                cancel=lambda: self._cancel,
            )
        finally:
            self.ui.prefill_done()
        dt = time.monotonic() - t0
        self.steps.append(Step(kind, before, n, len(ids), dt, text))
        pn, ps = self._last_prefill
        self._last_prefill = (pn + n, ps + dt)
        if n < len(ids):
            # Cancelled before the first chunk: nothing changed, the state still holds.
            if n > 0:
                self.state = "dirty"
            self.ui.notice("interrupted during prefill", "warn")
            return False
        if self.tok.decode(ids) != text:
            self.exact = False  # the tokenizer did not round-trip this text
        return True

    def _rebuild(self, full: str) -> str | None:
        """Reset the session to ``full``: longest disk-KV prefix, then prefill the rest."""
        s = self.session
        s.reset()
        self.state = "dirty"
        t0 = time.monotonic()
        live = ""
        loaded = None
        if self.store is not None:
            try:
                loaded = self.store.lookup_and_load(full)
            except OSError as e:
                self.ui.notice(f"disk KV lookup failed: {e}", "warn")
            if loaded is not None:
                try:
                    s.restore(SessionState(loaded.tokens, loaded.arrays, loaded.meta))
                    self.tool_memory.load(loaded.tool_memory.items())
                    live = loaded.text
                    n = len(s.tokens)
                    self.steps.append(Step("restore", 0, n, n, time.monotonic() - t0))
                    self.ui.notice(f"reused {n} tokens from the disk KV cache")
                except (SnapshotError, ContextOverflowError) as e:
                    self.ui.notice(f"disk KV snapshot unusable: {e}", "warn")
                    s.reset()
                    live = ""
        rest = full[len(live) :]
        if not live and self.store is not None:
            # Save the system prompt + tools prefix once: every new session shares it.
            segs = render_segments(self.conv, context_size=self.ctx, tool_memory=self.tool_memory)
            if len(segs) > 2 and segs[1].role == "system":
                anchor = segs[0].text + segs[1].text
                ids = self.tok.encode(anchor)
                if len(ids) >= ANCHOR_MIN_TOKENS and full.startswith(anchor):
                    if not self._append(anchor, ids, "prompt"):
                        return "interrupted"
                    self._save_anchor(anchor)
                    rest = full[len(anchor) :]
        if not self._append(rest, self.tok.encode(rest), "prompt"):
            return "interrupted"
        self.state = "ready"
        return None

    def _save_anchor(self, anchor: str) -> None:
        snap = self.session.snapshot()
        try:
            self.store.save(
                text=anchor,
                tokens=self.session.tokens,
                arrays=snap.arrays,
                reason="cold",
                meta=snap.meta,
            )
        except (OSError, ValueError) as e:
            self.ui.notice(f"could not save the prompt prefix: {e}", "warn")

    def _next_script(self) -> list[int] | None:
        """The next scripted completion's ids (tests only), EOS-terminated, or None."""
        if not self.script:
            return None
        ids = self.tok.encode(self.script.popleft())
        if not ids or ids[-1] != self.tok.eos_id:
            ids.append(self.tok.eos_id)
        return ids

    def _generate(self, *, thinking: bool, tools: bool, max_tokens: int, kind: str) -> _Generated:
        """Sample and feed one assistant turn with the engine's turn loop (the EOS is
        sampled but not fed)."""
        s = self.session
        start = len(s.tokens)
        self._phase = "model"
        self.ui.turn_start(kind)

        def show(ev: Event) -> None:
            if kind == "summary" and not isinstance(ev, ThinkingDelta | TextDelta):
                return  # tools are off while summarizing: calls are not shown or run
            self.ui.event(ev)

        spec = TurnSpec(
            self.sampling,
            max_tokens=max_tokens,
            thinking=thinking,
            tools=tuple(self.conv.tools) if tools else (),
        )
        res = run_turn(
            s, self.tok, spec, emit=show, cancel=lambda: self._cancel, script=self._next_script()
        )
        stop = _AGENT_STOP.get(res.finish, res.finish)
        fed = len(s.tokens) - start
        step = Step(kind, start, fed, fed, res.decode_s, stop=stop)
        self.steps.append(step)
        if kind == "answer":
            self._last_gen = step
        self.ui.turn_end(step)
        raw = self.tok.decode(s.tokens[start:])
        return _Generated(stop, res.decoded, raw, start, fed, res.decode_s, res.call_errors)

    def _close_turn(self, gen: _Generated, thinking: bool) -> Message:
        """The transcript message for a generated turn; make the live state end on it.

        A turn that stopped inside its reasoning gets ``</think>`` fed, so that the live
        text reads ``reasoning</think>content`` as the renderer writes it.
        """
        s = self.session
        raw = gen.raw
        self.state = "turn_end"
        if thinking and THINK_END not in raw:
            if s.room() >= 1:
                self._phase = "model"
                s.decode(self.tok.think_end_id)
                raw += THINK_END
            else:
                self.state = "dirty"
        if gen.stop == "eos":
            res = gen.result
            msg = Message(
                "assistant",
                content=res.content,
                reasoning=res.reasoning if thinking else None,
                tool_calls=list(res.tool_calls),
            )
            if render_assistant_turn(msg, thinking=thinking, eos=False) != raw:
                self.exact = False
            return msg
        # Interrupted or cut: keep the raw text as it is in the live state; a partial
        # tool call stays text and is never run.
        if thinking and THINK_END in raw:
            reasoning, content = raw.split(THINK_END, 1)
        elif thinking:
            reasoning, content = raw, ""
        else:
            reasoning, content = None, raw
        return Message("assistant", content=content, reasoning=reasoning)

    def _run_tools(self, calls: list[ToolCall], call_errors: dict[str, str]) -> bool:
        """Run ``calls`` in order, appending one tool message each; False if interrupted."""
        interrupted = False
        for call in calls:
            outcome: ToolOutcome | None = None
            interrupted = interrupted or self._cancel  # Ctrl+C between two calls
            try:
                if interrupted:
                    outcome = ToolOutcome(
                        False,
                        "error: not run: the user interrupted the agent before this call",
                        INTERRUPTED,
                    )
                elif call.id in call_errors:
                    outcome = ToolOutcome(
                        False,
                        f"error: malformed tool call ({call_errors[call.id]}); it was not run. "
                        "Call the tool again with well-formed DSML.",
                        "invalid_arguments",
                    )
                else:
                    self._phase = "tools"
                    self.ui.tool_start(call, self.toolbox.describe(call.name, call.arguments))
                    outcome = self.toolbox.run(call.name, call.arguments)
            except KeyboardInterrupt:
                interrupted = True
                outcome = ToolOutcome(
                    False,
                    "error: interrupted by the user while it ran; its outcome is unknown "
                    "(it may have run in part)",
                    INTERRUPTED,
                )
            finally:
                self._phase = "model"
                if outcome is None:  # an unexpected error escaped: still answer the call
                    outcome = ToolOutcome(False, "error: the agent failed to run this call")
                self.messages.append(Message("tool", outcome.text, tool_call_id=call.id))
            self.ui.tool_result(call, outcome)
        return not interrupted

    # ---- compaction

    def _message_tokens(self, m: Message) -> int:
        if m.role == "assistant":
            text = render_assistant_turn(
                m, thinking=self.conv.thinking, tool_memory=self.tool_memory
            )
        elif m.role == "tool":
            text = f"<tool_result>{m.content}</tool_result>"
        else:
            text = m.content
        return len(self.tok.encode(text)) + 2

    def _compact(self, reason: str) -> str | None:
        """Summarize, keep the tail verbatim, rebuild; then the state is ready to generate."""
        s = self.session
        msgs = self.messages
        before = len(s.tokens)
        self.ui.compaction(CompactionInfo(reason, "start", before))
        keep_from = self._pending_from()
        if keep_from < len(msgs) and msgs[keep_from].role == "tool" and keep_from > 1:
            keep_from -= 1  # pending results stay with the assistant turn that called
        summary, by_model = "", False
        words = max(50, int(self.policy.summary_max(self.ctx) * 0.6))
        last_a = self._last_assistant(self.conv)
        if self.state == "turn_end" and last_a > 0:
            req = Message("user", cmp.summary_instruction(words))
            tmp = Conversation(
                messages=msgs[: last_a + 1] + [req], tools=self.conv.tools, thinking=False
            )
            suffix = self._suffix(tmp)
            ids = self.tok.encode(suffix)
            limit = self.policy.summary_max(self.ctx)
            if len(s.tokens) + len(ids) + limit <= self.ctx:
                if not self._append(suffix, ids, "summary_request"):
                    return "interrupted"
                gen = self._generate(thinking=False, tools=False, max_tokens=limit, kind="summary")
                if gen.stop == "interrupted":
                    self.state = "dirty"
                    self.ui.notice("interrupted while summarizing", "warn")
                    return "interrupted"
                if gen.result.tool_calls:
                    self.ui.notice("tool calls in the summary were ignored (not run)", "warn")
                summary = gen.result.content.strip()
                by_model = bool(summary)
                # The summary turn now sits in the live state; the rebuild replaces it.
                self.state = "dirty"
        if not summary:
            summary = cmp.mechanical_summary(msgs[:keep_from])
        start = cmp.tail_start(
            msgs, keep_from, self._message_tokens, self.policy.tail_budget(self.ctx)
        )
        soft = self.policy.soft_limit(self.ctx)
        while True:
            new = cmp.rebuild(msgs, start, summary, cmp.first_request(msgs[:start]))
            conv = Conversation(messages=new, tools=self.conv.tools, thinking=self.conv.thinking)
            full = render_prompt(conv, context_size=self.ctx, tool_memory=self.tool_memory)
            n_full = len(self.tok.encode(full))
            over = n_full + self.policy.reserve(self.ctx) > self.ctx or n_full >= soft
            if not over or start >= keep_from:
                break
            # Still too big (or would compact again at once): keep fewer old messages.
            start += 1
            while start < keep_from and msgs[start].role == "tool":
                start += 1
        if n_full + self.policy.reserve(self.ctx) > self.ctx:
            self.ui.notice(
                f"compaction cannot help: the kept messages alone need {n_full} tokens "
                f"of a {self.ctx}-token context",
                "error",
            )
            return "context"
        self.conv = conv
        self.exact = True
        st = self._rebuild(full)
        info = CompactionInfo(
            reason,
            "done",
            before,
            after=len(s.tokens),
            summary=summary,
            by_model=by_model,
            kept=len(msgs) - start,
            dropped=start - 1,
        )
        self.compactions.append(info)
        self.ui.compaction(info)
        return st


def describe_messages(messages: list[Message]) -> Iterator[tuple[str, str]]:
    """``(role label, text)`` pairs for showing a transcript (``/history``)."""
    for m in messages:
        if m.role == "system":
            continue
        if m.role == "assistant":
            if m.reasoning:
                yield "thinking", m.reasoning
            if m.content:
                yield "assistant", m.content
            for c in m.tool_calls:
                yield "tool call", f"{c.name} {_json(c.arguments)}"
        elif m.role == "tool":
            yield "tool result", m.content
        else:
            yield m.role, m.content


def _json(v: Any) -> str:
    import json

    try:
        return json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(v)


__all__ = [
    "Agent",
    "AgentError",
    "AgentUI",
    "CompactionInfo",
    "DEFAULT_SYSTEM_PROMPT",
    "SendResult",
    "Status",
    "Step",
    "describe_messages",
]
