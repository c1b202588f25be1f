"""The prompt cache: live states in memory, their snapshots on disk, and one call
sequence to put a prompt into one of them (docs/ARCHITECTURE.md §3).

The unit is the *live state* (`ds4mlx.kv.resident.Resident`: a ``Session`` with its
bindings, the tool ids whose DSML it holds, its save tracker). Every caller — the
server's worker and the agent — runs a turn the same way, on the inference thread::

    lease = cache.begin(Prompt(tokens, rendered, conversation, thinking))
    result = run_turn(lease.session, tok, spec, prefill=lease.plan,
                      after_token=lease.after_token, ...)
    lease.finish(result)

`PromptCache.begin` picks a resident state (the best live match, else a free one, else
the least valuable, `ds4mlx.kv.resident.ResidentStates`), lets the
`ds4mlx.kv.plan.Planner` keep, restore or reset it, and returns a `Lease` carrying the
`ds4mlx.kv.plan.Plan`. The lease is the only way to the state for the turn: its
``after_token`` takes the ``continued`` disk saves, its ``finish`` records what a later
prompt may continue from. The agent's other uses of its state go through the cache too:
`PromptCache.append` (the summary request after a turn), `save` (``/save``, quit),
`resume` (``/switch``), `reset` (``/new``).

`PromptCache.peek` answers, without changing anything or queueing a job, what a prompt
would reuse and be charged (``count_tokens``), and `summary` describes the cache as plain
Python values (``/health``: routes never see sessions or arrays).

Failures are neutral facts (`ds4mlx.kv.plan.UnknownToolId`,
`ds4mlx.kv.plan.ContextFull`): each caller words them in its own protocol.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ds4mlx.dsml import Rendered
from ds4mlx.kv.plan import (
    ContextFull,
    Plan,
    Planner,
    PromptRejected,
    Tokens,
    UnknownToolId,
    lazy_tokens,
    reset,
)
from ds4mlx.kv.resident import Resident, ResidentStates

log = logging.getLogger("ds4mlx.kv")

__all__ = [
    "ContextFull",
    "Lease",
    "Prompt",
    "PromptCache",
    "PromptRejected",
    "Reuse",
    "UnknownToolId",
]


@dataclass(frozen=True)
class Prompt:
    """A prompt as the cache sees it (no protocol, no JSON).

    Attributes:
        tokens: the tokenization of the whole prompt (ids), or a call returning it: made
            at most once, and only when a rule needs it (a live continuation tokenizes
            its suffix alone).
        rendered: the rendered prompt: a ``ds4mlx.dsml.Rendered`` (its content spans
            tokenize as plain text), a raw ``str``, or None for token-id prompts.
        conversation: the ``ds4mlx.dsml.Conversation`` it was rendered from, or None.
        thinking: the prompt opened ``<think>`` (its turn's visible key is bound).
        transcript: the caller keeps its own transcript and binds it (the agent:
            ``Lease.finish(transcript_key=…)``); the turn binds nothing else.
        state_key: the client's name for the conversation (an agent or session id, a
            prompt cache key), or None: a prompt that continues no live state goes to
            the state last used under that key (`PromptCache.begin`).
        salt: the cache salt (``""``: none): opaque to the cache (the server derives it
            from a request's ``cache_salt`` and API key). A live state or snapshot made
            under one salt is never reused by a prompt of another.
        side: the client marked it a side request (a helper agent's fork of a
            conversation): it runs on a side state or room (`PromptCache.begin`), never
            on a conversation's state, even one it would continue.
        whole: every token is prefilled (the prompt is scored: a kept or restored
            prefix has no logits per position), on a side state as ``side``.
        room: tokens the job needs after the prompt: 1 (it generates), or 0 (a scored
            prompt that generates nothing may fill the context).
    """

    tokens: Tokens
    rendered: Rendered | str | None = None
    conversation: Any = None
    thinking: bool = False
    transcript: bool = False
    state_key: str | None = None
    salt: str = ""
    side: bool = False
    whole: bool = False
    room: int = 1

    @property
    def text(self) -> Rendered | None:
        return Rendered.of(self.rendered) if self.rendered is not None else None


@dataclass(frozen=True)
class Reuse:
    """What `PromptCache.peek` found: ``cached`` prompt tokens a live state would keep
    (0: none), on state ``state`` (None: no live match), and ``prompt_tokens``: the
    prompt's tokens as the session would hold them — the usage a request for it is
    charged (kept + the suffix prefilled; with no live match, its whole tokenization)."""

    cached: int
    state: int | None
    prompt_tokens: int


class Lease:
    """One turn's hold on a live state (from `PromptCache.begin` or `append`).

    Attributes:
        state: the `Resident` the turn runs on.
        plan: the `Plan` (suffix, checkpoints): hand it to ``run_turn(prefill=…)``.
        prompt: the `Prompt`, or None for an appended continuation.
    """

    def __init__(
        self, cache: PromptCache, state: Resident, plan: Plan, prompt, saves=True, before=None
    ):
        self._cache = cache
        self.state = state
        self.plan = plan
        self.prompt = prompt
        self._saves = saves and cache.tier is not None
        self._before = before  # (live tokens, bindings) when the lease began

    def abandon(self) -> None:
        """Give the lease up unused (nothing prefilled or generated): a plan that kept
        the whole state leaves it bound as before (the agent compacts instead of
        continuing; its summary request continues the turn the state ends with)."""
        if self._before is None:
            return
        n, saved = self._before
        if self.plan.keep == n == len(self.state.session.tokens):
            self.state.bindings.restore(saved)

    @property
    def session(self):
        """The ``ds4mlx.engine.Session`` to prefill and generate on."""
        return self.state.session

    def after_token(self, session=None) -> None:
        """``run_turn``'s ``after_token``: a ``continued`` snapshot at an unsaved
        frontier (nothing without a disk tier, or for an appended continuation)."""
        if self._saves:
            self._cache.tier.after_token(self.state)

    def finish(
        self, result, *, transcript_key: Rendered | str | None = None, at_boundary: bool = False
    ) -> None:
        """Record what a later prompt may continue this state from.

        Args:
            result: the turn's ``ds4mlx.engine.TurnResult`` (its finish, tool calls,
                visible text; ``decoded`` is None for a raw turn, which binds nothing).
            transcript_key: a caller that keeps its transcript (the agent): its
                rendering through this turn, ending with the turn's EOS. Then only that
                binding is made (the caller renders its own next prompt).
            at_boundary: the turn ended at a turn boundary although it was not an EOS
                (``ds4mlx.engine.Steering.at_boundary``: steered, or cancelled and
                closed): it binds as an end of turn does.
        """
        p = self.prompt
        chat = p is not None and not p.transcript and result.decoded is not None
        finish = (
            "stop" if at_boundary and result.finish in ("steered", "cancelled") else result.finish
        )
        self._cache.planner.after_generation(
            self.state,
            # Dropped calls (``tool_choice: none``) are in the live state but in no
            # rendering of this turn: it binds nothing, as a cut turn does.
            finish="dropped-calls" if getattr(result, "dropped_calls", 0) else finish,
            tool_calls=result.tool_calls,
            # The rendering with its content spans: the turn's visible keys carry where
            # the prompt spells special tokens as plain text.
            prompt_text=p.text if chat else None,
            thinking=p is not None and p.thinking,
            text=result.text,
            transcript_key=transcript_key,
        )


class PromptCache:
    """Live states and disk snapshots of one engine (see the module doc).

    Args:
        engine: the ``ds4mlx.engine.Engine`` (``session``, tokenizer, context size,
            ``new_session()`` for more states).
        tool_memory: the ``ds4mlx.dsml.ToolMemory`` of sampled calls, or None.
        disk: a `ds4mlx.kv.disk.DiskCache`, or None (no disk tier).
        sessions: the most live states kept (``--sessions N``; 1: the engine's own).

    Called on the inference thread, except `bound_tool_ids`, `summary` and `peek` (any
    thread: plain Python values).
    """

    @classmethod
    def open(
        cls, engine, settings=None, tool_memory=None, *, store=None, background: bool = True
    ) -> PromptCache:
        """A cache for ``engine``, with a disk tier when ``settings`` enable one.

        Args:
            engine: the loaded engine (on the inference thread: the disk tier's arrays
                belong to it).
            settings: ``ds4mlx.kv.policy.KVCacheSettings``, or None (no disk tier).
            tool_memory: the ``ds4mlx.dsml.ToolMemory``, or None; the entries persisted
                in the disk tier are reloaded into it.
            store: an open ``ds4mlx.kv.store.DiskKVStore`` of ``settings.disk_dir`` to
                use (the agent's), or None to open one.
            background: write snapshot files on a writer thread (the server); False
                writes them before a save returns (the agent records their keys).
        Raises:
            OSError: the disk directory cannot be created.
        """
        disk = None
        if settings is not None and settings.enabled:
            from ds4mlx.kv.disk import DiskCache

            disk = DiskCache(engine, settings, store=store, background=background)
            if tool_memory is not None and tool_memory.enabled:
                n = disk.reload_tool_memory(tool_memory)
                if n:
                    log.info("kv cache: reloaded %d tool-memory entries", n)
        sessions = settings.sessions if settings is not None else 1
        side = settings.min_tokens if settings is not None else 0
        return cls(engine, tool_memory, disk, sessions=sessions, side_tokens=side)

    def __init__(
        self, engine, tool_memory=None, disk=None, *, sessions: int = 1, side_tokens: int = 0
    ):
        from ds4mlx.kv.tier import DiskTier

        self.engine = engine
        self.disk = disk
        self.side_tokens = side_tokens
        self.tier = DiskTier(engine, disk, tool_memory) if disk is not None else None
        self.planner = Planner(engine, tool_memory, self.tier)
        self.states = ResidentStates(engine, sessions, Resident(0, engine.session))

    @property
    def state(self) -> Resident:
        """The state the last job ran on (the engine's own session at first): the
        agent's one state."""
        return max(self.states.states, key=lambda r: r.last_job)

    # ---------------------------------------------------------------- one turn

    def begin(self, prompt: Prompt) -> Lease:
        """Put ``prompt`` into a live state and lease it for one turn.

        Raises:
            UnknownToolId: a tool result nothing explains (nothing was changed).
            ContextFull: the planned prompt is empty or leaves no room for a token (the
                state may have been replaced already, as for any plan).
        """
        rendered = prompt.text
        tokens = lazy_tokens(prompt.tokens)
        r, why = self._choose(prompt, rendered, tokens)
        before = (len(r.session.tokens), r.bindings.save())
        plan = self.planner.plan(
            r, tokens, rendered, prompt.conversation, prompt.salt, whole=prompt.whole
        )
        if self.states.n > 1:
            plan.detail = f"{plan.detail} state={r.index}/{self.states.n} via={why}".strip()
        plan.session = r.session
        n, ctx = plan.prompt_tokens, r.session.ctx_size
        if n == 0 or n + prompt.room > ctx:
            # The route's early bound used the whole prompt's tokens; a text-prefix plan
            # may differ by a few. Refuse rather than overflow.
            raise ContextFull(n, ctx)
        return Lease(self, r, plan, prompt, before=before)

    def append(self, tail: Rendered) -> Lease | None:
        """Continue the state after its caller's turn with ``tail`` (the next turn's
        rendering after the EOS the state does not hold yet): the agent's summary
        request. None when the state does not end at that turn. No disk saves: the
        caller replaces what it generates."""
        r = self.state
        plan = self.planner.append(r, tail)
        if plan is None:
            return None
        plan.session = r.session
        r.bindings.clear()
        return Lease(self, r, plan, None, saves=False)

    def _choose(self, prompt: Prompt, rendered, tokens) -> tuple[Resident, str]:
        """The state for a job and why (``live``, ``side``, ``key``, ``room``; for the
        log line) (docs/ARCHITECTURE.md §3, resident states): the best live
        match (a tool-id continuation over a text key over a prefix, then the most tokens
        kept; a ``prompt.side`` request matches side states only); else, for a side
        request (``prompt.side`` or `_is_side`), room that spares conversations
        (`ResidentStates.room_for`); else the state of the prompt's ``state_key``; else
        room (a free state, or the least valuable one)."""
        states = self.states
        side, why = False, "only"
        if states.n == 1:
            r = states.states[0]
        else:
            best = self._best_live(prompt, rendered, tokens)
            side = prompt.side or prompt.whole or self._is_side(prompt, rendered, tokens)
            keyed = [
                s
                for s in states.states
                if prompt.state_key and s.key == prompt.state_key and s.salt == prompt.salt
            ]
            if best is not None:
                r, why = best[1], "live"
            elif side:
                r, why = states.room_for(side=True), "side"
            elif keyed:
                r, why = keyed[0], "key"
            else:
                r, why = states.room_for(), "room"
            log.debug("kv: state %d for a job (%s)", r.index, why)
        if not side and prompt.state_key:
            for s in states.states:  # a key names one state
                if s.key == prompt.state_key and s is not r:
                    s.key = None
            r.key = prompt.state_key
        # A live continuation keeps a conversation's state one; a side request that
        # continues the scratch state keeps it the state side requests take.
        r.side = side and (why != "live" or r.side)
        states.touch(r)
        return r, why

    def _is_side(self, prompt: Prompt, rendered, tokens) -> bool:
        """A side request (a title, a quota probe): no tools and fewer prompt tokens than
        the disk tier's ``--kv-cache-min-tokens``. It never takes a conversation's state
        while a free or side state exists."""
        conv = prompt.conversation
        if self.side_tokens <= 0 or conv is None or conv.tools:
            return False
        # A token is at least one character: a long text is no side request, untokenized.
        if rendered is not None and len(rendered.text) >= self.side_tokens * 16:
            return False
        return len(tokens()) < self.side_tokens

    # ---------------------------------------------------------------- queries

    def _best_live(self, prompt: Prompt, rendered, tokens) -> tuple[tuple, Resident] | None:
        """``(score, state)`` of the best live match (`Planner.live_match`), ranked by
        (tier, kept tokens): a tool-id continuation over a text key over a prefix; the
        predicted prompt is no criterion. A ``prompt.side`` request matches side states
        only (a helper's fork would take the conversation's state). None: no match."""
        best: tuple | None = None
        # Against the configured count, not the states made so far: they are made as
        # needed, and a helper right after a conversation's first turn found one state
        # and took it (Claude Code's prompt suggestion after its first reply).
        apart = (prompt.side or prompt.whole) and self.states.n > 1
        for s in list(self.states.states):
            if apart and not s.side:
                continue
            score = self.planner.live_match(s, tokens, rendered, prompt.conversation, prompt.salt)
            if score is not None and (best is None or score[:2] > best[0][:2]):
                best = (score, s)
        return best

    def peek(self, prompt: Prompt) -> Reuse:
        """What ``prompt`` would reuse of a live state and be charged, without changing
        anything (no job, no disk lookup): ``count_tokens`` predicts usage with it.

        Safe from any thread (it reads plain values, no arrays): it answers while a job
        runs, against the states as they are then (a state being generated on has no
        binding yet and matches only as a prefix).
        """
        tokens = lazy_tokens(prompt.tokens)
        # The state a job would choose (`_choose`), so the figure is what it is charged.
        best = None if prompt.whole else self._best_live(prompt, prompt.text, tokens)
        if best is None:
            return Reuse(0, None, len(tokens()))
        (_, kept, n_prompt), r = best
        return Reuse(kept, r.index, n_prompt)

    def bound_tool_ids(self) -> frozenset[str]:
        """Ids of the live tool bindings of every state (any thread)."""
        return self.states.bound_tool_ids()

    def summary(self) -> dict[str, Any]:
        """The cache as plain values (any thread): ``live_tokens`` (the engine's own
        state), ``sessions`` (N), ``states`` (per state, a list also for N = 1: the
        shape of ``/health`` does not change with a flag), ``kv_writer`` (the disk
        writer's counts, or None)."""
        states = self.states
        writer = self.disk.writer if self.disk is not None else None
        return {
            "live_tokens": len(states.states[0].session.tokens),
            "sessions": states.n,
            "states": states.describe(),
            "kv_writer": writer.status() if writer is not None else None,
        }

    # ---------------------------------------------------------------- the agent's state

    def bind_transcript(self, key: Rendered | str) -> None:
        """Bind ``key`` (a caller's rendering of the conversation the state holds, ending
        with an EOS) to the state as it is now (``live-transcript``)."""
        from ds4mlx.kv.live import TranscriptBinding

        r = self.state
        r.bindings.transcript = TranscriptBinding(key, len(r.session.tokens))

    def reset(self) -> None:
        """Empty the state (a new conversation): no bindings, nothing saved."""
        reset(self.state)

    def save(self, reason: str):
        """Snapshot the state now (the agent's ``/save``, ``/switch`` and quit), with the
        tool ids it holds. Returns the entry (``key``, ``tokens``) or None (no disk tier,
        empty, or not written)."""
        if self.tier is None:
            return None
        return self.tier.save(self.state, reason)

    def resume(self, key: str) -> int | None:
        """Restore the snapshot stored under ``key`` into the state (``/switch``), after
        an ``evict`` save of what it holds. Returns the tokens restored, or None (gone or
        unusable: the state is then empty)."""
        r = self.state
        r.live_keys = self.planner.keys_of(r, r.bindings.thinking)
        r.bindings.clear()
        if self.tier is None:
            reset(r)
            return None
        n = self.tier.resume(r, key)
        r.live_keys = ()
        return n

    def shutdown(self, save: bool = True) -> None:
        """Clean exit: save every state (``shutdown``) when worth it (unless ``save`` is
        False: a split model that lost a rank has no whole state to save), then write
        every queued save (the writer thread is stopped)."""
        if self.tier is None:
            return
        for r in self.states.states if save else ():
            if self.disk.worth_saving(len(r.session.tokens), r.tracker):
                self.tier.save(r, "shutdown", self.planner.keys_of(r, r.bindings.thinking))
        self.disk.close()
