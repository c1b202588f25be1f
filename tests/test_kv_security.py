"""Issue 17 (security), the disk tier's part: no checkpoint reads another's snapshots,
files are private, a full disk is survived, a PID-1 restart cleans its temp files.

Real checkpoints (the tiny DS4 network), real engines and files; the full-disk and
PID-1 tests run in namespaces of their own (``unshare -m`` with a small tmpfs,
``unshare --pid --fork``) and are skipped where those are not allowed (not root).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.kv.store import DiskKVStore

REPO = Path(__file__).resolve().parents[1]


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


# --------------------------------------------------------------------------- identity


def _identity(path: Path) -> str:
    from ds4mlx.engine.core import _model_identity

    config = json.loads((path / "config.json").read_text())
    return _model_identity(path, config, "f32")


def _rewrite(path: Path, change, metadata) -> None:
    """Load ``path``'s model.safetensors, apply ``change(tensors)``, save it back with
    ``metadata(tensors, old_metadata)`` (what another tool would do)."""
    f = path / "model.safetensors"
    tensors, meta = mx.load(str(f), return_metadata=True)
    change(tensors)
    mx.eval(list(tensors.values()))  # mx.load is lazy; the file is about to be replaced
    mx.save_safetensors(str(f), tensors, metadata=metadata(tensors, meta))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _bump_middle(tensors, name="embed.weight"):
    """One value in the middle of a large tensor: outside the sampled windows."""
    a = np.array(tensors[name])
    flat = a.reshape(-1)
    flat[flat.size // 2 + 12345] += 1.0
    tensors[name] = mx.array(a)


def _retrain(tensors, name="layers.0.attn.wq_a.weight"):
    """A whole tensor changed, as training changes it."""
    tensors[name] = tensors[name] * 1.001


def test_one_changed_tensor_changes_the_identity(tiny_f32_dir, tmp_path):
    """Same config, layout, file names and sizes; one tensor differs. The identity
    differs: through the weights digest (``make-tiny``/``convert`` write it) when a
    tool rewrites it, through the sampled bytes when it is missing or stale."""

    def variant(name, change, metadata) -> Path:
        d = _copy(tiny_f32_dir, tmp_path / name)
        _rewrite(d, change, metadata)
        return d

    def same(t):
        pass

    def size(d: Path) -> int:
        return (d / "model.safetensors").stat().st_size

    base = _identity(tiny_f32_dir)
    assert _identity(_copy(tiny_f32_dir, tmp_path / "copy")) == base  # content, not path
    # Without a digest (a tool that writes its own metadata): a fine-tuned tensor.
    plain = variant("plain", same, lambda t, m: {"format": "mlx"})
    tuned = variant("tuned", _retrain, lambda t, m: {"format": "mlx"})
    assert size(plain) == size(tuned)
    assert _identity(tuned) != _identity(plain)

    from ds4mlx.model.identity import DIGEST_KEY, file_digest, weights_metadata

    f = tiny_f32_dir / "model.safetensors"
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        written = json.loads(fh.read(n))["__metadata__"][DIGEST_KEY]
    assert written == file_digest(f)  # make-tiny wrote the digest of what it saved
    # With the digest: one value outside every sampled window, re-digested as convert
    # would; and a fine-tuned tensor under a copied, now stale, digest.
    digested = variant("digested", same, lambda t, m: dict(m))
    one = variant("one", _bump_middle, lambda t, m: weights_metadata(t))
    stale = variant("stale", _retrain, lambda t, m: dict(m))
    assert size(digested) == size(one) == size(stale)
    assert len({_identity(d) for d in (digested, one, stale)}) == 3


def test_two_seeds_share_a_directory_without_crossing(tiny_f32_dir, tmp_path):
    """Two checkpoints of the same layout (seeds 0 and 1) on one cache directory:
    neither finds nor overwrites the other's snapshot of the same prompt; each gets its
    own state back."""
    from ds4mlx.engine import Engine
    from ds4mlx.kv.disk import DiskCache
    from ds4mlx.kv.policy import KVCacheSettings
    from ds4mlx.model.tiny import make_tiny

    other = Path(make_tiny(tmp_path / "seed1", seed=1, expert_bits=None, other_bits=None))
    kv = tmp_path / "kv"
    settings = KVCacheSettings(disk_dir=str(kv), min_tokens=16)
    a, b = (Engine.load(d, ctx_size=1024) for d in (tiny_f32_dir, other))
    assert a.identity != b.identity
    cache_a, cache_b = DiskCache(a, settings), DiskCache(b, settings)
    text = "<｜begin▁of▁sentence｜>" + " ".join(f"word{i}" for i in range(60)) + "<｜User｜>hi"
    prompt = text + "<｜Assistant｜></think>"

    def prefill(engine):
        s = engine.new_session()
        s.prefill(engine.tokenizer.encode(text))
        return s

    live_a = prefill(a)
    saved_a = cache_a.save_live(live_a, "cold")
    bytes_a = saved_a.path.read_bytes()
    assert cache_b.lookup(prompt) is None, "checkpoint B found A's snapshot"
    live_b = prefill(b)
    saved_b = cache_b.save_live(live_b, "cold")
    assert saved_b is not None and saved_b.path != saved_a.path
    assert saved_a.path.read_bytes() == bytes_a, "B overwrote A's snapshot"
    for cache, live in ((cache_a, live_a), (cache_b, live_b)):
        got = cache.lookup(prompt)
        assert got is not None and got.tokens == live.tokens
        assert np.array_equal(np.array(got.arrays["logits"]), np.array(live.logits))
    assert {e.model_identity for e in DiskKVStore(
        kv, budget_bytes=1 << 30, model_identity=a.identity, ctx_size=1024, expert_bits=None
    ).scan().entries} == {a.identity, b.identity}  # fmt: skip


def test_snapshots_of_the_old_format_are_dropped(tmp_path):
    """A version-1 snapshot (keyed by its text alone) is removed when a store opens the
    directory; it is never loaded."""
    from test_kv_store import _rewrite as rewrite_snapshot
    from test_kv_store import _tensors_and_meta, make_store, save

    store = make_store(tmp_path)
    e = save(store, "old snapshot text")
    t, m = _tensors_and_meta(e.path)
    rewrite_snapshot(e.path, t, {**m, "version": "1"})
    fresh = make_store(tmp_path)
    assert not e.path.exists()
    assert fresh.lookup("old snapshot text and more") is None


# --------------------------------------------------------------------------- file modes


def test_cache_sessions_and_trace_files_are_private(tmp_path, tiny_f32_dir):
    """Snapshots, the hit index, agent sessions and the trace file are 0600 in 0700
    directories, also where the directory or the trace file existed with wider modes."""
    from test_kv_store import make_store, save

    from ds4mlx.agent.sessions import SessionBook, SessionRecord
    from ds4mlx.server.trace import Tracer

    old = os.umask(0o022)
    try:
        nested = tmp_path / "cache" / "ds4mlx" / "kv"
        store = DiskKVStore(
            nested, budget_bytes=1 << 26, model_identity="m", ctx_size=64, expert_bits=None
        )
        e = save(store, "private prompt")
        store.lookup_and_load("private prompt and more")  # a hit: writes index.json
        assert _mode(nested) == 0o700 and _mode(nested.parent) == 0o700
        assert _mode(e.path) == 0o600 and _mode(nested / "index.json") == 0o600

        wide = tmp_path / "kv"  # an existing directory of an older build
        wide.mkdir(mode=0o755)
        os.chmod(wide, 0o755)
        make_store(tmp_path)
        assert _mode(wide) == 0o700

        sessions = tmp_path / "agent-kv" / "agent-sessions"
        sessions.mkdir(parents=True)
        os.chmod(sessions, 0o755)
        book = SessionBook(sessions)
        book.put(SessionRecord(id=1, workspace=str(tmp_path), title="t", created=0.0))
        assert _mode(sessions) == 0o700 and _mode(sessions / "1.json") == 0o600

        trace = tmp_path / "trace.jsonl"
        Tracer(trace).close()
        assert _mode(trace) == 0o600
        os.chmod(trace, 0o644)
        t = Tracer(trace)
        t.write(1, "prompt", text="secret")
        t.close()
        assert _mode(trace) == 0o600 and "secret" in trace.read_text()
    finally:
        os.umask(old)


# --------------------------------------------------------------------------- namespaces


def _can(*cmd: str) -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", *cmd], capture_output=True).returncode == 0


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}


_ENOSPC_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    import mlx.core as mx, numpy as np
    from ds4mlx.kv.store import DiskKVStore
    from ds4mlx.kv.writer import SnapshotWriter

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    d = sys.argv[1]
    # The budget (64 MiB) is far above what the 2 MiB filesystem holds.
    store = DiskKVStore(d, budget_bytes=64 << 20, model_identity="m", ctx_size=64,
                        expert_bits=None)
    writer = SnapshotWriter(store.write)

    def save(text, kib, seed):
        rng = np.random.default_rng(seed)
        arr = mx.array(rng.integers(0, 255, kib << 10).astype(np.uint8))
        p = store.prepare_save(text=text, tokens=[1, 2, 3], arrays={"x": arr}, reason="cold")
        writer.submit(p)
        writer.flush(60)
        return p.key

    keys = [save(f"snapshot {i}", 560, i) for i in range(3)]
    # A hit makes the middle one the most valuable.
    store.lookup_and_load("snapshot 1 and more")
    before = writer.status()
    # A header a few bytes longer than the others': one eviction still makes the room
    # (asking for the whole file's size evicted a second one).
    fourth = save("snapshot 3, a longer text", 560, 3)
    after_fourth = writer.status()
    present = sorted(e.key for e in store.entries())
    # Larger than the whole filesystem (but within the budget): it cannot fit even with
    # every snapshot gone, so none is evicted and the save fails.
    huge = save("snapshot huge", 2200, 4)
    print(json.dumps({"keys": keys, "fourth": fourth, "huge": huge, "present": present,
                      "before": before, "after_fourth": after_fourth,
                      "end": writer.status(),
                      "end_present": sorted(e.key for e in store.entries())}))
    """
)


