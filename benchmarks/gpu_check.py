"""GPU check of the mHC Sinkhorn kernel body on an NVIDIA machine without MLX.

Run by ``benchmarks/gpu_check.sh``. Needs numpy and CuPy (and, optionally, torch); no
network, no MLX, no ds4mlx install: the kernel text is read from
``ds4mlx/model/sinkhorn_src.py`` by path (that module imports only numpy).

What it checks (docs/KERNELS.md, "What runs where"):

1. ``SINKHORN_BODY`` compiles as CUDA (CuPy ``RawKernel``, one thread per 4x4 matrix,
   the same body text the MLX ``mx.fast.cuda_kernel`` / ``metal_kernel`` wrappers use);
2. its output equals the numpy reference of the same order of operations for
   ``iters`` 1, 3, 20 and matrix counts 1 ... 1M (max abs / rel error printed);
3. with torch present, the same loop written in torch on the GPU agrees too;
4. launch + run time per call at decode size (86 matrices = 43 layers x 2) and at a
   prefill size, against the torch loop (2·iters reductions) when available.

Prints one JSON line per result and a final ``PASS`` / ``FAIL``; exit status 0 on pass.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

SRC = Path(__file__).resolve().parents[1] / "ds4mlx" / "model" / "sinkhorn_src.py"
EPS = 1e-6
THREADS = 64


def load_src():
    """``ds4mlx/model/sinkhorn_src.py`` as a module, without importing the package."""
    spec = importlib.util.spec_from_file_location("sinkhorn_src", SRC)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cupy_kernel(src, hc: int, iters: int):
    import cupy as cp

    return cp.RawKernel(src.standalone_cuda(hc, iters), "ds4_mhc_sinkhorn")


def run_cupy(kernel, logits: np.ndarray):
    import cupy as cp

    x = cp.asarray(logits, dtype=cp.float32)
    out = cp.empty_like(x)
    n = logits.shape[0]
    params = cp.asarray([EPS], dtype=cp.float32)
    count = cp.asarray([n], dtype=cp.int32)
    blocks = (n + THREADS - 1) // THREADS
    kernel((blocks,), (THREADS,), (x, params, count, out))
    return out


def torch_loop(logits, iters: int):
    """The MLX CPU path's loop, in torch (2·iters reductions + elementwise)."""
    import torch

    c = torch.softmax(logits, dim=-1) + EPS
    c = c / (c.sum(dim=-2, keepdim=True) + EPS)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + EPS)
        c = c / (c.sum(dim=-2, keepdim=True) + EPS)
    return c


def check_arithmetic(src, report) -> bool:
    ok = True
    rng = np.random.default_rng(0)
    for iters in (1, 3, 20):
        kernel = cupy_kernel(src, 4, iters)
        for n in (1, 7, 86, 4096, 1 << 20):
            x = (rng.standard_normal((n, 4, 4)) * 3).astype(np.float32)
            got = run_cupy(kernel, x).get()
            want = src.sinkhorn_reference(x, iters, EPS)
            err = float(np.abs(got - want).max())
            rel = float((np.abs(got - want) / np.maximum(np.abs(want), 1e-30)).max())
            good = bool(np.isfinite(got).all()) and err <= 1e-6 and rel <= 1e-5
            ok &= good
            report({"check": "cupy_vs_numpy", "iters": iters, "n": n, "max_abs": err,
                    "max_rel": rel, "ok": good})  # fmt: skip
    return ok


def check_torch(src, report) -> bool:
    try:
        import torch
    except ImportError:
        report({"check": "torch", "skipped": "torch not installed"})
        return True
    if not torch.cuda.is_available():
        report({"check": "torch", "skipped": "torch without CUDA"})
        return True
    ok = True
    rng = np.random.default_rng(1)
    for iters in (1, 20):
        x = (rng.standard_normal((4096, 4, 4)) * 3).astype(np.float32)
        got = run_cupy(cupy_kernel(src, 4, iters), x).get()
        want = torch_loop(torch.from_numpy(x).cuda(), iters).cpu().numpy()
        err = float(np.abs(got - want).max())
        good = err <= 1e-5
        ok &= good
        report({"check": "cupy_vs_torch_loop", "iters": iters, "max_abs": err, "ok": good})
    return ok


def bench(src, report) -> None:
    import cupy as cp

    for n in (86, 86 * 512):
        x = np.random.default_rng(2).standard_normal((n, 4, 4)).astype(np.float32)
        for iters in (1, 20):
            kernel = cupy_kernel(src, 4, iters)
            run_cupy(kernel, x)
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                run_cupy(kernel, x)
            cp.cuda.Device().synchronize()
            row = {"bench": "kernel", "n": n, "iters": iters,
                   "us_per_call": 1e6 * (time.perf_counter() - t0) / 200}  # fmt: skip
            try:
                import torch

                xt = torch.from_numpy(x).cuda()
                torch_loop(xt, iters)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    torch_loop(xt, iters)
                torch.cuda.synchronize()
                row["torch_loop_us_per_call"] = 1e6 * (time.perf_counter() - t0) / 200
            except ImportError:
                pass
            report(row)


def main() -> int:
    results = []

    def report(row: dict) -> None:
        results.append(row)
        print(json.dumps(row), flush=True)

    try:
        import cupy as cp

        report({"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()})
    except Exception as e:  # no CuPy or no GPU: nothing here can run
        report({"error": f"CuPy/GPU unavailable: {e!r}"})
        print("FAIL")
        return 1
    src = load_src()
    ok = check_arithmetic(src, report)
    ok &= check_torch(src, report)
    bench(src, report)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
