"""Prompt cache under real client traffic: tokens prefilled ÷ prompt tokens.

Real coding clients do not only extend one conversation. Claude Code interleaves its main
conversation with sub-agents (the ``Agent`` tool: another system prompt and history),
small side requests (a session title), retries and replays; Codex runs threads that
share its instructions. This benchmark replays that traffic against ``ds4mlx serve
--demo`` and reports how much of it the server had to prefill.

**Request shapes are captured from the real CLIs at run time** (nothing of their prompts
is stored in this repository; `client_capture`): ``claude -p`` and ``codex exec`` (from
``tests/clients``, ``npm install --prefix tests/clients``) are pointed at a small capture
server on loopback that answers with canned replies — Claude Code is made to start two
sub-agents, the first of which gets a tool result answered, to hit ``max_tokens`` once
(its recovery request), and to send its title request; Codex sends its first request.
From those bodies the replay keeps the system prompts, tool lists, client fields and
message shapes, and writes its own user turns, tool outputs and model outputs; from
Claude Code's headers it keeps the session id and the two sub-agents' agent ids.

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
(b) one state (``--sessions 1``, disk tier on);
(c) ``--sessions 3``;
(d) the defaults (no flags: ``--sessions`` is min(4, what memory holds)), with Claude
    Code's captured conversation headers on its requests (session id; each sub-agent its
    agent id), as the real client sends them.

Goals: (b) ≤ 0.06 (issue 19), (c) ≤ 0.10, each ≥ 3× fewer prefilled tokens than (a).

    python benchmarks/client_traffic.py                     # both clients, (a) (b) (c) (d)
    python benchmarks/client_traffic.py --clients claude --configs b,d --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_loop import Server  # noqa: E402  (the benchmarks' server harness)
from client_capture import MODEL, capture_claude, capture_codex  # noqa: E402

from ds4mlx.dsml.conversation import ToolCall  # noqa: E402
from ds4mlx.dsml.render import render_tool_calls  # noqa: E402

EOS = "<｜end▁of▁sentence｜>"
# label, extra serve flags, whether requests carry the client's conversation headers
CONFIGS = {
    "a": (
        "before issue 12: disk off, one state",
        ["--kv-disk-dir", "none", "--sessions", "1"],
        False,
    ),
    "b": ("one state", ["--sessions", "1"], False),
    "c": ("--sessions 3", ["--sessions", "3"], False),
    "d": ("defaults (headers)", [], True),
}
_WORDS = (
    "parser lexer token buffer cursor offset frame stack heap arena slice index "
    "cache entry bucket shard writer reader queue batch window chunk block"
).split()


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


# --------------------------------------------------------------------------- replay


@dataclass
class Row:
    """One replayed request: its kind, its conversation (``main``, ``sub3`` for the
    sub-agent started at turn 3, ``title3`` for the title request after turn 3: each a
    one-request conversation, as a client sends one per session) and usage (tokens)."""

    client: str
    kind: str
    prompt: int
    cached: int
    conv: str = ""

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
    headers: bool = False  # send the client's conversation headers (Claude Code's)
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

    def post(
        self,
        client: str,
        kind: str,
        path: str,
        body: dict,
        script: str,
        conv: str = "",
        headers: dict | None = None,
    ) -> dict:
        """Queue ``script`` as the job's output, send ``body`` (with ``headers`` when
        this run sends them), record its usage."""
        self.server.script(script)
        r = httpx.post(
            self.server.url + path,
            json={**body, "stream": False},
            headers=(headers or {}) if self.headers else {},
            timeout=3600,
        )
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
        self.rows.append(Row(client, kind, prompt, cached, conv))
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

    def __init__(self, shapes: dict, run: Run, turns: int, restart_at: int | None = 6):
        self.s, self.run, self.turns, self.restart_at = shapes, run, turns, restart_at

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

    def headers(self, conv: str) -> dict:
        """The client's conversation headers for a request of ``conv`` (none here)."""
        return {}

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

    def post(
        self, kind: str, base: dict, history: list, script: str, conv: str = "main", **over
    ) -> dict:
        body = self.body(base, history, **over)
        return self.run.post(self.client, kind, self.path, body, script, conv, self.headers(conv))

    def tool_loop(
        self, base, history, calls, seed, kind="main", first_kind=None, after_first=(), conv="main"
    ) -> str:
        """``calls`` tool calls and their results, then a final answer (returned)."""
        for step in range(calls):
            script = _dsml_call(*_tool_script(seed, step, self.client))
            resp = self.post(
                first_kind if step == 0 and first_kind else kind, base, history, script, conv
            )
            call_id = self.append_reply(history, resp)
            assert call_id, resp
            history.append(self.result(call_id, _lines(seed * 10 + step, 24)))
            if step == 0:
                history.extend(after_first)
        answer = f"Done with step {seed}: the {_word(seed)} path now handles empty input."
        self.append_reply(history, self.post(kind, base, history, answer + EOS, conv))
        return answer

    def agent_turn(self, turn: int, history: list) -> None:
        """A main turn whose tool call starts a sub-agent; its report is the result."""
        resp = self.post("main", self.base, history, _dsml_call(*self.agent_call()))
        call_id = self.append_reply(history, resp)
        base, sub_history, after_first = self.sub_agent_start(turn)
        report = self.tool_loop(
            base,
            sub_history,
            3,
            100 + turn,
            "sub-agent",
            after_first=after_first,
            conv=f"sub{turn}",
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
            if turn == self.restart_at:
                self.run.restart()


def _strip(body: dict, *keys: str) -> dict:
    return {k: v for k, v in body.items() if k not in ("stream", *keys)}


class ClaudeTraffic(Traffic):
    """Claude Code's traffic (Anthropic Messages) from the captured shapes."""

    client = "claude"
    path = "/v1/messages"

    def __init__(self, shapes: dict, run: Run, turns: int, restart_at: int | None = 6):
        super().__init__(shapes, run, turns, restart_at)
        main = shapes["main"]
        self.base = _strip(main, "messages")
        self._subs: dict[str, int] = {}  # sub-agent conversation -> captured agent index
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

    def headers(self, conv):
        """The captured headers: the main conversation's and the title request's carry
        the session id; the sub-agent started at turn 3 has the first captured agent's
        headers, the next one the second's (each its own ``x-claude-code-agent-id``)."""
        h = self.s["headers"]
        if conv.startswith("sub"):
            i = self._subs.setdefault(conv, len(self._subs))
            return h["subs"][i % len(h["subs"])]
        return h.get(conv, h["main"])

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
            f"title{turn}",
            self.headers("title"),
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

    def __init__(self, shapes: dict, run: Run, turns: int, restart_at: int | None = 6):
        super().__init__(shapes, run, turns, restart_at)
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
        script = f"Fix the {_word(turn)} tests" + EOS
        self.run.post(self.client, "title", self.path, body, script, f"title{turn}")

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
        default="a,b,c,d",
        help="server configurations, see above: a (disk off), b (one state), c (--sessions "
        "3), d (defaults, with headers); all by default (about 25 min on a 2-core CPU, most "
        "of it (a))",
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
            label, extra, headers = CONFIGS[cfg]
            d = work / f"run-{cfg}"
            d.mkdir()
            t0 = time.monotonic()
            run = Run(label, extra, d, args.ctx, headers)
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
            out["rows"] = [[r.client, r.kind, r.prompt, r.cached, r.conv] for r in run.rows]
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
            for cfg in ("b", "c", "d"):
                if cfg in c and c[cfg]["prefilled_tokens"]:
                    figures[f"a_over_{cfg}"] = (
                        c["a"]["prefilled_tokens"] / c[cfg]["prefilled_tokens"]
                    )
                    print(
                        f"(a) prefilled ÷ ({cfg}) prefilled = {figures[f'a_over_{cfg}']:.1f}x (goal ≥ 3)"
                    )
        print("goals: (b) ≤ 0.06, (c) ≤ 0.10")
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
