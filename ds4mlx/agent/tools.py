"""The agent's tools: definitions for the model and their implementation.

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
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import signal
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from ds4mlx.agent.jobs import Job, JobManager
from ds4mlx.agent.permissions import PathOutsideWorkspace, Permissions, resolve_in_workspace
from ds4mlx.agent.shaping import CountTokens, OutputStore, approx_tokens
from ds4mlx.dsml.conversation import ToolSpec

# Error kinds reported in ToolOutcome.error.
UNKNOWN_TOOL = "unknown_tool"
INVALID_ARGUMENTS = "invalid_arguments"
PATH_OUTSIDE_WORKSPACE = "path_outside_workspace"
PERMISSION_DENIED = "permission_denied"
NOT_FOUND = "not_found"
TIMEOUT = "timeout"
EXIT_STATUS = "exit_status"
FAILED = "failed"

DEFAULT_READ_LIMIT = 2000  # lines
MAX_LIST_ENTRIES = 5000
MAX_SEARCH_FILE_BYTES = 10 << 20
MAX_MATCH_LINE_CHARS = 300
MAX_RUNNING_JOBS = 16
# How much of a denied command the model is told (the denial names the call).
DENIED_COMMAND_CHARS = 200
MAX_SUMMARY_CHARS = 8000  # permission prompts: enough to judge, bounded for the terminal
_BINARY_SNIFF_BYTES = 8192
_SKIP_DIRS = frozenset({".git"})


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


class ToolError(Exception):
    """Raised inside a tool implementation to return ``error: message`` to the model."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class _CallbackError(Exception):
    """Carries an exception raised by the permission callback out of the tool."""


@dataclass
class _Result:
    """What a tool implementation returns; ``body`` is shaped, ``before``/``after`` kept."""

    body: str
    ok: bool = True
    error: str | None = None
    before: str = ""
    after: str = ""
    job: str | None = None
    shape: bool = True


@dataclass
class _Tool:
    spec: ToolSpec
    fn: Callable[[dict[str, Any]], _Result]
    validator: Draft202012Validator = field(repr=False)


def _obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_PATH_DESC = "Path relative to the workspace root (absolute paths must lie inside it)."