@pytest.mark.skipif(not _can("-m", "true"), reason="needs root and unshare -m")
def test_full_disk_evicts_the_lowest_valued_and_retries(tmp_path):
    """On a 2 MiB tmpfs (private mount namespace) under a 64 MiB budget: the fourth
    snapshot hits ENOSPC, the store evicts the lowest-valued one and the retry lands;
    a snapshot larger than the filesystem evicts nothing, fails and is counted as
    failed, apart from the written ones (the writer's status is /health's
    ``kv_writer``)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = tmp_path / "enospc.py"
    script.write_text(_ENOSPC_SCRIPT)
    r = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f'mount -t tmpfs -o size=2m tmpfs "{mnt}" && exec "{sys.executable}" "{script}" '
         f'"{mnt}/kv"'],
        capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    k0, k1, k2 = out["keys"]
    assert "No space left on device" in r.stderr
    # The hit kept snapshot 1; an unused one went; the fourth is on disk.
    assert out["fourth"] in out["present"] and k1 in out["present"]
    assert len({k0, k2} & set(out["present"])) == 1
    assert "disk full: evicted" in r.stderr
    # The first failure is said as what it is: a retry follows (it read "save failed").
    assert "disk full at a save tokens=3" in r.stderr and "save failed" not in r.stderr
    assert "does not fit even without the" in r.stderr and "not saved" in r.stderr
    assert out["before"]["written"] == 3 and out["before"]["failed"] == 0
    assert out["after_fourth"]["written"] == 4 and out["after_fourth"]["failed"] == 0
    assert out["end_present"] == out["present"]
    assert out["end"]["written"] == 4 and out["end"]["failed"] == 1


_READ_ONLY_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    import mlx.core as mx
    from ds4mlx.kv.store import DiskKVStore

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    kw = dict(budget_bytes=64 << 20, model_identity="m", ctx_size=64, expert_bits=None)
    store = DiskKVStore(sys.argv[1], **kw)
    store.save(text="snapshot 0", tokens=[1], arrays={"x": mx.zeros((8,))}, reason="cold")
    print("saved", flush=True)
    """
)


