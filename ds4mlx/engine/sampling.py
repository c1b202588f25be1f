"""The categorical draw for `ds4mlx.sampling.SamplingParams` (mlx-lm's filters, an
explicit key)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ds4mlx.sampling import SamplingParams

__all__ = ["SamplingParams", "sample_token"]


def sample_token(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """Draw one token id (uint32 scalar array) from float32 ``logits`` of shape (vocab,)."""
    logprobs = (logits - mx.logsumexp(logits, keepdims=True))[None]
    vocab = logprobs.shape[-1]
    if 0 < params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < vocab:
        logprobs = apply_top_k(logprobs, params.top_k)
    # Explicit key instead of mlx-lm's categorical_sampling: that one draws from MLX's
    # global generator, which any other MLX user in the process would perturb.
    return mx.random.categorical(logprobs * (1.0 / params.temperature), key=key)[0]
