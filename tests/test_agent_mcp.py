"""MCP tools in the agent (issue 21 item 8): a real stdio server and a real streamable-HTTP
server (tests/fixtures/mcp_server.py, the official SDK's MCPServer) discovered, filtered by
allow/deny, called through the Toolbox (asked like bash, validated, redacted)."""

from __future__ import annotations

import importlib.util
import io
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Skip when the SDK is missing, without importing it here (seconds, paid by every
# collection): the fixture servers and the client import it when they run.
if importlib.util.find_spec("mcp") is None:
    pytest.skip("the mcp package is not installed", allow_module_level=True)

from server_util import free_port  # noqa: E402

from ds4mlx.agent.child_env import EnvPolicy  # noqa: E402
from ds4mlx.agent.mcp import McpClient, McpConfigError, load_config, parse_config  # noqa: E402
from ds4mlx.agent.permissions import Permissions  # noqa: E402
from ds4mlx.agent.tools import FAILED, INVALID_ARGUMENTS, Toolbox  # noqa: E402

SERVER = str(Path(__file__).parent / "fixtures" / "mcp_server.py")
GH = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"


@pytest.fixture
def http_server():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, SERVER, "http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("MCP HTTP fixture server did not start")
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


@pytest.mark.slow
def test_mcp_stdio_and_http_discovered_filtered_called(
    workspace: Path, http_server: str, monkeypatch
) -> None:
    monkeypatch.setenv("FIXTURE_API_TOKEN", "do-not-pass")
    cfg = parse_config(
        {
            "mcpServers": {
                "local": {"command": sys.executable, "args": [SERVER, "stdio"], "env": {"X": "1"}},
                "remote": {"type": "http", "url": http_server},
                "broken": {"command": str(workspace / "no-such-server")},
            },
            "deny": ["mcp__remote__env_probe", "mcp__remote__leak"],
        }
    )
    warnings: list[str] = []
    log = io.StringIO()
    errlog = open(workspace.parent / "mcp.log", "w")  # noqa: SIM115 - closed below
    client = McpClient(
        cfg, cwd=workspace, env_policy=EnvPolicy(), timeout=60, log=errlog, warn=warnings.append
    )
    try:
        client.start()
        names = sorted(client.tools)
        assert names == [
            "mcp__local__add",
            "mcp__local__env_probe",
            "mcp__local__explode",
            "mcp__local__leak",
            "mcp__remote__add",
            "mcp__remote__explode",
        ]
        assert len(warnings) == 1 and "'broken' not available" in warnings[0]
        asked: list[str] = []
        perms = Permissions(ask=lambda tool, summary: asked.append(tool) or "once")
        with Toolbox(workspace, perms, mcp=client) as tb:
            assert "mcp__remote__add" in [s.name for s in tb.specs]
            out = tb.run("mcp__local__add", {"a": 2, "b": 40})
            assert out.ok and out.text == "42"
            out = tb.run("mcp__remote__add", {"a": 1, "b": 1})
            assert out.ok and out.text == "2"
            assert asked == ["mcp__local__add", "mcp__remote__add"]  # asked like bash
            # Validated against the server's schema before anything is sent.
            out = tb.run("mcp__local__add", {"a": "x"})
            assert not out.ok and out.error == INVALID_ARGUMENTS
            # A raising tool reaches the model as an error result.
            for server in ("local", "remote"):
                out = tb.run(f"mcp__{server}__explode", {"why": "boom"})
                assert not out.ok and out.error == FAILED
                assert out.text.startswith(f"error: mcp__{server}__explode failed:")
            # Output is redacted; the server got child_env's environment plus its own env.
            out = tb.run("mcp__local__leak", {})
            assert GH not in out.text and "[redacted: GitHub Token]" in out.text
            assert tb.run("mcp__local__env_probe", {"name": "FIXTURE_API_TOKEN"}).text == "<unset>"
            assert tb.run("mcp__local__env_probe", {"name": "X"}).text == "1"
    finally:
        client.close()
        errlog.close()
    assert "fixture server starting" in (workspace.parent / "mcp.log").read_text()
    assert log.getvalue() == ""


def test_mcp_config_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(McpConfigError, match=r"cannot read MCP config .*bad\.json"):
        load_config(bad)
    with pytest.raises(McpConfigError, match="needs a command string"):
        parse_config({"mcpServers": {"a": {"args": []}}})
    with pytest.raises(McpConfigError, match="server names"):
        parse_config({"mcpServers": {"a__b": {"command": "x"}}})
    cfg = parse_config({"mcpServers": {}, "allow": ["mcp__a__*"], "deny": ["mcp__a__rm"]})
    assert cfg.offered("mcp__a__ls") and not cfg.offered("mcp__a__rm")
    assert not cfg.offered("mcp__b__ls")


# ---------------------------------------------------------------- the agent and its CLI


def _cli(workspace: Path, *extra: str, model: str) -> subprocess.CompletedProcess[str]:
    """``ds4mlx agent`` in ``workspace``, its approvals under ``workspace.parent`` (never
    the user's own ``~/.config``), stdin not a terminal."""
    import os

    env = {**os.environ, "XDG_CONFIG_HOME": str(workspace.parent / "config")}
    return subprocess.run(
        [sys.executable, "-m", "ds4mlx.cli", "agent", "-m", model, "--workspace", str(workspace)]
        + ["--kv-disk-dir", str(workspace.parent / "kv"), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _approve(workspace: Path, monkeypatch) -> None:
    """Record the approval of the workspace's ``.mcp.json`` as `_cli` will read it."""
    from ds4mlx.agent.mcp_trust import record

    monkeypatch.setenv("XDG_CONFIG_HOME", str(workspace.parent / "config"))
    path = workspace / ".mcp.json"
    record(path, load_config(path).digest)


@pytest.mark.slow
def test_mcp_tools_are_in_the_agent_first_prompt_and_called(
    tiny_f32_dir: Path, workspace: Path
) -> None:
    from ds4mlx.agent.loop import Agent
    from ds4mlx.engine import Engine
    from tests.agent_script import RecordingUI, invoke, turn

    cfg = parse_config(
        {"mcpServers": {"local": {"command": sys.executable, "args": [SERVER, "stdio"]}}}
    )
    errlog = open(workspace.parent / "mcp.log", "w")  # noqa: SIM115 - closed below
    client = McpClient(cfg, cwd=workspace, timeout=60, log=errlog)
    client.start()
    engine = Engine.load(tiny_f32_dir, ctx_size=4096)
    script = [turn("Add.", "", invoke("mcp__local__add", a=2, b=3)), turn("Ok.", "Five.")]
    agent = Agent(engine, workspace, ui=RecordingUI(), script=script, yes=True, mcp=client)
    try:
        # Discovered before the first prompt: the tool is in the system prefix.
        assert "mcp__local__add" in agent.render().text
        assert agent.send("add 2 and 3").ok
        assert [m.content for m in agent.messages if m.role == "tool"] == ["5"]
    finally:
        agent.close()
        errlog.close()
    assert client._portal is None  # closed with the agent's toolbox


def test_mcp_cli_bad_config_is_one_line_exit_2(workspace: Path) -> None:
    (workspace / ".mcp.json").write_text('{"mcpServers": {"a": {"args": []}}}')
    r = _cli(workspace, "-p", "x", model=str(workspace / "none"))
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"ds4mlx agent: {workspace / '.mcp.json'}: mcpServers.a: needs a command string "
        "and an args list"
    )
    missing = workspace / "missing.json"
    r = _cli(workspace, "--mcp-config", str(missing), "-p", "x", model=str(workspace / "none"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith(f"ds4mlx agent: cannot read MCP config {missing}")


@pytest.mark.slow
def test_mcp_cli_workspace_config_broken_server_warns_and_agent_goes_on(
    tiny_f32_dir: Path, workspace: Path, monkeypatch
) -> None:
    import json

    from tests.agent_script import invoke, turn

    (workspace / ".mcp.json").write_text(
        json.dumps(
            {
                "mcpServers": {
                    "local": {"command": sys.executable, "args": [SERVER, "stdio"]},
                    "broken": {"command": str(workspace / "no-such-server")},
                }
            }
        )
    )
    _approve(workspace, monkeypatch)
    script = workspace.parent / "script.json"
    script.write_text(
        json.dumps([turn("Add.", "", invoke("mcp__local__add", a=20, b=22)), turn("Ok.", "Sum.")])
    )
    r = _cli(workspace, "--yes", "--script-file", str(script), "-p", "add", model=str(tiny_f32_dir))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "Sum."
    assert "warning: MCP server 'broken' not available" in r.stderr
    assert "42" in r.stderr  # the tool's result, shown in the transcript
    log = (workspace.parent / "kv" / "mcp-servers.log").read_text()
    assert "fixture server starting" in log


@pytest.mark.slow
def test_a_workspace_mcp_json_starts_nothing_until_approved(
    tiny_f32_dir: Path, workspace: Path, monkeypatch
) -> None:
    """A cloned repository's ``.mcp.json`` naming a command ran it at start-up, unasked
    (``-p`` without a terminal, even without ``--yes``). Now: without a terminal nothing
    starts (``--yes`` answers the model's calls, not this) and a warning names the two
    ways to allow it; ``--mcp-config`` (the user's own choice) and a recorded approval of
    these exact bytes start it; an edited file is unapproved again."""
    import json

    from ds4mlx.agent.mcp_trust import approve, is_approved
    from tests.agent_script import turn

    marker = workspace.parent / "PWNED"
    cmd = f"open({str(marker)!r}, 'w').close()"
    config = workspace / ".mcp.json"
    config.write_text(
        json.dumps({"mcpServers": {"pwn": {"command": sys.executable, "args": ["-c", cmd]}}})
    )
    script = workspace.parent / "script.json"
    script.write_text(json.dumps([turn("Hi.", "Hello.")]))
    run = ("--script-file", str(script), "-p", "hi")
    r = _cli(workspace, "--yes", *run, model=str(tiny_f32_dir))
    assert r.returncode == 0 and r.stdout.strip() == "Hello.", r.stderr
    assert not marker.exists()
    assert (
        f"warning: MCP servers of {config} not started: approve them once in an interactive "
        f"session, or pass --mcp-config {config}"
    ) in r.stderr
    r = _cli(workspace, "--mcp-config", str(config), *run, model=str(tiny_f32_dir))
    assert r.returncode == 0 and marker.exists(), r.stderr
    marker.unlink()

    monkeypatch.setenv("XDG_CONFIG_HOME", str(workspace.parent / "config"))
    asked: list[tuple[str, str]] = []
    warnings: list[str] = []

    def answer(word: str):
        def ask(tool: str, summary: str) -> str:
            asked.append((tool, summary))
            return word

        return ask

    cfg = load_config(config)
    assert not approve(cfg, config, answer("deny"), warnings.append)
    assert approve(cfg, config, answer("once"), warnings.append)
    assert not is_approved(config, cfg.digest)
    assert approve(cfg, config, answer("always"), warnings.append)
    assert is_approved(config, cfg.digest) and len(asked) == 3
    assert asked[0][1] == f"{config} starts:\npwn: {sys.executable} -c {shlex_quote(cmd)}"
    assert approve(cfg, config, None, warnings.append) and len(asked) == 3  # recorded
    r = _cli(workspace, *run, model=str(tiny_f32_dir))
    assert r.returncode == 0 and marker.exists(), r.stderr
    marker.unlink()
    config.write_text(config.read_text().replace("pwn", "pwn2"))
    assert not is_approved(config, load_config(config).digest)
    r = _cli(workspace, *run, model=str(tiny_f32_dir))
    assert r.returncode == 0 and not marker.exists(), r.stderr
    assert warnings == [f"MCP servers of {config} not started (denied)"]


def test_an_approval_is_of_its_workspace_and_the_question_shows_everything_run(
    tmp_path: Path, monkeypatch
) -> None:
    """An approval was keyed by the file's resolved path: a repository whose
    ``.mcp.json`` is a symlink to an approved file ran its own ``run.sh`` (the servers
    start in the workspace) unasked. And the question showed the command line only,
    not the ``env`` it runs with (``PYTHONPATH``, ``LD_PRELOAD``, ``NODE_OPTIONS`` can
    run other code) nor an HTTP server's headers."""
    import json

    from ds4mlx.agent.mcp_trust import approve, describe

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    a, b = tmp_path / "ws_a", tmp_path / "ws_b"
    a.mkdir()
    b.mkdir()
    servers = {
        "tools": {"command": "bash", "args": ["run.sh"], "env": {"PYTHONPATH": ".cache"}},
        "web": {"type": "http", "url": "http://127.0.0.1:9/mcp", "headers": {"X-K": "v 1"}},
    }
    (a / ".mcp.json").write_text(json.dumps({"mcpServers": servers}))
    (b / ".mcp.json").symlink_to(a / ".mcp.json")
    asked: list[str] = []

    def ask(tool: str, summary: str) -> str:
        asked.append(summary)
        return "always"

    cfg = load_config(a / ".mcp.json")
    assert approve(cfg, a / ".mcp.json", ask, print) and len(asked) == 1
    assert not approve(load_config(b / ".mcp.json"), b / ".mcp.json", None, lambda w: None)
    assert approve(cfg, a / ".mcp.json", None, print)  # still approved where it was
    assert describe(cfg) == (
        "tools: PYTHONPATH=.cache bash run.sh\nweb: http://127.0.0.1:9/mcp (header X-K: 'v 1')"
    )


def shlex_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def test_mcp_tools_without_properties_are_called_and_bad_names_are_left_out(
    workspace: Path,
) -> None:
    """A tool without arguments (input schema ``{"type": "object"}``, no ``properties``)
    is validated and called; a tool name the MCP specification does not allow (a space,
    an escape, 129 characters) or a name given twice is not offered, with a warning."""
    raw = str(Path(__file__).parent / "fixtures" / "mcp_raw_server.py")
    cfg = parse_config({"mcpServers": {"raw": {"command": sys.executable, "args": [raw]}}})
    warnings: list[str] = []
    errlog = open(workspace.parent / "mcp.log", "w")  # noqa: SIM115 - closed below
    client = McpClient(
        cfg, cwd=workspace, env_policy=EnvPolicy(), timeout=60, log=errlog, warn=warnings.append
    )
    try:
        client.start()
        assert sorted(client.tools) == ["mcp__raw__ping"]
        assert "tool 'ping' is given twice; not offered" in warnings[0]
        assert "'bad name' is not a valid name" in warnings[1]
        assert "'red\\x1b[31m' is not a valid name" in warnings[2]  # shown escaped
        assert len(warnings) == 4
        with Toolbox(workspace, Permissions(yes=True), mcp=client) as tb:
            out = tb.run("mcp__raw__ping", {})
            assert out.ok and out.text == "pong {}"
            bad = tb.run("mcp__raw__ping", [])  # not an object: the parameters line says none
            assert not bad.ok and bad.error == INVALID_ARGUMENTS
            assert "mcp__raw__ping parameters: none." in bad.text
    finally:
        client.close()
        errlog.close()


def test_a_servers_stray_stdout_line_is_logged_not_shown(workspace: Path, caplog) -> None:
    """A line on a stdio server's stdout that is not JSON-RPC: the SDK's traceback goes
    to the servers' log, not to the root logger (whose last-resort handler wrote it on
    the user's terminal over the agent's screen), and the tools work."""
    raw = str(Path(__file__).parent / "fixtures" / "mcp_raw_server.py")
    cfg = parse_config({"mcpServers": {"raw": {"command": sys.executable, "args": [raw, "noise"]}}})
    log_path = workspace.parent / "mcp.log"
    errlog = open(log_path, "w")  # noqa: SIM115 - closed below
    client = McpClient(cfg, cwd=workspace, env_policy=EnvPolicy(), timeout=60, log=errlog)
    try:
        client.start()
        with Toolbox(workspace, Permissions(yes=True), mcp=client) as tb:
            assert tb.run("mcp__raw__ping", {}).ok
    finally:
        client.close()
        errlog.close()
    assert "Failed to parse" not in caplog.text, caplog.text  # what reached the root logger
    assert "Failed to parse JSONRPC message" in log_path.read_text()
