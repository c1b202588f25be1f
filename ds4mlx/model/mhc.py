"""Manifold-constrained hyper-connections (mHC), as few graph nodes as possible.

docs/ARCHITECTURE.md §2 (Hyper-connections): the residual is ``hc`` streams ``(L, hc, dim)``;
around each sub-block

    mixes = (flat · fnᵀ) · rsqrt(mean(flat²) + eps)      flat = streams as (L, hc·dim)
    pre   = sigmoid(mixes[:hc]·s0 + b) + hc_eps           block input = Σ_j pre_j · stream_j
    post  = 2 · sigmoid(mixes[hc:2hc]·s1 + b)
    comb  = Sinkhorn(mixes[2hc:]·s2 + b)                   (hc x hc)
    out_k = post_k · f(x) + Σ_j comb[j, k] · stream_j      (comb transposed)

Node-count choices (each is one kernel launch per layer on a GPU):

* the mean-square scale, the three affine maps and the sigmoids are one fused
  elementwise node (per-column group masks select pre / post / comb); on a GPU the
  normalization is one ``mx.fast.rms_norm`` kernel before the matmul instead;
* ``Σ_j pre_j · stream_j`` and ``Σ_j comb[j, k] · stream_j`` are matmuls, not a multiply
  and a reduction;
* everything elementwise sits in ``mx.compile``d functions so it fuses;
* Sinkhorn is one custom kernel on a GPU (``sinkhorn.py``), the plain loop on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import mlx.core as mx
import numpy as np

from .attention import rms_norm, weighted_rms_norm


def _groups(hc: int) -> list[tuple[int, int]]:
    return [(0, hc), (hc, 2 * hc), (2 * hc, (2 + hc) * hc)]


@cache
def hc_pre_fn(
    hc: int, iters: int, hc_eps: float, norm_eps: float, sinkhorn: Callable, gpu: bool = False
) -> Callable[..., tuple[mx.array, mx.array, mx.array]]:
    """Compiled ``fn(x, hc_fn, scale, base, norm_w) -> (y, post, comb)``.

    ``x`` ``(L, hc, dim)``; ``hc_fn`` ``((2+hc)·hc, hc·dim)``, ``scale`` ``(3,)``,
    ``base`` ``((2+hc)·hc,)`` float32, ``norm_w`` the sub-block's RMSNorm weight
    (``attn_norm`` / ``ffn_norm``, eps ``norm_eps``). Returns the normalized block input
    ``y`` ``(L, dim)`` in ``x``'s dtype, ``post`` ``(L, hc)`` and ``comb`` ``(L, hc, hc)``
    float32.
    ``sinkhorn(logits, iters, eps)`` is the device's implementation; ``gpu`` selects the
    GPU form of the normalization (one ``mx.fast.rms_norm`` kernel).
    """

    # Per-column group masks of the (2+hc)·hc mixes: pre | post | comb logits. With them
    # the three affine + activation chains are one fused elementwise node (host-built
    # constants, not graph nodes).
    col = np.arange((2 + hc) * hc)
    # Built from numpy, so already evaluated: a lazy constant would be tied to the stream
    # of the thread that first traced this function.
    masks = [(col >= a) & (col < b) for a, b in _groups(hc)]
    g_pre, g_post, g_comb = (mx.array(m) for m in masks)
    f_pre, f_post, f_comb = (mx.array(m.astype(np.float32)) for m in masks)

    def fn(x, hc_fn, scale, base, norm_w):
        L = x.shape[0]
        flat = x.reshape(L, -1).astype(mx.float32)
        if gpu:  # one rms_norm kernel, then the matmul
            mixes = mx.fast.rms_norm(flat, None, norm_eps) @ hc_fn.T
        else:  # as DeepSeek writes it: (flat · fnᵀ) · rsqrt(mean(flat²) + eps), fused below
            mixes = (flat @ hc_fn.T) * mx.rsqrt(
                mx.mean(flat * flat, axis=-1, keepdims=True) + norm_eps
            )
        s = scale[0:1] * f_pre + scale[1:2] * f_post + scale[2:3] * f_comb  # slices: no gather
        z = mixes * s + base
        sig = mx.sigmoid(z)
        w = mx.where(g_pre, sig + hc_eps, mx.where(g_post, 2 * sig, z))
        pre, post = w[:, :hc], w[:, hc : 2 * hc]
        comb = sinkhorn(w[:, 2 * hc :].reshape(L, hc, hc), iters, hc_eps)
        y = (pre[:, None, :] @ x.astype(mx.float32)).reshape(L, -1)
        # The sub-block's input norm (attn_norm / ffn_norm) in the same compiled call.
        return weighted_rms_norm(y.astype(x.dtype), norm_w, norm_eps), post, comb

    return mx.compile(fn)


@mx.compile
def hc_post(f: mx.array, residual: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """Streams ``(L, hc, dim)``: ``post_k · f + Σ_j comb[j, k] · residual_j``, ``residual``'s dtype."""
    mixed = comb.swapaxes(-1, -2) @ residual.astype(mx.float32)
    return (post[:, :, None] * f[:, None, :] + mixed).astype(residual.dtype)


@mx.compile
def hc_post2(
    f1: mx.array, f2: mx.array, residual: mx.array, post: mx.array, comb: mx.array
) -> mx.array:
    """``hc_post`` of ``f1 + f2`` (routed + shared expert) with the add fused in."""
    mixed = comb.swapaxes(-1, -2) @ residual.astype(mx.float32)
    return (post[:, :, None] * (f1 + f2)[:, None, :] + mixed).astype(residual.dtype)


@cache
def hc_head_fn(hc_eps: float, norm_eps: float) -> Callable[..., mx.array]:
    """Compiled final collapse ``fn(x, fn, scale, base) -> (L, dim)``: pre weights only
    (``sigmoid(mixes·scale + base) + eps``, no Sinkhorn), weighted sum of the streams."""

    def fn(x, hc_fn, scale, base):
        L = x.shape[0]
        flat = rms_norm(x.reshape(L, -1).astype(mx.float32), None, norm_eps)
        pre = mx.sigmoid((flat @ hc_fn.T) * scale + base) + hc_eps
        return (pre[:, None, :] @ x.astype(mx.float32)).reshape(L, -1)

    return mx.compile(fn)
