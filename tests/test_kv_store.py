"""Disk KV store (ds4mlx/kv/store.py): real files, real mx arrays (tiny, random)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.fsutil import temp_name
from ds4mlx.kv import store as kvs
from ds4mlx.kv.store import DiskKVStore, KVStoreError, eviction_score, scan_dir, text_key

IDENT = "ds4-test-model"
CTX = 4096


def make_store(tmp_path: Path, budget: int = 50_000_000, **kw) -> DiskKVStore:
    args = {"model_identity": IDENT, "ctx_size": CTX, "expert_bits": 4}
    args.update(kw)
    return DiskKVStore(tmp_path / "kv", budget_bytes=budget, **args)


def arrays(seed: int, n: int = 64) -> dict[str, mx.array]:
    rng = np.random.default_rng(seed)
    out = {
        "logits": mx.array(rng.standard_normal(n).astype(np.float32)),
        "cache.0.kv": mx.array(rng.standard_normal((8, n)).astype(np.float32)).astype(mx.bfloat16),
        "cache.0.comp": mx.array(rng.standard_normal((3, 5)).astype(np.float16)),
        "cache.1.idx": mx.array(rng.integers(-1000, 1000, (7,)).astype(np.int32)),
        "cache.1.empty": mx.zeros((0, 4), mx.float32),
        "cache.1.scalar": mx.array(3.5),
    }
    # A non-contiguous view, as a cache's state may hand out.
    out["cache.2.t"] = mx.array(rng.standard_normal((4, 6)).astype(np.float32)).T
    return out


def save(store: DiskKVStore, text: str, seed: int = 0, n_tokens: int = 5, **kw):
    kw.setdefault("reason", "cold")
    return store.save(
        text=text, tokens=list(range(seed, seed + n_tokens)), arrays=arrays(seed), **kw
    )


def same_arrays(a: dict[str, mx.array], b: dict[str, mx.array]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        # Bit-identical: compare raw bytes, not values (NaN-safe, -0.0-safe).
        if kvs._array_bytes(x) != kvs._array_bytes(y):
            return False
    return True


# --------------------------------------------------------------------------- round trip


def test_round_trip_bit_identical(tmp_path):
    store = make_store(tmp_path)
    text = "<｜begin▁of▁sentence｜>système 日本語 🙂\n" + "x" * 300_000 + "\n\n<｜DSML｜invoke a>"
    tokens = [0, 128821, 129279, 7, 7, 1]
    arrs = arrays(1)
    arrs["nan"] = mx.array([float("nan"), -0.0, float("inf")])
    tools = {"toolu_a": "<｜DSML｜invoke a>", "toolu_gone": "not in the text", "call_x": "日本"}
    meta = {"identity": IDENT, "layers": "3"}
    e = store.save(
        text=text, tokens=tokens, arrays=arrs, reason="evict", meta=meta, tool_memory=tools
    )
    assert e is not None and e.key == text_key(text, IDENT, CTX) and e.tokens == 6
    assert e.path.name == f"{e.key}.safetensors"
    assert e.text_bytes == len(text.encode()) and e.reason == "evict" and e.tool_count == 2

    got = make_store(tmp_path).load(e)  # a fresh store: everything comes from the file
    assert got.text == text
    assert got.tokens == tokens
    assert same_arrays(got.arrays, arrs)
    assert got.meta == meta
    # Only entries whose DSML occurs in the text are persisted.
    assert got.tool_memory == {"toolu_a": "<｜DSML｜invoke a>", "call_x": "日本"}
    assert got.entry.hits == 1 and got.entry.expert_bits == 4 and got.entry.ctx_size == CTX


def test_tool_memory_pairs_and_lookup_by_id(tmp_path):
    store = make_store(tmp_path)
    save(store, "AAA <inv1> BBB", tool_memory=[("t1", "<inv1>"), ("t2", "<inv2>")])
    save(store, "CCC <inv2>", seed=1, tool_memory=[("t2", "<inv2>")])
    found = {k: v for _, tools in make_store(tmp_path).tool_maps() for k, v in tools.items()}
    assert found == {"t1": "<inv1>", "t2": "<inv2>"}


def test_save_rejects_bad_arguments(tmp_path):
    store = make_store(tmp_path)
    with pytest.raises(ValueError):
        store.save(text="", tokens=[1], arrays={}, reason="cold")
    with pytest.raises(ValueError):
        store.save(text="a", tokens=[], arrays={}, reason="cold")
    with pytest.raises(ValueError):
        store.save(text="a", tokens=[1], arrays={}, reason="whim")
    with pytest.raises(ValueError):
        store.save(text="a", tokens=[2**31], arrays={}, reason="cold")
    with pytest.raises(ValueError):
        store.save(text="a", tokens=[1], arrays={"x": np.zeros(2)}, reason="cold")
    ro = make_store(tmp_path, read_only=True)
    with pytest.raises(ValueError):
        ro.save(text="a", tokens=[1], arrays={}, reason="cold")


def test_resave_same_text(tmp_path):
    store = make_store(tmp_path)
    e1 = save(store, "same text", tool_memory={"a": "same"})
    store.load(e1)  # one hit
    # Same text, tokens and tools: kept as is (hits survive, no rewrite).
    e2 = save(store, "same text", tool_memory={"a": "same"})
    assert e2.created == e1.created and e2.hits == 1
    # A new tool id for the same text: rewritten, and it carries the new map.
    e3 = save(store, "same text", tool_memory={"a": "same", "b": "text"})
    assert e3.created != e1.created
    assert store.load(e3).tool_memory == {"a": "same", "b": "text"}
    assert len(store.entries()) == 1


# --------------------------------------------------------------------------- lookup


def test_longest_prefix_lookup(tmp_path):
    store = make_store(tmp_path)
    base = "<｜begin▁of▁sentence｜>system prompt"
    e_short = save(store, base, seed=1)
    e_long = save(store, base + "<｜User｜>hello", seed=2)
    save(store, base + "<｜User｜>other", seed=3)
    save(store, "unrelated " + base, seed=4)

    assert store.lookup(base + "<｜User｜>hello<｜Assistant｜>").key == e_long.key
    assert store.lookup(base + "<｜User｜>hello").key == e_long.key  # equal length counts
    assert store.lookup(base + "<｜User｜>hel").key == e_short.key
    assert store.lookup(base[:-1]) is None
    assert store.lookup("") is None
    got = store.lookup_and_load(base + "<｜User｜>hello world")
    assert got.entry.key == e_long.key and got.tokens == list(range(2, 7))
    assert got.suffix(base + "<｜User｜>hello world") == " world"
    with pytest.raises(ValueError):
        got.suffix("something else")


def test_lookup_is_by_utf8_bytes(tmp_path):
    store = make_store(tmp_path)
    save(store, "naïve é", seed=1)  # é = c3 a9
    e_jp = save(store, "日本", seed=2)  # 2 chars, 6 bytes
    # Shares the lead byte c3 with é but is a different character: no match.
    assert store.lookup("naïve è and more") is None
    assert store.lookup("naïve é and more") is not None
    # Byte lengths, not character counts, decide which prefix is hashed.
    assert store.lookup("日本語").key == e_jp.key
    assert store.lookup("日") is None
    assert store.lookup("日本"[:1] + "x" * 10) is None
    # Lone surrogates (legal in JSON strings) survive the round trip.
    e_sur = save(store, "bad \ud800 surrogate", seed=3)
    got = store.lookup_and_load("bad \ud800 surrogate!")
    assert got.entry.key == e_sur.key and got.text == "bad \ud800 surrogate"
    assert got.suffix("bad \ud800 surrogate!") == "!"


def test_lookup_filters_identity_ctx_and_quant(tmp_path):
    prompt = "shared prefix and then the rest"
    save(make_store(tmp_path, model_identity="other-model"), "shared prefix and", seed=1)
    save(make_store(tmp_path, ctx_size=CTX * 2), "shared prefix", seed=2)
    save(make_store(tmp_path, expert_bits=2), "shared", seed=3)

    mine = make_store(tmp_path)
    assert mine.lookup(prompt).text_bytes == len("shared")  # cross-quant accepted
    strict = make_store(tmp_path, reject_different_quant=True)
    assert strict.lookup(prompt) is None
    assert make_store(tmp_path, model_identity="other-model").lookup(prompt).text_bytes == len(
        "shared prefix and"
    )
    assert make_store(tmp_path, ctx_size=CTX * 2).lookup(prompt).text_bytes == len("shared prefix")
    # Loading a foreign entry directly is refused too.
    foreign = [e for e in mine.scan().entries if e.model_identity == "other-model"][0]
    with pytest.raises(KVStoreError):
        mine.load(foreign)
    # Foreign snapshots are not bad files; they are just not ours.
    assert mine.scan().bad == [] and len(mine.scan().entries) == 3


def test_vanished_file_is_a_miss(tmp_path):
    store = make_store(tmp_path)
    e_short = save(store, "abc", seed=1)
    e_long = save(store, "abcdef", seed=2)
    assert store.lookup("abcdefg").key == e_long.key
    os.unlink(e_long.path)  # e.g. `ds4mlx kv rm` from another process
    with pytest.raises(KVStoreError):
        store.load(e_long)
    assert store.lookup_and_load("abcdefg").entry.key == e_short.key


def test_hits_persist_in_sidecar(tmp_path):
    store = make_store(tmp_path)
    e = save(store, "hello")
    for _ in range(3):
        store.lookup_and_load("hello there")
    again = make_store(tmp_path)
    (got,) = again.entries()
    assert got.hits == 3 and got.last_used > e.created
    assert scan_dir(tmp_path / "kv").entries[0].hits == 3
    # A lost or corrupt sidecar only resets statistics.
    (tmp_path / "kv" / "index.json").write_text("{not json")
    assert make_store(tmp_path).entries()[0].hits == 0
    # A sidecar record for an earlier file of the same key does not apply.
    idx = {"version": 1, "entries": {e.key: {"created": 1.0, "hits": 9, "last_used": 2.0}}}
    (tmp_path / "kv" / "index.json").write_text(json.dumps(idx))
    assert make_store(tmp_path).entries()[0].hits == 0


# --------------------------------------------------------------------------- budget


def test_budget_never_exceeded_and_new_file_kept(tmp_path, caplog):
    one = save(make_store(tmp_path / "probe"), "probe").size
    budget = int(one * 4.5)
    store = make_store(tmp_path, budget=budget)
    rng = np.random.default_rng(0)
    for i in range(30):
        text = f"conversation {i} " + "z" * int(rng.integers(0, 3000))
        e = save(store, text, seed=i, reason="continued")
        assert e is not None and e.path.exists(), "the file just written is never evicted"
        assert store.scan().total_bytes <= budget
        if i % 3 == 0:
            store.lookup_and_load(text + " more")
    assert "size estimate" not in caplog.text  # the pre-write bound held every time
    # Room is made before writing (with a size bound, so a crash after the rename
    # still leaves the directory within budget): at least two of these files fit.
    assert 2 <= len(store.entries()) <= 4


def test_concurrent_scans_see_only_whole_files(tmp_path):
    """`kv ls` from another process while the server saves and evicts: every listed
    file is readable, none is reported bad, nothing raises."""
    one = save(make_store(tmp_path / "probe"), "probe").size
    store = make_store(tmp_path, budget=one * 3)
    stop = threading.Event()
    problems: list[str] = []
    scans = [0]

    def reader():
        while not stop.is_set():
            try:
                res = scan_dir(store.dir)
                problems.extend(b.reason for b in res.bad)
                scans[0] += 1
            except Exception as e:  # noqa: BLE001 - any exception is the failure
                problems.append(repr(e))

    th = threading.Thread(target=reader)
    th.start()
    try:
        for i in range(40):
            save(store, f"snapshot {i}", seed=i)
    finally:
        stop.set()
        th.join()
    assert problems == [] and scans[0] > 0


def test_oversized_snapshot_is_not_written(tmp_path, caplog):
    store = make_store(tmp_path, budget=5_000)
    keep = store.save(text="small", tokens=[1], arrays={}, reason="cold")
    big = {"x": mx.zeros((10_000,), mx.float32)}
    with caplog.at_level(logging.WARNING, logger="ds4mlx.kv"):
        assert store.save(text="big", tokens=[1], arrays=big, reason="cold") is None
    assert "exceed the budget" in caplog.text
    assert [e.key for e in store.entries()] == [keep.key]  # nothing evicted for it


def test_failed_write_leaves_nothing(tmp_path, monkeypatch, caplog):
    store = make_store(tmp_path)
    keep = save(store, "kept", seed=1)

    def broken(f, tensors, metadata):
        f.write(b"partial bytes")
        raise RuntimeError("[write] disk full")

    monkeypatch.setattr(kvs.mx, "save_safetensors", broken)
    assert save(store, "lost", seed=2) is None
    assert "save failed" in caplog.text
    assert sorted(os.listdir(store.dir)) == [keep.path.name]


def test_eviction_score_formula():
    now = 1_000_000.0
    base = dict(key="k", path=Path("k"), text_bytes=1, model_identity="m", expert_bits=None)
    base.update(ctx_size=1, created=0.0, reason="cold")
    fresh = kvs.Entry(**base, tokens=2048, hits=0, last_used=now, size=4096)
    stale = kvs.Entry(
        **base, tokens=1024, hits=10, last_used=now - 14 * kvs.HIT_HALF_LIFE_S, size=4096
    )
    hot = kvs.Entry(**base, tokens=1024, hits=10, last_used=now - kvs.HIT_HALF_LIFE_S, size=4096)
    assert eviction_score(fresh, now) == 2048 / 4096
    assert eviction_score(stale, now) == 1024 / 4096  # 10 * 2**-14 < 0.01 -> 0
    assert eviction_score(hot, now) == pytest.approx((1 + 5) * 1024 / 4096)
    assert eviction_score(stale, now) < eviction_score(fresh, now) < eviction_score(hot, now)


def test_eviction_order_follows_score(tmp_path):
    now = 1_900_000_000.0
    clock = [now]
    store = make_store(tmp_path, budget=10**9, clock=lambda: clock[0])
    h = kvs.HIT_HALF_LIFE_S
    plan = {  # text -> (created ago, hits, last used ago) in seconds
        "a-stale-popular": (50 * h, 50, 40 * h),  # 50 * 2**-40 hits: worth nothing now
        "b-fresh-unused": (10, 0, 10),
        "c-recent-hits": (2 * h, 3, 60),
        "d-half-decayed": (3 * h, 2, h),  # 2 hits at half weight = 1
        "e-old-unused": (20 * h, 0, 20 * h),
    }
    entries = {}
    for i, (text, (age, _, _)) in enumerate(plan.items()):
        clock[0] = now - age
        entries[text] = save(store, text.ljust(20), seed=i)
    clock[0] = now
    index = {
        e.key: {"created": e.created, "hits": plan[t][1], "last_used": now - plan[t][2]}
        for t, e in entries.items()
    }
    (store.dir / "index.json").write_text(json.dumps({"version": 1, "entries": index}))
    assert len({e.size for e in entries.values()}) == 1  # same size and tokens: hits decide
    scored = sorted(store.entries(), key=lambda e: (eviction_score(e, now), e.last_used))
    expected = [e.head.strip() for e in scored]
    # Zero-value entries go least recently used first, then by decayed hits.
    assert expected == [
        "a-stale-popular",
        "e-old-unused",
        "b-fresh-unused",
        "d-half-decayed",
        "c-recent-hits",
    ]
    size = entries["a-stale-popular"].size
    evicted = []
    for keep in range(4, -1, -1):
        store.budget_bytes = keep * size
        evicted += [e.head.strip() for e in store.evict()]
        assert len(store.entries()) == keep
    assert evicted == expected


# --------------------------------------------------------------------------- bad files


def _tensors_and_meta(path: Path):
    t, m = mx.load(str(path), format="safetensors", return_metadata=True)
    mx.eval(list(t.values()))  # mx.load is lazy; we are about to overwrite the file
    return t, m


def _rewrite(path: Path, tensors, meta):
    with open(path, "wb") as f:
        mx.save_safetensors(f, tensors, meta)


def test_corrupt_and_foreign_files_are_skipped_and_reported(tmp_path, caplog):
    store = make_store(tmp_path)
    good = save(store, "prefix", seed=0)
    prompt = "prefix and then a longer prompt"
    d = store.dir

    def victim(i: int) -> Path:
        e = save(store, "prefix and then"[: 7 + i], seed=i)
        return e.path

    # 1. truncated
    p = victim(1)
    p.write_bytes(p.read_bytes()[:-100])
    # 2. random bytes
    p = victim(2)
    p.write_bytes(np.random.default_rng(0).bytes(p.stat().st_size))
    # 3. a foreign safetensors file under a snapshot name
    p = victim(3)
    _rewrite(p, {"model.embed.weight": mx.zeros((4, 4))}, {"format": "pt"})
    # 4. a future format version
    p = victim(4)
    t, m = _tensors_and_meta(p)
    _rewrite(p, t, {**m, "version": "3"})
    # 5. text that does not hash to the name
    p = victim(5)
    t, m = _tensors_and_meta(p)
    t[kvs.TEXT_KEY] = mx.array(np.frombuffer(b"prefix_", np.uint8))
    _rewrite(p, t, m)
    # 6. flipped bits in the KV data (only the digest can tell)
    p = victim(6)
    t, m = _tensors_and_meta(p)
    t["session.logits"] = t["session.logits"] + 1
    _rewrite(p, t, m)
    # 7. empty file
    (d / ("f" * 40 + ".safetensors")).write_bytes(b"")

    with caplog.at_level(logging.WARNING, logger="ds4mlx.kv"):
        fresh = make_store(tmp_path)
        scan = fresh.scan()
        bad_names = {b.path.name for b in scan.bad}
        assert len(bad_names) == 6  # 1-5 and 7 are caught by the header scan
        assert {e.key for e in scan.entries} == {good.key, victim_key(6, store)}
        # 6 looks fine until loaded: the digest catches it and it is never returned.
        got = fresh.lookup_and_load(prompt)
        assert got.entry.key == good.key and got.text == "prefix"
        assert len(fresh.scan().bad) == 7
    assert "digest mismatch" in caplog.text
    assert "skipping bad file" in caplog.text
    # The header-level checks are what `kv ls` reports without reading tensors.
    reasons = " | ".join(b.reason for b in scan_dir(d).bad)
    for part in ("unreadable safetensors", "not a ds4mlx KV snapshot", "format version 3"):
        assert part in reasons
    with pytest.raises(KVStoreError):
        kvs.load_file(fresh.dir / f"{victim_key(6, store)}.safetensors")


def victim_key(i: int, store: DiskKVStore) -> str:
    return text_key("prefix and then"[: 7 + i], IDENT, CTX)


def test_bad_files_count_toward_budget_and_go_first(tmp_path):
    store = make_store(tmp_path)
    e = save(store, "good", seed=0)
    junk = store.dir / ("0" * 40 + ".safetensors")
    junk.write_bytes(b"\0" * e.size)
    store.budget_bytes = int(e.size * 2.5)
    save(store, "good two", seed=1)
    assert not junk.exists()
    assert {x.head for x in store.entries()} == {"good", "good two"}
    assert store.scan().total_bytes <= store.budget_bytes


def test_stale_temp_files_removed_at_open(tmp_path):
    d = tmp_path / "kv"
    d.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(dead.stdout)
    stale = d / f".{'a' * 40}.{dead_pid}.0123abcd.tmp"
    stale_idx = d / f".index.{dead_pid}.99.tmp"
    live = d / temp_name("b" * 40)  # a writer that is still running: this process
    # An older build's name (no start tag) of another live process is kept too.
    old_live = d / f".{'c' * 40}.{os.getppid()}.0123abcd.tmp"
    other = d / "notes.txt"
    for p in (stale, stale_idx, live, old_live, other):
        p.write_bytes(b"partial")
    make_store(tmp_path, read_only=True)
    assert stale.exists()  # inspection never modifies the directory
    make_store(tmp_path)
    assert not stale.exists() and not stale_idx.exists()
    assert live.exists() and old_live.exists() and other.exists()


def test_read_only_store_does_not_count_hits(tmp_path):
    save(make_store(tmp_path), "hello")
    ro = make_store(tmp_path, read_only=True)
    assert ro.lookup_and_load("hello!").text == "hello"
    assert not (tmp_path / "kv" / "index.json").exists()


# --------------------------------------------------------------------------- CLI


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    from ds4mlx.cli import main

    rc = main(["kv", *argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_cli_rm_removes_a_keys_rank_parts_too(tmp_path, capsys):
    """A split model's snapshot is one file per rank under one key (``ds4mlx.kv.parts``):
    ``kv rm DIR KEY`` removes the key's rank parts with its file (it left them), finds a
    key a rank > 0's directory holds only as a part (it said ``no snapshot matching``),
    and ``--all`` counts the parts it removed (it said ``removed 0 snapshots``)."""
    store = make_store(tmp_path)
    entry = save(store, "split text", seed=0)
    d = store.dir
    part = d / f"{entry.key}.rank1.safetensors"
    part.write_bytes(b"part")
    rc, out = run_cli(capsys, "rm", str(d), entry.key[:10])
    assert rc == 0 and list(d.glob("*.safetensors")) == [], out
    assert f"removed {part.name}" in out
    follower = tmp_path / "rank1"
    follower.mkdir()
    for k in ("ab" * 20, "cd" * 20):
        (follower / f"{k}.rank1.safetensors").write_bytes(b"part")
    rc, out = run_cli(capsys, "rm", str(follower), "abab")
    assert rc == 0 and [p.name for p in follower.iterdir()] == ["cd" * 20 + ".rank1.safetensors"]
    rc, out = run_cli(capsys, "rm", str(follower), "--all")
    assert rc == 0 and "removed 0 snapshots and 1 rank parts" in out, out


def test_cli_show_writes_no_control_character_raw(tmp_path, capsys, monkeypatch):
    """A snapshot's text comes from any client of the server: ``kv show`` (and ``kv ls``
    on a terminal) writes its control characters escaped, never raw."""
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich writes as to a terminal
    hostile = "title\x1b]0;PWNED\x07 clear\x1b[2J red\x1b[31mRED\u202e"
    e = save(make_store(tmp_path), hostile, seed=3)
    for argv in (("show", str(e.path.parent), e.key[:8]), ("ls", str(e.path.parent))):
        rc, out = run_cli(capsys, *argv)
        assert rc == 0
        assert "\x1b]" not in out and "\x07" not in out and "\u202e" not in out, argv
        assert "\x1b[2J" not in out and "\x1b[31mRED" not in out, argv
    assert (
        "title\\x1b]0;PWNED\\x07 clear\\x1b[2J"
        in run_cli(capsys, "show", str(e.path.parent), e.key[:8])[1]
    )


def test_cli_ls_show_rm(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    store = make_store(tmp_path)
    e1 = save(store, "<｜begin▁of▁sentence｜>first line\nsecond", seed=1, n_tokens=600)
    e2 = save(store, "another snapshot", seed=2, reason="shutdown", tool_memory={"t": "snap"})
    store.lookup_and_load("another snapshot!")
    (store.dir / ("c" * 40 + ".safetensors")).write_bytes(b"junk")
    d = str(store.dir)

    rc, out = run_cli(capsys, "ls", d)
    assert rc == 0
    assert e1.key[:12] in out and e2.key[:12] in out and "c" * 12 in out
    assert "first line" in out and "second" not in out
    assert "600" in out and "shutdown" in out and "BAD" in out
    assert "2 snapshots, 1 bad" in out
    # Without a directory: the server's default one ($XDG_CACHE_HOME/ds4mlx/kv).
    (tmp_path / "xdg" / "ds4mlx").mkdir(parents=True)
    (tmp_path / "xdg" / "ds4mlx" / "kv").symlink_to(store.dir)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert run_cli(capsys, "ls")[1].count(e1.key[:12]) == 1

    rc, out = run_cli(capsys, "show", d, e2.key[:8])
    assert rc == 0
    for part in (e2.key, "shutdown", IDENT, "another snapshot", "1 ids", "hits"):
        assert part in out
    rc, out = run_cli(capsys, "show", d, "c" * 10)
    assert rc == 1 and "BAD" in out
    rc, out = run_cli(capsys, "show", d, "")  # ambiguous
    assert rc == 1

    rc, out = run_cli(capsys, "rm", d, e1.key[:10])
    assert rc == 0 and not e1.path.exists() and e2.path.exists()
    rc, out = run_cli(capsys, "rm", d)
    assert rc == 2
    rc, out = run_cli(capsys, "rm", d, "--all")
    assert rc == 0 and not any(p.name.endswith(".safetensors") for p in store.dir.iterdir())
    assert not (store.dir / "index.json").exists()
    # A missing directory is the same usage error for every subcommand (rm --all used
    # to print "removed 0" and exit 0 while ls exited 2).
    missing = tmp_path / "no-such-dir"
    for argv in (
        ("ls", missing),
        ("rm", missing, "--all"),
        ("rm", missing, "ab"),
        ("show", missing, "ab"),
    ):
        rc, _ = run_cli(capsys, *map(str, argv))
        assert rc == 2, argv
    assert not missing.exists()


def test_cli_ls_verify_flags_corrupt_data(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    store = make_store(tmp_path)
    e = save(store, "to be corrupted", seed=3)
    t, m = _tensors_and_meta(e.path)
    t["session.cache.0.kv"] = t["session.cache.0.kv"] * 2
    _rewrite(e.path, t, m)
    rc, out = run_cli(capsys, "ls", str(store.dir))
    assert "BAD" not in out
    rc, out = run_cli(capsys, "ls", "--verify", str(store.dir))
    assert "BAD" in out and "digest" in out


# --------------------------------------------------------------------------- engine


def test_real_session_state_round_trip(tmp_path, tiny_checkpoint):
    """A real Session snapshot (tiny DS4 network) through the store restores a session
    that continues exactly like the original."""
    from ds4mlx.engine import Engine, SessionState

    eng = Engine.load(tiny_checkpoint(seed=0), ctx_size=1024)
    store = DiskKVStore(
        tmp_path / "kv",
        budget_bytes=2**30,
        model_identity=eng.identity,
        ctx_size=eng.ctx_size,
        expert_bits=4,
    )
    text = "<｜begin▁of▁sentence｜>You are terse. 你好 🤖<｜User｜>hi<｜Assistant｜>"
    live = eng.new_session()
    live.prefill(eng.tokenizer.encode(text))
    snap = live.snapshot()
    saved = store.save(
        text=eng.tokenizer.decode(snap.tokens),
        tokens=snap.tokens,
        arrays=snap.arrays,
        meta=snap.meta,
        reason="cold",
    )
    assert saved is not None

    def greedy(session, n):
        out = []
        for _ in range(n):
            out.append(int(mx.argmax(session.logits).item()))
            session.decode(out[-1])
        return out

    ref = greedy(live, 6)
    got = store.lookup_and_load(text + "<think>")
    assert got is not None and got.suffix(text + "<think>") == "<think>"
    restored = eng.new_session()
    restored.restore(SessionState(tokens=got.tokens, arrays=got.arrays, meta=got.meta))
    assert greedy(restored, 6) == ref


def test_fallback_is_bounded_by_candidates_or_milliseconds(tmp_path, caplog):
    """Issue 19: a lookup falls back from rejected candidates to shorter ones, at most
    ``limit`` candidates or ``budget_ms`` of checks (the first is always checked); giving
    up logs the bounds, a hit reports how many were tried and the time spent."""
    store = make_store(tmp_path)
    for i, text in enumerate(("ab", "abc", "abcd", "abcde")):
        save(store, text, seed=i)
    seen: list[str] = []

    def only_shortest(entry, text, tokens):
        seen.append(text)
        return None if text == "ab" else "rejected by the test"

    got = store.lookup_and_load("abcdef", accept=only_shortest)  # no bound: reaches "ab"
    assert (got.text, got.tried, seen) == ("ab", 4, ["abcde", "abcd", "abc", "ab"])
    assert got.check_ms >= 0
    seen.clear()
    with caplog.at_level(logging.INFO, logger="ds4mlx.kv"):
        assert store.lookup_and_load("abcdef", accept=only_shortest, limit=2) is None
    assert seen == ["abcde", "abcd"] and "bound: 2 candidates" in caplog.text
    seen.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds4mlx.kv"):
        got = store.lookup_and_load("abcdef", accept=only_shortest, limit=8, budget_ms=0)
    assert got is None and seen == ["abcde"]  # the time bound spent after one check
    assert "bound: 8 candidates or 0 ms" in caplog.text, caplog.text


# --------------------------------------------------------------------------- hostile dirs


def test_a_fifo_or_a_symlink_loop_under_a_snapshot_name_is_a_bad_file(tmp_path):
    """A FIFO would block the reader for ever (a request and /health hung) and a
    symlink loop raised ELOOP out of every scan (every lookup and save failed)."""
    store = make_store(tmp_path)
    good = save(store, "prefix", seed=0)
    fifo = store.dir / ("1" * 40 + ".safetensors")
    os.mkfifo(fifo)
    loop = store.dir / ("2" * 40 + ".safetensors")
    loop.symlink_to(loop.name)
    fresh = make_store(tmp_path)  # opening scans the directory
    reasons = {b.path.name: b.reason for b in fresh.scan().bad}
    assert reasons == {fifo.name: "not a regular file", loop.name: reasons[loop.name]}
    assert "cannot stat it" in reasons[loop.name]
    assert fresh.lookup_and_load("prefix and more").entry.key == good.key
    assert save(fresh, "prefix and", seed=1) is not None
    assert {b.path.name for b in scan_dir(fresh.dir).bad} == {fifo.name, loop.name}


@pytest.mark.parametrize(
    "index",
    [
        '{"version": 1, "entries": {"K": {"created": 1, "hits": 1e400, "last_used": 1}}}',
        "[" * 100_000 + "]" * 100_000,
    ],
    ids=["infinite-hits", "deep-nesting"],
)
def test_a_damaged_hit_index_loses_only_statistics_and_is_rewritten(tmp_path, caplog, index):
    store = make_store(tmp_path)
    e = save(store, "prefix", seed=0)
    (store.dir / kvs.INDEX_NAME).write_text(index.replace("K", e.key))
    with caplog.at_level(logging.WARNING, logger="ds4mlx.kv"):
        fresh = make_store(tmp_path)
        assert fresh.lookup_and_load("prefix and more").entry.key == e.key
        assert save(fresh, "other", seed=1) is not None
    assert "ignoring unreadable hit index" in caplog.text
    data = json.loads((store.dir / kvs.INDEX_NAME).read_text())  # healed by the hit
    assert data["entries"][e.key]["hits"] == 1


def test_a_snapshot_that_failed_to_load_is_replaced_by_the_next_save(tmp_path):
    store = make_store(tmp_path)
    e = save(store, "prefix", seed=0)
    t, m = _tensors_and_meta(e.path)
    t["session.logits"] = t["session.logits"] + 1  # the digest no longer matches
    _rewrite(e.path, t, m)
    assert store.lookup_and_load("prefix and more") is None
    again = save(store, "prefix", seed=0)  # was "already stored" for ever
    assert again is not None
    assert store.lookup_and_load("prefix and more").entry.key == e.key


def test_a_cache_dir_removed_while_serving_is_made_again(tmp_path):
    store = make_store(tmp_path)
    save(store, "prefix", seed=0)
    import shutil

    shutil.rmtree(store.dir)
    assert save(store, "other", seed=1) is not None
    assert store.lookup_and_load("other text") is not None


def test_clearing_leaves_a_foreign_index_json(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "index.json").write_text('{"pages": [1, 2]}')
    (proj / "README").write_text("mine")
    assert kvs.clear_dir(proj) == (0, 0)
    assert sorted(p.name for p in proj.iterdir()) == ["README", "index.json"]
    (proj / "index.json").unlink()
    (proj / "index.json").mkdir()  # not a file: left alone, no crash
    assert kvs.clear_dir(proj) == (0, 0) and (proj / "index.json").is_dir()
    store = make_store(tmp_path)
    save(store, "prefix", seed=0)
    store.lookup_and_load("prefix and more")  # a hit: the index exists
    assert (store.dir / kvs.INDEX_NAME).exists()
    assert kvs.clear_dir(store.dir) == (1, 0) and list(store.dir.iterdir()) == []


def test_only_a_directory_of_the_caches_own_files_is_narrowed(tmp_path):
    from ds4mlx.fsutil import private_dir

    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "notes.txt").write_text("a user's file")
    shared.chmod(0o1777)  # as /tmp
    DiskKVStore(shared, budget_bytes=50_000_000, model_identity=IDENT, ctx_size=CTX, expert_bits=4)
    assert shared.stat().st_mode & 0o7777 == 0o1777
    own = tmp_path / "own"
    own.mkdir()
    (own / kvs.INDEX_NAME).write_text("{}")
    (own / ".DS_Store").write_bytes(b"")  # Finder's, in any folder a Mac user opened
    own.chmod(0o755)  # an older build's cache directory
    DiskKVStore(own, budget_bytes=50_000_000, model_identity=IDENT, ctx_size=CTX, expert_bits=4)
    assert own.stat().st_mode & 0o777 == 0o700
    with pytest.raises(OSError, match="empty directory name"):
        private_dir("")


def test_many_bad_files_are_logged_in_a_bounded_number_of_lines(tmp_path, caplog):
    d = tmp_path / "kv"
    d.mkdir()
    for i in range(kvs.MAX_BAD_REPORTS + 30):
        (d / f"{i:040x}.safetensors").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="ds4mlx.kv"):
        store = make_store(tmp_path)
        assert len(store.scan().bad) == kvs.MAX_BAD_REPORTS + 30
    lines = [r.getMessage() for r in caplog.records if "bad file" in r.getMessage()]
    assert len(lines) == kvs.MAX_BAD_REPORTS + 1
    assert "skipping 30 more bad files" in lines[-1]


def test_a_disk_hit_waits_on_no_fsync_and_a_save_still_syncs(tmp_path, monkeypatch):
    """The hit index is statistics: rewritten on every hit under the store lock, it is
    not fsynced (with a slow disk, each hit waited on two fsyncs: a lookup took 88 s
    with fsync delayed 15 s). A snapshot still is, file and directory."""
    store = make_store(tmp_path)
    save(store, "prefix", seed=0)
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd) or real(fd))
    assert store.lookup_and_load("prefix and more") is not None
    assert calls == []
    assert json.loads((store.dir / kvs.INDEX_NAME).read_text())["entries"]
    assert save(store, "other", seed=1) is not None
    assert len(calls) >= 2  # the snapshot file, then the directory's rename


def test_the_opening_line_names_this_models_snapshots_of_another_ctx(tmp_path, caplog):
    """A restart with another ``--ctx`` leaves the model's snapshots unusable: the line
    the store opens with names that context (it said only "of other models or
    contexts", and every request after the restart was cold without a word why)."""
    import logging

    make_store(tmp_path, ctx_size=8192).save(
        text="hello", tokens=[1, 2], arrays=arrays(1), reason="cold"
    )
    make_store(tmp_path, model_identity="another").save(
        text="hi", tokens=[1], arrays=arrays(2), reason="cold"
    )
    with caplog.at_level(logging.INFO, logger="ds4mlx.kv"):
        make_store(tmp_path, ctx_size=16384)
    (line,) = [r.getMessage() for r in caplog.records if "snapshots (" in r.getMessage()]
    assert "2 snapshots (0 usable; 2 of other models or contexts: this model at ctx 8192," in line
