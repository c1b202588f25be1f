"""Prompt cache under real client traffic: tokens prefilled ÷ prompt tokens.

Real coding clients do not only extend one conversation. Claude Code interleaves its main
conversation with sub-agents (the ``Agent`` tool: another system prompt and history),
small side requests (a session title), retries and replays; Codex runs threads that
share its instructions. This benchmark replays that traffic against ``ds4mlx serve
--demo`` and reports how much of it the server had to prefill.

**Request shapes are captured from the real CLIs at run time** (nothing of their prompts
is stored in this repository): ``claude -p`` and ``codex exec`` (from
``tests/clients``, ``npm install --prefix tests/clients``) are pointed at a small capture
server on loopback that answers with canned replies — Claude Code is made to start a
sub-agent, whose first tool result is answered, to hit ``max_tokens`` once (its
recovery request), and to send its title request; Codex sends its first request. From
those bodies the replay keeps the system prompts, tool lists, client fields and message
shapes, and writes its own user turns, tool outputs and model outputs.

**The traffic** (per client, all requests sequential, as one user's session):

- a main conversation of ``--turns`` (12) turns, each a tool loop: the user's message,
  a tool call, its result, a final answer;
- a sub-agent of 4 requests (a tool loop of three calls and an answer) started from the
  main conversation's turns 3 and 7; its report is the tool result of that turn
  (Claude Code: the ``Agent`` tool with the captured sub-agent prompt; Codex: a thread
  with the captured instructions, as ``multi_agent_v1`` spawns);
- a title request after every main turn (Claude Code's captured shape; Codex sends
  none, so its side request is a one-message request of our own);
- one retry of the first request in the shape issue 12 names: the first request ends on
  ``max_tokens`` and the retry carries the mid-conversation ``system`` message inside
  the first user turn as ``<system-reminder>`` (Codex: an identical resend);
- Claude Code's current ``max_tokens`` recovery on turn 9 (the truncated answer and its
  "Output token limit hit" user message, as captured; a live continuation);
- one exact replay (turn 10's first request sent twice);
- one server restart after turn 6.

Model output is scripted (``--enable-scripted-decoding``): every token still runs through
the network, so prefill counts are real; output caps are fixed by the scripts (EOS) and
by ``max_tokens`` on the two truncated requests. Each request's usage gives the prompt
tokens and how many of them were served from a cache; tokens prefilled = prompt −
cached.

**Configurations**, each on a fresh cache directory:

(a) the behaviour before issue 12: ``--kv-disk-dir none`` (no disk tier), one state;
(b) the defaults (disk tier on, one state);
(c) ``--sessions 3``.

Goals: (b) ≤ 0.15, (c) ≤ 0.10, each ≥ 3× fewer prefilled tokens than (a).

    python benchmarks/client_traffic.py                     # both clients, (a) (b) (c)
    python benchmarks/client_traffic.py --clients claude --configs b,c --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_loop import Server  # noqa: E402  (the benchmarks' server harness)

from ds4mlx.dsml.conversation import ToolCall  # noqa: E402
from ds4mlx.dsml.render import render_tool_calls  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLIENTS_BIN = REPO / "tests" / "clients" / "node_modules" / ".bin"
EOS = "<｜end▁of▁sentence｜>"
MODEL = "deepseek-v4-flash"
CONFIGS = {
    "a": ("before issue 12: disk off, one state", ["--kv-disk-dir", "none"]),
    "b": ("defaults", []),
    "c": ("--sessions 3", ["--sessions", "3"]),
}
_WORDS = (
    "parser lexer token buffer cursor offset frame stack heap arena slice index "
    "cache entry bucket shard writer reader queue batch window chunk block"
).split()


def _cli(name: str) -> str:
    path = CLIENTS_BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: npm install --prefix tests/clients")
    return found


def _word(i: int) -> str:
    return _WORDS[i % len(_WORDS)]


def _lines(seed: int, n: int) -> str:
    """``n`` lines of varied code-like text (a tool output), distinct for each ``seed``."""
    out = []
    for i in range(n):
        w = [_word(seed * 7 + i * 5 + k * 3) for k in range(4)]
        out.append(f"{i + 1:4d}  def {w[0]}_{w[1]}_{seed}(self, {w[2]}): return self.{w[3]}")
    return "\n".join(out)


def _dsml_call(name: str, arguments: dict) -> str:
    """Scripted output: one DSML tool call (the format's own rendering) + EOS."""
    return render_tool_calls([ToolCall(id="scripted", name=name, arguments=arguments)]).text + EOS


# --------------------------------------------------------------------------- capture


class _Capture:
    """A loopback HTTP server that records request bodies and answers with ``reply``.

    ``reply(path, body)`` returns ``None`` (an empty 404) or a list of
    ``(event, data)`` SSE pairs; the reply is streamed and the connection closed.
    """

    def __init__(self, reply):
        self.bodies: list[tuple[str, dict]] = []
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
    ``title`` (the title request).
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
        subprocess_run([_cli("claude"), "-p", "fix the failing test", "--model", MODEL], work, env)
    finally:
        cap.close()
    msgs = [b for p, b in cap.bodies if "/v1/messages" in p and "count_tokens" not in p]
    main = [b for b in msgs if b.get("tools") and "cc_is_subagent" not in json.dumps(b["system"])]
    sub = [b for b in msgs if b.get("tools") and "cc_is_subagent" in json.dumps(b["system"])]
    title = [b for b in msgs if not b.get("tools")]
    if len(main) < 3 or len(sub) < 2 or not title:
        raise SystemExit(
            f"claude capture incomplete: {len(main)} main, {len(sub)} sub, {len(title)} title"
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
        "title": title[0],
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


def capture_codex(work: Path) -> dict:
    """Run ``codex exec`` against a capture server; return ``{"main": first request}``."""
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
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(codex_home),
    }
    try:
        subprocess_run(
            [_cli("codex"), "exec", "--skip-git-repo-check", "fix the failing test"], work, env
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


# --------------------------------------------------------------------------- replay


@dataclass
class Row:
    """One replayed request: its kind and usage (tokens)."""

    client: str
    kind: str
    prompt: int
    cached: int

    @property
    def prefilled(self) -> int:
        return self.prompt - self.cached


@dataclass
class Run:
    """One configuration: a ``ds4mlx serve --demo`` on a fresh cache directory."""

    label: str
    extra: list[str]
    work: Path
    ctx: int
    rows: list[Row] = field(default_factory=list)
    restarts: int = 0

    def __post_init__(self):
        self.server = self._start()

    def _start(self) -> Server:
        extra = list(self.extra)
        if "--kv-disk-dir" not in extra:
            extra += ["--kv-disk-dir", str(self.work / "kv")]
        return Server(None, self.ctx, extra, self.work / "serve.log")

    def restart(self) -> None:
        """Stop cleanly (the shutdown save) and start again on the same cache directory."""
        self.server.stop()
        self.server = self._start()
        self.restarts += 1

    def post(self, client: str, kind: str, path: str, body: dict, script: str) -> dict:
        """Queue ``script`` as the job's output, send ``body``, record its usage."""
        self.server.script(script)
        r = httpx.post(self.server.url + path, json={**body, "stream": False}, timeout=3600)
        if r.status_code != 200:
            raise RuntimeError(f"{kind}: HTTP {r.status_code}: {r.text[:1000]}")
        resp = r.json()
        u = resp["usage"]
        if path == "/v1/messages":
            prompt, cached = (
                u["input_tokens"] + u["cache_read_input_tokens"],
                u["cache_read_input_tokens"],
            )
        else:
            prompt, cached = u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
        self.rows.append(Row(client, kind, prompt, cached))
        return resp

    def stop(self) -> None:
        self.server.stop()


def _tool_script(turn: int, step: int, client: str) -> tuple[str, dict]:
    """The tool call a scripted turn makes: (name, arguments)."""
    if client == "codex":
        return "exec_command", {"cmd": f"sed -n 1,40p src/{_word(turn + step)}_{turn}.py"}
    if (turn + step) % 2:
        return "Read", {"file_path": f"/project/src/{_word(turn * 3 + step)}_{turn}.py"}
    return "Bash", {
        "command": f"pytest -q tests/test_{_word(turn)}.py",
        "description": "Run the tests",
    }


class Traffic:
    """The traffic skeleton of the module doc; a subclass maps it onto one client's shapes.

    ``history`` is the client's message (or input item) list, extended in place as the
    client would: each reply appended, then its tool results.
    """

    client = ""
    path = ""

    def __init__(self, shapes: dict, run: Run, turns: int):
        self.s, self.run, self.turns = shapes, run, turns

    # Per-client hooks --------------------------------------------------------------
    def body(self, base: dict, history: list, **over) -> dict:
        raise NotImplementedError

    def user(self, turn: int) -> dict:
        raise NotImplementedError

    def append_reply(self, history: list, resp: dict) -> str | None:
        """Append the reply as the client resends it; return its first tool call's id."""
        raise NotImplementedError

    def result(self, call_id: str, content) -> dict:
        raise NotImplementedError

    def first_history(self) -> list:
        raise NotImplementedError

    def sub_agent_start(self, turn: int) -> tuple[dict, list, list]:
        """``(base, history, messages appended after the first tool result)``."""
        raise NotImplementedError

    def agent_call(self) -> tuple[str, dict]:
        raise NotImplementedError

    def title(self, turn: int) -> None:
        raise NotImplementedError

    def agent_report(self, report: str):
        """The tool result content a sub-agent's ``report`` becomes."""
        return report

    def retry(self, history: list) -> str:
        raise NotImplementedError

    def recovery(self, history: list) -> str | None:
        return None

    # The shared skeleton -----------------------------------------------------------
    def task(self, turn: int) -> str:
        return (
            f"Turn {turn}: the {_word(turn)} tests fail after the {_word(turn * 5)} change; fix it."
        )

    def post(self, kind: str, base: dict, history: list, script: str, **over) -> dict:
        return self.run.post(self.client, kind, self.path, self.body(base, history, **over), script)

    def tool_loop(
        self, base, history, calls, seed, kind="main", first_kind=None, after_first=()
    ) -> str:
        """``calls`` tool calls and their results, then a final answer (returned)."""
        for step in range(calls):
            script = _dsml_call(*_tool_script(seed, step, self.client))
            resp = self.post(
                first_kind if step == 0 and first_kind else kind, base, history, script
            )
            call_id = self.append_reply(history, resp)
            assert call_id, resp
            history.append(self.result(call_id, _lines(seed * 10 + step, 24)))
            if step == 0:
                history.extend(after_first)
        answer = f"Done with step {seed}: the {_word(seed)} path now handles empty input."
        self.append_reply(history, self.post(kind, base, history, answer + EOS))
        return answer

    def agent_turn(self, turn: int, history: list) -> None:
        """A main turn whose tool call starts a sub-agent; its report is the result."""
        resp = self.post("main", self.base, history, _dsml_call(*self.agent_call()))
        call_id = self.append_reply(history, resp)
        base, sub_history, after_first = self.sub_agent_start(turn)
        report = self.tool_loop(
            base, sub_history, 3, 100 + turn, "sub-agent", after_first=after_first
        )
        history.append(self.result(call_id, self.agent_report(report)))
        self.append_reply(
            history, self.post("main", self.base, history, f"Turn {turn} done." + EOS)
        )

    def replay(self, history: list) -> str:
        """The request is sent here and once more, identical, by the tool loop."""
        self.post("main", self.base, history, _dsml_call(*_tool_script(10, 0, self.client)))
        return "replay"

    def run_all(self) -> None:
        history = self.first_history()
        for turn in range(1, self.turns + 1):
            if turn > 1:
                history.append(self.user(turn))
            first_kind = None
            if turn == 1:
                first_kind = self.retry(history)
            elif turn == 9:
                first_kind = self.recovery(history)
            elif turn == 10:
                first_kind = self.replay(history)
            if turn in (3, 7):
                self.agent_turn(turn, history)
            else:
                self.tool_loop(self.base, history, 1, turn, first_kind=first_kind)
            self.title(turn)
            if turn == 6:
                self.run.restart()


def _strip(body: dict, *keys: str) -> dict:
    return {k: v for k, v in body.items() if k not in ("stream", *keys)}


class ClaudeTraffic(Traffic):
    """Claude Code's traffic (Anthropic Messages) from the captured shapes."""

    client = "claude"
    path = "/v1/messages"

    def __init__(self, shapes: dict, run: Run, turns: int):
        super().__init__(shapes, run, turns)
        main = shapes["main"]
        self.base = _strip(main, "messages")
        self.first_user, self.late_system = main["messages"][0], main["messages"][1]

    def body(self, base, history, **over):
        return {**base, "messages": history, **over}

    def user(self, turn):
        if turn == 1:  # Claude Code's first user turn: its context reminder, then the prompt
            blocks = [dict(b) for b in self.first_user["content"]]
            blocks[-1] = {**blocks[-1], "text": self.task(1)}
            return {"role": "user", "content": blocks}
        return {"role": "user", "content": [{"type": "text", "text": self.task(turn)}]}

    def append_reply(self, history, resp):
        history.append({"role": "assistant", "content": resp["content"]})
        return next((b["id"] for b in resp["content"] if b["type"] == "tool_use"), None)

    def result(self, call_id, content):
        if not isinstance(content, str):
            content = [{"type": "text", "text": t} for t in content]
        return {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call_id, "content": content}],
        }

    def first_history(self):
        return [self.user(1), self.late_system]

    def sub_agent_start(self, turn):
        sub = self.s["sub"]
        first = [dict(b) for b in sub["messages"][0]["content"]]
        first[-1] = {
            **first[-1],
            "text": f"Find where the {_word(turn)} state is reset (turn {turn}).",
        }
        history = [{"role": "user", "content": first}, *sub["messages"][1:]]
        return _strip(sub, "messages"), history, self.s["sub_after_result"]

    def agent_call(self):
        task = {"description": "Find the reset", "prompt": "Find where state is reset"}
        return "Agent", {**task, "subagent_type": "general-purpose"}

    def agent_report(self, report):
        # Claude Code adds its agent-id/usage block to a sub-agent's report.
        tail = self.s["agent_result_tail"]
        return [report, tail] if tail else report

    def title(self, turn):
        """Claude Code's title request (captured shape) about this turn's message."""
        body = json.loads(json.dumps(self.s["title"]))
        msg = body["messages"][0]
        text = msg["content"][0]["text"] if isinstance(msg["content"], list) else msg["content"]
        _, sep, tail = text.partition("</session>")
        if sep:
            text = f"<session>\n{self.task(turn)}\n{sep}{tail}"
        msg["content"] = [{"type": "text", "text": text}]
        self.run.post(
            self.client,
            "title",
            self.path,
            _strip(body),
            f"Fix the {_word(turn)} tests" + EOS,
        )

    def retry(self, history):
        """The first request ends on ``max_tokens``; its retry carries the mid-conversation
        system message inside the first user turn as ``<system-reminder>`` (issue 12)."""
        self.post("main", self.base, history, _lines(1, 4), max_tokens=8)
        skills = self.late_system["content"]
        skills = skills if isinstance(skills, str) else "".join(b["text"] for b in skills)
        reminder = {"type": "text", "text": f"<system-reminder>\n{skills}\n</system-reminder>"}
        history[:] = [{"role": "user", "content": [reminder, *history[0]["content"]]}]
        return "retry"

    def recovery(self, history):
        """Claude Code 2.1's ``max_tokens`` recovery: the cut answer, then its user note."""
        resp = self.post("main", self.base, history, _lines(9, 4), max_tokens=8)
        self.append_reply(history, resp)
        history.append({"role": "user", "content": self.s["recovery"]})
        return "recovery"


