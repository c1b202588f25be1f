"""Issue 26 items 4 and 6: every bad value is one line on stderr with exit 2 (usage) or 1
(runtime), never a traceback; and the quiet corners of the command line say what they do.

Real ``ds4mlx`` processes throughout (``python -m ds4mlx.cli`` with this checkout first on
the path); ``XDG_CACHE_HOME`` points at a scratch directory so ``--demo`` makes its own
tiny model instead of touching the user's cache.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_util import REPO, free_port

CMD = [sys.executable, "-m", "ds4mlx.cli"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("xdg")
    return {
        **os.environ,
        "XDG_CACHE_HOME": str(cache),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "COLUMNS": "80",
    }


def _run(env, *args, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CMD, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, **kw
    )


@pytest.fixture(scope="module")
def places(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli_errors")
    existing = root / "existing"
    existing.mkdir()
    (existing / "config.json").write_text("{}")
    (root / "empty").mkdir()
    (root / "shared.txt").write_text("someone's notes\n")
    (root / "link.jsonl").symlink_to(root / "shared.txt")
    # An interrupted download or copy: the weights file cut short, or empty.
    for name, size in (("trunc", 5000), ("hollow", 0)):
        shutil.copytree(tiny_model_dir, root / name)
        for f in (root / name).glob("*.safetensors"):
            with open(f, "r+b") as fh:
                fh.truncate(size)
    return {
        "TRUNC": root / "trunc",
        "HOLLOW": root / "hollow",
        "LINK": root / "link.jsonl",
        "AFILE": existing / "config.json",
        "MISSING": root / "no-such-model",
        "EXISTING": existing,
        "EMPTY": root / "empty",
        "TINY": tiny_model_dir,
        "OUT": root / "out",
    }


# (arguments, exit status, a phrase of the one line). Placeholders in CAPS are filled
# from ``places``; PORT is a free port (so only the bad value can fail).
BAD = [
    (["serve", "--port", "99999"], 2, "not a port"),
    (["serve", "--port", "0"], 2, "not a port"),
    (["serve", "--demo", "--served-model-name", "", "--port", "PORT"], 2, "an empty value"),
    (["make-tiny", "AFILE"], 1, "is a file; give a directory"),
    (["make-tiny", "/proc/ds4mlx-tiny"], 1, "cannot write /proc/ds4mlx-tiny"),
    # An address problem says to check --host (it suggested another port).
    (["serve", "-m", "TINY", "--host", "999.1.1.1", "--port", "PORT"], 1, "(check --host)"),
    # The plot's format is said before minutes of measuring, not after.
    (["bench", "--demo", "--plot", "OUT.txt"], 2, "give a file name ending in .png"),
    (["bench", "--demo", "--plot", "OUT"], 2, "give a file name ending in .png"),
    # A negative interval sent keepalives without pause (50,000 in 9 s).
    (["serve", "--demo", "--keepalive", "-1"], 2, "--keepalive: -1 must be a number of seconds"),
    (["agent", "--demo", "--bash-timeout", "0"], 2, "--bash-timeout: 0 must be"),
    (["serve", "--ctx", "-5", "--demo"], 2, "--ctx: -5 must be at least 1"),
    (["serve", "--memory-limit", "foo", "--demo"], 2, "not a size: 'foo'"),
    (["serve", "-m", "MISSING", "--port", "PORT"], 2, "does not exist"),
    # A cut or empty weights file (it was a traceback from the default --sessions).
    (["serve", "-m", "TRUNC", "--port", "PORT"], 2, "cannot read the safetensors header"),
    (["serve", "-m", "HOLLOW", "--port", "PORT"], 2, "cannot read the safetensors header"),
    (["generate", "-m", "TRUNC", "-p", "hi"], 2, "cannot read the safetensors header"),
    # As serve and agent: exit 2, the line headed with the command (it was 1, "ds4mlx:").
    (["generate", "-m", "MISSING", "-p", "hi"], 2, "ds4mlx generate: cannot load model"),
    (["bench", "-m", "MISSING"], 2, "ds4mlx bench: cannot load model"),
    (["generate", "-m", "TINY", "-p", "hi", "-n", "-3"], 2, "--max-tokens: -3"),
    (["generate", "-p", "hi"], 2, "-m/--model or --demo is required"),
    (["generate", "-m", "TINY", "--demo", "-p", "hi"], 2, "not both"),
    (["generate", "-m", "TINY", "-p", "hi", "--memory-limit", "foo"], 2, "not a size"),
    (["bench", "--demo", "--frontiers", "1,x"], 2, "--frontiers"),
    (["bench", "--demo", "--frontiers", "64,32"], 2, "increasing"),
    (["bench", "--shape", "flash", "--demo"], 2, "builds its own model"),
    (["bench", "--demo", "--compare"], 2, "--compare needs --distributed"),
    # A flag error, not a failure to load the model ("cannot load model").
    (["generate", "-m", "TINY", "-p", "hi", "--pipeline-split", "2"], 2, "needs --distributed"),
    (["bench", "--demo", "--pipeline-split", "2"], 2, "--pipeline-split needs --distributed"),
    (["bench", "--demo", "--prefill-repeats", "0"], 2, "--prefill-repeats"),
    (["agent", "--ctx", "0", "--demo"], 2, "--ctx: 0 must be at least 1"),
    # An empty message (an unset variable): a usage error (it was a traceback, exit 1).
    (["agent", "--demo", "-p", " "], 2, "-p/--prompt: an empty value"),
    # Smaller than the system prompt and tools: at start (each message said "does not fit
    # even after compaction", exit 1).
    (["agent", "-m", "TINY", "--ctx", "10", "-p", "go"], 2, "give --ctx"),
    (["make-tiny", "EXISTING"], 1, "--overwrite"),
    (["convert", "MISSING", "OUT"], 1, "does not exist"),
    (["convert", "TINY", "OUT", "--override", "oops"], 2, "PART=SPEC"),
    (["tokenize", "-m", "MISSING", "hi"], 1, "is not a directory"),
    # A load that fails on the worker thread exits cleanly: the thread clears its MLX
    # streams however it ends (left to interpreter exit they aborted the process, 134).
    (["serve", "-m", "TINY", "--speculative", "mtp", "--port", "PORT"], 2, "has no MTP drafter"),
    # --draft-tokens alone turns nothing on: refused before any model loads.
    (["serve", "-m", "MISSING", "--draft-tokens", "8"], 2, "--draft-tokens needs --speculative"),
    (["generate", "--demo", "-p", "hi", "--draft-t", "2"], 2, "--draft-tokens needs"),
    (["agent", "--demo", "--draft-tokens", "2", "--speculative", "off"], 2, "needs --speculative"),
    # `--api-key "$KEY"` with KEY unset must not serve without authentication.
    (["serve", "-m", "TINY", "--api-key", "", "--port", "PORT"], 2, "--api-key: an empty key"),
    # An unknown flag points at the sub-command's own help, which lists its flags.
    (["agent", "--bogus"], 2, "unrecognized arguments: --bogus (see ds4mlx agent --help)"),
    # "" (an unset $VAR) would have been the current directory, made private.
    (
        ["serve", "-m", "TINY", "--kv-disk-dir", "", "--port", "PORT"],
        2,
        "--kv-disk-dir '': an empty",
    ),
    (["kv", "show", "EXISTING", "abc", "--chars", "-5"], 2, "--chars: -5 must be at least 1"),
    # Cache settings are refused in the flags' words (it said "disk_space_mb").
    (
        ["serve", "-m", "TINY", "--kv-disk-space-mb", "0", "--port", "PORT"],
        2,
        "--kv-disk-space-mb must",
    ),
    # Said before the model loads, naming the flag (it was "cannot load model …").
    (["serve", "--demo", "--trace", "MISSING/t.jsonl", "--port", "PORT"], 2, "--trace"),
    # The trace is made private (0600): never through a symlink, never a device.
    (["serve", "--demo", "--trace", "LINK", "--port", "PORT"], 2, "not a regular file"),
    (["serve", "--demo", "--trace", "/dev/null", "--port", "PORT"], 2, "not a regular file"),
]


@pytest.mark.parametrize(("argv", "status", "phrase"), BAD, ids=[" ".join(c[0]) for c in BAD])
def test_bad_values_are_one_line(env, places, argv, status, phrase):
    argv = [str(places.get(a, a)) for a in argv]
    argv = [str(free_port()) if a == "PORT" else a for a in argv]
    r = _run(env, *argv)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == status, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "terminate called" not in r.stderr
    assert len(lines) == 1 and phrase in lines[0], r.stderr
    assert "reading headers" not in r.stderr  # no progress bar before the failure
    assert not (places["OUT"] / "config.json").exists()
    assert places["LINK"].resolve().stat().st_mode & 0o777 != 0o600


def test_convert_names_a_cut_weights_file(env, places):
    """``convert`` of a checkpoint whose weights file is empty: the file named, exit 1,
    nothing written (the safetensors error escaped as a traceback)."""
    r = _run(env, "convert", str(places["HOLLOW"]), str(places["OUT"]))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and not places["OUT"].exists()
    assert "model.safetensors: cannot read the safetensors header" in r.stderr.splitlines()[-1]


def test_a_bad_memory_limit_variable_is_named(env, places):
    """``$DS4MLX_MEMORY_LIMIT`` that is no size: one line naming the variable, before the
    model loads (it read "cannot load model …: not a size")."""
    r = _run(
        {**env, "DS4MLX_MEMORY_LIMIT": "abc"}, "generate", "-m", str(places["TINY"]), "-p", "hi"
    )
    assert r.returncode == 2, r.stderr
    assert (
        r.stderr.strip()
        == "ds4mlx: $DS4MLX_MEMORY_LIMIT: not a size: 'abc' (examples: 256MB, 5GB, 24GiB)"
    )


def test_an_override_matching_no_module_is_refused_before_writing(env, places):
    """A mistyped part (``haed``) or a pattern matching nothing left the module at its
    default, silently. Known once the headers are read; nothing is written."""
    r = _run(env, "convert", str(places["TINY"]), str(places["OUT"]), "--override", "haed=none")
    assert r.returncode == 1, r.stderr
    assert "override 'haed' matches no module of this checkpoint" in r.stderr
    assert "Traceback" not in r.stderr and not places["OUT"].exists()


def test_ctrl_c_in_a_command_is_one_line_not_a_traceback(env):
    """Ctrl+C in a command that does not handle it itself (here ``tokenize`` waiting on
    stdin; convert and bench alike): one line and 130, as the shell reports SIGINT."""
    from ds4mlx.agent.tools.background import _READ_SYSCALL

    if _READ_SYSCALL is None:
        pytest.skip("no known read syscall number on this machine")
    proc = subprocess.Popen(
        [*CMD, "tokenize"], stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # blocked reading stdin: inside the command, past start-up
            with open(f"/proc/{proc.pid}/syscall") as f:
                if f.read().split()[:2] == [_READ_SYSCALL, "0x0"]:
                    break
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        assert proc.stderr.read().strip() == "ds4mlx tokenize: interrupted"
    finally:
        proc.kill()


LOAD_INTERRUPTED = """
import os, signal, sys
import mlx.core as mx
from ds4mlx.cli import interrupted
from ds4mlx.server.worker import Worker

