"""``--trace FILE``: a JSON-lines record of a whole server session."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
import threading
import time
from typing import Any


class Tracer:
    """``--trace FILE``: JSON lines of prompts, cache decisions, output, parser events.

    One object per line: ``{"t": unix time, "job": id, "kind": ..., ...}``. Thread-safe;
    writes are flushed per job so a crash loses at most the running one. The file holds
    whole prompts: it is created 0600, and an existing one is narrowed to 0600 before
    anything is appended.
    """

    def __init__(self, path: str | os.PathLike | None):
        self._lock = threading.Lock()
        self._f = _open_private(path) if path else None

    @property
    def enabled(self) -> bool:
        return self._f is not None

    def write(self, job_id: int, kind: str, **fields: Any) -> None:
        if self._f is None:
            return
        rec = {"t": round(time.time(), 3), "job": job_id, "kind": kind, **fields}
        line = json.dumps(rec, ensure_ascii=False, default=_json_default)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


def _open_private(path: str | os.PathLike):
    """``path`` opened for appending text, mode 0600 (created so, or narrowed).

    Raises:
        OSError: ``path`` is a symlink (ELOOP) or not a regular file: narrowing its mode
            would change what it points at (a shared file, ``/dev/null``).
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    except OSError:
        pass  # another user's file we may append to: leave its mode
    return os.fdopen(fd, "a", encoding="utf-8")


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return {"type": type(o).__name__, **dataclasses.asdict(o)}
    return repr(o)
