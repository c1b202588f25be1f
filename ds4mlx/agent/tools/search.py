"""The ``search`` tool: a Python regular expression over the workspace's text files.

Output is ``path:line: text`` per matching line (paths relative to the workspace,
1-based lines, long lines cut), in walk order: directories and files name-sorted,
``.git`` skipped, symlinked directories not followed, symlinks out of the workspace
ignored, binary files and files over 10 MB skipped and counted.

Paths that ``.gitignore`` files ignore (git's rules, read with ``pathspec``: every
``.gitignore`` from the workspace root down, deeper files first, and
``.git/info/exclude``) are skipped and counted unless ``include_ignored`` is set: in a
real repository the vendored and built trees would otherwise fill ``max_results``
before the sources. A file named directly as ``path`` is always searched.

Patterns run on the ``regex`` module (a superset of ``re``) with a time limit: a
pattern that backtracks without end (``(a|aa)+$``) stops the search with what it
found, instead of freezing the agent.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pathspec
import regex

from ds4mlx.agent.tools.common import (
    INVALID_ARGUMENTS,
    NOT_FOUND,
    SKIP_DIRS,
    Result,
    ToolError,
    Workspace,
    one_line,
    sniff_encoding,
)
from ds4mlx.agent.tools.schema import PATH_DESC, object_schema
from ds4mlx.dsml.conversation import ToolSpec

MAX_SEARCH_FILE_BYTES = 10 << 20
MAX_MATCH_LINE_CHARS = 300
#: Seconds one search may take (walk and matching together) before it stops with
#: what it found.
SEARCH_TIME_S = 20.0

SEARCH_SPEC = ToolSpec(
    "search",
    "Search file contents with a Python regular expression, line by line. Returns "
    "path:line: text for each match. Skips binary files, .git, files over 10 MB and "
    "paths .gitignore ignores (include_ignored=true searches those too).",
    object_schema(
        {
            "pattern": {"type": "string", "minLength": 1, "description": "Python regex."},
            "path": {
                "type": "string",
                "default": ".",
                "description": "File or directory to search. " + PATH_DESC,
            },
            "glob": {
                "type": "string",
                "minLength": 1,
                "description": 'Only files matching this glob, e.g. "*.py" or "src/**/*.ts".',
            },
            "ignore_case": {"type": "boolean", "default": False},
            "include_ignored": {
                "type": "boolean",
                "default": False,
                "description": "Also search paths that .gitignore files ignore.",
            },
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
)


class GitIgnores:
    """The ``.gitignore`` rules of a workspace, read lazily per directory.

    Args:
        root: the workspace root (resolved); its ``.git/info/exclude`` counts as the
            outermost rules.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._specs: dict[Path, pathspec.GitIgnoreSpec | None] = {}
        self._dirs: dict[Path, bool] = {}
        self.skipped = 0  # paths left out, for the result's note

    def _spec(self, d: Path, name: str = ".gitignore") -> pathspec.GitIgnoreSpec | None:
        key = d / name
        if key not in self._specs:
            try:
                lines = key.read_text(encoding="utf-8", errors="replace").splitlines()
                self._specs[key] = pathspec.GitIgnoreSpec.from_lines(lines)
            except (OSError, ValueError):  # absent, unreadable, or a bad pattern
                self._specs[key] = None
        return self._specs[key]

    def _rules(self, d: Path) -> list[tuple[Path, pathspec.GitIgnoreSpec]]:
        """``(directory, spec)`` that apply to entries of ``d``, deepest first."""
        out = []
        for a in (d, *d.parents):
            spec = self._spec(a)
            if spec is not None:
                out.append((a, spec))
            if a == self.root:
                break
        exclude = self._spec(self.root / ".git" / "info", "exclude")
        if exclude is not None:
            out.append((self.root, exclude))
        return out

    def ignored(self, p: Path, is_dir: bool) -> bool:
        """Whether git would ignore ``p`` (inside the root), its own rules deciding: the
        deepest file with a matching pattern wins, and its last such pattern."""
        for d, spec in self._rules(p.parent):
            rel = p.relative_to(d).as_posix() + ("/" if is_dir else "")
            hit = spec.check_file(rel).include
            if hit is not None:
                return hit
        return False

    def hidden(self, p: Path, base: Path, is_dir: bool = False) -> bool:
        """Whether ``p`` (under ``base``) or a directory between ``base`` and it is
        ignored (git never looks inside an ignored directory)."""
        for d in reversed(p.relative_to(base).parents[:-1]):
            full = base / d
            if full not in self._dirs:
                self._dirs[full] = self.ignored(full, True)
            if self._dirs[full]:
                return True
        return self.ignored(p, is_dir)


def search(ws: Workspace, a: dict[str, Any]) -> Result:
    """Run ``search`` with validated arguments ``a`` (defaults filled in).

    Raises:
        ToolError: ``invalid_arguments`` for a bad regex or glob, ``not_found`` for a
            missing path.
        PathOutsideWorkspace: ``path`` resolves outside the workspace.
    """
    try:
        pattern = regex.compile(a["pattern"], regex.IGNORECASE if a["ignore_case"] else 0)
    except (regex.error, ValueError) as exc:
        raise ToolError(
            INVALID_ARGUMENTS, f"invalid regular expression {a['pattern']!r}: {exc}"
        ) from None
    base = ws.path(a["path"])
    rel = ws.rel(base)
    if not base.exists():
        raise ToolError(NOT_FOUND, f"no such file or directory: {rel}")
    ignores = None if a.get("include_ignored") else GitIgnores(ws.root)
    if ignores is not None and base != ws.root and ignores.hidden(base, ws.root, base.is_dir()):
        ignores = None  # asked for by name (``node_modules``): searched whole
    scan = _Scan(ws, pattern, a["max_results"], time.monotonic() + SEARCH_TIME_S)
    for p in _candidates(ws, base, a.get("glob"), ignores):
        if scan.full or scan.stopped:
            break
        scan.file(p)
    return scan.result(a["pattern"], rel, ignores.skipped if ignores else 0)


