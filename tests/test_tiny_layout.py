"""``ds4mlx make-tiny --layers N``: Flash's layer layout at toy size."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from ds4mlx.cli import build_parser
from ds4mlx.model.loading import load_model
from ds4mlx.model.tiny import flash_layout, tiny_config


def test_flash_layout():
    ratios, n_hash = flash_layout(43)
    assert ratios == ([0, 0] + [4, 128] * 40)[:43]  # issue 9's 43-layer configuration
    assert n_hash == 3
    assert flash_layout(1) == ([0], 1)
    assert flash_layout(6) == ([0, 0, 4, 128, 4, 128], 3)
    cfg = tiny_config(5, sinkhorn_iters=1)
    assert cfg["num_hidden_layers"] == 5 and cfg["hc_sinkhorn_iters"] == 1
    assert tiny_config()["compress_ratios"] == [0, 4, 128, 4]  # the test model is unchanged


def test_make_tiny_layers_cli(tmp_path):
    d = tmp_path / "t6"
    args = build_parser().parse_args(["make-tiny", str(d), "--layers", "6", "--float32"])
    assert args.func(args) == 0
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 6 and cfg["num_hash_layers"] == 3
    assert cfg["compress_ratios"] == [0, 0, 4, 128, 4, 128]
    model, margs = load_model(d)
    assert [margs.layer_kind(i) for i in range(6)] == ["window"] * 2 + ["csa", "hca"] * 2
    assert margs.hash_layers == (True, True, True, False, False, False)
    logits = model(mx.array(np.arange(1000, 1040, dtype=np.int32))[None])
    assert logits.shape == (1, 40, margs.vocab_size) and np.isfinite(np.array(logits)).all()
    bad = build_parser().parse_args(["make-tiny", str(tmp_path / "x"), "--layers", "0"])
    assert bad.func(bad) == 2
