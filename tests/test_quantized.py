"""The tiny checkpoint (ds4mlx.model.tiny) and MLX-quantized loading (layout c)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from ds4mlx.model.loading import load_model  # noqa: E402
from ds4mlx.model.moe import QuantizedSwitchLinear  # noqa: E402
from ds4mlx.model.network import QuantizedGroupedLinear  # noqa: E402
from ds4mlx.model.tiny import make_tiny  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def tiny_dirs(tiny_f32_dir, tiny_checkpoint):
    return {"float": str(tiny_f32_dir), "q": str(tiny_checkpoint(seed=0))}


@pytest.fixture(scope="module")
def prompt(tiny_dirs):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tiny_dirs["q"], "tokenizer.json"))
    ids = [0] + tok.encode(TEXT, add_special_tokens=False).ids
    assert len(ids) > 100  # crosses the window (16) and many CSA blocks
    return np.array(ids, dtype=np.int32)


def _param_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def test_tiny_has_every_layer_kind(tiny_dirs):
    cfg = json.load(open(os.path.join(tiny_dirs["q"], "config.json")))
    assert sorted(set(cfg["compress_ratios"])) == [0, 4, 128]
    assert cfg["vocab_size"] == 129280 and 0 < cfg["num_hash_layers"] < cfg["num_hidden_layers"]
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(tiny_dirs["q"], name))
    assert os.path.getsize(os.path.join(tiny_dirs["q"], "model.safetensors")) < 16e6


def test_quantized_is_small_and_has_the_requested_bits(tiny_dirs):
    fm, _ = load_model(tiny_dirs["float"])
    qm, args = load_model(tiny_dirs["q"])
    assert args.quantization["bits"] == 8
    qbytes, fbytes = _param_bytes(qm), _param_bytes(fm)
    assert qbytes < 0.4 * fbytes, (qbytes, fbytes)
    layer = qm.layers[1]
    assert (
        isinstance(layer.ffn.experts.w1, QuantizedSwitchLinear) and layer.ffn.experts.w1.bits == 4
    )
    assert isinstance(layer.attn.wq_a, nn.QuantizedLinear) and layer.attn.wq_a.bits == 8
    assert isinstance(layer.attn.wo_a, QuantizedGroupedLinear) and layer.attn.wo_a.bits == 8
    assert isinstance(qm.embed, nn.QuantizedEmbedding) and isinstance(qm.head, nn.QuantizedLinear)
    # Router and mHC parameters stay float: routing is decided by them.
    assert layer.ffn.gate.weight.dtype == mx.float32
    assert layer.hc_attn_fn.dtype == mx.float32


def test_quantized_generates_and_tracks_float(tiny_dirs, prompt):
    fm, _ = load_model(tiny_dirs["float"])
    qm, args = load_model(tiny_dirs["q"])
    toks = mx.array(prompt[None])
    fl = np.array(fm(toks)[0])
    ql = np.array(qm(toks)[0])
    assert np.isfinite(ql).all()
    # Same network, quantized weights: logits stay strongly correlated.
    assert np.corrcoef(fl.ravel(), ql.ravel())[0, 1] > 0.9
    # Chunked prefill + token-by-token decode equals the full forward (the quantized
    # expert kernels differ between long and short calls: sorted vs unsorted gather).
    cache = qm.make_cache()
    n = len(prompt) - 12
    first = np.array(qm(toks[:, :n], cache)[0])
    rows = [np.array(qm(toks[:, i : i + 1], cache)[0, 0]) for i in range(n, len(prompt))]
    np.testing.assert_allclose(np.concatenate([first, np.stack(rows)]), ql, atol=2e-3)
    # Greedy generation produces valid token ids.
    out = []
    logits = ql[-1]
    for _ in range(8):
        t = int(np.argmax(logits))
        out.append(t)
        logits = np.array(qm(mx.array([[t]]), cache)[0, -1])
    assert all(0 <= t < args.vocab_size for t in out)
    assert cache[0].offset == len(prompt) + 8


def test_expert_only_and_mxfp4_variants_load(tmp_path, prompt):
    toks = mx.array(prompt[None, :40])
    for kw in (dict(other_bits=None), dict(expert_mode="mxfp4"), dict(expert_bits=2)):
        d = make_tiny(str(tmp_path / "_".join(f"{k}{v}" for k, v in kw.items())), **kw)
        m, _ = load_model(d)
        assert np.isfinite(np.array(m(toks))).all(), kw
        if kw.get("expert_mode") == "mxfp4":
            assert m.layers[0].ffn.experts.w1.mode == "mxfp4"
        if "other_bits" in kw:
            assert isinstance(m.layers[0].attn.wq_a, nn.Linear)


def test_make_tiny_is_seeded(tmp_path):
    a = mx.load(make_tiny(str(tmp_path / "a"), seed=5) + "/model.safetensors")
    b = mx.load(make_tiny(str(tmp_path / "b"), seed=5) + "/model.safetensors")
    c = mx.load(make_tiny(str(tmp_path / "c"), seed=6) + "/model.safetensors")
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert not mx.array_equal(a["layers.0.attn.wq_a.weight"], c["layers.0.attn.wq_a.weight"]).item()


def test_wo_a_split_per_group_loads(tiny_dirs, tmp_path, prompt):
    """MLX conversions may store ``wo_a`` one group per tensor (``attn.wo_a.G.*``)."""
    import shutil

    src = tiny_dirs["q"]
    d = tmp_path / "split"
    shutil.copytree(src, d)
    w = mx.load(
        os.path.join(src, "model.safetensors")
    )  # read the original, not the file we overwrite
    cfg = json.load(open(d / "config.json"))
    groups = cfg["o_groups"]
    out = {}
    for k, v in w.items():
        if ".attn.wo_a." in k:
            base, suffix = k.rsplit(".", 1)
            rows = v.shape[0] // groups
            for g in range(groups):
                out[f"{base}.{g}.{suffix}"] = v[g * rows : (g + 1) * rows]
        else:
            out[k] = v
    mx.save_safetensors(str(d / "model.safetensors"), out)
    m1, _ = load_model(src)
    m2, _ = load_model(str(d))
    toks = mx.array(prompt[None, :40])
    assert np.array_equal(np.array(m1(toks)), np.array(m2(toks)))


def test_prefixed_names_and_quant_keys_load(tiny_dirs, tmp_path, prompt):
    """A conversion that keeps a ``model.`` prefix (tensors and per-module quant keys)."""
    src = tiny_dirs["q"]
    d = tmp_path / "prefixed"
    d.mkdir()
    w = mx.load(os.path.join(src, "model.safetensors"))
    renamed = {("head.weight" if k == "head.weight" else "model." + k): v for k, v in w.items()}
    renamed = {k.replace("model.head.", "head."): v for k, v in renamed.items()}
    mx.save_safetensors(str(d / "model.safetensors"), renamed)
    cfg = json.load(open(os.path.join(src, "config.json")))
    q = {
        k if k in ("group_size", "bits", "mode") else "model." + k: v
        for k, v in cfg["quantization"].items()
    }
    cfg["quantization"] = cfg["quantization_config"] = q
    json.dump(cfg, open(d / "config.json", "w"))
    m1, _ = load_model(src)
    m2, _ = load_model(str(d))
    assert m2.layers[1].ffn.experts.w1.bits == 4
    toks = mx.array(prompt[None, :40])
    assert np.array_equal(np.array(m1(toks)), np.array(m2(toks)))
