"""The turn loop's extension points (`TurnHooks`) and their composition (`chain_hooks`).

Several features plug into one turn at once (steering, a single-call limit, a grammar
mask, a drafter): each is a `TurnHooks`; `chain_hooks` runs them in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

# ``turn`` below is the running ``ds4mlx.engine.turn.Turn`` (not imported: turn.py builds
# on this module).
Turn = Any


class TurnHooks:
    """Extension points of the turn loop: subclass and override what you need (every
    default does nothing). Hooks run on the inference thread with the running `Turn`.

    - `after_prefill`: the planned prefill is over (done, cut or failed): a UI closes
      its progress display.
    - `before_step`: polled before every sampling step, after ``cancel``: a finish
      reason ends the turn there (steering and cancel polls).
    - `on_token`: a token was handed to the loop (sampled, scripted, forced or a
      verified draft), before its text is emitted; the next `mask` call (if any) is
      for the token after it. A grammar advances its matcher here.
    - `mask`: the logits to sample this step from, ``(vocab,)`` float (e.g. ``-inf``
      on forbidden ids), or None for the session's own; forced tokens skip it.
    - `draft`: proposed tokens to follow the one just sampled (a draft model, a
      lookup); `ds4mlx.engine.speculative` verifies them in one forward pass and
      counts ``TurnResult.drafted``/``accepted`` (the engine's own drafters, chosen by
      ``Engine.speculation``, propose when this returns nothing).
    - `admit`: how many of the proposed drafts (a prefix) are worth verifying: a
      grammar admits those it allows after the tokens so far (the rest could never
      be accepted, and a rejected row costs a rewind and a second forward).
    - `may_end`: whether the output so far may end here (an EOS could be sampled
      next); a ``cap_is_eos`` cap stands in for an EOS only where one may come (a
      grammar: where its matcher accepts), elsewhere it ends the turn as ``length``.
    - `at_end`: the turn ended (any finish but an exception); it may call
      `Turn.force_feed` (e.g. ``</think>`` to close a cut reasoning block).
    """

    def after_prefill(self, turn: Turn) -> None:
        return None

    def before_step(self, turn: Turn) -> str | None:
        return None

    def on_token(self, turn: Turn, token: int) -> None:
        return None

    def mask(self, turn: Turn, logits: mx.array) -> mx.array | None:
        return None

    def draft(self, turn: Turn) -> Sequence[int]:
        return ()

    def admit(self, turn: Turn, drafts: Sequence[int]) -> int:
        return len(drafts)

    def may_end(self, turn: Turn) -> bool:
        return True

    def at_end(self, turn: Turn) -> None:
        return None


class ChainedHooks(TurnHooks):
    """Several `TurnHooks` as one, in order: every ``after_prefill``/``at_end`` runs;
    ``before_step`` ends the turn with the first finish reason given; each ``mask``
    receives the previous one's logits (so masks compose); ``draft`` takes the first
    non-empty proposal; ``admit`` the fewest drafts any admits; ``may_end`` holds
    where every hook lets the output end."""

    def __init__(self, hooks: Sequence[TurnHooks]):
        self.hooks = list(hooks)

    def after_prefill(self, turn: Turn) -> None:
        for h in self.hooks:
            h.after_prefill(turn)

    def before_step(self, turn: Turn) -> str | None:
        for h in self.hooks:
            stop = h.before_step(turn)
            if stop is not None:
                return stop
        return None

    def on_token(self, turn: Turn, token: int) -> None:
        for h in self.hooks:
            h.on_token(turn, token)

    def mask(self, turn: Turn, logits: mx.array) -> mx.array | None:
        out = None
        for h in self.hooks:
            masked = h.mask(turn, logits if out is None else out)
            out = masked if masked is not None else out
        return out

    def draft(self, turn: Turn) -> Sequence[int]:
        for h in self.hooks:
            proposal = h.draft(turn)
            if proposal:
                return proposal
        return ()

    def admit(self, turn: Turn, drafts: Sequence[int]) -> int:
        return min((h.admit(turn, drafts) for h in self.hooks), default=len(drafts))

    def may_end(self, turn: Turn) -> bool:
        return all(h.may_end(turn) for h in self.hooks)

    def at_end(self, turn: Turn) -> None:
        for h in self.hooks:
            h.at_end(turn)


def chain_hooks(*hooks: TurnHooks | Sequence[TurnHooks] | None) -> TurnHooks | None:
    """One `TurnHooks` for any mix of hooks, sequences of hooks and None (in order);
    None when there are none, the hook itself when there is one."""
    flat: list[TurnHooks] = []
    for h in hooks:
        if h is None:
            continue
        if isinstance(h, TurnHooks):
            flat.append(h)
        else:
            flat.extend(x for x in h if x is not None)
    if not flat:
        return None
    return flat[0] if len(flat) == 1 else ChainedHooks(flat)
