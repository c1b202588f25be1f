"""Issue 4, must-hold 3: the real Codex CLI (``codex exec``) against ``/v1/responses``.

Codex is configured from ``examples/codex-config.toml`` (base URL pointed at the test
server): a model provider
with ``wire_api = "responses"``. Scripted decoding emits an ``exec_command`` function
call; Codex runs it and sends the ``function_call_output`` back (with the reasoning
item's ``encrypted_content``); the server completes the turn. Both transports Codex
speaks are exercised: HTTP SSE, and the Responses WebSocket (``supports_websockets``),
which must be served at once rather than costing seconds of failed upgrade attempts.
Fails (not skips) under CI when the CLI is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import tomllib

import pytest
from kv_server_util import traced_server
from server_util import EOS, REPO, Server, require_cli, tool_call_dsml

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "codex-config.toml"


def _toml(config: dict) -> str:
    """A minimal TOML writer for the example's shape (top-level keys + provider tables)."""
    out, tables = [], []
    for k, v in config.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            out.append(f"{k} = {json.dumps(v)}")
    for name, table in tables:
        for sub, vals in table.items():
            out.append(f"\n[{name}.{sub}]")
            out += [f"{k} = {json.dumps(v)}" for k, v in vals.items()]
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with traced_server(tiny_model_dir, tmp_path_factory, ctx=32768) as s:
        yield s


def _codex(server: Server, tmp_path, prompt: str, *, websockets: bool, timeout: float = 240):
    exe = require_cli("codex")
    home = tmp_path / "home"
    codex_home = tmp_path / "codex"
    home.mkdir(exist_ok=True)
    codex_home.mkdir(exist_ok=True)
    # examples/codex-config.toml, pointed at this server.
    config = tomllib.loads(EXAMPLE.read_text())
    provider = config["model_providers"][config["model_provider"]]
    assert provider["wire_api"] == "responses"
    provider.update(
        base_url=f"{server.url}/v1",
        supports_websockets=websockets,
        request_max_retries=0,
        stream_max_retries=0,
    )
    (codex_home / "config.toml").write_text(_toml(config))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(codex_home),
        "LD_PRELOAD": "",
    }
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    t0 = time.monotonic()
    r = subprocess.run(
        [exe, "exec", "--skip-git-repo-check", prompt],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r, time.monotonic() - t0


@pytest.mark.parametrize("websockets", [False, True], ids=["sse", "websocket"])
def test_codex_exec_function_call_round_trip(server, tmp_path, websockets):
    word = "ws-hello" if websockets else "sse-hello"
    server.script(
        "Run it.</think>" + tool_call_dsml("exec_command", cmd=f"echo {word}"),
        f"Done.</think>The command printed {word}." + EOS,
    )
    n0 = len(server.trace.jobs())
    r, took = _codex(server, tmp_path, "run the echo", websockets=websockets)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert f"The command printed {word}." in r.stdout
    assert word in out  # the command's own output, shown by Codex
    path = "ws /v1/responses" if websockets else "/v1/responses"
    jobs = [j for j in server.trace.jobs()[n0:] if j["path"].endswith("/v1/responses")]
    assert len(jobs) == 2, server.log()[-3000:]
    assert all(j["path"] == path for j in jobs), jobs
    # The function_call_output turn continued the live state.
    assert jobs[1]["decision"] == "live-responses", jobs
    if websockets:
        # Served over the WebSocket: no fallback (five failed upgrades cost seconds each).
        assert "falling back" not in out.lower() and "reconnecting" not in out.lower(), out[-2000:]
        assert took < 120
