"""The DSpark drafter (``ds4mlx.model.dspark``, ``ds4mlx.engine.dspark``) on the real
tiny model with a random tiny DSpark head (``make-tiny --dspark``).

Exactness: greedy output and end state with the DSpark drafter equal the plain loop's
across the window wrap, ratio-4 and ratio-128 boundaries. The drafter's context (the
target layers' outputs of every fed position) follows rewinds and re-feeds: after a
speculative turn it equals the features of one fresh prefill of the same tokens. Loader:
a malformed tensor set or config is refused naming what is wrong; the checkpoint's
``mtp.*`` is never taken for MTP blocks; the fit check counts the drafter when it is
loaded; ``convert`` keeps it, quantized like the rest.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.engine import Engine, SamplingParams, TurnSpec, run_turn
from ds4mlx.engine.speculative import Speculation, speculation_for
from ds4mlx.model.demo import DEMO_TINY_KWARGS
from ds4mlx.model.dspark_loading import load_dspark
from ds4mlx.model.errors import LoadError

GREEDY = SamplingParams(temperature=0)
ATOL = 1e-4  # the chunked-vs-full prefill tolerance (tests/test_engine.py)
PROMPT = "<｜begin▁of▁sentence｜><｜User｜>hello there<｜Assistant｜></think>"


@pytest.fixture(scope="module")
def dspark_dir(tiny_checkpoint):
    return tiny_checkpoint(**DEMO_TINY_KWARGS, dspark=True)


@pytest.fixture(scope="module")
def engine(dspark_dir):
    e = Engine.load(dspark_dir, ctx_size=512)
    yield e
    e.speculation = speculation_for(e, "off")


def _turn(engine, mode, prompt, spec, k=4):
    engine.speculation = speculation_for(engine, mode, k)
    s = engine.new_session()
    try:
        r = run_turn(s, engine.tokenizer, spec, prefill=prompt)
    finally:
        engine.speculation = Speculation()
    return r, s


def _assert_same_state(a, b):
    (r1, s1), (r2, s2) = a, b
    assert (r1.finish, r1.completion_tokens, r1.text) == (r2.finish, r2.completion_tokens, r2.text)
    assert s1.tokens == s2.tokens
    x1, x2 = s1.snapshot().arrays, s2.snapshot().arrays
    assert sorted(x1) == sorted(x2)
    for k in x1:
        x, y = x1[k], x2[k]
        if k.endswith((".pend_kv", ".pend_score")):
            # Rows past ``offset % ratio`` are stale by definition (model/cache.py).
            live = int(x1[f"cache.{k.split('.')[1]}.offset"].item()) % x.shape[0]
            x, y = x[:live], y[:live]
        if x.size:
            finite = mx.isfinite(x)
            assert mx.array_equal(finite, mx.isfinite(y)).item(), k
            assert float(mx.max(mx.where(finite, mx.abs(x - y), 0.0)).item()) < ATOL, k


def _long_prompt(engine, n):
    ids = engine.tokenizer.encode(PROMPT)
    body = np.random.default_rng(1).integers(1000, 100000, size=n - len(ids)).tolist()
    return ids[:-2] + body + ids[-2:]


@pytest.mark.parametrize("where", ["window_and_ratio4", "ratio128"])
def test_greedy_output_with_a_random_dspark_head_equals_plain(engine, where):
    """The random head's drafts are (nearly) all rejected: every verify rewinds. Greedy
    output, finish, and every cache tensor still equal the plain loop's."""
    if where == "ratio128":
        prompt, n = _long_prompt(engine, 120), 14
    else:
        prompt, n = engine.tokenizer.encode(PROMPT), 30
    spec = TurnSpec(GREEDY, n, parse=False, ignore_eos=True, pipeline=False)
    plain = _turn(engine, "off", prompt, spec)
    got = _turn(engine, "dspark", prompt, spec)
    _assert_same_state(plain, got)
    assert got[0].drafted > 0 and plain[0].drafted == 0


