"""Test helpers: a tiny float32 ``transformers.DeepseekV4ForCausalLM`` oracle.

The reference follows the fixture rules of ``DS4_NETWORK.md`` so that it can tell the
subtle variants apart: ``hc_mult`` 3 (comb vs combᵀ is visible), YaRN on the compressed
layers, distinct experts per ``tid2eid`` row, a random router bias, expert weights large
enough that the SwiGLU clamp fires, 8 indexer heads with a small ``index_topk`` (so the
indexer really selects), randomized sinks / norms / hc scales / ``ape``, and all three
attention kinds plus both MoE kinds.

transformers clamps the shared expert; DeepSeek's official code does not, so every
layer's ``mlp.shared_experts.limit`` is set to ``inf`` (``DS4_NETWORK.md`` "Test oracle").
"""

from __future__ import annotations

import math

import numpy as np

# Small dims; ratios chosen so a 600-token prompt crosses the window (16), ~150 CSA
# blocks (ratio 4, top-k 8 of them) and ~18 HCA blocks (ratio 32).
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
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
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
            # The official model does not clamp the shared expert (DS4_NETWORK.md, MoE).
            layer.mlp.shared_experts.limit = float("inf")
    return model


def prompt_tokens(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Seeded random token ids (int32, shape ``(n,)``), avoiding ids 0 and 1 (BOS/EOS)."""
    rng = np.random.default_rng(seed)
    return rng.integers(2, vocab, size=n).astype(np.int32)
