"""Issue 4, must-hold 2: the real Claude Code CLI against ``ds4mlx serve``.

``claude -p`` (launched by ``examples/claude-code.sh``) with its full default system
prompt and tools (about 19k tokens) runs a
turn in which scripted decoding emits a ``Bash`` tool call: Claude Code must run the
command, send the ``tool_result`` back, and the server must complete the turn. Fails
(not skips) under CI when the CLI is missing (``npm install --prefix tests/clients``).
"""

from __future__ import annotations

import os
import subprocess

import pytest
from kv_server_util import traced_server
from server_util import EOS, REPO, Server, require_cli, tiny_model_dir, tool_call_dsml  # noqa: F401

WRAPPER = REPO / "examples" / "claude-code.sh"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):  # noqa: F811 (fixture from server_util)
    with traced_server(tiny_model_dir, tmp_path_factory, ctx=32768) as s:
        yield s


def _claude(
    server: Server, tmp_path, *args: str, timeout: float = 240
) -> subprocess.CompletedProcess:
    exe = require_cli("claude")
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "DS4MLX_URL": server.url,
        "CLAUDE": exe,
        "DISABLE_AUTOUPDATER": "1",
        "LD_PRELOAD": "",
    }
    return subprocess.run(
        [str(WRAPPER), "-p", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_claude_code_runs_a_bash_tool_call_and_completes(server, tmp_path):
    marker = tmp_path / "marker.txt"
    server.script(
        "The user wants the command run.</think>"
        + tool_call_dsml(
            "Bash", command=f"echo ds4mlx-e2e > {marker}", description="Write the marker"
        ),
        "It ran.</think>Wrote the marker file." + EOS,
    )
    n0 = len(server.trace.jobs())
    r = _claude(
        server,
        tmp_path,
        "write the marker",
        "--model",
        "deepseek-v4-flash",
        "--allowedTools",
        "Bash",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Wrote the marker file." in r.stdout
    assert marker.read_text().strip() == "ds4mlx-e2e"  # Claude Code really ran the tool
    jobs = [j for j in server.trace.jobs()[n0:] if j["path"] == "/v1/messages"]
    assert len(jobs) == 2, server.log()[-3000:]
    # The tool-result turn continued the live state (the sampled call stayed in the KV).
    assert jobs[1]["decision"] == "live-anthropic", jobs


def test_claude_code_bare_text_turn(server, tmp_path):
    server.script("Short.</think>Hello from ds4mlx." + EOS)
    r = _claude(
        server,
        tmp_path,
        "say hi",
        "--model",
        "deepseek-v4-flash",
        "--bare",
        "--tools",
        "",
        "--system-prompt",
        "Be terse.",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "Hello from ds4mlx."
