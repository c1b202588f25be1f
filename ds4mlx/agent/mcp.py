"""MCP servers' tools for the agent, through the official ``mcp`` SDK (optional extra).

Configuration is Claude Code's ``mcpServers`` JSON (``.mcp.json`` in the workspace, or
``--mcp-config FILE``)::

    {"mcpServers": {
        "files": {"command": "python", "args": ["server.py"], "env": {"ROOT": "."}},
        "web":   {"type": "http", "url": "http://127.0.0.1:8000/mcp", "headers": {…}}},
     "allow": ["mcp__files__*"], "deny": ["mcp__web__delete*"]}

Each server's tools are discovered once, before the first prompt (so they are part of
the cached prompt prefix), and offered as ``mcp__SERVER__TOOL`` — those matching an
``allow`` pattern if any is given, and no ``deny`` pattern (``fnmatch`` patterns on the
qualified name). A stdio server runs in the workspace with :func:`~ds4mlx.agent.
child_env.child_env` (its ``env`` table set over it); its stderr goes to a log file. A
server that will not start, or a discovery or call past ``timeout`` seconds, is a
warning or an error result: the agent goes on without it.

The SDK is async: :class:`McpClient` runs it on its own anyio event loop in a thread
(``anyio.from_thread.start_blocking_portal``); each server's connection lives in one
task there, and the agent's thread calls through the portal.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import logging
import re
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ds4mlx.agent.child_env import EnvPolicy, child_env
from ds4mlx.dsml.conversation import ToolSpec

PREFIX = "mcp__"
DEFAULT_TIMEOUT = 60.0
_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-")
# A tool name as the MCP specification has it (1-128 of A-Z a-z 0-9 _ - .): anything else
# (a space, a quote, a control character) would reach the model's tool list and the
# permission question, and a name given twice would silently replace the first tool.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class McpConfigError(ValueError):
    """The MCP configuration cannot be read or is malformed (one line: file and why)."""


@dataclass(frozen=True)
class ServerConfig:
    """One entry of ``mcpServers``: a stdio command or a streamable-HTTP URL."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"


@dataclass(frozen=True)
class McpConfig:
    """The servers and allow/deny patterns of a config; ``digest``: the SHA-256 (hex) of
    the file's bytes it was parsed from (``""`` when not read from a file), which a
    workspace file's approval names (`ds4mlx.agent.mcp_trust`)."""

    servers: tuple[ServerConfig, ...]
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    digest: str = ""

    def offered(self, qualified: str) -> bool:
        """True if the tool ``mcp__SERVER__TOOL`` passes ``allow`` and ``deny``."""
        if any(fnmatch.fnmatchcase(qualified, p) for p in self.deny):
            return False
        return not self.allow or any(fnmatch.fnmatchcase(qualified, p) for p in self.allow)


