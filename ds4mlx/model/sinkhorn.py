"""mHC Sinkhorn normalization: one custom kernel on Metal / CUDA, the MLX loop on the CPU.

Written as MLX ops the loop costs one reduction plus one fused divide per normalization,
i.e. ``2 * iters`` graph nodes per call and two calls per layer: 3,440 kernel launches
per decode step at Flash depth with 20 iterations. On a GPU the whole loop runs as a
single kernel launch, one thread per ``hc x hc`` matrix (16 floats held in registers).
The kernel text (``sinkhorn_src.SINKHORN_BODY``, wrapped by ``kernel_source``) is shared by both wrappers below and by
the CuPy check in ``benchmarks/gpu_check.py``; docs/KERNELS.md says what runs where.

On the CPU the loop stays plain MLX (``sinkhorn_loop``): there is no custom-kernel API
for the CPU, and inside ``mx.compile`` each normalization is just a reduction and a fused
elementwise node.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import mlx.core as mx

from .sinkhorn_src import kernel_source

_INPUTS = ["logits", "params", "count"]
_THREADS = 64  # threads per threadgroup / block (one matrix each)


def sinkhorn_loop(logits: mx.array, iters: int, eps: float) -> mx.array:
    """The loop in MLX ops (CPU path). ``logits`` ``(..., hc, hc)`` float32 -> same shape.

    Row softmax + eps, one column normalization, then ``iters - 1`` x (row, column), each
    normalization dividing by ``sum + eps``.
    """
    comb = mx.softmax(logits, axis=-1, precise=True) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb


@cache
def metal_kernel():
    """The ``mx.fast.metal_kernel`` over ``SINKHORN_BODY`` (built once)."""
    header, source = kernel_source("metal")
    return mx.fast.metal_kernel(
        name="ds4_mhc_sinkhorn",
        input_names=_INPUTS,
        output_names=["comb"],
        source=source,
        header=header,
        ensure_row_contiguous=True,
    )


@cache
def cuda_kernel():
    """The ``mx.fast.cuda_kernel`` over ``SINKHORN_BODY`` (built once)."""
    header, source = kernel_source("cuda")
    return mx.fast.cuda_kernel(
        name="ds4_mhc_sinkhorn",
        input_names=_INPUTS,
        output_names=["comb"],
        source=source,
        header=header,
        ensure_row_contiguous=True,
    )


def sinkhorn_kernel(kernel, logits: mx.array, iters: int, eps: float) -> mx.array:
    """Run a compiled Sinkhorn ``kernel`` on ``logits`` ``(..., hc, hc)`` (float32 in/out)."""
    hc = logits.shape[-1]
    n = logits.size // (hc * hc)
    (out,) = kernel(
        inputs=[
            logits.astype(mx.float32),
            mx.array([eps], dtype=mx.float32),
            mx.array([n], dtype=mx.int32),
        ],
        template=[("HC", hc), ("ITERS", iters)],
        grid=(max(n, 1), 1, 1),
        threadgroup=(min(_THREADS, max(n, 1)), 1, 1),
        output_shapes=[logits.shape],
        output_dtypes=[mx.float32],
    )
    return out


def device_kind() -> str:
    """``"metal"``, ``"cuda"`` or ``"cpu"``: where the default device's kernels run."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def choose_sinkhorn(kind: str | None = None) -> Callable[[mx.array, int, float], mx.array]:
    """The Sinkhorn implementation for a device (default: the current default device).

    Returns ``fn(logits, iters, eps) -> comb``: the custom kernel on ``"metal"`` /
    ``"cuda"``, ``sinkhorn_loop`` on ``"cpu"``.
    """
    kind = kind or device_kind()
    if kind == "metal":
        return lambda x, iters, eps: sinkhorn_kernel(metal_kernel(), x, iters, eps)
    if kind == "cuda":
        return lambda x, iters, eps: sinkhorn_kernel(cuda_kernel(), x, iters, eps)
    return sinkhorn_loop
