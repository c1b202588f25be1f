"""Shared pytest setup.

OpenBLAS must be preloaded at process start for MLX's CPU GEMMs to be usable
(see ds4mlx/blas.py), so the test process re-executes itself once with it.
"""

import os
from pathlib import Path

import pytest

from ds4mlx.blas import ensure_openblas, needs_reexec

# One OpenBLAS thread per test process. The suite runs an xdist worker per core (and one
# more), each beside the server / agent subprocesses it starts, so every core is busy; the
# tiny model's GEMMs are small, and OpenBLAS's extra thread spent its time spinning in
# sched_yield between them (measured: sys time was a third of the suite's CPU time; this
# halves it). Set before the re-exec below, so the re-executed
# pytest, its xdist workers and every subprocess a test starts inherit it. A value the
# user set is kept. Users' servers keep OpenBLAS's default (a real model's GEMMs gain
# from every core).
OPENBLAS_THREADS = os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than the cores. A worker spends part of its time
    waiting on the processes its tests start (a server coming up, a real CLI, a rank
    timeout): in one run on 2 cores the fast set kept the cores 77 % busy and the slow
    set 63 %, so a further worker fills those waits."""
    return (os.cpu_count() or 1) + 1


def pytest_configure(config):
    if needs_reexec():
        # pytest has already redirected fd 1/2 into its capture files; the re-executed
        # process inherits fds, so hand the real terminal back first.
        capman = config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            capman.stop_global_capturing()
        ensure_openblas()
    if not hasattr(config, "workerinput"):  # once, in the controller
        _compile_package()


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """Let pytest cache its assertion rewriting of the test modules (in the git-ignored
    ``tests/__pycache__``) while it collects, also where ``PYTHONDONTWRITEBYTECODE`` is
    set (see `_compile_package`): pytest writes that cache only when the interpreter may
    write bytecode, so every xdist worker of both runs (fast set, slow set) rewrote all
    the test modules again, 5 of the 8 CPU-s a worker's collection took. The setting is
    the user's again once collection ends."""
    import sys

    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        yield
    finally:
        sys.dont_write_bytecode = before


def _compile_package() -> None:
    """Write the package's bytecode once before any test starts a process.

    The suite starts a few hundred Python processes (servers, CLI runs, agents), each
    importing most of ``ds4mlx``. Where ``PYTHONDONTWRITEBYTECODE`` is set (this
    project's CI machines set it), none of them writes the ``.pyc`` files, so each one
    compiled every module from source again: 0.2-0.3 s of CPU per server start
    (py-spy, `source_to_code`). The variable only stops imports from writing; they
    still read bytecode that exists, and `compileall` writes it (atomically, so a
    process importing meanwhile reads either nothing or a whole file) beside the
    sources, in the git-ignored ``__pycache__`` folders; up-to-date files are skipped.
    (Not under ``PYTHONPYCACHEPREFIX``: that moves every package's bytecode, and the
    processes then compiled all of site-packages instead: 36 -> 72 user-s on the CLI
    and doctor files.)
    """
    import compileall

    compileall.compile_dir(Path(__file__).resolve().parents[1] / "ds4mlx", quiet=1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(**make_tiny_kwargs) -> Path``: one tiny DS4 checkpoint per distinct
    set of `ds4mlx.model.tiny.make_tiny` arguments, made once per session and shared
    read-only (tests copy it before changing anything)."""
    from ds4mlx.model.tiny import make_tiny

    made: dict[tuple, Path] = {}

    def get(**kwargs) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in made:
            made[key] = Path(make_tiny(str(tmp_path_factory.mktemp("tiny")), **kwargs))
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_f32_dir(tiny_checkpoint) -> Path:
    """The seeded tiny DS4 checkpoint, unquantized float32 (quantized matmuls are slow on
    the CPU); the same one ``serve --demo`` makes. Shared read-only by every test module
    that needs a real engine."""
    from ds4mlx.model.demo import DEMO_TINY_KWARGS

    return tiny_checkpoint(**DEMO_TINY_KWARGS)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_f32_dir) -> Path:
    """The checkpoint the server tests serve: `tiny_f32_dir` (what ``serve --demo`` uses)."""
    return tiny_f32_dir


@pytest.fixture(scope="session")
def server_factory():
    """``server_factory(model_dir, **Server kwargs) -> Server``: a running ``ds4mlx serve``
    shared by the session, one per distinct set of flags (`server_util.ServerPool`)."""
    from server_util import ServerPool

    pool = ServerPool()
    yield pool.get
    pool.close()


@pytest.fixture
def workspace(tmp_path) -> Path:
    """An empty agent workspace directory."""
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture
def ws(workspace: Path) -> Path:
    """`workspace`, under the name the tool tests use."""
    return workspace


@pytest.fixture
def tb(ws: Path):
    """A `ds4mlx.agent.tools.Toolbox` in ``ws`` that allows everything (60 s bash bound)."""
    from ds4mlx.agent.permissions import Permissions
    from ds4mlx.agent.tools import Toolbox

    with Toolbox(ws, Permissions(yes=True), kill_grace=0.3, bash_timeout=60) as box:
        yield box


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (``CI`` set) a skipped test fails: oracle, parity and client tests skip
    locally when their dependency is missing, but CI installs everything, so a skip
    there means a check silently stopped running."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under CI (a dependency is missing?): {reason}"
