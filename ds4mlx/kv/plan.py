"""What to reuse for a prompt, and how to prefill it (the prompt cache's matching order).

`ds4mlx.kv.cache.PromptCache.begin` asks the one `Planner`, on the inference thread, how
to put a prompt into a live state (`ds4mlx.kv.resident.Resident`); the planner brings its
session to the state to extend (keeps it, restores a disk snapshot, or resets it) and
answers with a `Plan`: the suffix to prefill and the disk-save checkpoints on the way. The
engine's turn loop (``ds4mlx.engine.run_turn``) feeds the plan. After the turn,
`Planner.after_generation` (through ``Lease.finish``) remembers on that state what a later
prompt may continue from. The planner holds nothing between jobs.

`Planner` implements the whole matching order; the first rule that fits wins:

1–2. ``live-tools`` (`ds4mlx.kv.live.LIVE_TOOLS`; a caller may relabel it for its log) —
   the trailing tool results answer the calls the live state just sampled
   (`ds4mlx.kv.live.ToolBinding`): all the synchronous ones (a call to a background tool
   is answered by its pending status result), plus late results of replayed earlier
   calls: only the tool-results suffix is appended, tokenized on its own; the sampled
   turn (hidden thinking, exact DSML) stays as is;
3. ``live-transcript`` / ``live-thinking`` — the prompt starts with the agent's own
   rendering of the conversation the live state holds (`ds4mlx.kv.live.TranscriptBinding`),
   or with the visible key of the thinking turn the live state just sampled
   (`ds4mlx.kv.live.ThinkingBinding`);
4. ``exact-token-prefix`` — the live tokens are a prefix of the prompt's tokens;
5. ``text-prefix`` — the live tokens' text is a byte prefix of the rendered prompt:
   keep them and tokenize only the remaining text, on its own (tokens of the whole
   prompt are never reused across that boundary: BPE may merge across it);
6. ``disk`` — the longest stored rendered-text prefix whose tokens are the prompt's
   (`ds4mlx.kv.tier.DiskTier.restore`: candidates from the longest down, each checked
   from its text and tokens before its KV is read): restore it, tokenize and prefill
   the rest;
7. ``cold`` — reset and prefill everything.

Every text-keyed rule (3, 5, 6) requires the same *tokens*, not only the same bytes:
content that spells a special token (``<｜User｜>`` in a tool output) is plain text while
the renderer's markers are tokens. The state's own text (rules 5, 6) is checked against
its tokens (`_same_markers`); a key that is another rendering (rule 3's keys, a disk
snapshot's aliases) must spell special tokens as plain text where the prompt does
(`_same_key`).

A binding a job does not use is cleared. A tool result that neither the live binding
nor a replayed assistant call explains rejects the job (`UnknownToolId`, a client
mistake carrying the id; each caller words it).

DeepSeek V4 caches cannot be trimmed backwards past the compressed frontier, so a plan
keeps either all live tokens or none, and a snapshot at ``n`` tokens is taken while the
session holds exactly ``n``: the prefill pauses at each checkpoint.

"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ds4mlx.dsml import Rendered
from ds4mlx.dsml.tokens import EOS
from ds4mlx.kv.live import (
    LIVE_TOOLS,
    TOOL_RESULT_IDS,
    ThinkingBinding,
    ToolBinding,
    TranscriptBinding,
    matched_key,
    tool_results_suffix,
    trailing_tool_ids,
    unexplained_tool_ids,
    visible_keys,
)
from ds4mlx.kv.resident import Resident

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


class PromptRejected(Exception):
    """The prompt cannot be served as sent (a client mistake). Carries facts, not
    wording: each caller words it in its own protocol."""


class UnknownToolId(PromptRejected):
    """A tool result whose id answers no call the live state sampled or the prompt
    replays. ``tool_id``: that id."""

    def __init__(self, tool_id: str):
        super().__init__(f"tool result {tool_id!r} answers no known call")
        self.tool_id = tool_id


class ContextFull(PromptRejected):
    """The prompt leaves no room in the context: ``n_prompt`` tokens (0: an empty
    prompt) of an ``n_ctx``-token context."""

    def __init__(self, n_prompt: int, n_ctx: int):
        what = "empty prompt" if n_prompt == 0 else f"prompt is {n_prompt} tokens"
        super().__init__(f"{what}; the context is {n_ctx}")
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx


Tokens = list[int] | Callable[[], list[int]]


def lazy_tokens(tokens: Tokens) -> Callable[[], list[int]]:
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


class Planner:
    """The full matching order of docs/ARCHITECTURE.md §3, applied to one live state.

    Stateless between jobs: everything a later prompt may continue from lives on the
    `ds4mlx.kv.resident.Resident` it is given (session, bindings, tool ids, save
    tracker). `ds4mlx.kv.cache.PromptCache` owns the states and calls it through a
    `ds4mlx.kv.cache.Lease`.

    Args:
        engine: the ``ds4mlx.engine.Engine`` (tokenizer, context size).
        tool_memory: the ``ds4mlx.dsml.ToolMemory`` (exact sampled DSML), or None.
        tier: the `ds4mlx.kv.tier.DiskTier` (snapshots), or None when the disk cache is
            off.
    """

    def __init__(self, engine, tool_memory=None, tier=None):
        self.engine = engine
        self.tool_memory = tool_memory
        self.tier = tier

    def plan(
        self,
        r: Resident,
        prompt_tokens: Tokens,
        rendered: Rendered | None,
        conversation=None,
        salt: str = "",
        *,
        whole: bool = False,
    ) -> Plan:
        """Decide how to serve a prompt on state ``r`` and bring its session to the
        state to extend (kept, restored from a disk hit, or reset after an ``evict``
        save); the returned plan's suffix goes on top of it.

        Args:
            r: the live state the job runs on.
            prompt_tokens: the tokenization of the whole prompt, or a call returning it
                (made at most once, only by a rule that needs it: a live continuation
                tokenizes its suffix alone).
            rendered: the rendered prompt (suffixes are tokenized with its content as
                plain text), or None for token-id prompts.
            conversation: the ``ds4mlx.dsml.Conversation`` it was rendered from, or None.
            salt: the prompt's cache salt (``""``: none). A state of another salt is
                never continued (rules 1-5 are skipped; it is replaced), and the disk
                rule finds only snapshots saved under this salt.
            whole: prefill every token (a scored prompt): rule 7 (cold) alone.
        Raises:
            UnknownToolId: a tool result that nothing explains (a client mistake); the
                session and the bindings are unchanged.
        """
        session = r.session
        prompt_tokens = lazy_tokens(prompt_tokens)
        same_salt = r.salt == salt
        live_ok = same_salt and len(session.tokens) > 0 and session.logits is not None
        saved = r.bindings.save()
        # Whatever this prompt does, the bindings describe the state before it: a later
        # prompt can only continue from what *this* turn leaves (after_generation).
        r.bindings.clear()
        tool_b, think_b, transcript_b = saved
        r.live_keys = self.keys_of(r, think_b)
        if whole:
            # No disk saves of a scored prompt: no lookup would restore one.
            plan = self._cold(r, prompt_tokens())
            plan.detail = "ids=0 scored"
            r.tracker.scored = True
            r.salt = salt
            return plan
        plan = self._live_tools(session, conversation, tool_b) if live_ok else None
        if plan is None and conversation is not None:
            # Tool results must be live (above) or replayed with their calls.
            bad = unexplained_tool_ids(conversation)
            if bad:
                # A rejected prompt changes nothing: the client may still send the right
                # results and continue live.
                r.bindings.restore(saved)
                raise UnknownToolId(bad[0])
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
            self._note_replayed(r, conversation)
            return self._checkpoints(plan, r, None)
        plan = (
            _prefix_plan(session, self.engine.tokenizer, rendered, prompt_tokens)
            if same_salt
            else None
        )
        if plan is not None and self._fits(plan):
            plan.detail = "ids=0"
        else:
            # Either replaces the live state (and forgets which calls it holds); the
            # evict save of what it replaces is keyed by the state's old salt.
            plan = self._from_disk(r, rendered, salt) or self._cold(r, prompt_tokens())
        r.salt = salt
        self._note_replayed(r, conversation)
        return self._checkpoints(plan, r, rendered, conversation)

    def live_match(
        self, r: Resident, prompt_tokens: Tokens, rendered, conversation, salt: str = ""
    ) -> tuple[int, int, int] | None:
        """``(tier, kept tokens, prompt tokens)`` of the best live rule for state ``r``
        (tier 3: tool ids, 2: a text key, 1: a prefix; prompt tokens: kept + the suffix
        it would prefill), or None (also for a state of another cache ``salt``). No side
        effects: it ranks states (`ds4mlx.kv.cache.PromptCache` plans the chosen one for
        real) and predicts usage (`ds4mlx.kv.cache.PromptCache.peek`)."""
        if not r.live or r.salt != salt:
            return None
        s, b = r.session, r.bindings
        tier, plan = 3, self._live_tools(s, conversation, b.tool)
        if plan is None and rendered is not None:
            tier = 2
            tok = self.engine.tokenizer
            plan = _key_plan(tok, s, rendered, b.transcript, "live-transcript", "")
            plan = plan or _key_plan(tok, s, rendered, b.thinking, "live-thinking", "")
        if plan is None:
            tier, plan = (
                1,
                _prefix_plan(s, self.engine.tokenizer, rendered, lazy_tokens(prompt_tokens)),
            )
        if plan is None or plan.prompt_tokens >= self.engine.ctx_size:
            return None
        return tier, plan.keep, plan.prompt_tokens

    def append(self, r: Resident, tail: Rendered) -> Plan | None:
        """A plan that continues state ``r`` after its caller's turn with ``tail`` (the
        rendering of the next turn, after the turn's EOS, which the state does not hold
        yet): the agent's summary request. None unless ``r`` ends exactly where its
        transcript binding says (a sampled turn's end)."""
        b = r.bindings.transcript
        if b is None or b.n_tokens != len(r.session.tokens) or r.session.logits is None:
            return None
        tok = self.engine.tokenizer
        return Plan(
            keep=b.n_tokens,
            suffix_tokens=[tok.eos_id, *tok.encode(tail.text, content=tail.content)],
            decision="live-transcript",
            cached=b.n_tokens,
            detail="match=appended",
        )

    def _checkpoints(self, plan: Plan, r: Resident, rendered, conv=None) -> Plan:
        """``plan`` with its disk-save checkpoints, for a prompt a lookup may find: the
        state holds one now (kept or replaced, after any evict save), so its saves are
        due again even where it held a scored prompt."""
        r.tracker.scored = False
        if self.tier is None:
            return plan
        stable = _stable_prefix(conv, rendered.text if rendered is not None else None, self)
        return self.tier.with_checkpoints(plan, r, rendered, stable)

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
        """Rules 1-2: the trailing tool results answer the calls just sampled (the
        synchronous ones at least: `ds4mlx.kv.live.tool_results_suffix`)."""
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

    def _from_disk(self, r: Resident, rendered: Rendered | None, salt: str = "") -> Plan | None:
        """Rule 6: restore the longest stored rendered-text prefix saved under ``salt``
        (`DiskTier.restore`)."""
        if self.tier is None or rendered is None:
            return None
        got = self.tier.restore(r, rendered, salt)
        if got is None:
            return None
        n, detail, text_len = got
        return Plan(
            keep=n,
            suffix_tokens=_encode_tail(self.engine.tokenizer, rendered, text_len),
            decision="disk",
            cached=n,
            detail=detail,
        )

    def _cold(self, r: Resident, prompt_tokens: list[int]) -> Plan:
        """Rule 7: save the live state it replaces (evict), reset, prefill everything."""
        if self.tier is not None:
            self.tier.evict(r)
        r.session.reset()
        replaced(r)
        return Plan(
            keep=0, suffix_tokens=list(prompt_tokens), decision="cold", cached=0, detail="ids=0"
        )

    def _note_replayed(self, r: Resident, conv) -> None:
        """Remember the replayed calls whose exact DSML the kept prompt now holds."""
        if conv is None or self.tool_memory is None:
            return
        for m in conv.messages:
            for c in m.tool_calls:
                if c.id and c.id in self.tool_memory:
                    r.live_tool_ids[c.id] = None

    def keys_of(self, r: Resident, binding: ThinkingBinding | None) -> tuple:
        """Disk aliases (`_alias`) of state ``r`` besides its own text: a thinking
        turn's visible keys without their EOS (the next prompt renders the turn without
        its reasoning, so its text never starts with the live text;
        `ds4mlx.kv.live.visible_keys`)."""
        if binding is None or binding.n_tokens != len(r.session.tokens):
            return ()
        tok = self.engine.tokenizer
        return tuple(
            _alias(tok, k.head(len(k.text) - len(EOS)))
            for k in binding.keys
            if k.text.endswith(EOS)
        )

    def after_generation(
        self,
        r: Resident,
        *,
        finish: str,
        tool_calls: Sequence = (),
        prompt_text: Rendered | None = None,
        thinking: bool = False,
        text: str = "",
        transcript_key: Rendered | str | None = None,
    ) -> None:
        """Remember what the next prompt may continue state ``r`` from.

        Args:
            r: the state the turn ran on.
            finish: the turn's finish reason (``stop`` is an end of turn).
            tool_calls: the ``ds4mlx.dsml.ToolCall``s the turn sampled, in order.
            prompt_text: the rendered prompt of a chat turn, or None (a raw turn).
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

        r.bindings.clear()
        r.live_keys = ()
        for c in tool_calls:
            if c.id:
                r.live_tool_ids[c.id] = None
        n = len(r.session.tokens)
        if transcript_key is not None:
            r.bindings.transcript = TranscriptBinding(transcript_key, n)
        if finish != "stop" or prompt_text is None:
            return
        calls = list(tool_calls)
        if calls and all(c.id for c in calls):
            ids, names = tuple(c.id for c in calls), tuple(c.name for c in calls)
            r.bindings.tool = ToolBinding(ids, n, names)
        if thinking and prompt_text.text.endswith(THINK_START):
            keys = visible_keys(prompt_text, text, render_tool_calls(calls, self.tool_memory))
            r.bindings.thinking = ThinkingBinding(keys, n)


def replaced(r: Resident) -> None:
    """State ``r`` is about to be replaced: nothing of it is on disk or bound."""
    r.live_tool_ids.clear()
    r.tracker.reset()


def reset(r: Resident) -> None:
    """Empty state ``r`` (a new conversation): no bindings, nothing saved."""
    r.bindings.clear()
    r.live_keys = ()
    r.salt = ""
    replaced(r)
    r.session.reset()
