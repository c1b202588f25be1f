"""Shell jobs for the agent's ``bash`` tools: run, poll, time out, stop.

Every command runs as ``bash -c COMMAND`` in its own process group (session), with
stdout and stderr on separate pipes; stdin is ``/dev/null``, or for foreground runs a
pseudo-terminal the runtime owns (:meth:`Job.reading_stdin`, :meth:`Job.answer`). A reader thread per pipe drains it
into a bounded buffer that keeps the head and the tail of unread output and drops the
middle, so a chatty command can neither block on a full pipe nor fill memory.
Stopping a job signals the whole process group (SIGTERM, then SIGKILL after a
grace period), so children started by the command die with it.

Times are in seconds (``time.monotonic``); buffer sizes in bytes.
"""

from __future__ import annotations

import codecs
import contextlib
import itertools
import os
import platform
import select
import signal
import subprocess
import termios
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ds4mlx.agent.child_env import EnvPolicy, child_env
from ds4mlx.agent.diagnostics import ExitStatus
from ds4mlx.agent.redact import Redactor
from ds4mlx.agent.terminal import TerminalText


@dataclass(frozen=True)
class JobOutput:
    """New output of a job's two streams, each as a terminal shows it, secrets redacted."""

    stdout: str
    stderr: str

    def text(self) -> str:
        """stdout, then ``[stderr]`` and stderr when there is any (interleaving is lost)."""
        if not self.stderr:
            return self.stdout
        sep = "" if not self.stdout or self.stdout.endswith("\n") else "\n"
        return f"{self.stdout}{sep}[stderr]\n{self.stderr}"


#: A background job's deadline when its call sets none (s), and its output ceiling (bytes).
JOB_TIMEOUT = 3600.0
JOB_OUTPUT_LIMIT = 64 << 20

# The read(2) syscall number as /proc/PID/syscall shows it (Linux only; None elsewhere:
# a command blocked on its input is then not detected and runs into its timeout).
_READ_SYSCALL = {"x86_64": "0", "aarch64": "63", "arm64": "63"}.get(platform.machine())


def _group_pids(pgid: int) -> list[int]:
    """Pids of the live processes in process group ``pgid`` (from ``/proc``; [] without)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) "
        if len(fields) > 2 and int(fields[2]) == pgid:
            out.append(int(name))
    return out


# How long to wait for the pipes to close after the main process exited while something
# else of its group still lives: a command that leaves a background child holding stdout
# would otherwise block us forever.
_DRAIN_S = 0.5
# How long once the group is empty and the pipes have bytes or an end of file unread:
# they wait only for the reader threads to get the CPU (on a loaded machine a 0.5 s wait
# lost a foreground command's output and called it "left running"). Polled every _POLL_S.
_READERS_S = 10.0
_POLL_S = 0.05
# How long to wait for the exit after SIGKILL. It cannot be caught, so this is only the
# kernel tearing the group down and our reaper thread getting the CPU: far longer than a
# short kill grace on a loaded machine (a 0.3 s wait reported a killed job "still running").
_KILLED_S = 10.0


class _HeadTailBuffer:
    """Unread bytes: the first ``limit/2`` and the last ``limit/2`` once over ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = max(limit, 2)
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.overflow = False

    def append(self, data: bytes) -> None:
        if not self.overflow:
            self.head += data
            if len(self.head) <= self.limit:
                return
            half = self.limit // 2
            self.overflow = True
            data = bytes(self.head[half:])
            del self.head[half:]
        self.tail += data
        excess = len(self.tail) - self.limit // 2
        if excess > 0:
            self.dropped += excess
            del self.tail[:excess]

    def take(self) -> tuple[bytes, int, bytes]:
        out = bytes(self.head), self.dropped, bytes(self.tail)
        self.head.clear()
        self.tail.clear()
        self.dropped = 0
        self.overflow = False
        return out


