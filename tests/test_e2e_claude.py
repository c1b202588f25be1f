"""Issue 4, must-hold 2: the real Claude Code CLI against ``ds4mlx serve``.

``claude -p`` (launched by ``examples/claude-code.sh``) with its full default system
prompt and tools (about 19k tokens) runs a
turn in which scripted decoding emits a ``Bash`` tool call: Claude Code must run the
command, send the ``tool_result`` back, and the server must complete the turn. Fails
(not skips) under CI when the CLI is missing (``npm install --prefix tests/clients``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from kv_server_util import traced_server
from server_util import EOS, REPO, Server, require_cli, tool_call_dsml

pytestmark = pytest.mark.slow

WRAPPER = REPO / "examples" / "claude-code.sh"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with traced_server(tiny_model_dir, tmp_path_factory, ctx=32768) as s:
        yield s


def _claude(
    server: Server, tmp_path, *args: str, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run ``claude -p`` through ``examples/claude-code.sh``. ``timeout`` only catches a
    hang (stacks dumped by pytest-timeout past it): a ~20k-token prompt per request on a
    loaded 2-core box took 240 s for the compaction test's five requests."""
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


def test_claude_code_compacts_when_the_server_refuses_a_prompt_as_too_long(server, tmp_path):
    """Issue 13, item 11: at the CPU default ``--ctx 32768`` a conversation that outgrows
    the window makes Claude Code compact and finish instead of failing.

    ``claude-code.sh`` gives Claude Code the real window and, below 64k, leaves
    ``CLAUDE_CODE_AUTO_COMPACT_WINDOW`` unset: with it Claude Code would refuse every turn
    locally (its threshold, the window less 33k, is below its own ~19k-token prompt).
    Claude Code then compacts when the server refuses a prompt with the Messages API's
    ``prompt is too long: N tokens > M maximum``. Three Bash outputs of ~5k tokens each
    push the fourth request past 32k: the server refuses it, Claude Code sends its
    summarization request (in the trace), then the turn again on the summary, which fits.
    The outputs are generated (``yes``), not files: Claude Code re-attaches files it read
    after compacting, which would not fit this window again.
    """
    lines = 450  # ~5k tokens of output per call
    calls = [
        f"Printing {n}.</think>"
        + tool_call_dsml(
            "Bash",
            command=f"yes '{n} alpha beta gamma delta word alpha beta gamma delta' | head -n {lines}",
            description=f"Print {n}",
        )
        for n in "abc"
    ]
    server.script(
        *calls,
        "Summing up.</think><summary>The user asked to print a, b and c; all three were "
        "printed.</summary>" + EOS,
        "Done.</think>Printed all three." + EOS,
    )
    n0 = len(server.trace.prompts())
    log0 = len(server.log())
    r = _claude(
        server,
        tmp_path,
        "print a, b and c",
        "--allowedTools",
        "Bash",
        "--output-format",
        "stream-json",
        "--verbose",
    )
    events = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    result = events[-1] if events else {}
    assert r.returncode == 0 and result.get("type") == "result", r.stdout[-3000:] + r.stderr
    assert not result["is_error"] and result["result"] == "Printed all three.", result
    assert "--ctx 65536" in r.stderr  # the script says why it does not compact earlier
    assert any(e.get("subtype") == "compact_boundary" for e in events), events
    # The server refused one prompt as too long, in the Messages API's words ...
    refused = re.findall(r"rejected 400: .*", server.log()[log0:])
    assert len(refused) == 1 and "prompt is too long" in refused[0], server.log()[log0:]
    # ... then served the summarization request and the retried turn.
    prompts = server.trace.prompts()[n0:]
    assert len(prompts) == 5, [p["tokens"] for p in prompts]
    assert "<summary>" in prompts[3]["text"] and "Do NOT call any tools" in prompts[3]["text"]
    assert "all three were printed" in prompts[4]["text"] and prompts[4]["tokens"] < 32768


def test_claude_code_gives_up_on_a_401_at_once(tiny_model_dir, server_factory, tmp_path):
    """A server under ``--api-key`` refuses a wrong key with ``x-should-retry: false``:
    Claude Code reports the 401 after one request. Without the header it retried (six
    401s in 25 s, ten in three minutes) before telling its user."""
    s = server_factory(tiny_model_dir, ctx=1024, extra=["--kv-disk-dir", "none", "--api-key", "k1"])
    exe = require_cli("claude")
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": s.url,
        "ANTHROPIC_AUTH_TOKEN": "wrong",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "LD_PRELOAD": "",
    }
    before = s.log().count("rejected 401")
    r = subprocess.run(
        [exe, "-p", "hi", "--model", "deepseek-v4-flash"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert r.returncode != 0 and "401" in r.stdout + r.stderr
    assert s.log().count("rejected 401") - before == 1, s.log()[-2000:]
