"""Issue 4, must-hold 3: the real Codex CLI (``codex exec``) against ``/v1/responses``.

Codex is configured from ``examples/codex-config.toml`` (base URL pointed at the test
server): a model provider
with ``wire_api = "responses"``. Scripted decoding emits an ``exec_command`` function
call; Codex runs it and sends the ``function_call_output`` back (with the reasoning
item's ``encrypted_content``); the server completes the turn. Both transports Codex
speaks are exercised: HTTP SSE, and the Responses WebSocket (``supports_websockets``),
which must be served at once rather than costing seconds of failed upgrade attempts.
Issue 24: with ``examples/codex-model-catalog.json`` Codex sends ``apply_patch`` as a
custom tool with its Lark grammar; the scripted patch is generated under it and applied.
Fails (not skips) under CI when the CLI is missing.
"""

from __future__ import annotations

import json
import os
import re
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


def _codex(
    server: Server,
    tmp_path,
    prompt: str,
    *,
    websockets: bool,
    timeout: float = 240,
    catalog: dict | None = None,
    args: tuple[str, ...] = (),
    model: str | None = None,
):
    """Run ``codex exec`` in ``tmp_path/work``; ``catalog``: a ``model_catalog_json``
    document to configure; ``args``: extra ``codex exec`` flags; ``model``: the model
    name instead of the example's."""
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
    if model is not None:
        config["model"] = model
    if catalog is not None:
        (codex_home / "catalog.json").write_text(json.dumps(catalog))
        config["model_catalog_json"] = str(codex_home / "catalog.json")
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
        [exe, "exec", "--skip-git-repo-check", *args, prompt],
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
    r, _ = _codex(server, tmp_path, "run the echo", websockets=websockets)
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


# Codex offers ``apply_patch`` as a freeform (custom) tool with a Lark grammar only to a
# model whose catalog entry says ``apply_patch_tool_type: freeform``; a model unknown to
# its built-in catalog gets fallback metadata without it. ``model_catalog_json`` names
# a catalog file: the example's, as examples/codex-config.toml suggests.
CATALOG = json.loads((REPO / "examples" / "codex-model-catalog.json").read_text())


def test_codex_exec_applies_a_grammar_true_apply_patch(server, tmp_path):
    """Codex sends ``apply_patch`` as a custom tool with its Lark grammar; the scripted
    call is generated under that grammar (the constraint holds to its end), arrives as a
    ``custom_tool_call`` with the exact patch, and Codex applies it to the workspace."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("alpha\nbeta\n")
    patch = (
        "*** Begin Patch\n*** Update File: notes.txt\n@@\n alpha\n-beta\n+gamma\n"
        "*** Add File: new.txt\n+fresh line\n*** End Patch\n"
    )
    server.script(
        "Patch it.</think>" + tool_call_dsml("apply_patch", input=patch),
        "Done.</think>Patched both files." + EOS,
    )
    n0 = len(server.trace.jobs())
    r, _ = _codex(
        server,
        tmp_path,
        "edit notes.txt",
        websockets=False,
        catalog=CATALOG,
        args=("--dangerously-bypass-approvals-and-sandbox",),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Patched both files." in r.stdout
    assert (work / "notes.txt").read_text() == "alpha\ngamma\n"
    assert (work / "new.txt").read_text() == "fresh line\n"
    jobs = [j for j in server.trace.jobs()[n0:] if j["path"].endswith("/v1/responses")]
    assert len(jobs) == 2, server.log()[-3000:]
    assert jobs[1]["decision"] == "live-responses", jobs
    # The call was generated under the turn grammar (the custom tool's Lark grammar
    # inside the DSML block), and the grammar held to its end.
    first = [ln for ln in server.request_lines() if re.search(rf" job={jobs[0]['job']}\b", ln)]
    assert first and "grammar=complete" in first[0], server.request_lines()[-3:]


@pytest.mark.parametrize("websockets", [False, True], ids=["sse", "websocket"])
def test_codex_with_a_responses_lite_model_gets_its_tools(server, tmp_path, websockets):
    """A model of Codex's built-in catalog marked ``use_responses_lite`` (``gpt-5.6-sol``)
    makes Codex send ``tools: []`` and its tools in a leading ``additional_tools`` input
    item: a ``functions`` namespace holding the freeform (custom) ``exec`` tool, which
    runs JavaScript, and a ``collaboration`` namespace. The model is offered them (they
    were dropped: no tools at all), a call to ``exec`` is a ``custom_tool_call`` Codex
    runs, and its output continues the live state."""
    server.script(
        "Run it.</think>" + tool_call_dsml("exec", input='text("lite-" + "hello")'),
        "Done.</think>The script printed lite-hello." + EOS,
    )
    n0 = len(server.trace.jobs())
    p0 = len(server.trace.prompts())
    r, _ = _codex(server, tmp_path, "run the script", websockets=websockets, model="gpt-5.6-sol")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "The script printed lite-hello." in r.stdout, r.stdout + r.stderr
    prompts = server.trace.prompts()[p0:]
    assert '"name": "exec"' in prompts[0]["text"] and '"name": "spawn_agent"' in prompts[0]["text"]
    # Codex ran the script: its output came back as the call's result.
    assert "lite-hello" in prompts[1]["text"].split("<tool_result>", 1)[1]
    jobs = [j for j in server.trace.jobs()[n0:] if j["path"].endswith("/v1/responses")]
    assert len(jobs) == 2 and jobs[1]["decision"] == "live-responses", jobs