class _Pipe:
    """One output pipe of a job: a reader thread, its bounded buffer, its terminal view.

    What :meth:`read_new` returns went through :class:`~ds4mlx.agent.terminal.
    TerminalText` (rendered as a terminal shows it) and :class:`~ds4mlx.agent.redact.
    Redactor` (secrets replaced), both kept across reads.
    """

    def __init__(
        self,
        name: str,
        stream: IO[bytes],
        buffer_bytes: int,
        on_bytes: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.name = name
        self._on_bytes = on_bytes
        self._stream = stream
        self._lock = threading.Lock()
        self.new = threading.Condition(self._lock)
        self._buf = _HeadTailBuffer(buffer_bytes)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._terminal = TerminalText()
        self._redactor = Redactor()
        self.eof = threading.Event()
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)

    def start(self) -> None:
        """Start the reader thread (its ``on_bytes`` may run at once, on that thread)."""
        self._thread.start()

    def _read(self) -> None:
        fd = self._stream.fileno()
        try:
            while True:
                data = os.read(fd, 65536)
                if not data:
                    break
                with self.new:
                    self._buf.append(data)
                    self.new.notify_all()
                self._on_bytes(len(data))
        except OSError:
            pass
        finally:
            self.eof.set()
            with self.new:
                self.new.notify_all()
            self._stream.close()

    def read_raw(self) -> tuple[str, bool]:
        """``(text since the last read, stream ended)``: decoded, dropped middle marked."""
        with self._lock:
            # Check EOF before taking: the reader sets it only after its last append.
            final = self.eof.is_set()
            head, dropped, tail = self._buf.take()
        if not dropped:
            return self._decoder.decode(head, final=final), final
        text = self._decoder.decode(head, final=True)
        self._decoder.reset()
        sep = "" if not text or text.endswith("\n") else "\n"
        marker = f"{sep}[… {dropped} bytes of output dropped …]\n"
        return text + marker + self._decoder.decode(tail, final=final), final

    def unread(self) -> bool:
        """True if the pipe holds bytes or an end of file its reader has not taken yet, or
        the reader closed it (it is just ending: ``eof`` is set)."""
        try:
            poller = select.poll()
            poller.register(self._stream.fileno(), select.POLLIN)
            return bool(poller.poll(0))  # POLLHUP too: every writer closed its end
        except (OSError, ValueError):  # closed
            return True

    def peek_tail(self, chars: int = 300) -> str:
        """The last ``chars`` characters of the unread output, not consumed (an input
        prompt to show the user); decoded with replacement, not rendered."""
        with self._lock:
            data = bytes(self._buf.tail or self._buf.head)
        return data.decode("utf-8", errors="replace")[-chars:]

    def read_new(self) -> str:
        """Output since the last read as a terminal shows it, secrets redacted.

        The line still being drawn (no newline yet) is shown too, and again, complete,
        by the read after it ends.
        """
        text, final = self.read_raw()
        out = self._redactor.feed(self._terminal.feed(text, final=final))
        pending = self._terminal.pending
        if pending and not final:
            out += self._redactor.peek(pending)
        return out


