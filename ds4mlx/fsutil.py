"""Private, durable file writes: the one temp-file + fsync + rename implementation.

A reader must see either the old file or the complete new one, never a torn write, and
a power loss must not leave a complete-looking name over missing blocks: the data is
fsynced before the rename publishes it, and the directory after (so the new name itself
survives). Used by the disk KV cache (snapshots and its index) and the agent's session
files. Stdlib only.

**Modes.** What these files hold is private (full prompt text, KV state, agent
transcripts): files are created 0600 and their directories 0700 (`private_dir` also
narrows an existing directory that is group- or world-accessible), so other local
accounts cannot read ``~/.cache/ds4mlx``.

**Temp names** (`temp_name`) carry the writer's pid *and* a start tag: the Linux boot id
and the process's start time (clock ticks since boot, ``/proc/<pid>/stat`` field 22). A
temp file is stale (`stale_temp`) when its writer is gone: the pid is dead, or it now
belongs to another process (another start time). A pid alone cannot tell: in a
container the server is PID 1 after every restart, so the temps of a killed run carry
the new run's own pid. Where no start time can be read (macOS has no ``/proc``), the tag
is ``0`` and liveness falls back to the pid alone (there, a temp whose pid was reused by
an unrelated process is removed once that process exits).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("ds4mlx.fsutil")

FILE_MODE = 0o600
DIR_MODE = 0o700

# ``.<stem>.<pid>.t<tag>.<random>.tmp``; builds before the tag wrote ``.<stem>.<pid>.<random>.tmp``.
TEMP_RE = re.compile(
    r"^\.(?P<stem>[^./]+)\.(?P<pid>\d+)\.(?:t(?P<tag>[0-9a-f]+)\.)?[0-9a-f]+\.tmp$"
)


# Directories `private_dir` left open (warned about once per process).
_LEFT_OPEN: set[Path] = set()


def private_dir(path: str | os.PathLike, ours: Callable[[str], bool] | None = None) -> Path:
    """Create ``path`` (and missing parents) with mode 0700, or narrow an existing one
    that is only ours.

    An existing directory that the group or others may access gets mode 0700 (logged)
    when every name in it is one ``ours`` accepts (an empty one included): the caller's
    own directory, made wider by an older build or a umask. Any other directory (``/tmp``,
    a project folder given by mistake, a sticky one, another owner's) is left as it is,
    with a warning: narrowing it would lock its other users out. The caller's files are
    created 0600 either way.

    Returns:
        ``path`` as a ``Path``.
    Raises:
        OSError: the directory cannot be created, or ``path`` is empty.
    """
    if not os.fspath(path):
        raise FileNotFoundError("an empty directory name")  # "" would mean the cwd
    p = Path(path)
    missing = []
    q = p
    while not q.exists() and q != q.parent:
        missing.append(q)
        q = q.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, DIR_MODE)  # the umask can only narrow it further
    st = p.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{p} is not a directory")
    if not st.st_mode & 0o077:
        return p
    # Finder's .DS_Store appears in any folder a Mac user opened: not a sign of others.
    names = [n for n in os.listdir(p) if n != ".DS_Store"]
    only_ours = all(ours is not None and ours(name) for name in names)
    if st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX and only_ours:
        new = stat.S_IMODE(st.st_mode) & ~0o077
        os.chmod(p, new)
        log.info("%s: mode %03o -> %03o (private)", p, stat.S_IMODE(st.st_mode), new)
    elif p not in _LEFT_OPEN:  # once: serve checks the directory, then its store opens it
        _LEFT_OPEN.add(p)
        log.warning(
            "%s: mode %03o lets others list it; left as it is (it is not only ours), and "
            "the files written there are private (0600)", p, stat.S_IMODE(st.st_mode),
        )  # fmt: skip
    return p


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:16]
    except OSError:
        return ""


def process_tag(pid: int | None = None) -> str:
    """The start tag of process ``pid`` (default: this one): hex of the boot id and its
    start time in clock ticks, or ``"0"`` when the system does not tell (no ``/proc``)
    or the process is gone."""
    try:
        # "self": this process even where /proc is another pid namespace's mount.
        with open(f"/proc/{'self' if pid is None else pid}/stat", "rb") as f:
            # The command name (field 2) may hold spaces and ")": split after the last ")".
            start = int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return "0"
    boot = _boot_id()
    return f"{boot}{start:x}" if boot else f"{start:x}"


_OWN_TAG = process_tag()


def temp_name(stem: str) -> str:
    """A fresh temp file name for ``stem`` in the same directory as its final file:
    ``.<stem>.<pid>.t<start tag>.<random>.tmp`` (dot name: no glob of final names
    matches it)."""
    return f".{stem}.{os.getpid()}.t{_OWN_TAG}.{secrets.token_hex(4)}.tmp"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    except OSError:
        return False
    return True


def stale_temp(name: str) -> bool:
    """Whether ``name`` is a temp file (`TEMP_RE`) whose writer is gone.

    The writer is gone when its pid is dead, or when the pid now runs a process with
    another start tag (a restart that got the same pid: PID 1 in a container). A name
    without a tag (an older build) is stale unless its pid is alive and is not this
    process (this process writes tagged names only).
    """
    m = TEMP_RE.match(name)
    if m is None:
        return False
    pid, tag = int(m.group("pid")), m.group("tag")
    if pid == os.getpid():
        return tag != _OWN_TAG  # None (untagged) or an earlier process with this pid
    if not _pid_alive(pid):
        return True
    if tag is None or tag == "0":
        return False
    now = process_tag(pid)
    return now != "0" and now != tag


def remove_stale_temps(dir: str | os.PathLike) -> list[str]:
    """Delete the stale temp files (`stale_temp`) in ``dir``; returns their names."""
    gone = []
    try:
        with os.scandir(dir) as it:
            names = [de.name for de in it]
    except FileNotFoundError:
        return gone
    for name in names:
        if stale_temp(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(dir, name))
                gone.append(name)
    return gone


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


def write_durable(
    path: str | os.PathLike, data: bytes, *, mode: int = FILE_MODE, sync: bool = True
) -> None:
    """Create ``path`` (it must not exist) with ``mode`` (default 0600), write ``data``
    and fsync it (``sync``; False for a file whose loss in a crash costs nothing but
    statistics: an fsync is milliseconds to seconds on a busy disk).

    Raises:
        OSError: the file exists or cannot be written; a partial file is removed.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if sync:
                fsync_file(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def atomic_write(
    final: str | os.PathLike,
    data: bytes,
    *,
    tmp: str | os.PathLike,
    mode: int | None = None,
    sync: bool = True,
) -> None:
    """Replace ``final`` with ``data`` atomically: durable write to ``tmp`` (a fresh name
    in the same directory), rename, fsync the directory. A failure at any point (a full
    disk, a file size limit) leaves ``final`` as it was, never half-written.

    ``mode``: the new file's permission bits, exactly (set with ``chmod``, so the umask
    does not narrow them: an edited file keeps its own), or None for `FILE_MODE`.
    ``sync=False``: no fsync of the file or the directory (still atomic for readers; a
    crash may leave the old or an empty file): for statistics, not for data.

    Raises:
        OSError: nothing was replaced; ``tmp`` is removed.
    """
    write_durable(tmp, data, sync=sync)
    try:
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync:
        fsync_dir(Path(final).parent)