class CodexTraffic(Traffic):
    """Codex's traffic (Responses API, ``store: false``) from its captured first request."""

    client = "codex"
    path = "/v1/responses"

    def __init__(self, shapes: dict, run: Run, turns: int):
        super().__init__(shapes, run, turns)
        main = shapes["main"]
        self.base = _strip(main, "input")
        self.prefix = main["input"][:-1]  # developer instructions, environment context

    def body(self, base, history, **over):
        return {**base, "input": history, **over}

    def user(self, turn):
        return {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": self.task(turn)}],
        }

    def append_reply(self, history, resp):
        history.extend(resp["output"])  # reasoning (encrypted_content), messages, calls
        return next((o["call_id"] for o in resp["output"] if o["type"] == "function_call"), None)

    def result(self, call_id, content):
        return {"type": "function_call_output", "call_id": call_id, "output": content}

    def first_history(self):
        return [*self.prefix, self.user(1)]

    def sub_agent_start(self, turn):
        # A spawned agent's thread starts with the same instructions and its task.
        task = {
            "type": "message",
            "role": "user",
            "content": [
                {
                    "type": "input_text",
                    "text": f"Find where the {_word(turn)} state is reset (turn {turn}).",
                }
            ],
        }
        return self.base, [*self.prefix, task], []

    def agent_call(self):
        return "exec_command", {"cmd": "codex-subagent --task 'find the reset'"}

    def title(self, turn):
        """Codex sends no title request: a one-message side request of our own."""
        body = {
            "model": MODEL,
            "instructions": "Write a title of 3 to 7 words for the user's task.",
            "input": [self.user(turn)],
            "store": False,
        }
        self.run.post(self.client, "title", self.path, body, f"Fix the {_word(turn)} tests" + EOS)

    def retry(self, history):
        """Codex's retry after a dropped stream is the identical request."""
        self.post("main", self.base, history, _dsml_call(*_tool_script(1, 0, self.client)))
        return "retry"


