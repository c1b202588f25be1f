"""A random DeepSeek V4 model at real Flash dimensions, quantized from the start.

For measuring per-layer cost at the real shapes (``ds4mlx bench --shape flash``) without
the 284B-parameter checkpoint: hidden 4096, 64 heads of 512, q / o LoRA ranks 1024 (8
output groups), window 128, 256 routed experts (6 active, inter 2048) + 1 shared,
indexer 64 heads of 128 with top-512, hc 4, vocab 129280, Flash's layer layout cut to
``n_layers``.

Quantized tensors are generated directly as random packed ``uint32`` words plus
float16 scales / biases: a float copy of one layer's experts would be 25.8 GB in
float32. The model is first built lazily (MLX does not allocate ``zeros`` / random
initializers until evaluated), then every parameter is replaced before anything is
evaluated, one tensor at a time, so peak memory stays at the quantized size.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .config import ModelArgs
from .network import Model
from .tiny import flash_layout

GROUP_SIZE = 64


def flash_args(n_layers: int, *, first: int = 0, sinkhorn_iters: int = 20) -> ModelArgs:
    """``ModelArgs`` with DeepSeek V4 Flash's dimensions: its layers ``first …
    first + n_layers - 1`` (attention kind and hash routing as in Flash)."""
    ratios, n_hash = flash_layout(first + n_layers)
    return ModelArgs(
        n_layers=n_layers,
        compress_ratios=tuple(ratios[first:]),
        hash_layers=tuple(first + i < n_hash for i in range(n_layers)),
        hc_sinkhorn_iters=sinkhorn_iters,
    )


def _random_quantized(
    shape: tuple[int, ...], bits: int, key=None
) -> tuple[mx.array, mx.array, mx.array]:
    """Random affine-quantized ``(weight, scales, biases)`` whose dequantized values have
    std ≈ ``1/sqrt(in_features)`` (``in_features`` = packed width · 32 / ``bits``); drawn
    from ``key`` (an ``mx.random.key``) when given, else from MLX's global generator."""
    in_features = shape[-1] * 32 // bits
    levels = (1 << bits) - 1
    scale = np.float32(2.0 / (levels * np.sqrt(in_features)))
    gshape = (*shape[:-1], in_features // GROUP_SIZE)
    keys = mx.random.split(key) if key is not None else (None, None)
    hi, lo = (mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32, key=k) for k in keys)
    words = (hi << 16) | lo  # uniform random 32-bit words
    scales = mx.full(gshape, scale, dtype=mx.float16)
    biases = mx.full(gshape, -scale * levels / 2, dtype=mx.float16)
    return words, scales, biases


def _random_float(name: str, shape: tuple[int, ...], key) -> mx.array:
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * mx.random.normal(shape, key=key)
    if leaf == "attn_sink" or leaf == "ape" or name.endswith("gate.bias"):
        return 0.3 * mx.random.normal(shape, key=key)
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        return 0.5 + mx.random.uniform(shape=shape, key=key)
    if leaf.startswith("hc_"):
        return 0.1 * mx.random.normal(shape, key=key)
    return mx.random.normal(shape, key=key) * (shape[-1] ** -0.5)


def _tid2eid(shape: tuple[int, ...], n_experts: int, seed: int) -> mx.array:
    """Distinct experts per token id, as the real hash table has."""
    rng = np.random.default_rng(seed)
    out = np.empty(shape, dtype=np.int32)
    step = 8192
    for r in range(0, shape[0], step):
        rows = rng.random((min(step, shape[0] - r), n_experts), dtype=np.float32)
        out[r : r + rows.shape[0]] = np.argpartition(rows, shape[1], axis=-1)[:, : shape[1]]
    return mx.array(out)