def test_context_features_follow_rewinds_and_refeeds(engine):
    """After a speculative turn (verifies written and rewound, pipelined steps), the
    drafter's context rows are those of one fresh prefill of the session's tokens."""
    prompt = engine.tokenizer.encode(PROMPT)
    spec = TurnSpec(GREEDY, 24, parse=False, ignore_eos=True)
    engine.speculation = speculation_for(engine, "dspark", 4)
    d = engine.speculation.dspark
    try:
        s = engine.new_session()
        r = run_turn(s, engine.tokenizer, spec, prefill=prompt)
        assert r.drafted > 0 and "dspark" in s.draft.state  # rows projected while drafting
        end = len(s.tokens)
        start, rows = d.context(s)
        fresh = engine.new_session()
        fresh.prefill(s.tokens)
        start2, rows2 = d.context(fresh)
    finally:
        engine.speculation = Speculation()
    W = engine.args.window_size
    assert (start, start2) == (end - W, end - W) and rows.shape == rows2.shape
    assert rows.shape[1] == engine.args.dim
    assert float(mx.max(mx.abs(rows - rows2)).item()) < ATOL


def test_proposal_is_a_block_after_t0(engine):
    """A proposal drafts ``min(limit, dspark_block_size)`` tokens (the block's rows see
    each other, so a shorter block is not a prefix of a longer one), deterministic when
    greedy; with temperature it returns the drafting distributions (rows sum to 1); a
    cache that was never fed (a restored state) gives no drafts."""
    engine.speculation = speculation_for(engine, "dspark", 8)
    d = engine.speculation.dspark
    s = engine.new_session()
    s.prefill(engine.tokenizer.encode(PROMPT))
    t0 = int(mx.argmax(s.logits).item())
    a, q = d.propose(s, t0, 8, GREEDY)
    assert len(a) == d.block_size == 5 and q == [] and d.propose(s, t0, 8, GREEDY) == (a, [])
    assert len(d.propose(s, t0, 3, GREEDY)[0]) == 3
    drafts, qs = d.propose(s, t0, 2, SamplingParams(temperature=1.0, seed=3))
    assert len(drafts) == len(qs) == 2
    assert all(abs(float(x.sum().item()) - 1) < 1e-3 for x in qs)
    # A sampled turn checks those drafts with the acceptance rule against q.
    spec = TurnSpec(SamplingParams(temperature=1.0, seed=5), 8, parse=False, ignore_eos=True)
    r = run_turn(
        engine.new_session(), engine.tokenizer, spec, prefill=engine.tokenizer.encode(PROMPT)
    )
    assert r.drafted > 0 and r.completion_tokens == 8
    restored = engine.new_session()
    restored.restore(s.snapshot())
    assert d.propose(restored, t0, 4, GREEDY) == ([], [])
    # Fed again, it drafts from the rows it was fed since (a gap before them).
    n0 = len(restored.tokens)
    restored.prefill([t0, 1000, 1001])
    start, rows = d.context(restored)
    assert (start, rows.shape[0]) == (n0, 3)
    assert len(d.propose(restored, 1002, 4, GREEDY)[0]) == 4
    engine.speculation = speculation_for(engine, "off")


def test_auto_picks_the_dspark_drafter_when_the_checkpoint_has_one(engine, tiny_f32_dir):
    assert speculation_for(engine, "auto").dspark is not None
    plain = Engine.load(tiny_f32_dir, ctx_size=256)
    assert speculation_for(plain, "auto").dspark is None
    with pytest.raises(ValueError, match="--speculative dspark: .* has no DSpark drafter"):
        speculation_for(plain, "dspark")
    engine.speculation = speculation_for(engine, "off")


