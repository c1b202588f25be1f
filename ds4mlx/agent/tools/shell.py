"""Shell tools: ``bash`` (foreground or background job), ``bash_status``, ``bash_stop``.

Processes are :class:`~ds4mlx.agent.tools.background.Job` objects (own process group, bounded
output buffer). ``bash`` returns a :class:`~ds4mlx.agent.tools.common.Proposal`: the
command runs only after the dispatcher got permission. Times are in seconds.
"""

from __future__ import annotations

import re
import signal
from functools import partial
from pathlib import Path
from typing import Any

from ds4mlx.agent.sanitize import escape_controls
from ds4mlx.agent.tools.background import Job, JobManager
from ds4mlx.agent.tools.common import (
    EXIT_STATUS,
    FAILED,
    NOT_FOUND,
    TIMEOUT,
    Proposal,
    Result,
    ToolError,
    cap,
)
from ds4mlx.agent.tools.schema import object_schema
from ds4mlx.dsml.conversation import ToolSpec

MAX_RUNNING_JOBS = 16
# How much of a denied command the model is told (the denial names the call).
DENIED_COMMAND_CHARS = 200

_HANDLE = {"type": "string", "description": 'Job handle, e.g. "job_1".'}


def bash_spec(default_timeout: float | None = None) -> ToolSpec:
    """The ``bash`` tool; its ``timeout`` description states ``default_timeout`` if given."""
    default = f"{default_timeout:g}" if default_timeout is not None else "the agent's setting"
    return ToolSpec(
        "bash",
        "Run a bash command in the workspace directory (stdin closed, stderr merged into "
        "stdout). Foreground commands are stopped after timeout seconds; processes they "
        "leave running are stopped when they exit. For servers, watchers or anything "
        "long, set background=true: you get a job handle to poll with bash_status and "
        "stop with bash_stop.",
        object_schema(
            {
                "command": {"type": "string", "minLength": 1, "description": "Bash command line."},
                "timeout": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "maximum": 86400,
                    "description": "Seconds before the command is stopped. Foreground "
                    f"default: {default}; background default: no limit.",
                },
                "background": {
                    "type": "boolean",
                    "default": False,
                    "description": "Start it as a background job and return its handle at once.",
                },
            },
            ["command"],
        ),
    )


BASH_STATUS_SPEC = ToolSpec(
    "bash_status",
    "Poll a background job: its output since the previous poll, and whether it is "
    "still running or its exit code.",
    object_schema(
        {
            "handle": _HANDLE,
            "wait": {
                "type": "number",
                "minimum": 0,
                "maximum": 600,
                "default": 0,
                "description": "Seconds to wait for the job to finish before reporting "
                "(returns as soon as it exits).",
            },
        },
        ["handle"],
    ),
)

BASH_STOP_SPEC = ToolSpec(
    "bash_stop",
    "Stop a background job (its whole process group) and return its remaining output.",
    object_schema({"handle": dict(_HANDLE)}, ["handle"]),
)

# Escape sequences (ECMA-48), each in its 7-bit (ESC …) and 8-bit (C1) spelling:
# CSI (colours, cursor moves): ESC [ or \x9b, parameters, intermediates, final byte;
# strings (OSC titles, links and clipboard; DCS, SOS, PM, APC): ESC ] P X ^ _ or
# \x9d \x90 \x98 \x9e \x9f, up to BEL or ST (ESC \ or \x9c);
# nF (charset selection ESC ( 0, ESC # 8): ESC, intermediates, final byte;
# the two-byte rest (ESC 7/8 save/restore cursor, ESC c reset, ESC M, ESC =).
_ANSI_RE = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"
    r"|\x1b[ -/]+[0-~]"
    r"|\x1b[0-~]"
)


def clean_terminal_output(text: str) -> str:
    """What a terminal shows of ``text``, as plain text: no escape sequence, no control.

    Escape sequences are removed, carriage returns applied (progress bars redraw a line
    with ``\\r`` hundreds of times; only the last state of each line is worth tokens),
    and any control character left (a lone ``ESC``, an unterminated OSC, BEL,
    backspace) is written as a ``\\xNN`` escape by
    :func:`~ds4mlx.agent.sanitize.escape_controls`. ``\\n`` and ``\\t`` stay.
    """
    text = _ANSI_RE.sub("", text).replace("\r\n", "\n")
    if "\r" in text:
        text = "\n".join(
            line.rsplit("\r", 1)[-1] if "\r" in line else line for line in text.split("\n")
        )
    return escape_controls(text)


