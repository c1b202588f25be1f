"""Shared pytest setup.

OpenBLAS must be preloaded at process start for MLX's CPU GEMMs to be usable
(see ds4mlx/blas.py), so the test process re-executes itself once with it.
"""

from ds4mlx.blas import ensure_openblas, needs_reexec


def pytest_configure(config):
    if needs_reexec():
        # pytest has already redirected fd 1/2 into its capture files; the re-executed
        # process inherits fds, so hand the real terminal back first.
        capman = config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            capman.stop_global_capturing()
        ensure_openblas()
