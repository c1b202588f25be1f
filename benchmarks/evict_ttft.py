"""Evict saves off the inference thread: time to first token with and without one.

An ``evict`` save happens when a request replaces a live state worth keeping (≥ the
min-tokens setting). Its file I/O runs on the disk tier's writer thread; only the
in-memory serialization stays on the inference thread. This benchmark measures, on one
``ds4mlx serve`` with the default cache settings (a fresh directory):

- **with evict**: a long unrelated conversation is made live, then a new prompt arrives
  (cold: its plan evict-saves the long state first) — its time to first token;
- **without**: a short conversation (below min-tokens: nothing to save) is made live,
  then a new prompt of the same size arrives — its time to first token.

Each new prompt is unique (no disk hit) and of the same size, so both kinds of job do
the same prefill and the same saves of their own (chat anchor, prompt end). Reported:
the two medians over ``--jobs`` jobs each (interleaved, so drift hits both alike) and
their ratio (goal: within 10 %). Before each measured request the benchmark waits until
the writer thread is idle (``/health`` ``kv_writer``): the long conversation's own
``continued`` saves, one per 2048 tokens it crossed, would otherwise still be written
while the measured request runs, and on a 2-core machine that I/O competes with its
prefill whatever the evict does (``--no-drain`` measures with it). Also reported: the
median time the writer spent on one evict save, which an inline write would have added.

    python benchmarks/evict_ttft.py                 # the tiny float32 model (made once)
    python benchmarks/evict_ttft.py -m /path/to/DeepSeek-V4-Flash --ctx 65536 --live-tokens 30000
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_loop import Server, tiny_model  # noqa: E402  (the benchmarks' server harness)

_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


def text_of(server: Server, tokens: int, seed: int) -> str:
    """A unique text of about ``tokens`` tokens (``seed`` makes it differ from the start)."""
    words = [f"Note {seed}."]
    k = 0
    while True:
        chunk = " ".join(
            f"Rule {k + i}: {' '.join(_WORDS[(k + i + j * 5 + seed) % 12] for j in range(6))}."
            for i in range(50)
        )
        words.append(chunk)
        k += 50
        if server.count(" ".join(words)) >= tokens:
            return " ".join(words)


def body(system: str, user: str) -> dict:
    return {
        "model": "deepseek-chat",
        "max_tokens": 2,
        "system": system,
        "messages": [{"role": "user", "content": user}],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-m", "--model", help="checkpoint directory (default: tiny float32 model)")
    ap.add_argument("--ctx", type=int, default=16384, help="context size (16384)")
    ap.add_argument("--live-tokens", type=int, default=6000, help="evicted state size (6000)")
    ap.add_argument(
        "--prompt-tokens", type=int, default=1500, help="tokens of each measured prompt (1500)"
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=10,
        help="measured jobs with an evict, and as many without (10 each)",
    )
    ap.add_argument(
        "--no-drain",
        dest="drain",
        action="store_false",
        help="do not wait for the writer thread to finish the previous job's saves (the "
        "long state's continued saves) before each measured request",
    )
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="ds4mlx-evict-ttft-"))
    model = args.model or tiny_model(work)
    srv = Server(model, args.ctx, ["--kv-disk-dir", str(work / "kv")], work / "serve.log")
    try:
        prompt_text = text_of(srv, args.prompt_tokens, 0)
        long_text = text_of(srv, args.live_tokens, 1)

        def ttft_after(live: str, tag: str) -> float:
            """Make ``live`` the live state, then time a new prompt that replaces it."""
            srv.script("x")
            srv.messages(body(live, tag))
            srv.script("y")
            if args.drain:
                srv.drain()
            t, _, cached = srv.ttft(body(f"[{tag}] " + prompt_text, "go"))
            assert cached == 0, cached
            return t

        with_evict, without = [], []
        for i in range(args.jobs):
            # With: a long live state, replaced by the new prompt (evict save).
            with_evict.append(ttft_after(f"[long {i}] " + long_text, f"with {i}"))
            # Without: a short live state (nothing worth saving), then the same-size prompt.
            without.append(ttft_after(f"[short {i}]", f"without {i}"))
    finally:
        srv.stop()
    log = (work / "serve.log").read_text()
    evicts = log.count("reason=evict")
    # What each evict save cost the writer thread (the store logs every file it writes):
    # had it run on the inference thread, the next request's TTFT would carry it.
    write_ms = [
        float(m.group(1))
        for m in re.finditer(r"stored tokens=\d+ reason=evict .*save=([\d.]+) ms", log)
    ]
    m_with, m_without = statistics.median(with_evict), statistics.median(without)
    figures = {
        "jobs": args.jobs,
        "live_tokens": args.live_tokens,
        "prompt_tokens": args.prompt_tokens,
        "median_ttft_with_evict_s": m_with,
        "median_ttft_without_s": m_without,
        "ratio": m_with / m_without,
        "evict_saves_logged": evicts,
        "drained": args.drain,
        "median_evict_write_ms": statistics.median(write_ms) if write_ms else None,
    }
    print(json.dumps(figures, indent=2))
    print(
        f"median TTFT after an evict {m_with * 1e3:.0f} ms vs {m_without * 1e3:.0f} ms without "
        f"({(m_with / m_without - 1) * 100:+.1f} %; goal within 10 %), {evicts} evict saves"
    )
    if write_ms:
        w = statistics.median(write_ms)
        print(
            f"an evict save took {w:.0f} ms on the writer thread (median): "
            f"{w / (m_without * 1e3) * 100:.0f} % of the TTFT without, had it run inline"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
