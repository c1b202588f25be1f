"""The agent's permission model: what runs freely, what asks, what is refused.

- Every path a tool touches must resolve inside the workspace, for every tool,
  reads included. ``..``, absolute paths and symlinks are resolved first
  (``Path.resolve``), so none of them can step outside.
- Reads (``read``, ``list``, ``search``, ``more``) and job polling run freely.
- ``write``, ``edit`` and ``bash`` ask the user through a callback
  ``ask(tool, summary) -> "once" | "always" | "deny"``; ``"always"`` allows that
  tool for the rest of the session. ``yes=True`` (the CLI's ``--yes``) allows all.
  Without a callback and without ``yes``, asking tools are denied (fail safe for
  non-interactive use).

Note: ``bash`` commands are not path-checked (a shell can reach anything); that is
what asking before running them is for.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

Decision = Literal["once", "always", "deny"]
AskFn = Callable[[str, str], str]

#: Tools that need the user's permission (unless ``yes`` or an earlier "always").
ASKING_TOOLS: frozenset[str] = frozenset({"write", "edit", "bash"})
# MCP tools (``mcp__SERVER__TOOL``) ask like bash: a server's readOnlyHint is not trusted.
ASKING_PREFIXES: tuple[str, ...] = ("mcp__",)


class PathOutsideWorkspace(ValueError):
    """A tool path that resolves outside the workspace (or cannot be resolved)."""

    def __init__(self, path: str, resolved: Path | None, workspace: Path, reason: str = "") -> None:
        self.path = path
        self.resolved = resolved
        self.workspace = workspace
        where = f" (resolves to {resolved})" if resolved is not None else ""
        why = reason or f"it is outside the workspace {workspace}"
        super().__init__(f"path {path!r}{where} refused: {why}")


def resolve_in_workspace(workspace: Path, path: str | os.PathLike[str]) -> Path:
    """Resolve ``path`` (relative to ``workspace``, or absolute) and require it inside.

    Symlinks (also dangling ones and ones in parent directories) and ``..`` are
    resolved before the check; the file need not exist. ``~`` is expanded so the
    error names the real target.

    Returns:
        The resolved absolute path (inside the resolved workspace).

    Raises:
        PathOutsideWorkspace: the path resolves outside the workspace, or is not a
            valid path (e.g. contains a NUL byte).
    """
    root = Path(workspace).resolve()
    raw = os.fspath(path)
    try:
        candidate = Path(raw).expanduser()
        resolved = (root / candidate).resolve()  # an absolute candidate replaces root
    except (ValueError, OSError, RuntimeError) as exc:  # NUL byte, symlink loop
        raise PathOutsideWorkspace(raw, None, root, f"cannot resolve it ({exc})") from None
    if not resolved.is_relative_to(root):
        raise PathOutsideWorkspace(raw, resolved, root)
    return resolved


class QuestionInterrupted(KeyboardInterrupt):
    """Ctrl+C while a permission question was on screen: the call was not run (unlike a
    Ctrl+C while a tool runs, whose outcome is unknown)."""


class Permissions:
    """Per-session permission state.

    Args:
        ask: callback ``ask(tool, summary) -> "once" | "always" | "deny"``. ``summary``
            is a human-readable description of the action (first line short, further
            lines may hold a diff or the full command). Any other return value counts
            as "deny". Exceptions it raises (e.g. ``KeyboardInterrupt``) propagate.
        yes: allow everything without asking (``--yes``).
        asking_tools: names of tools that need permission.
    """

    def __init__(
        self,
        ask: AskFn | None = None,
        *,
        yes: bool = False,
        asking_tools: Iterable[str] = ASKING_TOOLS,
    ) -> None:
        self.ask = ask
        self.yes = yes
        self.asking_tools = frozenset(asking_tools)
        self._always: set[str] = set()

    @property
    def always(self) -> frozenset[str]:
        """Tools the user allowed for the rest of this session."""
        return frozenset(self._always)

    def needs_ask(self, tool: str) -> bool:
        """True if running ``tool`` now would ask the user."""
        asking = tool in self.asking_tools or tool.startswith(ASKING_PREFIXES)
        return asking and not self.yes and tool not in self._always

    def request(self, tool: str, summary: str) -> bool:
        """Decide whether ``tool`` may perform the action ``summary``; ask if needed.

        Returns:
            True if allowed (free tool, ``yes``, earlier "always", or the user said
            "once"/"always"); False if denied or no ``ask`` callback is set.
        """
        if not self.needs_ask(tool):
            return True
        if self.ask is None:
            return False
        try:
            decision = self.ask(tool, summary)
        except KeyboardInterrupt as e:
            raise QuestionInterrupted from e
        if decision == "always":
            self._always.add(tool)
            return True
        return decision == "once"

    def reset(self) -> None:
        """Forget "always" answers (a new session)."""
        self._always.clear()
