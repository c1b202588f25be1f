"""Helpers for the server tests: a real ``ds4mlx serve`` subprocess on 127.0.0.1.

Every end-to-end test talks to a real server process (the tiny float32 model, a free
port, scripted decoding enabled), stopped with SIGINT and checked to shut down cleanly:
one a test module starts itself (``with Server(...)``), or one shared by the session and
memoized by its flags (the ``server_factory`` fixture, a `ServerPool`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
CLIENTS_BIN = REPO / "tests" / "clients" / "node_modules" / ".bin"
EOS = "<｜end▁of▁sentence｜>"
# The demo model's output cap in the tests' ``--demo`` processes (``DEMO_ENV`` sets
# ``$DS4MLX_DEMO_MAX_TOKENS``; 256 by default): the noise model never samples EOS, so
# every demo reply decodes the whole cap, ~4 CPU-seconds at 256 here. What the tests
# assert (a natural end at the cap, text shown, the banner's figure) holds at any cap.
DEMO_CAP = 64
DEMO_ENV = {"DS4MLX_DEMO_MAX_TOKENS": str(DEMO_CAP)}

# The helpers' one HTTP client. ``httpx.get``/``post`` make a client per call, and making
# one loads the CA bundle: ~35 ms of CPU against ~2 ms for the request itself, paid by
# every /health poll (start-up, `wait_idle`, tests' polling loops). No keep-alive, so each
# request still has a connection of its own, as with ``httpx.get``.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie — exited, not yet reaped — does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux; 49152, IANA's, elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def free_port(count: int = 1) -> int:
    """A port P with P … P + ``count`` - 1 free on 127.0.0.1, picked at random below the
    kernel's ephemeral range.

    A port ``bind(0)`` hands out is an ephemeral one: until the process it is meant for
    binds it (a server or a ring rank binds seconds later, after its imports), any
    outgoing connection on the machine may get it as its local port, and the suite
    makes thousands (seen: a ring rank's ``Couldn't bind socket (error: 98)`` beside the
    test holding 1,100 idle connections). Below that range only an explicit bind takes
    a port.
    """
    high = _ephemeral_start() - count
    low = max(1024, high - 16384)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(low, high) if high > low else 0
        held: list[socket.socket] = []
        try:
            for k in range(count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port + k if port else 0))
                port = port or s.getsockname()[1]
            return port
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {count} free consecutive ports below {high + count}")


class Server:
    """A ``ds4mlx serve`` subprocess.

    Args:
        model_dir: checkpoint directory (None with ``--demo`` in ``extra``).
        ctx: context size.
        extra: more CLI flags.
        env: extra environment variables.
        scripted: pass ``--enable-scripted-decoding``.
        kv_dir: the disk KV cache directory. The disk tier is on by default
            (``~/.cache/ds4mlx/kv``); unless ``extra`` names one, every server gets a
            fresh temporary directory of its own (removed by `stop`), so no test
            sees another's snapshots — or the user's. False passes no
            ``--kv-disk-dir`` (the server's default; set ``XDG_CACHE_HOME`` in ``env``).
    """

    def __init__(
        self,
        model_dir,
        *,
        ctx: int = 8192,
        extra=(),
        env=None,
        scripted: bool = True,
        log_path=None,
        kv_dir=None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "ds4mlx.cli",
            "serve",
            "--port",
            str(self.port),
            "--ctx",
            str(ctx),
        ]
        if model_dir is not None:
            self.cmd += ["-m", str(model_dir)]
        if scripted:
            self.cmd.append("--enable-scripted-decoding")
        self.cmd += list(extra)
        self._tmp_kv = None
        if "--kv-disk-dir" in self.cmd:
            kv_dir = Path(self.cmd[self.cmd.index("--kv-disk-dir") + 1])
        elif kv_dir is None:
            import tempfile

            kv_dir = self._tmp_kv = Path(tempfile.mkdtemp(prefix="ds4mlx-kv-"))
        if "--kv-disk-dir" not in self.cmd and kv_dir is not False:
            self.cmd += ["--kv-disk-dir", str(kv_dir)]
        self.kv_dir = kv_dir
        self.env = {**os.environ, "DS4MLX_REASONING_KEY": "tests", **(env or {})}
        self.env.pop("DS4MLX_MODEL", None)
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self._log = None
        # True: the server (and whatever it starts) gets its own session / process group.
        self.start_new_session = False
        # The server's stdin (None: this process's; `subprocess.PIPE`: a pipe left open).
        self.stdin = None
        self._interrupted = False

    def start(self, timeout: float = 90.0) -> Server:
        if self.log_path is None:
            import tempfile

            self.log_path = Path(tempfile.mkstemp(prefix="ds4mlx-serve-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self._interrupted = False
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=self.stdin,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=REPO,
            start_new_session=self.start_new_session,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if HTTP.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server did not start in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return ""

    def request_lines(self) -> list[str]:
        """The per-request log lines (one per finished job)."""
        return [ln for ln in self.log().splitlines() if " prompt=" in ln and " generated=" in ln]

    def request_line(self, n: int, timeout: float = 30.0) -> str:
        """The ``n``-th per-request log line, waiting for it: the worker writes it after
        the job's last event, so a client can have its answer before the line exists."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.request_lines()
            if len(lines) > n:
                return lines[n]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request line {n} in the log:\n{self.log()[-2000:]}")
            time.sleep(0.05)

    def interrupt(self) -> None:
        """Send SIGINT (graceful shutdown) once, without waiting: `stop` then waits. A
        second SIGINT would be the user's "force quit", so this never sends two."""
        if self.proc is not None and not self._interrupted and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self._interrupted = True

    def stop(self, timeout: float = 30.0) -> int:
        """SIGINT (graceful shutdown, unless `interrupt` sent it) and wait; returns the
        exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.interrupt()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        self._release()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the server (if it still runs) and release what `stop` releases."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._release()

    def _release(self) -> None:
        """Close the log and stdin handles and remove the temporary disk-cache folder
        (idempotent; the log file itself stays for `log`)."""
        if self._log:
            self._log.close()
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()
        if self._tmp_kv is not None:
            shutil.rmtree(self._tmp_kv, ignore_errors=True)

    def script(self, *texts: str) -> None:
        """Queue scripted continuations: the next jobs decode these texts, in order."""
        r = HTTP.post(self.url + "/debug/script", json={"texts": list(texts)}, timeout=10)
        r.raise_for_status()

    def health(self) -> dict:
        return HTTP.get(self.url + "/health", timeout=5).json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if not h["busy"] and h["queued"] == 0:
                return h
            if time.monotonic() > deadline:
                raise TimeoutError(f"server still busy: {h}")
            time.sleep(0.05)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        try:
            rc = self.stop()
        finally:
            self.kill()
        if exc[0] is None:
            assert rc == 0, f"server exited with {rc}:\n{self.log()[-3000:]}"
            self.log_path.unlink(missing_ok=True)  # kept when something failed


class ServerPool:
    """Servers shared by the whole test session, one per distinct set of flags.

    `get` starts a `Server` the first time its arguments are asked for and returns the
    running one afterwards; `close` (session end) stops each with SIGINT and fails if one
    did not exit cleanly. For tests that do not need a fresh server: a shared one has
    served other modules' requests (prompt cache, ``/health`` counters, log lines), so
    such tests count from what they see first (``n0 = len(s.request_lines())``).
    """

    def __init__(self) -> None:
        self._servers: dict[str, Server] = {}

    def get(self, model_dir, **kw) -> Server:
        """The running server for ``Server(model_dir, **kw)``.

        Raises:
            RuntimeError: it did not start, or a shared one has died since.
        """
        key = json.dumps([str(model_dir), kw], sort_keys=True, default=str)
        s = self._servers.get(key)
        if s is None:
            s = self._servers[key] = Server(model_dir, **kw).start()
        elif s.proc.poll() is not None:
            raise RuntimeError(f"shared server exited with {s.proc.returncode}:\n{s.log()[-3000:]}")
        return s

    def close(self) -> None:
        bad = []
        # Every server shuts down at once (each saves its state, flushes and exits on its
        # own), then each is waited for and checked as `Server.stop` does.
        for s in self._servers.values():
            s.interrupt()
        for s in self._servers.values():
            try:
                rc = s.stop()
            finally:
                s.kill()
            if rc != 0:
                bad.append(f"{s.cmd}: exit {rc}\n{s.log()[-2000:]}")
            else:
                s.log_path.unlink(missing_ok=True)
        self._servers.clear()
        assert not bad, "\n".join(bad)


@contextlib.contextmanager
def running(model_dir, **kw) -> Iterator[Server]:
    with Server(model_dir, **kw) as s:
        yield s


def require_cli(name: str) -> str:
    """Path of a real client CLI from tests/clients; fail under CI when missing, else skip."""
    path = CLIENTS_BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found:
        return found
    msg = f"{name} CLI not installed (npm install --prefix tests/clients --no-audit --no-fund)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def benchmark_module(name: str):
    """Import ``benchmarks/NAME.py`` (the benchmarks are scripts, not a package): the
    tests reuse their capture of the real CLIs and their traffic replay."""
    import importlib

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def ws_upgrade(
    port: int, headers: dict[str, str], path: str = "/v1/responses"
) -> tuple[int, bytes]:
    """A raw WebSocket upgrade on ``GET path``: ``(status, the answer's bytes so far)``.

    ``Host`` is ``127.0.0.1:port`` unless ``headers`` names one.
    """
    import base64

    head = {"Host": f"127.0.0.1:{port}", **headers}
    req = (
        f"GET {path} HTTP/1.1\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
        "Sec-WebSocket-Version: 13\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(req.encode())
        data = s.recv(65536)
        if int(data.split(b" ", 2)[1]) != 101:
            # A refusal's JSON body may come in a second segment.
            s.settimeout(2)
            with contextlib.suppress(OSError):
                while b"}" not in data.rpartition(b"\r\n\r\n")[2]:
                    more = s.recv(65536)
                    if not more:
                        break
                    data += more
    return int(data.split(b" ", 2)[1]), data


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str | None, str | None]]:
    """Parse SSE lines into ``(event, data)``; comments yield ``(None, None)``."""
    event, data = None, []
    for line in lines:
        if line == "":
            if data or event:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith(":"):
            yield None, None
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))


def tool_call_dsml(name: str, **params) -> str:
    """A DSML tool-call block (string params as raw text, others as JSON) + EOS."""
    body = ""
    for k, v in params.items():
        if isinstance(v, str):
            body += f'<｜DSML｜parameter name="{k}" string="true">{v}</｜DSML｜parameter>\n'
        else:
            body += f'<｜DSML｜parameter name="{k}" string="false">{json.dumps(v)}</｜DSML｜parameter>\n'
    return f'\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}'
