"""Test helper: a tiny checkpoint in DeepSeek's FP8/FP4 release layout.

Written the way DeepSeek ships V4 Flash (dtypes per tensor as in its ``inference/model.py``):

* ``F8_E4M3`` weights with an ``F8_E8M0`` ``.scale`` per 128×128 block for the attention
  projections (``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``), the indexer's ``wq_b`` and
  the shared expert;
* routed experts as ``I8`` holding two e2m1 codes per byte (low nibble first) with an
  ``F8_E8M0`` ``.scale`` per 32 inputs;
* ``BF16`` embedding, head, router weight and indexer ``weights_proj``; ``F32``
  compressors, norms, sinks, ``ape``, mHC; ``I32`` ``tid2eid``; an MTP tensor the network
  does not use; ``quantization_config`` fp8 in ``config.json``; two shards.

``write_release`` also returns the dequantized weights (float32), i.e. the network the
release encodes, for writing a float reference checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch  # imported where used: collecting tests must not pay for it

FP8_MAX = 448.0
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
_FP8 = re.compile(
    r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$"
)
_BF16 = re.compile(r"^(embed|head)\.weight$|ffn\.gate\.weight$|indexer\.weights_proj\.weight$")
_EXPERT = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight$")
RELEASE_QUANT = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Power-of-two scale so that amax / scale ≤ top (ue8m0, as DeepSeek's quantizer)."""
    import torch

    return torch.exp2(torch.ceil(torch.log2(torch.clamp(amax, min=1e-30) / top)))


def quantize_fp8(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """``(F8_E4M3 weight, F8_E8M0 block scale, dequantized float32)`` of ``w (out, in)``."""
    import torch

    t = torch.from_numpy(w).float()
    out, inn = t.shape
    bo, bi = -(-out // 128), -(-inn // 128)
    pad = torch.zeros(bo * 128, bi * 128)
    pad[:out, :inn] = t
    blocks = pad.view(bo, 128, bi, 128)
    scale = _pow2_scale(blocks.abs().amax(dim=(1, 3)), FP8_MAX)  # (bo, bi)
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inn]
    q = (t / full).to(torch.float8_e4m3fn)
    deq = (q.float() * full).numpy()
    return q, scale.to(torch.float8_e8m0fnu), deq


def quantize_fp4(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """``(I8 packed e2m1 (out, in/2), F8_E8M0 scale (out, in/32), dequantized float32)``."""
    import torch

    t = torch.from_numpy(w).float()
    out, inn = t.shape
    g = t.view(out, inn // 32, 32)
    scale = _pow2_scale(g.abs().amax(dim=-1), 6.0)  # (out, in/32)
    x = (g / scale[..., None]).numpy().reshape(out, inn)
    mag = np.abs(x)
    code = np.abs(mag[..., None] - E2M1).argmin(-1).astype(np.uint8)  # nearest e2m1 magnitude
    code |= (np.signbit(x) & (code > 0)).astype(np.uint8) << 3
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    sign = np.where(code & 8, -1.0, 1.0).astype(np.float32)
    deq = sign * E2M1[code & 7] * np.repeat(scale.numpy(), 32, axis=1)
    return torch.from_numpy(packed.view(np.int8)), scale.to(torch.float8_e8m0fnu), deq


def write_release(
    state: dict[str, np.ndarray], cfg_dir: str, out_dir: str
) -> dict[str, np.ndarray]:
    """Write ``state`` (official names, per-expert, float32) in the release layout.

    ``cfg_dir`` holds the source ``config.json`` (copied, with ``quantization_config``
    fp8 added). Returns the dequantized weights under the same names (float32, ``tid2eid``
    int32), i.e. exactly the network the written checkpoint encodes.
    """
    import torch
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    deq: dict[str, np.ndarray] = {}
    for name, w in state.items():
        base = name[: -len(".weight")]
        if _EXPERT.search(name):
            q, s, d = quantize_fp4(w)
            tensors[name], tensors[base + ".scale"], deq[name] = q, s, d
        elif _FP8.search(name):
            q, s, d = quantize_fp8(w)
            tensors[name], tensors[base + ".scale"], deq[name] = q, s, d
        elif _BF16.search(name):
            b = torch.from_numpy(np.ascontiguousarray(w)).bfloat16()
            tensors[name], deq[name] = b, b.float().numpy()
        elif w.dtype.kind in "iu":
            tensors[name], deq[name] = torch.from_numpy(w.astype(np.int32)), w.astype(np.int32)
        else:
            tensors[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
            deq[name] = w.astype(np.float32)
    tensors["mtp.0.e_proj.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
    keys = sorted(tensors)
    half = len(keys) // 2
    for i, part in enumerate((keys[:half], keys[half:])):
        save_file(
            {k: tensors[k].contiguous() for k in part},
            os.path.join(out_dir, f"model-{i + 1:05d}-of-00002.safetensors"),
        )
    with open(os.path.join(cfg_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = dict(RELEASE_QUANT)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return deq


def write_float(state: dict[str, np.ndarray], cfg_dir: str, out_dir: str) -> str:
    """Write ``state`` as a float official-name checkpoint (the loader's layout b)."""
    from safetensors.numpy import save_file as save_np

    os.makedirs(out_dir, exist_ok=True)
    save_np(
        {k: np.ascontiguousarray(v) for k, v in state.items()},
        os.path.join(out_dir, "model.safetensors"),
    )
    shutil.copy(os.path.join(cfg_dir, "config.json"), out_dir)
    return out_dir