def load():  # a load still inside MLX when Ctrl+C comes
    os.kill(os.getpid(), signal.SIGINT)
    a = mx.random.normal((256, 256))
    while True:
        a = mx.tanh(a @ a)
        mx.eval(a)

try:
    Worker(tool_memory=None).start(load)
except KeyboardInterrupt as e:
    sys.exit(interrupted("serve", e))
"""


def test_ctrl_c_while_the_model_loads_exits_130_not_abort(env):
    """Ctrl+C while ``serve`` loads the model: the worker thread is inside MLX and goes
    on. ``serve`` says it was interrupted and exits 130; before, the interpreter's exit
    with that thread running aborted the process (``terminate called without an active
    exception``, SIGABRT) in most tries. Three tries: each used to abort alone."""
    for _ in range(3):
        r = subprocess.run(
            [sys.executable, "-c", LOAD_INTERRUPTED],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert (r.returncode, r.stderr.strip()) == (130, "ds4mlx serve: interrupted"), r.stderr


def test_a_reader_that_goes_away_ends_the_listing_quietly(env):
    """``ds4mlx tokenize -v … | head -1``: the closed pipe ends the command as SIGPIPE
    would (exit 141), without a traceback."""
    proc = subprocess.Popen(
        [*CMD, "tokenize", "-v"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    proc.stdin.write(b"hello world " * 50000)  # ~100k lines out: past any pipe buffer
    proc.stdin.close()
    assert proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=300) == 141
    assert proc.stderr.read() == b""


def test_failed_load_after_making_the_demo_model_exits_2(env, tmp_path):
    """``serve --demo`` makes the demo model in process (MLX on the main thread), then the
    load fails on the worker thread: exit 2 with one line, no abort at interpreter exit."""
    fresh = {**env, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = _run(fresh, "serve", "--demo", "--speculative", "mtp", "--port", free_port())
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "terminate called" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "making the tiny demo model" in r.stderr and "has no MTP drafter" in r.stderr


def test_make_tiny_overwrite_replaces_and_keeps_refusing_without_it(env, places, tmp_path):
    d = tmp_path / "tiny"
    assert _run(env, "make-tiny", d, "--float32").returncode == 0
    before = (d / "model.safetensors").stat().st_mtime_ns
    r = _run(env, "make-tiny", d, "--seed", "3")
    assert r.returncode == 1 and (d / "model.safetensors").stat().st_mtime_ns == before
    assert _run(env, "make-tiny", d, "--seed", "3", "--overwrite").returncode == 0


def test_generate_and_bench_take_demo(env, tmp_path):
    r = _run(env, "generate", "--demo", "-p", "hi", "-n", "4", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    csv = tmp_path / "b.csv"
    r = _run(env, "bench", "--demo", "--frontiers", "32,64", "--decode-tokens", "2", "--csv", csv)
    assert r.returncode == 0, r.stderr
    rows = csv.read_text().splitlines()
    assert rows[0].startswith("frontier") and len(rows) == 3, rows


def test_tokenize_says_it_uses_the_packaged_tokenizer(env, places):
    r = _run(env, "tokenize", "-m", places["EMPTY"], "hello")
    assert r.returncode == 0, r.stderr
    notice = [ln for ln in r.stderr.splitlines() if "tokenizer" in ln]
    assert len(notice) == 1 and "packaged" in notice[0] and str(places["EMPTY"]) in notice[0]
    # A directory with its own tokenizer.json says nothing of the kind.
    r = _run(env, "tokenize", "-m", places["TINY"], "hello")
    assert r.returncode == 0 and "packaged" not in r.stderr


def test_serve_help_shows_the_defaults(env):
    out = _run(env, "serve", "--help").stdout
    flat = " ".join(out.split())
    assert "--ctx CTX context size in tokens (default: the model's limit, at most 65536" in flat
    assert "--demo: 65536" in flat
    assert "--keepalive SECONDS keepalive interval" in flat and "(default: 10.0)" not in flat
    # Off loopback a missing key is warned about in the banner, not refused (the help
    # once said "Required").
    assert "Set one when --host is not loopback" in flat and "(the banner warns)" in flat


def test_top_level_help_names_every_subcommand(env):
    """``ds4mlx --help``'s description is the module docstring's whole first paragraph
    (it was its first line, cut after ``kv,``)."""
    out = " ".join(_run(env, "--help").stdout.split())
    assert "serve, agent, generate, bench, convert, tokenize, make-tiny, kv, doctor." in out


def test_demo_serves_claude_codes_context(env):
    """``serve --demo`` defaults to 65536 tokens (Claude Code's smallest workable window)."""
    from ds4mlx.model.demo import DEMO_CTX

    assert DEMO_CTX == 65536
    src = (REPO / "ds4mlx" / "server" / "cli.py").read_text()
    assert "args.ctx = DEMO_CTX" in src


def _kv_dir(tmp_path) -> tuple[Path, str]:
    from test_kv_store import make_store, save

    store = make_store(tmp_path)
    e = save(store, "a snapshot whose text is long enough to be cut " * 4, seed=1, n_tokens=600)
    return store.dir, e.key


def test_kv_ls_piped_is_tab_separated_whole_values(env, tmp_path):
    d, key = _kv_dir(tmp_path)
    r = _run(env, "kv", "ls", d)  # stdout is a pipe
    assert r.returncode == 0, r.stderr
    head, row = r.stdout.splitlines()
    assert head.split("\t") == ["key", "tokens", "hits", "age", "used", "reason", "size", "text"]
    cells = row.split("\t")
    assert cells[0] == key and cells[1] == "600" and cells[-1].startswith("a snapshot whose")
    assert "…" not in r.stdout and "1 snapshots" in r.stderr


def test_kv_ls_fits_an_80_column_terminal(tmp_path):
    from rich.console import Console

    from ds4mlx.cli import build_parser
    from ds4mlx.kv.cli import run

    d, key = _kv_dir(tmp_path)
    for long in ([], ["-l"]):
        con = Console(width=80, force_terminal=True, record=True)
        assert run(build_parser().parse_args(["kv", "ls", *long, str(d)]), con) == 0
        text = con.export_text()
        assert all(len(ln) <= 80 for ln in text.splitlines()), text
        for col in ("key", "tokens", "reason", "size"):
            assert f" {col} " in text, text  # whole headers: never "toke…"
        assert key[:12] in text and "600" in text


@pytest.mark.slow
def test_bench_flash_honours_frontiers_and_shows_progress():
    """Per frontier one row per layer (plus embedding+head), prefill timed per interval;
    the build reports its progress. One Flash-size layer (a minute or so here)."""
    from ds4mlx.bench import run_flash_shape

    seen: list[tuple[int, int]] = []
    res = run_flash_shape(
        1, frontiers=[4, 8], decode_tokens=1, progress=lambda d, t: seen.append((d, t))
    )
    assert [r.context for r in res.rows] == [4, 4, 8, 8]
    assert [r.layer for r in res.rows] == [0, -1, 0, -1]
    assert len(seen) > 10 and seen[-1][0] == seen[-1][1] and seen[0][0] < seen[0][1]
    with pytest.raises(ValueError, match="increasing"):
        run_flash_shape(1, frontiers=[8, 4])
