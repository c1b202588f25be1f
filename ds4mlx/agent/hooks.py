"""Response hooks: user commands run around every assistant response, observe only.

``--before-response-hook CMD`` runs before the model generates a response and
``--after-response-hook CMD`` after it (a response that makes tool calls counts; a
user message with three tool rounds has four responses). Each run is ``bash -c CMD``
in the workspace, in its own process group, with the environment of
:func:`~ds4mlx.agent.child_env.child_env` (secret-looking names withheld like for
commands) and one JSON object on stdin:

``event`` (``before_response`` / ``after_response``), ``model`` (the checkpoint's
directory name), ``user_text`` (the user message this response answers),
``response_text`` (after only: the visible text, reasoning excluded),
``response_index`` (0-based, counted over the agent's life), ``generated_tokens``
(after: tokens of this response; before: 0), ``interrupted`` (after: the user
stopped it), ``tool_call`` (after: the response made tool calls) and ``tool_calls``
(after: ``[{"id", "name", "arguments"}]``).

Hooks observe: their stdout is discarded and nothing they do changes the turn. A hook
that fails (exit status not 0, cannot start) or outlives ``--hook-timeout`` seconds
(its process group is killed) gets one warning on stderr; the turn goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds4mlx.agent.child_env import EnvPolicy, child_env
from ds4mlx.sanitize import escape_controls

DEFAULT_TIMEOUT = 10.0
MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 3600.0
BEFORE, AFTER = "before_response", "after_response"
_STDERR_TAIL = 300  # characters of a failing hook's stderr quoted in the warning
_DRAIN_S = 2.0  # after the kill, how long its stderr may stay open before we stop reading


def _stderr_warning(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


@dataclass
class Hooks:
    """The configured response hooks.

    Attributes:
        before: command for ``before_response``, or None.
        after: command for ``after_response``, or None.
        timeout: seconds a hook may run (1–3600) before its group is killed.
        cwd: directory hooks run in (the workspace).
        env_policy: the environment they get (:mod:`ds4mlx.agent.child_env`).
        warn: where failures are reported (default: one ``warning:`` line on stderr).
    """

    before: str | None = None
    after: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    cwd: Path | None = None
    env_policy: EnvPolicy | None = None
    warn: Callable[[str], None] = _stderr_warning

    def __post_init__(self) -> None:
        if not MIN_TIMEOUT <= self.timeout <= MAX_TIMEOUT:
            raise ValueError(
                f"--hook-timeout must be within {MIN_TIMEOUT:g}..{MAX_TIMEOUT:g} s, "
                f"got {self.timeout:g}"
            )

    @property
    def active(self) -> bool:
        return bool(self.before or self.after)

    def fire(self, event: str, payload: dict[str, Any]) -> None:
        """Run the hook for ``event`` (if configured) with ``{"event": event, **payload}``.

        Never raises for the hook's behaviour; returns when it exited or was killed.
        """
        cmd = self.before if event == BEFORE else self.after
        if not cmd:
            return
        data = json.dumps({"event": event, **payload}, ensure_ascii=False).encode()
        try:
            proc = subprocess.Popen(
                ["bash", "-c", cmd],
                cwd=self.cwd,
                env=child_env(self.env_policy),
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a timeout kills what the hook started, too
            )
        except OSError as e:
            self.warn(f"{event} hook could not start: {e}")
            return
        try:
            _, err = proc.communicate(data, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            try:
                proc.communicate(timeout=_DRAIN_S)
            except subprocess.TimeoutExpired:
                # A process the hook started in a session of its own escaped the kill and
                # holds stderr open: stop reading (the hook itself is dead) rather than
                # wait for it forever.
                proc.stderr.close()  # type: ignore[union-attr]
                proc.wait()
            self.warn(f"{event} hook killed after {self.timeout:g} s (--hook-timeout)")
            return
        if proc.returncode != 0:
            tail = escape_controls(err.decode("utf-8", "replace").strip()[-_STDERR_TAIL:])
            self.warn(
                f"{event} hook exited with status {proc.returncode}" + (f": {tail}" if tail else "")
            )


def fire_response(agent: Any, event: str, gen: Any = None, msg: Any = None) -> None:
    """Fire ``agent.hooks`` (if any) for ``event`` with :func:`response_payload`."""
    hooks = agent.hooks
    if hooks is not None and hooks.active:
        hooks.fire(event, response_payload(agent, gen, msg))


def response_payload(agent: Any, gen: Any = None, msg: Any = None) -> dict[str, Any]:
    """The JSON fields of one response (module docstring) from an agent loop's state.

    Args:
        agent: the agent's ``ds4mlx.agent.steps.Steps`` (its live engine, the user text,
            the response counter).
        gen: the generated turn (``Generated``), None before the response.
        msg: the transcript message of the response (``Message``), None before it.
    """
    payload: dict[str, Any] = {
        "model": agent.live.engine.path.name,
        "user_text": agent.user_text,
        "response_index": agent.responses,
        "generated_tokens": gen.tokens if gen else 0,
        "interrupted": bool(gen and gen.stop == "interrupted"),
        "tool_call": bool(msg and msg.tool_calls),
    }
    if msg is not None:
        payload["response_text"] = msg.content or ""
        payload["tool_calls"] = [
            {"id": c.id, "name": c.name, "arguments": c.arguments} for c in msg.tool_calls
        ]
    return payload


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
