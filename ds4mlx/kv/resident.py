"""Resident states (``ds4mlx serve --sessions N``): up to N live states in memory.

docs/ARCHITECTURE.md §3: one live session is the design; N > 1 is the option for clients
that interleave conversations that do not extend each other (Claude Code's main
conversation, its sub-agents, title requests). Each `Resident` is a complete live state
— a ``Session`` (tokens, KV caches, logits), its live bindings, the tool ids whose DSML
it holds and its disk-save tracker — so a request that runs on one state clears and
sets only that state's bindings. Still one job computes at a time (the worker's FIFO);
`ResidentStates` only decides *which* state a job runs on
(``ds4mlx.kv.cache.PromptCache.begin``: the best live match, else a free state, else the
least valuable one, whose state the planner evict-saves to disk before replacing it).

Value (`ResidentStates.value`): the tokens a state holds — what prefilling it again would
cost — divided by one plus the number of jobs since one last ran on it. A recent small
state (a title request, a few hundred tokens) goes before a long conversation that was
interrupted by a few side requests, which plain least-recently-used replacement would
throw out first; a long state nobody came back to for many jobs still ages out.

Memory: every resident state holds its own KV caches (up to a full context each), so N
multiplies the KV memory; the weights are shared.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ds4mlx.kv.live import LiveBindings
from ds4mlx.kv.policy import SaveTracker

__all__ = ["Resident", "ResidentStates"]


@dataclass(eq=False)
class Resident:
    """One resident live state.

    Attributes:
        index: its number (0 is the engine's own session), for logs and the trace.
        session: its ``ds4mlx.engine.Session``.
        bindings: its `LiveBindings` (what the next prompt may continue it by).
        live_tool_ids: ids whose exact DSML may be inside its text (persisted with its
            snapshots).
        tracker: the largest token count saved for it (``SaveTracker``).
        live_keys: while a plan may replace it (its bindings are cleared when planning
            starts), its disk aliases besides its text (a thinking turn's visible keys):
            its ``evict`` save is indexed by them too.
        last_used: when a job last ran on it (``time.monotonic()`` seconds).
        last_job: the `ResidentStates` job count when a job last ran on it.
        key: the client's name of the conversation it holds (``Prompt.state_key``), or
            None.
        side: its last job was a side request (``PromptCache._is_side``).
        salt: the cache salt of the prompts it holds (``Prompt.salt``; ``""``: none):
            only a prompt with the same salt continues it, and its snapshots are keyed
            by it.
    """

    index: int
    session: Any
    bindings: LiveBindings = field(default_factory=LiveBindings)
    live_tool_ids: dict[str, None] = field(default_factory=dict)
    tracker: SaveTracker = field(default_factory=SaveTracker)
    live_keys: tuple[tuple[str, tuple[int, ...]], ...] = ()
    last_used: float = 0.0
    last_job: int = 0
    key: str | None = None
    side: bool = False
    salt: str = ""

    @property
    def live(self) -> bool:
        """Whether it holds a state a prompt may extend."""
        return bool(self.session.tokens) and self.session.logits is not None


class ResidentStates:
    """Up to ``n`` `Resident` states on one engine; the first is ``engine.session``.

    Args:
        engine: the ``ds4mlx.engine.Engine`` (``session``, ``new_session()``).
        n: the most states kept (>= 1).
        first: the `Resident` wrapping ``engine.session`` (the engine's own).

    Sessions beyond the first are made on demand (on the inference thread: their
    arrays belong to it). Written on the inference thread only; `bound_tool_ids`
    may be read from any thread.
    """

    def __init__(self, engine, n: int, first: Resident):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.engine = engine
        self.n = n
        self.states: list[Resident] = [first]
        self.jobs = 0  # jobs run on any state (`touch`)

    def bound_tool_ids(self) -> frozenset[str]:
        """Ids of every state's live tool binding (for the routes' pre-queue check)."""
        out: frozenset[str] = frozenset()
        for r in list(self.states):
            out |= r.bindings.bound_tool_ids()
        return out

    def room_for(self, side: bool = False) -> Resident:
        """The state a job that matches none should run on: an empty one (made when
        fewer than ``n`` exist), else the least valuable (`value`; its state is
        replaced; ties go to the least recently used). A ``side`` request takes the
        least valuable state that last served a side request when there is one, so it
        never replaces a conversation while such a scratch state exists."""
        empty = [r for r in self.states if not r.live]
        if empty:
            return empty[0]
        if len(self.states) < self.n:
            r = Resident(len(self.states), self.engine.new_session())
            self.states.append(r)
            return r
        pool = [r for r in self.states if r.side] if side else []
        return min(pool or self.states, key=lambda r: (self.value(r), r.last_used))

    def value(self, r: Resident) -> float:
        """Tokens of ``r`` ÷ (1 + jobs run since ``r`` was last used): the prefill its
        replacement could cost, discounted by how long nobody has come back to it."""
        return len(r.session.tokens) / (1 + self.jobs - r.last_job)

    def touch(self, r: Resident) -> None:
        """Record that a job runs on ``r`` now."""
        self.jobs += 1
        r.last_used = time.monotonic()
        r.last_job = self.jobs

    def describe(self) -> list[dict]:
        """Per state: index, client key, side flag, live tokens, bound tool ids (for
        ``/health`` and logs)."""
        return [
            {
                "state": r.index,
                "key": r.key,
                "side": r.side,
                "tokens": len(r.session.tokens),
                "bound_tool_ids": len(r.bindings.bound_tool_ids()),
            }
            for r in self.states
        ]