TOOL_SPECS: list[ToolSpec] = [
    ToolSpec(
        "read",
        "Read a text file of the workspace. Returns the exact file text (no line-number "
        "prefixes), lines offset..offset+limit-1. A note at the end tells how to read on "
        "when the file has more lines.",
        _obj(
            {
                "path": {"type": "string", "minLength": 1, "description": _PATH_DESC},
                "offset": {
                    "type": "integer",
                    "minimum": 1,
                    "default": 1,
                    "description": "First line to return (1-based).",
                },
                "limit": {
                    "type": "integer",
                    "minimum": 1,
                    "default": DEFAULT_READ_LIMIT,
                    "description": "Maximum number of lines to return.",
                },
            },
            ["path"],
        ),
    ),
    ToolSpec(
        "more",
        "Read the part of a long tool output that was cut. Each call returns the next "
        "chunk of the output named by handle (from a note like "
        '[… cut …; call more with handle="out_3"]); line jumps to a given line.',
        _obj(
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
    ),
    ToolSpec(
        "write",
        "Create or overwrite a file with the given content (parent directories are "
        "created). Prefer edit for changes to an existing file.",
        _obj(
            {
                "path": {"type": "string", "minLength": 1, "description": _PATH_DESC},
                "content": {"type": "string", "description": "The complete new file text."},
            },
            ["path", "content"],
        ),
    ),
    ToolSpec(
        "edit",
        "Replace an exact piece of text in a file. old must match the file exactly "
        "(whitespace and indentation included) and occur exactly once, unless "
        "replace_all is true. Include enough surrounding lines to make it unique.",
        _obj(
            {
                "path": {"type": "string", "minLength": 1, "description": _PATH_DESC},
                "old": {"type": "string", "minLength": 1, "description": "Exact text to replace."},
                "new": {"type": "string", "description": "Replacement text."},
                "replace_all": {
                    "type": "boolean",
                    "default": False,
                    "description": "Replace every occurrence instead of requiring one.",
                },
            },
            ["path", "old", "new"],
        ),
    ),
    ToolSpec(
        "list",
        "List files and directories (directories end with /, symlinks show their "
        "target; .git is skipped). Without glob, lists path down to depth levels. With "
        'glob (pathlib syntax, e.g. "**/*.py"; a pattern without / matches at any '
        "depth), lists the matching paths under path instead.",
        _obj(
            {
                "path": {"type": "string", "default": ".", "description": _PATH_DESC},
                "glob": {"type": "string", "minLength": 1, "description": "Optional glob pattern."},
                "depth": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 20,
                    "default": 2,
                    "description": "Directory levels to descend (1 = direct children).",
                },
            },
            [],
        ),
    ),
    ToolSpec(
        "search",
        "Search file contents with a Python regular expression, line by line. Returns "
        "path:line: text for each match. Skips binary files, .git and files over 10 MB.",
        _obj(
            {
                "pattern": {"type": "string", "minLength": 1, "description": "Python regex."},
                "path": {
                    "type": "string",
                    "default": ".",
                    "description": "File or directory to search. " + _PATH_DESC,
                },
                "glob": {
                    "type": "string",
                    "minLength": 1,
                    "description": 'Only files matching this glob, e.g. "*.py" or "src/**/*.ts".',
                },
                "ignore_case": {"type": "boolean", "default": False},
                "max_results": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 5000,
                    "default": 200,
                    "description": "Stop after this many matching lines.",
                },
            },
            ["pattern"],
        ),
    ),
    ToolSpec(
        "bash",
        "Run a bash command in the workspace directory (stdin closed, stderr merged into "
        "stdout). Foreground commands are stopped after timeout seconds; processes they "
        "leave running are stopped when they exit. For servers, watchers or anything "
        "long, set background=true: you get a job handle to poll with bash_status and "
        "stop with bash_stop.",
        _obj(
            {
                "command": {"type": "string", "minLength": 1, "description": "Bash command line."},
                "timeout": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "maximum": 86400,
                    "description": "Seconds before the command is stopped. Foreground "
                    "default: the agent's setting; background default: no limit.",
                },
                "background": {
                    "type": "boolean",
                    "default": False,
                    "description": "Start it as a background job and return its handle at once.",
                },
            },
            ["command"],
        ),
    ),
    ToolSpec(
        "bash_status",
        "Poll a background job: its output since the previous poll, and whether it is "
        "still running or its exit code.",
        _obj(
            {
                "handle": {"type": "string", "description": 'Job handle, e.g. "job_1".'},
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
    ),
    ToolSpec(
        "bash_stop",
        "Stop a background job (its whole process group) and return its remaining output.",
        _obj(
            {"handle": {"type": "string", "description": 'Job handle, e.g. "job_1".'}}, ["handle"]
        ),
    ),
]

# ESC [ … final byte (CSI: colours, cursor moves) and ESC ] … BEL/ST (OSC: titles, links).
_ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


def clean_terminal_output(text: str) -> str:
    """Strip ANSI escape sequences and apply carriage returns (keep what a terminal shows).

    Progress bars redraw a line with ``\\r`` hundreds of times; only the last state
    of each line is worth tokens.
    """
    text = _ANSI_RE.sub("", text).replace("\r\n", "\n")
    if "\r" not in text:
        return text
    return "\n".join(
        line.rsplit("\r", 1)[-1] if "\r" in line else line for line in text.split("\n")
    )


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _show(value: Any, limit: int = 80) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


_BOUND_WORDS = {
    "minimum": ">=",
    "maximum": "<=",
    "exclusiveMinimum": ">",
    "exclusiveMaximum": "<",
}


def _describe_param(name: str, schema: dict[str, Any], required: bool) -> str:
    parts = [schema.get("type", "any")]
    for key, word in _BOUND_WORDS.items():
        if key in schema:
            parts.append(f"{word} {schema[key]}")
    if "minLength" in schema:
        parts.append(
            "non-empty" if schema["minLength"] == 1 else f"length >= {schema['minLength']}"
        )
    parts.append(
        "required"
        if required
        else f"default {_show(schema['default'])}"
        if "default" in schema
        else "optional"
    )
    return f"{name} ({', '.join(parts)})"


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(_BINARY_SNIFF_BYTES)


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _count_lines(text: str) -> int:
    if not text:
        return 0
    return text.count("\n") + (0 if text.endswith("\n") else 1)


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
    ) -> None:
        root = Path(workspace).resolve()
        if not root.is_dir():
            raise ValueError(f"workspace {workspace} is not a directory")
        self.workspace = root
        self.permissions = permissions
        self.count_tokens = count_tokens
        self.bash_timeout = bash_timeout
        self.outputs = OutputStore(output_token_budget, count_tokens)
        self.jobs = JobManager(buffer_bytes=job_buffer_bytes, kill_grace=kill_grace)
        impls: dict[str, Callable[[dict[str, Any]], _Result]] = {
            "read": self._read,
            "more": self._more,
            "write": self._write,
            "edit": self._edit,
            "list": self._list,
            "search": self._search,
            "bash": self._bash,
            "bash_status": self._bash_status,
            "bash_stop": self._bash_stop,
        }
        specs = copy.deepcopy(TOOL_SPECS)
        for spec in specs:
            if spec.name == "bash":  # tell the model the real default
                spec.parameters["properties"]["timeout"]["description"] = (
                    f"Seconds before the command is stopped. Foreground default: "
                    f"{bash_timeout:g}; background default: no limit."
                )
        self._tools = {
            spec.name: _Tool(spec, impls[spec.name], Draft202012Validator(spec.parameters))
            for spec in specs
        }

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
            hint = f" Did you mean {close[0]!r}?" if close else ""
            return self._error(
                UNKNOWN_TOOL,
                f"unknown tool {name!r}.{hint} Available tools: {', '.join(self._tools)}.",
            )
        problems = self._validate(tool, arguments)
        if problems:
            schema = tool.spec.parameters
            req = set(schema.get("required", []))
            params = ", ".join(
                _describe_param(k, v, k in req) for k, v in schema["properties"].items()
            )
            return self._error(
                INVALID_ARGUMENTS,
                f"invalid arguments for {name}:\n"
                + "\n".join(problems)
                + f"\n{name} parameters: {params}. Fix the arguments and call again.",
            )
        args = self._with_defaults(tool, arguments)
        try:
            result = tool.fn(args)
        except PathOutsideWorkspace as exc:
            return self._error(
                PATH_OUTSIDE_WORKSPACE, f"{exc}; only paths inside the workspace are allowed"
            )
        except ToolError as exc:
            return self._error(exc.kind, exc.message)
        except _CallbackError as exc:
            raise exc.__cause__ from None
        except (KeyboardInterrupt, SystemExit):
            raise
        except FileNotFoundError as exc:
            return self._error(NOT_FOUND, f"{exc.strerror}: {self._rel_str(exc.filename)}")
        except OSError as exc:
            target = f": {self._rel_str(exc.filename)}" if exc.filename else ""
            return self._error(FAILED, f"{name} failed: {exc.strerror or exc}{target}")
        except Exception as exc:  # a tool bug must not kill the agent loop
            return self._error(FAILED, f"{name} failed: {type(exc).__name__}: {exc}")
        return self._finish(result)

    def describe(self, name: str, arguments: Any) -> str:
        """One-line human summary of a call, for the UI (``read src/a.py lines 1–2000``)."""
        if not isinstance(arguments, dict):
            return f"{name} {_show(arguments)}"
        shown = []
        for key, value in arguments.items():
            text = value if isinstance(value, str) else _show(value)
            text = text.replace("\n", "⏎")
            shown.append(f"{key}={text[:60] + '…' if len(text) > 60 else text}")
        return f"{name} " + " ".join(shown)

    def close(self) -> None:
        """Stop all background jobs still running."""
        self.jobs.stop_all()

    def __enter__(self) -> Toolbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing --------------------------------------------------------------

    def _validate(self, tool: _Tool, arguments: Any) -> list[str]:
        if not isinstance(arguments, dict):
            return [f"- arguments: expected object, got {_json_type(arguments)} {_show(arguments)}"]
        props = tool.spec.parameters.get("properties", {})
        problems: list[str] = []
        for err in sorted(
            tool.validator.iter_errors(arguments), key=lambda e: list(map(str, e.path))
        ):
            fld = ".".join(str(p) for p in err.absolute_path) or "arguments"
            got = f"got {_json_type(err.instance)} {_show(err.instance)}"
            if err.validator == "required":
                for missing in err.validator_value:
                    if missing not in err.instance:
                        want = props.get(missing, {}).get("type", "a value")
                        problems.append(f"- field '{missing}': missing (required, expected {want})")
            elif err.validator == "additionalProperties":
                for extra in err.instance:
                    if extra not in props:
                        problems.append(
                            f"- field '{extra}': unexpected (got {_show(err.instance[extra])}); "
                            f"allowed fields: {', '.join(props)}"
                        )
            elif err.validator == "type":
                problems.append(f"- field '{fld}': expected {err.validator_value}, {got}")
            elif err.validator in _BOUND_WORDS:
                problems.append(
                    f"- field '{fld}': expected a number {_BOUND_WORDS[err.validator]} "
                    f"{err.validator_value}, {got}"
                )
            elif err.validator == "minLength":
                problems.append(f"- field '{fld}': expected a non-empty string, {got}")
            else:
                problems.append(f"- field '{fld}': {err.message}")
        return problems

    @staticmethod
    def _with_defaults(tool: _Tool, arguments: dict[str, Any]) -> dict[str, Any]:
        args = dict(arguments)
        for key, schema in tool.spec.parameters["properties"].items():
            if key not in args and "default" in schema:
                args[key] = schema["default"]
            # JSON Schema accepts 5.0 as an integer; Python slicing does not.
            if schema.get("type") == "integer" and isinstance(args.get(key), float):
                args[key] = int(args[key])
        return args

    def _error(self, kind: str, message: str) -> ToolOutcome:
        shaped = self.outputs.shape(f"error: {message}")
        return ToolOutcome(False, shaped.text, kind, shaped.handle)

    def _finish(self, r: _Result) -> ToolOutcome:
        handle = None
        body = r.body
        if r.shape:
            room = self.budget - self.count_tokens(r.before) - self.count_tokens(r.after) - 4
            shaped = self.outputs.shape(body, budget=max(room, 64))
            body, handle = shaped.text, shaped.handle
        parts = [p for p in (r.before, body, r.after) if p]
        text = "\n".join(p.rstrip("\n") for p in parts[:-1])
        text = f"{text}\n{parts[-1]}" if text else (parts[-1] if parts else "")
        return ToolOutcome(r.ok, text, r.error, handle, r.job)

    def _path(self, raw: str) -> Path:
        return resolve_in_workspace(self.workspace, raw)

    def _rel(self, path: Path) -> str:
        rel = path.relative_to(self.workspace).as_posix()
        return rel or "."

    def _rel_str(self, filename: Any) -> str:
        if filename is None:
            return ""
        try:
            return self._rel(Path(os.fsdecode(filename)).resolve())
        except (ValueError, OSError):
            return os.fsdecode(filename)

    def _ask(self, tool: str, summary: str, what: str | None = None) -> None:
        """Ask permission; ``what`` names the call in the denial text (default: the
        summary's first line)."""
        try:
            allowed = self.permissions.request(tool, summary)
        except Exception as exc:  # the UI's problem, not the model's: re-raised by run()
            raise _CallbackError() from exc
        if not allowed:
            if what is None:
                what = summary.splitlines()[0] if summary else tool
            raise ToolError(
                PERMISSION_DENIED,
                f"permission denied: the user did not allow this {tool} call ({what}). "
                "Do not retry it unchanged; ask the user or take another approach.",
            )

    def _text_file(self, path: Path, raw: str) -> None:
        """Raise a ToolError unless ``path`` is an existing regular, non-binary file."""
        if not path.exists():
            raise ToolError(NOT_FOUND, f"file not found: {raw}")
        if path.is_dir():
            raise ToolError(FAILED, f"{raw} is a directory; use list to see its contents")
        if not path.is_file():
            raise ToolError(FAILED, f"{raw} is not a regular file")
        if _is_binary(path):
            size = path.stat().st_size
            raise ToolError(FAILED, f"{raw} is a binary file ({size} bytes); not shown")

    # --- file tools ------------------------------------------------------------

    def _read(self, a: dict[str, Any]) -> _Result:
        path = self._path(a["path"])
        rel = self._rel(path)
        self._text_file(path, rel)
        offset, limit = a["offset"], a["limit"]
        lines: list[str] = []
        total = 0
        # newline="\n": split on \n only (as every other tool counts lines), keep \r.
        with open(path, encoding="utf-8", errors="replace", newline="\n") as f:
            for total, line in enumerate(f, 1):
                if offset <= total < offset + limit:
                    lines.append(line)
        if total == 0:
            return _Result("", after=f"[{rel} is empty]")
        if offset > total:
            raise ToolError(FAILED, f"offset {offset} is past the end of {rel} ({total} lines)")
        last = offset + len(lines) - 1
        after = ""
        if offset > 1 or last < total:
            after = f"[{rel}: lines {offset}–{last} of {total}"
            after += f"; call read with offset={last + 1} for more]" if last < total else "]"
        return _Result("".join(lines), after=after)

    def _more(self, a: dict[str, Any]) -> _Result:
        try:
            text = self.outputs.more(a["handle"], a.get("line"))
        except KeyError as exc:
            raise ToolError(NOT_FOUND, exc.args[0]) from None
        except ValueError as exc:
            raise ToolError(INVALID_ARGUMENTS, str(exc)) from None
        return _Result(text, shape=False)

    def _write(self, a: dict[str, Any]) -> _Result:
        path = self._path(a["path"])
        rel = self._rel(path)
        content: str = a["content"]
        data = content.encode("utf-8")
        if path.is_dir():
            raise ToolError(FAILED, f"{rel} is a directory")
        exists = path.exists()
        if exists and not path.is_file():  # a FIFO or device would block or misbehave
            raise ToolError(FAILED, f"{rel} is not a regular file")
        if exists:
            try:
                old = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                old = None
            detail = _diff(old, content, rel) if old is not None else ""
        else:
            detail = _preview(content)
        n_lines = _count_lines(content)
        what = "overwrite" if exists else "create"
        self._ask("write", f"{what} {rel} ({len(data)} bytes, {n_lines} lines)\n{detail}".rstrip())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        done = "overwrote" if exists else "created"
        return _Result(f"{done} {rel} ({len(data)} bytes, {n_lines} lines)")

    def _edit(self, a: dict[str, Any]) -> _Result:
        path = self._path(a["path"])
        rel = self._rel(path)
        self._text_file(path, rel)
        old, new, replace_all = a["old"], a["new"], a["replace_all"]
        if old == new:
            raise ToolError(FAILED, "old and new are identical; nothing to change")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(FAILED, f"{rel} is not valid UTF-8; use write or bash") from None
        count = text.count(old)
        if count == 0 and "\r\n" in text and "\r" not in old:
            # The model writes \n; the file uses CRLF. Match and keep the file's style.
            crlf = old.replace("\n", "\r\n")
            if crlf != old and text.count(crlf):
                old, new = crlf, new.replace("\n", "\r\n")
                count = text.count(old)
        if count == 0:
            hint = ""
            if old.strip() and old.strip() in text:
                hint = " (the text occurs with different surrounding whitespace)"
            raise ToolError(
                NOT_FOUND,
                f"old text not found in {rel}{hint}. It must match the file exactly, "
                "including indentation and line breaks; read the file and copy the text.",
            )
        starts = [m.start() for m in re.finditer(re.escape(old), text)]
        lines = [_line_of(text, i) for i in starts]
        if count > 1 and not replace_all:
            shown = ", ".join(map(str, lines[:10])) + (", …" if len(lines) > 10 else "")
            raise ToolError(
                FAILED,
                f"old text occurs {count} times in {rel} (lines {shown}); include more "
                "surrounding lines to make it unique, or set replace_all=true",
            )
        updated = text.replace(old, new) if replace_all else text.replace(old, new, 1)
        n = count if replace_all else 1
        self._ask(
            "edit", f"edit {rel}: replace {n} occurrence(s)\n{_diff(text, updated, rel)}".rstrip()
        )
        path.write_bytes(updated.encode("utf-8"))
        at = ", ".join(map(str, lines[:10])) + (", …" if len(lines) > 10 else "")
        return _Result(f"edited {rel}: replaced {n} occurrence(s) at line(s) {at}")

    def _list(self, a: dict[str, Any]) -> _Result:
        base = self._path(a["path"])
        rel = self._rel(base)
        if not base.exists() and not base.is_symlink():
            raise ToolError(NOT_FOUND, f"no such file or directory: {rel}")
        if not base.is_dir():
            return _Result(self._entry(base))
        entries: list[str] = []
        if a.get("glob"):
            for p in self._glob(base, a["glob"]):
                entries.append(self._entry(p))
                if len(entries) >= MAX_LIST_ENTRIES:
                    break
            if not entries:
                return _Result(f"no paths under {rel} match {a['glob']!r}")
        else:
            self._walk_list(base, a["depth"], entries)
            if not entries:
                return _Result(f"{rel} is empty")
        after = (
            f"[listing stopped at {MAX_LIST_ENTRIES} entries]"
            if len(entries) >= MAX_LIST_ENTRIES
            else ""
        )
        return _Result("\n".join(entries) + "\n", after=after)

    def _entry(self, p: Path) -> str:
        """``rel/path``, ``dir/`` or ``link -> target`` (paths relative to the workspace)."""
        rel = (
            p.relative_to(self.workspace).as_posix() if p.is_relative_to(self.workspace) else str(p)
        )
        if p.is_symlink():
            try:
                return f"{rel} -> {os.readlink(p)}"
            except OSError:
                return f"{rel} -> ?"
        return f"{rel}/" if p.is_dir() else rel

    def _walk_list(self, d: Path, depth: int, out: list[str]) -> None:
        try:
            children = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as exc:
            out.append(f"{self._rel(d)}/ [unreadable: {exc.strerror}]")
            return
        for entry in children:
            if len(out) >= MAX_LIST_ENTRIES:
                return
            if entry.name in _SKIP_DIRS:
                continue
            p = Path(entry.path)
            out.append(self._entry(p))
            # Never descend through symlinks: they may leave the workspace or loop.
            if depth > 1 and entry.is_dir(follow_symlinks=False):
                self._walk_list(p, depth - 1, out)

    def _glob(self, base: Path, pattern: str) -> list[Path]:
        """Sorted matches of ``pattern`` under ``base``, inside the workspace, without .git."""
        if Path(pattern).is_absolute() or ".." in Path(pattern).parts:
            raise ToolError(
                INVALID_ARGUMENTS, f"glob {pattern!r} must be relative and must not use .."
            )
        if "/" not in pattern and not pattern.startswith("**"):
            pattern = f"**/{pattern}"  # "*.py" means any depth, as users expect
        found = []
        try:
            matches = base.glob(pattern)
            for p in matches:
                if _SKIP_DIRS.intersection(p.relative_to(base).parts):
                    continue
                try:
                    if not p.resolve().is_relative_to(self.workspace):
                        continue
                except (OSError, RuntimeError):
                    continue
                found.append(p)
        except ValueError as exc:  # malformed pattern, e.g. "**x"
            raise ToolError(INVALID_ARGUMENTS, f"invalid glob {pattern!r}: {exc}") from None
        return sorted(found)

    def _search(self, a: dict[str, Any]) -> _Result:
        flags = re.IGNORECASE if a["ignore_case"] else 0
        try:
            regex = re.compile(a["pattern"], flags)
        except re.error as exc:
            raise ToolError(
                INVALID_ARGUMENTS, f"invalid regular expression {a['pattern']!r}: {exc}"
            ) from None
        base = self._path(a["path"])
        rel = self._rel(base)
        if not base.exists():
            raise ToolError(NOT_FOUND, f"no such file or directory: {rel}")
        max_results = a["max_results"]
        if base.is_file():
            files = [base]
        elif a.get("glob"):
            files = [p for p in self._glob(base, a["glob"]) if p.is_file()]
        else:
            files = list(self._walk_files(base))
        out: list[str] = []
        searched = binary = large = matched_files = 0
        for p in files:
            if len(out) >= max_results:
                break
            try:
                if not p.resolve().is_relative_to(self.workspace):
                    continue  # a symlink out of the workspace: not ours to read
                st = p.stat()
                if not stat.S_ISREG(st.st_mode):
                    continue
                if st.st_size > MAX_SEARCH_FILE_BYTES:
                    large += 1
                    continue
                if _is_binary(p):
                    binary += 1
                    continue
                searched += 1
                prel = p.relative_to(self.workspace).as_posix()
                hit = False
                with open(p, encoding="utf-8", errors="replace", newline="\n") as f:
                    for no, line in enumerate(f, 1):
                        line = line.rstrip("\r\n")
                        if regex.search(line):
                            hit = True
                            if len(line) > MAX_MATCH_LINE_CHARS:
                                line = line[:MAX_MATCH_LINE_CHARS] + "…"
                            out.append(f"{prel}:{no}: {line}")
                            if len(out) >= max_results:
                                break
                matched_files += hit
            except OSError:
                continue
        skipped = []
        if binary:
            skipped.append(f"{binary} binary")
        if large:
            skipped.append(f"{large} over {MAX_SEARCH_FILE_BYTES >> 20} MB")
        skip_note = f"; skipped {', '.join(skipped)}" if skipped else ""
        if not out:
            return _Result(
                f"no matches for {a['pattern']!r} in {rel} ({searched} files searched{skip_note})"
            )
        stop_note = (
            f"; stopped at max_results={max_results}, narrow the search or raise max_results"
            if len(out) >= max_results
            else ""
        )
        after = f"[{len(out)} matching lines in {matched_files} files{skip_note}{stop_note}]"
        return _Result("\n".join(out) + "\n", after=after)

    def _walk_files(self, base: Path):
        for root, dirs, files in os.walk(base, followlinks=False):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
            for name in sorted(files):
                yield Path(root, name)

    # --- bash ------------------------------------------------------------------

    def _bash(self, a: dict[str, Any]) -> _Result:
        command: str = a["command"]
        background: bool = a["background"]
        timeout = a.get("timeout")
        if not background and timeout is None:
            timeout = self.bash_timeout
        limit = f"timeout {timeout:g} s" if timeout is not None else "no timeout"
        mode = "background job" if background else "foreground"
        short = " ⏎ ".join(ln.strip() for ln in command.strip().splitlines() if ln.strip())
        if len(short) > DENIED_COMMAND_CHARS:
            short = short[: DENIED_COMMAND_CHARS - 1] + "…"
        self._ask(
            "bash",
            f"run ({mode}, {limit}) in {self.workspace}:\n{_cap(command)}",
            what=f"{mode}: {short}",
        )
        if background:
            running = [j.handle for j in self.jobs.jobs if j.running]
            if len(running) >= MAX_RUNNING_JOBS:
                raise ToolError(
                    FAILED,
                    f"too many background jobs running ({', '.join(running)}); "
                    "stop one with bash_stop first",
                )
            job = self.jobs.start(command, self.workspace, timeout=timeout)
            return _Result(
                f"started background job {job.handle} (pid {job.pid}, {limit}). Poll it with "
                f'bash_status handle="{job.handle}"; stop it with bash_stop.',
                job=job.handle,
            )
        job = self.jobs.start(command, self.workspace, register=False)
        try:
            code = job.wait(timeout)
        except BaseException:  # Ctrl+C in the agent: do not leave the command running
            job.stop()
            raise
        if code is None:
            job.stop()
            output = clean_terminal_output(job.read_new())
            return _Result(
                output or "(no output)",
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
        output = clean_terminal_output(job.read_new())
        status = _exit_text(code) + f" · {job.elapsed:.1f} s"
        if leftovers:
            status += " · processes it left running were stopped (use background=true for those)"
        return _Result(
            output or "(no output)",
            ok=code == 0,
            error=None if code == 0 else EXIT_STATUS,
            after=f"[{status}]",
        )

    def _job(self, handle: str) -> Job:
        try:
            return self.jobs.get(handle)
        except KeyError as exc:
            raise ToolError(NOT_FOUND, exc.args[0]) from None

    def _job_status(self, job: Job) -> tuple[str, bool, str | None]:
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

    def _bash_status(self, a: dict[str, Any]) -> _Result:
        job = self._job(a["handle"])
        if a["wait"] > 0 and job.running:
            job.wait(a["wait"])
        output = clean_terminal_output(job.read_new())
        status, ok, err = self._job_status(job)
        return _Result(output or "(no new output)", ok=ok, error=err, after=status)

    def _bash_stop(self, a: dict[str, Any]) -> _Result:
        job = self._job(a["handle"])
        was_running = job.running
        job.stop()
        output = clean_terminal_output(job.read_new())
        status, ok, err = self._job_status(job)
        if not was_running:
            status = status[:-1] + "; it had already ended]"
            ok, err = True, None
        return _Result(output or "(no new output)", ok=ok, error=err, after=status)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _diff(old: str | None, new: str, rel: str, max_lines: int = 80) -> str:
    """Unified diff of a change, capped at ``max_lines`` lines (for the permission prompt)."""
    lines = list(
        difflib.unified_diff(
            (old or "").splitlines(keepends=True),
            new.splitlines(keepends=True),
            f"a/{rel}",
            f"b/{rel}",
            n=2,
        )
    )
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"… {len(lines) - max_lines} more diff lines\n"]
    return _cap("".join(line if line.endswith("\n") else line + "\n" for line in lines))


def _preview(content: str, max_lines: int = 20) -> str:
    lines = content.splitlines(keepends=True)
    shown = "".join(lines[:max_lines])
    if len(lines) > max_lines:
        shown += f"… {len(lines) - max_lines} more lines\n"
    return _cap(shown)


def _cap(text: str, limit: int = MAX_SUMMARY_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"… ({len(text) - limit} more chars)\n"
