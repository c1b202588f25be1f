"""Asynchronous tool calls: prefill reuse of a scripted conversation (docs/ARCHITECTURE.md §4).

The `agent_loop.py` setup (a real ``ds4mlx serve``, scripted decoding, an Anthropic client
with thinking on, display omitted and the reasoning replayed through the signature
carrier) with an ``async: true`` tool. Each of ``--cycles`` cycles is four requests:

1. the model calls ``sleep`` (async) and ``read_file`` (sync) in one turn;
2. the client sends only the ``read_file`` result (``sleep`` is answered by its pending
   status result) and the model answers;
3. an unrelated user question, answered;
4. the ``sleep`` result arrives late, by its id, with the next instruction (the next
   cycle's call turn).

Reported per request: prompt tokens, cached tokens, tokens prefilled, the plan decision,
and whether the request reused everything the live state held (cached = previous prompt +
previous output − the unfed EOS: only the new suffix prefilled). Then the same
conversation with ``sleep`` synchronous (its result sent with ``read_file``'s, no late
result) for comparison. Goal: after the first request only the new suffix, in both runs.

    python benchmarks/async_tools.py                 # the tiny float32 model (made once)
    python benchmarks/async_tools.py -m /path/to/DeepSeek-V4-Flash --ctx 65536
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from agent_loop import DSML, EOS, TOOL, Server, system_prompt, tiny_model

SLEEP = {
    "name": "sleep",
    "description": "Wait for a number of seconds, in the background.",
    "input_schema": {
        "type": "object",
        "properties": {"seconds": {"type": "integer"}},
        "required": ["seconds"],
    },
}


def _invoke(name: str, param: str, value: str, string: bool) -> str:
    return (
        f'<{DSML}invoke name="{name}">\n<{DSML}parameter name="{param}" '
        f'string="{"true" if string else "false"}">{value}</{DSML}parameter>\n</{DSML}invoke>'
    )


def calls(cycle: int) -> str:
    """Scripted call turn: reasoning, then sleep (async) and read_file (sync), then EOS."""
    return (
        f"Cycle {cycle}: start the timer and read the next file meanwhile.</think>"
        f"\n\n<{DSML}tool_calls>\n{_invoke('sleep', 'seconds', str(30 + cycle), False)}\n"
        f"{_invoke('read_file', 'path', f'src/file{cycle}.py', True)}\n</{DSML}tool_calls>{EOS}"
    )


def answer(text: str) -> str:
    return f"Short reasoning about it.</think>{text}{EOS}"


def file_text(cycle: int) -> str:
    return "\n".join(f"{n:4d}  line {n} of file{cycle}.py = {n * cycle}" for n in range(1, 25))


def _results(*pairs: tuple[str, str]) -> list[dict]:
    return [{"type": "tool_result", "tool_use_id": i, "content": t} for i, t in pairs]


def run(srv: Server, body: dict, cycles: int, background: bool) -> list[dict]:
    """The scripted conversation; one row per request."""
    sleep = {**SLEEP, "async": True} if background else SLEEP
    body = {**body, "tools": [sleep, TOOL]}
    msgs = [{"role": "user", "content": "Time each file read with the sleep tool."}]
    rows: list[dict] = []

    def send(script: str, what: str) -> dict:
        srv.script(script)
        resp = srv.messages({**body, "messages": msgs})
        u = resp["usage"]
        prompt = u["input_tokens"] + u["cache_read_input_tokens"]
        live = rows[-1]["prompt"] + rows[-1]["output"] - 1 if rows else None
        rows.append(
            {
                "request": len(rows) + 1,
                "what": what,
                "prompt": prompt,
                "cached": u["cache_read_input_tokens"],
                "prefilled": u["input_tokens"],
                "output": u["output_tokens"],
                "reused_all_live": None if live is None else u["cache_read_input_tokens"] == live,
            }
        )
        msgs.append({"role": "assistant", "content": resp["content"]})
        return resp

    late: tuple[str, str] | None = None
    for cycle in range(1, cycles + 1):
        resp = send(calls(cycle), "calls" if late is None else "late result + calls")
        sleep_id, read_id = [b["id"] for b in resp["content"] if b["type"] == "tool_use"]
        sleep_result = (sleep_id, f"slept {30 + cycle} s")
        given = [(read_id, file_text(cycle))]
        if not background:
            given.insert(0, sleep_result)
        msgs.append({"role": "user", "content": _results(*given)})
        send(answer(f"File {cycle} read; the timer is running."), "sync result")
        msgs.append({"role": "user", "content": f"Unrelated question {cycle}: what is 2+{cycle}?"})
        send(answer(f"It is {2 + cycle}."), "user turn")
        late = sleep_result if background else None
        nxt = [{"type": "text", "text": "Next file, please."}]
        msgs.append({"role": "user", "content": (_results(late) if late else []) + nxt})
    srv.script(answer("Done."))
    resp = srv.messages({**body, "messages": msgs})
    u = resp["usage"]
    rows.append(
        {
            "request": len(rows) + 1,
            "what": "late result" if background else "user turn",
            "prompt": u["input_tokens"] + u["cache_read_input_tokens"],
            "cached": u["cache_read_input_tokens"],
            "prefilled": u["input_tokens"],
            "output": u["output_tokens"],
            "reused_all_live": u["cache_read_input_tokens"]
            == rows[-1]["prompt"] + rows[-1]["output"] - 1,
        }
    )
    return rows


def _report(name: str, rows: list[dict], decisions: list[str]) -> dict:
    prompt = sum(r["prompt"] for r in rows)
    prefilled = sum(r["prefilled"] for r in rows)
    later = sum(r["prefilled"] for r in rows[1:]) / sum(r["prompt"] for r in rows[1:])
    print(f"\n{name}")
    print(f"{'req':>3} {'prompt':>7} {'cached':>7} {'prefilled':>9} {'ratio':>6} reused  decision")
    for r, d in zip(rows, decisions, strict=False):
        ok = "-" if r["reused_all_live"] is None else ("yes" if r["reused_all_live"] else "NO")
        ratio = r["prefilled"] / r["prompt"]
        print(
            f"{r['request']:>3} {r['prompt']:>7} {r['cached']:>7} {r['prefilled']:>9} "
            f"{ratio:>6.3f} {ok:>6}  {d} ({r['what']})"
        )
    every = all(r["reused_all_live"] for r in rows[1:])
    print(
        f"prefilled / prompt: {prefilled} / {prompt} = {prefilled / prompt:.4f}; after the "
        f"first request {later:.4f}; only the new suffix after the first: {every}"
    )
    return {
        "requests": rows,
        "decisions": decisions,
        "prefilled_over_prompt": round(prefilled / prompt, 4),
        "after_first_prefilled_over_prompt": round(later, 4),
        "only_new_suffix_after_first": every,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="checkpoint directory (default: tiny float32 model)")
    ap.add_argument("--ctx", type=int, default=16384, help="context size (16384)")
    ap.add_argument("--system-tokens", type=int, default=2000, help="system prompt size (2000)")
    ap.add_argument("--cycles", type=int, default=3, help="async call cycles (3)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="ds4mlx-async-tools-"))
    figures: dict = {"model": args.model or "tiny float32 (make_tiny)"}
    try:
        model = args.model or tiny_model(work)
        for name, background in (("async", True), ("sync", False)):
            log = work / f"serve-{name}.log"
            srv = Server(model, args.ctx, ["--kv-disk-dir", "none"], log)
            try:
                body = {
                    "model": "deepseek-v4-flash",
                    "max_tokens": 512,
                    "system": system_prompt(srv, args.system_tokens),
                    "thinking": {"type": "enabled", "budget_tokens": 4096, "display": "omitted"},
                }
                rows = run(srv, body, args.cycles, background)
            finally:
                srv.stop()
            decisions = [ln.split()[2] for ln in log.read_text().splitlines() if " prompt=" in ln]
            title = "sleep async: sync result alone, late result" if background else "all sync"
            figures[name] = _report(title, rows, decisions)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
