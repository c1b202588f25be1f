"""Tensor names: every supported checkpoint spelling mapped onto DeepSeek's official one.

The network's parameters use DeepSeek's official names (``embed``, ``layers.N.attn.wq_a``,
``layers.N.ffn.experts.w1`` stacked ...). transformers' names (its ``conversion_mapping.py``
entry ``deepseek_v4`` documents the correspondence) and mlx-lm's stacked-expert spelling are
renamed here; per-expert and per-group tensors are recognised so they can be stacked.
"""

from __future__ import annotations

import re

# Ordered (regex, replacement) pairs mapping transformers names to official ones.
# Order matters: the indexer / compressor / shared-expert specific rules come first.
_RENAMES = [
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    # mlx-lm's stacked-expert spelling (SwitchGLU) of the same tensors.
    (r"\.ffn\.switch_mlp\.gate_proj\.", ".ffn.experts.w1."),
    (r"\.ffn\.switch_mlp\.up_proj\.", ".ffn.experts.w3."),
    (r"\.ffn\.switch_mlp\.down_proj\.", ".ffn.experts.w2."),
    # transformers 5 save_pretrained writes the attention's kv_norm as "attn.norm".
    (r"^(layers\.\d+)\.attn\.norm\.", r"\1.attn.kv_norm."),
]
_RENAMES = [(re.compile(a), b) for a, b in _RENAMES]

# Small precision-critical tensors kept in float32 whatever the compute dtype, as in
# DeepSeek's reference: norms, router, mHC, sinks, compressor position bias.
KEEP_F32 = re.compile(
    r"(norm\.weight|\.attn_sink|\.ape|\.gate\.(weight|bias)|hc_(attn|ffn|head)_(fn|base|scale))$"
)
# Per-expert tensors (``layers.N.ffn.experts.E.w1.weight``, the MTP blocks' ``mtp.N.…``;
# official ``.scale`` included).
PER_EXPERT = re.compile(
    r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scales|biases|scale)$"
)
# ``wo_a`` stored one output group per tensor (some MLX conversions).
WO_A_SPLIT = re.compile(r"^((?:layers|mtp)\.\d+\.attn\.wo_a)\.(\d+)\.(weight|scales|biases)$")
LAYER = re.compile(r"^layers\.(\d+)\.")
MTP = re.compile(r"^mtp\.(\d+)\.")


def is_mtp(name: str) -> bool:
    """Whether checkpoint tensor ``name`` belongs to an MTP block (``[model.]mtp.I.*``)."""
    return MTP.match(name.removeprefix("model.")) is not None


def official_name(name: str, mtp: bool = False) -> str | None:
    """Map one checkpoint tensor name to the official naming; None means "drop it".

    MTP tensors (``mtp.I.*``, also under ``model.``) are dropped unless ``mtp`` (the
    drafter is wanted: ``ds4mlx.model.mtp``); a block's decoder-layer names map like a
    layer's (``mtp.0.self_attn.q_a_proj`` -> ``mtp.0.attn.wq_a``).
    """
    if name.startswith("model."):
        name = name[len("model.") :]
    if m := MTP.match(name):
        if not mtp:
            return None
        # Rename as a layer, then put the MTP prefix back.
        inner = official_name(f"layers.{m.group(1)}.{name[m.end() :]}")
        return f"mtp.{inner[len('layers.') :]}"
    for pat, rep in _RENAMES:
        name = pat.sub(rep, name)
    return name


def part_of(path: str) -> str:
    """The part a parameter or module path belongs to, for per-part quantization choices.

    One of ``"embed"``, ``"head"``, ``"experts"`` (routed), ``"shared"`` (shared expert),
    ``"indexer"``, ``"attn"`` (attention incl. its compressor), ``"other"`` (norms, router,
    mHC: never quantized).
    """
    if path == "embed" or path.startswith("embed."):
        return "embed"
    if path == "head" or path.startswith("head."):
        return "head"
    if ".ffn.shared_experts." in path:
        return "shared"
    if ".ffn.experts." in path or path.endswith(".ffn.experts"):
        return "experts"
    if ".attn.indexer." in path:
        return "indexer"
    if ".attn." in path and not KEEP_F32.search(path):
        return "attn"
    return "other"
