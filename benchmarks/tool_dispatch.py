"""Streaming tool dispatch: how soon a chat client can start a tool call.

A scripted two-call turn on one ``ds4mlx serve`` (``--enable-scripted-decoding``) is
streamed with ``"tool_call_dispatch": true``. The first call's invoke closes mid-turn (the
second call, with a long argument, follows). Measured on the client, per run:

- **close → dispatch**: from the chunk carrying the first call's closing argument delta
  (the ``}`` the decoder emits at ``</｜DSML｜invoke>``) to its ``event:
  tool_call_dispatch`` (goal: within one token's time);
- **close → end of turn**: from that chunk to the finish chunk, when a client without
  dispatch could start the call;
- **token time**: the median gap between two streamed chunks.

Reported: medians over ``--runs``.

    python benchmarks/tool_dispatch.py                 # the tiny float32 model (made once)
    python benchmarks/tool_dispatch.py -m /path/to/DeepSeek-V4-Flash
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_loop import Server, tiny_model  # noqa: E402  (the benchmarks' server harness)

EOS = "<｜end▁of▁sentence｜>"
TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "run a command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}


def script(second_words: int) -> str:
    """Reasoning, then a block of two ``bash`` calls; the second's argument is long."""
    long = " ".join(f"arg{i}" for i in range(second_words))

    def invoke(cmd: str) -> str:
        return (
            '<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="command" string="true">'
            f"{cmd}</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
        )

    return f"ok</think>\n\n<｜DSML｜tool_calls>\n{invoke('ls')}{invoke('echo ' + long)}</｜DSML｜tool_calls>{EOS}"


def one_run(server: Server, second_words: int) -> dict[str, float]:
    server.script(script(second_words))
    body = {
        "model": "deepseek-v4-flash",
        "messages": [{"role": "user", "content": "look around"}],
        "tools": [TOOL],
        "stream": True,
        "tool_call_dispatch": True,
    }
    stamps: list[tuple[float, str | None, str]] = []
    event = None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                stamps.append((time.monotonic(), event, line[5:].strip()))
                event = None
    close = dispatch = end = None
    gaps = []
    for k, (t, ev, data) in enumerate(stamps):
        if k:
            gaps.append(t - stamps[k - 1][0])
        if ev == "tool_call_dispatch" and dispatch is None:
            dispatch = t
            continue
        if data == "[DONE]" or ev is not None:
            continue
        choice = (json.loads(data).get("choices") or [{}])[0]
        for tc in (choice.get("delta") or {}).get("tool_calls") or []:
            if tc["index"] == 0 and (tc.get("function") or {}).get("arguments", "").endswith("}"):
                close = t
        if choice.get("finish_reason"):
            end = t
    assert close is not None and dispatch is not None and end is not None, "incomplete stream"
    return {
        "close_to_dispatch_ms": (dispatch - close) * 1e3,
        "close_to_end_ms": (end - close) * 1e3,
        "token_ms": statistics.median(gaps) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="checkpoint (default: the tiny model)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--second-words", type=int, default=40, help="words of the second call")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ds4mlx-dispatch-") as tmp:
        work = Path(tmp)
        model = args.model or tiny_model(work)
        server = Server(model, args.ctx, [], work / "serve.log")
        try:
            one_run(server, args.second_words)  # warm-up
            runs = [one_run(server, args.second_words) for _ in range(args.runs)]
        finally:
            server.stop()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(json.dumps({"runs": args.runs, **{k: round(v, 2) for k, v in med.items()}}))


if __name__ == "__main__":
    main()
