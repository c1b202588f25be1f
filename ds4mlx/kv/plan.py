"""What to reuse for a prompt, and how to prefill it (the prompt cache's matching order).

The server's worker and the agent ask the one `Planner`, on the inference thread, how to
put a prompt into the live ``Session``; the planner brings the session to the state to
extend (keeps it, restores a disk snapshot, or resets it) and answers with a `Plan`: the
suffix to prefill and the disk-save checkpoints on the way. The engine's turn loop
(``ds4mlx.engine.run_turn``) feeds the plan. After the turn, `Planner.after_generation`
remembers what a later prompt may continue from.

`Planner` implements the whole matching order; the first rule that fits wins:

1–2. ``live-tools`` (`ds4mlx.kv.live.LIVE_TOOLS`; a caller may relabel it for its log) —
   the trailing tool results carry exactly the call ids the live state just sampled
   (`ds4mlx.kv.live.ToolBinding`): only the tool-results suffix is appended, tokenized
   on its own; the sampled turn (hidden thinking, exact DSML) stays as is;
3. ``live-transcript`` / ``live-thinking`` — the prompt starts with the agent's own
   rendering of the conversation the live state holds (`ds4mlx.kv.live.TranscriptBinding`),
   or with the visible key of the thinking turn the live state just sampled
   (`ds4mlx.kv.live.ThinkingBinding`);
4. ``exact-token-prefix`` — the live tokens are a prefix of the prompt's tokens;
5. ``text-prefix`` — the live tokens' text is a byte prefix of the rendered prompt:
   keep them and tokenize only the remaining text, on its own (tokens of the whole
   prompt are never reused across that boundary: BPE may merge across it);
6. ``disk`` — the longest stored rendered-text prefix (`ds4mlx.kv.disk.DiskCache`):
   restore it, tokenize and prefill the rest;
7. ``cold`` — reset and prefill everything.

Every text-keyed rule (3, 5, 6) requires the same *tokens*, not only the same bytes:
content that spells a special token (``<｜User｜>`` in a tool output) is plain text while
the renderer's markers are tokens. The state's own text (rules 5, 6) is checked against
its tokens (`_same_markers`); a key that is another rendering (rule 3's keys, a disk
snapshot's aliases) must spell special tokens as plain text where the prompt does
(`_same_key`).

A binding a job does not use is cleared. A tool result that neither the live binding
nor a replayed assistant call explains rejects the job (`PlanRejected`, a client
mistake, with the id as its fact: each caller words it).

The whole prompt's tokens are asked for (``prompt_tokens`` may be a callable) only by
the rules that need them (4 and 7, and the resident-state choice's prefix rule): a live
continuation tokenizes only its suffix.

DeepSeek V4 caches cannot be trimmed backwards past the compressed frontier, so a plan
keeps either all live tokens or none, and a snapshot at ``n`` tokens is taken while the
session holds exactly ``n``: the prefill pauses at each checkpoint.

"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ds4mlx.dsml import Rendered
from ds4mlx.dsml.tokens import EOS
from ds4mlx.kv.live import (
    LIVE_TOOLS,
    TOOL_RESULT_IDS,
    LiveBindings,
    ThinkingBinding,
    ToolBinding,
    TranscriptBinding,
    matched_key,
    tool_results_suffix,
    trailing_tool_ids,
    unexplained_tool_ids,
    visible_keys,
)
from ds4mlx.kv.resident import Resident, ResidentStates

log = logging.getLogger("ds4mlx.kv")

# Plans that are not live continuations (rules 4-7): their prompt end gets a ``prompt``
# snapshot (docs/ARCHITECTURE.md §5).
_NOT_CONTINUATIONS = frozenset({"exact-token-prefix", "text-prefix", "disk", "cold"})


def _stable_prefix(conv, text: str | None, planner) -> str | None:
    """The start of ``text`` that a retry of ``conv`` shares when its mid-conversation
    system text (``Conversation.late_system``, rendered after the tools section) comes
    back inside a user turn instead, as Claude Code's retry sends it: the common prefix
    of the rendering and the rendering without that text (top-level system text and
    tools). None without late system text. A snapshot there serves such a retry
    (docs/ARCHITECTURE.md §5)."""
    if conv is None or text is None or not getattr(conv, "late_system", ""):
        return None
    from dataclasses import replace

    from ds4mlx.dsml import render_prompt

    other = render_prompt(
        replace(conv, late_system=""),
        context_size=planner.engine.ctx_size,
        tool_memory=planner.tool_memory,
    )
    return text[: len(os.path.commonprefix([text, other]))]


def _thinking_detail(conv, tool_b: ToolBinding | None) -> str:
    """Log detail of a ``live-thinking`` plan.

    A tool conversation (tool results after the replayed assistant turn, e.g. a partial
    set that rules 1-2 do not take) names its results, and how many calls the live tool
    binding held: ``match=visible-key tool-results=1/2``; otherwise ``ids=0``.
    """
    results = trailing_tool_ids(conv) if conv is not None else []
    if not results:
        return "match=visible-key ids=0"
    live = f"/{len(tool_b.ids)}" if tool_b is not None else ""
    return f"match=visible-key tool-results={len(results)}{live}"


class _Session(Protocol):
    tokens: list[int]
    logits: Any

    @property
    def text(self) -> str: ...


class _Tokenizer(Protocol):
    def encode(self, text: str, *, content=()) -> list[int]: ...


class PlanRejected(Exception):
    """The prompt cannot be served as sent (a client mistake): ``tool_id``, a tool-result
    id that neither the live state nor a replayed call explains. No wording: the caller
    words it in its protocol (the server's worker reports ``ds4mlx.jobs.Failure``)."""

    def __init__(self, tool_id: str):
        super().__init__(f"unknown tool result id {tool_id}")
        self.tool_id = tool_id


Tokens = list[int] | Callable[[], list[int]]


def _lazy(tokens: Tokens) -> Callable[[], list[int]]:
    """``tokens`` as a call that computes them at most once (a list is returned as is)."""
    if not callable(tokens):
        return lambda: tokens
    box: list[list[int]] = []

    def get() -> list[int]:
        if not box:
            box.append(tokens())
        return box[0]

    return get


@dataclass
class Plan:
    """How to bring the live session to a prompt (the session already holds ``keep``).

    Attributes:
        keep: live tokens kept (the planner reset the session when 0).
        suffix_tokens: token ids to prefill after the kept ones.
        decision: the matching rule that fired (the caller's
            ``live-tools``, ``live-transcript``, ``live-thinking``,
            ``exact-token-prefix``, ``text-prefix``, ``disk``, ``cold``); in the
            per-request log line and the trace.
        cached: prompt tokens served from existing state (== ``keep``; a disk restore
            is done by the planner before it returns, so it counts as kept).
        detail: extra ``key=value`` words for the log line (``ids=2`` …).
        checkpoints: absolute live token counts (ascending, in ``(keep, prompt_tokens]``)
            at which the prefill pauses and calls ``on_checkpoint``.
        on_checkpoint: ``f(session, n_tokens)``, called at each checkpoint.
        extra: free-form details for the trace.
        session: the ``Session`` to prefill and generate on: the one passed to
            `Planner.plan`, or with resident states (``--sessions N``) the one chosen.
    """

    keep: int
    suffix_tokens: list[int]
    decision: str
    cached: int
    detail: str = ""
    checkpoints: list[int] = field(default_factory=list)
    on_checkpoint: Callable[[Any, int], Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    session: Any = None

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the prompt as the session will hold it after prefill."""
        return self.keep + len(self.suffix_tokens)


def _encode_tail(tokenizer, rendered: Rendered, start: int) -> list[int]:
    """Tokens of ``rendered`` from character ``start`` on, on their own (content spans
    stay plain text)."""
    tail = rendered.tail(start)
    return tokenizer.encode(tail.text, content=tail.content)


def _same_markers(tokenizer, tokens: list[int], rendered: Rendered, end: int) -> bool:
    """Whether ``tokens`` (a state whose text is ``rendered.text[:end]``) hold control
    tokens exactly where the rendering has markers: the same bytes are not the same
    prompt when content spells a marker (plain text) that the state holds as a token,
    or the reverse. Reuse keyed by the state's own text (text prefix, a disk snapshot's
    text) requires it; reuse keyed by another rendering requires `_same_key`."""
    head = rendered.head(end)
    return tokenizer.same_markers(tokens, head.text, head.content)


def _marks(tokenizer, key: Rendered, end: int) -> tuple[int, ...]:
    """Where ``key.text[:end]`` spells special tokens as plain text (character offsets,
    ``Tokenizer.plain_markers``): two renderings with those bytes are the same tokens
    there exactly when their marks agree."""
    head = key.head(end)
    return tokenizer.plain_markers(head.text, head.content)


def _same_key(tokenizer, marks, rendered: Rendered, end: int) -> bool:
    """Whether a text key stands for the prompt ``rendered``, whose first ``end``
    characters repeat the key's bytes: the key's ``marks`` (its `_marks` up to ``end``)
    are the prompt's.

    A key (a live visible or transcript key, a disk alias) is a rendering, not the text
    its state's tokens decode to (that leaves out hidden reasoning, or spells a sampled
    turn differently), so it is compared with the prompt, not with tokens. The state holds
    the markers of the rendering its key was made from: rules 4-7 prefill that
    rendering's tokens or check them, and a live continuation appends the rendering's
    suffix to a state the client selected, its sampled turns as the model wrote them.
    """
    return tuple(marks) == _marks(tokenizer, rendered, end)


def _alias(tokenizer, key: Rendered) -> tuple[str, tuple[int, ...]]:
    """``key`` as a disk alias (``DiskCache.save_live(keys=…)``): its text and its marks,
    which a lookup through it checks with `_same_key`."""
    return key.text, _marks(tokenizer, key, len(key.text))


def _key_plan(
    tokenizer, session: _Session, rendered: Rendered, binding, decision: str, detail: str
) -> Plan | None:
    """Rule 3: the prompt starts with a key of the turn just sampled (``binding``: the
    visible keys of a thinking turn, or the agent's transcript key): its bytes, and its
    markers (`_same_key`)."""
    n = len(session.tokens)
    if binding is None or binding.n_tokens != n:
        return None
    key = matched_key(rendered.text, binding)
    if key is None:
        return None
    # The live state holds the key up to its EOS (sampled, never fed); the EOS and what
    # follows are the prompt's, tokenized from its rendering.
    start = len(key.text) - len(EOS)
    if not _same_key(tokenizer, _marks(tokenizer, key, start), rendered, start):
        log.info("kv: the %s key matches as text, not as tokens; not used", decision)
        return None
    return Plan(
        keep=n,
        suffix_tokens=_encode_tail(tokenizer, rendered, start),
        decision=decision,
        cached=n,
        detail=detail or "match=transcript",
    )


def _prefix_plan(
    session: _Session,
    tokenizer: _Tokenizer,
    rendered: Rendered | None,
    tokens: Callable[[], list[int]],
) -> Plan | None:
    """Rules 4 and 5: the live state is a token or text prefix of the prompt (``tokens()``
    its whole tokenization, asked for only when there is a live state)."""
    live = session.tokens
    n = len(live)
    if not n or session.logits is None:
        return None
    prompt = tokens()
    if n <= len(prompt) and prompt[:n] == live:
        return Plan(keep=n, suffix_tokens=list(prompt[n:]), decision="exact-token-prefix", cached=n)
    if rendered is not None:
        live_text = session.text
        # "\ufffd" means the live tokens end inside a UTF-8 sequence: their text is not a
        # faithful byte prefix of anything, so do not match on it.
        if (
            live_text
            and not live_text.endswith("\ufffd")
            and len(live_text) <= len(rendered.text)
            and rendered.text.startswith(live_text)
            and _same_markers(tokenizer, live, rendered, len(live_text))
        ):
            rest = _encode_tail(tokenizer, rendered, len(live_text))
            return Plan(keep=n, suffix_tokens=rest, decision="text-prefix", cached=n)
    return None


# --------------------------------------------------------------------------- planner


class _DiskTier:
    """The disk-tier half of `Planner` (its snapshots: save points, evict/shutdown saves,
    restores). Split out only to keep each class readable; it uses `Planner`'s
    attributes (``engine``, ``disk``, ``tool_memory``, ``live_tool_ids``, ``bindings``)
    and methods (``reset``, ``_replaced``) and is never used on its own.
    """

    disk: Any
    engine: Any
    tool_memory: Any
    live_tool_ids: dict[str, None]
    bindings: LiveBindings
    residents: ResidentStates | None
    _live_keys: tuple[tuple[str, tuple[int, ...]], ...]

    def _with_checkpoints(self, plan: Plan, session, rendered: Rendered | None, conv=None) -> Plan:
        """Attach the disk-save checkpoints of ``plan`` (cold point, continued frontiers,
        the prompt's end when it is not a live continuation).

        ``rendered`` (the prompt, or None to skip the check) must start with a
        checkpoint's text for that checkpoint to be kept: a snapshot no lookup can find
        is not worth its disk space. A snapshot at the prompt's end is indexed by
        ``rendered`` as well (an alias, with its marks), which a retry or replay renders
        again.
        """
        if self.disk is None:
            return plan
        text = rendered.text if rendered is not None else None
        prompt_ids = list(session.tokens[: plan.keep]) + list(plan.suffix_tokens)
        points = self.disk.checkpoints(
            cached=plan.cached,
            prompt_tokens=prompt_ids,
            rendered_text=text,
            # A retry, replay or sub-agent of a prompt that did not continue the live
            # state cannot continue it either: its end is saved for them.
            prompt_end=plan.decision in _NOT_CONTINUATIONS,
            stable_text=_stable_prefix(conv, text, self),
        )
        if points:
            reasons = {p.tokens: p.reason for p in points}
            plan.checkpoints = [p.tokens for p in points]
            plan.extra["checkpoint_reasons"] = reasons

            end = plan.prompt_tokens
            keys = (_alias(self.engine.tokenizer, rendered),) if text else ()

            def save(session, n: int) -> None:
                self.disk.save_live(
                    session,
                    reasons.get(n, "continued"),
                    self.tool_memory,
                    self.live_tool_ids,
                    keys=keys if n == end else (),
                )

            plan.on_checkpoint = save
        return plan

    def _evict_live(self, session) -> None:
        """Save the live state (``evict``) before an unrelated request replaces it."""
        if self.disk is not None and self.disk.worth_saving(len(session.tokens)):
            self.disk.save_live(
                session, "evict", self.tool_memory, self.live_tool_ids, keys=self._live_keys
            )

    def _keys_of(
        self, session, binding: ThinkingBinding | None
    ) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Disk aliases (`_alias`) of the live state besides its own text: a thinking
        turn's visible keys without their EOS (the next prompt renders the turn without
        its reasoning, so its text never starts with the live text;
        `ds4mlx.kv.live.visible_keys`)."""
        if binding is None or binding.n_tokens != len(session.tokens):
            return ()
        tok = self.engine.tokenizer
        return tuple(
            _alias(tok, k.head(len(k.text) - len(EOS)))
            for k in binding.keys
            if k.text.endswith(EOS)
        )

    def _from_disk(self, session, rendered: Rendered | None) -> Plan | None:
        """Rule 6: restore the longest stored rendered-text prefix.

        Loads first, then saves the live state (evict) it replaces: saving first could
        evict, within the byte budget, the very snapshot about to be loaded.
        """
        if self.disk is None or rendered is None:
            return None
        t0 = time.perf_counter()
        loaded = self.disk.lookup(rendered.text)
        if loaded is None:
            return None
        return self._restore(session, rendered, loaded, t0)

    def resume(self, session, key: str) -> int | None:
        """Restore the disk snapshot stored under ``key`` (the agent's ``/switch``).

        The live state it replaces is saved first (``evict``) when worth it. Returns the
        tokens restored, or None when the snapshot is gone or unusable (the session is
        then reset).
        """
        from ds4mlx.engine import SessionState, SnapshotError

        loaded = self.disk.load_key(key) if self.disk is not None else None
        self._live_keys = self._keys_of(session, self.bindings.thinking)
        self._evict_live(session)
        self.reset(session)
        if loaded is None:
            return None
        try:
            session.restore(SessionState(loaded.tokens, loaded.arrays, loaded.meta))
        except (SnapshotError, ValueError) as e:
            log.warning("kv cache: cannot restore %s: %s", key[:12], e)
            return None
        self._loaded(loaded)
        return len(loaded.tokens)

    def _loaded(self, loaded) -> None:
        """Bookkeeping after a snapshot was restored into the live session."""
        self.disk.tracker.loaded(len(loaded.tokens))
        if self.tool_memory is not None and loaded.tool_memory:
            self.tool_memory.load(loaded.tool_memory.items())
        self.live_tool_ids.update(dict.fromkeys(loaded.tool_memory))

    def _restore(self, session, rendered: Rendered, loaded, t0: float) -> Plan | None:
        from ds4mlx.engine import SessionState, SnapshotError

        # The same bytes must be the same tokens. The snapshot's own text is what its
        # tokens decode to: checked against them. An alias is a rendering whose text is
        # not the tokens' (a visible key leaves out the reasoning the state holds, by
        # design): checked by the marks stored with it.
        tok, end = self.engine.tokenizer, len(loaded.text)
        if loaded.entry.via_alias:
            same = _same_key(tok, loaded.entry.alias_marks, rendered, end)
        else:
            same = _same_markers(tok, loaded.tokens, rendered, end)
        if not same:
            log.info("kv cache: %s matches as text, not as tokens; not used", loaded.entry.key[:12])
            return None
        self._evict_live(session)
        state = SessionState(tokens=loaded.tokens, arrays=loaded.arrays, meta=loaded.meta)
        try:
            session.restore(state)
        except (SnapshotError, ValueError) as e:
            # Verified by digest but not for this model's caches: treat as a miss.
            log.warning("kv cache: cannot restore %s: %s", loaded.entry.path.name, e)
            return None
        self._replaced()
        self._loaded(loaded)
        rest = _encode_tail(self.engine.tokenizer, rendered, len(loaded.text))
        n = len(loaded.tokens)
        ms = (time.perf_counter() - t0) * 1e3
        return Plan(
            keep=n,
            suffix_tokens=rest,
            decision="disk",
            cached=n,
            detail=f"ids=0 key={loaded.entry.key[:12]} reason={loaded.entry.reason} load={ms:.0f}ms",
        )

    def after_token(self, session) -> None:
        """Called after each generated token is fed: a ``continued`` save when the live
        state reaches an unsaved frontier."""
        if self.disk is not None and self.disk.continued_due(len(session.tokens)):
            self.disk.save_live(session, "continued", self.tool_memory, self.live_tool_ids)

    def on_shutdown(self, session) -> None:
        """Clean exit: save the live state (``shutdown``) when worth it, then write every
        queued save (the writer thread is stopped)."""
        if self.disk is None:
            return
        residents = self.residents.states if self.residents is not None else [None]
        for r in residents:
            if r is not None:  # every resident state is saved, each with its own ids
                self._use(r)
                session = r.session
            if self.disk.worth_saving(len(session.tokens)):
                keys = self._keys_of(session, self.bindings.thinking)
                self.disk.save_live(
                    session, "shutdown", self.tool_memory, self.live_tool_ids, keys=keys
                )
        self.disk.close()


class _Residency:
    """Which resident state a job runs on (``--sessions N``; split out of `Planner` for
    size, it uses Planner's ``_live_tools``). With one state (the
    default) none of this runs.

    The best live match wins: a tool-id continuation over a text key over a prefix,
    then the most tokens kept. A job that matches no state goes to a free state, else
    to the least valuable one (`ResidentStates.value`), which the plan then evict-saves
    and replaces.
    """

    disk: Any
    engine: Any
    bindings: LiveBindings
    live_tool_ids: dict[str, None]
    residents: ResidentStates | None
    current: Resident | None

    def _use(self, r: Resident) -> None:
        """Make ``r`` the state the planner's bindings, tool ids and tracker describe
        (each state keeps its own objects; the planner mutates them in place)."""
        self.current = r
        self.bindings = r.bindings
        self.live_tool_ids = r.live_tool_ids
        if self.disk is not None:
            self.disk.tracker = r.tracker

    def _match(self, r: Resident, rendered, conversation, prompt) -> tuple | None:
        """``(tier, kept tokens)`` of the best live rule for state ``r``, or None. No side
        effects: the chosen state is planned again for real."""
        if not r.live:
            return None
        s, b = r.session, r.bindings
        tier, plan = 3, self._live_tools(s, conversation, b.tool)
        if plan is None and rendered is not None:
            tier = 2
            tok = self.engine.tokenizer
            plan = _key_plan(tok, s, rendered, b.transcript, "live-transcript", "")
            plan = plan or _key_plan(tok, s, rendered, b.thinking, "live-thinking", "")
        if plan is None:
            tier, plan = 1, _prefix_plan(s, self.engine.tokenizer, rendered, prompt)
        if plan is None or plan.prompt_tokens >= self.engine.ctx_size:
            return None
        return tier, plan.keep

    def _choose(self, rendered, conversation, prompt) -> Resident:
        """Pick the state for a job and make it current (see the class docstring)."""
        best: tuple | None = None
        for r in self.residents.states:
            score = self._match(r, rendered, conversation, prompt)
            if score is not None and (best is None or score > best[0]):
                best = (score, r)
        r = best[1] if best is not None else self.residents.room_for()
        self._use(r)
        self.residents.touch(r)
        return r


class Planner(_Residency, _DiskTier):
    """The full matching order of docs/ARCHITECTURE.md §3 for one engine's live session.

    Args:
        engine: the ``ds4mlx.engine.Engine`` (tokenizer, context size).
        tool_memory: the server's ``ds4mlx.dsml.ToolMemory`` (exact sampled DSML).
        disk: a `ds4mlx.kv.disk.DiskCache`, or None when the disk cache is off.

    Attributes:
        bindings: the `LiveBindings` (routes read ``bindings.bound_tool_ids()``).
        live_tool_ids: ids whose exact DSML may be inside the live text (sampled or
            replayed in this live session, or restored with it); persisted with its
            snapshots.

    Called on the inference thread: `plan` before a turn, `after_token` after each
    generated token is fed, `after_generation` after the turn, `on_shutdown` at exit.
    """

    @classmethod
    def open(cls, engine, settings=None, tool_memory=None) -> Planner:
        """A planner for ``engine``, with a disk cache when ``settings`` enable one.

        Args:
            engine: the loaded engine (on the inference thread: the disk cache's arrays
                belong to it).
            settings: ``ds4mlx.kv.policy.KVCacheSettings``, or None for no disk cache.
                The tool-memory entries persisted in the cache are reloaded.
            tool_memory: the ``ds4mlx.dsml.ToolMemory`` of sampled calls, or None.
        Raises:
            OSError: the disk directory cannot be created.
        """
        disk = None
        sessions = settings.sessions if settings is not None else 1
        if settings is not None and settings.enabled:
            from ds4mlx.kv.disk import DiskCache

            # Snapshot files are written on the cache's writer thread: an evict save
            # must not delay the request that caused it (docs/ARCHITECTURE.md §5).
            disk = DiskCache(engine, settings, background=True)
            if tool_memory is not None and tool_memory.enabled:
                n = disk.reload_tool_memory(tool_memory)
                if n:
                    log.info("kv cache: reloaded %d tool-memory entries", n)
        planner = cls(engine, tool_memory, disk)
        if sessions > 1:
            first = Resident(0, engine.session)
            planner.residents = ResidentStates(engine, sessions, first)
            planner._use(first)
        return planner

    def __init__(self, engine, tool_memory=None, disk=None):
        self.engine = engine
        self.tool_memory = tool_memory
        self.disk = disk
        self.bindings = LiveBindings()
        self.live_tool_ids: dict[str, None] = {}
        # The visible keys of the live state while a plan may replace it (the bindings
        # are cleared when planning starts): its evict save is indexed by them too.
        self._live_keys: tuple[str, ...] = ()
        # Resident states (``--sessions N`` > 1, set by `open`): None means one state.
        self.residents: ResidentStates | None = None
        self.current: Resident | None = None

    # ---------------------------------------------------------------- helpers

    def bound_tool_ids(self) -> frozenset[str]:
        """Ids of the live tool bindings of every resident state (thread-safe; for the
        routes' pre-queue check)."""
        if self.residents is not None:
            return self.residents.bound_tool_ids()
        return self.bindings.bound_tool_ids()

    def _replaced(self) -> None:
        """The live state is about to be replaced: nothing of it is on disk or bound."""
        self.live_tool_ids.clear()
        if self.disk is not None:
            self.disk.tracker.reset()

    def _note_replayed(self, conv) -> None:
        """Remember the replayed calls whose exact DSML the kept prompt now holds."""
        if conv is None or self.tool_memory is None:
            return
        for m in conv.messages:
            for c in m.tool_calls:
                if c.id and c.id in self.tool_memory:
                    self.live_tool_ids[c.id] = None

    # ---------------------------------------------------------------- the hooks

    def plan(
        self,
        session,
        *,
        prompt_tokens: Tokens,
        rendered_text: Rendered | str | None,
        conversation=None,
    ) -> Plan:
        """Decide how to serve a prompt and bring ``session`` to the state to extend.

        Args:
            session: the live ``Session``: kept, restored from a disk hit, or reset (after
                an ``evict`` save) — the returned plan's suffix goes on top of it.
            prompt_tokens: the tokenization of the whole prompt, or a call returning it
                (made at most once, only by a rule that needs it: a live continuation
                tokenizes its suffix alone).
            rendered_text: the rendered prompt: a ``ds4mlx.dsml.Rendered`` (suffixes are
                tokenized with its content as plain text), a raw ``str``, or None for
                token-id prompts.
            conversation: the ``ds4mlx.dsml.Conversation`` it was rendered from, or None.
        Returns:
            A `Plan`.
        Raises:
            PlanRejected: a tool result that nothing explains (client error); the
                session and the bindings are unchanged.

        With resident states the job runs on the state `_Residency._choose` picks
        (``plan.session``; ``session`` is ignored), and ``plan.detail`` names it.
        """
        rendered = Rendered.of(rendered_text) if rendered_text is not None else None
        tokens = _lazy(prompt_tokens)
        if self.residents is None:
            plan = self._plan(session, tokens, rendered, conversation)
            plan.session = session
            return plan
        r = self._choose(rendered, conversation, tokens)
        plan = self._plan(r.session, tokens, rendered, conversation)
        plan.session = r.session
        plan.detail = f"{plan.detail} state={r.index}/{self.residents.n}".strip()
        return plan

    def _plan(self, session, tokens, rendered, conversation) -> Plan:
        """The matching order on one live state (see `plan`)."""
        live_ok = len(session.tokens) > 0 and session.logits is not None
        saved = self.bindings.save()
        # Whatever this prompt does, the bindings describe the state before it: a later
        # prompt can only continue from what *this* turn leaves (after_generation).
        self.bindings.clear()
        tool_b, think_b, transcript_b = saved
        self._live_keys = self._keys_of(session, think_b)
        plan = self._live_tools(session, conversation, tool_b) if live_ok else None
        if plan is None and conversation is not None:
            # Tool results must be live (above) or replayed with their calls.
            bad = unexplained_tool_ids(conversation)
            if bad:
                # A rejected prompt changes nothing: the client may still send the right
                # results and continue live.
                self.bindings.restore(saved)
                raise PlanRejected(bad[0])
        if plan is None and live_ok and rendered is not None:
            tok = self.engine.tokenizer
            plan = _key_plan(tok, session, rendered, transcript_b, "live-transcript", "")
            plan = plan or _key_plan(
                tok,
                session,
                rendered,
                think_b,
                "live-thinking",
                _thinking_detail(conversation, tool_b),
            )
        if plan is not None and self._fits(plan):
            self._note_replayed(conversation)
            return self._with_checkpoints(plan, session, None)
        plan = _prefix_plan(session, self.engine.tokenizer, rendered, tokens)
        if plan is not None and self._fits(plan):
            plan.detail = "ids=0"
        else:
            # Either replaces the live state (and forgets which calls it holds). The
            # caller checks that the planned prompt fits the context.
            plan = self._from_disk(session, rendered) or self._cold(session, tokens())
        self._note_replayed(conversation)
        return self._with_checkpoints(plan, session, rendered, conversation)

    def _fits(self, plan: Plan) -> bool:
        """Whether continuing the live state this way leaves room for a token.

        The live state may hold more than the prompt renders (hidden reasoning the client
        dropped): when keeping it would not fit where the rendered prompt does, the next
        rule (a rebuild from the rendering) serves the request instead of a refusal.
        """
        if plan.prompt_tokens < self.engine.ctx_size:
            return True
        log.info(
            "kv: %s would hold %d tokens of a %d context; rebuilding from the prompt",
            plan.decision,
            plan.prompt_tokens,
            self.engine.ctx_size,
        )
        return False

    def _live_tools(self, session, conv, binding: ToolBinding | None) -> Plan | None:
        """Rules 1-2: the trailing tool results answer exactly the calls just sampled."""
        n = len(session.tokens)
        if conv is None or binding is None or binding.n_tokens != n:
            return None
        suffix = tool_results_suffix(conv, binding, context_size=self.engine.ctx_size)
        if suffix is None:
            return None
        return Plan(
            keep=n,
            suffix_tokens=self.engine.tokenizer.encode(suffix.text, content=suffix.content),
            decision=LIVE_TOOLS,
            cached=n,
            detail=f"match={TOOL_RESULT_IDS} ids={len(binding.ids)}",
        )

    def _cold(self, session, prompt_tokens: list[int]) -> Plan:
        """Rule 7: save the live state it replaces (evict), reset, prefill everything."""
        self._evict_live(session)
        session.reset()
        self._replaced()
        return Plan(
            keep=0, suffix_tokens=list(prompt_tokens), decision="cold", cached=0, detail="ids=0"
        )

    def bind_transcript(self, session, key: Rendered | str) -> None:
        """Bind ``key`` (a caller's rendering of the conversation the live state holds,
        ending with an EOS: a ``ds4mlx.dsml.Rendered``, or a ``str`` without content
        spans) to the live state as it is now (`TranscriptBinding`)."""
        self.bindings.transcript = TranscriptBinding(key, len(session.tokens))

    def reset(self, session) -> None:
        """Empty the live session (a new conversation): no bindings, nothing saved."""
        self.bindings.clear()
        self._replaced()
        session.reset()

    def after_generation(
        self,
        session,
        *,
        finish: str,
        tool_calls: list = (),
        prompt_text: Rendered | str | None = None,
        thinking: bool = False,
        text: str = "",
        transcript_key: Rendered | str | None = None,
    ) -> None:
        """Remember what the next prompt may continue from (on the inference thread).

        Args:
            session: the live session after the turn.
            finish: the turn's finish reason (``stop`` is an end of turn).
            tool_calls: the ``ds4mlx.dsml.ToolCall``s the turn sampled, in order.
            prompt_text: the rendered prompt of the turn (a ``ds4mlx.dsml.Rendered``; a
                ``str`` has no content spans), or None for a raw turn.
            thinking: the prompt opened ``<think>``.
            text: the visible text the client saw (after stop strings).
            transcript_key: a caller that keeps the conversation (the agent): its
                rendering through this turn, ending with the turn's EOS
                (`TranscriptBinding`); kept whatever the finish, since the caller's
                transcript records the turn as the live state holds it.

        After a turn that ended with EOS: the sampled tool-call ids with the live token
        count (`ToolBinding`), and in thinking mode the turn's visible key
        (`ThinkingBinding`). Any other ending (max tokens, stop sequence, cancel) leaves
        no binding: the live state then holds tokens the client never saw as a turn.
        """
        from ds4mlx.dsml import render_tool_calls
        from ds4mlx.dsml.tokens import THINK_START

        self.bindings.clear()
        self._live_keys = ()
        for c in tool_calls:
            if c.id:
                self.live_tool_ids[c.id] = None
        n = len(session.tokens)
        if transcript_key is not None:
            self.bind_transcript(session, transcript_key)
        if finish != "stop" or prompt_text is None:
            return
        calls = list(tool_calls)
        if calls and all(c.id for c in calls):
            self.bindings.tool = ToolBinding(tuple(c.id for c in calls), n)
        prompt = Rendered.of(prompt_text)
        if thinking and prompt.text.endswith(THINK_START):
            keys = visible_keys(prompt, text, render_tool_calls(calls, self.tool_memory))
            self.bindings.thinking = ThinkingBinding(keys, n)
