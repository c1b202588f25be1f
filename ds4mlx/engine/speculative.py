"""Speculative decoding: drafters propose tokens, the target verifies them in one pass.

One draft→verify step of the turn loop (`ds4mlx.engine.turn`), after the loop sampled
and accepted a token ``t0`` that is to be fed:

1. a drafter proposes up to ``k`` tokens ``d1 … dk`` to follow ``t0`` (`TurnHooks.draft`
   first, then the engine's own: the checkpoint's MTP head or DSpark drafter
   (`ds4mlx.engine.dspark`), `PromptLookup`; ``auto`` asks the lookup first for a
   longest n-gram match, then the checkpoint's drafter, then shorter matches);
2. one forward pass over the ``k + 1`` rows ``t0, d1 … dk`` from the live state
   (`ds4mlx.engine.session.VerifyStep`) gives the target's logits after each row;
3. token by token, exactly as the plain loop would: poll (cancel, hooks, length), pick
   the target's token from row ``i - 1`` (forced feeds, scripts, the logits mask,
   greedy inside DSML structure all apply), hand it to the loop (`Turn.handle`:
   streaming, stop strings, DSML state, tool memory); greedy accepts ``di`` when it is
   the argmax, temperature > 0 accepts it with probability ``min(1, p/q)`` and
   otherwise draws from the normalised residual (`accept_draft`), so the output
   distribution is the target's. The first rejected draft's replacement is the target's
   own token: it is handed to the loop too, and the step ends;
4. the session keeps what was fed (`VerifyStep.settle`: all rows as computed, or a
   rewind of every cache and one forward over the kept tokens) and ``after_token`` runs
   once per kept token, after the state holds only verified rows.

`BackOff` pauses drafting when the loop measures it losing: two verifies in a row
that accept nothing or cost more seconds per token than plain decode steps pause it
for 4, 8, … 256 steps (plain, pipelined decode meanwhile).

Drafting runs unpipelined (docs/KERNELS.md "Speculative decoding"); paused steps and
turns without a drafter keep the pipelined decode.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ds4mlx.engine.dspark import dspark_drafter
from ds4mlx.engine.hooks import ChainedHooks, TurnHooks
from ds4mlx.engine.mtp import MTPDrafter
from ds4mlx.engine.sampling import sampling_logprobs
from ds4mlx.engine.session import Session, VerifyStep, split_key
from ds4mlx.sampling import DEFAULT_DRAFT_TOKENS as DEFAULT_DRAFT
from ds4mlx.sampling import MAX_DRAFT_TOKENS as MAX_DRAFT
from ds4mlx.sampling import SPECULATIVE_MODES as MODES

# ``Turn`` below is ``ds4mlx.engine.turn``'s (that module imports this one: typed ``Any``
# here, no import cycle).
Turn = Any


@dataclass
class Speculation:
    """An engine's speculative-decoding setting and running totals (``/health``).

    Attributes:
        mode: one of `MODES` (``off``: no drafting).
        k: draft tokens per verify (1 … `MAX_DRAFT`).
        drafted / accepted / fed / forwards: totals over the engine's turns (tokens
            checked, tokens accepted, tokens fed while drafting was on, target forward
            passes of those decodes).
        mtp: the MTP drafter (``ds4mlx.engine.mtp.MTPDrafter``), or None.
        dspark: the DSpark drafter (``ds4mlx.engine.dspark.DSparkDrafter``), or None.
    """

    mode: str = "off"
    k: int = DEFAULT_DRAFT
    drafted: int = 0
    accepted: int = 0
    fed: int = 0
    forwards: int = 0
    mtp: Any = field(default=None, repr=False)
    dspark: Any = field(default=None, repr=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"speculative mode must be one of {', '.join(MODES)}")
        if not 1 <= self.k <= MAX_DRAFT:
            raise ValueError(f"draft tokens must be in 1..{MAX_DRAFT}, got {self.k}")

    def add(self, result) -> None:
        """Count one turn's `TurnResult` into the totals."""
        self.drafted += result.drafted
        self.accepted += result.accepted
        if result.drafted:
            self.fed += result.fed
            self.forwards += result.forwards

    def report(self) -> dict[str, Any]:
        """The totals for ``/health``: mode, k, drafted, accepted, tokens per forward."""
        tpf = round(self.fed / self.forwards, 3) if self.forwards else None
        return {
            "mode": self.mode,
            "draft_tokens": self.k,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tokens_per_forward": tpf,
        }


