"""The ``search`` tool: a Python regular expression over the workspace's text files.

Output is ``path:line: text`` per matching line (paths relative to the workspace,
1-based lines, long lines cut), in walk order: directories and files name-sorted,
``.git`` skipped, symlinked directories not followed, symlinks out of the workspace
ignored, binary files and files over 10 MB skipped and counted.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds4mlx.agent.tools.common import (
    INVALID_ARGUMENTS,
    NOT_FOUND,
    SKIP_DIRS,
    Result,
    ToolError,
    Workspace,
    is_binary,
)
from ds4mlx.agent.tools.schema import PATH_DESC, object_schema
from ds4mlx.dsml.conversation import ToolSpec

MAX_SEARCH_FILE_BYTES = 10 << 20
MAX_MATCH_LINE_CHARS = 300

SEARCH_SPEC = ToolSpec(
    "search",
    "Search file contents with a Python regular expression, line by line. Returns "
    "path:line: text for each match. Skips binary files, .git and files over 10 MB.",
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


def search(ws: Workspace, a: dict[str, Any]) -> Result:
    """Run ``search`` with validated arguments ``a`` (defaults filled in).

    Raises:
        ToolError: ``invalid_arguments`` for a bad regex or glob, ``not_found`` for a
            missing path.
        PathOutsideWorkspace: ``path`` resolves outside the workspace.
    """
    try:
        regex = re.compile(a["pattern"], re.IGNORECASE if a["ignore_case"] else 0)
    except re.error as exc:
        raise ToolError(
            INVALID_ARGUMENTS, f"invalid regular expression {a['pattern']!r}: {exc}"
        ) from None
    base = ws.path(a["path"])
    rel = ws.rel(base)
    if not base.exists():
        raise ToolError(NOT_FOUND, f"no such file or directory: {rel}")
    scan = _Scan(ws, regex, a["max_results"])
    for p in _candidates(ws, base, a.get("glob")):
        if scan.full:
            break
        scan.file(p)
    return scan.result(a["pattern"], rel)


def _candidates(ws: Workspace, base: Path, glob: str | None) -> Iterator[Path]:
    """The files to search under ``base`` (or ``base`` itself), in output order."""
    if base.is_file():
        yield base
    elif glob:
        yield from (p for p in ws.glob(base, glob) if p.is_file())
    else:
        for root, dirs, files in os.walk(base, followlinks=False):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            for name in sorted(files):
                yield Path(root, name)


@dataclass
class _Scan:
    """Matching lines found so far, and counts of what was searched or skipped."""

    ws: Workspace
    regex: re.Pattern[str]
    max_results: int
    out: list[str] = field(default_factory=list)
    searched: int = 0
    binary: int = 0
    large: int = 0
    matched_files: int = 0

    @property
    def full(self) -> bool:
        return len(self.out) >= self.max_results

    def file(self, p: Path) -> None:
        """Search one candidate; unreadable files and ones leaving the workspace are skipped."""
        if not self.ws.contains(p):
            return  # a symlink out of the workspace: not ours to read
        try:
            st = p.stat()
            if not stat.S_ISREG(st.st_mode):
                return
            if st.st_size > MAX_SEARCH_FILE_BYTES:
                self.large += 1
                return
            if is_binary(p):
                self.binary += 1
                return
            self.searched += 1
            self.matched_files += self._grep(p)
        except OSError:
            return

    def _grep(self, p: Path) -> bool:
        """Append the matching lines of ``p`` (up to ``max_results``); True if any."""
        prel = self.ws.rel(p)
        hit = False
        with open(p, encoding="utf-8", errors="replace", newline="\n") as f:
            for no, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if not self.regex.search(line):
                    continue
                hit = True
                if len(line) > MAX_MATCH_LINE_CHARS:
                    line = line[:MAX_MATCH_LINE_CHARS] + "…"
                self.out.append(f"{prel}:{no}: {line}")
                if self.full:
                    break
        return hit

    def result(self, pattern: str, rel: str) -> Result:
        skipped = []
        if self.binary:
            skipped.append(f"{self.binary} binary")
        if self.large:
            skipped.append(f"{self.large} over {MAX_SEARCH_FILE_BYTES >> 20} MB")
        skip_note = f"; skipped {', '.join(skipped)}" if skipped else ""
        if not self.out:
            return Result(
                f"no matches for {pattern!r} in {rel} ({self.searched} files searched{skip_note})"
            )
        stop_note = (
            f"; stopped at max_results={self.max_results}, narrow the search or raise max_results"
            if self.full
            else ""
        )
        n = len(self.out)
        after = f"[{n} matching lines in {self.matched_files} files{skip_note}{stop_note}]"
        return Result("\n".join(self.out) + "\n", after=after)