class ShellTools:
    """``bash``, ``bash_status`` and ``bash_stop`` for commands run in ``cwd``.

    Args:
        cwd: the workspace root; every command runs there.
        jobs: the session's jobs (background ones are addressed by handle).
        default_timeout: foreground ``bash`` timeout when the call gives none, seconds.
    """

    def __init__(self, cwd: Path, jobs: JobManager, default_timeout: float) -> None:
        self.cwd = cwd
        self.jobs = jobs
        self.default_timeout = default_timeout

    def bash(self, a: dict[str, Any]) -> Proposal:
        command: str = a["command"]
        background: bool = a["background"]
        timeout = a.get("timeout")
        if not background and timeout is None:
            timeout = self.default_timeout
        limit = f"timeout {timeout:g} s" if timeout is not None else "no timeout"
        mode = "background job" if background else "foreground"
        short = " ⏎ ".join(ln.strip() for ln in command.strip().splitlines() if ln.strip())
        if len(short) > DENIED_COMMAND_CHARS:
            short = short[: DENIED_COMMAND_CHARS - 1] + "…"
        if background:
            apply = partial(self._background, command, timeout, limit)
        else:
            apply = partial(self._foreground, command, timeout)
        return Proposal(
            f"run ({mode}, {limit}) in {self.cwd}:\n{cap(command)}", apply, f"{mode}: {short}"
        )

    def _background(self, command: str, timeout: float | None, limit: str) -> Result:
        running = [j.handle for j in self.jobs.jobs if j.running]
        if len(running) >= MAX_RUNNING_JOBS:
            raise ToolError(
                FAILED,
                f"too many background jobs running ({', '.join(running)}); "
                "stop one with bash_stop first",
            )
        job = self.jobs.start(command, self.cwd, timeout=timeout)
        return Result(
            f"started background job {job.handle} (pid {job.pid}, {limit}). Poll it with "
            f'bash_status handle="{job.handle}"; stop it with bash_stop.',
            job=job.handle,
        )

    def _foreground(self, command: str, timeout: float) -> Result:
        job = self.jobs.start(command, self.cwd, register=False)
        try:
            code = job.wait(timeout)
        except BaseException:  # Ctrl+C in the agent: do not leave the command running
            job.stop()
            raise
        if code is None:
            job.stop()
            return Result(
                _drain(job) or "(no output)",
                ok=False,
                error=TIMEOUT,
                before=(
                    f"error: timed out after {timeout:g} s; outcome unknown — the command may "
                    "have had partial effects. It was stopped (process group killed) and not "
                    "retried. Check the state before running it again; use background=true "
                    "for long commands. Output before the timeout:"
                ),
            )
        leftovers = job.output_open
        # Stop whatever the command left running in its process group (see tool doc).
        job.stop(grace=0.2)
        output = _drain(job)
        status = _exit_text(code) + f" · {job.elapsed:.1f} s"
        if leftovers:
            status += " · processes it left running were stopped (use background=true for those)"
        return Result(
            output or "(no output)",
            ok=code == 0,
            error=None if code == 0 else EXIT_STATUS,
            after=f"[{status}]",
        )

    def status(self, a: dict[str, Any]) -> Result:
        job = self._job(a["handle"])
        if a["wait"] > 0 and job.running:
            job.wait(a["wait"])
        output = _drain(job)
        status, ok, err = _job_status(job)
        return Result(output or "(no new output)", ok=ok, error=err, after=status)

    def stop(self, a: dict[str, Any]) -> Result:
        job = self._job(a["handle"])
        was_running = job.running
        job.stop()
        output = _drain(job)
        status, ok, err = _job_status(job)
        if not was_running:
            status = status[:-1] + "; it had already ended]"
            ok, err = True, None
        return Result(output or "(no new output)", ok=ok, error=err, after=status)

    def _job(self, handle: str) -> Job:
        try:
            return self.jobs.get(handle)
        except KeyError as exc:
            raise ToolError(NOT_FOUND, exc.args[0]) from None


def _drain(job: Job) -> str:
    """The job's output since the last read, as a terminal would show it."""
    return clean_terminal_output(job.read_new())


def _job_status(job: Job) -> tuple[str, bool, str | None]:
    """``([status line], ok, error kind)`` of a background job."""
    code = job.returncode
    h = job.handle
    if code is None:
        return f"[{h} still running after {job.elapsed:.0f} s]", True, None
    if job.timed_out:
        return (
            f"[{h} timed out after {job.timeout:g} s and was stopped; outcome unknown — "
            "it may have had partial effects]",
            False,
            TIMEOUT,
        )
    if job.stopped:
        return f"[{h} stopped by bash_stop after {job.elapsed:.1f} s]", True, None
    return (
        f"[{h} finished: {_exit_text(code)} after {job.elapsed:.1f} s]",
        code == 0,
        (None if code == 0 else EXIT_STATUS),
    )


def _exit_text(code: int) -> str:
    """``exit code 2`` or ``killed by signal SIGTERM`` for a (negative = signal) status."""
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
