"""``--rank-timeout``: every wait of one rank on the others is bounded (docs/DISTRIBUTED.md,
"A lost rank").

MLX's ring backend has no timeout of its own: a rank waits on a peer's bytes for as long
as the peer's socket stays open. That is forever when the peer is stopped or hung, when a
real network never signals a dead peer, and also after a failure the ring did report: its
socket thread gives up after ten failed reads or writes and ends, so any later send or
receive on that socket (a step launched before the error surfaced, a shutdown snapshot
queued behind it on the same stream) never completes.

A `StepDeadline` watches from a daemon thread. It is armed by every operation this rank
builds for its peers (`arm`: a forward call, a snapshot or restore order, the shutdown)
and settled once an evaluation has waited for everything launched (`settle`: the session
evaluated its logits and caches). When no operation has been built for ``timeout_s``
while it is armed, the peers count as lost:

1. it shuts the ring's sockets down, so the blocked receive fails at once with the ring's
   own error (``[ring] connection to a peer was lost``): the request fails with its
   protocol's error and the server stops the way it does for a peer that died;
2. should the process still be alive ``grace_s`` later (a wait on a socket thread that
   already ended cannot be woken), it prints the line and exits with code 1.

The same sockets are made to wait asleep (`sleep_in_waits`, done by every `StepDeadline`,
so on every rank of either split): MLX's ring makes them non-blocking and its socket
thread busy-polls ``recv``/``send`` until the bytes come, so a rank that waits on its
peer would spin a core (on one host, the core the peer computes on).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("ds4mlx.engine")

RANK_TIMEOUT_S = 120.0
# After the sockets are shut down, how long the normal error path gets to stop the process.
GRACE_S = 5.0
# The longest one recv/send of MLX's socket thread sleeps before it turns to the other
# queue of the same socket (the kernel rounds it up to one clock tick, 1-10 ms).
SOCKET_WAIT_S = 0.001


def ring_sockets() -> list[int]:
    """File descriptors of this process's ring connections: connected TCP sockets whose
    local or peer address is one of the launch's addresses (``$MLX_HOSTFILE``, the JSON
    list of ``"ip:port"`` lists ``mlx.launch`` writes). Empty when there is none (no
    ring launch, or JACCL, whose traffic is not on TCP)."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return []
    try:
        with open(path) as f:
            hosts = json.load(f)
        addresses = {
            (ip, int(port)) for host in hosts for ip, _, port in (a.rpartition(":") for a in host)
        }
    except (OSError, ValueError, TypeError):
        return []
    fds = []
    for name in _fd_names():
        fd = int(name)
        try:
            s = socket.socket(fileno=fd)
        except OSError:  # not a socket
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ends = {s.getsockname()[:2], s.getpeername()[:2]}
        except OSError:  # not connected
            continue
        finally:
            s.detach()  # the descriptor stays MLX's
        if ends & addresses:
            fds.append(fd)
    return fds


def wait_for_bytes(fds: list[int]) -> bool:
    """Block, using no CPU, until one of the ring sockets ``fds`` has bytes to read (or is
    closed); True once they came, False at once without sockets (no ring launch, JACCL).
    A follower waits here for the next call: the call has begun once its first bytes
    came (the deadline is armed from then on), and no receive is posted meanwhile (before
    `sleep_in_waits`, a posted receive spun a core)."""
    if not fds:
        return False
    select.select(fds, [], [])
    return True


def sleep_in_waits(fds: list[int], wait_s: float = SOCKET_WAIT_S) -> None:
    """Make the ring sockets ``fds`` blocking with a ``wait_s`` receive and send timeout
    (``SO_RCVTIMEO``/``SO_SNDTIMEO``, seconds), so MLX's socket thread sleeps in the kernel
    until bytes come instead of busy-polling a non-blocking ``recv`` (the ring backend of
    mlx 0.32 reads a timeout's ``EAGAIN`` as "nothing yet" and tries again, as it does on
    the non-blocking socket). A bounded wait, not an endless one: the thread serves one
    socket's receives and sends in turn, and an all_sum of 1 MiB or more sends and receives
    on the same socket at once. A shutdown (`shut_down`) still ends a sleeping read at once.
    No-op for an empty list (no ring launch, JACCL)."""
    sec = int(wait_s)
    timeval = struct.pack("ll", sec, int((wait_s - sec) * 1_000_000))
    for fd in fds:
        with contextlib.suppress(OSError):
            os.set_blocking(fd, True)
            s = socket.socket(fileno=fd)
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            finally:
                s.detach()  # the descriptor stays MLX's


def _fd_names() -> list[str]:
    for d in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return [n for n in os.listdir(d) if n.isdigit()]
    return []


def closed_socket(fd: int) -> str | None:
    """Why ring socket ``fd`` is closed (``"its connection was closed"``: end of file;
    a reset or shutdown: the error), else None, seen with ``MSG_PEEK`` and without
    blocking: MLX's socket thread reads every byte itself."""
    s = socket.socket(fileno=fd)
    try:
        if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
            return "its connection was closed"
    except BlockingIOError:
        return None  # open, nothing to read
    except OSError as e:
        return e.strerror or str(e)
    finally:
        s.detach()  # the descriptor stays MLX's
    return None


