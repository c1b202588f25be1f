"""The disk tier's writer thread: snapshot file I/O off the inference thread.

docs/ARCHITECTURE.md §5: an ``evict`` save must not delay the unrelated request that
caused it. The inference thread only serializes a snapshot into memory
(``ds4mlx.kv.store.DiskKVStore.prepare_save``, the one MLX step: MLX arrays belong to
the thread that made them); `SnapshotWriter` then runs ``DiskKVStore.write`` (temp file,
fsync, rename, eviction) on its own thread, which makes no MLX call.

Memory policy: pending saves are whole files in memory, so the queue is bounded in
bytes. When a new save would push it over ``max_bytes``, the *oldest pending* saves are
dropped (logged): the newest snapshot describes the most recent state, which is what a
retry or a restart wants; an older one is at worst a shorter prefix of it or a state
already replaced. A save being written is never dropped; a single save larger than the
bound is still accepted (alone), so the bound is ``max(max_bytes, one save)``.

Crash safety is the store's: a write killed mid-way leaves only a temp file, which the
next store opened on the directory removes; a dropped or unwritten save is only a
cache miss.

Stdlib only (and the store's plain-bytes `PreparedSave`).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ds4mlx.kv")

__all__ = ["SnapshotWriter", "DEFAULT_QUEUE_BYTES"]

# Pending bytes before the oldest pending save is dropped (1 GiB): several snapshots of a
# long Flash context; a real disk drains it in a second or two.
DEFAULT_QUEUE_BYTES = 1 << 30


class SnapshotWriter:
    """One background thread writing prepared snapshots in FIFO order.

    Args:
        write: ``write(item) -> Any``, the file I/O of one item (``DiskKVStore.write``);
            None means the item is not on disk (a write error, a file over the budget:
            the callee logs why); its exceptions are logged, never raised to the
            submitter.
        max_bytes: bound on the bytes of pending (not yet started) items (int bytes).
        name: the thread's name.

    Items need ``.nbytes`` (int bytes), ``.key`` and ``.text_bytes`` (UTF-8 bytes of
    their lookup text). Thread-safe; `submit` never blocks on I/O.

    Attributes:
        written: items on disk so far (count, for tests and logs).
        failed: items whose write failed (``write`` returned None or raised; count).
        dropped: items dropped unwritten to keep the bound (count).
    """

    def __init__(
        self, write: Callable[[Any], Any], *, max_bytes: int = DEFAULT_QUEUE_BYTES, name: str = ""
    ):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self._write = write
        self.max_bytes = int(max_bytes)
        self._pending: collections.deque = collections.deque()
        self._pending_bytes = 0
        self._busy: Any = None  # the item being written
        self._cond = threading.Condition()
        self._closed = False
        self.written = 0
        self.failed = 0
        self.dropped = 0
        self._thread = threading.Thread(
            target=self._run, name=name or "ds4mlx-kv-writer", daemon=True
        )
        self._thread.start()

    # ---------------------------------------------------------------- producer side

    def submit(self, item) -> None:
        """Queue ``item``; drop the oldest pending items while over ``max_bytes``.

        Raises:
            RuntimeError: the writer was closed.
        """
        with self._cond:
            if self._closed:
                raise RuntimeError("snapshot writer is closed")
            self._pending.append(item)
            self._pending_bytes += item.nbytes
            while self._pending_bytes > self.max_bytes and len(self._pending) > 1:
                old = self._pending.popleft()
                self._pending_bytes -= old.nbytes
                self.dropped += 1
                log.warning(
                    "kv cache: dropped a pending %s save of %d tokens (write queue over %d MiB)",
                    getattr(old, "reason", "?"),
                    getattr(old, "tokens", 0),
                    self.max_bytes >> 20,
                )
            self._cond.notify_all()

    @property
    def pending_bytes(self) -> int:
        """Bytes of the items waiting (not the one being written)."""
        with self._cond:
            return self._pending_bytes

    def status(self) -> dict[str, int | bool]:
        """``{"pending", "pending_bytes", "writing", "written", "failed", "dropped"}``
        (counts, bytes, whether an item is being written) for ``/health``."""
        with self._cond:
            return {
                "pending": len(self._pending),
                "pending_bytes": self._pending_bytes,
                "writing": self._busy is not None,
                "written": self.written,
                "failed": self.failed,
                "dropped": self.dropped,
            }

    def wait_for(self, pred: Callable[[Any], bool], timeout: float | None = None) -> bool:
        """Wait until no pending or in-flight item satisfies ``pred``.

        The planner calls it before a disk lookup with "the item's text is a prefix of
        this prompt": a snapshot still in the queue is then on disk when the lookup runs
        (else an exact replay right after its prompt would miss its own save).
        Returns False on timeout (seconds).
        """
        with self._cond:
            return self._cond.wait_for(
                lambda: not any(pred(i) for i in self._in_queue()), timeout=timeout
            )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written. False on timeout (seconds)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and self._busy is None, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued, then stop the thread (clean shutdown). Idempotent.

        Returns False when the queue did not drain within ``timeout`` seconds (what is
        left is lost: a cache miss, never a corrupt file).
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---------------------------------------------------------------- the thread

    def _in_queue(self) -> list:
        return [*([self._busy] if self._busy is not None else []), *self._pending]

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return  # closed and drained
                item = self._busy = self._pending.popleft()
                self._pending_bytes -= item.nbytes
            ok = False
            try:
                ok = self._write(item) is not None
            except Exception:  # a disk error loses this snapshot, never the writer
                log.exception("kv cache: background save failed")
            finally:
                with self._cond:
                    self._busy = None
                    if ok:
                        self.written += 1
                    else:
                        self.failed += 1
                    self._cond.notify_all()
