"""The agent's tools: definitions for the model and the dispatcher that runs them.

:class:`Toolbox` is what the agent loop calls. It offers the tools as
:class:`~ds4mlx.dsml.conversation.ToolSpec` (JSON-schema parameters, rendered into
the prompt by ``dsml``) and runs a parsed call with :meth:`Toolbox.run`, which never
raises for anything the model did wrong: unknown tools, schema-invalid arguments,
paths outside the workspace, denied permissions, failing or timed-out commands
all come back as a :class:`ToolOutcome` with ``ok=False`` and an ``error: …`` text
the model can act on.

Every output is shaped to a token budget (:mod:`ds4mlx.agent.shaping`): head and
tail kept, the cut marked with a handle for the ``more`` tool.

Tools: ``read``, ``more``, ``write``, ``edit``, ``list``, ``search``, ``bash``,
``bash_status``, ``bash_stop``. Lines are ``\\n``-separated and 1-based everywhere.

Layout: the tool families live in :mod:`~ds4mlx.agent.tools.files` (read, write,
edit, list), :mod:`~ds4mlx.agent.tools.search` and :mod:`~ds4mlx.agent.tools.shell`
(bash and its jobs); what they share (error kinds, :class:`ToolError`, results,
workspace paths) in :mod:`~ds4mlx.agent.tools.common`; schema messages in
:mod:`~ds4mlx.agent.tools.schema`. Validation, permission, error mapping and output
shaping happen here, once for every tool.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from ds4mlx.agent.child_env import EnvPolicy
from ds4mlx.agent.mcp import McpClient
from ds4mlx.agent.permissions import PathOutsideWorkspace, Permissions
from ds4mlx.agent.redact import redact
from ds4mlx.agent.shaping import CountTokens, OutputStore, approx_tokens
from ds4mlx.agent.tools import schema as tool_schema
from ds4mlx.agent.tools.background import JOB_OUTPUT_LIMIT, JOB_TIMEOUT, JobManager
from ds4mlx.agent.tools.common import (
    EXIT_STATUS,
    FAILED,
    INVALID_ARGUMENTS,
    NOT_FOUND,
    PATH_OUTSIDE_WORKSPACE,
    PERMISSION_DENIED,
    TIMEOUT,
    UNKNOWN_TOOL,
    Proposal,
    Result,
    ToolError,
    Workspace,
)
from ds4mlx.agent.tools.files import EDIT_SPEC, LIST_SPEC, READ_SPEC, WRITE_SPEC, FileTools
from ds4mlx.agent.tools.search import SEARCH_SPEC, search
from ds4mlx.agent.tools.shell import (
    BASH_STATUS_SPEC,
    BASH_STOP_SPEC,
    ShellTools,
    bash_spec,
    clean_terminal_output,
)
from ds4mlx.dsml.conversation import ToolSpec
from ds4mlx.sanitize import valid_unicode

__all__ = [
    "EXIT_STATUS",
    "FAILED",
    "INVALID_ARGUMENTS",
    "NOT_FOUND",
    "PATH_OUTSIDE_WORKSPACE",
    "PERMISSION_DENIED",
    "TIMEOUT",
    "TOOL_SPECS",
    "UNKNOWN_TOOL",
    "ToolError",
    "ToolOutcome",
    "Toolbox",
    "clean_terminal_output",
]

MORE_SPEC = ToolSpec(
    "more",
    "Read the part of a long tool output that was cut. Each call returns the next "
    "chunk of the output named by handle (from a note like "
    '[… cut …; call more with handle="out_3"]); line jumps to a given line.',
    tool_schema.object_schema(
        {
            "handle": {"type": "string", "description": 'Output handle, e.g. "out_3".'},
            "line": {
                "type": "integer",
                "minimum": 1,
                "description": "Optional 1-based line of the full output to continue from.",
            },
        },
        ["handle"],
    ),
)

#: The tools in the order the model sees them (``bash`` with the generic default).
TOOL_SPECS: list[ToolSpec] = [
    READ_SPEC,
    MORE_SPEC,
    WRITE_SPEC,
    EDIT_SPEC,
    LIST_SPEC,
    SEARCH_SPEC,
    bash_spec(),
    BASH_STATUS_SPEC,
    BASH_STOP_SPEC,
]


@dataclass(frozen=True)
class ToolOutcome:
    """The result of one tool call, ready to hand back to the model.

    Attributes:
        ok: True if the tool did what was asked (for ``bash``: exit code 0).
        text: what the model sees; within the token budget. Errors start with
            ``error:``.
        error: None on success, else one of ``unknown_tool``, ``invalid_arguments``,
            ``path_outside_workspace``, ``permission_denied``, ``not_found``,
            ``timeout``, ``exit_status`` (command ran, non-zero exit), ``failed``.
        handle: the ``more`` handle when part of the output was cut, else None.
        job: the background job handle started by ``bash`` with ``background=true``.
    """

    ok: bool
    text: str
    error: str | None = None
    handle: str | None = None
    job: str | None = None


Handler = Callable[[dict[str, Any]], Result | Proposal]


@dataclass
class _Tool:
    spec: ToolSpec
    fn: Handler
    validator: Draft202012Validator = field(repr=False)


class Toolbox:
    """The agent's tools bound to one workspace and one permission state.

    Args:
        workspace: root directory every path must resolve inside; bash runs there.
        permissions: decides write/edit/bash (see :mod:`ds4mlx.agent.permissions`).
        output_token_budget: tokens one tool result may take (notes included). >= 64.
        count_tokens: ``str -> int`` token counter; defaults to chars/4.
        bash_timeout: default foreground ``bash`` timeout, seconds.
        kill_grace: seconds between SIGTERM and SIGKILL when stopping a command.
        job_buffer_bytes: unread output kept per command between polls, bytes
            (head and tail; the middle is dropped beyond it).
        env_policy: the environment commands get (:mod:`ds4mlx.agent.child_env`;
            default: names that look secret withheld).
        mcp: a started :class:`~ds4mlx.agent.mcp.McpClient`; its tools are offered after
            the built-in ones (:meth:`close` closes it).
        job_timeout: a background job's deadline when its call gives none, seconds.
        job_output_limit: bytes a background job may print before it is stopped.
        ask_input: answers a foreground command's input prompt (``ShellTools``); None
            gives it end of file.
        on_running: called as a foreground command starts (``ShellTools``).

    Raises:
        ValueError: ``workspace`` is not a directory, or the budget is below 64.

    Call :meth:`close` (or use it as a context manager) to stop background jobs.
    """

    def __init__(
        self,
        workspace: Path,
        permissions: Permissions,
        *,
        output_token_budget: int = 4096,
        count_tokens: CountTokens = approx_tokens,
        bash_timeout: float = 120.0,
        kill_grace: float = 2.0,
        job_buffer_bytes: int = 1 << 20,
        env_policy: EnvPolicy | None = None,
        mcp: McpClient | None = None,
        job_timeout: float = JOB_TIMEOUT,
        job_output_limit: int = JOB_OUTPUT_LIMIT,
        ask_input: Callable[[str, str, bool], str | None] | None = None,
        on_running: Callable[[], None] | None = None,
    ) -> None:
        root = Path(workspace).resolve()
        if not root.is_dir():
            raise ValueError(f"workspace {workspace} is not a directory")
        self.workspace = root
        self.permissions = permissions
        self.count_tokens = count_tokens
        self.bash_timeout = bash_timeout
        self.outputs = OutputStore(output_token_budget, count_tokens)
        self.jobs = JobManager(
            buffer_bytes=job_buffer_bytes,
            kill_grace=kill_grace,
            env_policy=env_policy,
            job_timeout=job_timeout,
            output_limit=job_output_limit,
        )
        self._ws = Workspace(root)
        self._files = files = FileTools(self._ws)
        self._shell = shell = ShellTools(root, self.jobs, bash_timeout, ask_input, on_running)
        handlers: dict[str, Handler] = {
            "read": files.read,
            "more": self._more,
            "write": files.write,
            "edit": files.edit,
            "list": files.list_paths,
            "search": partial(search, self._ws),
            "bash": shell.bash,
            "bash_status": shell.status,
            "bash_stop": shell.stop,
        }
        self._tools: dict[str, _Tool] = {}
        for spec in TOOL_SPECS:
            if spec.name == "bash":  # tell the model the real default
                spec = bash_spec(bash_timeout)
            spec = copy.deepcopy(spec)
            self._tools[spec.name] = _Tool(
                spec, handlers[spec.name], Draft202012Validator(spec.parameters)
            )
        self.mcp = mcp
        for tool in mcp.tools.values() if mcp is not None else ():
            spec = copy.deepcopy(tool.spec)
            self._tools[spec.name] = _Tool(
                spec, partial(self._mcp_call, spec.name), Draft202012Validator(spec.parameters)
            )

    # --- public API ------------------------------------------------------------

    @property
    def specs(self) -> list[ToolSpec]:
        """The tool definitions to offer the model (``Conversation.tools``); copies."""
        return [copy.deepcopy(t.spec) for t in self._tools.values()]

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    @property
    def budget(self) -> int:
        """Output token budget per tool result."""
        return self.outputs.budget

    def run(self, name: str, arguments: Any) -> ToolOutcome:
        """Validate and run one tool call; never raises for the model's mistakes.

        Args:
            name: tool name as the model called it.
            arguments: the decoded JSON arguments (should be a dict).

        Returns:
            A :class:`ToolOutcome`; ``text`` fits the output token budget.

        Raises:
            KeyboardInterrupt: propagated (a running foreground command is stopped
                first); so is anything the permission callback raises.
        """
        tool = self._tools.get(name)
        if tool is None:
            close = difflib.get_close_matches(str(name), self._tools, n=1)
            return self._error(
                UNKNOWN_TOOL,
                tool_schema.unknown_tool_text(name, list(self._tools), close[0] if close else None),
            )
        problems = tool_schema.problems(tool.validator, arguments)
        if problems:
            return self._error(
                INVALID_ARGUMENTS,
                tool_schema.invalid_arguments_text(name, tool.spec.parameters, problems),
            )
        args = tool_schema.with_defaults(tool.spec.parameters, arguments)
        step = self._guarded(name, partial(tool.fn, args))
        if isinstance(step, Proposal):
            denied = self._confirm(name, step)
            step = denied or self._guarded(name, step.apply)
        if isinstance(step, ToolOutcome):
            return step
        return self._finish(step)

    def already_applied(self, name: str, arguments: Any) -> ToolOutcome | None:
        """For a ``write``/``edit`` repeating one of unknown outcome: an ``ok`` outcome
        saying "already applied" when the file shows it in effect (nothing asked, nothing
        written), else None (run it normally). Invalid calls and other tools: None."""
        tool = self._tools.get(name)
        if name not in ("write", "edit") or tool is None:
            return None
        if tool_schema.problems(tool.validator, arguments):
            return None
        args = tool_schema.with_defaults(tool.spec.parameters, arguments)
        step = self._guarded(name, partial(self._files.applied, name, args))
        return ToolOutcome(True, step) if isinstance(step, str) else None

    def job_notices(self) -> list[tuple[str, str, str]]:
        """``(handle, outcome, detail)`` for each background job that ended since the
        model last heard of it (once each; not after bash_status/bash_stop saw the end);
        the detail is redacted and within the output budget."""
        out = []
        for job in self.jobs.ended_unseen():
            outcome, detail = self._shell.notice(job)
            out.append((job.handle, outcome, self.outputs.shape(detail).text if detail else ""))
        return out

    def describe(self, name: str, arguments: Any) -> str:
        """One-line human summary of a call, for the UI (``read path=a.py offset=3``)."""
        return tool_schema.describe_call(name, arguments)

    def close(self) -> None:
        """Stop all background jobs still running; close the MCP connections."""
        self.jobs.stop_all()
        if self.mcp is not None:
            self.mcp.close()

    def __enter__(self) -> Toolbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- dispatch --------------------------------------------------------------

    def _guarded(
        self, name: str, fn: Callable[[], Result | Proposal]
    ) -> Result | Proposal | ToolOutcome:
        """Call ``fn``; what it raises for a bad call becomes an error outcome.

        Only KeyboardInterrupt and SystemExit pass through: a bug in a tool must not
        kill the agent loop, it is reported to the model as ``failed``.
        """
        try:
            return fn()
        except PathOutsideWorkspace as exc:
            return self._error(
                PATH_OUTSIDE_WORKSPACE, f"{exc}; only paths inside the workspace are allowed"
            )
        except ToolError as exc:
            return self._error(exc.kind, exc.message)
        except FileNotFoundError as exc:
            return self._error(NOT_FOUND, f"{exc.strerror}: {self._ws.rel_str(exc.filename)}")
        except OSError as exc:
            target = f": {self._ws.rel_str(exc.filename)}" if exc.filename else ""
            return self._error(FAILED, f"{name} failed: {exc.strerror or exc}{target}")
        except Exception as exc:
            return self._error(FAILED, f"{name} failed: {type(exc).__name__}: {exc}")

    def _confirm(self, name: str, proposal: Proposal) -> ToolOutcome | None:
        """Ask permission for ``proposal``; None if allowed, else the denial outcome.

        Whatever the permission callback raises (Ctrl+C, a UI failure) propagates:
        it is the user's or the UI's problem, not the model's.
        """
        if self.permissions.request(name, proposal.summary):
            return None
        what = proposal.what
        if what is None:
            what = proposal.summary.splitlines()[0] if proposal.summary else name
        return self._error(
            PERMISSION_DENIED,
            f"permission denied: the user did not allow this {name} call ({what}). "
            "Do not retry it unchanged; ask the user or take another approach.",
        )

    def _error(self, kind: str, message: str) -> ToolOutcome:
        shaped = self.outputs.shape(f"error: {message}")
        return ToolOutcome(False, shaped.text, kind, shaped.handle)

    def _finish(self, r: Result) -> ToolOutcome:
        """Shape ``r.body`` into what is left of the budget after ``before``/``after``;
        every part as valid Unicode (`valid_unicode`: a non-UTF-8 file name's bytes)."""
        handle = None
        r = dataclasses.replace(
            r,
            before=valid_unicode(r.before),
            body=valid_unicode(r.body),
            after=valid_unicode(r.after),
        )
        body = r.body
        if r.shape:
            room = self.budget - self.count_tokens(r.before) - self.count_tokens(r.after) - 4
            shaped = self.outputs.shape(body, budget=max(room, 64))
            body, handle = shaped.text, shaped.handle
        parts = [p for p in (r.before, body, r.after) if p]
        text = "\n".join(p.rstrip("\n") for p in parts[:-1])
        text = f"{text}\n{parts[-1]}" if text else (parts[-1] if parts else "")
        return ToolOutcome(r.ok, text, r.error, handle, r.job)

    def _mcp_call(self, name: str, a: dict[str, Any]) -> Proposal:
        """An MCP tool: asks like ``bash`` (a server's ``readOnlyHint`` is not trusted);
        its output is redacted (:mod:`ds4mlx.agent.redact`) and shaped like any other."""
        assert self.mcp is not None
        args = tool_schema.show(a, 2000)

        def apply() -> Result:
            assert self.mcp is not None
            r = self.mcp.call(name, a)
            body = redact(r.text) or "(no output)"
            if r.is_error:
                return Result(body, ok=False, error=FAILED, before=f"error: {name} failed:")
            return Result(body)

        return Proposal(f"call MCP tool {name} with {args}", apply, f"{name} {args[:200]}")

    def _more(self, a: dict[str, Any]) -> Result:
        """The ``more`` tool: the next chunk of a cut output (already within budget)."""
        try:
            text = self.outputs.more(a["handle"], a.get("line"))
        except KeyError as exc:
            raise ToolError(NOT_FOUND, exc.args[0]) from None
        except ValueError as exc:
            raise ToolError(INVALID_ARGUMENTS, str(exc)) from None
        return Result(text, shape=False)
