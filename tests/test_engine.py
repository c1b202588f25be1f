"""Engine/Session on the real tiny float32 DS4 network (no mocks).

Incremental equals whole (chunked prefill + token-by-token decode vs one full forward),
bit-identical snapshot/restore (in memory, bytes, file), scripted decoding, seeded
sampling, context guard, progress/cancel.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.engine import (
    ContextOverflowError,
    Engine,
    SamplingParams,
    SessionState,
    SnapshotError,
    TurnSpec,
    run_turn,
)

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_dir(tiny_f32_dir):
    return tiny_f32_dir


@pytest.fixture(scope="module")
def engine(tiny_dir) -> Engine:
    return Engine.load(tiny_dir, ctx_size=2048)


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    """A prompt that crosses the window and at least two blocks of every ratio."""
    a = engine.args
    n = max(2 * max(a.compress_ratios) + 9, 2 * a.window_size + 9, 160)
    ids = engine.tokenizer.encode(
        "<｜begin▁of▁sentence｜><｜User｜>Explain the sliding window. 你好 🤖<｜Assistant｜><think>"
    )
    rng = np.random.default_rng(0)
    ids += rng.integers(1000, 100000, size=max(0, n - len(ids))).tolist()
    return ids[:n]


@pytest.fixture(scope="module")
def full_logits(engine, prompt) -> mx.array:
    out = engine.model(mx.array(prompt, dtype=mx.int32)[None], None)[0]
    mx.eval(out)
    return out


def _maxdiff(a, b) -> float:
    return float(mx.max(mx.abs(a - b)).item())


def _greedy(session, n):
    toks, logits = [], []
    for _ in range(n):
        t = session.sample(SamplingParams(temperature=0))
        toks.append(t)
        session.decode(t)
        logits.append(session.logits)
    return toks, logits


def test_engine_attributes(engine, tiny_dir):
    assert engine.ctx_size == 2048
    assert engine.identity.startswith("ds4-") and len(engine.identity) == 36
    assert engine.quant_desc == "f32"
    again = Engine(engine.model, engine.args, engine.tokenizer, path=tiny_dir, config=engine.config)
    assert again.identity == engine.identity  # stable for the same checkpoint
    assert engine.session.tokens == [] and engine.session.logits is None


@pytest.mark.parametrize("chunk", [5, 37, 10_000])
def test_chunked_prefill_then_decode_equals_full_forward(engine, prompt, full_logits, chunk):
    n_pre = len(prompt) - 24
    s = engine.new_session()
    assert s.prefill(prompt[:n_pre], chunk_size=chunk) == n_pre
    assert s.logits.shape == (engine.args.vocab_size,) and s.logits.dtype == mx.float32
    assert _maxdiff(s.logits, full_logits[n_pre - 1]) < ATOL
    for i in range(n_pre, len(prompt)):
        s.decode(prompt[i])
        assert _maxdiff(s.logits, full_logits[i]) < ATOL, f"position {i}"
    assert s.tokens == prompt
    assert int(mx.argmax(s.logits).item()) == int(mx.argmax(full_logits[-1]).item())


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [7, 10_000])
def test_scored_prefill_rows_are_the_full_forwards(engine, prompt, full_logits, chunk):
    """``prefill(on_rows=…)``: every token gets the logits it was predicted from (the
    one forward's row before it), across chunk boundaries and after a prefix fed
    earlier; a cold session's first token has none. `score_rows` takes the logprob and
    best alternatives from them, and the session ends as an unscored prefill."""
    from ds4mlx.engine.turn import score_rows

    s = engine.new_session()
    seen: list[tuple[mx.array, list[int]]] = []
    split = 50
    for part in (prompt[:split], prompt[split:]):
        s.prefill(part, chunk_size=chunk, on_rows=lambda rows, t: seen.append((rows, t)))
    assert [t for _, t in seen for t in t] == prompt[1:]
    rows = mx.concatenate([r for r, _ in seen])
    assert rows.shape == (len(prompt) - 1, engine.args.vocab_size)
    assert _maxdiff(rows, full_logits[:-1]) < ATOL
    assert _maxdiff(s.logits, full_logits[-1]) < ATOL and s.tokens == prompt
    lps = np.array(full_logits[:-1] - mx.logsumexp(full_logits[:-1], axis=-1, keepdims=True))
    scored = score_rows(rows, prompt[1:], 3)
    assert [e.token for e in scored] == prompt[1:]
    want = lps[np.arange(len(scored)), prompt[1:]]
    np.testing.assert_allclose([e.logprob for e in scored], want, atol=ATOL)
    three = np.argpartition(-lps, 3, axis=-1)[:, :3]
    best = np.take_along_axis(three, np.argsort(-np.take_along_axis(lps, three, -1)), -1)
    assert [[t for t, _ in e.top] for e in scored] == best.tolist()
    assert all([v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True) for e in scored)


def test_progress_and_cancel(engine, prompt, full_logits):
    s = engine.new_session()
    calls = []
    n = s.prefill(prompt, chunk_size=40, progress=lambda d, t: calls.append((d, t)))
    assert n == len(prompt)
    total = len(prompt)
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted({0, *range(40, total, 40), total})

    s = engine.new_session()
    polls = []

    def cancel():
        polls.append(1)
        return len(polls) > 2  # stop before the third chunk

    assert s.prefill(prompt, chunk_size=40, cancel=cancel) == 80
    assert s.tokens == prompt[:80]
    assert _maxdiff(s.logits, full_logits[79]) < ATOL
    s.prefill(prompt[80:], chunk_size=1000)  # the session stayed consistent
    assert _maxdiff(s.logits, full_logits[-1]) < ATOL


def test_snapshot_restore_bit_identical(engine, prompt, tmp_path):
    s = engine.new_session()
    s.prefill(prompt)
    snap = s.snapshot()
    assert snap.tokens == prompt and snap.meta["identity"] == engine.identity
    assert "logits" in snap.arrays and any(k.startswith("cache.") for k in snap.arrays)
    ref_toks, ref_logits = _greedy(s, 12)

    def check(state):
        s2 = engine.new_session()
        s2.restore(state)
        assert s2.tokens == prompt
        assert s2.kv_bytes() > 0
        toks, logits = _greedy(s2, 12)
        assert toks == ref_toks
        for a, b in zip(logits, ref_logits, strict=True):
            assert mx.array_equal(a, b)

    check(snap)
    check(snap)  # the snapshot is detached: continuing a restore does not change it
    # Restoring over a live session with other state replaces it entirely.
    s.restore(snap)
    assert _greedy(s, 12)[0] == ref_toks


def test_restore_rejects_foreign_snapshots(engine, prompt, tmp_path):
    s = engine.new_session()
    s.prefill(prompt[:20])
    snap = s.snapshot()
    bad = SessionState(snap.tokens, snap.arrays, {**snap.meta, "identity": "ds4-0000000000000000"})
    with pytest.raises(SnapshotError):
        engine.new_session().restore(bad)
    short = SessionState(snap.tokens[:-1], snap.arrays, snap.meta)
    with pytest.raises(SnapshotError):
        engine.new_session().restore(short)


def test_scripted_decoding_advances_kv(engine, prompt, full_logits):
    n = len(prompt) - 6
    script = prompt[n:]
    s = engine.new_session()
    s.prefill(prompt[:n])
    s.set_script(script)
    got = []
    for _ in script:
        t = s.sample(SamplingParams(temperature=1.0, seed=3))
        got.append(t)
        s.decode(t)
    assert got == script and s.script_remaining == 0
    # The forward ran for every scripted token: the state equals a plain prefill.
    assert s.tokens == prompt
    assert _maxdiff(s.logits, full_logits[-1]) < ATOL
    # Exhausted: normal sampling resumes.
    assert s.sample(SamplingParams(temperature=0)) == int(mx.argmax(full_logits[-1]).item())
    s.set_script([7, 8])
    s.set_script(None)
    assert s.script_remaining == 0


def test_seeded_sampling_reproducible(engine, prompt):
    s = engine.session
    params = SamplingParams(temperature=1.0, top_p=0.95, min_p=0.01, top_k=200, seed=1234)

    def run(p):
        s.reset()
        out: list[int] = []
        spec = TurnSpec(p, max_tokens=12, parse=False, ignore_eos=True)
        res = run_turn(
            s, engine.tokenizer, spec, prefill=prompt[:40], emit=lambda ev: out.extend(ev.tokens)
        )
        assert res.finish == "length" and res.completion_tokens == 12
        return out

    a, b = run(params), run(params)
    assert a == b and len(a) == 12
    c = run(SamplingParams(temperature=1.0, top_p=0.95, min_p=0.01, top_k=200, seed=99))
    assert c != a
    # Degenerate filters reduce to argmax, through mlx-lm's filter functions.
    s.reset()
    s.prefill(prompt[:40])
    top = int(mx.argmax(s.logits).item())
    s.seed(0)
    assert s.sample(SamplingParams(temperature=1.0, top_k=1)) == top
    assert s.sample(SamplingParams(temperature=1.0, min_p=1.0)) == top
    assert s.sample(SamplingParams(temperature=0.7), greedy=True) == top
    s.reset()


def test_turn_stop_token_not_fed(engine, prompt):
    """The feeding rule: the EOS that ends a turn is sampled but not fed (the next
    rendered turn starts with it). Was: ``Session.generate`` fed the stop token."""
    s = engine.new_session()
    eos = engine.tokenizer.eos_id
    spec = TurnSpec(SamplingParams(temperature=0), max_tokens=10, parse=False)
    res = run_turn(s, engine.tokenizer, spec, prefill=prompt[:30], script=[11, 12, eos])
    assert res.finish == "stop" and res.completion_tokens == 3 and res.fed == 2
    assert s.tokens == prompt[:30] + [11, 12]


def test_sampling_params_validated():
    for bad in (
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(min_p=2),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(temperature=0).greedy


def test_context_overflow(engine, tiny_dir, prompt):
    small = Engine(
        engine.model,
        engine.args,
        engine.tokenizer,
        path=tiny_dir,
        config=engine.config,
        ctx_size=32,
    )
    s = small.session
    with pytest.raises(ContextOverflowError) as e:
        s.prefill(prompt[:33])
    assert e.value.have == 0 and e.value.adding == 33 and e.value.ctx_size == 32
    assert s.tokens == [] and s.logits is None  # nothing was fed
    s.prefill(prompt[:31])
    s.decode(prompt[31])
    assert s.room() == 0
    with pytest.raises(ContextOverflowError):
        s.decode(1)
    s.reset()
    spec = TurnSpec(SamplingParams(temperature=0), max_tokens=10, parse=False, ignore_eos=True)
    res = run_turn(s, small.tokenizer, spec, prefill=prompt[:30])
    # Two tokens fit; the third is sampled from the last logits but cannot be fed.
    assert res.completion_tokens == 3 and res.finish == "context" and len(s.tokens) == 32
    with pytest.raises(ValueError):
        Engine(
            engine.model,
            engine.args,
            engine.tokenizer,
            path=tiny_dir,
            config=engine.config,
            ctx_size=engine.args.max_position_embeddings + 1,
        )


def test_kv_bytes_and_reset(engine, prompt):
    s = engine.new_session()
    assert s.kv_bytes() == 0
    s.prefill(prompt)
    assert s.kv_bytes() > 0
    assert s.text == engine.tokenizer.decode(prompt)
    s.reset()
    assert s.tokens == [] and s.logits is None and s.kv_bytes() == 0
    with pytest.raises(RuntimeError):
        s.sample(SamplingParams())


def test_quantized_tiny_loads_and_generates(tmp_path):
    from ds4mlx.model.tiny import make_tiny

    make_tiny(tmp_path, seed=0, expert_bits=2, other_bits=8)
    e = Engine.load(tmp_path, ctx_size=256)
    assert e.quant_desc == "experts=q2 other=q8"
    ids = e.tokenizer.encode("<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>")
    out: list[int] = []
    spec = TurnSpec(SamplingParams(temperature=0), max_tokens=5, parse=False, ignore_eos=True)
    run_turn(e.session, e.tokenizer, spec, prefill=ids, emit=lambda ev: out.extend(ev.tokens))
    assert len(out) == 5 and all(0 <= t < e.args.vocab_size for t in out)
