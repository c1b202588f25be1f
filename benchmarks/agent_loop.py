"""Agent-loop reuse and restart benchmark (docs/ARCHITECTURE.md §8).

A scripted Anthropic tool session against a real ``ds4mlx serve``: a system prompt of
``--system-tokens`` tokens, thinking on (display omitted, replayed through the
signature carrier, as Claude Code does), every turn a tool call whose result the next
request sends back. Reported:

1. **Reuse** — total tokens prefilled ÷ total prompt tokens received over the
   ``--turns`` turns (goal < 0.15), and for every tool turn whether the prefill was
   exactly the tool-results suffix (``<｜end▁of▁sentence｜><｜User｜><tool_result>…``
   ``<｜Assistant｜><think>``, tokenized on its own).
2. **Restart** — the server is stopped cleanly (``shutdown`` snapshot) and started
   again on the same ``--kv-disk-dir``; the client sends the next tool turn. Time to
   first token of that disk hit ÷ time to first token of the same request on a server
   without a disk cache (a cold prefill of the whole prompt). Each figure is the
   median of ``--repeats`` runs.

Scripted decoding (``--enable-scripted-decoding``) makes the model emit the reasoning
and DSML tool calls while every token still runs through the network, so prefill
counts and timings are real.

    python benchmarks/agent_loop.py                 # the tiny float32 model (made once)
    python benchmarks/agent_loop.py -m /path/to/DeepSeek-V4-Flash --ctx 65536
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
DSML = "｜DSML｜"
TOOL = {
    "name": "read_file",
    "description": "Read a file of the workspace.",
    "input_schema": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["path"],
    },
}
_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


class Server:
    """A ``ds4mlx serve`` subprocess on a free port."""

    def __init__(self, model: str | None, ctx: int, extra: list[str], log: Path):
        """``model`` None serves ``--demo``; ``extra``: more ``serve`` arguments."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        which = ["--demo"] if model is None else ["-m", model]
        cmd = [sys.executable, "-m", "ds4mlx.cli", "serve", *which, "--port", str(self.port)]
        cmd += ["--ctx", str(ctx), "--enable-scripted-decoding", *extra]
        env = {**os.environ, "DS4MLX_REASONING_KEY": "agent-loop-benchmark"}
        self.log = log
        self._f = open(log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self._f, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(120)
        self._f.close()

    def script(self, text: str) -> None:
        httpx.post(
            self.url + "/debug/script", json={"texts": [text]}, timeout=10
        ).raise_for_status()

    def drain(self, timeout: float = 120) -> None:
        """Wait until the disk tier's writer thread has nothing queued or in flight."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            w = httpx.get(self.url + "/health", timeout=10).json().get("kv_writer")
            if not w or (not w["pending"] and not w["writing"]):
                return
            time.sleep(0.05)
        raise RuntimeError("the snapshot writer did not drain")

    def count(self, text: str) -> int:
        r = httpx.post(self.url + "/v1/tokenize", json={"text": text}, timeout=60)
        return r.json()["count"]

    def messages(self, body: dict) -> dict:
        r = httpx.post(self.url + "/v1/messages", json=body, timeout=3600)
        r.raise_for_status()
        return r.json()

    def ttft(self, body: dict) -> tuple[float, int, int]:
        """Stream ``body``: seconds to the first content block, prompt and cached tokens."""
        t0 = time.perf_counter()
        first, prompt, cached = None, 0, 0
        with httpx.stream(
            "POST", self.url + "/v1/messages", json={**body, "stream": True}, timeout=3600
        ) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("event: content_block_") and first is None:
                    first = time.perf_counter() - t0
                elif line.startswith("data:") and '"message_start"' in line:
                    u = json.loads(line[5:])["message"]["usage"]
                    cached = u["cache_read_input_tokens"]
                    prompt = u["input_tokens"] + cached
        return (first if first is not None else float("nan")), prompt, cached


def tiny_model(work: Path) -> str:
    """The benchmarks' default checkpoint: the tiny float32 model, made in ``work``."""
    from ds4mlx.model.tiny import make_tiny

    model = str(work / "tiny")
    make_tiny(model, expert_bits=None, other_bits=None)
    return model


def system_prompt(server: Server, tokens: int) -> str:
    """A varied system prompt of at most ``tokens`` tokens (within ~15 of it)."""

    def rules(n: int) -> str:
        return " ".join(
            f"Rule {k}: {' '.join(_WORDS[(k + j * 5) % len(_WORDS)] for j in range(6))}."
            for k in range(n)
        )

    lo, hi = 1, 2
    while server.count(rules(hi)) <= tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # largest rule count that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if server.count(rules(mid)) <= tokens else (lo, mid)
    return rules(lo)


def call(turn: int) -> str:
    """Scripted output of one turn: reasoning, then one DSML tool call, then EOS."""
    return (
        f"Turn {turn}: I still need file number {turn}; reading it next.</think>"
        f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="read_file">\n'
        f'<{DSML}parameter name="path" string="true">src/file{turn}.py</{DSML}parameter>\n'
        f'<{DSML}parameter name="limit" string="false">200</{DSML}parameter>\n'
        f"</{DSML}invoke>\n</{DSML}tool_calls>{EOS}"
    )


def result_text(turn: int) -> str:
    return "\n".join(f"{n:4d}  line {n} of file{turn}.py = {n * turn}" for n in range(1, 25))


def tool_turn(body: dict, resp: dict, turn: int) -> tuple[dict, str]:
    """The next request (assistant turn replayed + its tool result) and its suffix."""
    (use,) = [b for b in resp["content"] if b["type"] == "tool_use"]
    res = result_text(turn)
    messages = body["messages"] + [
        {"role": "assistant", "content": resp["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": res}],
        },
    ]
    suffix = f"{EOS}{USER}<tool_result>{res}</tool_result>{ASSISTANT}<think>"
    return {**body, "messages": messages}, suffix


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="checkpoint directory (default: tiny float32 model)")
    ap.add_argument("--ctx", type=int, default=16384, help="context size (16384)")
    ap.add_argument("--system-tokens", type=int, default=4000, help="system prompt size (4000)")
    ap.add_argument("--turns", type=int, default=10, help="tool turns in the session (10)")
    ap.add_argument("--repeats", type=int, default=3, help="restart/cold TTFT runs (3)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="ds4mlx-agent-loop-"))
    model = args.model or tiny_model(work)
    kv = work / "kv"
    disk_flags = ["--kv-disk-dir", str(kv)]
    try:
        srv = Server(model, args.ctx, disk_flags, work / "serve.log")
        system = system_prompt(srv, args.system_tokens)
        body = {
            "model": "deepseek-v4-flash",
            "max_tokens": 512,
            "system": system,
            "tools": [TOOL],
            "thinking": {"type": "enabled", "budget_tokens": 4096, "display": "omitted"},
            "messages": [{"role": "user", "content": "Read the source files one by one."}],
        }
        rows = []
        suffix = None
        for turn in range(1, args.turns + 1):
            srv.script(call(turn))
            t0 = time.perf_counter()
            resp = srv.messages(body)
            dt = time.perf_counter() - t0
            u = resp["usage"]
            prompt = u["input_tokens"] + u["cache_read_input_tokens"]
            prefilled = u["input_tokens"]
            want = srv.count(suffix) if suffix is not None else None
            rows.append(
                {
                    "turn": turn,
                    "prompt": prompt,
                    "cached": u["cache_read_input_tokens"],
                    "prefilled": prefilled,
                    "suffix": want,
                    "exact_suffix": want == prefilled if want is not None else None,
                    "seconds": round(dt, 3),
                }
            )
            body, suffix = tool_turn(body, resp, turn)
        srv.stop()

        # Restart on the same directory: the next tool turn is a disk hit.
        restart, cold = [], []
        for _ in range(args.repeats):
            # Each restart resumes from the snapshot the first session's clean stop wrote;
            # the restarted server is killed, not stopped, so that it writes none of its own.
            # No prompt-end save either: each run measures the resume from that snapshot.
            no_prompt = [*disk_flags, "--kv-cache-no-prompt-end"]
            srv = Server(model, args.ctx, no_prompt, work / "serve.log")
            srv.script(call(args.turns + 1))
            t, n_prompt, n_cached = srv.ttft(body)
            restart.append(t)
            srv.proc.kill()
            srv.proc.wait()
            srv = Server(model, args.ctx, ["--kv-disk-dir", "none"], work / "serve-cold.log")
            srv.script(call(args.turns + 1))
            t, n_cold, _ = srv.ttft(body)
            cold.append(t)
            srv.stop()
            assert n_cold == n_prompt, (n_cold, n_prompt)
        decisions = [
            ln.split()[2]
            for ln in (work / "serve.log").read_text().splitlines()
            if " prompt=" in ln
        ]
    finally:
        shutil.rmtree(work / "kv", ignore_errors=True)

    total_prompt = sum(r["prompt"] for r in rows)
    total_prefilled = sum(r["prefilled"] for r in rows)
    exact = [r["exact_suffix"] for r in rows if r["exact_suffix"] is not None]
    figures = {
        "model": model if args.model else "tiny float32 (make_tiny)",
        "system_tokens": args.system_tokens,
        "turns": rows,
        "total_prompt_tokens": total_prompt,
        "total_prefilled_tokens": total_prefilled,
        "prefilled_over_prompt": round(total_prefilled / total_prompt, 4),
        "exact_suffix_every_tool_turn": all(exact),
        "restart_prompt_tokens": n_prompt,
        "restart_cached_tokens": n_cached,
        "restart_ttft_s": [round(x, 4) for x in restart],
        "cold_ttft_s": [round(x, 4) for x in cold],
        "restart_over_cold": round(statistics.median(restart) / statistics.median(cold), 4),
        "decisions": decisions,
    }
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'prefilled':>9} {'suffix':>6} exact  seconds")
    for r in rows:
        ex = "-" if r["exact_suffix"] is None else ("yes" if r["exact_suffix"] else "NO")
        sfx = "-" if r["suffix"] is None else r["suffix"]
        print(
            f"{r['turn']:>4} {r['prompt']:>7} {r['cached']:>7} {r['prefilled']:>9} {sfx:>6} {ex:>5}  {r['seconds']:.2f}"
        )
    print(
        f"prefilled / prompt over {len(rows)} turns: {total_prefilled} / {total_prompt} = "
        f"{figures['prefilled_over_prompt']:.4f} (goal < 0.15); exact suffix on every tool turn: "
        f"{figures['exact_suffix_every_tool_turn']}"
    )
    print(
        f"restart disk hit TTFT {statistics.median(restart) * 1e3:.0f} ms vs cold prefill TTFT "
        f"{statistics.median(cold) * 1e3:.0f} ms ({n_prompt} prompt tokens, {n_cached} from "
        f"disk): ratio {figures['restart_over_cold']:.4f}"
    )
    print("decisions:", " ".join(decisions))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
