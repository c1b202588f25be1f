"""The checkpoint's MTP drafter (``ds4mlx.model.mtp``, ``ds4mlx.engine.mtp``): tiny random
MTP blocks written by ``make-tiny --mtp``, loaded from official and transformers
spellings, refused when malformed (the tensor named), never read with ``--speculative
off``, counted by the fit check, kept and quantized by ``convert``; and the drafter's own
KV cache following the session's kept tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from ds4mlx.cli import main
from ds4mlx.engine import Engine, SamplingParams, TurnSpec, run_turn
from ds4mlx.engine.mtp import MTPDrafter, drafted_continuation
from ds4mlx.engine.speculative import Speculation, speculation_for
from ds4mlx.model.checkpoint import scan
from ds4mlx.model.convert import ConvertOptions, convert
from ds4mlx.model.fit import check_fit
from ds4mlx.model.loading import LoadError, load_model

GREEDY = SamplingParams(temperature=0)
BLOCK = (
    "attn.wq_a.weight",
    "attn.wkv.weight",
    "attn.attn_sink",
    "attn_norm.weight",
    "ffn_norm.weight",
    "ffn.gate.weight",
    "ffn.gate.bias",
    "ffn.experts.w1.weight",
    "ffn.shared_experts.w2.weight",
    "hc_attn_fn",
    "hc_ffn_scale",
)
EXTRA = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight")
HEAD = ("hc_head_fn", "hc_head_base", "hc_head_scale")


@pytest.fixture(scope="module")
def mtp_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint(expert_bits=None, other_bits=None, mtp=1)


def _copy(src: Path, dst: Path, change) -> Path:
    """``src`` with its tensors passed through ``change(dict) -> dict``."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    weights = change(dict(mx.load(str(f))))
    f.unlink()
    mx.save_safetensors(str(f), weights)
    return dst


def _mtp_params(model) -> dict[str, mx.array]:
    return {k: v for k, v in tree_flatten(model.parameters()) if k.startswith("mtp.")}


