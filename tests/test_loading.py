"""Checkpoint layouts, config flavours and load errors (ds4mlx.model.loading / config)."""

from __future__ import annotations

import json
import os
import shutil
from importlib.util import find_spec

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
if find_spec("torch") is None or find_spec("transformers") is None:
    # find_spec, not importorskip: torch and transformers are imported by the fixtures
    # that use them, so collecting the suite does not pay for them.
    pytest.skip("the oracle needs torch and transformers", allow_module_level=True)

from model_fixtures import REF_CONFIG, build_reference, official_state, prompt_tokens  # noqa: E402

from ds4mlx.model.config import ModelArgs  # noqa: E402
from ds4mlx.model.loading import LoadError, load_model, official_name  # noqa: E402

PROMPT = 300  # crosses the window (16), CSA blocks (4) and two HCA blocks (128)
ATOL = 2e-4


@pytest.fixture(scope="module")
def ref_dirs(tmp_path_factory):
    """One oracle written in every float layout, plus its logits on a prompt."""
    import torch
    from safetensors.numpy import save_file
    from safetensors.torch import save_file as save_torch

    ref = build_reference(seed=3)
    root = tmp_path_factory.mktemp("layouts")
    dirs = {}
    # transformers 5 save_pretrained (official names under "model.", per-expert tensors).
    dirs["save_pretrained"] = str(root / "save_pretrained")
    ref.save_pretrained(dirs["save_pretrained"])
    cfg_path = os.path.join(dirs["save_pretrained"], "config.json")
    # (a) transformers in-memory names with stacked gate_up_proj / down_proj.
    dirs["transformers"] = str(root / "transformers")
    os.makedirs(dirs["transformers"])
    shutil.copy(cfg_path, dirs["transformers"])
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    save_torch(sd, os.path.join(dirs["transformers"], "model.safetensors"))
    # (b) official names, per-expert and pre-stacked, split over two shards.
    for name, stacked in (("official", False), ("official_stacked", True)):
        d = str(root / name)
        os.makedirs(d)
        shutil.copy(cfg_path, d)
        st = official_state(ref, stacked=stacked)
        keys = sorted(st)
        half = len(keys) // 2
        save_file(
            {k: st[k] for k in keys[:half]}, os.path.join(d, "model-00001-of-00002.safetensors")
        )
        save_file(
            {k: st[k] for k in keys[half:]}, os.path.join(d, "model-00002-of-00002.safetensors")
        )
        dirs[name] = d
    toks = prompt_tokens(PROMPT, REF_CONFIG["vocab_size"], seed=1)
    with torch.no_grad():
        logits = ref(torch.tensor(toks[None].astype(np.int64))).logits[0].numpy()
    return dict(dirs=dirs, tokens=toks, logits=logits, root=root)


@pytest.mark.parametrize(
    "layout", ["save_pretrained", "transformers", "official", "official_stacked"]
)
def test_every_layout_gives_oracle_logits(ref_dirs, layout):
    model, args = load_model(ref_dirs["dirs"][layout])
    ours = np.array(model(mx.array(ref_dirs["tokens"][None]))[0])
    err = np.abs(ours - ref_dirs["logits"]).max()
    assert err < ATOL, f"{layout}: max abs diff {err:.2e}"
    assert args.compress_ratios == (0, 4, 128, 4, 128)
    assert args.hash_layers == (True, True, False, False, False)


def test_official_name_mapping():
    assert official_name("model.layers.3.self_attn.compressor.indexer.kv_norm.weight") == (
        "layers.3.attn.indexer.compressor.norm.weight"
    )
    assert (
        official_name("model.layers.3.self_attn.kv_norm.weight") == "layers.3.attn.kv_norm.weight"
    )
    assert official_name("model.layers.0.attn.norm.weight") == "layers.0.attn.kv_norm.weight"
    assert official_name("model.layers.2.mlp.shared_experts.gate_proj.weight") == (
        "layers.2.ffn.shared_experts.w1.weight"
    )
    assert (
        official_name("model.layers.2.mlp.gate.e_score_correction_bias") == "layers.2.ffn.gate.bias"
    )
    assert official_name("model.hc_head.hc_fn") == "hc_head_fn"
    assert official_name("lm_head.weight") == "head.weight"
    assert official_name("layers.5.ffn.experts.7.w2.weight") == "layers.5.ffn.experts.7.w2.weight"
    assert official_name("mtp.0.e_proj.weight") is None


