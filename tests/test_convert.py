"""``ds4mlx convert`` (ds4mlx.model.convert) and the loader's conversion messages.

The source of the main tests is a tiny checkpoint in DeepSeek's FP8/FP4 release layout
(``official_fixture``) written from the transformers oracle of ``test_parity``; its
reference is the same network run on the dequantized weights.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
if find_spec("torch") is None or find_spec("transformers") is None:
    # find_spec, not importorskip: torch and transformers are imported by the fixtures
    # that use them, so collecting the suite does not pay for them.
    pytest.skip("the oracle needs torch and transformers", allow_module_level=True)

import mlx.nn as nn  # noqa: E402
from model_fixtures import REF_CONFIG, build_reference, official_state, prompt_tokens  # noqa: E402
from official_fixture import write_float, write_release  # noqa: E402

from ds4mlx.cli import main  # noqa: E402
from ds4mlx.model.convert import ConvertError, ConvertOptions, convert  # noqa: E402
from ds4mlx.model.loading import LoadError, load_model  # noqa: E402
from ds4mlx.model.moe import QuantizedSwitchLinear  # noqa: E402
from ds4mlx.model.network import QuantizedGroupedLinear  # noqa: E402
from ds4mlx.model.report import quant_report  # noqa: E402
from ds4mlx.model.tiny import make_tiny  # noqa: E402

PROMPT_LEN = 600  # the parity prompt: crosses the window, CSA and HCA boundaries
SEED = 4  # test_parity's seed (no indexer ties at the top-k cut)
REL_TOL = 1e-5  # quantized matmul vs float matmul of the same numbers


def _logits(model, toks) -> np.ndarray:
    return np.array(model(mx.array(np.asarray(toks, dtype=np.int32)[None]))[0])


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The release-format checkpoint, its dequantized twin and the twin's logits."""
    root = tmp_path_factory.mktemp("release")
    ref = build_reference(seed=SEED)
    ref.save_pretrained(root / "hf")
    deq = write_release(official_state(ref), str(root / "hf"), str(root / "release"))
    write_float(deq, str(root / "hf"), str(root / "dequantized"))
    toks = prompt_tokens(PROMPT_LEN, REF_CONFIG["vocab_size"], seed=0)
    model, _ = load_model(str(root / "dequantized"))
    return dict(root=root, src=str(root / "release"), toks=toks, logits=_logits(model, toks))


def test_fixture_is_in_the_release_layout(release):
    from safetensors import safe_open

    dtypes = {}
    for f in sorted(os.listdir(release["src"])):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(release["src"], f), "numpy") as st:
                dtypes.update({k: st.get_slice(k).get_dtype() for k in st.keys()})
    assert dtypes["layers.2.ffn.experts.5.w1.weight"] == "I8"
    assert dtypes["layers.2.ffn.experts.5.w1.scale"] == "F8_E8M0"
    assert dtypes["layers.1.attn.wq_a.weight"] == "F8_E4M3"
    assert dtypes["layers.1.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.1.attn.wo_a.weight"] == "F8_E4M3"
    assert dtypes["embed.weight"] == "BF16" and dtypes["layers.1.attn_norm.weight"] == "F32"
    cfg = json.load(open(os.path.join(release["src"], "config.json")))
    assert cfg["quantization_config"]["quant_method"] == "fp8"


def test_release_is_not_loaded_directly(release):
    with pytest.raises(LoadError, match="ds4mlx convert"):
        load_model(release["src"])


