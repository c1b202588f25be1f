"""File tools: ``read``, ``write``, ``edit``, ``list``.

Files are UTF-8 text; lines are ``\\n``-separated and 1-based. ``write`` and ``edit``
return a :class:`~ds4mlx.agent.tools.common.Proposal` (with a diff or a preview for
the user) and change the file only once the dispatcher got permission.
"""

from __future__ import annotations

import codecs
import difflib
import io
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ds4mlx.agent.redact import MARKER, introduces_marker
from ds4mlx.agent.shaping import count_lines
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
    one_line,
    text_encoding,
)
from ds4mlx.agent.tools.schema import PATH_DESC, object_schema
from ds4mlx.dsml.conversation import ToolSpec
from ds4mlx.fsutil import atomic_write, temp_name, write_durable

DEFAULT_READ_LIMIT = 2000  # lines
UTF16_NOTE = (
    "{rel} is UTF-16 text ({order}, with a byte-order mark): write and edit keep that "
    "encoding; shell tools such as grep and sed see a NUL byte in every ASCII character"
)
NOT_UTF8_NOTE = (
    "{rel} is not valid UTF-8: bytes that do not decode are shown as U+FFFD (\ufffd), "
    "not as they are; change this file with bash, not write or edit"
)
_REPLACEMENT_REFUSAL = (
    "refused: {rel} is not UTF-8 text and the content holds U+FFFD (\ufffd), what read "
    "shows for bytes it cannot decode: writing it would destroy those bytes. Change this "
    "file with bash (e.g. sed or iconv) instead."
)
MAX_LIST_ENTRIES = 5000
# `read` shows a line longer than this many characters cut, saying so: a minified bundle
# or a data file on one line would otherwise be held whole in memory (hundreds of MB from
# a hostile repository) and handed to the model whole.
MAX_LINE_CHARS = 4000

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
        encoding = self.ws.text_file(path, rel)
        offset, limit = a["offset"], a["limit"]
        lines: list[str] = []
        total = 0
        utf8 = True
        for total, (line, ok) in enumerate(_text_lines(path, encoding), 1):
            utf8 = utf8 and ok
            if offset <= total < offset + limit:
                lines.append(line)
        if total == 0:
            return Result("", after=f"[{rel} is empty]")
        if offset > total:
            raise ToolError(FAILED, f"offset {offset} is past the end of {rel} ({total} lines)")
        last = offset + len(lines) - 1
        notes = []
        if offset > 1 or last < total:
            note = f"{rel}: lines {offset}–{last} of {total}"
            notes.append(
                note + (f"; call read with offset={last + 1} for more" if last < total else "")
            )
        if not utf8:
            notes.append(NOT_UTF8_NOTE.format(rel=rel))
        if encoding != "utf-8":
            notes.append(UTF16_NOTE.format(rel=rel, order=encoding[-2:].upper()))
        return Result("".join(lines), after="\n".join(f"[{n}]" for n in notes))

    def write(self, a: dict[str, Any]) -> Proposal:
        path = self.ws.path(a["path"])
        rel = self.ws.rel(path)
        content: str = a["content"]
        if path.is_dir():
            raise ToolError(FAILED, f"{rel} is a directory")
        if a["path"].endswith(("/", os.sep)):
            raise ToolError(FAILED, f"{a['path']} names a directory; give a file name")
        for parent in path.parents:  # a file where a directory must be: say which
            if parent.exists():
                if not parent.is_dir():
                    raise ToolError(FAILED, f"{self.ws.rel(parent)} is not a directory")
                break
        exists = path.exists()
        if exists and not path.is_file():  # a FIFO or device would block or misbehave
            raise ToolError(FAILED, f"{rel} is not a regular file")
        before = _contents(path)
        old: str | None = None
        encoding = "utf-8"
        if before is not None:
            old, encoding = _decode(before)
            if old is None and "\ufffd" in content:
                raise ToolError(FAILED, _REPLACEMENT_REFUSAL.format(rel=rel))
            if old is not None:
                content = _in_file_line_endings(old, content)
        data = _encode(content, encoding)
        if before is None:
            detail = _preview(content)
        elif old is None:
            detail = f"({rel} is not UTF-8 text: no diff shown; all its bytes are replaced)"
        else:
            detail = _diff(old, content, rel)
        size = f"({len(data)} bytes, {count_lines(content)} lines)"
        _refuse_redacted(content, old or "", rel)

        def apply() -> Result:
            _unchanged_since(path, before, rel)
            _put(path, data, exists=before is not None)
            return Result(f"{'overwrote' if exists else 'created'} {rel} {size}")

        what = "overwrite" if exists else "create"
        return Proposal(f"{what} {one_line(rel)} {size}\n{detail}".rstrip(), apply)

    def applied(self, name: str, a: dict[str, Any]) -> str | None:
        """Whether the ``write``/``edit`` call ``a`` is already in effect (a repeat of one
        whose outcome is unknown): the file holds ``content`` (in its own line endings),
        or holds ``new`` and every ``old`` left lies inside a ``new`` (`_in_effect`).
        Returns the result text ("already applied: …") or None.
        """
        path = self.ws.path(a["path"])
        rel = self.ws.rel(path)
        try:
            text = _decode(path.read_bytes())[0] if path.is_file() else None
        except OSError:
            return None
        if text is None:
            return None
        if name == "write" and text in (a["content"], _in_file_line_endings(text, a["content"])):
            return f"already applied: {rel} already holds this content; nothing was written"
        if name == "edit":
            old, new = _match_line_endings(text, a["old"], a["new"])
            if _in_effect(text, old, new):
                return f"already applied: {rel} holds new where old was; nothing changed"
        return None

    def edit(self, a: dict[str, Any]) -> Proposal:
        path = self.ws.path(a["path"])
        rel = self.ws.rel(path)
        self.ws.text_file(path, rel)
        old, new, replace_all = a["old"], a["new"], a["replace_all"]
        if old == new:
            raise ToolError(FAILED, "old and new are identical; nothing to change")
        before = path.read_bytes()
        text, encoding = _decode(before)
        if text is None:
            raise ToolError(FAILED, f"{rel} is not valid {encoding.upper()}; change it with bash")
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
        lines = _match_lines(text, old)
        if count > 1 and not replace_all:
            raise ToolError(
                FAILED,
                f"old text occurs {count} times in {rel} (lines {first_few(lines)}); include "
                "more surrounding lines to make it unique, or set replace_all=true",
            )
        updated = text.replace(old, new) if replace_all else text.replace(old, new, 1)
        n = count if replace_all else 1

        def apply() -> Result:
            _unchanged_since(path, before, rel)
            _put(path, _encode(updated, encoding), exists=True)
            return Result(f"edited {rel}: replaced {n} occurrence(s) at line(s) {first_few(lines)}")

        return Proposal(
            f"edit {one_line(rel)}: replace {n} occurrence(s)\n{_diff(text, updated, rel)}".rstrip(),
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
        on one line (`one_line`: a name holding a line break is not two entries)."""
        rel = one_line(self.ws.rel(p))
        if p.is_symlink():
            try:
                return f"{rel} -> {one_line(os.readlink(p))}"
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
    return old, _in_file_line_endings(text, new)


def _crlf_only(text: str) -> bool:
    """Every line break of ``text`` is CRLF (and there is one)."""
    return "\r\n" in text and text.count("\n") == text.count("\r\n")


def _in_file_line_endings(file_text: str, text: str) -> str:
    """``text`` (the model's, ``\n`` breaks) with CRLF breaks when ``file_text`` (what it
    goes into) uses CRLF only: a change keeps the file's style, as an editor would."""
    if _crlf_only(file_text):
        return re.sub(r"(?<!\r)\n", "\r\n", text)
    return text


def _match_lines(text: str, old: str, limit: int = 11) -> list[int]:
    """1-based line numbers of the first ``limit`` occurrences of ``old`` in ``text``
    (non-overlapping, as ``str.count``/``str.replace`` take them), counted
    incrementally: linear in the text, not in (occurrences × text)."""
    lines: list[int] = []
    line, last, pos = 1, 0, text.find(old)
    while pos != -1 and len(lines) < limit:
        line += text.count("\n", last, pos)
        last = pos
        lines.append(line)
        pos = text.find(old, pos + len(old))
    return lines


def _in_effect(text: str, old: str, new: str) -> bool:
    """Whether the edit ``old`` → ``new`` shows as done in ``text``: ``new`` occurs and
    every occurrence of ``old`` lies inside one of ``new`` (a deletion, ``new`` empty:
    ``old`` is gone). That covers edits that keep ``old`` inside ``new`` (adding a line
    after it): "old is gone" alone would apply those twice."""
    if not new:
        return old not in text
    spans = []
    pos = text.find(new)
    while pos != -1:
        spans.append((pos, pos + len(new)))
        pos = text.find(new, pos + 1)
    if not spans:
        return False
    i, pos = 0, text.find(old)
    while pos != -1:
        while i < len(spans) and spans[i][1] < pos + len(old):
            i += 1  # spans are in order of start and end (all of one length)
        if i == len(spans) or spans[i][0] > pos:
            return False
        pos = text.find(old, pos + 1)
    return True


def _text_lines(path: Path, encoding: str) -> Iterator[tuple[str, bool]]:
    """Each line of the file at ``path`` (split on ``\\n`` only, as every other tool
    counts lines; ``\\r`` stays) decoded from ``encoding``, and whether it decoded
    cleanly (bytes that do not decode show as U+FFFD). A UTF-8 file is read and decoded
    a line at a time, so one bad line marks only itself."""
    with open(path, "rb") as f:
        if encoding == "utf-8":
            yield from _utf8_lines(f)
            return
        data = f.read()
    text, _ = _decode(data)
    ok = text is not None
    if text is None:
        text = data.decode(encoding, errors="replace")
    for line in io.StringIO(text, newline="\n"):
        yield _cut_line(line), ok


def _utf8_lines(f) -> Iterator[tuple[str, bool]]:
    """`_text_lines` of a UTF-8 file open for binary reading: memory stays bounded by
    `MAX_LINE_CHARS` whatever a line's length (the rest of a long line is read in
    pieces and skipped)."""
    limit = MAX_LINE_CHARS * 4 + 4  # bytes: room for MAX_LINE_CHARS characters and one
    while raw := f.readline(limit):
        whole = raw.endswith(b"\n")
        while not whole and (more := f.readline(1 << 20)):
            if more.endswith(b"\n"):
                raw += b"\n"  # the line's end, kept on the cut line
                break
        try:
            # A line read in part may end inside a character: not the file's fault.
            text = codecs.getincrementaldecoder("utf-8")().decode(raw, final=whole)
            ok = True
        except UnicodeDecodeError:
            text, ok = raw.decode("utf-8", errors="replace"), False
        yield _cut_line(text, whole or len(raw) < limit), ok


def _cut_line(line: str, whole: bool = True) -> str:
    """``line`` cut to `MAX_LINE_CHARS` characters with a note (its line break kept) when
    longer, or when only a part of it was read (``whole`` False); else unchanged."""
    end = "\n" if line.endswith("\n") else ""
    if whole and len(line) - len(end) <= MAX_LINE_CHARS:
        return line
    return f"{line[:MAX_LINE_CHARS]}… [line cut at {MAX_LINE_CHARS} characters]{end}"


def _decode(data: bytes) -> tuple[str | None, str]:
    """``(text, encoding)`` of a file's bytes: its `text_encoding` and the text decoded
    from it (a UTF-16 byte-order mark kept as U+FEFF), or None when they do not decode."""
    encoding = text_encoding(data[:4])
    try:
        return data.decode(encoding), encoding
    except UnicodeDecodeError:
        return None, encoding


def _encode(text: str, encoding: str) -> bytes:
    """``text`` as a file's bytes in ``encoding``. UTF-16 keeps its byte-order mark even
    when the model's text dropped it (readers, this one too, need it to know the file)."""
    if encoding != "utf-8" and not text.startswith("\ufeff"):
        text = "\ufeff" + text
    return text.encode(encoding)


def _contents(path: Path) -> bytes | None:
    """The bytes of the regular file ``path``, or None when there is none."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ToolError(FAILED, f"cannot read {path.name}: {exc.strerror}") from None


def _unchanged_since(path: Path, before: bytes | None, rel: str) -> None:
    """Refuse to apply a change proposed from ``before`` (None: no file) to the resolved
    ``path`` when the file now holds something else (it changed while the user was
    asked: an editor saved it, and writing would silently drop that change) or the path
    no longer resolves to itself (a directory on it became a symlink: writing would
    follow it, maybe out of the workspace).

    Raises:
        ToolError: ``failed``, saying nothing was written.
    """
    try:
        moved = path.resolve() != path
    except (OSError, RuntimeError):  # a symlink loop now on the path
        moved = True
    if moved:
        # ``path`` was resolved (no symlink on it) and checked inside the workspace when
        # the change was proposed: a directory on it has been replaced since (by a
        # symlink out of the workspace, say), and writing now would follow it.
        raise ToolError(
            FAILED,
            f"{rel}: a directory on its path was moved or replaced after this change was "
            "proposed (while permission was asked); nothing was written. Check the path "
            "and redo the change.",
        )
    if _contents(path) != before:
        raise ToolError(
            FAILED,
            f"{rel} changed on disk after this change was proposed (while permission was "
            "asked); nothing was written. Read it again and redo the change.",
        )


def _put(path: Path, data: bytes, *, exists: bool) -> None:
    """Write ``data`` as ``path``: an existing file is replaced atomically and keeps its
    permission bits (a full disk or a size limit leaves it whole, never half-written);
    a new one is created with the umask's default mode and removed if the write fails.
    ``path`` is resolved (a symlink's target is what changes, the link stays)."""
    if exists:
        mode = stat.S_IMODE(path.stat().st_mode)
        atomic_write(path, data, tmp=path.with_name(temp_name(path.name)), mode=mode)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_durable(path, data, mode=0o666)


def _diff(old: str | None, new: str, rel: str, max_lines: int = 80) -> str:
    """Unified diff of a change, capped at ``max_lines`` lines (for the permission prompt).

    A last line without its newline is followed by git's ``\\ No newline at end of
    file``: else a change that only adds or drops the final newline reads ``-b``/``+b``,
    as if nothing changed."""
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
    return cap(
        "".join(
            line if line.endswith("\n") else f"{line}\n\\ No newline at end of file\n"
            for line in lines
        )
    )


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
