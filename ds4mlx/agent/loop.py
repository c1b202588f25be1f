"""The agent loop: one conversation driven on the live engine session (docs/ARCHITECTURE.md §7).

The engine's single live :class:`~ds4mlx.engine.Session` *is* the conversation. Each
step renders the transcript (``dsml.render``) and begins a lease on the prompt cache
(:class:`ds4mlx.kv.cache.PromptCache`, the same one the server uses) for what to prefill; after
each turn the agent binds its rendering of the transcript to the live state
(``live-transcript``), so the cache only ever appends:

- after a turn that made tool calls: exactly the tool-result suffix
  (``dsml.render_tool_results_suffix``: ``EOS <｜User｜><tool_result>…</tool_result>…
  <｜Assistant｜><think>``), tokenized on its own — the same live-continuation path the
  server uses. The sampled thinking and the exact DSML bytes of the calls stay in the
  KV cache; the transcript is never re-rendered over them;
- after a final answer: ``EOS <｜User｜>text<｜Assistant｜><think>`` (or ``</think>`` in
  chat mode), likewise rendered for the new turn only.

Generation is the engine's one turn loop (:func:`ds4mlx.engine.run_turn`: structure
sampled greedily, payload with the session's sampling); parsed calls are validated and run through
:class:`~ds4mlx.agent.tools.Toolbox` (permissions ask through the UI) and their sampled
DSML is remembered in :class:`~ds4mlx.dsml.ToolMemory`.

**Live state vs transcript.** The loop keeps one marker, ``Agent.state`` (a
:class:`~ds4mlx.agent.live.LiveState`):

- ``"empty"``: no tokens;
- ``"turn_end"``: the live tokens end exactly after an assistant turn (its EOS was
  sampled but not fed); the next step appends a rendered suffix;
- ``"dirty"``: the live tokens end anywhere else (a prefill was interrupted, a model
  error reset the session, a snapshot was missing). The cache then continues by
  rendered-text prefix when the live text is a byte prefix of the transcript's
  rendering, otherwise it rebuilds the session (longest disk-KV prefix, then prefill).

**Ctrl+C** (``interrupt`` or SIGINT while ``send`` runs) stops generation at the next
token, or prefill at the next chunk, and ``send`` returns ``"interrupted"``. An
interrupted turn is *closed*, never thrown away: if it stopped inside its reasoning,
``</think>`` is fed (one token) so the turn reads ``reasoning</think>content``; the
transcript records the partial reasoning and the raw partial text (a half-written tool
call stays as text and is never executed). So after an interrupted generation the live
tokens equal what the transcript renders to and the state is ``"turn_end"`` (the
``</think>`` is the turn loop's one forced feed, ``Turn.force_feed``). An
interrupted prefill leaves ``"dirty"``. Ctrl+C while a tool runs (or while asking for
permission) stops that tool; it and the calls not yet run get an error result that is
appended with the next message.

``Agent.exact`` says whether ``render_prompt(transcript)`` reproduces the live text.
It turns False only where the model's output cannot be re-rendered byte for byte
(malformed DSML, text after the tool-call block) or after ``/think``/``/nothink``
changes the mode of a conversation (the renderer has one mode per conversation). The
live state stays the truth either way; exactness only matters when a session must be
rebuilt from its transcript (compaction, a missing snapshot).

**Parts.** ``Agent`` composes :class:`~ds4mlx.agent.steps.Steps` (one turn),
:class:`~ds4mlx.agent.compactor.Compactor` and
:class:`~ds4mlx.agent.session_control.SessionControl` around one shared
:class:`~ds4mlx.agent.live.Live`; each turn is the prompt cache's call sequence
(``PromptCache.begin`` → ``run_turn(prefill=lease.plan)`` → ``lease.finish``), the
server worker's own.

**Compaction** (:mod:`ds4mlx.agent.compactor`, :mod:`ds4mlx.agent.compaction`): before appending, if the session would
reach the soft limit, or the new text plus a reserve would not fit, the loop appends a
summary request (chat mode, tools ignored), generates the summary with the live model,
and rebuilds the session from ``system + summary + verbatim tail``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ds4mlx.agent import compaction as cmp
from ds4mlx.agent.compactor import Compactor
from ds4mlx.agent.events import (
    AgentError,
    AgentUI,
    CompactionInfo,
    SendResult,
    Status,
    Step,
    describe_messages,
)
from ds4mlx.agent.hooks import Hooks
from ds4mlx.agent.live import Live, LiveState
from ds4mlx.agent.permissions import Permissions
from ds4mlx.agent.session_control import SessionControl
from ds4mlx.agent.sessions import SessionBook, SessionRecord, title_of
from ds4mlx.agent.steps import Steps
from ds4mlx.agent.tools import Toolbox
from ds4mlx.dsml import Conversation, Message, Rendered, ToolMemory
from ds4mlx.dsml.tokens import DSML, EOS
from ds4mlx.engine import DEFAULT_CHUNK, ContextOverflowError, SamplingParams
from ds4mlx.kv.cache import PromptCache
from ds4mlx.kv.plan import ContextFull
from ds4mlx.kv.policy import KVCacheSettings

DEFAULT_SYSTEM_PROMPT = (
    "You are ds4mlx agent, a coding assistant working on the user's machine in the "
    "workspace directory {workspace}. Use the tools to list, read and search files, to "
    "write and edit them, and to run commands; paths are relative to the workspace. "
    "Work in small, verifiable steps: read before you edit, run the tests after a change. "
    "When the task is done, answer briefly with what you did."
)


# Room a context must leave beside the system prompt and tools for a message and a reply.
MIN_ROOM_TOKENS = 256


def _check_room(base: Rendered, tok, ctx: int) -> None:
    """Refuse a context that cannot hold ``base`` (the empty transcript's rendering: the
    system prompt and the tool definitions) and a turn. Known before any message: said
    at start, not as every message's "does not fit even after compaction".

    Raises:
        ValueError: with the ``--ctx`` to give.
    """
    need = len(tok.encode(base.text, content=base.content)) + MIN_ROOM_TOKENS
    if need > ctx:
        raise ValueError(
            f"a {ctx}-token context cannot hold the agent's system prompt and tool "
            f"definitions and a turn: give --ctx {need} or more"
        )


class Agent:
    """The terminal agent's loop on an engine's live session.

    Args:
        engine: a loaded :class:`~ds4mlx.engine.Engine`; its ``session`` is used (and
            reset).
        workspace: directory the tools work in.
        ui: :class:`AgentUI` (default: silent, denies permissions).
        store: disk KV store (:class:`~ds4mlx.kv.store.DiskKVStore`): session snapshots
            and shared prefixes (the prompt cache's disk tier); None disables both.
        book: :class:`~ds4mlx.agent.sessions.SessionBook` for ``/list``/``/switch``;
            None disables sessions.
        yes: allow every tool without asking.
        thinking: thinking mode for new turns.
        sampling: :class:`~ds4mlx.engine.SamplingParams` (default: T 1, min_p 0.05).
        max_tokens: most tokens one model turn may generate (default: the context).
        cap_is_eos: reaching ``max_tokens`` ends the turn as an EOS would (the demo
            model's cap: it practically never samples EOS).
        max_steps: most tool rounds per user message (int).
        tool_output_tokens: token budget of one tool result (``ctx // 8`` in 64..4096).
        tool_options: passed to :class:`~ds4mlx.agent.tools.Toolbox` (``bash_timeout``,
            ``env_policy``, ``mcp`` — its tools are in the first prompt —, job limits).
        policy: :class:`~ds4mlx.agent.compaction.CompactionPolicy`.
        script: scripted decoding (tests only): one completion text per generation,
            consumed in order (answers and compaction summaries alike); an EOS is added
            to entries that lack one. When it runs out the model samples normally.
        system_prompt: system text, ``{workspace}`` replaced (:data:`DEFAULT_SYSTEM_PROMPT`).
        chunk_size: prefill chunk (tokens).
        hooks: :class:`~ds4mlx.agent.hooks.Hooks` around every response (observe only).

    Raises:
        ValueError: ``workspace`` is not a directory; a context too small (`_check_room`).
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
        cap_is_eos: bool = False,
        max_steps: int = 100,
        tool_output_tokens: int | None = None,
        policy: cmp.CompactionPolicy | None = None,
        script: Iterable[str] | None = None,
        system_prompt: str | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        hooks: Hooks | None = None,
        **tool_options: Any,
    ) -> None:
        self.engine = engine
        self.tok = engine.tokenizer
        self.ctx = engine.ctx_size
        self.ui = ui or AgentUI()
        self.store = store
        sampling = sampling or SamplingParams(temperature=1.0, top_p=1.0, min_p=0.05)
        self.max_tokens = max_tokens or self.ctx
        self.max_steps = max_steps
        self.policy = policy or cmp.CompactionPolicy()
        budget = tool_output_tokens or max(64, min(4096, self.ctx // 8))
        self.toolbox = Toolbox(
            Path(workspace),
            Permissions(ask=self._ask, yes=yes),
            output_token_budget=budget,
            count_tokens=lambda s: len(self.tok.encode_plain(s)),
            **tool_options,
        )
        self.workspace = self.toolbox.workspace
        self.system_prompt = (system_prompt or DEFAULT_SYSTEM_PROMPT).replace(
            "{workspace}", str(self.workspace)
        )
        self.tool_memory = ToolMemory()
        settings = None
        if store is not None:
            # No prompt-end saves: the agent keeps its transcript and continues it live;
            # it has no client retries or replays to serve, and saves synchronously.
            settings = KVCacheSettings(
                disk_dir=str(store.dir),
                disk_space_mb=max(1, store.budget_bytes >> 20),
                prompt_end=False,
            )
        # The server's prompt cache: live continuation, prefixes, disk tier.
        cache = PromptCache.open(engine, settings, self.tool_memory, store=store, background=False)
        self.live = Live(engine, cache, self.tool_memory, self.ui, self._conversation(thinking))
        if sampling.seed is not None:
            # Seed once per agent: the turn loop reseeds whenever its params carry a seed.
            engine.session.seed(sampling.seed)
            sampling = dataclasses.replace(sampling, seed=None)
        self.sampling = sampling
        queued = deque(script) if script is not None else None
        self.turns = Steps(
            self.live, self.toolbox, sampling, self.policy, queued, cap_is_eos, chunk_size, hooks
        )
        self.compactor = Compactor(self.live, self.turns, self.policy)
        self.book = book
        self.control = SessionControl(self.live, book, self.workspace, self.toolbox, self._fresh)
        self.turns.persist = self.control.persist
        cache.reset()
        _check_room(self.render(), self.tok, self.ctx)

    # ----------------------------------------------------------------- public API

    @property
    def session(self):
        """The live ``ds4mlx.engine.Session``."""
        return self.engine.session

    # The shared live conversation's parts, read-only (tests, the REPL's /status).
    conv = property(lambda self: self.live.conv, doc="The transcript ``Conversation``.")
    messages = property(lambda self: self.live.messages, doc="The transcript's messages.")
    state = property(lambda self: self.live.state, doc="The `LiveState` marker.")
    exact = property(lambda self: self.live.exact, doc="The transcript re-renders exactly.")
    steps = property(lambda self: self.live.steps, doc="Every `Step` done.")
    compactions = property(lambda self: self.live.compactions, doc="Finished compactions.")
    record = property(lambda self: self.live.record, doc="The current `SessionRecord`.")
    thinking = property(lambda self: self.live.conv.thinking, doc="Thinking mode.")

    def live_text(self) -> str:
        """The text the live tokens decode to."""
        return self.tok.decode(self.session.tokens)

    def consistent(self) -> bool:
        """True if ``render_prompt(transcript)`` is exactly the live text.

        A transcript that ends with an assistant turn renders that turn's EOS, which the
        live state does not hold yet (it is fed with the next suffix); that EOS is
        allowed for.
        """
        full = self.render().text
        live = self.live_text()
        if self.messages and self.messages[-1].role == "assistant":
            live += EOS
        return full == live

    def render(self) -> Rendered:
        """``render`` of the transcript with this agent's context and tool memory."""
        return self.live.render()

    def interrupt(self) -> None:
        """Stop the running generation at the next token (prefill: next chunk)."""
        self.live.cancel = True

    def sessions(self) -> list[SessionRecord]:
        """Stored sessions of this workspace, plus the current one (`SessionControl`)."""
        return self.control.sessions()

    def save(self, reason: str = "continued") -> SessionRecord | None:
        """Snapshot the live state and write the transcript (`SessionControl.save`)."""
        return self.control.save(reason)

    def new_session(self) -> None:
        """Save the current session and start an empty one (`SessionControl`)."""
        self.control.new_session()

    def switch(self, sid: int) -> str:
        """Make session ``sid`` current (`SessionControl.switch`)."""
        return self.control.switch(sid)

    def close(self) -> None:
        """Save the session (``shutdown`` snapshot) and stop background jobs."""
        self.control.close()

    def send(self, text: str) -> SendResult:
        """Add a user message and run the model (and its tool calls) until it answers.

        Returns a :class:`SendResult`; never raises for model or tool behaviour.

        Raises:
            ValueError: ``text`` is empty.
        """
        if not text.strip():
            raise ValueError("empty message")
        lv = self.live
        lv.cancel = False
        if lv.record is None and self.book is not None:
            lv.record = SessionRecord(
                id=self.book.new_id(), workspace=str(self.workspace), title=title_of(text)
            )
        self.messages.append(sent := Message("user", text))
        self.turns.user_text = text
        self.turns.last_gen = None
        self.turns.last_prefill = (0, 0.0)
        with _sigint_to(self):
            try:
                result = self._loop()
            except (ContextOverflowError, ContextFull) as e:
                self._resync()
                result = SendResult("context", message=str(e))
            except KeyboardInterrupt:
                self._resync()
                result = SendResult("interrupted")
            except Exception as e:  # an engine failure must not kill the REPL
                self._resync()
                result = SendResult("error", message=f"{type(e).__name__}: {e}")
            finally:
                lv.phase = "idle"
        if result.status == "context" and self.messages and self.messages[-1] is sent:
            result = self.compactor.take_back(sent)
        if result.status == "error":
            self.ui.notice(f"error: {result.message}", "error")
        self.control.persist()
        self.ui.status(self.status())
        return result

    def status(self) -> Status:
        """Current :class:`Status`."""
        g = self.turns.last_gen
        pre_n, pre_s = self.turns.last_prefill
        return Status(
            used=len(self.session.tokens),
            ctx=self.ctx,
            kv_bytes=self.session.kv_bytes(),
            generated=g.tokens if g else 0,
            tok_s=(g.tokens / g.seconds) if g and g.seconds > 0 else 0.0,
            prefilled=pre_n,
            prefill_tok_s=(pre_n / pre_s) if pre_s > 0 else 0.0,
            session=self.record.id if self.record else None,
            thinking=self.thinking,
        )

    def set_thinking(self, on: bool) -> None:
        """Thinking mode for the next turns (``/think``, ``/nothink``).

        The renderer has one mode per conversation, so after a switch with earlier
        turns the transcript no longer re-renders to the live text (``exact`` False);
        the live session continues unaffected.
        """
        lv = self.live
        if on == lv.conv.thinking:
            return
        if any(m.role == "assistant" for m in self.messages):
            lv.exact = False
        lv.conv.thinking = on
        if lv.state == LiveState.TURN_END:
            # The live state is still this transcript, now rendered in the new mode.
            lv.bind_transcript()

    # --------------------------------------------------------------------- internals

    def _conversation(self, thinking: bool) -> Conversation:
        return Conversation(
            messages=[Message("system", self.system_prompt)],
            tools=self.toolbox.specs,
            thinking=thinking,
        )

    def _fresh(self, thinking: bool) -> None:
        self.live.conv = self._conversation(thinking)
        self.live.state = LiveState.EMPTY
        self.live.exact = True

    def _ask(self, tool: str, summary: str) -> str:
        return self.ui.ask(tool, summary)

    def _resync(self) -> None:
        """After an unexpected exit: the live tokens no longer sit on a known boundary."""
        self.session.set_script(None)
        self.live.settle()

    # ---- the loop

    def _loop(self) -> SendResult:
        turns = 0
        rounds = 0
        while True:
            out = self.turns.answer(self.compactor, self.max_tokens)
            if isinstance(out, str):
                return SendResult(out, turns)
            gen, msg = out
            turns += 1
            if gen.stop != "eos":
                if gen.stop == "interrupted":
                    self.ui.notice("interrupted", "warn")
                return SendResult(gen.stop, turns)
            if msg.tool_calls:
                if not self.turns.run_tools(msg.tool_calls, gen.call_errors):
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


@contextlib.contextmanager
def _sigint_to(agent: Agent) -> Iterator[None]:
    """Route SIGINT to ``agent.interrupt`` while the model runs; to KeyboardInterrupt while
    tools run (main thread only: signals are delivered there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        # A running command or a permission prompt is stopped by the exception; MLX work
        # must not be (Session resets itself on exceptions mid-forward).
        if agent.live.phase == "tools":
            raise KeyboardInterrupt
        agent.live.cancel = True

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)


__all__ = [
    "Agent",
    "AgentError",
    "AgentUI",
    "CompactionInfo",
    "DEFAULT_SYSTEM_PROMPT",
    "SendResult",
    "SessionBook",
    "SessionRecord",
    "Status",
    "Step",
    "describe_messages",
]
