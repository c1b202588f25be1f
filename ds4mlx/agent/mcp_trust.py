"""Approval of a workspace's own ``.mcp.json`` before its servers start.

A stdio MCP server is a command the agent runs at start-up, before any prompt: a
repository's ``.mcp.json`` would otherwise run whatever it names as soon as someone starts
``ds4mlx agent`` in a clone of it. So a workspace's file is started only once the user
approved it (Claude Code asks the same of a project's servers):

- the permission question shows everything a server is started with: its command line
  with the environment it sets (``PYTHONPATH``, ``LD_PRELOAD`` or ``NODE_OPTIONS`` run
  other code), or its URL with the headers; ``once`` starts them this time, ``always``
  also records the approval, ``deny`` starts none;
- an approval is of the file's place *and* its bytes (SHA-256): an edited file is asked
  about again. The place is the workspace's own ``.mcp.json`` (its folder resolved, the
  file not): the servers start in the workspace, so a relative command runs that
  workspace's files, and a repository whose ``.mcp.json`` links to a file approved
  elsewhere is asked about;
- without a terminal to ask (``-p`` in a script) none start, with a warning naming the
  two ways to allow them. ``--yes`` does not: it answers the model's tool calls, and this
  runs before the model says anything. ``--mcp-config FILE`` is the user's own choice and
  needs no approval.

Approvals live in ``$XDG_CONFIG_HOME/ds4mlx/trusted-mcp.json`` (``~/.config/…``), a JSON
object of place (absolute path) → digest, written atomically.
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


def _place(path: Path) -> str:
    """The approval key of a workspace's config ``path``: its folder resolved (the
    workspace the servers start in), its own name kept (not a link's target)."""
    return str(path.absolute().parent.resolve() / path.name)


def is_approved(path: Path, digest: str) -> bool:
    """Whether the file at ``path`` was approved there with exactly these bytes
    (``digest``)."""
    return _approvals().get(_place(path)) == digest


def record(path: Path, digest: str) -> None:
    """Record the approval of ``path`` at ``digest`` (replacing an older one).

    Raises:
        OSError: the approvals file cannot be written.
    """
    approvals = _approvals()
    approvals[_place(path)] = digest
    final = trust_file()
    final.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(approvals, indent=1, sort_keys=True).encode()
    atomic_write(final, data, tmp=final.with_name(f".{final.name}.{os.getpid()}.tmp"))


def describe(config: McpConfig) -> str:
    """One line per server, all it is started with: ``NAME: [VAR=value …] command line``
    (shell-quoted, as a shell would run it) or ``NAME: URL (header K: v, …)``."""
    lines = []
    for s in config.servers:
        if s.url:
            sent = ", ".join(f"header {k}: {shlex.quote(v)}" for k, v in s.headers.items())
            target = f"{s.url} ({sent})" if sent else s.url
        else:
            env = [f"{k}={v}" for k, v in s.env.items()]
            target = shlex.join([*env, s.command or "", *s.args])
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
