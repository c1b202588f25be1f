"""What every agent tool shares: error kinds, results, and the workspace it works in.

A tool implementation (:mod:`ds4mlx.agent.tools.files`, :mod:`~ds4mlx.agent.tools.search`,
:mod:`~ds4mlx.agent.tools.shell`) takes the validated arguments (defaults filled in)
and either returns a :class:`Result`, returns a :class:`Proposal` for an action that
needs the user's permission, or raises :class:`ToolError`. The dispatcher,
:class:`ds4mlx.agent.tools.Toolbox`, does everything else once for all tools:
schema validation, asking permission, mapping errors, shaping output to the budget.

Paths go through :class:`Workspace`, which refuses anything resolving outside the
workspace root (see :mod:`ds4mlx.agent.permissions`).
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds4mlx.agent.permissions import resolve_in_workspace

# Error kinds reported in ToolOutcome.error.
UNKNOWN_TOOL = "unknown_tool"
INVALID_ARGUMENTS = "invalid_arguments"
PATH_OUTSIDE_WORKSPACE = "path_outside_workspace"
PERMISSION_DENIED = "permission_denied"
NOT_FOUND = "not_found"
TIMEOUT = "timeout"
EXIT_STATUS = "exit_status"
FAILED = "failed"

MAX_SUMMARY_CHARS = 8000  # permission prompts: enough to judge, bounded for the terminal
SKIP_DIRS = frozenset({".git"})  # never listed, searched or globbed
_BINARY_SNIFF_BYTES = 8192


class ToolError(Exception):
    """Raised inside a tool implementation to return ``error: message`` to the model.

    Args:
        kind: one of the error kinds above (becomes ``ToolOutcome.error``).
        message: what the model reads after ``error:``.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass
class Result:
    """What a tool implementation returns.

    Attributes:
        body: the output; cut to the token budget (with a ``more`` handle) when
            ``shape`` is true.
        ok: False for a failure the tool still reports as output (non-zero exit).
        error: the error kind when not ok.
        before: a line kept whole above the body (e.g. a timeout explanation).
        after: a line kept whole below the body (status, "read on" notes).
        job: the background job handle, for ``bash`` with ``background=true``.
        shape: False when the body is already within budget (``more`` chunks).
    """

    body: str
    ok: bool = True
    error: str | None = None
    before: str = ""
    after: str = ""
    job: str | None = None
    shape: bool = True


@dataclass(frozen=True)
class Proposal:
    """An action that runs only if the user allows it; the dispatcher asks.

    Attributes:
        summary: what the user is asked about (first line short; then a diff or the
            full command), bounded by :func:`cap`.
        apply: performs the action and returns its result.
        what: names the call in the denial the model reads; None for the summary's
            first line.
    """

    summary: str
    apply: Callable[[], Result]
    what: str | None = None


