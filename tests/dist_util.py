"""Launching ``tests/dist_script.py`` (or any python command) as two MLX ring ranks on
127.0.0.1 under ``mlx.launch``, for the distributed tests (``test_distributed*.py``).

The launcher exits 0 even when a rank fails, so a run is judged by the files rank 0
writes and the launcher's own per-rank warnings; it runs in its own process group,
killed at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from server_util import free_port

SCRIPT = Path(__file__).with_name("dist_script.py")
N_PROMPT, CHUNK = 300, 64


def _launcher() -> str:
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        pytest.skip("mlx.launch is not on PATH")
    return launcher


def _ring(argv: list[str]) -> list[str]:
    """``argv`` (a python command) under ``mlx.launch`` as two ring ranks on loopback."""
    return [
        _launcher(),
        "--backend",
        "ring",
        "--hosts",
        "127.0.0.1,127.0.0.1",
        "--starting-port",
        str(free_port(2)),  # the ring listens on one port per rank
        "--",
        *argv,
    ]


def under_launcher(server):
    """``server`` (a `server_util.Server`, not started) as two ring ranks under
    ``mlx.launch``: in its own session, so the ranks are found and killed as one group,
    and with an open stdin pipe nobody writes, as a terminal's would be (the launcher's
    main loop spins on a stdin at end of file, such as ``/dev/null``)."""
    server.cmd = _ring(server.cmd)
    server.start_new_session = True
    server.stdin = subprocess.PIPE
    return server


def _launch(
    model_dir: Path, out: Path, split: str | None, timeout: float = 600, extra: tuple = ()
) -> str:
    argv = [str(SCRIPT), str(model_dir), str(out), str(N_PROMPT), str(CHUNK)]
    log = _launched([sys.executable, *argv, *([split] if split else []), *extra], timeout)
    assert out.exists(), log[-3000:]
    return log


def _launched(argv: list[str], timeout: float = 600, *, clean: bool = True) -> str:
    """Run ``argv`` as two ring ranks (its own process group, killed afterwards); the
    launcher's whole output. With ``clean``, no rank may exit non-zero."""
    cmd = _ring(argv)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SCRIPT.parents[1]), *sys.path]))
    # stdin: a pipe held open and never written (see `under_launcher`).
    stdin, held = os.pipe()
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
    finally:
        os.close(stdin)
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
        os.close(held)
    assert not clean or "exited with code" not in log, log[-3000:]
    return log


def kill_group(proc) -> None:
    """SIGKILL ``proc``'s process group (a launcher started with ``start_new_session``:
    its ranks too); nothing when ``proc`` is None or the group is gone."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
