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
    - `mask`: the logits to sample this step from, ``(vocab,)`` float (e.g. ``-inf``
      on forbidden ids), or None for the session's own; forced tokens skip it.
    - `draft`: proposed tokens to follow the one just sampled (a draft model, a
      lookup); `ds4mlx.engine.speculative` verifies them in one forward pass and
      counts ``TurnResult.drafted``/``accepted`` (the engine's own drafters, chosen by
      ``Engine.speculation``, propose when this returns nothing).
    - `at_end`: the turn ended (any finish but an exception); it may call
      `Turn.force_feed` (e.g. ``</think>`` to close a cut reasoning block).
    """

    def after_prefill(self, turn: Turn) -> None:
        return None

    def before_step(self, turn: Turn) -> str | None:
        return None

    def mask(self, turn: Turn, logits: mx.array) -> mx.array | None:
        return None

    def draft(self, turn: Turn) -> Sequence[int]:
        return ()

    def at_end(self, turn: Turn) -> None:
        return None


class ChainedHooks(TurnHooks):
    """Several `TurnHooks` as one, in order: every ``after_prefill``/``at_end`` runs;
    ``before_step`` ends the turn with the first finish reason given; each ``mask``
    receives the previous one's logits (so masks compose); ``draft`` takes the first
    non-empty proposal."""

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
