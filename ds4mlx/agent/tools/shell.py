"""Shell tools: ``bash`` (foreground or background job), ``bash_status``, ``bash_stop``.

Processes are :class:`~ds4mlx.agent.tools.background.Job` objects (own process group, bounded
output buffer). ``bash`` returns a :class:`~ds4mlx.agent.tools.common.Proposal`: the
command runs only after the dispatcher got permission. Times are in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from ds4mlx.agent.diagnostics import diagnose
from ds4mlx.agent.terminal import clean_terminal_output
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

# clean_terminal_output lives in agent/terminal.py; its old import path stays.
__all__ = ["BASH_STATUS_SPEC", "BASH_STOP_SPEC", "ShellTools", "bash_spec", "clean_terminal_output"]

MAX_RUNNING_JOBS = 16
# How much of a denied command the model is told (the denial names the call).
DENIED_COMMAND_CHARS = 200

_HANDLE = {"type": "string", "description": 'Job handle, e.g. "job_1".'}


def bash_spec(default_timeout: float | None = None) -> ToolSpec:
    """The ``bash`` tool; its ``timeout`` description states ``default_timeout`` if given."""
    default = f"{default_timeout:g}" if default_timeout is not None else "the agent's setting"
    return ToolSpec(
        "bash",
        "Run a bash command in the workspace directory (output shown as a terminal would, "
        "stdout then stderr after a [stderr] line, secrets redacted; a foreground command "
        "that reads its input asks the user, a background one gets end of file). Foreground commands are stopped after timeout seconds; processes they "
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
                    f"default: {default}; background default: the agent's job timeout "
                    "(raise it, up to 86400, for servers).",
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


class ShellTools:
    """``bash``, ``bash_status`` and ``bash_stop`` for commands run in ``cwd``.

    Args:
        cwd: the workspace root; every command runs there.
        jobs: the session's jobs (background ones are addressed by handle).
        default_timeout: foreground ``bash`` timeout when the call gives none, seconds.
        ask_input: ``f(command, prompt_text, hidden) -> line | None`` when a foreground
            command waits for input on its terminal (``hidden``: it turned echo off, as
            for a password): the user's line answers it, None sends end of file,
            KeyboardInterrupt stops it. None (``-p``): end of file, said in the
            result. The time spent asking does not count toward the timeout.
        on_running: ``f()`` once a foreground command started (its permission given):
            the terminal says it runs and how to stop it, as its output comes only
            with its result.
    """

    def __init__(
        self,
        cwd: Path,
        jobs: JobManager,
        default_timeout: float,
        ask_input: Callable[[str, str, bool], str | None] | None = None,
        on_running: Callable[[], None] | None = None,
    ) -> None:
        self.cwd = cwd
        self.jobs = jobs
        self.default_timeout = default_timeout
        self.ask_input = ask_input
        self.on_running = on_running

    def bash(self, a: dict[str, Any]) -> Proposal:
        command: str = a["command"]
        background: bool = a["background"]
        timeout = a.get("timeout")
        if timeout is None:
            timeout = self.jobs.job_timeout if background else self.default_timeout
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
            # The handle, not the pid: `kill PID` would orphan the rest of its group.
            f"started background job {job.handle} ({limit}). Poll it with "
            f'bash_status handle="{job.handle}"; stop it (its whole process group) with '
            "bash_stop; you are told when it ends.",
            job=job.handle,
        )

    def _wait_answering(self, job: Job, command: str, timeout: float) -> tuple[int | None, str]:
        """Wait up to ``timeout`` s for ``job``, answering its input prompts (see the
        class doc); ``(exit code or None on timeout, note on what its input got)``."""
        deadline = time.monotonic() + timeout
        blocked, got = 0, []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, ""
            code = job.wait(min(left, 0.1))
            if code is None and not job.running:  # it exited just after that wait gave up
                code = job.wait(0)
            if code is not None:
                return code, ("[stdin: " + "; ".join(got) + "]") if got else ""
            # Blocked twice in a row: a read that just started may be answered by itself.
            blocked = blocked + 1 if job.reading_stdin() else 0
            if blocked < 2:
                continue
            blocked = 0
            if self.ask_input is None:
                job.answer(None)
                got.append("it read its input and got end of file (no terminal to ask)")
                continue
            t0 = time.monotonic()
            line = self.ask_input(command, job.prompt_text(), job.input_hidden())
            deadline += time.monotonic() - t0
            job.answer(line)
            got.append(
                "the user answered its input" if line is not None else "the user sent end of file"
            )

    def _foreground(self, command: str, timeout: float) -> Result:
        job = self.jobs.start(command, self.cwd, register=False, pty_stdin=True)
        if self.on_running is not None:
            self.on_running()
        try:
            code, stdin_note = self._wait_answering(job, command, timeout)
        except BaseException:  # Ctrl+C in the agent: do not leave the command running
            job.stop()
            raise
        if code is None:
            job.stop()
            out = job.read_new()
            return Result(
                out.text() or "(no output)",
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
        out = job.read_new()
        exit_status = job.status
        assert exit_status is not None  # the job exited
        status = exit_status.describe() + f" · {job.elapsed:.1f} s"
        if leftovers:
            status += " · processes it left running were stopped (use background=true for those)"
        if stdin_note:
            status += f"]\n{stdin_note[:-1]}"
        return Result(
            out.text() or "(no output)",
            ok=exit_status.ok,
            error=None if exit_status.ok else EXIT_STATUS,
            before="" if exit_status.ok else "\n".join(diagnose(out.stdout, out.stderr, self.cwd)),
            after=f"[{status}]",
        )

    def status(self, a: dict[str, Any]) -> Result:
        job = self._job(a["handle"])
        if a["wait"] > 0 and job.running:
            job.wait(a["wait"])
        # The state first, then the output: a job seen ended is drained before the read
        # (read first, a job that ended meanwhile was reported, once, without its end).
        ended = not job.running
        if ended:
            job.wait(0)
        out = job.read_new()
        status, ok, err = _job_status(job, ended)
        job.end_seen = job.end_seen or ended
        before = "" if ok else "\n".join(diagnose(out.stdout, out.stderr, self.cwd))
        return Result(
            out.text() or "(no new output)", ok=ok, error=err, before=before, after=status
        )

    def stop(self, a: dict[str, Any]) -> Result:
        job = self._job(a["handle"])
        was_running = job.running
        job.stop()
        output = job.read_new().text()
        job.end_seen = True
        status, ok, err = _job_status(job)
        if not was_running:
            status = status[:-1] + "; it had already ended]"
            ok, err = True, None
        return Result(output or "(no new output)", ok=ok, error=err, after=status)

    def notice(self, job: Job, last_lines: int = 10) -> tuple[str, str]:
        """``(outcome, detail)`` of an ended job for its late result: ``job_1 exited 0
        after 2.0 s``; the diagnostic (when it failed) and the last lines of its unread
        output."""
        job.wait(0)  # let the readers see EOF
        out = job.read_new()
        status, ok, _ = _job_status(job)
        st = job.status
        if st is not None and ok and not job.stopped:
            outcome = f"{job.handle} exited {st.returncode} after {job.elapsed:.1f} s"
        else:
            outcome = status.strip("[]")
        lines = out.text().rstrip("\n").splitlines()
        tail = lines[-last_lines:]
        if len(lines) > len(tail):
            tail.insert(0, f"[… {len(lines) - len(tail)} earlier lines …]")
        diag = [] if ok else diagnose(out.stdout, out.stderr, self.cwd)
        return outcome, "\n".join(diag + tail)

    def _job(self, handle: str) -> Job:
        try:
            return self.jobs.get(handle)
        except KeyError as exc:
            raise ToolError(NOT_FOUND, exc.args[0]) from None


def _job_status(job: Job, ended: bool | None = None) -> tuple[str, bool, str | None]:
    """``([status line], ok, error kind)`` of a background job; ``ended``: its state as the
    caller saw it (default: now)."""
    st = job.status
    h = job.handle
    if ended is None:
        ended = not job.running
    if not ended or st is None:
        return f"[{h} still running after {job.elapsed:.0f} s]", True, None
    if job.output_limited:
        return (
            f"[{h} stopped: output limit ({(job.output_limit or 0) / 2**20:g} MiB) reached "
            f"after {job.elapsed:.1f} s]",
            False,
            FAILED,
        )
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
        f"[{h} finished: {st.describe()} after {job.elapsed:.1f} s]",
        st.ok,
        (None if st.ok else EXIT_STATUS),
    )