class Job:
    """One running (or finished) shell command.

    Args:
        handle: the id the model uses (``job_N``).
        command: the bash command line.
        cwd: working directory.
        timeout: seconds after which the job is stopped and marked ``timed_out``;
            None for no limit.
        buffer_bytes: cap on unread output kept between polls, per stream (head + tail).
        kill_grace: seconds between SIGTERM and SIGKILL when stopping.
        env: the whole environment of the command (default: :func:`child_env` with the
            default policy: names that look secret are withheld).
        output_limit: bytes of output (both streams, read or not) after which the job is
            stopped and marked ``output_limited``; None for no limit.
        pty_stdin: stdin is a pseudo-terminal the runtime owns (echo off, line mode), so a
            prompt such as ``read -p`` is shown and :meth:`answer` can reply; else
            stdin is ``/dev/null`` (end of file at once).

    Raises:
        OSError: bash could not be started.
    """

    def __init__(
        self,
        handle: str,
        command: str,
        cwd: Path,
        *,
        timeout: float | None = None,
        buffer_bytes: int = 1 << 20,
        kill_grace: float = 2.0,
        env: Mapping[str, str] | None = None,
        output_limit: int | None = None,
        pty_stdin: bool = False,
    ) -> None:
        self.handle = handle
        self.output_limit = output_limit
        self.output_limited = False
        self.output_bytes = 0
        # The model was told of the end (bash_status/bash_stop, or a notice): no notice.
        self.end_seen = False
        self._count_lock = threading.Lock()
        self.command = command
        self.kill_grace = kill_grace
        self.timeout = timeout
        self.timed_out = False
        self.stopped = False
        self.started = time.monotonic()
        self.ended: float | None = None
        self.status: ExitStatus | None = None
        self._master: int | None = None
        self._tty = ""
        stdin: int = subprocess.DEVNULL
        if pty_stdin:
            # The terminal keeps its default ECHO: a program that reads a secret turns it
            # off (``read -s``, getpass), which is how `input_hidden` tells. The echo of
            # an answer goes to the master side only (never into the job's output, which
            # is its pipes) and is drained there (`answer`).
            self._master, stdin = os.openpty()
            os.set_blocking(self._master, False)
            self._tty = os.ttyname(stdin)
        self._proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=cwd,
            env=dict(env) if env is not None else child_env(),
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Own process group: killpg reaches its children. With a pty as stdin, not
            # a new session: a session leader takes the pty as its controlling terminal,
            # and its exit would hang up (SIGHUP) what it leaves running.
            start_new_session=not pty_stdin,
            process_group=0 if pty_stdin else None,
        )
        self.pid = self._proc.pid
        if pty_stdin:
            os.close(stdin)  # the child holds the terminal side now
        self._exited = threading.Event()
        # We reap the child ourselves with os.wait4 (Popen's wait hides the core flag);
        # Popen is never asked to wait, so it cannot race this thread for the status.
        threading.Thread(target=self._reap, name=f"reap-{handle}", daemon=True).start()
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self.stdout = _Pipe(f"job-{handle}-out", self._proc.stdout, buffer_bytes, self._count)
        self.stderr = _Pipe(f"job-{handle}-err", self._proc.stderr, buffer_bytes, self._count)
        self._timer: threading.Timer | None = None
        if timeout is not None:
            self._timer = threading.Timer(timeout, self._on_timeout)
            self._timer.daemon = True
        # Readers start last: the first read may cross ``output_limit`` and stop the job
        # from another thread at once, and stop() needs the whole job built (a reader
        # started early let that stop run before ``_timer`` and ``stderr`` existed).
        self.stdout.start()
        self.stderr.start()
        if self._timer is not None:
            self._timer.start()

    def _reap(self) -> None:
        try:
            _, raw, _ = os.wait4(self.pid, 0)
        except ChildProcessError:  # pragma: no cover - reaped elsewhere: status unknown
            raw = 0
        self.status = ExitStatus.from_wait(raw)
        self.ended = time.monotonic()
        self._proc.returncode = self.status.returncode  # Popen must not wait for it again
        self._exited.set()

    # --- input (pty stdin) -----------------------------------------------------

    def reading_stdin(self) -> bool:
        """True if a process of the job's group is blocked in ``read`` on the job's
        terminal (Linux: ``/proc/PID/syscall`` is a read on fd 0, and fd 0 is that pty)."""
        if self._master is None or _READ_SYSCALL is None or not self.running:
            return False
        for pid in _group_pids(self.pid):
            try:
                with open(f"/proc/{pid}/syscall") as f:
                    fields = f.read().split()
                if (
                    fields[:2] == [_READ_SYSCALL, "0x0"]
                    and os.readlink(f"/proc/{pid}/fd/0") == self._tty
                ):
                    return True
            except (OSError, IndexError):
                continue
        return False

    def input_hidden(self) -> bool:
        """True if the job's terminal does not echo now: the reading program asks for a
        secret (``read -s``, a password prompt), so its answer must not show either."""
        if self._master is None:
            return False
        try:
            fd = os.open(self._tty, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            return not termios.tcgetattr(fd)[3] & termios.ECHO
        except termios.error:
            return False
        finally:
            os.close(fd)

    def answer(self, line: str | None) -> None:
        """Reply on the job's terminal: ``line`` and a newline, or end of file (None)."""
        if self._master is None:
            return
        # The previous answers' echo: nobody reads it, and a terminal whose output queue
        # is full may hold its input (Linux drops the echo instead; drained either way).
        self._drain_echo()
        data = b"\x04" if line is None else line.encode("utf-8", "replace") + b"\n"
        try:
            os.write(self._master, data)
        except OSError:
            pass  # the reader is gone

    def _drain_echo(self) -> None:
        """Discard what the terminal echoed to the master side (answers typed so far)."""
        assert self._master is not None
        with contextlib.suppress(OSError):  # EAGAIN: nothing (more); EIO: no reader left
            while os.read(self._master, 4096):
                pass

    def prompt_text(self) -> str:
        """The end of its unread stdout and stderr (what a prompt just printed)."""
        return (self.stdout.peek_tail() + self.stderr.peek_tail())[-300:]

    def _count(self, n: int) -> None:
        """A reader got ``n`` bytes: past ``output_limit``, stop the job (once, from
        another thread: the reader must keep draining while the group dies)."""
        with self._count_lock:
            self.output_bytes += n
            over = self.output_limit is not None and self.output_bytes > self.output_limit
            first = over and not self.output_limited
            self.output_limited = self.output_limited or over
        if first and self.running:
            threading.Thread(target=self.stop, name=f"limit-{self.handle}", daemon=True).start()

    # --- state -----------------------------------------------------------------

    @property
    def returncode(self) -> int | None:
        """Exit status (negative: killed by that signal), or None while running."""
        return self.status.returncode if self._exited.is_set() and self.status else None

    @property
    def running(self) -> bool:
        return not self._exited.is_set()

    @property
    def elapsed(self) -> float:
        """Seconds since start, until exit once it exited."""
        return (self.ended or time.monotonic()) - self.started

    @property
    def output_open(self) -> bool:
        """True if the process exited but something it started still holds its output."""
        return not self.running and not (self.stdout.eof.is_set() and self.stderr.eof.is_set())

    # --- output ----------------------------------------------------------------

    def read_new(self) -> JobOutput:
        """Output of both streams since the previous call (see :meth:`_Pipe.read_new`).

        If more than ``buffer_bytes`` of a stream accumulated, its middle is replaced by
        a ``[… N bytes of output dropped …]`` line.
        """
        return JobOutput(self.stdout.read_new(), self.stderr.read_new())

    # --- lifecycle -------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds for the job to exit; return its code or None.

        After the exit, waits briefly for the output pipes to close so the caller
        sees the complete output.
        """
        if not self._exited.wait(timeout):
            return None
        self._drain()
        return self.returncode

    def _drain(self) -> None:
        """After the exit, wait for both pipes' end of file: up to ``_DRAIN_S`` s while a
        process of the job's group lives or a pipe is silent but open (a process may hold
        it for ever), up to ``_READERS_S`` s while a pipe's bytes or end of file wait for
        a reader that has not had the CPU yet."""
        start = time.monotonic()
        for pipe in (self.stdout, self.stderr):
            while not pipe.eof.wait(_POLL_S):
                waited = time.monotonic() - start
                held = self._group_alive() or not pipe.unread()
                if waited >= _READERS_S or (waited >= _DRAIN_S and held):
                    return

    def _group_alive(self) -> bool:
        """True while any process of the job's group exists (signal 0 probes, portably)."""
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a member we may not signal still exists
            return True
        return True

    def stop(self, grace: float | None = None) -> int | None:
        """Stop the job's whole process group: SIGTERM, then SIGKILL after ``grace`` s, then
        up to ``_KILLED_S`` s for the killed leader to be reaped.

        Safe to call on a finished job (it still kills leftover children). Returns the
        exit code (negative signal number when killed), None if the process survived
        even SIGKILL (uninterruptible sleep).
        """
        grace = self.kill_grace if grace is None else grace
        if self._timer is not None:
            self._timer.cancel()
        if self.running:
            self.stopped = True
        self._signal(signal.SIGTERM)
        code = self.wait(grace)
        # Kill stragglers in the group even when the leader exited on SIGTERM.
        self._signal(signal.SIGKILL)
        if code is None:
            code = self.wait(max(grace, _KILLED_S))
        else:  # leftovers just died: let the readers see EOF
            self.wait(0)
        if self._master is not None and code is not None:
            os.close(self._master)
            self._master = None
        return code

    def _signal(self, sig: int) -> None:
        # The group id is the leader's pid; it cannot be reused while any member of
        # the group lives, and once the group is empty killpg fails with ESRCH.
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # group already gone

    def _on_timeout(self) -> None:
        if self.running:
            self.timed_out = True
            self.stop()


