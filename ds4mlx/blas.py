"""Pick the fastest BLAS the machine has for MLX's CPU backend.

The Linux ``mlx[cpu]`` wheel links the reference BLAS, whose GEMM is ~80x slower than
OpenBLAS (256x4096x4096 f32: 4.2 s vs 0.05 s measured). A shared library can only be
swapped in at process start, so when OpenBLAS is installed and not yet preloaded we
re-execute the current command with ``LD_PRELOAD`` set. Nothing happens on macOS
(Accelerate) or when the user already chose a preload.
"""

from __future__ import annotations

import os
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)
_MARK = "DS4MLX_BLAS_REEXEC"


def openblas_path() -> str | None:
    """Return the path of an installed OpenBLAS shared library, or None."""
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    return None


def active_blas() -> str:
    """Name the BLAS this process runs with ("openblas", "accelerate" or "reference")."""
    if sys.platform == "darwin":
        return "accelerate"
    return "openblas" if "openblas" in os.environ.get("LD_PRELOAD", "") else "reference"


def blas_label() -> str:
    """``active_blas()`` for banners, with a hint when the slow reference BLAS runs.

    e.g. ``"openblas"``, or ``"reference (~80x slower GEMM: install OpenBLAS, e.g.
    apt-get install libopenblas0-pthread)"``.
    """
    name = active_blas()
    if name != "reference":
        return name
    if openblas_path() is not None:
        return "reference (~80x slower GEMM; OpenBLAS is installed: unset DS4MLX_NO_OPENBLAS)"
    return (
        "reference (~80x slower GEMM: install OpenBLAS, e.g. apt-get install libopenblas0-pthread)"
    )


def needs_reexec() -> bool:
    """True when OpenBLAS is installed but this process did not start with it.

    ``DS4MLX_NO_OPENBLAS=1`` disables the re-exec.
    """
    if sys.platform != "linux" or os.environ.get(_MARK) or os.environ.get("DS4MLX_NO_OPENBLAS"):
        return False
    return openblas_path() is not None and "openblas" not in os.environ.get("LD_PRELOAD", "")


def ensure_openblas(argv: list[str] | None = None) -> None:
    """Re-exec ``argv`` (default: this process's command line) with OpenBLAS preloaded.

    Returns normally when no re-exec is needed or possible; otherwise never returns.
    """
    if not needs_reexec():
        return
    path = openblas_path()
    env = dict(os.environ)
    env[_MARK] = "1"
    env["LD_PRELOAD"] = ":".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
    args = argv if argv is not None else [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(args[0], args, env)
