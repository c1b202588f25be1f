"""Test helpers: a tiny float32 ``transformers.DeepseekV4ForCausalLM`` oracle.

The reference follows these fixture rules so that it can tell the
subtle variants apart: ``hc_mult`` 3 (comb vs combᵀ is visible), YaRN on the compressed
layers, distinct experts per ``tid2eid`` row, a random router bias, expert weights large
enough that the SwiGLU clamp fires, 8 indexer heads with a small ``index_topk`` (so the
indexer really selects), randomized sinks / norms / hc scales / ``ape``, and all three
attention kinds plus both MoE kinds.

transformers clamps the shared expert; DeepSeek's official code does not, so every
layer's ``mlp.shared_experts.limit`` is set to ``inf`` (docs/ARCHITECTURE.md §2).
"""

from __future__ import annotations

import math

import numpy as np

# Small dims; ratios chosen so a 600-token prompt crosses the window (16), ~150 CSA
# blocks (ratio 4, top-k 8 of them) and 4 HCA blocks (ratio 128, as the real model).
REF_CONFIG = dict(
    vocab_size=1024,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=32,
    num_experts_per_tok=3,
    n_routed_experts=8,
    n_shared_experts=1,
    scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
    hc_mult=3,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    swiglu_limit=10.0,
    sliding_window=16,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=8,
    partial_rotary_factor=0.25,  # 8 rope channels of 32
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    max_position_embeddings=1048576,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)


def build_reference(seed: int = 0, **overrides):
    """Build the seeded float32 oracle (a ``DeepseekV4ForCausalLM`` in eval mode).

    Returns the torch model; the shared-expert clamp is already removed.
    """
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = dict(REF_CONFIG)
    cfg.update(overrides)
    config = DeepseekV4Config(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(seed + 1)

    def rnd(shape, std):
        return torch.randn(*shape, generator=g) * std

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + rnd(p.shape, 0.25))
            elif name.endswith("sinks"):
                p.copy_(rnd(p.shape, 1.0))
            elif name.endswith("hc.fn") or name.endswith("hc_fn"):
                p.copy_(rnd(p.shape, 0.15))
            elif name.endswith("hc.base") or name.endswith("hc_base"):
                p.copy_(rnd(p.shape, 0.5))
            elif name.endswith("hc.scale") or name.endswith("hc_scale"):
                p.copy_(0.5 + torch.rand(*p.shape, generator=g))
            elif name.endswith("position_bias"):
                p.copy_(rnd(p.shape, 0.7))
            elif name.endswith("gate.weight"):
                p.copy_(rnd(p.shape, 0.3))
            elif name.endswith("experts.gate_up_proj"):
                # std 0.6 over 64 unit-RMS inputs: pre-activations ~N(0, 4.8²), so the
                # clamp at 10 fires for a few percent of them.
                p.copy_(rnd(p.shape, 0.6))
            elif name.endswith("experts.down_proj"):
                p.copy_(rnd(p.shape, 0.08))
            elif "shared_experts" in name and ("gate_proj" in name or "up_proj" in name):
                # Large enough that an (incorrect) clamp on the shared expert would show.
                p.copy_(rnd(p.shape, 0.6))
            elif name.endswith("shared_experts.down_proj.weight"):
                p.copy_(rnd(p.shape, 0.08))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(rnd(p.shape, 1.0))
            elif p.ndim == 2:
                p.copy_(rnd(p.shape, 1.0 / math.sqrt(p.shape[1])))
            else:
                raise AssertionError(f"fixture does not know how to init {name} {tuple(p.shape)}")
        n_exp, k = config.n_routed_experts, config.num_experts_per_tok
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                rows = torch.argsort(torch.rand(config.vocab_size, n_exp, generator=g), dim=-1)[
                    :, :k
                ]
                gate.tid2eid.copy_(rows)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(rnd(gate.e_score_correction_bias.shape, 0.2))
            # The official model does not clamp the shared expert (docs/ARCHITECTURE.md §2, MoE).
            layer.mlp.shared_experts.limit = float("inf")
    return model


def prompt_tokens(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Seeded random token ids (int32, shape ``(n,)``), avoiding ids 0 and 1 (BOS/EOS)."""
    rng = np.random.default_rng(seed)
    return rng.integers(2, vocab, size=n).astype(np.int32)


# transformers module-attribute name -> DeepSeek official name, written out by hand from
# transformers' conversion_mapping.py (entry deepseek_v4) so the loader's own rename rules
# are checked against an independent table.
_OFFICIAL_LEAVES = {
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
}
_OFFICIAL_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
    "lm_head.weight": "head.weight",
}


def official_state(ref, *, stacked: bool = False) -> dict[str, np.ndarray]:
    """The oracle's weights under DeepSeek's official names (layout b).

    Experts are per-expert ``ffn.experts.E.w{1,2,3}.weight`` (as DeepSeek ships them) or,
    with ``stacked``, ``ffn.experts.w{1,2,3}.weight`` of shape ``(E, out, in)``;
    ``tid2eid`` is int32 as in the official checkpoint.
    """
    out: dict[str, np.ndarray] = {}
    for name, t in ref.state_dict().items():
        a = t.detach().cpu().numpy()
        if name in _OFFICIAL_TOP:
            out[_OFFICIAL_TOP[name]] = a
            continue
        _, _, idx, rest = name.split(".", 3)  # model.layers.N.rest
        base = f"layers.{idx}."
        if rest == "mlp.experts.gate_up_proj":
            inter = a.shape[1] // 2
            parts = {"w1": a[:, :inter], "w3": a[:, inter:]}
        elif rest == "mlp.experts.down_proj":
            parts = {"w2": a}
        else:
            if rest.endswith("tid2eid"):
                a = a.astype(np.int32)
            out[base + _OFFICIAL_LEAVES[rest]] = a
            continue
        for w, arr in parts.items():
            if stacked:
                out[f"{base}ffn.experts.{w}.weight"] = np.ascontiguousarray(arr)
            else:
                for e in range(arr.shape[0]):
                    out[f"{base}ffn.experts.{e}.{w}.weight"] = np.ascontiguousarray(arr[e])
    return out
