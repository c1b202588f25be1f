"""The ``--demo`` model: a tiny checkpoint made once and cached."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ds4mlx.argtypes import env_positive

# Output tokens per turn of the demo model (serve --demo, agent --demo) unless a limit is
# given: its text is noise and it practically never samples EOS, so the cap stands in for
# the end of a turn. 256, or ``$DS4MLX_DEMO_MAX_TOKENS`` (tests shorten it: every demo
# reply decodes the whole cap, ~4 CPU-seconds at 256 on a 2-core CI machine).
DEMO_MAX_TOKENS = env_positive("DS4MLX_DEMO_MAX_TOKENS", 256)

# Context of ``serve --demo`` unless --ctx is given: the smallest window Claude Code works
# in (its own prompt is ~19k tokens and it compacts at the window less 33k; see
# examples/README.md). The demo's KV at this size is a few MB.
DEMO_CTX = 65536


def demo_policy(demo: bool, output_limit: int | None) -> bool:
    """Whether the demo policy applies: ``--demo`` without an explicit output limit
    (``serve --tokens``, ``agent --max-tokens``). The one source of truth for what the demo
    serves: then nothing thinks (the server's every model id, its banner and
    ``/v1/models`` ``"thinking": false``; the agent's ``/think`` is refused), and the
    ``DEMO_MAX_TOKENS`` cap ends a turn as an EOS would."""
    return bool(demo and output_limit is None)


# Why the demo policy turns thinking off, for the banner, the agent and the docs.
DEMO_NO_THINKING = (
    f"the demo model answers without thinking: its noise reasoning would fill the whole "
    f"{DEMO_MAX_TOKENS}-token cap and show nothing (serve --tokens N or agent --max-tokens N "
    f"lifts this; a request's own max_tokens does not)"
)


def demo_model_dir() -> Path:
    """The cached tiny demo checkpoint directory (``$XDG_CACHE_HOME/ds4mlx/demo``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ds4mlx" / "demo"


def ensure_demo_model(path: Path | None = None) -> Path:
    """Make the tiny demo checkpoint once (``ds4mlx.model.tiny.make_tiny``) and return it.

    Written to a temporary sibling directory and renamed, so an interrupted first run
    never leaves a half-written model behind. A cached demo whose ``config.json`` is not
    today's tiny config (made by an older ds4mlx) is made anew: the demo is what this
    version's tests and docs describe.
    """
    import json
    import shutil
    import tempfile

    from ds4mlx.model.tiny import make_tiny, tiny_config

    path = path or demo_model_dir()
    try:
        if json.loads((path / "config.json").read_text()) == tiny_config():
            return path
    except (OSError, ValueError):
        pass  # absent or unreadable: made below
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=path.parent))
    try:
        make_tiny(tmp, **DEMO_TINY_KWARGS)
        if path.exists():
            # Renamed aside first: os.replace cannot replace a non-empty directory.
            old = Path(tempfile.mkdtemp(prefix=".demo-old-", dir=path.parent))
            try:
                os.replace(path, old / "demo")
            except OSError:
                pass  # another process moved it first
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, path)
        except OSError:
            # Another process won the race; use its copy.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# ``serve --demo``: output tokens per request unless --tokens says otherwise. The demo
# model's text is noise and it practically never samples EOS.

# make_tiny options for the demo model: float32, unquantized. Measured on the CPU
# (mlx[cpu] + OpenBLAS, 2 cores): decode 45 tok/s float32 vs 30 tok/s with the default
# q4 experts / q8 rest (MLX's CPU quantized matmuls cost more than they save at toy
# size); prefill ~1100 tok/s either way.
DEMO_TINY_KWARGS: dict[str, Any] = {"expert_bits": None, "other_bits": None}