def _candidates(
    ws: Workspace, base: Path, glob: str | None, ignores: GitIgnores | None
) -> Iterator[Path]:
    """The files to search under ``base`` (or ``base`` itself), in output order, less
    what ``ignores`` leaves out (counted in ``ignores.skipped``)."""
    if base.is_file():
        yield base
    elif glob:
        for p in ws.glob(base, glob):
            if not p.is_file():
                continue
            if ignores is not None and ignores.hidden(p, base):
                ignores.skipped += 1
                continue
            yield p
    else:
        for root, dirs, files in os.walk(base, followlinks=False):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            if ignores is not None:
                kept_dirs = [d for d in dirs if not ignores.ignored(Path(root, d), True)]
                kept = [f for f in files if not ignores.ignored(Path(root, f), False)]
                ignores.skipped += len(dirs) - len(kept_dirs) + len(files) - len(kept)
                dirs[:], files = kept_dirs, kept
            for name in sorted(files):
                yield Path(root, name)


def excerpt(line: str, start: int, width: int = MAX_MATCH_LINE_CHARS) -> str:
    """``line`` cut to ``width`` characters around the match that starts at ``start``.

    A long line (minified code, a data file) is shown from a little before the match, not
    from its start: cut at column ``width``, a hit at column 5,000 showed none of itself.
    Each cut is marked ``…``; a match longer than ``width`` shows its first characters.
    """
    if len(line) <= width:
        return line
    first = max(0, min(start - min(width // 4, start), len(line) - width))
    cut = line[first : first + width]
    return ("…" if first else "") + cut + ("…" if first + width < len(line) else "")


@dataclass
class _Scan:
    """Matching lines found so far, and counts of what was searched or skipped."""

    ws: Workspace
    pattern: regex.Pattern
    max_results: int
    deadline: float  # time.monotonic() second the search stops at
    out: list[str] = field(default_factory=list)
    stopped: bool = False  # past the deadline
    searched: int = 0
    binary: int = 0
    large: int = 0
    matched_files: int = 0

    @property
    def full(self) -> bool:
        return len(self.out) >= self.max_results

    def file(self, p: Path) -> None:
        """Search one candidate; unreadable files and ones leaving the workspace are skipped."""
        if time.monotonic() >= self.deadline:
            self.stopped = True
            return
        if not self.ws.contains(p):
            return  # a symlink out of the workspace: not ours to read
        try:
            st = p.stat()
            if not stat.S_ISREG(st.st_mode):
                return
            if st.st_size > MAX_SEARCH_FILE_BYTES:
                self.large += 1
                return
            encoding = sniff_encoding(p)
            if encoding is None:
                self.binary += 1
                return
            self.searched += 1
            self.matched_files += self._grep(p, encoding)
        except OSError:
            return

    def _grep(self, p: Path, encoding: str) -> bool:
        """Append the matching lines of ``p``, text in ``encoding`` (up to
        ``max_results``); True if any."""
        prel = one_line(self.ws.rel(p))
        hit = False
        with open(p, encoding=encoding, errors="replace", newline="\n") as f:
            for no, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                try:
                    left = max(self.deadline - time.monotonic(), 1e-3)
                    found = self.pattern.search(line, timeout=left)
                except TimeoutError:
                    self.stopped = True
                    break
                if not found:
                    continue
                hit = True
                self.out.append(f"{prel}:{no}: {excerpt(line, found.start())}")
                if self.full:
                    break
        return hit

    def result(self, pattern: str, rel: str, ignored: int = 0) -> Result:
        """The tool's result; ``ignored``: paths .gitignore left out."""
        skipped = []
        if self.binary:
            skipped.append(f"{self.binary} binary")
        if self.large:
            skipped.append(f"{self.large} over {MAX_SEARCH_FILE_BYTES >> 20} MB")
        if ignored:
            skipped.append(f"{ignored} paths .gitignore ignores (include_ignored=true)")
        skip_note = f"; skipped {', '.join(skipped)}" if skipped else ""
        stop_note = ""
        if self.stopped:
            stop_note = (
                f"; stopped after the {SEARCH_TIME_S:g} s limit: the rest was not searched "
                "(a pattern with nested repetition can backtrack without end: simplify it, "
                "or narrow path or glob)"
            )
        elif self.full:
            stop_note = (
                f"; stopped at max_results={self.max_results}, narrow the search or raise "
                "max_results"
            )
        if not self.out:
            return Result(
                f"no matches for {pattern!r} in {rel} "
                f"({self.searched} files searched{skip_note}{stop_note})"
            )
        n = len(self.out)
        after = f"[{n} matching lines in {self.matched_files} files{skip_note}{stop_note}]"
        return Result("\n".join(self.out) + "\n", after=after)