def test_lossless_conversion_gives_the_dequantized_network(release, tmp_path, caplog):
    """Must hold 1: --expert-mode mxfp4 --bits mxfp8 is exact at every prompt position."""
    out = str(tmp_path / "lossless")
    summary = convert(
        release["src"], out, ConvertOptions(expert="mxfp4", rest="mxfp8", dtype="float32")
    )
    with caplog.at_level(logging.WARNING, logger="ds4mlx.model"):
        model, args = load_model(out)
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # nothing to copy
    layer = model.layers[2]
    assert isinstance(layer.ffn.experts.w1, QuantizedSwitchLinear)
    assert layer.ffn.experts.w1.mode == "mxfp4"
    assert isinstance(layer.attn.wq_a, nn.QuantizedLinear) and layer.attn.wq_a.mode == "mxfp8"
    assert isinstance(layer.attn.wo_a, QuantizedGroupedLinear) and layer.attn.wo_a.mode == "mxfp8"
    # Tensors the release keeps in float stay float (re-quantizing would lose precision).
    assert isinstance(model.embed, nn.Embedding) and isinstance(model.head, nn.Linear)
    ours = _logits(model, release["toks"])
    ref = release["logits"]
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < REL_TOL, f"relative error {err:.2e}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    # Output layout: stacked experts, an index, tokenizer files, mlx-lm's quantization dict.
    files = sorted(os.listdir(out))
    assert "model.safetensors" in files and "model.safetensors.index.json" in files
    assert "tokenizer.json" in files and "config.json" in files
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
    assert "layers.2.ffn.experts.w1.weight" in index
    assert not any(re.search(r"experts\.\d+\.", k) or k.startswith("mtp.") for k in index)
    q = json.load(open(os.path.join(out, "config.json")))["quantization"]
    assert q["mode"] == "mxfp8" and q["layers.2.ffn.experts.w1"]["mode"] == "mxfp4"
    parts = summary.parts
    assert parts["experts"].formats == {"mxfp4"}
    assert abs(parts["experts"].bits_per_weight - 4.25) < 1e-6
    assert abs(parts["shared"].bits_per_weight - 8.25) < 1e-6
    assert any("MTP" in n for n in summary.notes)
    assert args.n_layers == REF_CONFIG["num_hidden_layers"]


@pytest.mark.parametrize("bits", [2, 4])
def test_affine_experts_load_and_generate(release, tmp_path, bits):
    """Must hold 1 (second half): --expert-bits 2 and 4 load and generate."""
    out = str(tmp_path / f"q{bits}")
    convert(
        release["src"],
        out,
        ConvertOptions(expert=str(bits), group_size=32, rest="mxfp8", dtype="float32"),
    )
    model, args = load_model(out)
    w1 = model.layers[0].ffn.experts.w1
    assert w1.mode == "affine" and w1.bits == bits and w1.group_size == 32
    cache = model.make_cache()
    logits = _logits_cached(model, release["toks"][:64], cache)
    out_ids = []
    for _ in range(8):
        t = int(np.argmax(logits))
        out_ids.append(t)
        logits = _logits_cached(model, [t], cache)
    assert all(0 <= t < args.vocab_size for t in out_ids)
    assert cache[0].offset == 72
    # Close to the exact network (random tiny weights: only a sanity bound).
    full = _logits(model, release["toks"])
    assert np.corrcoef(full.ravel(), release["logits"].ravel())[0, 1] > (0.8 if bits == 4 else 0.3)


def _logits_cached(model, toks, cache) -> np.ndarray:
    return np.array(model(mx.array(np.asarray(toks, dtype=np.int32)[None]), cache)[0, -1])


def test_report_gives_agreement_and_kl(release, tmp_path):
    prompts = [release["toks"][:80].tolist(), release["toks"][300:380].tolist()]
    rows = quant_report(
        release["src"],
        ["4:32", "2:32", "mxfp4"],
        prompts,
        str(tmp_path / "work"),
        base=ConvertOptions(rest="mxfp8", dtype="float32"),
    )
    by = {r.choice: r for r in rows}
    assert by["reference"].agreement == 1.0 and by["reference"].mean_kl == 0.0
    assert by["mxfp4"].agreement == 1.0 and by["mxfp4"].mean_kl < 1e-9  # lossless
    assert 0 <= by["2:32"].agreement <= by["4:32"].agreement <= 1
    assert 0 < by["4:32"].mean_kl < by["2:32"].mean_kl
    assert all(r.positions == 160 for r in rows)
    assert not os.listdir(tmp_path / "work")  # scratch conversions removed


def test_cli_convert_and_report(release, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(
        [
            "convert",
            release["src"],
            str(out),
            "--expert-bits",
            "2",
            "--group-size",
            "32",
            "--bits",
            "mxfp8",
            "--override",
            "head=8:32",
            "--override",
            r"layers\.0\.attn\.wq_b=none",
            "--dtype",
            "float32",
            "--shard-size",
            "400KB",
            "-q",
        ]
    )
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "experts" in cap.out and "q2g32" in cap.out and "bits/weight" in cap.out
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0].endswith("-of-" + f"{len(shards):05d}.safetensors")
    model, _ = load_model(str(out))
    assert isinstance(model.head, nn.QuantizedLinear) and model.head.bits == 8
    assert isinstance(model.layers[0].attn.wq_b, nn.Linear)  # the regex override
    assert model.layers[1].attn.wq_b.mode == "mxfp8"
    assert model.layers[1].ffn.experts.w2.bits == 2

    rc = main(
        [
            "convert",
            release["src"],
            "--report",
            "--report-bits",
            "4:32,2:32",
            "--report-tokens",
            "40",
            "--bits",
            "mxfp8",
            "--dtype",
            "float32",
        ]
    )
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "top-1 agreement" in cap.out and "mean KL" in cap.out
    assert re.search(r"2:32\s+│\s+[01]\.\d{4}\s+│\s+\d+\.\d{5}", cap.out), cap.out


