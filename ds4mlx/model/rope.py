"""Interleaved RoPE on the last channels of each head, as one fused elementwise kernel.

DeepSeek V4 rotates pairs ``(2i, 2i+1)`` of the last ``rope_head_dim`` channels of a head
(layout ``[nope | rope]``, docs/ARCHITECTURE.md §2). Written the obvious way (slice, four products,
stack, concatenate) that is eight graph nodes per rotation and there are up to six
rotations per layer. Here a rotation is ``x2 * C + swap(x2) * S`` on the head viewed as
pairs ``(…, D/2, 2)``: ``swap`` is a strided view (pair reversed), ``C`` / ``S`` are
per-step tables that hold ``cos``/``±sin`` on the rope pairs and ``1``/``0`` on the
nope pairs, and the whole expression is one compiled elementwise primitive.

It is bit-identical to the textbook form: ``a·cos + b·(−sin)`` is exactly
``a·cos − b·sin`` in IEEE arithmetic, and nope channels are ``x·1 + y·0 = x``.
Tables are built with numpy on the host (angles in float32 like DeepSeek's reference,
cosine/sine correctly rounded from float64), so they are graph leaves: no primitive.
"""

from __future__ import annotations

import math
from functools import cache

import mlx.core as mx
import numpy as np

# Tests set this to True to run the GPU code paths (fast.rms_norm, unfused rope) on the
# CPU; None: decided by the default device.
FORCE_GPU_PATHS: bool | None = None


def on_gpu() -> bool:
    """Whether the default device is a GPU (``mx.fast`` kernels are real kernels there)."""
    if FORCE_GPU_PATHS is not None:
        return FORCE_GPU_PATHS
    return mx.default_device() != mx.cpu


def rope_inv_freq(
    dim: int,
    base: float,
    factor: float = 1.0,
    original_seq_len: int = 0,
    beta_fast: float = 32,
    beta_slow: float = 1,
) -> np.ndarray:
    """Inverse frequencies ``(dim // 2,)`` float32 for interleaved RoPE on ``dim`` channels.

    With ``original_seq_len > 0`` applies YaRN's frequency ramp only (no mscale), as
    DeepSeek's ``precompute_freqs_cis``: frequencies below the ``beta`` correction range
    are divided by ``factor``, those above are kept, with a linear ramp in between.
    """
    idx = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(base), idx).astype(np.float32)
    inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if original_seq_len > 0:

        def corr_dim(rot):
            return dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(
            np.float32
        )
        keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (unchanged), 0: interpolate
        interp = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
        inv = (interp * (1 - keep) + inv * keep).astype(np.float32)
    return inv


def rope_tables(
    inv_freq: np.ndarray, positions: np.ndarray, head_dim: int
) -> tuple[mx.array, mx.array, mx.array]:
    """Tables ``(C, S, -S)``, each float32 ``(len(positions), head_dim // 2, 2)``.

    Args:
        inv_freq: ``(rope_dim // 2,)`` float32 from ``rope_inv_freq``.
        positions: absolute positions (int), one table row each.
        head_dim: channels per head; the last ``rope_dim`` are rotated.

    ``-S`` is the conjugate rotation (the de-rotation of the attention output).
    """
    half = inv_freq.shape[0]
    pairs = head_dim // 2
    ang = positions.astype(np.float32)[:, None] * inv_freq[None, :]  # float32, as DeepSeek
    cos = np.cos(ang.astype(np.float64)).astype(np.float32)
    sin = np.sin(ang.astype(np.float64)).astype(np.float32)
    c = np.ones((len(positions), pairs, 2), np.float32)
    s = np.zeros((len(positions), pairs, 2), np.float32)
    c[:, pairs - half :, 0] = cos
    c[:, pairs - half :, 1] = cos
    s[:, pairs - half :, 0] = -sin  # first of a pair: a·cos − b·sin
    s[:, pairs - half :, 1] = sin  # second: b·cos + a·sin
    return mx.array(c), mx.array(s), mx.array(-s)


@mx.compile
def _rotate(x2: mx.array, c: mx.array, s: mx.array) -> mx.array:
    # swap(x2) pairs (a, b) -> (b, a): a strided view, read directly by the fused kernel.
    return (x2 * c + x2[..., ::-1] * s).astype(x2.dtype)


def apply_rope(x: mx.array, c: mx.array, s: mx.array) -> mx.array:
    """Rotate ``x`` ``(..., D)`` with tables ``c``/``s`` broadcastable to ``(..., D/2, 2)``.

    Pass ``-S`` for the conjugate rotation. The result has ``x``'s shape and dtype
    (rotation arithmetic in float32: the tables are float32).
    """
    x2 = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    return _rotate(x2, c, s).reshape(x.shape)


@cache
def _norm_rotate(eps: float):
    """Compiled RMSNorm (optional per-channel weight) followed by the rotation.

    Rotation is linear and the norm's scale is one scalar per row, so
    ``rope(x · r · w) = r · (x·w·C + swap(x)·swap(w)·S)``: with ``swap`` applied to the
    inputs (views) the whole expression after the mean of squares is one fused node.
    """

    def fn(x2, w2, c, s):
        r = mx.rsqrt(mx.mean(x2 * x2, axis=(-2, -1), keepdims=True) + eps)
        out = (x2 * w2) * c + (x2[..., ::-1] * w2[..., ::-1]) * s
        return (out * r).astype(x2.dtype)

    return mx.compile(fn)


def norm_rope(x: mx.array, weight: mx.array | None, eps: float, c, s) -> mx.array:
    """``apply_rope(rms_norm(x, weight, eps), c, s)`` with fewer graph nodes on the CPU.

    On a GPU (where ``mx.fast.rms_norm`` is one kernel) this is exactly that composition.
    On the CPU it is three nodes instead of four (square, sum, one fused node); rounding
    differs from the composition by float32 ulps.
    """
    if on_gpu():
        if weight is not None and weight.dtype != x.dtype:  # float32 norm weight, bf16 x
            y = mx.fast.rms_norm(x.astype(mx.float32), weight.astype(mx.float32), eps)
            return apply_rope(y.astype(x.dtype), c, s)
        return apply_rope(mx.fast.rms_norm(x, weight, eps), c, s)
    x2 = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    w = mx.array([1.0, 1.0], dtype=mx.float32) if weight is None else weight
    w2 = w.reshape(-1, 2)
    return _norm_rotate(float(eps))(x2, w2, c, s).reshape(x.shape)
