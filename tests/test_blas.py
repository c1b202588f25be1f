import ctypes
import os
import subprocess
import sys

import mlx.core as mx
from conftest import OPENBLAS_THREADS

from ds4mlx.blas import active_blas, openblas_path


def test_openblas_preloaded_when_installed():
    if openblas_path() is None:
        assert active_blas() == "reference"
        return
    assert active_blas() == "openblas"
    assert "openblas" in os.environ["LD_PRELOAD"]


def test_matmul_runs_in_float32():
    a = mx.random.normal((256, 512))
    out = a @ a.T
    mx.eval(out)
    assert out.dtype == mx.float32 and out.shape == (256, 256)


def test_test_processes_run_openblas_with_the_suites_thread_count():
    """The suite's OpenBLAS thread count (one unless the user set one: tests/conftest.py)
    reaches the library in this worker and in the subprocesses tests start: a second
    thread per process only spun beside the other workers and servers."""
    path = openblas_path()
    if path is None:
        return
    assert ctypes.CDLL(path).openblas_get_num_threads() == int(OPENBLAS_THREADS)
    probe = f"import ctypes; print(ctypes.CDLL({path!r}).openblas_get_num_threads())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert int(out.stdout) == int(OPENBLAS_THREADS)
