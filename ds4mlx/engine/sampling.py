"""The categorical draw for `ds4mlx.sampling.SamplingParams`: three filters on the
log-probabilities, the temperature, then a draw with an explicit key.

The filters are written here rather than imported from mlx-lm: importing any mlx-lm
module runs its package ``__init__``, which imports its converter and, through it,
transformers (and torch where installed), seconds of start-up for every process.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ds4mlx.sampling import SamplingParams

__all__ = [
    "SamplingParams",
    "min_p_filter",
    "sample_token",
    "sampling_logprobs",
    "top_k_filter",
    "top_p_filter",
]

_NEG_INF = float("-inf")


def top_p_filter(logprobs: mx.array, top_p: float) -> mx.array:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability mass
    reaches ``top_p`` (ties at the threshold are kept), set the rest to ``-inf``.

    Args:
        logprobs: log-probabilities ``(..., vocab)`` (any float dtype; the mass is summed
            in float32).
        top_p: mass in (0, 1].

    Returns:
        ``logprobs`` with dropped entries ``-inf``, same shape and dtype.
    """
    ascending = mx.sort(logprobs, axis=-1)
    probs = mx.exp(ascending.astype(mx.float32))
    # Mass strictly above each sorted position; a position is dropped while the tokens
    # above it already hold top_p of the total.
    above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = above[..., :1] + probs[..., :1]
    # At most vocab - 1: the top token always survives. A top_p whose product with the
    # total underflows float32 (1e-300) would otherwise count every position, an index
    # past the end (MLX does not check it: the draw was garbage).
    dropped = mx.minimum(
        (above >= top_p * total).sum(axis=-1, keepdims=True), ascending.shape[-1] - 1
    )
    threshold = mx.take_along_axis(ascending, dropped, axis=-1)
    return mx.where(logprobs < threshold, _NEG_INF, logprobs)


def min_p_filter(logprobs: mx.array, min_p: float) -> mx.array:
    """Drop tokens whose probability is below ``min_p`` × the top probability (the top
    token always survives).

    Args:
        logprobs: log-probabilities ``(..., vocab)``.
        min_p: in (0, 1].

    Returns:
        ``logprobs`` with dropped entries ``-inf``, same shape and dtype.
    """
    floor = logprobs.max(axis=-1, keepdims=True) + math.log(min_p)
    return mx.where(logprobs < floor, _NEG_INF, logprobs)


def top_k_filter(logprobs: mx.array, top_k: int) -> mx.array:
    """Keep the ``top_k`` most likely tokens (ties broken arbitrarily), set the rest to
    ``-inf``.

    Args:
        logprobs: log-probabilities ``(..., vocab)``.
        top_k: in (0, vocab).

    Returns:
        Same shape and dtype as ``logprobs``.
    """
    rest = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, rest, mx.array(_NEG_INF, logprobs.dtype), axis=-1)


def _filtered(logits: mx.array, params: SamplingParams) -> mx.array:
    """``logits`` ``(..., vocab)`` through the request's filters (top-p, min-p, top-k),
    filtered ids ``-inf``; shifted by a constant per row, not normalised. Every filter
    is invariant to that shift (top-p divides by the mass it sums, min-p and top-k
    compare within the row); the shift by the row's maximum keeps top-p's ``exp`` finite."""
    vocab = logits.shape[-1]
    if 0 < params.top_p < 1:
        logits = top_p_filter(logits - logits.max(axis=-1, keepdims=True), params.top_p)
    if params.min_p > 0:
        logits = min_p_filter(logits, params.min_p)
    if 0 < params.top_k < vocab:
        logits = top_k_filter(logits, params.top_k)
    return logits


def sampling_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The distribution `sample_token` draws from, as log-probabilities: float32
    ``logits`` ``(..., vocab)`` through the filters (top-p, min-p, top-k, on the
    untempered distribution) and the temperature, normalised over the last axis
    (filtered ids ``-inf``). Speculative sampling compares drafts against it."""
    scaled = _filtered(logits, params) * (1.0 / params.temperature)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def sample_token(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """Draw one token id (uint32 scalar array) from float32 ``logits`` of shape (vocab,)
    under `sampling_logprobs`' distribution.

    The draw is Gumbel-max (``mx.random.categorical``), which only needs the scaled
    logits up to a constant: normalising first costs two passes of ``exp`` over the
    vocabulary (129,280 ids; on the CPU the largest part of a tiny model's step) and
    does not change the distribution."""
    scaled = _filtered(logits[None], params)
    if params.temperature != 1.0:
        scaled = scaled * (1.0 / params.temperature)
    # An explicit key, not MLX's global generator: any other MLX user in the process
    # would perturb that one.
    return mx.random.categorical(scaled, key=key)[0]
