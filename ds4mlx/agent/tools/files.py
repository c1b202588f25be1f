"""File tools: ``read``, ``write``, ``edit``, ``list``.

Files are UTF-8 text; lines are ``\\n``-separated and 1-based. ``write`` and ``edit``
return a :class:`~ds4mlx.agent.tools.common.Proposal` (with a diff or a preview for
the user) and change the file only once the dispatcher got permission.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

from ds4mlx.agent.redact import MARKER, introduces_marker
from ds4mlx.agent.shaping import count_lines, line_of
from ds4mlx.agent.tools.common import (
    FAILED,
    NOT_FOUND,
    SKIP_DIRS,
    Proposal,
    Result,
    ToolError,
    Workspace,
    cap,
    first_few,
)
from ds4mlx.agent.tools.schema import PATH_DESC, object_schema
from ds4mlx.dsml.conversation import ToolSpec

DEFAULT_READ_LIMIT = 2000  # lines
MAX_LIST_ENTRIES = 5000

READ_SPEC = ToolSpec(
    "read",
    "Read a text file of the workspace. Returns the exact file text (no line-number "
    "prefixes), lines offset..offset+limit-1. A note at the end tells how to read on "
    "when the file has more lines.",
    object_schema(
        {
            "path": {"type": "string", "minLength": 1, "description": PATH_DESC},
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
)

WRITE_SPEC = ToolSpec(
    "write",
    "Create or overwrite a file with the given content (parent directories are "
    "created). Prefer edit for changes to an existing file.",
    object_schema(
        {
            "path": {"type": "string", "minLength": 1, "description": PATH_DESC},
            "content": {"type": "string", "description": "The complete new file text."},
        },
        ["path", "content"],
    ),
)

EDIT_SPEC = ToolSpec(
    "edit",
    "Replace an exact piece of text in a file. old must match the file exactly "
    "(whitespace and indentation included) and occur exactly once, unless "
    "replace_all is true. Include enough surrounding lines to make it unique.",
    object_schema(
        {
            "path": {"type": "string", "minLength": 1, "description": PATH_DESC},
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
)

LIST_SPEC = ToolSpec(
    "list",
    "List files and directories (directories end with /, symlinks show their "
    "target; .git is skipped). Without glob, lists path down to depth levels. With "
    'glob (pathlib syntax, e.g. "**/*.py"; a pattern without / matches at any '
    "depth), lists the matching paths under path instead.",
    object_schema(
        {
            "path": {"type": "string", "default": ".", "description": PATH_DESC},
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
)


class FileTools:
    """``read``, ``write``, ``edit`` and ``list`` in one workspace.

    Each method takes the validated arguments of its tool (defaults filled in).
    """

    def __init__(self, workspace: Workspace) -> None:
        self.ws = workspace

    def read(self, a: dict[str, Any]) -> Result:
        path = self.ws.path(a["path"])
        rel = self.ws.rel(path)
        self.ws.text_file(path, rel)
        offset, limit = a["offset"], a["limit"]
        lines: list[str] = []
        total = 0
        # newline="\n": split on \n only (as every other tool counts lines), keep \r.
        with open(path, encoding="utf-8", errors="replace", newline="\n") as f:
            for total, line in enumerate(f, 1):
                if offset <= total < offset + limit:
                    lines.append(line)
        if total == 0:
            return Result("", after=f"[{rel} is empty]")
        if offset > total:
            raise ToolError(FAILED, f"offset {offset} is past the end of {rel} ({total} lines)")
        last = offset + len(lines) - 1
        after = ""
        if offset > 1 or last < total:
            after = f"[{rel}: lines {offset}–{last} of {total}"
            after += f"; call read with offset={last + 1} for more]" if last < total else "]"
        return Result("".join(lines), after=after)

    def write(self, a: dict[str, Any]) -> Proposal:
        path = self.ws.path(a["path"])
        rel = self.ws.rel(path)
        content: str = a["content"]
        data = content.encode("utf-8")
        if path.is_dir():
            raise ToolError(FAILED, f"{rel} is a directory")
        exists = path.exists()
        old: str | None = None
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
        size = f"({len(data)} bytes, {count_lines(content)} lines)"
        _refuse_redacted(content, old or "", rel)

        def apply() -> Result:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            return Result(f"{'overwrote' if exists else 'created'} {rel} {size}")

        what = "overwrite" if exists else "create"
        return Proposal(f"{what} {_one_line(rel)} {size}\n{detail}".rstrip(), apply)

    def applied(self, name: str, a: dict[str, Any]) -> str | None:
        """Whether the ``write``/``edit`` call ``a`` is already in effect (a repeat of one
        whose outcome is unknown): the file holds ``content``, or ``old`` is gone and
        ``new`` present. Returns the result text ("already applied: …") or None.
        """
        path = self.ws.path(a["path"])
        rel = self.ws.rel(path)
        try:
            text = path.read_bytes().decode("utf-8") if path.is_file() else None
        except (OSError, UnicodeDecodeError):
            return None
        if text is None:
            return None
        if name == "write" and text == a["content"]:
            return f"already applied: {rel} already holds this content; nothing was written"
        if name == "edit":
            old, new = _match_line_endings(text, a["old"], a["new"])
            if old not in text and new and new in text:
                return f"already applied: {rel} no longer holds old and holds new; nothing changed"
        return None

    def edit(self, a: dict[str, Any]) -> Proposal:
        path = self.ws.path(a["path"])
        rel = self.ws.rel(path)
        self.ws.text_file(path, rel)
        old, new, replace_all = a["old"], a["new"], a["replace_all"]
        if old == new:
            raise ToolError(FAILED, "old and new are identical; nothing to change")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(FAILED, f"{rel} is not valid UTF-8; use write or bash") from None
        old, new = _match_line_endings(text, old, new)
        _refuse_redacted(new, old, rel)
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
        lines = [line_of(text, m.start()) for m in re.finditer(re.escape(old), text)]
        if count > 1 and not replace_all:
            raise ToolError(
                FAILED,
                f"old text occurs {count} times in {rel} (lines {first_few(lines)}); include "
                "more surrounding lines to make it unique, or set replace_all=true",
            )
        updated = text.replace(old, new) if replace_all else text.replace(old, new, 1)
        n = count if replace_all else 1

        def apply() -> Result:
            path.write_bytes(updated.encode("utf-8"))
            return Result(f"edited {rel}: replaced {n} occurrence(s) at line(s) {first_few(lines)}")

        return Proposal(
            f"edit {_one_line(rel)}: replace {n} occurrence(s)\n{_diff(text, updated, rel)}".rstrip(),
            apply,
        )

    def list_paths(self, a: dict[str, Any]) -> Result:
        base = self.ws.path(a["path"])
        rel = self.ws.rel(base)
        if not base.exists() and not base.is_symlink():
            raise ToolError(NOT_FOUND, f"no such file or directory: {rel}")
        if not base.is_dir():
            return Result(self._entry(base))
        entries: list[str] = []
        if a.get("glob"):
            for p in self.ws.glob(base, a["glob"]):
                entries.append(self._entry(p))
                if len(entries) >= MAX_LIST_ENTRIES:
                    break
            if not entries:
                return Result(f"no paths under {rel} match {a['glob']!r}")
        else:
            self._walk(base, a["depth"], entries)
            if not entries:
                return Result(f"{rel} is empty")
        after = (
            f"[listing stopped at {MAX_LIST_ENTRIES} entries]"
            if len(entries) >= MAX_LIST_ENTRIES
            else ""
        )
        return Result("\n".join(entries) + "\n", after=after)

    def _entry(self, p: Path) -> str:
        """``rel/path``, ``dir/`` or ``link -> target`` (paths relative to the workspace),
        on one line (`_one_line`: a name holding a line break is not two entries)."""
        rel = _one_line(self.ws.rel(p))
        if p.is_symlink():
            try:
                return f"{rel} -> {_one_line(os.readlink(p))}"
            except OSError:
                return f"{rel} -> ?"
        return f"{rel}/" if p.is_dir() else rel

    def _walk(self, d: Path, depth: int, out: list[str]) -> None:
        """Append the entries under ``d``, ``depth`` levels deep, name-sorted, to ``out``."""
        try:
            children = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as exc:
            out.append(f"{self.ws.rel(d)}/ [unreadable: {exc.strerror}]")
            return
        for entry in children:
            if len(out) >= MAX_LIST_ENTRIES:
                return
            if entry.name in SKIP_DIRS:
                continue
            p = Path(entry.path)
            out.append(self._entry(p))
            # Never descend through symlinks: they may leave the workspace or loop.
            if depth > 1 and entry.is_dir(follow_symlinks=False):
                self._walk(p, depth - 1, out)


def _match_line_endings(text: str, old: str, new: str) -> tuple[str, str]:
    """``old``/``new`` with CRLF line breaks when only that form occurs in a CRLF file.

    The model writes ``\\n``; the file may use CRLF. Matching that way keeps the
    file's style in the replacement too.
    """
    if "\r\n" in text and "\r" not in old and old not in text:
        crlf = old.replace("\n", "\r\n")
        if crlf != old and crlf in text:
            return crlf, new.replace("\n", "\r\n")
    return old, new


def _one_line(rel: str) -> str:
    """A path on one line, as a listing entry or a permission question's first line
    shows it: a line break in the name written ``\\n``/``\\r`` (as ``ls`` quotes it),
    so the name cannot pass for two lines (another path and something else)."""
    return rel.replace("\r", "\\r").replace("\n", "\\n")


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
    return cap("".join(line if line.endswith("\n") else line + "\n" for line in lines))


def _refuse_redacted(new: str, old: str, rel: str) -> None:
    """Refuse content that adds a redaction marker (see :mod:`ds4mlx.agent.redact`).

    Raises:
        ToolError: ``failed``, naming the marker's meaning.
    """
    if introduces_marker(new, old):
        raise ToolError(
            FAILED,
            f"refused: the content for {rel} holds a redaction marker ({MARKER}…]); it "
            "stands for a secret you were not shown, and writing it would destroy the "
            "real value. Leave that part unchanged (edit around it) or ask the user.",
        )


def _preview(content: str, max_lines: int = 20) -> str:
    """The first ``max_lines`` lines of a new file (for the permission prompt)."""
    lines = content.splitlines(keepends=True)
    shown = "".join(lines[:max_lines])
    if len(lines) > max_lines:
        shown += f"… {len(lines) - max_lines} more lines\n"
    return cap(shown)
