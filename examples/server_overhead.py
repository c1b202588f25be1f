"""Server overhead benchmark (docs/ARCHITECTURE.md §8): decode tokens/s seen by a streaming HTTP
client ÷ engine-only decode tokens/s, same model, same prompt, greedy.

    python examples/server_overhead.py -m /path/to/model [--tokens 256]
    python examples/server_overhead.py --demo

Engine-only: the chat prompt is prefilled in process, then ``tokens`` greedy
sample+decode steps are timed from the first sampled token to the last. HTTP: a
``ds4mlx serve`` subprocess streams ``/v1/chat/completions`` (``deepseek-chat``,
temperature 0) and the client times the same span, from the first content chunk to
the last. Both runs must produce the same tokens; the script checks the text.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

try:
    import httpx
except ImportError:  # the SDK examples' dependency, not ds4mlx's
    sys.exit("server_overhead.py needs httpx: pip install httpx (or pip install -e '.[test]')")

PROMPT = "Write a long story about a lighthouse keeper."


def engine_only(e, n: int, ctx: int) -> tuple[float, str, int]:
    """Decode tokens/s of the engine's own turn loop (no HTTP), the text and its length."""
    from ds4mlx.dsml import render
    from ds4mlx.dsml.conversation import Conversation, Message
    from ds4mlx.engine import SamplingParams, TurnSpec, run_turn

    s = e.session
    s.reset()
    prompt = render(
        Conversation(messages=[Message("user", PROMPT)], thinking=False), context_size=ctx
    )
    ids = e.tokenizer.encode(prompt.text, content=prompt.content)
    spec = TurnSpec(SamplingParams(temperature=0), n, parse=False)
    pieces: list[str] = []
    res = run_turn(s, e.tokenizer, spec, prefill=ids, emit=lambda ev: pieces.append(ev.text))
    n_out = res.completion_tokens
    rate = (n_out - 1) / res.decode_s if n_out > 1 and res.decode_s > 0 else float("nan")
    return rate, "".join(pieces), n_out


def start_server(model: str, ctx: int) -> tuple[subprocess.Popen, str]:
    """Start ``ds4mlx serve`` on a free port; return the process and its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "ds4mlx.cli", "serve", "-m", model]
    cmd += ["--port", str(port), "--ctx", str(ctx), "-q"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    return proc, url


def http(url: str, n: int) -> tuple[float, str, int]:
    body = {
        "model": "deepseek-chat",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, times, usage = [], [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=None) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                usage = d["usage"]
            for c in d["choices"]:
                if c["delta"].get("content"):
                    text.append(c["delta"]["content"])
                    times.append(time.perf_counter())
    k = usage["completion_tokens"]
    return (k - 1) / (times[-1] - times[0]), "".join(text), k


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("-m", "--model", default=os.environ.get("DS4MLX_MODEL"))
    ap.add_argument("--demo", action="store_true", help="use the cached tiny demo model")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument(
        "--rounds", type=int, default=1, help="alternate engine/HTTP runs; report medians"
    )
    a = ap.parse_args()
    if a.demo:
        from ds4mlx.model.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    if not a.model:
        ap.error("give -m MODEL or --demo")
    from ds4mlx.blas import ensure_openblas

    ensure_openblas()
    import statistics

    from ds4mlx.engine import Engine

    engine = Engine.load(a.model, ctx_size=a.ctx)
    proc, url = start_server(a.model, a.ctx)
    e_rates, h_rates, same = [], [], True
    try:
        for _ in range(a.rounds):
            # Alternate, so that load from other processes hits both sides alike.
            e_rate, e_text, e_n = engine_only(engine, a.tokens, a.ctx)
            h_rate, h_text, h_n = http(url, a.tokens)
            e_rates.append(e_rate)
            h_rates.append(h_rate)
            same = same and e_text.removesuffix("<｜end▁of▁sentence｜>") == h_text
            print(
                f"round: engine {e_rate:7.1f} tok/s  HTTP {h_rate:7.1f} tok/s  ratio {h_rate / e_rate:.3f}"
            )
    finally:
        proc.terminate()
        proc.wait(30)
    e_med, h_med = statistics.median(e_rates), statistics.median(h_rates)
    print(f"engine-only decode: {e_med:8.1f} tok/s  ({e_n} tokens)")
    print(f"HTTP streamed:      {h_med:8.1f} tok/s  ({h_n} tokens)")
    print(f"ratio HTTP/engine:  {h_med / e_med:8.3f}   same output: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