def test_auto_without_the_mtp_tensors_falls_back_to_lookup(engine, dspark_dir, tmp_path):
    """A checkpoint that keeps the dspark_* fields but lost every ``mtp.*`` tensor (a
    conversion that dropped them): ``auto`` drafts with lookup alone, ``dspark`` refuses
    naming the missing tensors."""
    bad = _broken_copy(dspark_dir, tmp_path / "bad", drop="mtp.")
    e = Engine.load(bad, ctx_size=256)
    assert speculation_for(e, "auto").dspark is None
    with pytest.raises(ValueError, match="declares a DSpark drafter but has no mtp.. tensors"):
        speculation_for(e, "dspark")


def test_speculative_dspark_without_a_drafter_is_refused_at_start(tiny_f32_dir, capsys):
    from ds4mlx.cli import main

    rc = main(["generate", "-m", str(tiny_f32_dir), "-p", "hi", "--speculative", "dspark"])
    err = capsys.readouterr().err
    assert rc != 0 and "--speculative dspark" in err and "no DSpark drafter" in err


def test_make_tiny_writes_the_published_tensor_names_and_fields(dspark_dir):
    """Flash 0731's layout at toy size: three stages, ``main_proj`` over the three target
    layers on stage 0; ``hc_head``, ``norm`` and the Markov head on the last stage."""
    from safetensors import safe_open

    cfg = json.loads((dspark_dir / "config.json").read_text())
    assert cfg["dspark_block_size"] == 5 and cfg["dspark_noise_token_id"] == 128799
    assert cfg["dspark_target_layer_ids"] == [1, 2, 3] and cfg["num_nextn_predict_layers"] == 3
    dim, vocab, rank = cfg["hidden_size"], cfg["vocab_size"], cfg["dspark_markov_rank"]
    with safe_open(str(dspark_dir / "model.safetensors"), "numpy") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith("mtp.")}
    assert shapes["mtp.0.main_proj.weight"] == (dim, 3 * dim)
    assert shapes["mtp.0.main_norm.weight"] == (dim,)
    assert shapes["mtp.2.hc_head_fn"] == (4, 4 * dim)
    assert shapes["mtp.2.markov_head.markov_w1.weight"] == (vocab, rank)
    assert shapes["mtp.2.markov_head.markov_w2.weight"] == (vocab, rank)
    assert shapes["mtp.1.attn.wq_a.weight"] == (cfg["q_lora_rank"], dim)
    assert "mtp.1.ffn.gate.bias" in shapes and "mtp.1.hc_ffn_fn" in shapes
    assert not any(k.startswith("mtp.1.main_") or k.startswith("mtp.0.markov") for k in shapes)


def test_make_tiny_dspark_flag(tmp_path, capsys):
    from ds4mlx.cli import main

    assert main(["make-tiny", str(tmp_path / "t"), "--float32", "--dspark"]) == 0
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["dspark_block_size"] == 5 and cfg["num_nextn_predict_layers"] == 3


def _broken_copy(src, dst, *, drop=None, reshape=None, config=None):
    """A copy of checkpoint ``src`` with the tensors whose names start with ``drop``
    removed, ``reshape`` cut by one row, or ``config`` entries changed."""
    shutil.copytree(src, dst)
    if drop or reshape:
        w = mx.load(str(dst / "model.safetensors"))
        for k in [k for k in w if drop and k.startswith(drop)]:
            del w[k]
        if reshape:
            w[reshape] = w[reshape][:-1]
        mx.save_safetensors(str(dst / "model.safetensors"), w)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "broken, message",
    [
        (
            {"drop": "mtp.2.markov_head.markov_w2.weight"},
            r"malformed DSpark drafter .*mtp.2.markov_head.markov_w2.weight missing",
        ),
        ({"reshape": "mtp.0.main_proj.weight"}, r"mtp.0.main_proj.weight has shape"),
        ({"drop": "mtp.1.attn.wkv.weight"}, r"mtp.1.attn.wkv.weight missing"),
        ({"config": {"dspark_target_layer_ids": [2, 9, 10]}}, r"the model has 4 layers"),
        ({"config": {"num_nextn_predict_layers": 2}}, r"num_nextn_predict_layers is 2"),
    ],
)
def test_a_malformed_drafter_is_refused_naming_the_tensor(
    engine, dspark_dir, tmp_path, broken, message
):
    bad = _broken_copy(dspark_dir, tmp_path / "bad", **broken)
    cfg = json.loads((bad / "config.json").read_text())
    from ds4mlx.model.config import ModelArgs

    with pytest.raises(LoadError, match=message):
        load_dspark(str(bad), ModelArgs.from_dict(cfg), engine.model, cfg)