# --------------------------------------------------------------------------- report

TRAFFIC = {"claude": (capture_claude, ClaudeTraffic), "codex": (capture_codex, CodexTraffic)}


def summarize(rows: list[Row]) -> dict:
    """Totals of ``rows``: prompt, cached and prefilled tokens, the prefilled ratio."""
    prompt = sum(r.prompt for r in rows)
    prefilled = sum(r.prefilled for r in rows)
    return {
        "requests": len(rows),
        "prompt_tokens": prompt,
        "prefilled_tokens": prefilled,
        "ratio": prefilled / prompt if prompt else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--clients",
        default="claude,codex",
        help="whose traffic: claude, codex or both (default; the CLIs come from "
        "tests/clients: npm install --prefix tests/clients)",
    )
    ap.add_argument(
        "--configs",
        default="a,b,c",
        help="server configurations, see above: a (disk off), b (defaults), c (--sessions 3); "
        "all three by default (about 20 min on a 2-core CPU, most of it (a))",
    )
    ap.add_argument("--turns", type=int, default=12, help="main conversation turns (12)")
    ap.add_argument("--ctx", type=int, default=32768, help="server context size (32768)")
    ap.add_argument("--shapes", help="load captured shapes from this JSON (else capture now)")
    ap.add_argument("--save-shapes", help="write the captured shapes here (never commit them)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (server logs)")
    args = ap.parse_args(argv)
    clients = [c for c in args.clients.split(",") if c]
    configs = [c for c in args.configs.split(",") if c]
    work = Path(tempfile.mkdtemp(prefix="ds4mlx-client-traffic-"))
    try:
        if args.shapes:
            shapes = json.loads(Path(args.shapes).read_text())
        else:
            shapes = {}
            for c in clients:
                (work / f"capture-{c}").mkdir()
                shapes[c] = TRAFFIC[c][0](work / f"capture-{c}")
        if args.save_shapes:
            Path(args.save_shapes).write_text(json.dumps(shapes))
        figures = {"turns": args.turns, "ctx": args.ctx, "configs": {}}
        for cfg in configs:
            label, extra = CONFIGS[cfg]
            d = work / f"run-{cfg}"
            d.mkdir()
            t0 = time.monotonic()
            run = Run(label, extra, d, args.ctx)
            try:
                for c in clients:
                    TRAFFIC[c][1](shapes[c], run, args.turns).run_all()
            finally:
                run.stop()
            out = {
                "label": label,
                "seconds": round(time.monotonic() - t0, 1),
                **summarize(run.rows),
            }
            out["clients"] = {c: summarize([r for r in run.rows if r.client == c]) for c in clients}
            out["kinds"] = {
                k: summarize([r for r in run.rows if r.kind == k])
                for k in sorted({r.kind for r in run.rows})
            }
            out["rows"] = [[r.client, r.kind, r.prompt, r.cached] for r in run.rows]
            figures["configs"][cfg] = out
            print(
                f"({cfg}) {label}: {out['prefilled_tokens']}/{out['prompt_tokens']} tokens prefilled "
                f"= {out['ratio']:.3f} over {out['requests']} requests ({out['seconds']} s)",
                flush=True,
            )
            for k, v in out["kinds"].items():
                print(
                    f"      {k:10s} {v['prefilled_tokens']:7d}/{v['prompt_tokens']:7d} = {v['ratio']:.3f}"
                )
        c = figures["configs"]
        if "a" in c:
            for cfg in ("b", "c"):
                if cfg in c and c[cfg]["prefilled_tokens"]:
                    figures[f"a_over_{cfg}"] = (
                        c["a"]["prefilled_tokens"] / c[cfg]["prefilled_tokens"]
                    )
                    print(
                        f"(a) prefilled ÷ ({cfg}) prefilled = {figures[f'a_over_{cfg}']:.1f}x (goal ≥ 3)"
                    )
        print("goals: (b) ≤ 0.15, (c) ≤ 0.10")
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
