import os
import time

import mlx.core as mx

from ds4mlx.blas import active_blas, openblas_path


def test_openblas_preloaded_when_installed():
    if openblas_path() is None:
        assert active_blas() == "reference"
        return
    assert active_blas() == "openblas"
    assert "openblas" in os.environ["LD_PRELOAD"]


def test_matmul_runs_in_float32():
    a = mx.random.normal((256, 512))
    t = time.perf_counter()
    out = a @ a.T
    mx.eval(out)
    assert out.dtype == mx.float32 and out.shape == (256, 256)
    assert time.perf_counter() - t < 60