def test_quantized_checkpoint_loads_the_drafter_quantized(tiny_checkpoint):
    """The default tiny (experts 4-bit, rest 8-bit) quantizes the drafter like the
    target, and its greedy turn with DSpark equals the plain one."""
    e = Engine.load(tiny_checkpoint(dspark=True), ctx_size=256)
    prompt = e.tokenizer.encode(PROMPT)
    spec = TurnSpec(GREEDY, 8, parse=False, ignore_eos=True, pipeline=False)
    plain = _turn(e, "off", prompt, spec)
    e.speculation = speculation_for(e, "dspark", 4)
    stage = e.speculation.dspark.net.mtp[0]
    assert type(stage.attn.wq_a).__name__ == "QuantizedLinear"
    assert type(stage.ffn.experts.w1).__name__ == "QuantizedSwitchLinear"
    got = _turn(e, "dspark", prompt, spec)
    assert plain[1].tokens == got[1].tokens and got[0].drafted > 0


def test_generate_with_speculative_dspark_prints_the_plain_greedy_text(dspark_dir, capsys):
    """End to end through the CLI: ``generate --speculative dspark`` loads the drafter,
    drafts (``-v`` reports it) and prints what plain greedy decoding prints."""
    from ds4mlx.cli import main

    base = ["generate", "-m", str(dspark_dir), "-p", "hi", "--temp", "0", "--max-tokens", "12"]
    assert main([*base, "--ctx", "256"]) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--ctx", "256", "--speculative", "dspark", "-v"]) == 0
    out = capsys.readouterr()
    assert out.out == plain and "drafted=" in out.err


def test_a_dspark_checkpoint_never_loads_its_mtp_as_mtp_blocks(dspark_dir, tiny_checkpoint):
    """0731 declares ``num_nextn_predict_layers`` (its DSpark stages) and stores them under
    ``mtp.*``: ``--speculative auto`` loads the target without MTP blocks and drafts with
    DSpark; ``mtp`` says there is no MTP drafter and names the one there is (the
    refusal once read "no mtp.* tensors loaded; use lookup or off" on a checkpoint full
    of them). On an MTP checkpoint ``auto`` is MTP, and ``dspark`` points at ``mtp``."""
    e = Engine.load(dspark_dir, ctx_size=256, speculative="auto")
    assert "mtp" not in e.model and e.args.drafter == "dspark"
    spec = speculation_for(e, "auto")
    assert spec.dspark is not None and spec.mtp is None
    with pytest.raises(ValueError, match="--speculative mtp: .* has no MTP drafter") as err:
        speculation_for(e, "mtp")
    assert "DSpark drafter" in str(err.value) and "use --speculative dspark" in str(err.value)
    assert "lookup or off" not in str(err.value)
    m = Engine.load(tiny_checkpoint(**DEMO_TINY_KWARGS, mtp=1), ctx_size=256, speculative="auto")
    spec = speculation_for(m, "auto")
    assert spec.mtp is not None and spec.dspark is None and m.args.drafter == "mtp"
    with pytest.raises(ValueError, match="--speculative dspark: .* has no DSpark drafter") as err:
        speculation_for(m, "dspark")
    assert "use --speculative mtp" in str(err.value) and "lookup or off" not in str(err.value)