def test_make_tiny_mtp_writes_the_official_block_and_it_loads(tmp_path):
    out = tmp_path / "t"
    assert main(["make-tiny", str(out), "--float32", "--mtp", "1"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    assert len(cfg["compress_ratios"]) == cfg["num_hidden_layers"] + 1  # the MTP entry
    names = set(scan(str(out)))
    for n in BLOCK + EXTRA + HEAD:
        assert f"mtp.0.{n}" in names, n
    model, args = load_model(str(out), mtp=True)
    assert args.n_mtp_layers == 1 and args.mtp_compress_ratios == (0,)
    (block,) = model.mtp
    assert block.attn.kind == "window" and not block.ffn.gate.hashed
    assert model.taps == (args.n_layers - 1,)
    plain, _ = load_model(str(out))
    assert "mtp" not in plain and plain.taps == ()
    # The network's own weights do not depend on whether MTP blocks were drawn.
    base = dict(tree_flatten(plain.parameters()))
    for k, v in tree_flatten(model.parameters()):
        if not k.startswith("mtp."):
            assert mx.array_equal(v, base[k]).item(), k


_TRANSFORMERS = (
    (".attn.wq_a.", ".self_attn.q_a_proj."),
    (".attn.wkv.", ".self_attn.kv_proj."),
    (".attn_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".ffn.shared_experts.w1.", ".mlp.shared_experts.gate_proj."),
    (".hc_attn_fn", ".attn_hc.fn"),
)


def _transformers_names(w: dict) -> dict:
    """The MTP block under ``model.`` with transformers' layer spellings and its routed
    experts one tensor per expert (as official per-expert checkpoints store them)."""
    out = {}
    for k, v in w.items():
        if not k.startswith("mtp."):
            out[k] = v
            continue
        if ".ffn.experts.w" in k:
            base, w_, suffix = k.rsplit(".", 2)
            for e in range(v.shape[0]):
                out[f"{base}.{e}.{w_}.{suffix}"] = v[e]
            continue
        for a, b in _TRANSFORMERS:
            k = k.replace(a, b)
        out["model." + k] = v
    return out


def test_mtp_loads_from_transformers_spellings_and_per_expert_tensors(mtp_dir, tmp_path):
    other = _copy(mtp_dir, tmp_path / "hf", _transformers_names)
    assert any(n.startswith("model.mtp.0.self_attn.") for n in scan(str(other)))
    ref, _ = load_model(str(mtp_dir), mtp=True)
    got, _ = load_model(str(other), mtp=True)
    a, b = _mtp_params(ref), _mtp_params(got)
    assert sorted(a) == sorted(b)
    for k in a:
        assert mx.array_equal(a[k], b[k]).item(), k


@pytest.mark.parametrize(
    "case, named",
    [
        ("missing", "mtp.0.h_proj.weight missing"),
        ("shape", "mtp.0.e_proj.weight has shape (32, 16)"),
        ("expert", "mtp.0.ffn.experts: experts [3] missing"),
        ("extra", "mtp.1.enorm.weight unexpected"),
    ],
)
def test_malformed_mtp_is_refused_naming_the_tensor(mtp_dir, tmp_path, case, named, capsys):
    def change(w):
        if case == "missing":
            del w["mtp.0.h_proj.weight"]
        elif case == "shape":
            w["mtp.0.e_proj.weight"] = w["mtp.0.e_proj.weight"][:, :16]
        elif case == "expert":
            w = _transformers_names(w)
            del w["mtp.0.ffn.experts.3.w1.weight"]
        else:
            w["mtp.1.enorm.weight"] = w["mtp.0.enorm.weight"]
        return w

    bad = _copy(mtp_dir, tmp_path / case, change)
    with pytest.raises(LoadError, match="mtp") as e:
        load_model(str(bad), mtp=True)
    assert named in str(e.value)
    # --speculative off never reads them: the same checkpoint serves without a drafter.
    engine = Engine.load(bad, ctx_size=64, speculative="off")
    assert "mtp" not in engine.model
    rc = main(["generate", "-m", str(bad), "-p", "hi", "--speculative", "mtp", "-n", "2"])
    assert rc != 0 and named in capsys.readouterr().err


def test_fit_check_counts_the_drafter_only_when_loaded(mtp_dir):
    off = check_fit(str(mtp_dir), 256, dtype_bytes=4, gpu=False).weights
    on = check_fit(str(mtp_dir), 256, dtype_bytes=4, gpu=False, mtp=True).weights
    model, _ = load_model(str(mtp_dir), mtp=True)
    assert on - off == sum(v.nbytes for v in _mtp_params(model).values()) > 0


def test_convert_keeps_the_mtp_block_and_quantizes_it_like_the_rest(mtp_dir, tmp_path):
    out = tmp_path / "q"
    rc = main(
        ["convert", str(mtp_dir), str(out), "--expert-bits", "4", "--bits", "8",
         "--group-size", "32"]
    )  # fmt: skip
    assert rc == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "mtp.0.e_proj.scales" in index and "mtp.0.ffn.experts.w1.scales" in index
    model, _ = load_model(str(out), mtp=True)
    (block,) = model.mtp
    assert isinstance(block.e_proj, nn.QuantizedLinear) and block.e_proj.bits == 8
    assert block.ffn.experts.w1.bits == 4 and block.hc_head_fn.dtype == mx.float32
    # From the transformers / per-expert spelling too.
    hf = _copy(mtp_dir, tmp_path / "hf", _transformers_names)
    assert main(["convert", str(hf), str(tmp_path / "q2"), "--group-size", "32"]) == 0
    model2, _ = load_model(str(tmp_path / "q2"), mtp=True)
    assert model2.mtp[0].ffn.experts.w1.bits == 4
    # A malformed block is left out with the reason; the target still converts.
    bad = _copy(
        mtp_dir, tmp_path / "bad", lambda w: {k: v for k, v in w.items() if "h_proj" not in k}
    )
    summary = convert(str(bad), str(tmp_path / "q3"), ConvertOptions(group_size=32))
    assert any("mtp.0.h_proj missing" in n for n in summary.notes), summary.notes
    index = json.loads((tmp_path / "q3" / "model.safetensors.index.json").read_text())
    assert not any(k.startswith("mtp.") for k in index["weight_map"])


def test_speculative_mtp_loads_the_drafter_and_generates(mtp_dir, capsys):
    rc = main(
        ["generate", "-m", str(mtp_dir), "-p", "hi", "--speculative", "mtp", "--temp", "0",
         "-n", "12", "-v"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0 and "drafted=" in err, err


def test_the_drafter_cache_holds_only_kept_rows(mtp_dir):
    """After a drafting turn (verifies that accept and reject rows, re-feeds), the
    drafter's cache —
    built incrementally from the rows the session kept — drafts exactly what a cache
    rebuilt from scratch over the held window drafts."""
    engine = Engine.load(mtp_dir, ctx_size=256, speculative="mtp")
    engine.speculation = speculation_for(engine, "mtp", 4)
    s = engine.new_session()
    tok = engine.tokenizer
    prompt = tok.encode("<｜begin▁of▁sentence｜><｜User｜>hello there<｜Assistant｜></think>")
    script = drafted_continuation(engine, prompt, 40)
    spec = TurnSpec(GREEDY, 40, parse=False, ignore_eos=True, pipeline=False)
    r = run_turn(s, tok, spec, prefill=prompt, script=script)
    engine.speculation = Speculation()
    assert r.accepted > 0 and r.drafted > r.accepted  # accepted and rejected drafts
    drafter = MTPDrafter(engine.model)
    state = s.draft.state["mtp"]
    assert state.base == 0 and state.n < len(s.tokens)  # built along the turn
    t0 = int(mx.argmax(s.logits).item())
    incremental, _ = drafter.propose(s, t0, 4, GREEDY)
    assert s.draft.state["mtp"] is state and state.base + state.n == len(s.tokens)
    s.draft.state.clear()
    rebuilt, _ = drafter.propose(s, t0, 4, GREEDY)
    assert s.draft.state["mtp"].base == len(s.tokens) - engine.args.window_size
    assert incremental == rebuilt


def test_sampled_turns_draft_from_the_heads_distribution(mtp_dir):
    """Temperature 1 (``auto``: the head plus prompt lookup): the head drafts by sampling
    its own distribution and hands it to the acceptance rule; the turn runs its length."""
    engine = Engine.load(mtp_dir, ctx_size=256, speculative="auto")
    engine.speculation = speculation_for(engine, "auto", 3)
    assert isinstance(engine.speculation.mtp, MTPDrafter)
    s = engine.new_session()
    prompt = engine.tokenizer.encode("<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>")
    spec = TurnSpec(SamplingParams(temperature=1.0, seed=3), 24, parse=False, ignore_eos=True)
    drafter = engine.speculation.mtp
    s.prefill(prompt)
    drafts, qs = drafter.propose(s, 1000, 3, spec.sampling)
    assert len(drafts) == len(qs) == 3
    assert all(
        abs(float(q.sum().item()) - 1) < 1e-4 and float(q[d].item()) > 0
        for d, q in zip(drafts, qs, strict=True)
    )
    r = run_turn(s, engine.tokenizer, spec)
    engine.speculation = Speculation()
    assert r.completion_tokens == 24 and r.drafted > 0


def test_make_tiny_refuses_a_negative_mtp_count(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "x"), "--mtp", "-1"]) == 2
    assert "--mtp" in capsys.readouterr().err


@pytest.mark.parametrize("pipeline", [True, False])
def test_the_session_keeps_the_final_streams_of_its_newest_rows(mtp_dir, pipeline):
    """What drafters read (`Session.draft`): after prefill chunks and a turn (pipelined
    or not, with drafting verifies), the held rows are the target's final streams at
    those positions, as one full forward over the session's tokens computes them."""
    engine = Engine.load(mtp_dir, ctx_size=256, speculative="mtp")
    engine.speculation = speculation_for(engine, "mtp", 3)
    s = engine.new_session()
    tok = engine.tokenizer
    prompt = tok.encode("<｜begin▁of▁sentence｜><｜User｜>hello there<｜Assistant｜></think>")
    s.prefill(prompt, chunk_size=7)
    spec = TurnSpec(GREEDY, 20, parse=False, ignore_eos=True, pipeline=pipeline)
    r = run_turn(s, tok, spec, script=drafted_continuation(engine, prompt, 20))
    engine.speculation = Speculation()
    assert r.accepted > 0
    model, last, w = engine.model, engine.args.n_layers - 1, engine.args.window_size
    L = len(s.tokens)
    assert s.draft.first <= L - w and s.draft.rows(last, L - w - 8, L) is None  # bounded
    held = s.draft.rows(last, L - w, L)
    mx.eval(model(mx.array([s.tokens])))
    full = model.tapped[last][L - w :]
    assert held.shape == full.shape
    assert float(mx.max(mx.abs(held - full)).item()) < 1e-4


def test_default_sessions_count_the_drafter(mtp_dir):
    from ds4mlx.model.fit import sessions_that_fit

    _, off = sessions_that_fit(str(mtp_dir), 256, "1GB", dtype_bytes=4, gpu=False)
    _, on = sessions_that_fit(str(mtp_dir), 256, "1GB", dtype_bytes=4, gpu=False, mtp=True)
    assert on.weights > off.weights
