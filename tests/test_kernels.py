"""The mHC Sinkhorn kernel text, its wrappers and the CPU path; the decode graph size.

Neither GPU kernel can run here. What can be checked on this CPU:

* both MLX wrappers (Metal, CUDA) and the CuPy check script compile the one shared body
  text (``sinkhorn_src.SINKHORN_BODY``);
* that body's arithmetic, compiled as plain C with the host compiler, equals the numpy
  reference of the same order of operations;
* the CPU path (the MLX loop) equals that reference too.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.model import sinkhorn
from ds4mlx.model.sinkhorn_src import (
    SINKHORN_BODY,
    kernel_source,
    sinkhorn_reference,
    standalone_c,
    standalone_cuda,
)

ROOT = Path(__file__).resolve().parents[1]
EPS = 1e-6


def _logits(n: int, hc: int = 4, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, hc, hc)) * 2).astype(np.float32)


@pytest.mark.parametrize("kind", ["metal", "cuda"])
def test_wrappers_compile_the_shared_body(monkeypatch, kind):
    seen = {}

    def fake(**kw):
        seen.update(kw)
        return object()

    monkeypatch.setattr(mx.fast, f"{kind}_kernel", fake)
    builder = sinkhorn.metal_kernel if kind == "metal" else sinkhorn.cuda_kernel
    builder.__wrapped__()  # bypass the cache: build with the fake MLX entry point
    assert seen["source"] == kernel_source(kind)[1]
    assert seen["source"].endswith(SINKHORN_BODY)
    assert seen["header"] == kernel_source(kind)[0]
    assert seen["input_names"] == ["logits", "params", "count"]
    assert seen["output_names"] == ["comb"]


def test_gpu_check_script_uses_the_same_body():
    path = ROOT / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports no MLX, no CuPy at module level
    src = mod.load_src()
    assert src.SINKHORN_BODY == SINKHORN_BODY
    assert SINKHORN_BODY in standalone_cuda(4, 20)
    assert "import mlx" not in (ROOT / "ds4mlx/model/sinkhorn_src.py").read_text()


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_cpu_loop_matches_reference(iters):
    x = _logits(64)
    got = np.array(sinkhorn.sinkhorn_loop(mx.array(x), iters, EPS))
    want = sinkhorn_reference(x, iters, EPS)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-7)
    # The last step normalizes columns; rows approach 1 as iterations grow.
    np.testing.assert_allclose(want.sum(-2), 1, atol=1e-4)
    if iters == 20:
        np.testing.assert_allclose(want.sum(-1), 1, atol=0.05)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("iters", [1, 3, 20])
def test_body_arithmetic_as_c_matches_reference(tmp_path, iters):
    """Compile the kernel body with the host C compiler and run it via ctypes."""
    src = tmp_path / "sk.c"
    lib = tmp_path / "sk.so"
    src.write_text(standalone_c(4, iters))
    subprocess.run(["cc", "-O2", "-fPIC", "-shared", "-o", str(lib), str(src), "-lm"], check=True)
    fn = ctypes.CDLL(str(lib)).ds4_mhc_sinkhorn
    x = _logits(257, seed=iters)
    out = np.zeros_like(x)
    params = np.array([EPS], np.float32)
    count = np.array([x.shape[0]], np.int32)
    ptr = ctypes.POINTER(ctypes.c_float)
    fn(
        x.ctypes.data_as(ptr),
        params.ctypes.data_as(ptr),
        count.ctypes.data_as(ctypes.POINTER(ctypes.c_int)),
        out.ctypes.data_as(ptr),
    )
    np.testing.assert_allclose(out, sinkhorn_reference(x, iters, EPS), rtol=1e-6, atol=1e-7)


def test_cpu_device_chooses_the_loop():
    assert sinkhorn.device_kind() == "cpu"
    assert sinkhorn.choose_sinkhorn() is sinkhorn.sinkhorn_loop
    assert sinkhorn.choose_sinkhorn("cpu") is sinkhorn.sinkhorn_loop
    with pytest.raises(ValueError):
        kernel_source("vulkan")


def test_decode_step_primitive_budget():
    """Issue 9's figure at a depth that runs fast: per layer, the 43-layer budget holds."""
    from ds4mlx.model.graph import VIEW_OPS, decode_step_primitives
    from ds4mlx.model.tiny import random_model, tiny_config

    model = random_model(tiny_config(7, sinkhorn_iters=1))
    cache = model.make_cache()
    prompt = mx.array(np.random.default_rng(0).integers(1000, 100000, 64), dtype=mx.int32)
    model(prompt[None], cache)
    before = [c.capture() for c in cache]
    r = decode_step_primitives(model, cache, 1234)
    assert r["non_view"] == r["primitives"] - sum(
        n for op, n in r["by_op"].items() if op in VIEW_OPS
    )
    assert r["non_view"] <= 4500 * 7 / 43
    # Counting left the cache as it was (nothing evaluated, state put back).
    assert [c.offset for c in cache] == [64] * 7
    assert all(
        a[2][0] is b[2][0] for a, b in zip(before, [c.capture() for c in cache], strict=True)
    )


def test_gpu_code_paths_agree_with_the_cpu_paths(monkeypatch):
    """The GPU forms (``mx.fast.rms_norm`` then RoPE, normalization before the mHC matmul)
    run here through MLX's CPU fallbacks and must give the CPU forms' logits (the Sinkhorn
    kernels themselves cannot run here; the loop stands in for them)."""
    from ds4mlx.model import rope
    from ds4mlx.model.tiny import random_model, tiny_config

    toks = mx.array(np.random.default_rng(3).integers(1000, 100000, 150), dtype=mx.int32)

    def run():
        model = random_model(tiny_config(6))
        cache = model.make_cache()
        first = model(toks[None, :140], cache)[0]
        rest = [model(toks[None, i : i + 1], cache)[0, 0] for i in range(140, 150)]
        return np.concatenate([np.array(first), np.stack([np.array(r) for r in rest])])

    cpu = run()
    monkeypatch.setattr(rope, "FORCE_GPU_PATHS", True)
    gpu = run()
    np.testing.assert_allclose(gpu, cpu, atol=1e-4)


def test_model_runs_on_a_second_thread():
    """Cached compiled functions must not hold lazy constants tied to the stream of the
    thread that traced them (the server loads and runs the model on worker threads)."""
    import threading

    from ds4mlx.model.tiny import random_model, tiny_config

    out: dict = {}

    def run(tag: str, model=None):
        try:
            model = model or random_model(tiny_config(4, sinkhorn_iters=2))
            out["model"] = model
            cache = model.make_cache()
            mx.eval(model(mx.array([[5, 6, 7]]), cache), model(mx.array([[8]]), cache))
            out[tag] = "ok"
        except Exception as e:  # reported below, in the test's thread
            out[tag] = repr(e)
        finally:
            mx.clear_streams()

    for tag in ("first", "second"):
        t = threading.Thread(target=run, args=(tag, out.get("model")))
        t.start()
        t.join()
    assert out["first"] == "ok" and out["second"] == "ok", out