class JobManager:
    """Background jobs of one agent session, addressed by handle (``job_1``, ``job_2`` …).

    Args:
        buffer_bytes: cap on unread output per job, bytes.
        kill_grace: seconds between SIGTERM and SIGKILL when stopping.
        env_policy: which of the agent's environment variables commands get
            (:mod:`ds4mlx.agent.child_env`; default: names that look secret withheld).
        job_timeout: a background job's deadline when its call gives none, seconds
            (``--job-timeout``, default :data:`JOB_TIMEOUT`).
        output_limit: bytes a background job may print before it is stopped
            (``--job-output-limit-mb``, default :data:`JOB_OUTPUT_LIMIT`).
    """

    def __init__(
        self,
        *,
        buffer_bytes: int = 1 << 20,
        kill_grace: float = 2.0,
        env_policy: EnvPolicy | None = None,
        job_timeout: float = JOB_TIMEOUT,
        output_limit: int = JOB_OUTPUT_LIMIT,
    ) -> None:
        self.job_timeout = job_timeout
        self.output_limit = output_limit
        self.buffer_bytes = buffer_bytes
        self.kill_grace = kill_grace
        self.env_policy = env_policy or EnvPolicy()
        self._jobs: dict[str, Job] = {}
        self._ids = itertools.count(1)

    def start(
        self,
        command: str,
        cwd: Path,
        *,
        timeout: float | None = None,
        register: bool = True,
        pty_stdin: bool = False,
    ) -> Job:
        """Start ``command`` in ``cwd``; ``register=False`` for foreground runs (no handle kept);
        ``pty_stdin`` gives it a terminal as stdin (foreground runs, see `Job`).

        Raises:
            OSError: bash could not be started.
        """
        # Foreground runs get no number so the model's job handles stay job_1, job_2 …
        handle = f"job_{next(self._ids)}" if register else "foreground"
        job = Job(
            handle,
            command,
            cwd,
            timeout=timeout,
            buffer_bytes=self.buffer_bytes,
            kill_grace=self.kill_grace,
            env=child_env(self.env_policy),
            output_limit=self.output_limit if register else None,
            pty_stdin=pty_stdin,
        )
        if register:
            self._jobs[handle] = job
        return job

    def get(self, handle: str) -> Job:
        """The job with this handle.

        Raises:
            KeyError: unknown handle (message lists the known ones).
        """
        job = self._jobs.get(handle)
        if job is None:
            known = ", ".join(self._jobs) or "none"
            raise KeyError(f"unknown job handle {handle!r} (known: {known})")
        return job

    @property
    def jobs(self) -> list[Job]:
        """All background jobs of the session, oldest first (running or not)."""
        return list(self._jobs.values())

    def ended_unseen(self) -> list[Job]:
        """Background jobs that ended since the model last heard of them, oldest first;
        each is marked seen (a job's end is announced once)."""
        out = [j for j in self._jobs.values() if not j.running and not j.end_seen]
        for j in out:
            j.end_seen = True
        return out

    def stop_all(self) -> None:
        """Stop every job that is still running (session end)."""
        for job in self._jobs.values():
            if job.running:
                job.stop()
