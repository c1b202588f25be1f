"""Must hold 3: loading ds4mlx's own layout makes no copies; converting streams.

A ≥ 1 GB checkpoint in the own layout (``memory_probe.make``) is loaded in a fresh
process: after ``mx.eval(model.parameters())`` and one forward, the resident-set growth
over the baseline (runtime and tokenizer already loaded) is at most 1.05 × the
safetensors bytes. Converting it with 256 MB shards (experts re-quantized 4 → 2 bits)
peaks at most 2 × shard + 10 % above its baseline. Each probe is a subprocess so the
figures are its own; together they take ~30 s on a 2-core box.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm"),
    pytest.mark.timeout(300),
]
PROBE = Path(__file__).with_name("memory_probe.py")
SHARD = 256_000_000


def _probe(*args) -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    r = subprocess.run(
        [sys.executable, str(PROBE), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("big") / "own"
    made = _probe("make", d)
    assert made["bytes"] >= 1_000_000_000
    return d


def test_loading_own_layout_makes_no_copies(big):
    r = _probe("load", big)
    ratio = (r["after"] - r["baseline"]) / r["safetensors_bytes"]
    print(f"RSS growth / safetensors bytes = {ratio:.4f} ({r})")
    assert ratio <= 1.05, r


def test_conversion_memory_is_bounded_by_the_shard_size(big, tmp_path):
    r = _probe("convert", big, tmp_path / "q2", SHARD)
    growth = r["peak"] - r["baseline"]
    print(f"conversion peak RSS growth {growth / 1e6:.0f} MB for {SHARD / 1e6:.0f} MB shards ({r})")
    assert r["shards"] >= 3
    assert r["peak"] <= r["baseline"] + 2 * SHARD * 1.10, r
