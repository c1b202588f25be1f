"""``ds4mlx bench`` graph columns, cache capture/rewind, the Flash-shape generator."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

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


def test_flash_model_generation_at_small_dims(monkeypatch):
    """``flash_model``'s generation path (quantized tensors made directly) on small dims."""
    from ds4mlx.model import synth
    from ds4mlx.model.tiny import tiny_config

    def small(n_layers, *, first=0, sinkhorn_iters=20):
        from ds4mlx.model.config import ModelArgs

        cfg = tiny_config(first + n_layers, sinkhorn_iters=sinkhorn_iters)
        cfg.update(hidden_size=64, moe_intermediate_size=64, q_lora_rank=64, o_lora_rank=64)
        cfg.update(head_dim=64, index_head_dim=64)
        a = ModelArgs.from_dict(cfg)
        a.compress_ratios = a.compress_ratios[first:]
        a.hash_layers = a.hash_layers[first:]
        a.n_layers = n_layers
        return a

    monkeypatch.setattr(synth, "flash_args", small)
    model = synth.flash_model(2, first=2, expert_bits=2, other_bits=8)
    w1 = model.layers[0].ffn.experts.w1
    assert w1.weight.dtype == mx.uint32 and w1.bits == 2 and w1.scales.dtype == mx.float16
    assert model.layers[0].attn.wq_a.bits == 8
    assert [model.args.layer_kind(i) for i in range(2)] == ["csa", "hca"]
    logits = model(mx.array([list(range(1000, 1010))]))
    assert np.isfinite(np.array(logits)).all()
