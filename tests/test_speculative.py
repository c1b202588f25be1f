"""Speculative decoding (``ds4mlx.engine.speculative``) on the real tiny model.

Exactness: with any drafter — one that is mostly right, one that is always wrong, the
prompt-lookup drafter, a random tiny MTP head — greedy output equals plain greedy output token for token, and
the session ends with the same tokens, and logits and every cache tensor within the
chunked-vs-full prefill tolerance, whatever ends the turn. Sampling: the acceptance
rule against hand-computed cases, and a chi-square test of the first drafted token's
distribution at temperature 1.
"""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.dsml import ToolMemory, ToolSpec
from ds4mlx.engine import Engine, SamplingParams, TurnHooks, TurnSpec, run_turn
from ds4mlx.engine.grammar import json_grammar, ll_tokenizer
from ds4mlx.engine.mtp import drafted_continuation
from ds4mlx.engine.session import VerifyStep
from ds4mlx.engine.speculative import (
    BackOff,
    PromptLookup,
    Speculation,
    accept_draft,
    speculation_for,
)

GREEDY = SamplingParams(temperature=0)
ATOL = 1e-4  # the chunked-vs-full prefill tolerance (tests/test_engine.py)
PROMPT = "<｜begin▁of▁sentence｜><｜User｜>hello there<｜Assistant｜></think>"
TOOL = ToolSpec(
    "bash",
    "run a command",
    {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
)


@pytest.fixture(scope="module")
def engine(tiny_f32_dir):
    e = Engine.load(tiny_f32_dir, ctx_size=512)
    yield e
    e.speculation = Speculation()


@pytest.fixture(scope="module")
def mtp_engine(tiny_checkpoint):
    """The tiny model with one random MTP block (``make-tiny --mtp 1``), drafter loaded."""
    path = tiny_checkpoint(expert_bits=None, other_bits=None, mtp=1)
    e = Engine.load(path, ctx_size=512, speculative="mtp")
    yield e
    e.speculation = Speculation()


@pytest.fixture(scope="module")
def plain_turns():
    """The plain (non-drafting) reference turns, each run once per module by whichever
    drafter's case asks first: a plain turn here is greedy or scripted, so the same
    engine, prompt and spec give the same result and state every time."""
    return {}


class Oracle(TurnHooks):
    """Drafts the reference continuation ``ref``; every ``wrong_every``-th step's last
    draft is corrupted (1: every draft is wrong)."""

    def __init__(self, ref: list[int], wrong_every: int = 3, k: int = 4):
        self.ref, self.every, self.k, self.calls = ref, wrong_every, k, 0

    def draft(self, turn):
        self.calls += 1
        n = turn.result.completion_tokens  # the sampled token to be fed is ref[n - 1]
        drafts = list(self.ref[n : n + self.k])
        if self.every == 1:
            return [(t + 1) % 1000 + 7 for t in drafts]
        if drafts and self.calls % self.every == 0:
            drafts[-1] = (drafts[-1] + 1) % 1000 + 7
        return drafts


def _run(engine, spec, prompt, *, hooks=None, script=None, cancel_after=None, mode="off"):
    engine.speculation = speculation_for(engine, mode, 4)
    s = engine.new_session()
    polls, seen = [0], [0]

    def cancel():  # polled once before each sampled token, plain or drafted
        polls[0] += 1
        return cancel_after is not None and polls[0] > cancel_after

    def after(sess):
        seen[0] += 1
        assert len(sess.tokens) >= seen[0]

    mem = ToolMemory()
    events = []
    try:
        r = run_turn(
            s,
            engine.tokenizer,
            spec,
            prefill=prompt,
            script=script,
            hooks=hooks,
            cancel=cancel,
            after_token=after,
            tool_memory=mem,
            emit=events.append,
        )
    finally:
        engine.speculation = Speculation()
    return r, s, mem, events


def _assert_same_state(plain, spec):
    (r1, s1, _, _), (r2, s2, _, _) = plain, spec
    assert (r1.finish, r1.completion_tokens, r1.fed, r1.text, r1.raw) == (
        r2.finish,
        r2.completion_tokens,
        r2.fed,
        r2.text,
        r2.raw,
    )
    assert [c.dsml for c in r1.tool_calls] == [c.dsml for c in r2.tool_calls]
    assert s1.tokens == s2.tokens
    a1, a2 = s1.snapshot(), s2.snapshot()
    assert sorted(a1.arrays) == sorted(a2.arrays)
    assert a1.tokens == a2.tokens and s1.text == s2.text
    for k in a1.arrays:
        x, y = a1.arrays[k], a2.arrays[k]
        assert x.shape == y.shape, k
        if k.endswith((".pend_kv", ".pend_score")):
            # Rows past ``offset % ratio`` are stale by definition (model/cache.py):
            # they hold whatever an earlier block or chunk left there.
            live = int(a1.arrays[f"cache.{k.split('.')[1]}.offset"].item()) % x.shape[0]
            x, y = x[:live], y[:live]
        if x.size == 0:
            continue
        finite = mx.isfinite(x)
        assert mx.array_equal(finite, mx.isfinite(y)).item(), k
        diff = mx.where(finite, mx.abs(x - y), 0.0)
        assert float(mx.max(diff).item()) < ATOL, k


# --------------------------------------------------------------------------- units


def test_accept_draft_hand_computed():
    """p = (.5, .3, .2). A deterministic draft of id 1 is kept with probability .3 and
    replaced from (.5, 0, .2)/.7; with q = (.2, .6, .2) a draft of id 0 (p > q) is always
    kept, a draft of id 1 kept with probability .3/.6 and else replaced by id 0 (the
    only positive residual); a draft with p = 0 is never kept."""
    lp = mx.log(mx.array([0.5, 0.3, 0.2, 0.0]))
    q = mx.array([0.2, 0.6, 0.2, 0.0])
    n = 3000
    keys = [mx.random.key(i) for i in range(n)]
    det = [accept_draft(lp, 1, None, k) for k in keys]
    kept = sum(ok for _, ok in det) / n
    assert abs(kept - 0.3) < 0.03
    alts = [t for t, ok in det if not ok]
    assert set(alts) <= {0, 2} and abs(alts.count(0) / len(alts) - 0.5 / 0.7) < 0.04
    assert all(accept_draft(lp, 0, q, k) == (0, True) for k in keys[:200])
    soft = [accept_draft(lp, 1, q, k) for k in keys]
    assert {t for t, ok in soft if not ok} == {0}
    assert abs(sum(ok for _, ok in soft) / n - 0.5) < 0.03
    assert all(not ok and t != 3 for t, ok in (accept_draft(lp, 3, None, k) for k in keys[:200]))
    # The marginal is p: .3 kept + .7 * (.5/.7, 0, .2/.7) = (.5, .3, .2).
    marg = np.bincount([t for t, _ in det], minlength=4) / n
    assert np.allclose(marg, [0.5, 0.3, 0.2, 0.0], atol=0.03)


def test_prompt_lookup_continues_the_latest_occurrence():
    look = PromptLookup()
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert look.propose(toks, 3) == [4, 5, 6]  # the latest "1 2 3" is followed by 4 5 6
    assert look.propose([*toks, 4], 2) == [5, 6]  # incremental
    assert look.propose([*toks, 4, 8], 2) == []  # "4 8" / "8" never seen (no 1-grams)
    assert look.propose([5, 5], 2) == []  # another context: rebuilt, nothing recurs yet
    # The sampled token not fed yet comes as ``then`` (the session's list is not copied):
    # the same answers, asked twice or after it was fed.
    then = PromptLookup()
    assert then.propose(toks[:-1], 3, then=toks[-1]) == [4, 5, 6]
    assert then.propose(toks[:-1], 3, then=toks[-1]) == [4, 5, 6]
    assert then.propose(toks, 2, then=4) == [5, 6]
    assert then.propose([*toks, 4], 2, then=8) == []


def test_backoff_pauses_a_losing_drafter_longer_each_time():
    b = BackOff()
    verifies = 0
    for _ in range(1000):
        if b.ready():
            verifies += 1
            b.record(0.0, 1, 0)
    assert b.wasted == verifies and verifies <= 0.05 * 1000
    good = BackOff()
    for _ in range(50):
        assert good.ready()
        good.record(0.0, 4, 3)


def test_no_snapshot_while_unverified_rows_are_in_the_caches(engine):
    s = engine.new_session()
    s.prefill(engine.tokenizer.encode(PROMPT))
    v = VerifyStep(s, [5, 6, 7])
    with pytest.raises(RuntimeError, match="unverified"):
        s.snapshot()
    v.settle([5, 8])
    assert s.snapshot().tokens[-2:] == [5, 8]


# --------------------------------------------------------------------------- exactness


def _long_prompt(engine, n: int) -> list[int]:
    ids = engine.tokenizer.encode(PROMPT)
    rng = np.random.default_rng(1)
    body = rng.integers(1000, 100000, size=n - len(ids)).tolist()
    return ids[:-2] + body + ids[-2:]


@pytest.mark.parametrize("drafter", ["oracle", "wrong"])
@pytest.mark.parametrize("where", ["window_and_ratio4", "ratio128"])
def test_greedy_output_and_state_equal_plain(engine, plain_turns, drafter, where):
    """Unscripted greedy decoding: the verify's rows cross the 16-row window wrap and
    ratio-4 blocks (from a short prompt), or the first ratio-128 block's end. (The
    lookup drafter runs in the scripted cases below: what the random model writes
    seldom recurs.)"""
    if where == "ratio128":
        prompt, n = _long_prompt(engine, 120), 14
    else:
        prompt, n = engine.tokenizer.encode(PROMPT), 30
    spec = TurnSpec(GREEDY, n, parse=False, ignore_eos=True, pipeline=False)
    if ("greedy", where) not in plain_turns:
        plain_turns["greedy", where] = _run(engine, spec, prompt)
    plain = plain_turns["greedy", where]
    ref = plain[1].tokens[len(prompt) :]
    got = _run(engine, spec, prompt, hooks=Oracle(ref, 1 if drafter == "wrong" else 3))
    _assert_same_state(plain, got)
    r = got[0]
    assert r.drafted > 0
    if drafter == "wrong":
        assert r.accepted == 0
    else:
        assert r.accepted > 0 and r.fed / r.forwards > 1


@pytest.mark.parametrize("scripted", [True, False])
@pytest.mark.parametrize("where", ["window_and_ratio4", "ratio128"])
def test_mtp_greedy_output_and_state_equal_plain(mtp_engine, where, scripted):
    """The random tiny MTP head drafting: unscripted greedy decoding (its drafts are
    almost always wrong), and a target scripted to follow the head's own first drafts
    (each verify accepts one, rejects the chained ones), across the window wrap and
    ratio-4 blocks or the first ratio-128 block's end."""
    engine = mtp_engine
    if where == "ratio128":
        prompt, n = _long_prompt(engine, 120), 14
    else:
        prompt, n = engine.tokenizer.encode(PROMPT), 30
    script = drafted_continuation(engine, prompt, n) if scripted else None
    spec = TurnSpec(GREEDY, n, parse=False, ignore_eos=True, pipeline=False)
    plain = _run(engine, spec, prompt, script=script)
    got = _run(engine, spec, prompt, script=script, mode="mtp")
    _assert_same_state(plain, got)
    r = got[0]
    assert r.drafted > 0
    if scripted:
        assert r.accepted >= n // 3 and r.fed / r.forwards > 1


def test_auto_copies_repeated_text_before_asking_the_head(mtp_engine):
    """``--speculative auto`` on a checkpoint with an MTP head: where the reply repeats
    the prompt (a 3-token match), prompt lookup drafts and its copies are accepted; the
    output and state equal plain greedy. (The head always had a draft, so lookup was
    never asked: ``auto`` accepted what the random head guessed, about nothing.)"""
    engine = mtp_engine
    tok = engine.tokenizer
    words = tok.encode(" one two three four five six seven eight nine ten eleven twelve")
    prompt = tok.encode(PROMPT.replace("hello there", "say" + tok.decode(words)))
    spec = TurnSpec(GREEDY, len(words), parse=False, ignore_eos=True, pipeline=False)
    plain = _run(engine, spec, prompt, script=list(words))
    got = _run(engine, spec, prompt, script=list(words), mode="auto")
    _assert_same_state(plain, got)
    r = got[0]
    assert r.accepted >= len(words) // 2 and r.fed / r.forwards > 1.5, (r.accepted, r.forwards)


def _scripted_case(engine, case):
    tok = engine.tokenizer
    words = tok.encode(" one two three four five six seven eight nine ten")
    # The prompt quotes the words: the lookup drafter copies them.
    prompt, eng = (
        tok.encode(
            PROMPT.replace("hello there", "say one two three four five six seven eight nine ten")
        ),
        engine,
    )
    kw: dict = {"max_tokens": 40, "parse": True}
    script, cancel_after = list(words), None
    if case == "eos":
        script = words[:6] + [tok.eos_id]
    elif case == "stop_straddles":
        kw["stops"] = ("ee fou",)  # "three" + " four": across accepted tokens
    elif case == "max_tokens_in_run":
        kw["max_tokens"] = 6
    elif case == "cancel":
        cancel_after = 5
    elif case == "full_context":
        eng = Engine.load(engine.path, ctx_size=len(prompt) + 7, speculative="mtp")
    elif case == "tool_call":
        call = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="command" string="true">ls -la</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
        script = tok.encode("Let me look." + call) + [tok.eos_id]
        prompt = tok.encode(PROMPT.replace("hello there", "run" + call))
        kw["tools"], kw["max_tokens"] = (TOOL,), 200
    return eng, prompt, script, cancel_after, TurnSpec(GREEDY, pipeline=False, **kw)


@pytest.mark.parametrize("drafter", ["oracle", "lookup", "mtp"])
@pytest.mark.parametrize(
    "case",
    ["eos", "stop_straddles", "max_tokens_in_run", "cancel", "full_context", "tool_call"],
)
def test_every_way_a_turn_ends_leaves_the_plain_state(
    engine, mtp_engine, plain_turns, case, drafter
):
    """Scripted turns (the script is the target's choice, the oracle drafts it, every
    third verify with one wrong draft): each ending — EOS, a stop string across accepted
    tokens, ``max_tokens`` inside an accepted run, cancel, a full context, a DSML tool
    call (tool memory too) — gives the plain loop's result and state. (The oracle and
    lookup cases of one ending share their engine and plain turn.)"""
    base = mtp_engine if drafter == "mtp" else engine
    key = ("scripted", case, drafter == "mtp")
    if key not in plain_turns:
        eng, prompt, script, cancel_after, spec = _scripted_case(base, case)
        plain = _run(eng, spec, prompt, script=script, cancel_after=cancel_after)
        plain_turns[key] = (eng, prompt, script, cancel_after, spec), plain
    (eng, prompt, script, cancel_after, spec), plain = plain_turns[key]
    hooks, mode = (Oracle(script, 3), "off") if drafter == "oracle" else (None, drafter)
    got = _run(eng, spec, prompt, script=script, cancel_after=cancel_after, hooks=hooks, mode=mode)
    _assert_same_state(plain, got)
    # The random MTP head seldom drafts the scripted words: drafted, maybe not accepted.
    assert got[0].drafted > 0 and (got[0].accepted > 0 or drafter == "mtp")
    if case == "tool_call":
        (call,) = got[0].tool_calls
        assert call.arguments == {"command": "ls -la"} and got[0].call_errors == {}
        assert got[2].get(call.id) == call.dsml == plain[0].tool_calls[0].dsml
    expected = {
        "eos": "stop",
        "stop_straddles": "stop_sequence",
        "max_tokens_in_run": "length",
        "cancel": "cancelled",
        "full_context": "context",
        "tool_call": "stop",
    }
    assert got[0].finish == expected[case]


# A bounded schema (tests/grammar_cases.py) the random model can finish greedily.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("drafter", ["oracle", "lookup"])
def test_constrained_turn_drafts_and_equals_plain(engine, drafter):
    """A turn under a JSON-schema grammar drafts: each verify row is masked by the
    matcher advanced through the accepted tokens before it, so a draft the grammar
    forbids is never accepted (the oracle's corrupted drafts), and greedy output and
    state equal the plain constrained turn's. Oracle: unscripted greedy under the mask;
    lookup: a scripted reply inside the grammar that the prompt quotes."""
    tok = engine.tokenizer
    g = json_grammar(PERSON, ll_tokenizer(tok, 129280))
    spec = TurnSpec(GREEDY, 60, grammar=g, pipeline=False)
    reply = '{"name":"Ada","age":36}'
    if drafter == "oracle":
        prompt, script = tok.encode(PROMPT), None
        plain = _run(engine, spec, prompt)
        ref = plain[1].tokens[len(prompt) :] + [tok.eos_id]
        got = _run(engine, spec, prompt, hooks=Oracle(ref, 3))
    else:
        prompt = tok.encode(PROMPT.replace("hello there", f"say {reply} {reply}"))
        script = tok.encode(reply) + [tok.eos_id]
        plain = _run(engine, spec, prompt, script=script)
        got = _run(engine, spec, prompt, script=script, mode="lookup")
    _assert_same_state(plain, got)
    r = got[0]
    assert plain[0].drafted == 0 and r.drafted > 0 and r.accepted > 0
    assert r.grammar == plain[0].grammar == "complete", r.raw
    jsonschema.validate(json.loads(r.text), PERSON)
    if drafter == "lookup":
        assert r.text == reply


class Forbidden(TurnHooks):
    """Drafts a token no JSON reply allows (the BOS special token), ``k`` times."""

    def __init__(self, token: int, k: int = 4):
        self.token, self.k = token, k

    def draft(self, turn):
        return [self.token] * self.k


def test_drafts_the_grammar_forbids_are_not_verified(engine):
    """Drafts are cut before the first token the grammar forbids (`TurnHooks.admit`):
    a drafter proposing only forbidden tokens costs no verify row and no second
    forward (one forward per fed token), and the turn equals the plain one."""
    tok = engine.tokenizer
    g = json_grammar(PERSON, ll_tokenizer(tok, 129280))
    spec = TurnSpec(GREEDY, 30, grammar=g, pipeline=False)
    prompt = tok.encode(PROMPT)
    plain = _run(engine, spec, prompt)
    got = _run(engine, spec, prompt, hooks=Forbidden(tok.bos_id))
    _assert_same_state(plain, got)
    r = got[0]
    assert (r.drafted, r.accepted) == (0, 0)
    assert r.forwards == r.fed


# --------------------------------------------------------------------------- sampling


@pytest.mark.slow
def test_first_drafted_token_has_the_target_distribution(engine):
    """Temperature 1, the vocabulary masked to 16 ids after a fixed first token: the
    token decided by the acceptance rule (a deterministic draft of one of the 16)
    follows the target's masked distribution (chi-square goodness of fit), as plain
    sampling does."""
    from scipy.stats import chisquare

    tok = engine.tokenizer
    prompt = tok.encode(PROMPT)
    first = tok.encode("ok")[0]
    allowed = mx.array(list(range(1000, 1016)))
    ref = engine.new_session()
    ref.prefill([*prompt, first])
    scale = 2.0  # spread the tiny model's near-flat logits: the 16 ids differ

    class Masked(TurnHooks):
        def __init__(self, draft: bool):
            self.drafting = draft

        def mask(self, turn, logits):
            if turn.result.completion_tokens == 0:
                return mx.where(mx.arange(logits.shape[-1]) == first, 0.0, -mx.inf)
            keep = mx.zeros(logits.shape, dtype=mx.bool_).at[allowed].add(True)
            return mx.where(keep, logits * scale, -mx.inf)

        def draft(self, turn):
            return [1003] if self.drafting else []

    lp = ref.logits[allowed] * scale
    p = np.array(mx.softmax(lp).tolist(), dtype=np.float64)
    p /= p.sum()
    base = engine.new_session()
    base.prefill(prompt)
    snap = base.snapshot()
    n = 250
    counts = {}
    for draft in (True, False):
        hits = np.zeros(16)
        for i in range(n):
            s = engine.new_session()
            s.restore(snap)
            ids: list[int] = []
            spec = TurnSpec(SamplingParams(temperature=1.0, seed=i), 2, parse=False)
            r = run_turn(
                s, tok, spec, hooks=Masked(draft), emit=lambda ev, ids=ids: ids.extend(ev.tokens)
            )
            assert ids[0] == first and r.drafted == (1 if draft else 0)
            hits[ids[1] - 1000] += 1
        counts[draft] = hits
    for draft, hits in counts.items():
        pvalue = chisquare(hits, p * n).pvalue
        print(f"drafting={draft}: chi-square p-value {pvalue:.3f}")
        assert pvalue > 1e-3, (draft, hits, p * n)


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize("cmd", ["generate", "bench", "serve", "agent"])
@pytest.mark.parametrize("k", ["0", "17", "two"])
def test_draft_tokens_out_of_range_is_a_usage_error(cmd, k, capsys):
    from ds4mlx.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([cmd, "--draft-tokens", k])
    assert e.value.code == 2 and "--draft-tokens" in capsys.readouterr().err


def test_speculative_mtp_without_a_drafter_is_refused_at_start(tiny_f32_dir, capsys):
    from ds4mlx.cli import main

    rc = main(["generate", "-m", str(tiny_f32_dir), "-p", "hi", "--speculative", "mtp"])
    err = capsys.readouterr().err
    assert rc != 0 and "--speculative mtp" in err and "no MTP drafter" in err
    assert "num_nextn_predict_layers 0" in err


# --------------------------------------------------------------------------- server


def test_server_reports_drafts_and_a_live_continuation_prefills_only_the_suffix(
    tiny_model_dir, tmp_path_factory
):
    """``serve --speculative lookup``: a tool-call turn whose reasoning repeats itself
    is drafted (the per-request log line and ``/health`` count drafted / accepted and
    tokens per target forward); the tool-result continuation afterwards is live and
    prefills exactly the results suffix (the state holds only verified rows). The tool
    is strict: the call is generated under its grammar, which held (issue 24)."""
    from kv_server_util import (
        ASSISTANT,
        EOS,
        USER,
        anthropic_usage,
        count_tokens,
        invoke,
        post,
        script,
        tool_calls,
        traced_server,
    )

    read = {
        "name": "read",
        "description": "Read a file",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
        "strict": True,
    }
    extra = ["--kv-disk-dir", "none", "--speculative", "lookup", "--draft-tokens", "4"]
    with traced_server(tiny_model_dir, tmp_path_factory, ctx=4096, extra=extra) as server:
        reasoning = " ".join(["read the file a.txt first, then answer."] * 4)
        script(server, reasoning + "</think>" + tool_calls(invoke("read", ("path", "a.txt", None))))
        body = {
            "model": "deepseek-v4-flash",
            "max_tokens": 2000,
            "tools": [read],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "Read a.txt."}],
        }
        r1 = post(server, "/v1/messages", body)
        (use,) = [b for b in r1["content"] if b["type"] == "tool_use"]
        line = server.request_line(0)
        assert "drafted=" in line and "tokens/forward=" in line, line
        assert "grammar=complete" in line, line
        health = server.health()["speculative"]
        assert server.health()["distributed"] is None  # one process
        assert health["mode"] == "lookup" and health["draft_tokens"] == 4
        assert health["accepted"] > 0 and health["tokens_per_forward"] > 1.2, health
        p1, _ = anthropic_usage(r1)
        follow = body["messages"] + [
            {"role": "assistant", "content": r1["content"]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "R"}],
            },
        ]
        script(server, "", greedy=True)
        r2 = post(
            server,
            "/v1/messages",
            {**body, "messages": follow, "max_tokens": 8, "thinking": {"type": "enabled"}},
        )
        assert server.trace.last()["decision"] == "live-anthropic"
        p2, c2 = anthropic_usage(r2)
        assert c2 == p1 + r1["usage"]["output_tokens"] - 1
        suffix = EOS + USER + "<tool_result>R</tool_result>" + ASSISTANT + "<think>"
        assert p2 - c2 == count_tokens(server, suffix)
