"""How a command ended, and what went wrong in a few lines: exit status and diagnostics.

:class:`ExitStatus` is the status ``os.wait4`` reports: an exit code, or the signal that
killed the process and whether the OS wrote a core file (reported, never enabled). A
``bash -c`` whose last command was killed exits ``128 + N``; that code is decoded
(``exit code 139 (its last command was killed by SIGSEGV)``).

:func:`diagnose` reads a failed command's output (stderr and stdout) and returns a
frame of at most :data:`MAX_LINES` lines for the top of the tool result, so the model
sees the cause even when the middle of a long output is cut:

- pytest: the failing test ids with their assertion (the short test summary) and the
  final counts line;
- a Python traceback: the exception and its message, and the innermost frame inside
  the workspace (library frames skipped);
- C/C++ compilers: ``file:line:col: error: message`` lines (gcc, clang);
- Rust: ``error[E…]: message`` with its ``--> file:line:col``, and a runtime panic
  (``thread 'main' panicked at file:line:col:`` and its message).
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

#: Most lines a diagnostic frame has (its header included).
MAX_LINES = 10
_HEADER = "[diagnostic]"


def signal_name(num: int) -> str:
    """``SIGSEGV`` for 11; the number as text for one Python does not know."""
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended.

    Attributes:
        code: exit code (0–255), or None when a signal killed it.
        signal: the signal number that killed it, or None.
        core: the OS reports a core file was written (only with a signal).
    """

    code: int | None
    signal: int | None = None
    core: bool = False

    @classmethod
    def from_wait(cls, raw: int) -> ExitStatus:
        """The status from a raw ``os.wait4``/``waitpid`` status word."""
        if os.WIFSIGNALED(raw):
            return cls(None, os.WTERMSIG(raw), os.WCOREDUMP(raw))
        return cls(os.WEXITSTATUS(raw) if os.WIFEXITED(raw) else 0)

    @property
    def returncode(self) -> int:
        """``subprocess``'s convention: the exit code, or minus the signal number."""
        return -self.signal if self.signal is not None else int(self.code or 0)

    @property
    def ok(self) -> bool:
        return self.code == 0

    def describe(self) -> str:
        """``exit code 2``, ``killed by signal SIGSEGV (core dumped)``, or a decoded 128+N."""
        if self.signal is not None:
            core = " (core dumped)" if self.core else ""
            return f"killed by signal {signal_name(self.signal)}{core}"
        code = int(self.code or 0)
        # bash reports a child killed by signal N as 128+N (a program may exit with
        # such a code itself, hence "its last command").
        if 128 < code < 128 + 65:
            try:
                name = signal.Signals(code - 128).name
            except ValueError:
                return f"exit code {code}"
            return f"exit code {code} (its last command was killed by {name})"
        return f"exit code {code}"


# --- diagnostics --------------------------------------------------------------------

_PYTEST_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$", re.MULTILINE)
_PYTEST_COUNTS = re.compile(
    r"^=*\s*(\d+ (?:failed|error|errors|passed)\b.*? in [\d.]+s.*?)\s*=*$", re.MULTILINE
)
_PY_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+), in (\S+)')
_C_ERROR = re.compile(r"^([^\s:][^:\n]*):(\d+):(\d+): (?:fatal )?error: (.+)$", re.MULTILINE)
_RUST_ERROR = re.compile(r"^(error(?:\[E\d+\])?): (.+)$")
_RUST_AT = re.compile(r"^\s*--> (\S+:\d+:\d+)")
_RUST_PANIC = re.compile(r"^thread '([^']*)'(?: \(\d+\))? panicked at (?:'(.*)', )?(\S+?):?$")


def diagnose(stdout: str, stderr: str, workspace: Path | None = None) -> list[str]:
    """A short frame naming the failure in a command's output; empty if none is found.

    Args:
        stdout: the rendered stdout of the command (all of it that was kept).
        stderr: its rendered stderr.
        workspace: the directory the command ran in; Python frames inside it are
            preferred, and shown relative to it.

    Returns:
        At most :data:`MAX_LINES` lines, the first ``[diagnostic]``; ``[]`` when no
        known failure shape is in the output.
    """
    found: list[str] = []
    for text in (stderr, stdout):
        if not text:
            continue
        found += _pytest(text)
        found += _python(text, workspace)
        found += _c_errors(text)
        found += _rust(text)
    seen: set[str] = set()
    lines = [x for x in found if not (x in seen or seen.add(x))]
    if not lines:
        return []
    if len(lines) > MAX_LINES - 1:
        lines = lines[: MAX_LINES - 2] + [f"… {len(lines) - (MAX_LINES - 2)} more"]
    return [_HEADER, *lines]


def _pytest(text: str) -> list[str]:
    out = []
    for kind, test_id, msg in _PYTEST_SUMMARY.findall(text):
        out.append(f"pytest {kind.lower()}: {test_id}" + (f" - {msg}" if msg else ""))
    if out:
        counts = _PYTEST_COUNTS.findall(text)
        if counts:
            out.append(f"pytest: {counts[-1]}")
    return out


def _python(text: str, workspace: Path | None) -> list[str]:
    start = text.rfind("Traceback (most recent call last):")
    if start < 0:
        return []
    frames: list[tuple[str, str, str]] = []
    exc = ""
    for line in text[start:].splitlines()[1:]:
        m = _PY_FRAME.match(line)
        if m:
            frames.append(m.groups())
        elif line and not line[0].isspace():
            exc = line.strip()  # the first unindented line after the frames
            break
    if not exc:
        return []
    out = [f"python: {exc}"]
    where = _innermost(frames, workspace)
    if where:
        out.append(f"  at {where}")
    return out


def _innermost(frames: list[tuple[str, str, str]], workspace: Path | None) -> str:
    """``path:line in func`` of the innermost frame in the workspace (else the last)."""
    if not frames:
        return ""
    chosen = frames[-1]
    shown = chosen[0]
    if workspace is not None:
        for path, line, func in reversed(frames):
            p = Path(path)
            full = p if p.is_absolute() else workspace / p
            try:
                rel = full.resolve().relative_to(workspace.resolve())
            except (ValueError, OSError):
                continue
            if "site-packages" in rel.parts or ".venv" in rel.parts:
                continue
            chosen, shown = (path, line, func), rel.as_posix()
            break
    return f"{shown}:{chosen[1]} in {chosen[2]}"


def _c_errors(text: str) -> list[str]:
    return [f"{f}:{ln}:{col}: error: {msg}" for f, ln, col, msg in _C_ERROR.findall(text)]


def _rust(text: str) -> list[str]:
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _RUST_ERROR.match(line)
        if m and not m.group(2).startswith("aborting due to"):
            at = next((a.group(1) for a in map(_RUST_AT.match, lines[i + 1 : i + 3]) if a), None)
            # A bare "error:" is anyone's (git, pip); rustc's has a --> location.
            if at or m.group(1) != "error":
                out.append(f"rust {m.group(1)}: {m.group(2)}" + (f" at {at}" if at else ""))
            continue
        m = _RUST_PANIC.match(line)
        if m:
            thread, old_msg, where = m.groups()
            msg = old_msg or (lines[i + 1].strip() if i + 1 < len(lines) else "")
            out.append(f"rust panic in thread '{thread}' at {where}: {msg}")
    return out
