"""Issue 26 must-hold: every command README.md and examples/README.md show in a ``bash``
block runs here. Each command line is classified; a line no rule knows fails the test, so
a new command in the docs needs a way to run here.

- ``ds4mlx …`` runs for real, paths under ``~/models`` replaced by small checkpoints made
  here (the tiny model, its conversions) and ``serve`` started until ``/health`` answers;
- ``hf download`` (network, 156 GB) runs as ``hf download --help``;
- ``pip install`` runs as ``pip install --dry-run --no-deps`` (the suite's environment
  already has the packages), ``npm install`` as ``npm ls`` of the same prefix;
- ``python3 -m venv`` and ``source …/activate`` run for real in a scratch directory;
- ``examples/claude-code.sh`` runs for real against no server (it must stop with "no server
  at"); Claude Code against a server is tests/test_e2e_claude.py;
- ``curl`` lines are tests/test_e2e_readme.py's (against the demo server); the test command
  is the suite itself and must be the last line of .ci/run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_util import HTTP, REPO, free_port

DOCS = [REPO / "README.md", REPO / "examples" / "README.md"]


def _commands() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", doc.read_text(), flags=re.S):
            joined = re.sub(r"\\\n\s*", " ", block)
            for ln in joined.splitlines():
                ln = ln.split(" #")[0].strip()
                if ln and not ln.startswith("#"):
                    for part in ln.split(" && "):
                        out.append((doc.name, part.strip()))
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("home")
    return {
        **os.environ,
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "PYTHONPATH": str(REPO),
        "COLUMNS": "120",
    }


def _run(argv, env, timeout=900, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO, **kw)  # fmt: skip


def _ds4mlx(argv: list[str], env, home: Path, tiny: Path) -> None:
    """Run ``ds4mlx ARGV`` with the documented model paths made real and small."""
    models = home / "models"
    release = models / "DeepSeek-V4-Flash"
    if not release.exists():
        shutil.copytree(tiny, release)  # stands in for the 156 GB download
    argv = [a.replace("~", str(home)) for a in argv]
    argv = ["DIR" if a == "DIR" else a for a in argv]
    if "DIR" in argv:
        argv[argv.index("DIR")] = str(tiny)
    if argv[0] == "convert" and Path(argv[2]).exists():
        argv.append("--overwrite")
    if argv[0] == "serve":
        _serve(argv, env)
        return
    cmd = [sys.executable, "-m", "ds4mlx.cli", *argv]
    r = _run(cmd, env)
    assert r.returncode == 0, (argv, r.stderr[-2000:])
    assert "Traceback" not in r.stderr


def _serve(argv: list[str], env) -> None:
    """Start the documented serve command (on a free port) until /health answers."""
    for flag in ("--kv-disk-dir",):
        if flag in argv and argv[argv.index(flag) + 1].startswith("/fast"):
            argv[argv.index(flag) + 1] = str(Path(env["HOME"]) / "kv")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ds4mlx.cli", *argv, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)  # fmt: skip
    try:
        import time

        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (argv, proc.stderr.read()[-2000:])
            try:
                if HTTP.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, argv
            time.sleep(0.3)
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.slow
def test_every_documented_command_runs_here(env, tiny_f32_dir):
    home = Path(env["HOME"])
    ran: list[str] = []
    seen: set[str] = set()
    for doc, line in _commands():
        if line in seen:  # shown twice (a set-up repeated per client): run once
            continue
        seen.add(line)
        words = shlex.split(line)
        run_env = dict(env)
        while words and re.fullmatch(r"[A-Z0-9_]+=\S*", words[0]):  # VAR=value prefixes
            k, _, v = words.pop(0).partition("=")
            run_env[k] = v
        head = words[0]
        if head == "ds4mlx":
            _ds4mlx(words[1:], run_env, home, tiny_f32_dir)
        elif head == "hf":
            assert words[1] == "download"
            r = _run(["hf", "download", "--help"], run_env)
            assert r.returncode == 0 and "--local-dir" in r.stdout
        elif head == "pip":
            assert words[1] == "install"
            r = _run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
                      "--no-build-isolation", *words[2:]], run_env)  # fmt: skip
            assert r.returncode == 0, (line, r.stderr[-2000:])
        elif head == "npm":
            assert words[1] == "install" and "--prefix" in words
            prefix = words[words.index("--prefix") + 1]
            r = _run(["npm", "ls", "--prefix", prefix], run_env)
            assert r.returncode == 0, (line, r.stdout[-2000:])
        elif head == "python3" and words[1:3] == ["-m", "venv"]:
            r = _run([sys.executable, "-m", "venv", "--without-pip", str(home / "venv")], run_env)
            assert r.returncode == 0, r.stderr
        elif head == "source":
            activate = home / "venv" / "bin" / "activate"
            r = _run(["bash", "-c", f"source {activate} && echo $VIRTUAL_ENV"], run_env)
            assert r.stdout.strip() == str(home / "venv")
        elif head == "examples/claude-code.sh":
            run_env["DS4MLX_URL"] = f"http://127.0.0.1:{free_port()}"
            r = _run([str(REPO / head), *words[1:]], run_env, stdin=subprocess.DEVNULL)
            assert r.returncode == 1 and "no server at" in r.stderr, r.stderr
        elif head == "curl":
            continue  # tests/test_e2e_readme.py runs them against the demo server
        elif head == "python" and words[1:3] == ["-m", "pytest"]:
            last = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
            assert line in last  # the suite itself, run by .ci/run
            continue
        else:
            raise AssertionError(f"{doc}: no way to run {line!r} here; add a rule")
        ran.append(line)
    assert any("ds4mlx doctor" in c for c in ran) and any("hf download" in c for c in ran)
    assert any("ds4mlx convert" in c for c in ran) and any(
        "examples/claude-code.sh" in c for c in ran
    )
