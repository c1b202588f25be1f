"""``ds4mlx bench`` graph columns, cache capture/rewind, the Flash-shape generator."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.bench import graph_figures, run_bench
from ds4mlx.engine import Engine
from ds4mlx.model.graph import time_decode
from ds4mlx.model.synth import GROUP_SIZE, _random_quantized, flash_args


def test_bench_reports_graph_size_and_build_eval_split(tiny_f32_dir):
    engine = Engine.load(tiny_f32_dir, ctx_size=256)
    res = run_bench(engine, (32, 64), decode_tokens=2)
    for row in res.rows:
        assert 0 < row.decode_non_view < row.decode_primitives
        assert row.build_ms > 0 and row.eval_ms > 0
        assert 0 < row.kv_used_bytes <= row.kv_bytes
        # The verify-cost columns: one forward over 6 rows from the decode state.
        assert row.decode_non_view < row.verify_non_view < row.verify_primitives
        assert row.verify_ms > 0 and row.verify_ratio > 0


def test_expert_reads_counts_the_unique_routed_experts_of_a_forward(tiny_f32_dir):
    """One row reads ``top-k`` experts per layer, six rows between that and ``6·k`` (at
    most all of them), their bytes in proportion; the cache is left as it was."""
    from ds4mlx.bench import expert_reads

    engine = Engine.load(tiny_f32_dir, ctx_size=256)
    model, a = engine.model, engine.args
    cache = model.make_cache()
    mx.eval(model(mx.array([list(range(1000, 1040))]), cache))
    before = [c.capture() for c in cache]
    one = expert_reads(model, cache, [1234])
    six = expert_reads(model, cache, [1234, 99, 5000, 777, 31337, 4242])
    assert [c.capture() for c in cache] == before
    assert one["experts"] == a.n_layers * a.n_activated_experts
    assert one["experts"] < six["experts"] <= a.n_layers * min(6 * a.n_activated_experts, 8)
    assert six["bytes"] == six["experts"] * one["bytes"] // one["experts"]  # same per expert


def test_graph_figures_leave_the_snapshot_alone(tiny_f32_dir):
    engine = Engine.load(tiny_f32_dir, ctx_size=256)
    s = engine.new_session()
    s.prefill(list(range(1000, 1050)))
    snap = s.snapshot()
    before = {k: np.array(v) for k, v in snap.arrays.items()}
    graph_figures(engine.model, snap, 1234, steps=2)
    assert all(np.array_equal(np.array(snap.arrays[k]), v) for k, v in before.items())


def test_rewind_restores_a_built_but_unevaluated_step(tiny_f32_dir):
    engine = Engine.load(tiny_f32_dir, ctx_size=256)
    model = engine.model
    cache = model.make_cache()
    mx.eval(model(mx.array([list(range(1000, 1031))]), cache))
    saved = [c.capture() for c in cache]
    model(mx.array([[7]]), cache)  # built, never evaluated
    for c, s in zip(cache, saved, strict=True):
        c.rewind(s)
    a = model(mx.array([[9]]), cache)
    fresh = model.make_cache()
    mx.eval(model(mx.array([list(range(1000, 1031))]), fresh))
    b = model(mx.array([[9]]), fresh)
    assert mx.array_equal(a, b).item()
    t = time_decode(model, cache, [5, 6])
    assert len(t["step_ms"]) == 2 and all(x > 0 for x in t["eval_ms"])


def test_flash_shape_generator():
    a = flash_args(2)
    assert (a.dim, a.n_heads, a.head_dim, a.q_lora_rank, a.o_lora_rank, a.o_groups) == (
        4096,
        64,
        512,
        1024,
        1024,
        8,
    )
    assert (a.n_routed_experts, a.n_activated_experts, a.moe_inter_dim) == (256, 6, 2048)
    assert a.compress_ratios == (0, 0) and a.hash_layers == (True, True)
    for bits in (2, 4):
        w, s, b = _random_quantized((3, 64, 256 * bits // 32), bits)
        assert w.dtype == mx.uint32 and s.shape == (3, 64, 256 // GROUP_SIZE)
        deq = mx.dequantize(w, s, b, group_size=GROUP_SIZE, bits=bits)
        assert deq.shape == (3, 64, 256)
        std = float(mx.std(deq).item())
        assert 0.3 / math.sqrt(256) < std < 2 / math.sqrt(256)
        assert abs(float(mx.mean(deq).item())) < 0.2 / math.sqrt(256)


def _small_flash_args(n_layers, *, first=0, sinkhorn_iters=20):
    """`synth.flash_args` at small dims (64 wide, tiny's expert count), for generation tests."""
    from ds4mlx.model.config import ModelArgs
    from ds4mlx.model.tiny import tiny_config

    cfg = tiny_config(first + n_layers, sinkhorn_iters=sinkhorn_iters)
    cfg.update(hidden_size=64, moe_intermediate_size=64, q_lora_rank=64, o_lora_rank=64)
    cfg.update(head_dim=64, index_head_dim=64)
    a = ModelArgs.from_dict(cfg)
    a.compress_ratios = a.compress_ratios[first:]
    a.hash_layers = a.hash_layers[first:]
    a.n_layers = n_layers
    return a


def test_flash_model_generation_at_small_dims(monkeypatch):
    """``flash_model``'s generation path (quantized tensors made directly) on small dims."""
    from ds4mlx.model import synth

    monkeypatch.setattr(synth, "flash_args", _small_flash_args)
    model = synth.flash_model(2, first=2, expert_bits=2, other_bits=8)
    w1 = model.layers[0].ffn.experts.w1
    assert w1.weight.dtype == mx.uint32 and w1.bits == 2 and w1.scales.dtype == mx.float16
    assert model.layers[0].attn.wq_a.bits == 8
    assert [model.args.layer_kind(i) for i in range(2)] == ["csa", "hca"]
    logits = model(mx.array([list(range(1000, 1010))]))
    assert np.isfinite(np.array(logits)).all()
    # The whole Flash-shape bench on these dims, with the verify's expert reads.
    from ds4mlx.bench import run_flash_shape

    res = run_flash_shape(2, first=2, prompt_tokens=8, decode_tokens=1)
    r = res.routing
    assert r["rows"] == 6 and r["decode"]["experts"] == 2 * model.args.n_activated_experts
    assert r["decode"]["bytes"] < r["verify"]["bytes"]


def test_make_tiny_shape_flash_writes_a_loadable_checkpoint(monkeypatch, tmp_path):
    """``make-tiny DIR --shape flash``: `flash_model`'s random layers written as a
    checkpoint (run here at small dims: the real one is 2.2 GB per layer) that loads with
    the experts and the rest at their bits and gives the in-memory model's logits; the
    flags it cannot honour are refused."""
    from ds4mlx.cli import build_parser
    from ds4mlx.model import synth
    from ds4mlx.model.loading import load_model

    monkeypatch.setattr(synth, "flash_args", _small_flash_args)
    d = tmp_path / "fw"
    argv = ["make-tiny", str(d), "--shape", "flash", "--layers", "3", "--expert-bits", "2"]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    model, margs = load_model(str(d))
    assert [margs.layer_kind(i) for i in range(3)] == ["window", "window", "csa"]
    assert margs.hash_layers == (True, True, True) and margs.dim == 64
    assert model.layers[2].ffn.experts.w2.bits == 2 and model.layers[2].attn.wq_a.bits == 8
    ids = mx.array([list(range(1000, 1020))])
    mem = synth.flash_model(3, expert_bits=2, other_bits=8)
    mem.set_dtype(mx.float32)  # the load casts the float16 scales and biases likewise
    want = mem(ids)
    assert np.array_equal(np.array(model(ids)), np.array(want))
    for bad in (["--float32"], ["--mtp", "1"]):
        a = build_parser().parse_args([*argv, "--overwrite", *bad])
        assert a.func(a) == 2


@pytest.mark.slow
def test_bench_times_each_prefill_repeatedly_and_reports_the_median(tiny_f32_dir):
    """``prefill_repeats``: the interval is prefilled R times from the same state, the
    session ends as after one prefill (same tokens and logits), the row says R; 0 is
    refused."""
    import pytest

    from ds4mlx.bench import timed_prefill

    engine = Engine.load(tiny_f32_dir, ctx_size=256)
    once, thrice = engine.new_session(), engine.new_session()
    for s in (once, thrice):
        s.prefill(list(range(1000, 1020)), chunk_size=8)
    once.prefill(list(range(2000, 2030)), chunk_size=8)
    assert timed_prefill(thrice, list(range(2000, 2030)), 8, 3) > 0
    assert thrice.tokens == once.tokens
    assert np.array_equal(np.array(thrice.logits), np.array(once.logits))
    res = run_bench(engine, (32,), decode_tokens=1, prefill_repeats=2)
    assert res.rows[0].prefill_repeats == 2 and res.rows[0].prefill_tok_s > 0
    with pytest.raises(ValueError, match="prefill_repeats"):
        run_bench(engine, (32,), decode_tokens=1, prefill_repeats=0)


def test_paired_rounds_time_both_engines_per_frontier(tiny_f32_dir):
    """`paired_rounds` (``bench --distributed … --compare``): per frontier, R interleaved
    rounds of both engines' interval prefill rate and decode time per token, all
    positive; R < 1 is refused. Two one-process engines stand in for split and
    unsplit here (the 2-rank run is `test_distributed.py`'s)."""
    import pytest

    from ds4mlx.bench import paired_rounds

    a, b = (Engine.load(tiny_f32_dir, ctx_size=256) for _ in range(2))
    out = paired_rounds(a, b, (24, 56), decode_tokens=2, chunk_size=16, seed=3, rounds=3)
    assert [(p.frontier, p.rounds) for p in out] == [(24, 3), (56, 3)]
    for p in out:
        figures = p.split_prefill_tok_s + p.single_prefill_tok_s
        figures += p.split_decode_ms + p.single_decode_ms
        assert len(figures) == 4 * 3 and all(math.isfinite(v) and v > 0 for v in figures), p
    with pytest.raises(ValueError, match="rounds"):
        paired_rounds(a, b, (24,), decode_tokens=1, chunk_size=16, seed=0, rounds=0)
