"""The agent's tools (a package): `registry` (``Toolbox``: specs and the dispatcher),
`schema` (argument validation), `files`, `search`, `shell` (the tools), `common`
(shared results and errors), `background` (background shell jobs).

The names the agent loop and its tests use are re-exported from `registry`.
"""

from ds4mlx.agent.tools.registry import (
    EXIT_STATUS,
    FAILED,
    INVALID_ARGUMENTS,
    NOT_FOUND,
    PATH_OUTSIDE_WORKSPACE,
    PERMISSION_DENIED,
    TIMEOUT,
    TOOL_SPECS,
    UNKNOWN_TOOL,
    Toolbox,
    ToolError,
    ToolOutcome,
    clean_terminal_output,
)

__all__ = [
    "EXIT_STATUS",
    "FAILED",
    "INVALID_ARGUMENTS",
    "NOT_FOUND",
    "PATH_OUTSIDE_WORKSPACE",
    "PERMISSION_DENIED",
    "TIMEOUT",
    "TOOL_SPECS",
    "UNKNOWN_TOOL",
    "ToolError",
    "ToolOutcome",
    "Toolbox",
    "clean_terminal_output",
]
