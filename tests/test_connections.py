"""Issue 17, connection exhaustion: idle connections cannot lock clients out.

A real ``ds4mlx serve`` started under ``prlimit --nofile=1024:1024`` (mlx-lm's import
used to fail there, setting the limit to 2048/4096), 1,100 idle connections opened by
the test: ``/health`` still answers (the cap closes the longest-idle connection for a
new one), and failed accepts are logged at most once per interval, without tracebacks.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import socket
import time
from datetime import datetime

import httpx
import pytest
from server_util import HTTP, Server

IDLE = 1100
# The servers' log interval (``$DS4MLX_LOG_INTERVAL_S``; 10 s by default), shortened so
# that waiting one interval out costs seconds. Log lines carry whole seconds: two lines
# one interval apart are at least ``LOG_INTERVAL_S - 1`` apart in the log.
LOG_INTERVAL_S = 3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit"),
]


@pytest.fixture(autouse=True)
def _enough_descriptors():
    """This process opens IDLE connections: its own soft limit must allow them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = IDLE + 200
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"hard open-file limit {hard} < {want}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def limited(model_dir, nofile: str, extra=()) -> Server:
    s = Server(
        model_dir,
        ctx=1024,
        extra=["--kv-disk-dir", "none", *extra],
        env={"DS4MLX_LOG_INTERVAL_S": str(LOG_INTERVAL_S)},
        scripted=False,
    )
    s.cmd = ["prlimit", f"--nofile={nofile}", *s.cmd]
    return s


@contextlib.contextmanager
def idle_connections(port: int, n: int):
    """``n`` TCP connections to the server that never send a byte."""
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        yield socks
    finally:
        for s in socks:
            s.close()


def retried(get, within: float = 60) -> httpx.Response:
    """``get()`` (one request), asked as a supervisor's probe does: a connection the
    server closed unserved is tried again, until ``within`` seconds have passed. (While
    `MAX_CLOSING` evicted connections are still closing, a new one is closed at once: on
    a loaded machine the probe right after a burst of idle connections met that.) Locked
    out for good, it fails."""
    deadline = time.monotonic() + within
    while True:
        try:
            return get()
        except (httpx.ReadError, httpx.ConnectError, httpx.RemoteProtocolError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def health_answers(server) -> dict:
    r = retried(lambda: HTTP.get(server.url + "/health", timeout=httpx.Timeout(60, connect=60)))
    assert r.status_code == 200, r.text
    return r.json()


def line_times(log: str, pattern: str) -> list[int]:
    """Times (whole seconds) of the log lines matching ``pattern``: a log line starts with
    its ISO 8601 date and time (``2026-12-05T02:42:26``)."""
    line = rf"^(\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d) .*{pattern}"
    return [int(datetime.fromisoformat(t).timestamp()) for t in re.findall(line, log, re.M)]


def assert_once_per_interval(times: list[int]) -> None:
    # Timestamps have whole seconds: consecutive lines at least the interval apart, less
    # one second of rounding.
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(g >= LOG_INTERVAL_S - 1 for g in gaps), times


def test_idle_connections_past_the_file_limit_do_not_lock_health_out(tiny_model_dir):  # noqa: F811
    with limited(tiny_model_dir, "1024:1024") as s:
        with idle_connections(s.port, IDLE):
            health_answers(s)
            # A request on a connection that then stays open: served as well.
            with httpx.Client(base_url=s.url, timeout=60) as c:
                assert retried(lambda: c.get("/v1/models")).status_code == 200
                health_answers(s)
        health_answers(s)
        log = s.log()
    assert "Traceback" not in log and "out of system resource" not in log, log[-3000:]
    assert "connections open (the cap)" in log
    assert_once_per_interval(line_times(log, r"connections open \(the cap\)"))
    assert_once_per_interval(line_times(log, "closing new connections"))


def test_accept_errors_are_logged_once_per_interval(tiny_model_dir):  # noqa: F811
    # A cap above the file limit: accepts fail with EMFILE, as they did without a cap.
    with limited(tiny_model_dir, "1024:1024", ["--max-connections", "100000"]) as s:
        with idle_connections(s.port, IDLE):
            health_answers(s)
            time.sleep(LOG_INTERVAL_S + 2)  # accepts keep failing past one interval
            health_answers(s)
        log = s.log()
    failures = line_times(log, "accept failed")
    assert failures, log[-3000:]
    assert_once_per_interval(failures)
    assert "Traceback" not in log and "out of system resource" not in log, log[-3000:]


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_the_limit_is_raised_and_closed_connections_free_their_descriptors(tiny_model_dir):  # noqa: F811
    # Below this process's hard limit.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    with limited(tiny_model_dir, f"512:{hard}") as s:
        # Raised to the hard limit.
        assert f"open-file limit {hard};" in s.log(), s.log()[-2000:]
        pid = s.proc.pid
        before = _open_fds(pid)
        with idle_connections(s.port, 300):
            # The server's own descriptors move by a few meanwhile (files, pipes): the
            # 300 accepted connections are what must show.
            held = before + 300 - 10
            deadline = time.monotonic() + 30
            while _open_fds(pid) < held and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _open_fds(pid) >= held
        # Closed by the client: the server closes them too, not at its 75 s keep-alive
        # timeout (which held every closed connection's descriptor until then).
        deadline = time.monotonic() + 30
        while _open_fds(pid) > before + 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _open_fds(pid) <= before + 10, (before, _open_fds(pid))
        health_answers(s)
