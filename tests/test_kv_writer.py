"""Issue 12: snapshot saves off the inference thread (ds4mlx/kv/writer.py) and
snapshot aliases (a thinking turn's visible keys) in the store.

The writer is tested with a gated fake ``write`` (its queue policy: bounded in bytes,
the oldest *pending* save dropped, FIFO, flush/close drain) and with the real store: the
snapshot is serialized on this thread (``prepare_save``, the only MLX step) and written
by the writer thread, which makes no MLX call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
from test_kv_store import CTX, IDENT, arrays, make_store, same_arrays

from ds4mlx.kv.store import load_file, scan_dir
from ds4mlx.kv.writer import SnapshotWriter


@dataclass
class Item:
    name: str
    nbytes: int
    text_bytes: bytes = b""

    def prefix_of(self, prompt: bytes) -> bool:
        return prompt.startswith(self.text_bytes)


def gated():
    """A ``write`` that blocks until released; records what it wrote, in order."""
    gate, started, done = threading.Event(), threading.Event(), []

    def write(item):
        started.set()
        gate.wait(10)
        done.append(item.name)
        return item

    return write, gate, started, done


def test_queue_is_bounded_in_bytes_and_drops_the_oldest_pending():
    write, gate, started, done = gated()
    w = SnapshotWriter(write, max_bytes=100)
    w.submit(Item("busy", 80))  # being written: never dropped
    assert started.wait(60)
    for name in ("a", "b", "c"):
        w.submit(Item(name, 40))
    # a+b+c = 120 > 100: the oldest pending (a) went; the one in flight stays.
    assert w.dropped == 1 and w.pending_bytes == 80
    st = w.status()  # what /health shows
    assert st == {
        "pending": 2, "pending_bytes": 80, "writing": True, "written": 0, "failed": 0, "dropped": 1
    }  # fmt: skip
    w.submit(Item("huge", 500))  # alone over the bound: kept, everything older dropped
    assert w.dropped == 3 and w.pending_bytes == 500
    gate.set()
    assert w.flush(10)
    assert done == ["busy", "huge"]
    assert w.status() == {
        "pending": 0, "pending_bytes": 0, "writing": False, "written": 2, "failed": 0,
        "dropped": 3,
    }  # fmt: skip
    assert w.close(10)
    with pytest.raises(RuntimeError):
        w.submit(Item("late", 1))


def test_close_writes_everything_queued_fifo():
    write, gate, started, done = gated()
    w = SnapshotWriter(write, max_bytes=10**9)
    for i in range(5):
        w.submit(Item(str(i), 10))
    gate.set()
    assert w.close(10)
    assert done == ["0", "1", "2", "3", "4"] and w.written == 5


def test_wait_for_a_queued_prefix():
    write, gate, started, done = gated()
    w = SnapshotWriter(write)
    w.submit(Item("p", 10, b"<sys>hello"))
    assert started.wait(60)
    # Not a prefix of this prompt: no wait. A prefix: waits for it (times out here).
    assert w.wait_for(lambda p: p.prefix_of(b"<sys>other"), timeout=0.01)
    assert not w.wait_for(lambda p: p.prefix_of(b"<sys>hello world"), timeout=0.05)
    gate.set()
    assert w.wait_for(lambda p: p.prefix_of(b"<sys>hello world"), timeout=60)
    w.close(5)


def test_a_failing_write_does_not_kill_the_writer(caplog):
    calls = []

    def write(item):
        calls.append(item.name)
        if item.name == "bad":
            raise OSError("disk full")

    w = SnapshotWriter(write)
    w.submit(Item("bad", 1))
    w.submit(Item("good", 1))
    assert w.close(10)
    assert calls == ["bad", "good"] and "background save failed" in caplog.text


def test_store_write_on_another_thread(tmp_path):
    """Serialized here, written by the writer thread: the file verifies and loads."""
    store = make_store(tmp_path)
    a = arrays(3)
    p = store.prepare_save(text="<sys>abc", tokens=[1, 2, 3], arrays=a, reason="evict")
    assert p.nbytes == len(p.data) and p.key and p.tokens == 3
    w = SnapshotWriter(store.write)
    w.submit(p)
    assert w.close(10)
    (e,) = store.entries()
    assert e.reason == "evict" and e.size == p.nbytes
    loaded = load_file(e.path)
    assert loaded.text == "<sys>abc" and loaded.tokens == [1, 2, 3]
    assert same_arrays(loaded.arrays, a)
    assert scan_dir(store.dir).entries[0].model_identity == IDENT


def test_alias_finds_the_snapshot_and_becomes_its_text(tmp_path):
    """A snapshot saved with an alias (a thinking turn's visible key) is found by a
    prompt that starts with the alias; the loaded text is that prefix of the prompt."""
    store = make_store(tmp_path)
    live = "<sys>q<think>hidden reasoning</think>answer"
    key = "<sys>q</think>answer"
    store.save(text=live, tokens=[5, 6, 7, 8], arrays=arrays(1), reason="evict", aliases=[key])
    prompt = key + "<eos><user>next"
    hit = store.lookup_and_load(prompt)
    assert hit is not None and hit.text == key and hit.tokens == [5, 6, 7, 8]
    assert hit.entry.hits == 1
    assert store.lookup_and_load(live + "<eos>more").text == live  # its own text still works
    assert store.lookup_and_load("<sys>q</think>other") is None
    # The same state saved again (same text): the alias list merges, nothing rewritten.
    store.save(
        text=live, tokens=[5, 6, 7, 8], arrays=arrays(1), reason="shutdown", aliases=["<sys>x"]
    )
    assert store.lookup_and_load("<sys>x and more").text == "<sys>x"
    assert store.lookup_and_load(prompt).text == key
    # Evicting the file forgets its aliases with it.
    (e,) = store.entries()
    store.remove(e.key)
    assert store.lookup_and_load(prompt) is None


def test_alias_marks_are_kept_and_unmarked_legacy_aliases_dropped(tmp_path):
    """Issue 12: an alias carries its marks (where its text spells special tokens as plain
    text); a hit through it returns them for the planner's check. A sidecar alias of an
    older build has none, so nothing can be checked: it is ignored."""
    import json

    from ds4mlx.kv.store import INDEX_NAME, text_key

    store = make_store(tmp_path)
    live = "<sys>q<think>hidden</think>answer"
    key = "<sys>q</think>answer"
    store.save(
        text=live, tokens=[5, 6, 7], arrays=arrays(1), reason="evict", aliases=[(key, [1, 9])]
    )
    hit = store.lookup_and_load(key + "<eos>next")
    assert hit.entry.via_alias == len(key) and hit.entry.alias_marks == (1, 9)
    assert store.lookup_and_load(live + "more").entry.alias_marks == ()
    # The sidecar as an older build wrote it: ``[sha1, bytes]``, no marks.
    index = store.dir / INDEX_NAME
    data = json.loads(index.read_text())
    (rec,) = data["entries"].values()
    rec["aliases"] = [[text_key(key, IDENT, CTX), len(key.encode())]]
    index.write_text(json.dumps(data))
    reopened = make_store(tmp_path)
    assert reopened.lookup_and_load(key + "<eos>next") is None
    assert reopened.lookup_and_load(live + "more").text == live