def wait_closed(fds: list[int], timeout_s: float) -> bool:
    """Sleep until a peer has closed one of the ring sockets ``fds`` (`closed_socket`),
    at most ``timeout_s`` seconds; whether it did. Waits without MLX, whose receive on
    a closed socket prints ten ``[ring]`` lines before it raises."""
    end = time.monotonic() + timeout_s
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select(fds, [], [], left)
        if any(closed_socket(fd) is not None for fd in ready):
            return True
        if ready:  # bytes nobody reads here: look again a little later
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))
    return False


def shut_down(fds: list[int]) -> None:
    """Shut every socket of ``fds`` down both ways (the descriptors stay open: MLX owns
    them); its blocked or later reads then end at once."""
    for fd in fds:
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=fd)
            try:
                s.shutdown(socket.SHUT_RDWR)
            finally:
                s.detach()


class PeerLost(RuntimeError):
    """A peer rank is gone (it died, or stopped answering for ``--rank-timeout``); the
    message is the one line to print: ``rank 0 lost: …``."""


class StepDeadline:
    """Bounds the waits of one rank on its peers (module docstring) and makes them sleep:
    constructing one applies `sleep_in_waits` to this process's ring sockets.

    Args:
        timeout_s: seconds without a new operation, while armed, before the peers count
            as lost (``--rank-timeout``; > 0).
        who: the lost peers in words (``"rank 1"``), for the line.
        grace_s: seconds from shutting the sockets down to exiting the process.
        exit: called with the exit code instead of ``os._exit`` (tests).

    Attributes:
        expired: None, or why the peers count as lost (``"no answer within 120 s
            (--rank-timeout)"``) once the deadline passed.
    """

    def __init__(
        self,
        timeout_s: float = RANK_TIMEOUT_S,
        who: str = "a peer rank",
        *,
        grace_s: float = GRACE_S,
        exit: Callable[[int], None] = os._exit,
    ):
        if not timeout_s > 0:
            raise ValueError(f"--rank-timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.who = who
        self.grace_s = grace_s
        self.expired: str | None = None
        self._exit = exit
        self._sockets = ring_sockets()
        sleep_in_waits(self._sockets)
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic time of the last arm, None: settled
        self._thread: threading.Thread | None = None

    def arm(self) -> None:
        """An operation for the peers was built: they must answer within the timeout."""
        with self._lock:
            self._since = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="ds4mlx-rank-deadline", daemon=True
                )
                self._thread.start()

    def settle(self) -> None:
        """Everything launched has been evaluated: nothing is waited for any more."""
        with self._lock:
            self._since = None

    def lost(self, exc: BaseException) -> str | None:
        """The line to print when ``exc`` (raised by an operation with the peers) means a
        peer is gone, else None: ``"rank 1 lost: "`` + why (this deadline's expiry when it
        shut the sockets down, else MLX's error: its ring raises ``RuntimeError("[ring] …
        connection … lost")`` from ``recv``/``send``/``all_sum`` as soon as the peer's
        socket closes). Re-arms: the process stops now and must be gone within the
        timeout, as a wait left on a dead ring socket (MLX joins its streams at exit)
        would block it for good."""
        text = str(exc)
        if not isinstance(exc, RuntimeError) or "[ring]" not in text:
            return None
        self.arm()
        return f"{self.who} lost: {self.expired or text}"

    def closed(self) -> str | None:
        """The lost-peer line when a peer has closed one of the ring sockets (it died: its
        kernel closed them), seen without reading (`closed_socket`), else None. A rank
        that dies while nothing is sent to it fails nothing; this is how rank 0 learns of
        it before its shutdown saves, whose parts could no longer be written."""
        for fd in self._sockets:
            why = closed_socket(fd)
            if why is not None:
                return f"{self.who} lost: {self.expired or why}"
        return None

    @contextlib.contextmanager
    def naming_the_lost_peer(self):
        """A lost peer inside the block raises `PeerLost` with `lost`'s line (a
        follower's loop: its last line says which rank went and why)."""
        try:
            yield
        except RuntimeError as e:
            line = self.lost(e)
            if line is None:
                raise
            raise PeerLost(line) from e

    def _watch(self) -> None:
        tick = min(1.0, self.timeout_s / 4)
        while True:
            time.sleep(tick)
            with self._lock:
                since = self._since
            if since is not None and time.monotonic() - since > self.timeout_s:
                break
        self.expired = f"no answer within {self.timeout_s:g} s (--rank-timeout)"
        line = f"{self.who} lost: {self.expired}"
        log.error("%s; shutting the ring sockets down", line)
        shut_down(self._sockets)
        time.sleep(self.grace_s)
        print(f"ds4mlx: {line}; exiting", file=sys.stderr, flush=True)
        self._exit(1)