class Workspace:
    """The workspace root and the path rules every tool follows.

    Args:
        root: resolved absolute directory.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, raw: str) -> Path:
        """Resolve a path the model gave.

        Raises:
            PathOutsideWorkspace: it resolves outside the root.
        """
        return resolve_in_workspace(self.root, raw)

    def rel(self, path: Path) -> str:
        """``path`` (inside the root) relative to it, POSIX style; ``.`` for the root.

        Raises:
            ValueError: ``path`` is not inside the root.
        """
        return path.relative_to(self.root).as_posix()

    def rel_str(self, filename: Any) -> str:
        """An ``OSError.filename`` shown relative to the root when it lies inside."""
        if filename is None:
            return ""
        try:
            return self.rel(Path(os.fsdecode(filename)).resolve())
        except (ValueError, OSError):
            return os.fsdecode(filename)

    def contains(self, p: Path) -> bool:
        """True if ``p`` resolves inside the root (False if it cannot be resolved).

        A symlink found while walking may point out of the workspace or loop; such
        paths are skipped rather than read.
        """
        try:
            return p.resolve().is_relative_to(self.root)
        except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python 3.11)
            return False

    def text_file(self, path: Path, raw: str) -> str:
        """Check that ``path`` is an existing regular, non-binary file; its text encoding
        (`sniff_encoding`).

        Raises:
            ToolError: ``not_found``, or ``failed`` for a directory, a special file
                or a binary file (``raw`` names it in the message).
        """
        if not path.exists():
            raise ToolError(NOT_FOUND, f"file not found: {raw}")
        if path.is_dir():
            raise ToolError(FAILED, f"{raw} is a directory; use list to see its contents")
        if not path.is_file():
            raise ToolError(FAILED, f"{raw} is not a regular file")
        encoding = sniff_encoding(path)
        if encoding is None:
            size = path.stat().st_size
            raise ToolError(FAILED, f"{raw} is a binary file ({size} bytes); not shown")
        return encoding

    def glob(self, base: Path, pattern: str) -> list[Path]:
        """Sorted matches of ``pattern`` under ``base``, inside the workspace, without .git.

        A pattern without ``/`` matches at any depth (``*.py`` = ``**/*.py``).

        Raises:
            ToolError: ``invalid_arguments`` for an absolute pattern, one using ``..``,
                or a malformed one.
        """
        if Path(pattern).is_absolute() or ".." in Path(pattern).parts:
            raise ToolError(
                INVALID_ARGUMENTS, f"glob {pattern!r} must be relative and must not use .."
            )
        if "/" not in pattern and not pattern.startswith("**"):
            pattern = f"**/{pattern}"  # "*.py" means any depth, as users expect
        try:
            found = [
                p
                for p in base.glob(pattern)
                if not SKIP_DIRS.intersection(p.relative_to(base).parts) and self.contains(p)
            ]
        except ValueError as exc:  # malformed pattern, e.g. "**x"
            raise ToolError(INVALID_ARGUMENTS, f"invalid glob {pattern!r}: {exc}") from None
        return sorted(found)


def text_encoding(head: bytes) -> str:
    """The encoding the file tools read and write a file in, from its first bytes:
    ``"utf-16-le"`` or ``"utf-16-be"`` after a UTF-16 byte-order mark (Windows tools
    write those: PowerShell scripts, .reg and .rc files), else ``"utf-8"``.

    The mark stays in the decoded text (U+FEFF), so text written back in the same
    encoding keeps every byte. A UTF-32 mark (which starts like UTF-16's) is not UTF-16.
    """
    if head.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        return "utf-8"
    if head.startswith(codecs.BOM_UTF16_LE):
        return "utf-16-le"
    if head.startswith(codecs.BOM_UTF16_BE):
        return "utf-16-be"
    return "utf-8"


def sniff_encoding(path: Path) -> str | None:
    """The text encoding of the file at ``path`` (`text_encoding` of its first bytes), or
    None for a binary file: a NUL byte in its first 8 KiB (UTF-16 text, which has a NUL
    in every ASCII character, is text when it starts with its byte-order mark). One read
    answers both questions: ``search`` asks them of every file it walks."""
    with open(path, "rb") as f:
        head = f.read(_BINARY_SNIFF_BYTES)
    encoding = text_encoding(head)
    return None if b"\0" in head and encoding == "utf-8" else encoding


def one_line(rel: str) -> str:
    """A path on one line, as a listing entry, a search hit or a permission question's
    first line shows it: a line break in the name written ``\\n``/``\\r`` (as ``ls``
    quotes it), so the name cannot pass for two lines (another path and something else)."""
    return rel.replace("\r", "\\r").replace("\n", "\\n")


def cap(text: str, limit: int = MAX_SUMMARY_CHARS) -> str:
    """``text`` cut to ``limit`` characters plus a note of how many were left out."""
    return text if len(text) <= limit else text[:limit] + f"… ({len(text) - limit} more chars)\n"


def first_few(numbers: list[int], limit: int = 10) -> str:
    """``1, 5, 9`` — at most ``limit`` numbers, then ``, …``."""
    return ", ".join(map(str, numbers[:limit])) + (", …" if len(numbers) > limit else "")
