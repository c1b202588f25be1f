"""The console script as README says: ``ds4mlx make-tiny`` then ``ds4mlx generate``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

DS4MLX = shutil.which("ds4mlx")
CMD = [DS4MLX] if DS4MLX else [sys.executable, "-m", "ds4mlx.cli"]


def _run(*args, timeout=300):
    return subprocess.run([*CMD, *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "tiny"
    r = _run("make-tiny", d, "--seed", 1)
    assert r.returncode == 0, r.stderr
    assert (d / "config.json").is_file() and (d / "tokenizer.json").is_file()
    assert list(d.glob("*.safetensors"))
    return d


def test_generate_streams_text(tiny):
    r = _run("generate", "-m", tiny, "-p", "Say hello 你好", "-n", 12, "--seed", 7, "-v")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # noise, but text
    assert "tok/s" in r.stderr
    # The turn loop's finish reason (was stop=None after an EOS).
    assert re.search(r"stop=(length|stop);", r.stderr), r.stderr
    again = _run("generate", "-m", tiny, "-p", "Say hello 你好", "-n", 12, "--seed", 7)
    assert again.returncode == 0 and again.stdout == r.stdout  # seeded: reproducible


def test_generate_nothink_greedy(tiny):
    r = _run("generate", "-m", tiny, "-p", "hi", "-n", 6, "--temp", 0, "--nothink")
    assert r.returncode == 0, r.stderr


def test_generate_bad_model_dir(tmp_path):
    r = _run("generate", "-m", tmp_path / "nope", "-p", "hi")
    assert r.returncode != 0 and "cannot load model" in r.stderr


def test_tokenize(tiny):
    r = _run("tokenize", "-m", tiny, "<｜User｜>hi<think>")
    assert r.returncode == 0, r.stderr
    ids = json.loads(r.stdout)
    assert ids[0] == 128803 and ids[-1] == 128821


@pytest.mark.slow
def test_bench_csv(tiny, tmp_path):
    out = tmp_path / "bench.csv"
    png = tmp_path / "bench.png"
    r = _run(
        "bench",
        "-m",
        tiny,
        "--frontiers",
        "32,64",
        "--decode-tokens",
        3,
        "--csv",
        out,
        "--plot",
        png,
    )
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert lines[0].startswith("frontier,prefill_tokens,") and len(lines) == 3
    assert "roofline" in r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_checks_output_paths_before_measuring(tiny, tmp_path):
    """A bad --csv/--plot path is a usage error up front, not a traceback after the run."""
    for flag, path in (
        ("--plot", tmp_path / "nonexistent-dir" / "x.png"),
        ("--csv", tmp_path / "nonexistent-dir" / "x.csv"),
        ("--csv", tmp_path),
    ):
        r = _run("bench", "-m", tiny, "--frontiers", "32", "--decode-tokens", 1, flag, path)
        assert r.returncode == 2, (flag, r.stderr)
        assert flag in r.stderr and "Traceback" not in r.stderr
        assert "roofline" not in r.stderr  # nothing was measured