# DeepSeek's published configs (abridged to the keys that matter; values as published).
OFFICIAL_HF = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "num_nextn_predict_layers": 1,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}
OFFICIAL_INFERENCE = {
    "vocab_size": 129280,
    "dim": 4096,
    "moe_inter_dim": 2048,
    "n_layers": 43,
    "n_hash_layers": 3,
    "n_heads": 64,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "n_activated_experts": 6,
    "score_func": "sqrtsoftplus",
    "route_scale": 1.5,
    "swiglu_limit": 10.0,
    "q_lora_rank": 1024,
    "head_dim": 512,
    "rope_head_dim": 64,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "window_size": 128,
    "original_seq_len": 65536,
    "rope_theta": 10000,
    "rope_factor": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_official_config_flavours_agree():
    a = ModelArgs.from_dict(OFFICIAL_HF)
    b = ModelArgs.from_dict(OFFICIAL_INFERENCE)
    assert a.n_layers == 43 and len(a.compress_ratios) == 43  # MTP entry dropped
    assert a.compress_ratios[:4] == (0, 0, 4, 128) and a.compress_ratios[-1] == 4
    assert a.hash_layers == (True,) * 3 + (False,) * 40
    assert a.layer_kind(0) == "window" and a.layer_kind(2) == "csa" and a.layer_kind(3) == "hca"
    for f in (
        "dim rope_head_dim window_size compress_ratios hash_layers rope_factor original_seq_len "
        "beta_fast beta_slow route_scale swiglu_limit compress_rope_theta index_topk moe_inter_dim"
    ).split():
        assert getattr(a, f) == getattr(b, f), f
    assert a.rope_factor == 16 and a.original_seq_len == 65536


def test_transformers_config_and_round_trip():
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(**REF_CONFIG).to_dict()
    a = ModelArgs.from_dict(cfg)
    assert a.compress_ratios == (0, 4, 128, 4, 128) and a.csa_ratio == 4
    assert a.rope_head_dim == 8 and a.original_seq_len == 65536 and a.rope_factor == 16
    assert a.rope_theta == 10000 and a.compress_rope_theta == 160000
    b = ModelArgs.from_dict(json.loads(json.dumps(a.to_dict())))
    assert b.to_dict() == a.to_dict()
    # transformers' legacy spelling (compress_ratios + num_hash_layers) reads the same.
    legacy = DeepseekV4Config(
        **{k: v for k, v in REF_CONFIG.items() if k not in ("layer_types", "mlp_layer_types")},
        compress_ratios=[0, 4, 128, 4, 128],
        num_hash_layers=2,
    ).to_dict()
    c = ModelArgs.from_dict(legacy)
    assert c.compress_ratios == (0, 4, 128, 4, 128)
    assert c.hash_layers == (True, True, False, False, False)


def test_config_without_schedule_is_rejected():
    cfg = dict(OFFICIAL_HF)
    del cfg["compress_ratios"]
    with pytest.raises(ValueError, match="schedule"):
        ModelArgs.from_dict(cfg)


def _copy_dir(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_load_errors(ref_dirs, tmp_path):
    from safetensors.numpy import save_file

    with pytest.raises(LoadError, match="config.json"):
        load_model(str(tmp_path))

    d = _copy_dir(ref_dirs["dirs"]["official_stacked"], tmp_path / "wrongtype")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["model_type"] = "llama"
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(LoadError, match="deepseek_v4"):
        load_model(d)

    d = str(tmp_path / "noweights")
    os.makedirs(d)
    shutil.copy(os.path.join(ref_dirs["dirs"]["official"], "config.json"), d)
    with pytest.raises(LoadError, match="safetensors"):
        load_model(d)

    # A tensor missing: the message names it.
    d = str(tmp_path / "missing")
    os.makedirs(d)
    shutil.copy(os.path.join(ref_dirs["dirs"]["official"], "config.json"), d)
    st = official_state(build_reference(seed=3), stacked=True)
    del st["layers.1.attn.indexer.wq_b.weight"]
    save_file(st, os.path.join(d, "model.safetensors"))
    with pytest.raises(LoadError, match=r"layers\.1\.attn\.indexer\.wq_b\.weight"):
        load_model(d)

    # Raw official FP8 shards: a conversion step is needed, said clearly.
    d = str(tmp_path / "fp8")
    os.makedirs(d)
    cfg = dict(OFFICIAL_HF, quantization_config={"quant_method": "fp8", "fmt": "e4m3"})
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    save_file(
        {
            "layers.0.attn.wq_a.weight": np.zeros((8, 8), np.uint8),
            "layers.0.attn.wq_a.scale": np.ones((1, 1), np.float32),
        },
        os.path.join(d, "model.safetensors"),
    )
    with pytest.raises(LoadError, match="convert"):
        load_model(d)
