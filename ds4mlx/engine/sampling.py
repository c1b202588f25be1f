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
    dropped = (above >= top_p * total).sum(axis=-1, keepdims=True)
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


def sampling_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The distribution `sample_token` draws from, as log-probabilities: float32
    ``logits`` ``(..., vocab)`` through the filters (top-p, min-p, top-k, on the
    untempered distribution) and the temperature, normalised over the last axis
    (filtered ids ``-inf``). Speculative sampling compares drafts against it."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    vocab = logprobs.shape[-1]
    if 0 < params.top_p < 1:
        logprobs = top_p_filter(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = min_p_filter(logprobs, params.min_p)
    if 0 < params.top_k < vocab:
        logprobs = top_k_filter(logprobs, params.top_k)
    scaled = logprobs * (1.0 / params.temperature)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def sample_token(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """Draw one token id (uint32 scalar array) from float32 ``logits`` of shape (vocab,)
    under `sampling_logprobs`."""
    # An explicit key, not MLX's global generator: any other MLX user in the process
    # would perturb that one.
    return mx.random.categorical(sampling_logprobs(logits[None], params), key=key)[0]
