"""Request shapes and headers captured from the real coding CLIs, at run time.

``claude -p`` and ``codex exec`` (from ``tests/clients``, ``npm install --prefix
tests/clients``) are pointed at `_Capture`, a small server on loopback that records each
request (path, JSON body, headers) and answers with canned replies. Nothing the CLIs
send is stored in this repository: `benchmarks/client_traffic.py` replays traffic built
from these shapes, and the tests that need Claude Code's real headers or prompts
(``tests/test_client_traffic.py``, ``tests/test_client_sessions.py``) capture them the
same way.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLIENTS_BIN = REPO / "tests" / "clients" / "node_modules" / ".bin"
MODEL = "deepseek-v4-flash"
# Claude Code's own headers (session, agent, parent agent), as the capture keeps them.
CLAUDE_HEADER_PREFIX = "x-claude-code-"


def cli(name: str) -> str:
    path = CLIENTS_BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: npm install --prefix tests/clients")
    return found


class _Capture:
    """A loopback HTTP server that records request bodies and answers with ``reply``.

    ``reply(path, body)`` returns ``None`` (an empty 404) or a list of
    ``(event, data)`` SSE pairs; the reply is streamed and the connection closed.
    """

    def __init__(self, reply):
        self.bodies: list[tuple[str, dict]] = []
        self.headers: list[dict[str, str]] = []  # each body's request headers (lower-case)
        cap = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # the CLIs' traffic is not worth a line each
                pass

            def _empty(self, status: int) -> None:
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_GET(self):  # noqa: N802  (http.server's naming)
                self._empty(404)  # Codex's WebSocket upgrade, model lists: not served

            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                cap.bodies.append((self.path, body))
                cap.headers.append({k.lower(): v for k, v in self.headers.items()})
                events = reply(self.path, body)
                if events is None:
                    self._empty(404)
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                for event, data in events:
                    self.wfile.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
                self.wfile.flush()
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _anthropic_sse(text: str | None, tool: tuple[str, dict] | None, stop: str) -> list:
    """The SSE events of one Anthropic Messages answer: a text or a tool_use block."""
    msg = {
        "id": "msg_" + uuid.uuid4().hex[:16],
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }
    if tool:
        block = {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:20], "name": tool[0]}
        start, delta = {**block, "input": {}}, {"type": "input_json_delta"}
        delta["partial_json"] = json.dumps(tool[1])
    else:
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": text}
    return [
        ("message_start", {"type": "message_start", "message": msg}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": start},
        ),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": 3},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


def capture_claude(work: Path) -> dict:
    """Run ``claude -p`` against a capture server; return the request shapes.

    Keys: ``main`` (the first main request), ``recovery`` (the user text Claude Code
    sends after an answer cut by ``max_tokens``), ``sub`` (a sub-agent's first request),
    ``sub_after_result`` (messages the sub-agent appends after its first tool result),
    ``agent_result_tail`` (the text block Claude Code adds to an ``Agent`` tool result),
    ``title`` (the title request), ``headers``: Claude Code's own request headers
    (``x-claude-code-…``, lower-case) of the main conversation (``main``), its title
    request (``title``) and each sub-agent it started, in order (``subs``: two, each with
    its own ``x-claude-code-agent-id``).
    """
    counts = {"main": 0, "sub": 0}
    (work / "notes.txt").write_text("test_parse fails on empty input\n")

    def reply(path, body):
        if "/v1/messages" not in path or "count_tokens" in path:
            return None
        system = json.dumps(body.get("system"))
        if not body.get("tools"):
            return _anthropic_sse("Fix the failing parser test", None, "end_turn")
        kind = "sub" if "cc_is_subagent" in system else "main"
        counts[kind] += 1
        n = counts[kind]
        if kind == "main" and n == 1:
            task = {"description": "Find the test", "prompt": "Find the failing test"}
            return _anthropic_sse(
                None, ("Agent", {**task, "subagent_type": "general-purpose"}), "tool_use"
            )
        if kind == "sub" and n == 1:
            return _anthropic_sse(
                None, ("Read", {"file_path": str(work / "notes.txt")}), "tool_use"
            )
        if kind == "main" and n == 2:
            return _anthropic_sse("The test is test_parse and", None, "max_tokens")
        if kind == "main" and n == 3:  # a second sub-agent: its own agent id
            task = {"description": "Check the fix", "prompt": "Check the parser fix"}
            return _anthropic_sse(
                None, ("Agent", {**task, "subagent_type": "general-purpose"}), "tool_use"
            )
        return _anthropic_sse("Done.", None, "end_turn")

    cap = _Capture(reply)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(work / "home"),
        "ANTHROPIC_BASE_URL": cap.url,
        "ANTHROPIC_AUTH_TOKEN": "local",
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "CLAUDE_CODE_SUBAGENT_MODEL": MODEL,
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "100000",
        "DISABLE_AUTOUPDATER": "1",
    }
    (work / "home").mkdir(exist_ok=True)
    try:
        subprocess_run([cli("claude"), "-p", "fix the failing test", "--model", MODEL], work, env)
    finally:
        cap.close()
    msgs = [
        (b, {k: v for k, v in h.items() if k.startswith(CLAUDE_HEADER_PREFIX)})
        for (p, b), h in zip(cap.bodies, cap.headers, strict=True)
        if "/v1/messages" in p and "count_tokens" not in p
    ]

    def is_sub(b: dict) -> bool:
        return "cc_is_subagent" in json.dumps(b["system"])

    main = [b for b, _ in msgs if b.get("tools") and not is_sub(b)]
    sub = [b for b, _ in msgs if b.get("tools") and is_sub(b)]
    title = [(b, h) for b, h in msgs if not b.get("tools")]
    agents: dict[str, dict] = {}  # agent id -> its headers, in order of appearance
    for b, h in msgs:
        if b.get("tools") and is_sub(b) and "x-claude-code-agent-id" in h:
            agents.setdefault(h["x-claude-code-agent-id"], h)
    main_headers = next(h for b, h in msgs if b.get("tools") and not is_sub(b))
    if len(main) < 3 or len(sub) < 2 or not title or len(agents) < 2:
        raise SystemExit(
            f"claude capture incomplete: {len(main)} main, {len(sub)} sub, {len(title)} "
            f"title, {len(agents)} agent ids"
        )
    # main[1] sends the Agent tool's result (answered with max_tokens); main[2] is the
    # recovery request that follows, ending with Claude Code's note to the model.
    agent_result = main[1]["messages"][-1]["content"][0]["content"]
    recovery = main[2]["messages"][-1]
    return {
        "main": main[0],
        "recovery": recovery["content"]
        if isinstance(recovery["content"], str)
        else recovery["content"][0]["text"],
        "sub": sub[0],
        # The sub-agent's second request is its first + [assistant, tool_result, *these].
        "sub_after_result": sub[1]["messages"][len(sub[0]["messages"]) + 2 :],
        "agent_result_tail": agent_result[-1]["text"] if len(agent_result) > 1 else "",
        "title": title[0][0],
        "headers": {"main": main_headers, "title": title[0][1], "subs": list(agents.values())},
    }


def _responses_sse(text: str) -> list:
    rid = "resp_" + uuid.uuid4().hex[:16]
    base = {
        "id": rid,
        "object": "response",
        "created_at": 0,
        "model": MODEL,
        "status": "in_progress",
        "output": [],
    }
    item = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    usage = {
        "input_tokens": 1,
        "output_tokens": 1,
        "total_tokens": 2,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
    return [
        ("response.created", {"type": "response.created", "response": base}),
        (
            "response.output_item.added",
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {**item, "status": "in_progress", "content": []},
            },
        ),
        (
            "response.output_text.delta",
            {
                "type": "response.output_text.delta",
                "output_index": 0,
                "item_id": "msg_1",
                "content_index": 0,
                "delta": text,
            },
        ),
        (
            "response.output_item.done",
            {"type": "response.output_item.done", "output_index": 0, "item": item},
        ),
        (
            "response.completed",
            {
                "type": "response.completed",
                "response": {**base, "status": "completed", "output": [item], "usage": usage},
            },
        ),
    ]


def capture_codex(work: Path, catalog: Path | None = None) -> dict:
    """Run ``codex exec`` against a capture server; return ``{"main": first request}``.

    ``catalog``: a ``model_catalog_json`` file to configure (e.g.
    ``examples/codex-model-catalog.json``: Codex then offers its freeform ``apply_patch``
    custom tool with its Lark grammar), or None (Codex's fallback metadata)."""
    cap = _Capture(
        lambda path, body: _responses_sse("Done.") if path.endswith("/responses") else None
    )
    home, codex_home = work / "home", work / "codex"
    home.mkdir(exist_ok=True)
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "ds4mlx"\nmodel_context_window = 32768\n'
        f'[model_providers.ds4mlx]\nname = "capture"\nbase_url = "{cap.url}/v1"\n'
        'wire_api = "responses"\nsupports_websockets = false\n'
        "request_max_retries = 0\nstream_max_retries = 0\n"
    )
    if catalog is not None:  # a top-level key: it must come before the provider table
        text = (codex_home / "config.toml").read_text()
        (codex_home / "config.toml").write_text(
            f"model_catalog_json = {json.dumps(str(catalog))}\n" + text
        )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(codex_home),
    }
    try:
        subprocess_run(
            [cli("codex"), "exec", "--skip-git-repo-check", "fix the failing test"], work, env
        )
    finally:
        cap.close()
    bodies = [b for p, b in cap.bodies if p.endswith("/responses")]
    if not bodies:
        raise SystemExit("codex capture: no request")
    return {"main": bodies[0]}


def subprocess_run(cmd: list[str], cwd: Path, env: dict) -> None:
    """Run a client CLI to completion (5 min at most); exit with its output if it fails."""
    r = subprocess.run(
        cmd, cwd=cwd, env={**env, "LD_PRELOAD": ""}, capture_output=True, text=True, timeout=300
    )
    if r.returncode != 0:
        raise SystemExit(
            f"{cmd[0]} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        )
