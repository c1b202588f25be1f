"""Open files and client connections: the open-file limit, a cap on connections with a
reserve, and accept errors logged once per interval.

Every client connection holds a file descriptor. Hypercorn accepts connections as long
as the process has descriptors and has no cap of its own; once the open-file limit is
reached, ``accept`` fails with ``EMFILE``, new clients (``/health`` included) wait in the
kernel's backlog until an idle connection times out, and asyncio logs a traceback for
every failed accept, many times a second. So:

- `raise_open_file_limit` lifts the soft ``RLIMIT_NOFILE`` to the hard limit at start.
- `ConnectionGate` caps open connections below the limit (`default_cap`: the limit less
  the descriptors open at start less `RESERVE`, kept for snapshot files, the trace and
  the log). At the cap a new connection closes the longest-idle connection (one with no
  request or WebSocket in flight) and is served; with none idle it is closed at once.
  Idle connections cannot then lock clients out. A connection the client closed is
  closed at once (`_ClientSocket`), not at Hypercorn's keep-alive timeout.
- An accept that still fails for lack of descriptors is logged once per
  `LOG_INTERVAL_S` (with how many failed), closes idle connections to free
  descriptors, and pauses accepting for asyncio's retry delay.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import socket
import time
import weakref
from collections import OrderedDict

from ds4mlx.argtypes import env_positive

log = logging.getLogger("ds4mlx.server")

# Descriptors kept out of the connection cap: snapshot and index files, the trace, the
# log, the connections an accept batch evicted and that are still closing.
RESERVE = 64
# At most this many evicted connections may be still closing; past it, new ones are
# refused (an accept batch takes up to 100 connections at once).
MAX_CLOSING = 16
# Seconds between two log lines about the same condition (failed accepts, the cap):
# 10, or ``$DS4MLX_LOG_INTERVAL_S`` (the tests that wait an interval out shorten it).
LOG_INTERVAL_S = env_positive("DS4MLX_LOG_INTERVAL_S", 10.0)
# asyncio waits this long before accepting again after EMFILE
# (asyncio.constants.ACCEPT_RETRY_DELAY).
ACCEPT_PAUSE_S = 1.0
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


# --------------------------------------------------------------------------- open-file limit


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; return ``(soft, hard)`` after.

    macOS refuses an unlimited soft limit (its cap is ``kern.maxfilesperproc``); then
    the largest value it takes below the hard limit is kept. Never lowers the limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = hard == resource.RLIM_INFINITY
    for target in ([] if infinite else [hard]) + [1 << 20, 65536, 10240]:
        if target <= soft or (not infinite and target > hard):
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def open_fds() -> int:
    """Descriptors this process has open now (0 where the platform does not say)."""
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(d))
        except OSError:
            continue
    return 0


def default_cap() -> int:
    """Connections at most: the soft open-file limit less the descriptors open now less
    `RESERVE` (at least 8)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(8, soft - open_fds() - RESERVE)


# --------------------------------------------------------------------------- the gate


class _Every:
    """Logs a message at most once per `LOG_INTERVAL_S`, counting the ones it held back."""

    def __init__(self) -> None:
        self.last = float("-inf")
        self.held = 0

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        if now - self.last < LOG_INTERVAL_S:
            self.held += 1
            return
        more = f" ({self.held} more since the last line)" if self.held else ""
        self.last, self.held = now, 0
        log.warning("%s%s", text, more)