def _strings(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise McpConfigError(f"{what} must be an object of strings")
    return dict(value)


def parse_config(data: Any, source: str = "MCP config") -> McpConfig:
    """The :class:`McpConfig` of a decoded ``mcpServers`` JSON document.

    Raises:
        McpConfigError: the shape is wrong (the message names ``source`` and the field).
    """
    if not isinstance(data, dict) or not isinstance(data.get("mcpServers", {}), dict):
        raise McpConfigError(f"{source}: expected an object with an mcpServers object")
    servers = []
    for name, raw in data.get("mcpServers", {}).items():
        where = f"{source}: mcpServers.{name}"
        if not name or not set(name.lower()) <= _NAME_OK or "__" in name:
            raise McpConfigError(f"{where}: server names use letters, digits, - and _")
        if not isinstance(raw, dict):
            raise McpConfigError(f"{where}: expected an object")
        kind = raw.get("type", "http" if "url" in raw else "stdio")
        if kind in ("http", "streamable-http"):
            if not isinstance(raw.get("url"), str):
                raise McpConfigError(f"{where}: type http needs a url string")
            headers = _strings(raw.get("headers"), f"{where}.headers")
            servers.append(ServerConfig(name, url=raw["url"], headers=headers))
        elif kind == "stdio":
            args = raw.get("args", [])
            if not isinstance(raw.get("command"), str) or not (
                isinstance(args, list) and all(isinstance(a, str) for a in args)
            ):
                raise McpConfigError(f"{where}: needs a command string and an args list")
            env = _strings(raw.get("env"), f"{where}.env")
            servers.append(ServerConfig(name, command=raw["command"], args=tuple(args), env=env))
        else:
            raise McpConfigError(f"{where}: unsupported type {kind!r} (stdio or http)")
    pats = {}
    for key in ("allow", "deny"):
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise McpConfigError(f"{source}: {key} must be a list of name patterns")
        pats[key] = tuple(value)
    return McpConfig(tuple(servers), pats["allow"], pats["deny"])


def load_config(path: Path) -> McpConfig:
    """Read and parse an ``mcpServers`` file.

    Raises:
        McpConfigError: unreadable, not JSON, or malformed.
    """
    try:
        # One read: the bytes parsed are the bytes whose digest an approval names.
        raw = Path(path).read_bytes()
        data = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise McpConfigError(f"cannot read MCP config {path}: {e}") from None
    config = parse_config(data, str(path))
    return dataclasses.replace(config, digest=hashlib.sha256(raw).hexdigest())


@dataclass(frozen=True)
class McpTool:
    """A discovered tool: its qualified name, spec for the model, server, own name."""

    spec: ToolSpec
    server: str
    name: str
    read_only_hint: bool = False


@dataclass(frozen=True)
class McpResult:
    """A call's outcome: the text for the model and whether the tool reported an error."""

    text: str
    is_error: bool


def result_text(result: Any) -> McpResult:
    """A ``CallToolResult`` as text: text blocks joined; other content a placeholder."""
    parts = []
    for block in getattr(result, "content", []) or []:
        kind = getattr(block, "type", "?")
        if kind == "text":
            parts.append(block.text)
        else:
            mime = getattr(block, "mime_type", None) or getattr(block, "uri", None) or ""
            parts.append(f"[{kind} content{f' {mime}' if mime else ''} not shown]")
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return McpResult("\n".join(parts), bool(getattr(result, "is_error", False)))


class McpClient:
    """Connections to the configured MCP servers, on one anyio thread.

    Args:
        config: the servers and the allow/deny patterns.
        cwd: directory stdio servers run in (the workspace).
        env_policy: their environment (:mod:`ds4mlx.agent.child_env`).
        timeout: seconds for starting a server plus discovery, and for one call.
        log: where stdio servers' stderr goes (a text file; default: discarded to
            stderr of the agent is avoided, the UI owns it).
        warn: reports a server that could not be used (one line).

    Call :meth:`start` (discovers the tools), then :meth:`call`; :meth:`close` ends
    every connection and the thread.
    """

    def __init__(
        self,
        config: McpConfig,
        *,
        cwd: Path,
        env_policy: EnvPolicy | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        log: TextIO | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.cwd = cwd
        self.env_policy = env_policy
        self.timeout = timeout
        self.log = log
        self.warn = warn or (lambda m: print(f"warning: {m}", file=sys.stderr))
        self.tools: dict[str, McpTool] = {}
        self._sessions: dict[str, Any] = {}
        self._stack = ExitStack()
        self._portal: Any = None
        self._stop: Any = None

    def start(self) -> list[McpTool]:
        """Connect to every server and discover its tools; failures are warnings.

        Returns:
            The offered tools (after allow/deny), in server then tool order.
        """
        import anyio
        from anyio.from_thread import start_blocking_portal

        self._route_sdk_log()

        self._portal = self._stack.enter_context(start_blocking_portal())
        self._stop = self._portal.call(anyio.Event)
        for server in self.config.servers:
            try:
                _, listed = self._portal.start_task(self._serve, server)
            except Exception as e:  # noqa: BLE001 - any failure of one server is a warning
                self.warn(f"MCP server {server.name!r} not available: {_why(e)}")
                continue
            for tool in listed:
                qualified = f"{PREFIX}{server.name}__{tool.name}"
                if not _TOOL_NAME.fullmatch(tool.name) or qualified in self.tools:
                    why = "is given twice" if qualified in self.tools else "is not a valid name"
                    self.warn(f"MCP server {server.name!r}: tool {tool.name!r} {why}; not offered")
                    continue
                if not self.config.offered(qualified):
                    continue
                hint = bool(tool.annotations and tool.annotations.read_only_hint)
                desc = f"[MCP server {server.name}] {tool.description or ''}".strip()
                schema = tool.input_schema or {"type": "object", "properties": {}}
                spec = ToolSpec(qualified, desc, schema)
                self.tools[qualified] = McpTool(spec, server.name, tool.name, hint)
        return list(self.tools.values())

    async def _serve(self, server: ServerConfig, *, task_status: Any) -> None:
        """One server's connection: open, discover, report, then wait for :meth:`close`."""
        import anyio
        from mcp import ClientSession

        # The transport's and the session's task groups must be exited in the task
        # and order they were entered: nested ``async with``, the timeout inside them.
        async with self._transport(server) as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                with anyio.fail_after(self.timeout):
                    await session.initialize()
                    listed = (await session.list_tools()).tools
                self._sessions[server.name] = session
                task_status.started(listed)
                await self._stop.wait()

    def _transport(self, server: ServerConfig) -> Any:
        if server.url:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            client = httpx2.AsyncClient(headers=server.headers, timeout=self.timeout)
            return streamable_http_client(server.url, http_client=client)
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        params = StdioServerParameters(
            command=server.command or "",
            args=list(server.args),
            env=child_env(self.env_policy, extra=server.env),
            cwd=self.cwd,
        )
        return stdio_client(params, errlog=self.log or sys.stderr)

    def call(self, qualified: str, arguments: dict[str, Any]) -> McpResult:
        """Call a discovered tool; a timeout or a protocol error is an error result.

        Raises:
            KeyError: ``qualified`` was not discovered.
        """
        tool = self.tools[qualified]
        session = self._sessions[tool.server]

        async def run() -> Any:
            import anyio

            with anyio.fail_after(self.timeout):
                return await session.call_tool(tool.name, arguments)

        try:
            result = self._portal.call(run)
        except TimeoutError:
            return McpResult(f"MCP call timed out after {self.timeout:g} s", True)
        except Exception as e:  # noqa: BLE001 - the server's failure, reported to the model
            return McpResult(f"MCP call failed: {_why(e)}", True)
        return result_text(result)

    def _route_sdk_log(self) -> None:
        """The SDK's own log (a server's stdout line that is not JSON-RPC: a traceback)
        goes where the servers' stderr goes, not onto the user's terminal, where
        Python's last-resort handler put it over the agent's screen."""
        handler: logging.Handler = (
            logging.StreamHandler(self.log) if self.log is not None else logging.NullHandler()
        )
        sdk = logging.getLogger("mcp")
        sdk.addHandler(handler)
        self._stack.callback(setattr, sdk, "propagate", sdk.propagate)
        self._stack.callback(sdk.removeHandler, handler)
        sdk.propagate = False

    def close(self) -> None:
        """End every connection (stdio servers exit) and the anyio thread."""
        if self._portal is not None and self._stop is not None:
            try:
                self._portal.call(self._stop.set)
            except RuntimeError:
                pass
        self._stack.close()
        self._portal = None


def _why(exc: BaseException) -> str:
    """One line for an exception (an ExceptionGroup's first leaf)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
