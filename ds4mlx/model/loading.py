"""Load a DeepSeek V4 checkpoint directory into ``network.Model``.

A directory holds ``config.json`` and ``*.safetensors`` (optionally ``tokenizer.json``).
Supported layouts (docs/ARCHITECTURE.md §2), detected from the tensor names:

(a) transformers names (``model.layers.N.self_attn.q_a_proj.weight``, stacked
    ``mlp.experts.gate_up_proj`` / ``down_proj``, ``model.embed_tokens``, ``lm_head``);
    also the mixed names ``save_pretrained`` of transformers 5 writes (official names
    under a ``model.`` prefix, per-expert ``ffn.experts.E.w1``, ``attn.norm`` for the
    attention's ``kv_norm``); the name correspondence follows transformers'
    ``conversion_mapping.py`` entry ``deepseek_v4``;
(b) DeepSeek's official names (``embed``, ``layers.N.attn.wq_a`` …, per-expert
    ``ffn.experts.E.w{1,2,3}`` or pre-stacked ``ffn.experts.w{1,2,3}``), float weights;
(c) (b) MLX-quantized: ``.weight/.scales[/.biases]`` triples, with the ``quantization``
    dict of ``config.json`` in mlx-lm's format (``group_size``, ``bits``, optional
    ``mode``, per-module overrides keyed by module path, ``false`` = not quantized).
    ``wo_a`` may be split per group (``attn.wo_a.G.*``).

Tensors come from ``mx.load`` (lazy: read from the file when first evaluated); renames
cost nothing, stacking per-expert tensors makes one copy at first use.
Raw official FP8/FP4 shards (``.scale`` companions, ``quantization_config`` fp8) are
rejected with a message: they need a conversion step.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections import defaultdict

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .network import Model


class LoadError(Exception):
    """The directory is not a loadable DeepSeek V4 checkpoint (message says why)."""


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
_KEEP_F32 = re.compile(
    r"(norm\.weight|\.attn_sink|\.ape|\.gate\.(weight|bias)|hc_(attn|ffn|head)_(fn|base|scale))$"
)
_PER_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scales|biases)$")
_WO_A_SPLIT = re.compile(r"^(layers\.\d+\.attn\.wo_a)\.(\d+)\.(weight|scales|biases)$")


def official_name(name: str) -> str | None:
    """Map one checkpoint tensor name to the official naming; None means "drop it".

    MTP tensors (``mtp.*``) are dropped: the network has no MTP head yet.
    """
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("mtp.") or name.startswith("model.mtp."):
        return None
    for pat, rep in _RENAMES:
        name = pat.sub(rep, name)
    return name


def _is_raw_fp8(cfg: dict, names: list[str]) -> bool:
    qc = cfg.get("quantization_config") or {}
    if "quantization" not in cfg and str(qc.get("quant_method", "")).lower() in ("fp8", "fp4"):
        return True
    return _has_block_scales(names)


def _has_block_scales(names) -> bool:
    """Official FP8/FP4 shards carry a singular ``X.scale`` tensor next to each ``X.weight``."""
    names = set(names)
    return any(n.endswith(".scale") and n[: -len(".scale")] + ".weight" in names for n in names)


def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    """Turn checkpoint tensors (any supported layout) into ``Model`` parameter names.

    Renames transformers names, splits ``experts.gate_up_proj`` into ``w1``/``w3``, stacks
    per-expert tensors into ``(E, …)`` arrays, joins a per-group split ``wo_a`` and casts
    ``tid2eid`` to int32.

    Raises:
        LoadError: an expert is missing from a per-expert layout.
    """
    out: dict[str, mx.array] = {}
    experts: dict[tuple[str, str, str], dict[int, mx.array]] = defaultdict(dict)
    wo_a: dict[tuple[str, str], dict[int, mx.array]] = defaultdict(dict)
    for raw, arr in weights.items():
        name = official_name(raw)
        if name is None:
            continue
        if m := _PER_EXPERT.match(name):
            experts[(m.group(1), m.group(3), m.group(4))][int(m.group(2))] = arr
            continue
        if m := _WO_A_SPLIT.match(name):
            wo_a[(m.group(1), m.group(3))][int(m.group(2))] = arr
            continue
        if name.endswith(".ffn.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = arr.shape[1] // 2
            out[base + "w1.weight"] = arr[:, :inter]
            out[base + "w3.weight"] = arr[:, inter:]
            continue
        if name.endswith(".ffn.experts.down_proj"):
            out[name[: -len("down_proj")] + "w2.weight"] = arr
            continue
        if name.endswith(".gate.tid2eid"):
            arr = arr.astype(mx.int32)
        out[name] = arr
    for (base, w, suffix), parts in experts.items():
        n = args.n_routed_experts
        missing = [e for e in range(n) if e not in parts]
        if missing:
            raise LoadError(f"{base}: experts {missing[:8]} missing for {w}.{suffix}")
        out[f"{base}.{w}.{suffix}"] = mx.stack([parts[e] for e in range(n)])
    for (base, suffix), parts in wo_a.items():
        out[f"{base}.{suffix}"] = mx.concatenate([parts[g] for g in sorted(parts)])
    return out


def _quant_predicate(qcfg: dict, weights: dict[str, mx.array]):
    """mlx-lm's rule: a per-module entry wins; else quantize where ``.scales`` exist."""

    # Per-module entries may use checkpoint spellings ("model." prefix, transformers names).
    qcfg = {
        (official_name(k + ".weight") or k)[: -len(".weight")]: v
        for k, v in qcfg.items()
        if isinstance(v, (bool, dict))
    }

    def pred(path: str, module: nn.Module):
        if path in qcfg:
            entry = qcfg[path]
            return entry if isinstance(entry, (bool, dict)) else bool(entry)
        if not hasattr(module, "to_quantized"):
            return False
        return f"{path}.scales" in weights

    return pred


