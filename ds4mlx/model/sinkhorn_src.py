"""The mHC Sinkhorn loop as kernel source text, plus a numpy reference of the same loop.

This module imports only numpy on purpose: ``benchmarks/gpu_check.py`` loads it on an
NVIDIA machine that has CuPy but no MLX, compiles ``SINKHORN_BODY`` with CuPy's
``RawKernel`` and checks it against ``sinkhorn_reference``. The MLX wrappers
(``sinkhorn.py``: ``mx.fast.metal_kernel`` and ``mx.fast.cuda_kernel``) compile the very
same text, so what is validated there is what runs on a Mac or an MLX CUDA build.

Order of operations (DeepSeek's ``hc_split_sinkhorn``; docs/ARCHITECTURE.md §2, "Hyper-connections"): per
``HC x HC`` matrix ``c`` of logits,

1. row softmax (``exp(x - rowmax) / rowsum``), then ``+ eps`` on every entry;
2. one column normalization ``c / (colsum + eps)``;
3. ``ITERS - 1`` times: row normalization ``c / (rowsum + eps)``, then column
   normalization.

Sums run left to right (index 0 first) in float32, in the kernel and in the reference.

The body's contract with a wrapper (which writes the function signature):

* ``HC``, ``ITERS``: integer compile-time constants (template parameters or ``#define``);
* ``SK_EXP(x)``: single-precision exponential of the device (``metal::exp`` / ``expf``);
* ``mat``: index of this thread's matrix (one thread per matrix), already bounds-checked;
* ``logits``: ``const float*``, matrices stored row-major, ``HC*HC`` floats each;
* ``params``: ``const float*``; ``params[0]`` is ``eps``;
* ``comb``: ``float*`` output, same layout as ``logits``.
"""

from __future__ import annotations

import numpy as np

SINKHORN_BODY = """
    const int base = (int)mat * HC * HC;
    const float eps = params[0];
    float c[HC * HC];
    for (int i = 0; i < HC * HC; ++i) {
        c[i] = logits[base + i];
    }
    // 1. Row softmax, then + eps.
    for (int r = 0; r < HC; ++r) {
        float m = c[r * HC];
        for (int j = 1; j < HC; ++j) {
            m = c[r * HC + j] > m ? c[r * HC + j] : m;
        }
        float s = 0.0f;
        for (int j = 0; j < HC; ++j) {
            c[r * HC + j] = SK_EXP(c[r * HC + j] - m);
            s += c[r * HC + j];
        }
        for (int j = 0; j < HC; ++j) {
            c[r * HC + j] = c[r * HC + j] / s + eps;
        }
    }
    // 2. and 3. One column normalization, then (ITERS - 1) x (row, column).
    for (int it = 0; it < ITERS; ++it) {
        if (it > 0) {
            for (int r = 0; r < HC; ++r) {
                float s = 0.0f;
                for (int j = 0; j < HC; ++j) {
                    s += c[r * HC + j];
                }
                const float d = s + eps;
                for (int j = 0; j < HC; ++j) {
                    c[r * HC + j] = c[r * HC + j] / d;
                }
            }
        }
        for (int j = 0; j < HC; ++j) {
            float s = 0.0f;
            for (int r = 0; r < HC; ++r) {
                s += c[r * HC + j];
            }
            const float d = s + eps;
            for (int r = 0; r < HC; ++r) {
                c[r * HC + j] = c[r * HC + j] / d;
            }
        }
    }
    for (int i = 0; i < HC * HC; ++i) {
        comb[base + i] = c[i];
    }
"""


# Per-device pieces around the shared body: the exponential and this thread's matrix.
# (``count[0]`` is the number of matrices; launches may round the thread count up.)
METAL_HEADER = "#define SK_EXP(x) metal::exp(x)\n"
METAL_PROLOGUE = (
    "    const uint mat = thread_position_in_grid.x;\n    if (mat >= (uint)count[0]) return;\n"
)
CUDA_HEADER = "#define SK_EXP(x) expf(x)\n"
CUDA_PROLOGUE = (
    "    const int mat = blockIdx.x * blockDim.x + threadIdx.x;\n    if (mat >= count[0]) return;\n"
)


def kernel_source(kind: str) -> tuple[str, str]:
    """``(header, source)`` for ``kind`` ``"metal"`` or ``"cuda"``: prologue + ``SINKHORN_BODY``."""
    if kind == "metal":
        return METAL_HEADER, METAL_PROLOGUE + SINKHORN_BODY
    if kind == "cuda":
        return CUDA_HEADER, CUDA_PROLOGUE + SINKHORN_BODY
    raise ValueError(f"no Sinkhorn kernel for {kind!r}")


def standalone_cuda(hc: int, iters: int) -> str:
    """A complete CUDA C translation unit (for CuPy ``RawKernel``, no MLX) around the same
    body: ``ds4_mhc_sinkhorn(logits, params, count, comb)``, one thread per matrix."""
    header, source = kernel_source("cuda")
    return (
        f"#define HC {hc}\n#define ITERS {iters}\n{header}"
        'extern "C" __global__ void ds4_mhc_sinkhorn(const float* logits, const float* params,'
        " const int* count, float* comb) {\n"
        f"{source}}}\n"
    )


def standalone_c(hc: int, iters: int) -> str:
    """The same body as a plain C function looping over matrices (host check with a C
    compiler): ``void ds4_mhc_sinkhorn(const float*, const float*, const int*, float*)``."""
    return (
        f"#include <math.h>\n#define HC {hc}\n#define ITERS {iters}\n#define SK_EXP(x) expf(x)\n"
        "void ds4_mhc_sinkhorn(const float* logits, const float* params, const int* count,"
        " float* comb) {\n  for (int mat = 0; mat < count[0]; ++mat) {\n"
        f"{SINKHORN_BODY}  }}\n}}\n"
    )


def sinkhorn_reference(logits: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """The loop of ``SINKHORN_BODY`` in numpy float32, same order of operations.

    Args:
        logits: ``(..., hc, hc)`` comb logits (``mixes * scale + base``).
        iters: ``hc_sinkhorn_iters`` (≥ 1).
        eps: ``hc_eps``.

    Returns:
        float32 ``(..., hc, hc)`` comb weights (rows ≈ columns ≈ 1 after enough iterations).
    """
    c = np.array(logits, dtype=np.float32, copy=True)
    hc = c.shape[-1]
    e = np.float32(eps)

    def total(axis: int) -> np.ndarray:
        # Left-to-right float32 sum, as the kernel's loop (numpy's own sum is pairwise).
        s = np.take(c, 0, axis=axis)
        for j in range(1, hc):
            s = (s + np.take(c, j, axis=axis)).astype(np.float32)
        return np.expand_dims(s, axis)

    m = c.max(axis=-1, keepdims=True)
    c = np.exp(c - m).astype(np.float32)
    c = (c / total(-1) + e).astype(np.float32)
    for it in range(iters):
        if it > 0:
            c = (c / (total(-1) + e)).astype(np.float32)
        c = (c / (total(-2) + e)).astype(np.float32)
    return c