def test_the_fit_check_counts_the_drafter_when_it_is_loaded(engine, dspark_dir):
    """``check_fit(mtp=True)`` counts the DSpark stages' bytes exactly; the load counts
    them under ``dspark`` / ``auto`` only (a budget between the two totals refuses those
    and admits ``off``)."""
    from mlx.utils import tree_flatten

    from ds4mlx.model.fit import check_fit
    from ds4mlx.model.loading import load_model

    off = check_fit(str(dspark_dir), 256, dtype_bytes=4, gpu=False)
    on = check_fit(str(dspark_dir), 256, dtype_bytes=4, gpu=False, mtp=True)
    net = speculation_for(engine, "dspark").dspark.net
    assert on.weights - off.weights == sum(v.nbytes for _, v in tree_flatten(net.parameters()))
    limit = (off.total + on.total) // 2
    load_model(str(dspark_dir), ctx_size=256, memory_limit=limit, mtp=True)
    for kw in ({"dspark": True}, {"dspark": True, "mtp": True}):
        with pytest.raises(LoadError):
            load_model(str(dspark_dir), ctx_size=256, memory_limit=limit, **kw)
    engine.speculation = speculation_for(engine, "off")


def test_convert_keeps_the_dspark_stages_quantized_like_the_rest(dspark_dir, tmp_path):
    """``convert`` keeps the stages' ``mtp.*`` (the tensors nothing reads left out),
    quantizes them like the target, and the result drafts with DSpark as the source
    does (same greedy output as plain decoding)."""
    from ds4mlx.model.convert import ConvertOptions, convert

    src = _broken_copy(dspark_dir, tmp_path / "src")
    w = mx.load(str(src / "model.safetensors"))
    w["mtp.0.confidence_head.weight"] = mx.zeros((1, 8))
    mx.save_safetensors(str(src / "model.safetensors"), w)
    opts = ConvertOptions(group_size=32, expert="4", rest="8")
    summary = convert(str(src), str(tmp_path / "q"), opts)
    assert any("left out 1 DSpark tensors" in n for n in summary.notes), summary.notes
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    names = index["weight_map"]
    assert "mtp.0.main_proj.scales" in names and "mtp.2.markov_head.markov_w2.scales" in names
    assert "mtp.1.ffn.experts.w1.scales" in names
    assert not any("confidence_head" in k for k in names)
    e = Engine.load(tmp_path / "q", ctx_size=256, speculative="dspark")
    e.speculation = speculation_for(e, "dspark", 4)
    stage = e.speculation.dspark.net.mtp[0]
    assert stage.main_proj.bits == 8 and stage.ffn.experts.w1.bits == 4
    prompt = e.tokenizer.encode(PROMPT)
    spec = TurnSpec(GREEDY, 8, parse=False, ignore_eos=True, pipeline=False)
    got = _turn(e, "dspark", prompt, spec)
    plain = _turn(e, "off", prompt, spec)
    assert got[1].tokens == plain[1].tokens and got[0].drafted > 0


def test_serve_default_sessions_count_the_drafter_speculative_loads(dspark_dir, monkeypatch):
    """``serve``'s default ``--sessions`` counts the DSpark drafter under ``dspark`` /
    ``auto`` (what the load counts), not under ``mtp`` or ``off``."""
    from argparse import Namespace
    from dataclasses import dataclass

    from ds4mlx.model import fit
    from ds4mlx.server.cli import _default_sessions

    @dataclass
    class KV:
        sessions: int = 1

    on = fit.check_fit(str(dspark_dir), 256, mtp=True)
    monkeypatch.setenv(fit.MEMORY_ENV, str(on.total))  # one state fits with the drafter
    want = {d: fit.sessions_that_fit(str(dspark_dir), 256, mtp=d)[0] for d in (False, True)}
    assert want[True] == 1 < want[False]
    for mode, counted in (("off", False), ("mtp", False), ("dspark", True), ("auto", True)):
        kv, _ = _default_sessions(
            KV(),
            Namespace(sessions=None, ctx=256, speculative=mode, distributed=None),
            str(dspark_dir),
        )
        assert kv.sessions == want[counted], mode
