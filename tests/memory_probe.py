"""Memory probes run as subprocesses by ``test_convert_memory.py`` (one fresh process each,
so resident-set figures are not polluted by the test runner).

    python tests/memory_probe.py make DIR        # write a ≥ 1 GB checkpoint in ds4mlx's layout
    python tests/memory_probe.py load DIR        # RSS growth of load + eval + one forward
    python tests/memory_probe.py convert SRC DST SHARD_BYTES   # peak RSS of a conversion

Each prints one JSON line. RSS is read from ``/proc/self/statm`` (current) and
``/proc/self/status`` ``VmHWM`` (peak); sizes are bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

# Big enough that the weights dominate the runtime (≥ 1 GB, mostly stacked experts), with
# the real vocabulary so the real tokenizer applies. Affine q4 experts, q8 elsewhere.
BIG_CONFIG = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "head_dim": 128,
    "qk_rope_head_dim": 32,
    "q_lora_rank": 512,
    "o_groups": 4,
    "o_lora_rank": 256,
    "sliding_window": 64,
    "compress_ratios": [0, 4, 128, 4, 128, 0],
    "num_hash_layers": 1,
    "n_routed_experts": 64,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "index_n_heads": 8,
    "index_head_dim": 64,
    "index_topk": 32,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "max_position_embeddings": 65536,
}
SHARD = 300_000_000


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """Peak RSS of this process image (``VmHWM``).

    Not ``getrusage``'s ``ru_maxrss``: Linux carries that across ``execve`` from the
    address space that spawned us, so a child of a big test runner would report the
    runner's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def make(out: str) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from ds4mlx.model.config import ModelArgs
    from ds4mlx.model.network import Model
    from ds4mlx.model.tiny import tokenizer_dir

    args = ModelArgs.from_dict(BIG_CONFIG)
    model = Model(args)
    expert = {"group_size": 64, "bits": 4, "mode": "affine"}
    quant = {"group_size": 64, "bits": 8, "mode": "affine"}

    def pred(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        if ".ffn.experts." in path:
            quant[path] = dict(expert)
            return dict(expert)
        return True

    nn.quantize(model, group_size=64, bits=8, mode="affine", class_predicate=pred)
    os.makedirs(out, exist_ok=True)
    mx.random.seed(0)
    shard: dict = {}
    size, n = 0, 0
    for name, p in tree_flatten(model.parameters()):
        if p.dtype == mx.uint32:
            v = mx.random.randint(0, 1 << 30, p.shape).astype(mx.uint32)
        elif name.endswith("tid2eid"):
            v = mx.random.randint(0, args.n_routed_experts, p.shape).astype(mx.int32)
        elif name.endswith("norm.weight"):
            v = mx.ones(p.shape)
        elif name.endswith(".scales"):
            v = mx.full(p.shape, 0.002)
        elif name.endswith(".biases"):
            v = mx.full(p.shape, -0.015)
        else:
            v = 0.02 * mx.random.normal(p.shape)
        mx.eval(v)
        shard[name] = v
        size += v.nbytes
        if size >= SHARD:
            n += 1
            mx.save_safetensors(os.path.join(out, f"model-{n:05d}.safetensors"), shard)
            shard, size = {}, 0
    if shard:
        mx.save_safetensors(os.path.join(out, f"model-{n + 1:05d}.safetensors"), shard)
    cfg = dict(BIG_CONFIG, quantization=quant, quantization_config=quant)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(tokenizer_dir(), name), os.path.join(out, name))
    print(
        json.dumps(
            {
                "bytes": sum(
                    os.path.getsize(os.path.join(out, f))
                    for f in os.listdir(out)
                    if f.endswith(".safetensors")
                )
            }
        )
    )


def load(path: str) -> None:
    import mlx.core as mx

    from ds4mlx.model.loading import load_model
    from ds4mlx.tokenizer import Tokenizer

    tok = Tokenizer.load(path)
    ids = [tok.bos_id, *tok.encode("Memory check: one short forward pass. " * 4)]
    mx.eval(mx.ones(8) + 1)  # the runtime is up before the baseline
    base = rss()
    model, _ = load_model(path, dtype=mx.float32, ctx_size=4096)
    mx.eval(model.parameters())
    logits = model(mx.array([ids]))
    mx.eval(logits)
    after = rss()
    weights = sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if f.endswith(".safetensors")
    )
    print(
        json.dumps(
            {"baseline": base, "after": after, "safetensors_bytes": weights, "tokens": len(ids)}
        )
    )


def convert(src: str, dst: str, shard: int) -> None:
    import mlx.core as mx

    from ds4mlx.model.convert import ConvertOptions, convert

    mx.eval(mx.ones(8) + 1)
    base = rss()
    summary = convert(
        src,
        dst,
        ConvertOptions(expert="2", rest="keep", dtype="float32", shard_size=shard, overwrite=True),
    )
    print(
        json.dumps(
            {
                "baseline": base,
                "peak": peak_rss(),
                "shards": len(summary.shards),
                "bytes": summary.total_bytes,
                "seconds": summary.seconds,
            }
        )
    )


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "make":
        make(rest[0])
    elif cmd == "load":
        load(rest[0])
    elif cmd == "convert":
        convert(rest[0], rest[1], int(rest[2]))
    else:
        raise SystemExit(f"unknown probe {cmd}")
