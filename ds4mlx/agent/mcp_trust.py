"""Approval of a workspace's own ``.mcp.json`` before its servers start.

A stdio MCP server is a command the agent runs at start-up, before any prompt: a
repository's ``.mcp.json`` would otherwise run whatever it names as soon as someone starts
``ds4mlx agent`` in a clone of it. So a workspace's file is started only once the user
approved it (Claude Code asks the same of a project's servers):

- the permission question shows each server's command line or URL; ``once`` starts them
  this time, ``always`` also records the approval, ``deny`` starts none;
- an approval is of the file's path *and* its bytes (SHA-256): an edited file is asked
  about again;
- without a terminal to ask (``-p`` in a script) none start, with a warning naming the
  two ways to allow them. ``--yes`` does not: it answers the model's tool calls, and this
  runs before the model says anything. ``--mcp-config FILE`` is the user's own choice and
  needs no approval.

Approvals live in ``$XDG_CONFIG_HOME/ds4mlx/trusted-mcp.json`` (``~/.config/…``), a JSON
object of absolute path → digest, written atomically.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable
from pathlib import Path

from ds4mlx.agent.mcp import McpConfig
from ds4mlx.fsutil import atomic_write

# What the permission question names (the tool slot of ``AgentUI.ask``).
QUESTION = "the workspace's MCP servers"


def trust_file() -> Path:
    """``$XDG_CONFIG_HOME/ds4mlx/trusted-mcp.json`` (``~/.config/…`` by default)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "ds4mlx" / "trusted-mcp.json"


def _approvals() -> dict[str, str]:
    """The recorded approvals (path → digest); an unreadable or malformed file is none."""
    try:
        data = json.loads(trust_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def is_approved(path: Path, digest: str) -> bool:
    """Whether the file at ``path`` was approved with exactly these bytes (``digest``)."""
    return _approvals().get(str(path.resolve())) == digest


def record(path: Path, digest: str) -> None:
    """Record the approval of ``path`` at ``digest`` (replacing an older one).

    Raises:
        OSError: the approvals file cannot be written.
    """
    approvals = _approvals()
    approvals[str(path.resolve())] = digest
    final = trust_file()
    final.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(approvals, indent=1, sort_keys=True).encode()
    atomic_write(final, data, tmp=final.with_name(f".{final.name}.{os.getpid()}.tmp"))


def describe(config: McpConfig) -> str:
    """One line per server: ``NAME: command line`` (shell-quoted) or ``NAME: URL``."""
    lines = []
    for s in config.servers:
        target = s.url if s.url else shlex.join([s.command or "", *s.args])
        lines.append(f"{s.name}: {target}")
    return "\n".join(lines)


def approve(
    config: McpConfig,
    path: Path,
    ask: Callable[[str, str], str] | None,
    warn: Callable[[str], None],
) -> bool:
    """Whether to start the servers of the workspace file ``path`` (parsed as ``config``,
    read with digest ``config.digest``): recorded, else asked (``ask``: the UI's
    permission question, or None without a terminal). A refusal warns once.
    """
    if not config.servers or is_approved(path, config.digest):
        return True
    if ask is not None:
        decision = ask(QUESTION, f"{path} starts:\n{describe(config)}")
        if decision == "always":
            try:
                record(path, config.digest)
            except OSError as e:
                warn(f"cannot record the approval of {path} ({e}); asked again next time")
        if decision in ("once", "always"):
            return True
        warn(f"MCP servers of {path} not started (denied)")
        return False
    warn(
        f"MCP servers of {path} not started: approve them once in an interactive "
        f"session, or pass --mcp-config {path}"
    )
    return False