def refused_under_split(mode: str) -> str | None:
    """Why ``--speculative mode`` cannot run on a model split across ranks, or None
    (``off``). Needs no model: every rank refuses before joining the ring."""
    if mode == "off":
        return None
    # A verify writes rejected rows into every rank's caches; the followers cannot
    # rewind them yet (docs/DISTRIBUTED.md).
    return f"--speculative {mode} is not supported with --distributed yet"


def speculation_for(engine, mode: str, k: int = DEFAULT_DRAFT) -> Speculation:
    """The `Speculation` to set on ``engine`` for ``--speculative mode --draft-tokens k``.

    ``auto``: the checkpoint's drafter (MTP or DSpark) when it has one, plus prompt
    lookup. The MTP drafter exists when the engine was loaded with it
    (``Engine.load(speculative=…)``); the DSpark drafter is loaded here. Raises
    ValueError (a message for the user): ``mtp`` on a checkpoint without an ``mtp.*``
    drafter; ``dspark`` on one without a DSpark drafter, or a malformed one; a bad mode
    or ``k``; any drafting on a model split across ranks.
    """
    if getattr(engine, "layout", "") and (refused := refused_under_split(mode)):
        raise ValueError(refused)
    blocks = getattr(engine.model, "mtp", None)
    if mode == "mtp" and not blocks:
        if getattr(engine.args, "drafter", None) == "dspark":
            # Flash 0731: its mtp.* tensors are DSpark stages, the drafter the user meant.
            raise ValueError(
                f"--speculative mtp: {engine.path} has no MTP drafter: its mtp.* tensors "
                "are a DSpark drafter (dspark_block_size in config.json); use "
                "--speculative dspark (or auto)"
            )
        n = getattr(engine.args, "n_mtp_layers", 0)
        raise ValueError(
            f"--speculative mtp: {engine.path} has no MTP drafter "
            f"(num_nextn_predict_layers {n}, no mtp.* tensors loaded); use lookup or off"
        )
    mtp = MTPDrafter(engine.model) if blocks and mode in ("auto", "mtp") else None
    dspark = dspark_drafter(engine, mode)
    return Speculation(mode, k, mtp=mtp, dspark=dspark)


def draft_words(result) -> str:
    """`` drafted=D accepted=A tokens/forward=T`` for a `TurnResult` that drafted (the
    per-request log line, ``generate -v``), else ``""``."""
    if not result.drafted:
        return ""
    tpf = result.fed / max(result.forwards, 1)
    return f" drafted={result.drafted} accepted={result.accepted} tokens/forward={tpf:.2f}"


# --------------------------------------------------------------------------- acceptance


def accept_draft(
    logprobs: mx.array, draft: int, q: mx.array | None, key: mx.array
) -> tuple[int, bool]:
    """The speculative-sampling rule for one drafted token.

    Args:
        logprobs: the target's sampling distribution ``(vocab,)`` as log-probabilities
            (`ds4mlx.engine.sampling.sampling_logprobs`).
        draft: the drafted id.
        q: the drafter's distribution ``(vocab,)`` as probabilities, or None for a
            deterministic drafter (all its mass on ``draft``).
        key: an MLX PRNG key (split here for the two draws).
    Returns:
        ``(token, accepted)``: ``draft`` with probability ``min(1, p(draft)/q(draft))``;
        otherwise a draw from ``max(0, p - q)`` normalised (then ``accepted`` False).
        The token's marginal distribution is ``p`` whatever ``q`` is.
    """
    p = mx.exp(logprobs.astype(mx.float32))
    if q is None:
        q = mx.zeros_like(p).at[draft].add(1.0)
    k_accept, k_resid = mx.random.split(key)
    u = mx.random.uniform(key=k_accept)
    qd = q[draft]
    ok = (qd > 0) & (u * qd < p[draft])  # u < p/q without dividing by a tiny q
    resid = mx.maximum(p - q, 0.0)
    alt = mx.random.categorical(mx.log(resid), key=k_resid)
    mx.eval(ok, alt)
    if ok.item() or resid.sum().item() <= 0:
        return int(draft), True
    return int(alt.item()), False


# --------------------------------------------------------------------------- drafters


