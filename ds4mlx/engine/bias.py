"""Logit bias (OpenAI's ``logit_bias``): fixed per-token offsets added to the logits of
every sampled step, as a `TurnHooks` mask."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ds4mlx.engine.hooks import Turn, TurnHooks

__all__ = ["LogitBias"]


class LogitBias(TurnHooks):
    """Adds ``bias`` to the logits of every step the loop samples (forced and scripted
    tokens skip masks). A bias of -100 all but bans a token and +100 all but forces it,
    as in OpenAI's API; greedy steps (protocol structure, temperature 0) take the argmax
    of the biased logits.

    Args:
        bias: ``(token id, offset)`` pairs; ids in ``[0, vocab)`` (the route checked
            them), offsets in logit units.
    """

    def __init__(self, bias: Sequence[tuple[int, float]]):
        self.ids = [int(t) for t, _ in bias]
        self.values = [float(v) for _, v in bias]
        self._dense: mx.array | None = None  # made on the inference thread, at first use

    def mask(self, turn: Turn, logits: mx.array) -> mx.array | None:
        if self._dense is None or self._dense.shape != logits.shape:
            zeros = mx.zeros(logits.shape, dtype=logits.dtype)
            values = mx.array(self.values, dtype=logits.dtype)
            self._dense = zeros.at[mx.array(self.ids, dtype=mx.int32)].add(values)
        return logits + self._dense
