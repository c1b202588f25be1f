"""Speculative decoding at Flash depth (43 layers, the Flash-layout tiny config).

Four figures (docs/KERNELS.md "Speculative decoding"):

1. **Verify cost**: one forward over 6 rows from a decode state (what ``--draft-tokens
   5`` verifies) ÷ one single-token decode step, on caches prefilled with 256 tokens;
   per run the median of ``--steps`` interleaved steps (decode, verify, decode, …; each
   verify rewound), the ratio's median over ``--runs`` runs; both graphs' primitive
   counts (``ds4mlx.model.graph.decode_step_primitives``, view ops apart).
2. **Copy-heavy agent turn**: the prompt holds a file of ``--copy-tokens`` tokens and the
   reply re-emits it (scripted decoding forces the target's choices; every token still
   runs through the network); plain pipelined decode vs ``--speculative lookup``:
   tokens per target forward and tok/s.
3. **Always-wrong drafter with back-off**: a draft hook that is never right; verifies
   that accepted nothing ÷ decode steps (counted), tok/s against plain.
4. **Random MTP head**: reported as not available until ``mtp.*`` loading lands.

Usage: ``python benchmarks/speculative.py [--runs 3] [--steps 20] [--copy-tokens 1000]
[--json out.json]``. Toy dimensions: figure 1 guards graph overhead only (on a Mac the
verify's cost is the routed experts it reads; ``ds4mlx bench --shape flash`` measures
that at real dimensions), and the Mac verdict needs a Metal run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from ds4mlx.blas import active_blas, ensure_openblas

ensure_openblas()  # re-executes with OpenBLAS preloaded when the system has it

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from ds4mlx.engine import Engine, SamplingParams, TurnHooks, TurnSpec, run_turn  # noqa: E402
from ds4mlx.engine.speculative import Speculation  # noqa: E402
from ds4mlx.model.graph import cache_buffers, decode_step_primitives  # noqa: E402
from ds4mlx.model.tiny import make_tiny  # noqa: E402

LAYERS = 43
PREFILL = 256
ROWS = 6


def verify_cost(model, runs: int, steps: int) -> dict:
    """Figure 1: primitives and the verify ÷ decode time ratio (see the module doc)."""
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(1000, 100000, PREFILL), dtype=mx.int32)[None]
    cache = model.make_cache()
    mx.eval(model(prompt, cache), cache_buffers(cache))
    feed = rng.integers(1000, 100000, 4 * steps + 16).tolist()
    one = decode_step_primitives(model, cache, feed[0])
    six = decode_step_primitives(model, cache, feed[:ROWS])
    per_run = []
    for _ in range(runs):
        dec, ver = [], []
        for i in range(steps + 2):
            x1 = mx.array([[feed[i]]], dtype=mx.int32)
            t0 = time.perf_counter()
            mx.eval(model(x1, cache), cache_buffers(cache))
            t1 = time.perf_counter()
            saved = [c.capture() for c in cache]
            x6 = mx.array([feed[i : i + ROWS]], dtype=mx.int32)
            t2 = time.perf_counter()
            mx.eval(model(x6, cache), cache_buffers(cache))
            t3 = time.perf_counter()
            for c, s in zip(cache, saved, strict=True):
                c.rewind(s)
            if i >= 2:  # warm-up
                dec.append(t1 - t0)
                ver.append(t3 - t2)
        per_run.append(
            {
                "decode_ms": 1e3 * statistics.median(dec),
                "verify_ms": 1e3 * statistics.median(ver),
            }
        )
    ratios = [r["verify_ms"] / r["decode_ms"] for r in per_run]
    return {
        "primitives_decode": {k: one[k] for k in ("primitives", "non_view")},
        "primitives_verify6": {k: six[k] for k in ("primitives", "non_view")},
        "runs": per_run,
        "ratio_per_run": ratios,
        "ratio_median": statistics.median(ratios),
    }


class AlwaysWrong(TurnHooks):
    """Drafts ``k`` tokens that are never the target's (the target is scripted)."""

    def __init__(self, k: int):
        self.k = k

    def draft(self, turn):
        return [7] * self.k