def read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise LoadError(f"{path}: no config.json")
    with open(cfg_path) as f:
        return json.load(f)


def load_model(path: str, *, dtype=mx.float32) -> tuple[Model, ModelArgs]:
    """Load ``path`` (directory with ``config.json`` + ``*.safetensors``).

    Args:
        path: checkpoint directory.
        dtype: compute dtype for unquantized floating parameters (float32 on the CPU).

    Returns:
        ``(model, args)``; weights stay lazy (read from the mmapped files on first use).

    Raises:
        LoadError: missing files, unsupported layout (e.g. raw FP8 official shards), or
            tensors that do not match the config (names listed in the message).
    """
    cfg = read_config(path)
    mt = cfg.get("model_type", "deepseek_v4")
    if mt not in ("deepseek_v4",):
        raise LoadError(f"{path}: model_type {mt!r} is not deepseek_v4")
    try:
        args = ModelArgs.from_dict(cfg)
    except ValueError as e:
        raise LoadError(f"{path}: bad config.json: {e}") from e
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise LoadError(f"{path}: no *.safetensors files")
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except Exception as e:  # noqa: BLE001 — report which file is unreadable
            if any(n.endswith(".scale") for n in _safetensors_names(f)):
                raise LoadError(
                    f"{f}: raw DeepSeek FP8/FP4 shards cannot be loaded directly; convert them "
                    "to an MLX checkpoint first (dequantize, then quantize with MLX)"
                ) from e
            raise LoadError(f"{f}: cannot read safetensors: {e}") from e
    if _is_raw_fp8(cfg, list(weights)):
        raise LoadError(
            f"{path}: raw DeepSeek FP8/FP4 checkpoint (quant_method fp8 / '.scale' tensors); "
            "convert it to an MLX checkpoint first (dequantize, then quantize with MLX)"
        )
    weights = sanitize(weights, args)
    model = Model(args)
    quantized = any(k.endswith(".scales") for k in weights)
    if quantized:
        q = args.quantization or cfg.get("quantization_config")
        if not isinstance(q, dict) or "bits" not in q:
            raise LoadError(f"{path}: quantized tensors but no 'quantization' entry in config.json")
        nn.quantize(
            model,
            group_size=q.get("group_size", 64),
            bits=q["bits"],
            mode=q.get("mode", "affine"),
            class_predicate=_quant_predicate(q, weights),
        )
    # Float parameters go to the compute dtype; packed weights and int tables stay. The
    # small precision-critical tensors stay float32 whatever the compute dtype, as in
    # DeepSeek's reference (norms, router, mHC, sinks, compressor position bias).
    for k, v in list(weights.items()):
        if not mx.issubdtype(v.dtype, mx.floating):
            continue
        want = mx.float32 if _KEEP_F32.search(k) else dtype
        if v.dtype != want:
            weights[k] = v.astype(want)
    model.compute_dtype = dtype
    expected = dict(_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        raise LoadError(
            f"{path}: checkpoint does not match the config: missing {missing[:6]}"
            f"{' …' if len(missing) > 6 else ''}, unexpected {extra[:6]}{' …' if len(extra) > 6 else ''}"
        )
    bad = [k for k, v in weights.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if bad:
        k = bad[0]
        raise LoadError(
            f"{path}: {k} has shape {tuple(weights[k].shape)}, expected {tuple(expected[k].shape)}"
        )
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    return model, args


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def _safetensors_names(path: str) -> list[str]:
    """Tensor names from a safetensors header (without reading the data)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        return [k for k in header if k != "__metadata__"]
    except (OSError, ValueError):
        return []