class ConnectionGate:
    """Counts the open client connections and keeps them under ``cap``.

    Connections are keyed by the peer address ``(host, port)``, which the accept and
    the ASGI scope's ``client`` both give. All methods run on the event loop's thread.

    Args:
        cap: open connections at most (int > 0).
    """

    def __init__(self, cap: int):
        self.cap = cap
        # peer → socket, oldest first; a request moves its connection to the end.
        self._conns: OrderedDict[tuple, weakref.ref] = OrderedDict()
        self._busy: dict[tuple, int] = {}
        self._closing: set[tuple] = set()
        self.evicted = 0
        self.refused = 0
        self.accept_failures = 0
        self._log_evict = _Every()
        self._log_refuse = _Every()
        self._log_accept = _Every()

    # ----------------------------------------------------------------- accounting

    @property
    def open(self) -> int:
        """Connections open now (including evicted ones still closing)."""
        self._prune()
        return len(self._conns)

    def _prune(self) -> None:
        for key in [k for k, ref in self._conns.items() if _closed(ref())]:
            del self._conns[key]
            self._closing.discard(key)

    def _evict_idle(self) -> bool:
        """Shut down the longest-idle connection; False when none is idle or too many
        evicted ones are still closing. Its transport then reads a reset and closes it,
        freeing its descriptor within a loop iteration or two."""
        if len(self._closing) >= MAX_CLOSING:
            return False
        for key, ref in self._conns.items():
            if key in self._closing or self._busy.get(key):
                continue
            sock = ref()
            if _closed(sock):
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # its next read resets (`_ClientSocket`)
            self._closing.add(key)
            self.evicted += 1
            return True
        return False

    def admit(self, conn: socket.socket, addr) -> bool:
        """Whether to serve a just-accepted connection (False: the caller closes it)."""
        if len(self._conns) >= self.cap:
            self._prune()
        if len(self._conns) >= self.cap:
            if not self._evict_idle():
                self.refused += 1
                self._log_refuse(
                    f"{len(self._conns)} connections open (cap {self.cap}), none idle or "
                    "all being closed: closing new connections (--max-connections)"
                )
                return False
            self._log_evict(
                f"{self.cap} connections open (the cap): closing the longest-idle ones "
                "for new clients (--max-connections)"
            )
        self._conns[_peer(addr)] = weakref.ref(conn)
        return True

    def accept_failed(self, exc: OSError) -> None:
        """The process is out of descriptors: log (once per interval) and free some by
        closing idle connections."""
        self.accept_failures += 1
        self._prune()
        freed = sum(self._evict_idle() for _ in range(MAX_CLOSING))
        self._log_accept(
            f"accept failed: {exc.strerror or exc} ({len(self._conns)} connections open, "
            f"cap {self.cap}; closed {freed} idle ones; retrying in {ACCEPT_PAUSE_S:g}s)"
        )

    # ----------------------------------------------------------------- ASGI

    def asgi(self, app):
        """``app`` wrapped so each connection counts as busy while a request or a
        WebSocket on it runs (busy connections are never evicted)."""

        async def gated(scope, receive, send):
            if scope.get("type") not in ("http", "websocket") or not scope.get("client"):
                return await app(scope, receive, send)
            key = _peer(scope["client"])
            self._busy[key] = self._busy.get(key, 0) + 1
            if key in self._conns:
                self._conns.move_to_end(key)
            try:
                return await app(scope, receive, send)
            finally:
                left = self._busy.pop(key) - 1
                if left:
                    self._busy[key] = left
                if key in self._conns:
                    self._conns.move_to_end(key)

        return gated

    # ----------------------------------------------------------------- sockets

    def listener(self, sock: socket.socket) -> socket.socket:
        """``sock`` (a bound listening socket) as one whose ``accept`` goes through
        this gate; ``sock`` is detached (its descriptor moves to the new object)."""
        gated = _GatedListener(sock.family, sock.type, sock.proto, fileno=sock.detach())
        gated.gate = self
        return gated


def _peer(addr) -> tuple:
    """``(host, port)`` of a peer address (IPv6 accepts add flow info and scope id)."""
    return tuple(addr[:2]) if isinstance(addr, tuple | list) else (addr,)


def _closed(sock: socket.socket | None) -> bool:
    return sock is None or sock.fileno() < 0


class _ClientSocket(socket.socket):
    """An accepted connection whose end of input reads as a reset.

    Hypercorn (0.18) keeps a connection whose client closed it while no request was in
    flight until its keep-alive timeout: the descriptor stays open (CLOSE-WAIT) for 75 s
    after every closed connection, and an evicted one (shut down) would linger the
    same. A reset makes asyncio close the transport, and its descriptor, at once; the
    request in flight, if any, sees the client gone. (HTTP clients do not half-close
    a connection while waiting for an answer.)
    """

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = super().recv(bufsize, flags)
        if not data and bufsize:
            raise ConnectionResetError(errno.ECONNRESET, "connection closed by the client")
        return data

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        n = super().recv_into(buffer, nbytes, flags)
        if n == 0 and (nbytes or len(buffer)):
            raise ConnectionResetError(errno.ECONNRESET, "connection closed by the client")
        return n


class _GatedListener(socket.socket):
    """A listening socket whose ``accept`` asks a `ConnectionGate` first and hands out
    `_ClientSocket` connections.

    asyncio's accept loop calls ``accept`` up to 100 times per readiness event. A
    refused connection is closed and ``ConnectionAbortedError`` ends the batch (asyncio
    ignores it). On EMFILE asyncio pauses for a second but keeps calling ``accept`` in
    the same batch, scheduling one more retry and logging one more traceback per call:
    after the first failure the rest of the batch is ended the same way.
    """

    gate: ConnectionGate
    _paused_until = float("-inf")

    def accept(self):
        if time.monotonic() < self._paused_until:
            raise ConnectionAbortedError("accepting is paused")
        try:
            fd, addr = self._accept()
        except OSError as e:
            if e.errno in _OUT_OF_FDS:
                self._paused_until = time.monotonic() + ACCEPT_PAUSE_S / 2
                self.gate.accept_failed(e)
            raise
        conn = _ClientSocket(self.family, self.type, self.proto, fileno=fd)
        if not self.gate.admit(conn, addr):
            conn.close()
            raise ConnectionAbortedError("connection cap reached")
        return conn, addr


def quiet_accept_errors(loop, context: dict) -> None:
    """Event-loop exception handler: asyncio's own report of an accept that ran out of
    descriptors (a traceback each time) is dropped — `ConnectionGate.accept_failed`
    logged it once per interval; everything else goes to the default handler."""
    exc = context.get("exception")
    if "socket" in context and isinstance(exc, OSError) and exc.errno in _OUT_OF_FDS:
        return
    loop.default_exception_handler(context)