def test_convert_refusals(release, tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConvertError, match="not empty"):
        convert(release["src"], str(out))
    with pytest.raises(ConvertError, match="differ"):
        convert(release["src"], release["src"])
    # The source by a symlink, with --overwrite: refused before its shards are deleted.
    link = tmp_path / "src-link"
    link.symlink_to(release["src"])
    shards = sorted(p.name for p in Path(release["src"]).glob("*.safetensors"))
    with pytest.raises(ConvertError, match="differ"):
        convert(release["src"], str(link), ConvertOptions(overwrite=True))
    assert sorted(p.name for p in Path(release["src"]).glob("*.safetensors")) == shards
    with pytest.raises(ValueError, match="bad quantization"):
        convert(release["src"], str(tmp_path / "x"), ConvertOptions(expert="7"))
    assert main(["convert", release["src"], str(tmp_path / "y"), "--bits", "9"]) == 2
    assert "bad quantization" in capsys.readouterr().err
    # Another model generation: refused with the supported one named.
    v41 = tmp_path / "v41"
    shutil.copytree(release["src"], v41)
    cfg = json.load(open(v41 / "config.json"))
    cfg["model_type"] = "deepseek_v41"
    json.dump(cfg, open(v41 / "config.json", "w"))
    with pytest.raises(ConvertError, match=r"'deepseek_v41' is not supported.*'deepseek_v4'"):
        convert(str(v41), str(tmp_path / "z"))
    with pytest.raises(LoadError, match=r"'deepseek_v41' is not supported"):
        load_model(str(v41))


# ----------------------------------------------------------------------- third-party layout
def _third_party(src: str, dst: str) -> None:
    """Re-write an MLX checkpoint the way a public mixed Q4/Q8 conversion stores it: one
    ``layers.N.ffn.experts.E.w{1,2,3}`` triple per expert, fp16 norms/scales/biases,
    per-expert quantization entries in config.json, several shards."""
    os.makedirs(dst)
    w = mx.load(os.path.join(src, "model.safetensors"))
    out = {}
    for k, v in w.items():
        if m := re.match(r"^(layers\.\d+\.ffn\.experts)\.(w[123])\.(weight|scales|biases)$", k):
            for e in range(v.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.{m.group(3)}"] = v[e]
        elif v.dtype == mx.float32 and (k.endswith(("norm.weight", ".scales", ".biases"))):
            out[k] = v.astype(mx.float16)
        else:
            out[k] = v
    keys = sorted(out)
    for i in range(3):
        part = {k: out[k] for k in keys[i::3]}
        mx.save_safetensors(os.path.join(dst, f"model-{i + 1:05d}-of-00003.safetensors"), part)
    cfg = json.load(open(os.path.join(src, "config.json")))
    q = {"group_size": 32, "bits": 8}
    for k in cfg["quantization"]:
        if m := re.match(r"^(layers\.\d+\.ffn\.experts)\.(w[123])$", k):
            for e in range(cfg["n_routed_experts"]):
                q[f"{m.group(1)}.{e}.{m.group(2)}"] = {"group_size": 32, "bits": 4}
    cfg["quantization"] = cfg["quantization_config"] = q
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), dst)


def test_per_expert_quantized_checkpoint_converts_with_identical_logits(tmp_path, caplog):
    """Must hold 2: the per-expert third-party shape → stacked layout, identical logits."""
    tiny = make_tiny(str(tmp_path / "tiny"), seed=2)  # q4 g32 experts, q8 g32 rest
    src = str(tmp_path / "third_party")
    _third_party(tiny, src)
    with caplog.at_level(logging.WARNING, logger="ds4mlx.model"):
        ref_model, args = load_model(src)
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "one tensor per expert" in msgs and "ds4mlx convert" in msgs  # says so once
    assert sum("one tensor per expert" in r.getMessage() for r in caplog.records) == 1
    out = str(tmp_path / "stacked")
    summary = convert(src, out, ConvertOptions(dtype="float32"))  # default: keep as stored
    assert summary.parts["experts"].formats == {"q4g32"}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ds4mlx.model"):
        model, _ = load_model(out)
    assert not caplog.records
    toks = prompt_tokens(200, args.vocab_size, seed=3)
    assert np.array_equal(_logits(model, toks), _logits(ref_model, toks))
    names = mx.load(os.path.join(out, "model.safetensors"))
    assert names["layers.1.ffn.experts.w1.weight"].shape[0] == args.n_routed_experts
    assert names["layers.1.attn_norm.weight"].dtype == mx.float32