@pytest.mark.skipif(not _can("-m", "true"), reason="needs root and unshare -m")
def test_a_read_only_cache_is_said_at_start(tmp_path):
    """A cache directory on a read-only mount: one warning when the store opens (before,
    only each save's failure said it), its snapshots still read, a save fails cleanly."""
    kv = tmp_path / "kv"
    script = tmp_path / "ro.py"
    script.write_text(_READ_ONLY_SCRIPT)
    cmd = f'"{sys.executable}" "{script}" "{kv}"'
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0 and "not writable" not in r.stderr, r.stderr[-2000:]
    r = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'mount --bind -o ro "{kv}" "{kv}" && exec {cmd}'],
        capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert r.returncode == 0 and "saved" in r.stdout, r.stderr[-3000:]
    assert f"kv cache: {kv} is not writable" in r.stderr, r.stderr[-3000:]
    assert "1 snapshots (1 usable" in r.stderr and "Traceback" not in r.stderr


def test_a_budget_the_disk_cannot_hold_is_said_at_start(tmp_path, caplog):
    """A ``--kv-disk-space-mb`` above what the cache directory's filesystem holds (its
    snapshots plus the free space): one warning naming the flag when the store opens
    (it was accepted silently); a budget that fits: none."""
    st = os.statvfs(tmp_path)
    room = st.f_bavail * st.f_frsize
    with caplog.at_level(logging.WARNING, logger="ds4mlx.kv"):
        DiskKVStore(tmp_path / "a", budget_bytes=room // 4, model_identity="m", ctx_size=64,
                    expert_bits=None)  # fmt: skip
        assert "can hold" not in caplog.text
        DiskKVStore(tmp_path / "b", budget_bytes=4 * room + (1 << 30), model_identity="m",
                    ctx_size=64, expert_bits=None)  # fmt: skip
    (line,) = [r.getMessage() for r in caplog.records if "can hold" in r.getMessage()]
    assert f"is more than {tmp_path / 'b'} can hold" in line and "--kv-disk-space-mb" in line


