"""Issue 26: ``examples/claude-code.sh`` finds the Claude Code the README installs, says how
to point it at one when there is none, and stops at once when no server answers."""

from __future__ import annotations

import os
import shutil
import subprocess

from server_util import REPO, free_port

SCRIPT = REPO / "examples" / "claude-code.sh"


def _env(**kw) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CLAUDE", "DS4MLX_URL")}
    # A PATH with the shell tools and python3 but no `claude`.
    env["PATH"] = os.pathsep.join(
        p for p in env["PATH"].split(os.pathsep) if not (p and os.path.exists(f"{p}/claude"))
    )
    return {**env, **kw}


def test_no_server_stops_at_once_naming_the_url(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    r = subprocess.run([str(SCRIPT), "-p", "hi"], capture_output=True, text=True,
                       timeout=60, env=_env(DS4MLX_URL=url), stdin=subprocess.DEVNULL)  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.strip() == (
        f"claude-code.sh: no server at {url} (start one: ds4mlx serve --demo, or set DS4MLX_URL)"
    )


def test_without_claude_it_says_how_to_point_at_one(tmp_path):
    copy = tmp_path / "examples" / "claude-code.sh"  # no tests/clients beside this copy
    copy.parent.mkdir()
    shutil.copy(SCRIPT, copy)
    r = subprocess.run([str(copy)], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 1 and "Claude Code not found" in r.stderr
    assert "CLAUDE=/path/to/claude" in r.stderr


def test_the_readme_install_is_found():
    """The README's test command installs Claude Code into tests/clients; the script finds
    it there (here the server check then stops it: nothing listens)."""
    assert (REPO / "tests" / "clients" / "node_modules" / ".bin" / "claude").exists()
    url = f"http://127.0.0.1:{free_port()}"
    r = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=60,
                       env=_env(DS4MLX_URL=url))  # fmt: skip
    assert "not found" not in r.stderr and "no server at" in r.stderr


def test_a_server_wanting_a_key_is_named_before_claude_starts(tiny_model_dir, server_factory):
    """``/health`` needs no key, so the script's probe of the context size is what meets
    the 401: it says to set ``DS4MLX_API_KEY`` (before, it blamed a missing server and
    Claude Code then retried the 401 for minutes)."""
    s = server_factory(tiny_model_dir, ctx=1024, extra=["--kv-disk-dir", "none", "--api-key", "k1"])
    env = {k: v for k, v in _env(DS4MLX_URL=s.url).items() if k != "DS4MLX_API_KEY"}
    r = subprocess.run([str(SCRIPT), "-p", "hi"], capture_output=True, text=True,
                       timeout=60, env=env, stdin=subprocess.DEVNULL)  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.strip() == (
        f"claude-code.sh: the server at {s.url} wants an API key (serve --api-key): set "
        "DS4MLX_API_KEY to it"
    )
