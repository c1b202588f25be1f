"""Durable file writes: the one temp-file + fsync + rename implementation.

A reader must see either the old file or the complete new one, never a torn write, and
a power loss must not leave a complete-looking name over missing blocks: the data is
fsynced before the rename publishes it, and the directory after (so the new name itself
survives). Used by the disk KV cache (snapshots and its index) and the agent's session
files. Stdlib only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


def fsync_file(fd: int) -> None:
    """Flush ``fd``'s data to stable storage.

    On macOS ``fsync()`` only reaches the drive's cache; ``F_FULLFSYNC`` is the real
    barrier there (falls back to ``fsync`` where the filesystem refuses it).
    """
    full = getattr(fcntl, "F_FULLFSYNC", None)
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError:
            pass
    os.fsync(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside directory ``path`` durable (best effort: some filesystems
    refuse fsync on directories; the rename is still atomic)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_durable(path: str | os.PathLike, data: bytes, *, mode: int = 0o644) -> None:
    """Create ``path`` (it must not exist), write ``data`` and fsync it.

    Raises:
        OSError: the file exists or cannot be written; a partial file is removed.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            fsync_file(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def atomic_write(final: str | os.PathLike, data: bytes, *, tmp: str | os.PathLike) -> None:
    """Replace ``final`` with ``data`` atomically: durable write to ``tmp`` (a fresh name
    in the same directory), rename, fsync the directory.

    Raises:
        OSError: nothing was replaced; ``tmp`` is removed.
    """
    write_durable(tmp, data)
    try:
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(Path(final).parent)