_KILLED_WRITER = textwrap.dedent(
    """
    import itertools, os, sys
    import mlx.core as mx, numpy as np
    from ds4mlx.kv.store import DiskKVStore

    assert os.getpid() == 1, os.getpid()
    store = DiskKVStore(sys.argv[1], budget_bytes=1 << 34, model_identity="m", ctx_size=64,
                        expert_bits=None)
    big = {"x": mx.array(np.zeros(32 << 20, np.uint8))}
    print("writing", flush=True)
    for i in itertools.count():  # saves until killed; each one passes through a temp file
        e = store.save(text=f"snapshot {i}", tokens=[1], arrays=big, reason="cold")
        store.remove(e.key)
    """
)

_RESTART = textwrap.dedent(
    """
    import os, sys
    from ds4mlx.kv.store import DiskKVStore

    assert os.getpid() == 1, os.getpid()
    DiskKVStore(sys.argv[1], budget_bytes=1 << 34, model_identity="m", ctx_size=64,
                expert_bits=None)
    print(sorted(os.listdir(sys.argv[1])))
    """
)


def _ns_python(script: Path, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(script), *args],
        env=_env(), start_new_session=True, **kw,
    )  # fmt: skip


def _kill_mid_write(script: Path, d: Path) -> list[Path]:
    """Run ``script`` (a store saving in a loop, as PID 1) and SIGKILL it while a temp
    file exists; returns the temp files left."""
    p = _ns_python(script, str(d), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "writing", p.stderr.read()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(n.endswith(".tmp") for n in os.listdir(d)):
                os.killpg(p.pid, signal.SIGSTOP)  # frozen: does the temp still exist?
                left = [x for x in d.iterdir() if x.name.endswith(".tmp")]
                if left:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(30)
                    return left
                os.killpg(p.pid, signal.SIGCONT)
            time.sleep(0.001)
        raise AssertionError("never saw a temp file")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)


@pytest.mark.skipif(
    not _can("--pid", "--fork", "--mount-proc", "true"), reason="needs root and unshare --pid"
)
def test_pid1_restart_removes_the_killed_runs_temp_files(tmp_path):
    """A container restart: the server is PID 1 in both runs. The temp file of the run
    killed mid-write carries pid 1, the new run's own pid; it is removed anyway."""
    d = tmp_path / "kv"
    writer, restart = tmp_path / "writer.py", tmp_path / "restart.py"
    writer.write_text(_KILLED_WRITER)
    restart.write_text(_RESTART)
    left = _kill_mid_write(writer, d)
    assert all(".1." in x.name for x in left), left  # written by pid 1
    r = _ns_python(restart, str(d), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = r.communicate(timeout=120)
    assert r.returncode == 0, err[-3000:]
    assert not [x for x in left if x.exists()], (out, err[-2000:])