def flash_model(
    n_layers: int = 2,
    *,
    first: int = 0,
    expert_bits: int = 2,
    other_bits: int | None = 8,
    sinkhorn_iters: int = 20,
    seed: int = 0,
    progress: Callable[[int, int], object] | None = None,
) -> Model:
    """A random Flash-shaped ``Model`` (float32 compute, embedding and head included).

    Args:
        n_layers: layers in Flash's layout.
        first: Flash's layer index of the first one (2: start at the first ratio-4 layer).
        expert_bits: routed-expert bits (affine, group 64).
        other_bits: bits of every other linear layer, the embedding and the head; None
            keeps them float32.
        sinkhorn_iters: ``hc_sinkhorn_iters``.
        seed: random seed (the same seed gives the same weights).
        progress: called as ``progress(done, total)`` in parameter bytes while the random
            weights are generated (a minute or more per layer at Flash size on a CPU).
    """
    args = flash_args(n_layers, first=first, sinkhorn_iters=sinkhorn_iters)
    model = Model(args)  # lazy: nothing allocated yet

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized"):
            return False
        if ".ffn.experts." in path:
            return {"group_size": GROUP_SIZE, "bits": expert_bits}
        return other_bits is not None

    nn.quantize(model, group_size=GROUP_SIZE, bits=other_bits or 8, class_predicate=predicate)
    params = dict(tree_flatten(model.parameters()))
    key = mx.random.key(seed)
    new: dict[str, mx.array] = {}
    total, done = sum(p.nbytes for p in params.values()), 0
    for name, p in params.items():
        done += p.nbytes
        if progress is not None:
            progress(done, total)
        key, sub = mx.random.split(key)
        stem, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases"):
            continue  # written with their weight
        if p.dtype == mx.uint32:
            bits = p.shape[-1] * 32 // params[f"{stem}.scales"].shape[-1] // GROUP_SIZE
            w, s, b = _random_quantized(tuple(p.shape), bits, sub)
            new[name], new[f"{stem}.scales"], new[f"{stem}.biases"] = w, s, b
            mx.eval(w, s, b)
        elif name.endswith("gate.tid2eid"):
            new[name] = _tid2eid(tuple(p.shape), args.n_routed_experts, seed)
        else:
            new[name] = _random_float(name, tuple(p.shape), sub)
            mx.eval(new[name])
    model.update(tree_unflatten(list(new.items())))
    mx.eval(model.parameters())
    return model


def write_flash_checkpoint(
    out_dir: str,
    n_layers: int = 2,
    *,
    expert_bits: int = 2,
    other_bits: int | None = 8,
    seed: int = 0,
    progress: Callable[[int, int], object] | None = None,
) -> str:
    """Write `flash_model`'s random model (Flash's first ``n_layers`` layers at Flash's
    dimensions) as a loadable checkpoint in ``out_dir`` (`tiny.write_checkpoint`: official
    names, mlx-lm ``quantization`` dict, the packaged tokenizer); returns ``out_dir``.

    For benches that need a checkpoint whose layers are as wide as Flash's (a tensor
    split at width 4096 halves real work; at the tiny width of 32 it halves nothing).
    Size: about 2.2 GB per layer at ``expert_bits=2`` (1.8 GB of it routed experts) plus
    1.1 GB of embedding and head at 8 bits; generating and writing it holds the whole
    model in memory once.
    """
    from .tiny import write_checkpoint

    model = flash_model(
        n_layers, expert_bits=expert_bits, other_bits=other_bits, seed=seed, progress=progress
    )
    quant: dict = {"group_size": GROUP_SIZE, "bits": other_bits or 8, "mode": "affine"}
    for i in range(n_layers):
        for w in ("w1", "w2", "w3"):
            quant[f"layers.{i}.ffn.experts.{w}"] = {"group_size": GROUP_SIZE, "bits": expert_bits}
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], **model.args.to_dict()}
    cfg["quantization"] = cfg["quantization_config"] = quant
    return write_checkpoint(out_dir, dict(tree_flatten(model.parameters())), cfg)
