"""Logit bias (OpenAI's ``logit_bias``): fixed per-token offsets added to the logits of
every sampled step; presence and frequency penalties (OpenAI's ``presence_penalty`` and
``frequency_penalty``): offsets that grow with the reply's own tokens; the repetition
penalty (vLLM's and Hugging Face's ``repetition_penalty``): a factor on the logits of
every token already in the context; vLLM's ``min_tokens`` and ``ignore_eos``: no EOS
before a count of tokens, or at all. All are `TurnHooks` masks."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ds4mlx.engine.hooks import Turn, TurnHooks

__all__ = ["EndBan", "LogitBias", "Penalties", "RepetitionPenalty"]


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


class Penalties(TurnHooks):
    """OpenAI's presence and frequency penalties: before each sampled step, every token
    the turn has produced so far has ``count * frequency + presence`` taken off its
    logit (``count``: how often it came; negative values favour repetition), as in
    OpenAI's API reference ("Parameter details": ``mu[j] - c[j] * alpha_frequency -
    float(c[j] > 0) * alpha_presence``). Every token handed to the loop counts
    (sampled, scripted, forced, verified drafts: the reply's text), reasoning
    included. Steps inside the protocol's structure (a tool call's DSML, decoded
    greedily) are left alone: a penalty on markup that must repeat (parameter tags,
    quotes) would break the call, and the client's wish is about its prose.

    Args:
        presence: subtracted once from every token seen (OpenAI: -2..2).
        frequency: subtracted per occurrence (OpenAI: -2..2).
    """

    def __init__(self, presence: float = 0.0, frequency: float = 0.0):
        self.presence = float(presence)
        self.frequency = float(frequency)
        self.counts: dict[int, int] = {}

    def on_token(self, turn: Turn, token: int) -> None:
        self.counts[int(token)] = self.counts.get(int(token), 0) + 1

    def mask(self, turn: Turn, logits: mx.array) -> mx.array | None:
        if not self.counts or turn.in_structure:
            return None
        # Sparse: only the reply's own tokens move (tens to thousands of ids, not the
        # 129,280 of the vocabulary).
        ids = mx.array(list(self.counts), dtype=mx.int32)
        offsets = [-(n * self.frequency + self.presence) for n in self.counts.values()]
        return logits.at[ids].add(mx.array(offsets, dtype=logits.dtype))


class RepetitionPenalty(TurnHooks):
    """The multiplicative repetition penalty of Keskar et al., "CTRL" (2019), §4.1, as
    vLLM and Hugging Face ``transformers`` apply it (``repetition_penalty``): before each
    sampled step, every token already in the context (the prompt and the reply so far)
    has its logit divided by ``penalty`` where positive and multiplied by it where not,
    so above 1 it is less likely and below 1 more. Steps inside the protocol's structure
    are left alone, as `Penalties` leaves them.

    Args:
        penalty: the factor (> 0; 1 changes nothing).

    Raises:
        ValueError: ``penalty`` not above 0.
    """

    def __init__(self, penalty: float):
        if not penalty > 0:
            raise ValueError(f"a repetition penalty is above 0, got {penalty}")
        self.penalty = float(penalty)
        self.seen: set[int] | None = None  # the context's ids, read at the first step
        self._ids: mx.array | None = None  # `seen` as an array, remade when it grows

    def on_token(self, turn: Turn, token: int) -> None:
        if self.seen is not None and int(token) not in self.seen:
            self.seen.add(int(token))
            self._ids = None

    def mask(self, turn: Turn, logits: mx.array) -> mx.array | None:
        if self.seen is None:
            # The session holds the whole context (a live or restored prefix included):
            # every token in it counts, as in vLLM's prompt-and-output rule.
            self.seen = {int(t) for t in turn.s.tokens}
        if not self.seen or turn.in_structure:
            return None
        if self._ids is None:
            self._ids = mx.array(sorted(self.seen), dtype=mx.int32)
        factor = mx.where(logits[self._ids] > 0, 1.0 / self.penalty, self.penalty)
        return logits.at[self._ids].multiply(factor.astype(logits.dtype))


class EndBan(TurnHooks):
    """vLLM's ``min_tokens`` (and ``ignore_eos``, an unbounded ban): the EOS token's logit
    is ``-inf`` at every sampled step while the reply has fewer than ``until`` tokens
    (reasoning included, as vLLM counts every output token), so the turn cannot end
    there by itself; a stop string, the output limit or a full context still end it.
    Forced and scripted tokens skip masks, as for every mask.

    Args:
        until: tokens the reply has before an EOS may be sampled; None: never.
    """

    def __init__(self, until: int | None):
        self.until = until

    def mask(self, turn: Turn, logits: mx.array) -> mx.array | None:
        if self.until is not None and turn.result.completion_tokens >= self.until:
            return None
        eos = mx.array([turn.tok.eos_id], dtype=mx.int32)
        return logits.at[eos].add(mx.array([-mx.inf], dtype=logits.dtype))
