"""Crash safety of the disk KV store (issue 5, item 6).

A child process writes snapshots (and counts hits) in a loop into one directory and is
``kill -9``ed at a random moment, 20 times. After every kill: the directory is within
budget, opening a store removes the dead writer's temp files, no file with a snapshot
name is unreadable, and every snapshot loads, passes its digest and holds exactly the
content the writer derived from its seed.

Run as ``python tests/test_kv_crash.py writer DIR BUDGET SEED`` it is that child.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

IDENT = "ds4-crash-test"
CTX = 8192
REASONS = ("cold", "continued", "evict", "shutdown")


@functools.cache
def _bulk(k: int):
    """KV-sized arrays, generated once per process: the child should spend its time
    writing files, not drawing random numbers, so that kills land mid-write."""
    import mlx.core as mx

    rng = np.random.default_rng(k)
    rows = 512 + 256 * k
    raw = mx.array(rng.standard_normal((rows, 1024)).astype(np.float32)).astype(mx.bfloat16)
    comp = mx.array(rng.standard_normal((rows, 512)).astype(np.float32))
    mx.eval(raw, comp)
    return raw, comp


def snapshot(seed: int):
    """Deterministic (text, tokens, arrays, tool memory) for ``seed``: 3-8 MB."""
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    text = f"<｜begin▁of▁sentence｜>seed={seed};" + "é世" * int(rng.integers(1, 2000))
    tokens = rng.integers(0, 129280, int(rng.integers(1, 4000))).tolist()
    raw, comp = _bulk(seed % 4)
    arrays = {
        "logits": mx.array(rng.standard_normal(4096).astype(np.float32)),
        "cache.0.raw": raw,
        "cache.1.comp": comp,
    }
    tools = {f"toolu_{seed}": f"seed={seed};"}
    return text, tokens, arrays, tools


def seed_of(text: str) -> int:
    return int(text.split("seed=", 1)[1].split(";", 1)[0])


def writer(dir: str, budget: int, seed0: int) -> None:
    from ds4mlx.kv.store import DiskKVStore

    store = DiskKVStore(dir, budget_bytes=budget, model_identity=IDENT, ctx_size=CTX, expert_bits=4)
    for k in range(4):
        _bulk(k)
    print("ready", flush=True)
    for i in range(10**9):
        seed = seed0 * 100_000 + i
        text, tokens, arrays, tools = snapshot(seed)
        store.save(
            text=text, tokens=tokens, arrays=arrays, reason=REASONS[i % 4], tool_memory=tools
        )
        if i % 4 == 3:
            store.lookup_and_load(text + "<｜User｜>more")  # hit counting rewrites the sidecar


def test_kill_9_during_writes(tmp_path):
    from ds4mlx.kv import store as kvs

    d = tmp_path / "kv"
    budget = 32 * 2**20
    rng = random.Random(1234)
    script = Path(__file__).resolve()
    temp_seen = 0
    loaded = 0
    t_end = time.monotonic() + 120
    for round_ in range(20):
        assert time.monotonic() < t_end, "crash test is too slow"
        child = subprocess.Popen(
            [sys.executable, str(script), "writer", str(d), str(budget), str(round_)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.35))
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()  # reaped: its pid is dead for the temp-file cleanup
            child.stdout.close()

        names = os.listdir(d)
        temp_seen += any(n.endswith(".tmp") for n in names)
        # Room is made before each write, so even a kill between rename and eviction
        # leaves the snapshots within budget.
        assert kvs.scan_dir(d).total_bytes <= budget

        store = kvs.DiskKVStore(
            d, budget_bytes=budget, model_identity=IDENT, ctx_size=CTX, expert_bits=4
        )
        assert not [n for n in os.listdir(d) if n.endswith(".tmp")], "temp files survive"
        scan = store.scan()
        assert scan.bad == [], f"unreadable snapshot after kill: {scan.bad}"
        for e in scan.entries:
            got = store.load(e, count_hit=False)
            text, tokens, arrays, tools = snapshot(seed_of(got.text))
            assert got.text == text and got.tokens == tokens and got.tool_memory == tools
            assert got.arrays.keys() == arrays.keys()
            for k, a in arrays.items():
                assert kvs._array_bytes(got.arrays[k]) == kvs._array_bytes(a), k
            loaded += 1
    assert loaded > 0
    # The kill points are random; most rounds should have caught a write in flight.
    assert temp_seen >= 1, "no kill landed during a write; the test proves nothing"
    print(f"kills during a write: {temp_seen}/20, snapshots verified: {loaded}")


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "writer":
    writer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