class PromptLookup:
    """The n-gram drafter: the continuation of the latest earlier occurrence of the
    context's last ``n`` tokens (``n`` from ``longest`` down to ``shortest``), over the
    prompt and the generated tokens. No weights; an index of every n-gram's latest end
    is kept incrementally (O(1) per token after the first call)."""

    def __init__(self, longest: int = 3, shortest: int = 2):
        self.sizes = range(longest, shortest - 1, -1)
        self.seen: dict[tuple[int, ...], int] = {}
        self.toks: list[int] = []

    def _sync(self, tokens: Sequence[int], then: int | None = None) -> None:
        """Index ``tokens`` (then ``then``, when given) past what the last call saw: only
        their new tail is read, so a session's whole token list is never copied."""
        n, total = len(self.toks), len(tokens) + (then is not None)
        last = (tokens[n - 1] if n <= len(tokens) else then) if n else None
        if total < n or (n and last != self.toks[-1]):  # another context
            self.seen.clear()
            self.toks, n = [], 0
        if n <= len(tokens):
            self.toks.extend(tokens[n:])
            if then is not None:
                self.toks.append(then)
        # Index the n-grams that end before the last position (the last one is the query).
        for end in range(max(n, 1), len(self.toks)):
            for size in self.sizes:
                if end >= size:
                    self.seen[tuple(self.toks[end - size : end])] = end

    def propose(
        self, tokens: Sequence[int], k: int, shortest: int = 0, then: int | None = None
    ) -> list[int]:
        """Up to ``k`` ids to follow ``tokens`` and then ``then`` (the sampled token not
        fed yet, when given); empty when no n-gram of ``shortest`` tokens or more
        recurs."""
        self._sync(tokens, then)
        toks = self.toks
        for n in self.sizes:
            if len(toks) <= n or n < shortest:
                continue
            end = self.seen.get(tuple(toks[-n:]))
            if end is not None and end < len(toks):
                return toks[end : end + k]
        return []


class BackOff:
    """Pauses drafting while it loses (see the module doc); time is measured on the
    loop's own steps (seconds per fed token, plain vs verify)."""

    FIRST, LONGEST = 4, 256

    def __init__(self):
        self.pause = 0
        self.next_pause = self.FIRST
        self.misses = 0
        self.plain_s: float | None = None  # seconds per token of plain steps (EMA)
        self.mark: float | None = None  # when the last paused step started
        self.wasted = 0  # verifies that accepted nothing

    def ready(self) -> bool:
        """Whether this step may draft (a paused one counts down, and is timed)."""
        now = time.perf_counter()
        if self.mark is not None:
            dt, self.mark = now - self.mark, None
            self.plain_s = dt if self.plain_s is None else 0.7 * self.plain_s + 0.3 * dt
        if self.pause > 0:
            self.pause -= 1
            self.mark = now
            return False
        return True

    def record(self, seconds: float, fed: int, accepted: int) -> None:
        """One verify step: ``fed`` tokens in ``seconds``, ``accepted`` drafts."""
        self.wasted += accepted == 0
        slow = self.plain_s is not None and seconds > self.plain_s * max(fed, 1)
        if accepted == 0 or slow:
            self.misses += 1
        else:
            self.misses, self.next_pause = 0, self.FIRST
        if self.misses >= 2:
            self.pause, self.misses = self.next_pause, 0
            self.next_pause = min(2 * self.next_pause, self.LONGEST)


def _drafts(hooks: TurnHooks) -> bool:
    """Whether ``hooks`` (or one they chain, or the ``inner`` hooks a wrapper such as
    ``ds4mlx.engine.steer.Steering`` delegates to) overrides `TurnHooks.draft`."""
    if isinstance(hooks, ChainedHooks):
        return any(_drafts(h) for h in hooks.hooks)
    inner = getattr(hooks, "inner", None)
    if isinstance(inner, TurnHooks):
        return _drafts(inner)
    return type(hooks).draft is not TurnHooks.draft


