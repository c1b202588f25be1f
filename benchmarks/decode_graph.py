"""Decode-step graph size and speed at Flash depth: ds4mlx vs mlx-lm's DeepSeek V3.

Both models are toy-sized (hidden 32) but 43 layers deep, so a decode step is dominated
by the number of graph nodes built and launched, not by FLOPs (docs/KERNELS.md):

* ds4mlx: the tiny config in Flash's layout (2 window-only layers, 3 hash layers, then
  ratio 4 / ratio 128 alternating), ``hc_sinkhorn_iters`` 1 and 20;
* mlx-lm ``deepseek_v3`` with the ModelArgs of issue 9 (43 layers, 8 experts, top-2).

Method: prefill 256 random tokens, count the primitives of one decode step
(``ds4mlx.model.graph.decode_step_primitives``: logits + every cache array, view ops set
apart), then time decoding: ``--runs`` runs, each the median of ``--steps`` steps after
``--warmup`` steps, the two models' steps interleaved one by one, all in this one
process. The reported ratio is the median over runs of ours / V3.

Usage: ``python benchmarks/decode_graph.py [--runs 3] [--steps 40] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from ds4mlx.blas import active_blas, ensure_openblas

ensure_openblas()  # re-executes with OpenBLAS preloaded when the system has it

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from ds4mlx.model.graph import cache_buffers, decode_step_primitives, time_decode  # noqa: E402
from ds4mlx.model.tiny import random_model, tiny_config  # noqa: E402

LAYERS = 43
PREFILL = 256


def v3_model(layers: int = LAYERS):
    """mlx-lm's DeepSeek V3 with issue 9's toy ModelArgs (float32, random weights)."""
    from mlx_lm.models import deepseek_v3

    args = deepseek_v3.ModelArgs(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=24,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        intermediate_size=64,
        moe_intermediate_size=32,
        first_k_dense_replace=0,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        n_group=1,
        topk_group=1,
        vocab_size=129280,
        num_hidden_layers=layers,
    )
    mx.random.seed(0)
    model = deepseek_v3.Model(args)
    mx.eval(model.parameters())
    return model


class Subject:
    """One model under test: how to make a fresh cache and prefill it."""

    def __init__(self, name: str, model, make_cache):
        self.name, self.model, self.make_cache = name, model, make_cache

    def prefilled(self, prompt: mx.array):
        cache = self.make_cache()
        mx.eval(self.model(prompt[None], cache), cache_buffers(cache))
        return cache


def ours(iters: int) -> Subject:
    m = random_model(tiny_config(LAYERS, sinkhorn_iters=iters))
    return Subject(f"ds4mlx (Sinkhorn {iters})", m, m.make_cache)


def theirs() -> Subject:
    from mlx_lm.models.cache import make_prompt_cache

    m = v3_model()
    return Subject("mlx-lm deepseek_v3", m, lambda: make_prompt_cache(m))


def count(s: Subject, prompt: mx.array, token: int) -> dict:
    r = decode_step_primitives(s.model, s.prefilled(prompt), token)
    return {k: r[k] for k in ("primitives", "non_view", "build_ms")} | {
        "top_ops": dict(list(r["by_op"].items())[:12])
    }


def interleaved(subjects: list[Subject], prompt, feed, runs: int, warmup: int) -> dict:
    """Per subject and run: median step / build / eval ms over ``feed`` (after warm-up).

    Within a run the subjects alternate step by step (ours, V3, ours, V3, ...) on caches
    prefilled side by side, so load from other processes hits both alike; each run starts
    from fresh prefills.
    """
    out: dict[str, list[dict]] = {s.name: [] for s in subjects}
    for _ in range(runs):
        caches = [s.prefilled(prompt) for s in subjects]
        for s, c in zip(subjects, caches, strict=True):
            time_decode(s.model, c, feed[:warmup])
        steps: dict[str, dict[str, list[float]]] = {
            s.name: {"step_ms": [], "build_ms": [], "eval_ms": []} for s in subjects
        }
        for t in feed[warmup:]:
            for s, c in zip(subjects, caches, strict=True):
                for k, v in time_decode(s.model, c, [t]).items():
                    steps[s.name][k] += v
        for s in subjects:
            out[s.name].append({k: statistics.median(v) for k, v in steps[s.name].items()})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="timed steps per run (≥ 40)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(1000, 100000, PREFILL), dtype=mx.int32)
    feed = rng.integers(1000, 100000, a.warmup + a.steps).tolist()
    print(f"BLAS {active_blas()}, {LAYERS} layers, prefill {PREFILL}", file=sys.stderr)

    v3 = theirs()
    report: dict = {"layers": LAYERS, "prefill": PREFILL, "steps": a.steps, "runs": a.runs}
    report["primitives"] = {v3.name: count(v3, prompt, feed[0])}
    for iters in (1, 20):
        us = ours(iters)
        report["primitives"][us.name] = count(us, prompt, feed[0])
        times = interleaved([us, v3], prompt, feed, a.runs, a.warmup)
        ratios = [
            u["step_ms"] / t["step_ms"] for u, t in zip(times[us.name], times[v3.name], strict=True)
        ]
        report[f"sinkhorn_{iters}"] = {
            "runs": times,
            "ratio_per_run": ratios,
            "ratio_median": statistics.median(ratios),
        }
    for name, c in report["primitives"].items():
        print(
            f"{name:26s} primitives {c['primitives']:6d}  non-view {c['non_view']:6d}  "
            f"build {c['build_ms']:.1f} ms"
        )
    for iters in (1, 20):
        r = report[f"sinkhorn_{iters}"]
        for name, runs in r["runs"].items():
            cells = "  ".join(
                f"{x['step_ms']:.2f} (build {x['build_ms']:.2f} + eval {x['eval_ms']:.2f})"
                for x in runs
            )
            print(f"iters {iters:2d} {name:26s} ms/token per run: {cells}")
        print(
            f"iters {iters:2d} ours / V3 per run: "
            + ", ".join(f"{x:.3f}" for x in r["ratio_per_run"])
            + f"; median {r['ratio_median']:.3f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