def test_bf16_checkpoint_on_cpu_says_it_is_cast(tmp_path, caplog):
    tiny = make_tiny(str(tmp_path / "tiny"), seed=1, expert_bits=None, other_bits=None)
    out = str(tmp_path / "bf16")
    convert(tiny, out, ConvertOptions(expert="none", rest="none", dtype="bfloat16"))
    st = mx.load(os.path.join(out, "model.safetensors"))
    assert st["layers.0.attn.wq_a.weight"].dtype == mx.bfloat16
    assert st["layers.0.attn_norm.weight"].dtype == mx.float32  # precision-critical stays f32
    with caplog.at_level(logging.WARNING, logger="ds4mlx.model"):
        model, _ = load_model(out, dtype=mx.float32)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "casting" in msgs[0] and "float32" in msgs[0], msgs
    assert model.layers[0].attn.wq_a.weight.dtype == mx.float32


# ----------------------------------------------------------------------- other source layouts
@pytest.fixture(scope="module")
def layouts(tmp_path_factory, release):
    """The oracle in transformers' own names (stacked ``gate_up_proj``) and as transformers 5
    ``save_pretrained`` writes it; an MLX conversion with ``wo_a`` split per group."""
    from safetensors.torch import save_file as save_torch

    root = tmp_path_factory.mktemp("layouts")
    ref = build_reference(seed=SEED)
    dirs = {"save_pretrained": str(release["root"] / "hf")}
    d = root / "transformers"
    d.mkdir()
    shutil.copy(release["root"] / "hf" / "config.json", d)
    save_torch(
        {k: v.contiguous() for k, v in ref.state_dict().items()}, str(d / "model.safetensors")
    )
    dirs["transformers"] = str(d)
    tiny = make_tiny(str(root / "tiny"), seed=5)
    split = root / "wo_a_split"
    shutil.copytree(tiny, split)
    w = mx.load(os.path.join(tiny, "model.safetensors"))
    groups = json.load(open(split / "config.json"))["o_groups"]
    out = {}
    for k, v in w.items():
        if ".attn.wo_a." in k:
            base, suffix = k.rsplit(".", 1)
            rows = v.shape[0] // groups
            for g in range(groups):
                out[f"{base}.{g}.{suffix}"] = v[g * rows : (g + 1) * rows]
        else:
            out[k] = v
    mx.save_safetensors(str(split / "model.safetensors"), out)
    dirs["mlx_wo_a_split"] = str(split)
    return dirs


@pytest.mark.parametrize("layout", ["save_pretrained", "transformers", "mlx_wo_a_split"])
def test_every_loadable_layout_converts_without_changing_logits(layouts, tmp_path, layout):
    src = layouts[layout]
    ref_model, args = load_model(src)
    out = str(tmp_path / layout)
    # Float sources stay float ("none"); the MLX one keeps its quantization ("keep").
    spec = "keep" if layout.startswith("mlx") else "none"
    convert(src, out, ConvertOptions(expert=spec, rest=spec, dtype="float32"))
    model, _ = load_model(out)
    toks = prompt_tokens(150, args.vocab_size, seed=7)
    assert np.array_equal(_logits(model, toks), _logits(ref_model, toks))
    names = mx.load(os.path.join(out, "model.safetensors"))
    assert "layers.1.ffn.experts.w1.weight" in names and "layers.1.attn.wo_a.weight" in names


def test_report_says_when_nothing_was_quantized(release, tiny_f32_dir, capsys):
    """Issue 26 item 6: the tiny model's expert dims (32) do not divide by the default
    group size 64, so ``--report-bits 4`` quantizes nothing and its row would read as
    lossless: the report says so. The release fixture's are partly divisible: said too."""
    rc = main(["convert", str(tiny_f32_dir), "--report", "--report-bits", "4,2:32",
               "--report-tokens", "16", "--dtype", "float32"])  # fmt: skip
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    flat = " ".join(cap.err.split())
    assert "note: 4: nothing was quantized, the routed experts stayed f32" in flat, cap.err
    assert "note: 2:32" not in flat  # group 32 divides: quantized, no note
    rc = main(["convert", release["src"], "--report", "--report-bits", "4",
               "--report-tokens", "16", "--dtype", "float32"])  # fmt: skip
    flat = " ".join(capsys.readouterr().err.split())
    assert "note: 4: only part of the routed experts was quantized (f32+q4g64" in flat
