"""Every dimension comes from config.json; other model generations are refused (must hold 5)."""

from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx.utils import tree_flatten  # noqa: E402

from ds4mlx.model.config import ModelArgs  # noqa: E402
from ds4mlx.model.network import Model  # noqa: E402

# A PRO-like synthetic config: every dimension differs from Flash's defaults and from the
# tiny checkpoint (hidden size, layers, heads, head dims, ranks, groups, experts, window,
# indexer, hc_mult, vocabulary, schedule), in DeepSeek's HF-style spelling.
PRO_LIKE = {
    "model_type": "deepseek_v4",
    "vocab_size": 777,
    "hidden_size": 96,
    "num_hidden_layers": 7,
    "num_attention_heads": 6,
    "head_dim": 48,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 40,
    "o_groups": 3,
    "o_lora_rank": 20,
    "sliding_window": 12,
    "compress_ratios": [0, 8, 64, 8, 64, 8, 0, 8],  # + one MTP entry, dropped
    "num_hash_layers": 2,
    "n_routed_experts": 12,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "moe_intermediate_size": 56,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 2.5,
    "swiglu_limit": 7.0,
    "rope_theta": 20000,
    "compress_rope_theta": 80000,
    "index_n_heads": 5,
    "index_head_dim": 24,
    "index_topk": 6,
    "hc_mult": 3,
    "hc_sinkhorn_iters": 7,
    "num_nextn_predict_layers": 1,
    "csa_ratio": 8,
}


def test_pro_like_config_builds_the_right_shapes():
    a = ModelArgs.from_dict(json.loads(json.dumps(PRO_LIKE)))
    assert (a.dim, a.n_layers, a.n_heads, a.head_dim, a.rope_head_dim) == (96, 7, 6, 48, 16)
    assert (a.n_routed_experts, a.n_activated_experts, a.moe_inter_dim) == (12, 3, 56)
    assert a.compress_ratios == (0, 8, 64, 8, 64, 8, 0) and a.csa_ratio == 8
    assert [a.layer_kind(i) for i in range(7)] == [
        "window",
        "csa",
        "hca",
        "csa",
        "hca",
        "csa",
        "window",
    ]
    assert a.hash_layers == (True, True, False, False, False, False, False)
    assert (a.hc_mult, a.hc_sinkhorn_iters, a.window_size, a.vocab_size) == (3, 7, 12, 777)
    p = dict(tree_flatten(Model(a).parameters()))
    E, D, I, H, Dh = 12, 96, 56, 6, 48  # noqa: E741,N806
    mix = (2 + 3) * 3
    want = {
        "embed.weight": (777, D),
        "head.weight": (777, D),
        "hc_head_fn": (3, 3 * D),
        "layers.0.attn.wq_a.weight": (40, D),
        "layers.0.attn.wq_b.weight": (H * Dh, 40),
        "layers.0.attn.wkv.weight": (Dh, D),
        "layers.0.attn.wo_a.weight": (3 * 20, H * Dh // 3),
        "layers.0.attn.wo_b.weight": (D, 3 * 20),
        "layers.0.attn.attn_sink": (H,),
        "layers.0.hc_attn_fn": (mix, 3 * D),
        "layers.0.ffn.gate.tid2eid": (777, 3),
        "layers.2.ffn.gate.bias": (E,),
        "layers.2.ffn.experts.w1.weight": (E, I, D),
        "layers.2.ffn.experts.w2.weight": (E, D, I),
        "layers.2.ffn.shared_experts.w3.weight": (I, D),
        "layers.1.attn.compressor.wkv.weight": (2 * Dh, D),  # overlapping ratio-8 CSA
        "layers.1.attn.compressor.ape": (8, 2 * Dh),
        "layers.1.attn.indexer.wq_b.weight": (5 * 24, 40),
        "layers.1.attn.indexer.weights_proj.weight": (5, D),
        "layers.1.attn.indexer.compressor.wkv.weight": (2 * 24, D),
        "layers.2.attn.compressor.wkv.weight": (Dh, D),  # HCA: no overlap
        "layers.2.attn.compressor.ape": (64, Dh),
    }
    for k, shape in want.items():
        assert tuple(p[k].shape) == shape, (k, p[k].shape, shape)
    assert "layers.2.attn.indexer.wq_b.weight" not in p and "layers.6.attn.compressor.ape" not in p
    assert not any(k.startswith("layers.7.") for k in p)


def test_pro_like_network_runs():
    a = ModelArgs.from_dict(PRO_LIKE)
    model = Model(a)
    mx.eval(model.parameters())
    toks = mx.array(np.arange(2, 42, dtype=np.int32)[None])
    logits = model(toks)
    assert logits.shape == (1, 40, 777)
    assert np.isfinite(np.array(logits)).all()


@pytest.mark.parametrize("mt", ["deepseek_v41", "deepseek_v3", "llama"])
def test_other_generations_are_refused(mt):
    with pytest.raises(ValueError, match=rf"model_type '{mt}' is not supported.*'deepseek_v4'"):
        ModelArgs.from_dict(dict(PRO_LIKE, model_type=mt))
