"""One pipeline rank's parts of disk snapshots (docs/DISTRIBUTED.md, "Snapshots").

Under ``--distributed pipeline`` rank 0 writes the usual snapshot file
(``ds4mlx.kv.store``: text, tokens, logits, tool memory and its own layers' caches) and
every other rank writes its own layers' caches to its own disk, under the same key:
``<key>.rank<r>.safetensors`` in the same ``--kv-disk-dir`` path on each machine (the
rank in the name lets loopback ranks share one directory; rank 0's scans ignore these
names). There is no merged file: merging would send the whole KV over the link.

A part file is plain safetensors: the layer caches as ``cache.<layer>.<name>`` (global
layer numbers) and the header ``format`` = ``"ds4mlx-kv-part"``, ``key``, ``rank``,
``tokens`` (the token count the caches hold) and ``digest`` (the store's CRC-32 over every
tensor). Rank 0 orders every save, load and removal (``ds4mlx.engine.pipeline``); this
store never evicts on its own.

The follower's inference thread serializes a part into memory (the only MLX work) and
a `ds4mlx.kv.writer.SnapshotWriter` thread puts it on disk (temp file, fsync, rename), so
the pipeline never waits on disk.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ds4mlx.fsutil import atomic_write, private_dir, temp_name
from ds4mlx.kv.store import _digest, cache_file
from ds4mlx.kv.writer import SnapshotWriter

log = logging.getLogger("ds4mlx.kv")

PART_FORMAT = "ds4mlx-kv-part"


@dataclass
class _PreparedPart:
    key: str
    data: memoryview
    tokens: int
    reason: str = "part"
    text_bytes: bytes = b""

    @property
    def nbytes(self) -> int:
        return len(self.data)


class PartStore:
    """This rank's snapshot parts in ``dir``.

    Args:
        dir: the ``--kv-disk-dir`` (created 0700 when missing).
        rank: this process's rank (> 0).
    """

    def __init__(self, dir: str | os.PathLike, rank: int):
        self.dir = private_dir(dir, ours=cache_file)
        self.rank = rank
        self.writer = SnapshotWriter(self._write, name=f"ds4mlx-kv-part-writer-{rank}")

    def path(self, key: str) -> Path:
        """The part file of snapshot ``key`` (40 hex digits) on this rank."""
        return self.dir / f"{key}.rank{self.rank}.safetensors"

    def save(self, key: str, arrays: dict[str, mx.array], tokens: int) -> None:
        """Serialize ``arrays`` (``cache.<layer>.<name>`` -> array) now, on the calling
        thread (it owns them), and queue the file write. ``tokens``: how many tokens the
        caches hold (checked at load). Failures are logged, never raised."""
        header = {"format": PART_FORMAT, "key": key, "rank": str(self.rank), "tokens": str(tokens)}
        try:
            mx.eval(list(arrays.values()))
            header["digest"] = _digest(arrays)
            buf = io.BytesIO()
            mx.save_safetensors(buf, {k: mx.contiguous(a) for k, a in arrays.items()}, header)
            self.writer.submit(_PreparedPart(key, buf.getbuffer(), tokens))
        except (OSError, RuntimeError) as e:
            log.warning("kv cache: rank %d: part %s not saved: %s", self.rank, key[:12], e)

    def _write(self, p: _PreparedPart) -> Path | None:
        final = self.path(p.key)
        try:
            atomic_write(final, p.data, tmp=self.dir / temp_name(final.name))
        except OSError as e:
            log.warning("kv cache: rank %d: part %s not written: %s", self.rank, p.key[:12], e)
            return None
        log.info("kv cache: rank %d: stored part key=%s tokens=%d", self.rank, p.key, p.tokens)
        return final

    def load(self, key: str, tokens: int) -> dict[str, mx.array] | None:
        """The evaluated arrays of part ``key`` holding ``tokens`` tokens, or None (logged)
        when it is missing, corrupt or of another key or token count. Waits for a queued
        write of the same key first."""
        self.writer.wait_for(lambda item: item.key == key)
        path = self.path(key)
        try:
            arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
            mx.eval(list(arrays.values()))
        except FileNotFoundError:
            log.info("kv cache: rank %d: no part for key=%s", self.rank, key)
            return None
        except Exception as e:  # MLX raises RuntimeError/ValueError on a torn file
            log.warning("kv cache: rank %d: unreadable part %s: %s", self.rank, path.name, e)
            return None
        want = {"format": PART_FORMAT, "key": key, "rank": str(self.rank), "tokens": str(tokens)}
        if any(meta.get(k) != v for k, v in want.items()) or meta.get("digest") != _digest(arrays):
            log.warning("kv cache: rank %d: part %s is corrupt or foreign", self.rank, path.name)
            return None
        return arrays

    def remove(self, key: str) -> None:
        """Delete the part of ``key`` (rank 0 evicted or removed its file), after a queued
        write of the same key: rank 0 may evict a snapshot while this rank's writer still
        has its part queued, which was written after the removal and left behind."""
        self.writer.wait_for(lambda item: item.key == key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))

    def close(self) -> None:
        """Write what is queued (shutdown saves), then stop the writer thread."""
        self.writer.close()
