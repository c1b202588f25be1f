"""Speculative decoding at Flash depth (43 layers, the Flash-layout tiny config).

Five figures (docs/KERNELS.md "Speculative decoding"):

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
4. **Random tiny MTP head** (``make-tiny --mtp 1``, drafting with ``--speculative mtp``):
   acceptance, tokens per target forward and tok/s against plain decode, (a) on the
   random model's own greedy output (the head is random: it is almost never right, the
   back-off pauses it) and (b) on a target scripted to follow the head's first drafts
   (``ds4mlx.engine.mtp.drafted_continuation``: each verify accepts one draft).
5. **Random DSpark head** (``make-tiny --dspark``: Flash 0731's three stages, targets
   layers 40–42, random weights): an unscripted greedy turn of ``--dspark-tokens``
   tokens, plain vs ``--speculative dspark`` (back-off on): acceptance, tokens per target
   forward, tok/s; and one proposal of 5 drafts ÷ one decode step (median of
   ``--steps``), the drafter's own cost.

Usage: ``python benchmarks/speculative.py [--runs 3] [--steps 20] [--copy-tokens 1000]
[--mtp-tokens 200] [--dspark-tokens 200] [--figures 12345] [--json out.json]``. Toy
dimensions: figure 1 guards graph overhead only (on a Mac the verify's cost is the routed experts it reads; ``ds4mlx bench --shape flash`` measures
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
from ds4mlx.engine.mtp import drafted_continuation  # noqa: E402
from ds4mlx.engine.speculative import Speculation, speculation_for  # noqa: E402
from ds4mlx.model.graph import cache_buffers, decode_step_primitives, time_verify  # noqa: E402
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
    one = decode_step_primitives(model, cache, int(rng.integers(1000, 100000)))
    six = decode_step_primitives(model, cache, rng.integers(1000, 100000, ROWS).tolist())
    per_run = []
    for _ in range(runs):
        feed = rng.integers(1000, 100000, steps + 2 + ROWS - 1).tolist()
        t = time_verify(model, cache, feed, ROWS, warmup=2)
        per_run.append(
            {
                "decode_ms": statistics.median(t["decode_ms"]),
                "verify_ms": statistics.median(t["verify_ms"]),
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


def _turn(engine, prompt, script, mode="off", hooks=None, n=None) -> dict:
    engine.speculation = speculation_for(engine, mode, 5)
    s = engine.new_session()
    s.prefill(prompt)
    n = len(script) if script else n
    spec = TurnSpec(SamplingParams(temperature=0), n, parse=False, ignore_eos=True)
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


def dspark_head(path: str, n: int, steps: int) -> dict:
    """Figure 5: the random tiny DSpark head (see the module doc)."""
    engine = Engine.load(path, ctx_size=4096)
    tok = engine.tokenizer
    prompt = tok.encode("<｜begin▁of▁sentence｜><｜User｜>hi there<｜Assistant｜></think>")
    spec = TurnSpec(SamplingParams(temperature=0), n, parse=False, ignore_eos=True)
    out = {}
    for mode in ("off", "dspark"):
        engine.speculation = speculation_for(engine, mode, 5)
        s = engine.new_session()
        s.prefill(prompt)
        t0 = time.perf_counter()
        r = run_turn(s, tok, spec)
        dt = time.perf_counter() - t0
        out[mode] = {
            "tok_s": r.completion_tokens / dt,
            "drafted": r.drafted,
            "accepted": r.accepted,
            "acceptance": r.accepted / max(r.drafted, 1),
            "tokens_per_forward": r.fed / max(r.forwards, 1),
        }
    drafter, greedy = engine.speculation.dspark, SamplingParams(temperature=0)
    s = engine.new_session()
    s.prefill(prompt)
    prop, dec = [], []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        drafter.propose(s, 1000 + i, 5, greedy)
        t1 = time.perf_counter()
        s.decode(1000 + i)
        t2 = time.perf_counter()
        if i >= 2:
            prop.append(t1 - t0)
            dec.append(t2 - t1)
    engine.speculation = speculation_for(engine, "off")
    out["proposal_ms"] = 1e3 * statistics.median(prop)
    out["decode_ms"] = 1e3 * statistics.median(dec)
    out["proposal_over_decode"] = out["proposal_ms"] / out["decode_ms"]
    out["tok_s_ratio"] = out["dspark"]["tok_s"] / out["off"]["tok_s"]
    return out


def mtp_head(engine, n: int) -> dict:
    """Figure 4: the random MTP head, unscripted and on a continuation it drafts right."""
    tok = engine.tokenizer
    prompt = tok.encode("<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>")
    out = {}
    for case, script in (("own_output", None), ("follows_head", True)):
        if script:
            script = drafted_continuation(engine, prompt, n)
        plain = _turn(engine, prompt, script, n=n)
        mtp = _turn(engine, prompt, script, mode="mtp", n=n)
        out[case] = {
            "plain": plain,
            "mtp": mtp,
            "acceptance": mtp["accepted"] / max(mtp["drafted"], 1),
            "tok_s_ratio": mtp["tok_s"] / plain["tok_s"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--copy-tokens", type=int, default=1000)
    p.add_argument("--wrong-tokens", type=int, default=1000)
    p.add_argument("--dspark-tokens", type=int, default=200)
    p.add_argument("--mtp-tokens", type=int, default=200)
    p.add_argument("--figures", default="12345", help="which figures to run (digits 1-5)")
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args(argv)
    figs = set(a.figures)
    print(f"BLAS {active_blas()}, {LAYERS} layers, Flash layout", file=sys.stderr)
    with tempfile.TemporaryDirectory() as d:
        # One MTP block, drawn after the network's weights (which do not change with it).
        make_tiny(d, expert_bits=None, other_bits=None, layers=LAYERS, mtp=1)
        ctx = 4 * max(a.copy_tokens, a.wrong_tokens, a.mtp_tokens) + 4096
        engine = Engine.load(d, ctx_size=ctx, speculative="mtp")
        report: dict = {}
        if "1" in figs:
            v = report["verify_cost"] = verify_cost(engine.model, a.runs, a.steps)
            print(
                f"1. verify {ROWS} rows / decode 1 row: per run "
                + ", ".join(f"{x:.2f}" for x in v["ratio_per_run"])
                + f"; median {v['ratio_median']:.2f}; primitives decode "
                f"{v['primitives_decode']} verify {v['primitives_verify6']}"
            )
        if "2" in figs:
            c = report["copy_turn"] = copy_turn(engine, a.copy_tokens)
            print(
                f"2. copy-heavy turn ({a.copy_tokens} tokens): lookup "
                f"{c['lookup']['tokens_per_forward']:.2f} tokens/forward, "
                f"{c['lookup']['tok_s']:.1f} tok/s vs plain {c['plain']['tok_s']:.1f} tok/s "
                f"({c['speedup']:.2f}x)"
            )
        if "3" in figs:
            w = report["always_wrong"] = always_wrong(engine, a.wrong_tokens)
            print(
                f"3. always-wrong drafter: {w['wasted_verifies']} wasted verifies in "
                f"{a.wrong_tokens} steps ({100 * w['wasted_share_of_steps']:.1f} %), "
                f"{w['always_wrong']['tok_s']:.1f} tok/s vs plain {w['plain']['tok_s']:.1f}"
            )
        for case, r in (mtp_head(engine, a.mtp_tokens) if "4" in figs else {}).items():
            report.setdefault("mtp", {})[case] = r
            print(
                f"4. random MTP head, {case.replace('_', ' ')} ({a.mtp_tokens} tokens): "
                f"acceptance {r['mtp']['accepted']}/{r['mtp']['drafted']} "
                f"({100 * r['acceptance']:.1f} %), {r['mtp']['tokens_per_forward']:.2f} "
                f"tokens/forward, {r['mtp']['tok_s']:.1f} tok/s vs plain "
                f"{r['plain']['tok_s']:.1f} ({r['tok_s_ratio']:.2f}x)"
            )
        if "5" in figs:
            make_tiny(f"{d}/dspark", expert_bits=None, other_bits=None, layers=LAYERS, dspark=True)
            ds = report["dspark"] = dspark_head(f"{d}/dspark", a.dspark_tokens, a.steps)
            print(
                f"5. random DSpark head ({a.dspark_tokens} tokens): accepted "
                f"{ds['dspark']['accepted']}/{ds['dspark']['drafted']} drafts, "
                f"{ds['dspark']['tokens_per_forward']:.2f} tokens/forward, "
                f"{ds['dspark']['tok_s']:.1f} tok/s vs plain {ds['off']['tok_s']:.1f} "
                f"({ds['tok_s_ratio']:.2f}x); one proposal of 5 / one decode step "
                f"{ds['proposal_over_decode']:.2f} ({ds['proposal_ms']:.1f} / {ds['decode_ms']:.1f} ms)"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