class Drafting:
    """The draft→verify step of one turn (see the module doc): built by `for_turn`,
    used by `ds4mlx.engine.turn.Turn.generate`."""

    def __init__(self, hooks: TurnHooks, spec: Speculation | None):
        self.hooks = hooks
        self.k = spec.k if spec is not None else DEFAULT_DRAFT
        mode = spec.mode if spec is not None else "off"
        self.lookup = PromptLookup() if mode in ("auto", "lookup") else None
        self.mtp = spec.mtp if spec is not None and mode in ("auto", "mtp") else None
        self.dspark = spec.dspark if spec is not None and mode in ("auto", "dspark") else None
        self.backoff = BackOff()

    @classmethod
    def for_turn(cls, session: Session, hooks: TurnHooks) -> Drafting | None:
        """The turn's drafting, or None: no hook drafts and the engine's `Speculation`
        is off."""
        spec = getattr(session.engine, "speculation", None)
        on = spec is not None and spec.mode != "off"
        if not on and not _drafts(hooks):
            return None
        return cls(hooks, spec if on else None)

    def ready(self, turn: Turn) -> bool:
        """Whether the coming step drafts (then it runs unpipelined)."""
        return self.backoff.ready() and turn.s.room() >= 2

    def propose(self, turn: Turn, t0: int) -> list[int]:
        """Drafts to follow ``t0``: the hooks', else the engine's drafters'; cut so that
        every row fits the context and no draft lies past ``max_tokens``, and to the
        prefix the hooks admit (`TurnHooks.admit`: a grammar's allowed tokens)."""
        s, r = turn.s, turn.result
        limit = min(self.k, s.room() - 1, turn.spec.max_tokens - r.completion_tokens)
        if limit < 1:
            return []
        drafts = list(self.hooks.draft(turn))
        self.qs: list[mx.array | None] = []
        if not drafts and self.lookup is not None and (self.mtp or self.dspark):
            # ``auto``: where the text repeats a longest n-gram, copying it costs no
            # forward and runs long (code, quoted files); the model drafter elsewhere.
            drafts = self.lookup.propose(s.tokens, limit, self.lookup.sizes[0], then=t0)
        for drafter in (self.mtp, self.dspark):
            if not drafts and drafter is not None:
                drafts, self.qs = drafter.propose(s, t0, limit, turn.spec.sampling)
        if not drafts and self.lookup is not None:
            drafts = self.lookup.propose(s.tokens, limit, then=t0)
        drafts = [int(d) for d in drafts[:limit]]
        return drafts[: self.hooks.admit(turn, drafts)] if drafts else drafts

    def feed(self, turn: Turn, t0: int, end: str | None, after: Callable[[Session], Any]):
        """Feed ``t0`` (handled, to be fed) and whatever drafted tokens the target
        accepts after it; returns the finish reason, or None to go on."""
        s, r = turn.s, turn.result
        drafts = self.propose(turn, t0) if end is None else []
        if not drafts:
            s.decode(t0)
            r.fed += 1
            r.forwards += 1
            after(s)
            return end
        t_start = time.perf_counter()
        v = VerifyStep(s, [t0, *drafts])
        kept, accepted = [t0], 0
        for i, d in enumerate(drafts):
            end = turn.poll()
            if end is not None:
                break
            row = v.logits[i]
            lp_fn = turn.logprob_for(row)
            u, ok = self._pick(turn, row, d, self.qs[i] if i < len(self.qs) else None)
            r.drafted += 1
            accepted += ok
            end, fed = turn.handle(u, lp_fn(u) if lp_fn else None)
            if fed:
                kept.append(u)
            if end is not None or not ok:
                break
        v.settle(kept)
        r.accepted += accepted
        r.fed += len(kept)
        r.forwards += v.forwards
        self.backoff.record(time.perf_counter() - t_start, len(kept), accepted)
        for _ in kept:
            after(s)
        return end

    def _pick(self, turn: Turn, row: mx.array, draft: int, q) -> tuple[int, bool]:
        """The target's token from verify row ``row`` (forced, scripted, masked, greedy
        or speculative-sampled against the drafter's probabilities ``q``, None for a
        deterministic drafter), and whether it is ``draft``."""
        if turn.forced:
            t = turn.forced.popleft()
            return t, t == draft
        s, spec = turn.s, turn.spec
        masked = self.hooks.mask(turn, row)
        row = row if masked is None else masked
        if s.script_remaining:
            t = int(s.sample_async(spec.sampling, logits=row).item())
            return t, t == draft
        if spec.greedy_after_script or turn.in_structure or spec.sampling.greedy:
            t = int(mx.argmax(row).item())
            return t, t == draft
        lp = sampling_logprobs(row, spec.sampling)
        return accept_draft(lp, draft, q, split_key(s, spec.sampling))