def _turn(engine, prompt, script, mode="off", hooks=None) -> dict:
    engine.speculation = Speculation(mode, 5)
    s = engine.new_session()
    s.prefill(prompt)
    spec = TurnSpec(SamplingParams(temperature=0), len(script), parse=False, ignore_eos=True)
    t0 = time.perf_counter()
    r = run_turn(s, engine.tokenizer, spec, script=script, hooks=hooks)
    dt = time.perf_counter() - t0
    engine.speculation = Speculation()
    return {
        "tokens": r.completion_tokens,
        "tok_s": r.completion_tokens / dt,
        "forwards": r.forwards,
        "tokens_per_forward": r.fed / max(r.forwards, 1),
        "drafted": r.drafted,
        "accepted": r.accepted,
    }


def copy_turn(engine, n: int) -> dict:
    """Figure 2: the reply re-emits a file of ``n`` tokens that the prompt holds."""
    tok = engine.tokenizer
    rng = np.random.default_rng(2)
    words = ["def", "return", "self", "value", "index", "(", ")", ":", "\n", "    ", "x", "+"]
    text = ""
    while len(tok.encode(text)) < n:
        text += " ".join(rng.choice(words, 8)) + "\n"
    body = tok.encode(text)[:n]
    head = tok.encode("<｜begin▁of▁sentence｜><｜User｜>Rewrite this file:\n")
    tail = tok.encode("<｜Assistant｜></think>")
    prompt = head + body + tail
    plain = _turn(engine, prompt, body)
    spec = _turn(engine, prompt, body, mode="lookup")
    return {"plain": plain, "lookup": spec, "speedup": spec["tok_s"] / plain["tok_s"]}


def always_wrong(engine, n: int) -> dict:
    """Figure 3: a never-right drafter, paused by the back-off."""
    tok = engine.tokenizer
    prompt = tok.encode("<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>")
    script = np.random.default_rng(3).integers(1000, 100000, n).tolist()
    plain = _turn(engine, prompt, script)
    wrong = _turn(engine, prompt, script, hooks=AlwaysWrong(5))
    wasted = wrong["drafted"]  # each verify stops at its first (wrong) draft
    return {
        "plain": plain,
        "always_wrong": wrong,
        "wasted_verifies": wasted,
        "wasted_share_of_steps": wasted / n,
        "tok_s_ratio": wrong["tok_s"] / plain["tok_s"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--copy-tokens", type=int, default=1000)
    p.add_argument("--wrong-tokens", type=int, default=1000)
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args(argv)
    print(f"BLAS {active_blas()}, {LAYERS} layers, Flash layout", file=sys.stderr)
    with tempfile.TemporaryDirectory() as d:
        make_tiny(d, expert_bits=None, other_bits=None, layers=LAYERS)
        engine = Engine.load(d, ctx_size=4 * a.copy_tokens + 4096)
        report = {"verify_cost": verify_cost(engine.model, a.runs, a.steps)}
        v = report["verify_cost"]
        print(
            f"1. verify {ROWS} rows / decode 1 row: per run "
            + ", ".join(f"{x:.2f}" for x in v["ratio_per_run"])
            + f"; median {v['ratio_median']:.2f}; primitives decode "
            f"{v['primitives_decode']} verify {v['primitives_verify6']}"
        )
        c = report["copy_turn"] = copy_turn(engine, a.copy_tokens)
        print(
            f"2. copy-heavy turn ({a.copy_tokens} tokens): lookup "
            f"{c['lookup']['tokens_per_forward']:.2f} tokens/forward, "
            f"{c['lookup']['tok_s']:.1f} tok/s vs plain {c['plain']['tok_s']:.1f} tok/s "
            f"({c['speedup']:.2f}x)"
        )
        w = report["always_wrong"] = always_wrong(engine, a.wrong_tokens)
        print(
            f"3. always-wrong drafter: {w['wasted_verifies']} wasted verifies in "
            f"{a.wrong_tokens} steps ({100 * w['wasted_share_of_steps']:.1f} %), "
            f"{w['always_wrong']['tok_s']:.1f} tok/s vs plain {w['plain']['tok_s']:.1f}"
        )
        report["mtp"] = "not available: mtp.* drafter loading is not implemented yet"
        print(f"4. random MTP head: {report['mtp']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
