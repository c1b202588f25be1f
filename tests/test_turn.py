"""The one turn loop (``ds4mlx.engine.turn``): the feeding rule on every way a turn ends,
forced tool calls, call errors, logprobs, cancellation — on the real tiny model.

The feeding rule: every sampled token is fed except the one that ends the turn; the
state after a turn equals a fresh prefill of the prompt plus the fed tokens.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4mlx.dsml import ToolCallEnd, ToolMemory, ToolSpec
from ds4mlx.engine import (
    Engine,
    RawText,
    SamplingParams,
    TokenLogprob,
    TurnSpec,
    run_turn,
)

GREEDY = SamplingParams(temperature=0)
PROMPT = "<｜begin▁of▁sentence｜><｜User｜>hello there<｜Assistant｜>"
TOOL = ToolSpec(
    "bash",
    "run a command",
    {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
)


@pytest.fixture(scope="module")
def engine(tiny_f32_dir):
    return Engine.load(tiny_f32_dir, ctx_size=512)


@pytest.fixture
def session(engine):
    s = engine.new_session()
    yield s
    s.reset()


def _ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def _assert_state_is_prompt_plus_fed(engine, s, prompt: list[int], fed: list[int]):
    """The session equals a fresh prefill of ``prompt + fed`` (tokens and logits)."""
    assert s.tokens == prompt + fed
    ref = engine.new_session()
    ref.prefill(prompt + fed)
    assert mx.allclose(s.logits, ref.logits, atol=1e-4).item()


def test_eos_ends_the_turn_unfed(engine, session):
    prompt = _ids(engine, PROMPT + "</think>")
    script = _ids(engine, "Hi!") + [engine.tokenizer.eos_id]
    res = run_turn(session, engine.tokenizer, TurnSpec(GREEDY, 50), prefill=prompt, script=script)
    assert res.finish == "stop" and res.completion_tokens == len(script)
    assert res.text == "Hi!" and res.fed == len(script) - 1
    _assert_state_is_prompt_plus_fed(engine, session, prompt, script[:-1])


def test_stop_string_token_is_not_fed(engine, session):
    prompt = _ids(engine, PROMPT + "</think>")
    script = _ids(engine, "one two three four")
    spec = TurnSpec(GREEDY, 50, stops=("three",))
    seen: list[str] = []
    res = run_turn(
        session,
        engine.tokenizer,
        spec,
        prefill=prompt,
        script=script,
        emit=lambda ev: seen.append(getattr(ev, "text", "")),
    )
    assert res.finish == "stop_sequence" and res.stop_sequence == "three"
    assert res.text == "one two " and "three" not in "".join(seen)
    # The token that completed the stop string was sampled, not fed.
    assert len(session.tokens) == len(prompt) + res.completion_tokens - 1


def test_length_and_cap_is_eos(engine, session):
    prompt = _ids(engine, PROMPT + "</think>")
    script = _ids(engine, "a b c d e f g h")
    res = run_turn(session, engine.tokenizer, TurnSpec(GREEDY, 4), prefill=prompt, script=script)
    assert res.finish == "length" and res.completion_tokens == 4 and res.fed == 3
    _assert_state_is_prompt_plus_fed(engine, session, prompt, script[:3])
    # --demo's cap ends the turn as if EOS came next: the last token is fed too.
    session.reset()
    spec = TurnSpec(GREEDY, 4, cap_is_eos=True)
    res = run_turn(session, engine.tokenizer, spec, prefill=prompt, script=script)
    assert res.finish == "stop" and res.fed == 4
    _assert_state_is_prompt_plus_fed(engine, session, prompt, script[:4])


def test_context_full(engine, tiny_f32_dir):
    small = Engine.load(tiny_f32_dir, ctx_size=24)
    s = small.session
    prompt = _ids(small, PROMPT + "</think>")
    spec = TurnSpec(GREEDY, 100, parse=False, ignore_eos=True)
    res = run_turn(s, small.tokenizer, spec, prefill=prompt)
    assert res.finish == "context" and len(s.tokens) == 24
    assert res.completion_tokens == 24 - len(prompt) + 1


def test_cancel_mid_decode_and_mid_prefill(engine, session):
    prompt = _ids(engine, PROMPT + "</think>")
    n = [0]

    def cancel() -> bool:
        return n[0] >= 3

    def count(_ev) -> None:
        n[0] += 1

    spec = TurnSpec(GREEDY, 50, parse=False, ignore_eos=True)
    res = run_turn(session, engine.tokenizer, spec, prefill=prompt, emit=count, cancel=cancel)
    assert res.finish == "cancelled" and res.fed == res.completion_tokens
    assert session.tokens[: len(prompt)] == prompt
    # Cancelled before the first prefill chunk: nothing sampled, nothing fed.
    session.reset()
    res = run_turn(
        session, engine.tokenizer, spec, prefill=prompt, cancel=lambda: True, chunk_size=4
    )
    assert res.finish == "cancelled" and res.prefilled == 0 and res.completion_tokens == 0


def test_tool_call_parsed_remembered_and_structure_greedy(engine, session):
    prompt = _ids(engine, PROMPT + "<think>")
    call = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
        '<｜DSML｜parameter name="command" string="true">ls -la</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    script = _ids(engine, "let me look</think>Sure." + call) + [engine.tokenizer.eos_id]
    memory = ToolMemory()
    ends: list[ToolCallEnd] = []
    spec = TurnSpec(GREEDY, 200, thinking=True, tools=(TOOL,))
    res = run_turn(
        session,
        engine.tokenizer,
        spec,
        prefill=prompt,
        script=script,
        tool_memory=memory,
        emit=lambda ev: ends.append(ev) if isinstance(ev, ToolCallEnd) else None,
    )
    assert res.finish == "stop" and res.reasoning == "let me look" and res.text == "Sure."
    assert [c.arguments for c in res.tool_calls] == [{"command": "ls -la"}]
    assert res.call_errors == {} and len(ends) == 1
    assert memory.get(res.tool_calls[0].id) == res.tool_calls[0].dsml
    assert res.reasoning_tokens == len(_ids(engine, "let me look")) + 1


def test_truncated_call_is_marked_not_runnable(engine, session):
    prompt = _ids(engine, PROMPT + "</think>")
    call = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
        '<｜DSML｜parameter name="command" string="true">rm -rf build'
    )
    script = _ids(engine, call)
    spec = TurnSpec(GREEDY, len(script) - 2, tools=(TOOL,))
    res = run_turn(session, engine.tokenizer, spec, prefill=prompt, script=script)
    # Cut by max_tokens: never presented as runnable; the decoder still saw it.
    assert res.finish == "length" and res.tool_calls == []
    (cut,) = res.decoded.tool_calls
    assert cut.id in res.call_errors and "truncated" in res.call_errors[cut.id]


def test_forced_tool_call_opens_the_block(engine, session):
    prompt = _ids(engine, PROMPT + "</think>")
    body = (
        '<｜DSML｜parameter name="command" string="true">pwd</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    script = _ids(engine, body) + [engine.tokenizer.eos_id]
    spec = TurnSpec(GREEDY, 200, tools=(TOOL,), tool_required=True, tool_name="bash")
    res = run_turn(session, engine.tokenizer, spec, prefill=prompt, script=script)
    assert [(c.name, c.arguments) for c in res.tool_calls] == [("bash", {"command": "pwd"})]
    assert res.raw.startswith('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n')


def test_raw_logprobs_one_per_token(engine, session):
    prompt = _ids(engine, PROMPT + "</think>")
    pieces: list[RawText] = []
    spec = TurnSpec(GREEDY, 6, parse=False, logprobs=3, ignore_eos=True)
    res = run_turn(session, engine.tokenizer, spec, prefill=prompt, emit=pieces.append)
    tokens = [t for p in pieces for t in p.tokens]
    lps = [lp for p in pieces for lp in p.logprobs]
    assert len(tokens) == res.completion_tokens == 6 and len(lps) == 6
    for t, lp in zip(tokens, lps, strict=True):
        # Greedy: the sampled token is the most likely one.
        assert isinstance(lp, TokenLogprob) and lp.token == t and len(lp.top) == 3
        assert lp.top[0][0] == t and lp.logprob == pytest.approx(lp.top[0][1])


# --------------------------------------------------------------------------- pipelining


def _one_run(session, tokenizer, spec, prompt, script, cancel_after):
    n = [0]
    seen: list[tuple[int, bytes]] = []

    def cancel() -> bool:
        return cancel_after is not None and n[0] >= cancel_after

    def saw(sess) -> None:  # a disk save's view: the state right after a fed token
        n[0] += 1
        snap = sess.snapshot()
        seen.append((len(sess.tokens), bytes(memoryview(snap.arrays["logits"]))))

    res = run_turn(
        session, tokenizer, spec, prefill=prompt, script=script, cancel=cancel, after_token=saw
    )
    return res, (list(session.tokens), session.snapshot().arrays), seen


def _run_both(engine, make_spec, prompt, *, script=None, cancel_after=None, ctx=None):
    """The same turn pipelined and synchronous, each on a fresh session: the results,
    end states (tokens, arrays), and the states every ``after_token`` call saw."""
    eng = ctx or engine
    return [
        _one_run(eng.new_session(), eng.tokenizer, make_spec(p), prompt, script, cancel_after)
        for p in (True, False)
    ]


def _assert_same(both):
    (r1, (t1, a1), seen1), (r2, (t2, a2), seen2) = both
    assert (r1.finish, r1.completion_tokens, r1.fed, r1.text) == (
        r2.finish,
        r2.completion_tokens,
        r2.fed,
        r2.text,
    )
    assert t1 == t2 and sorted(a1) == sorted(a2)
    for k in a1:
        assert mx.array_equal(a1[k], a2[k]).item(), k
    assert seen1 == seen2


@pytest.mark.parametrize(
    "case", ["eos", "stop_string", "length", "length_on_block_end", "cap", "cancel"]
)
def test_pipelined_decode_leaves_the_synchronous_state(engine, case):
    """Issue 9, must-hold 3: whatever ends the turn, the pipelined loop leaves tokens,
    logits and every cache tensor exactly as the synchronous one (an abandoned step
    is never evaluated), and per-token saves see the same states."""
    tok = engine.tokenizer
    prompt = _ids(engine, PROMPT + "</think>")
    words = _ids(engine, "one two three four five six seven eight nine ten eleven twelve")
    script, cancel_after = words, None
    max_tokens, stops, cap = 10, (), False
    if case == "eos":
        script = words[:5] + [tok.eos_id]
    elif case == "stop_string":
        stops = ("five",)
    elif case == "length_on_block_end":
        # The last fed token completes a ratio-4 block (and its indexer row).
        max_tokens = 4 - (len(prompt) % 4) + 4 + 1
    elif case == "cap":
        cap = True
    elif case == "cancel":
        cancel_after = 3

    def spec(pipeline: bool) -> TurnSpec:
        return TurnSpec(GREEDY, max_tokens, stops=stops, cap_is_eos=cap, pipeline=pipeline)

    both = _run_both(engine, spec, prompt, script=script, cancel_after=cancel_after)
    _assert_same(both)
    expected = {"eos": "stop", "stop_string": "stop_sequence", "cap": "stop", "cancel": "cancelled"}
    assert both[0][0].finish == expected.get(case, "length")
    if case == "length_on_block_end":
        assert len(both[0][1][0]) % 4 == 0


def test_pipelined_decode_at_a_full_context(tiny_f32_dir, engine):
    small = Engine.load(tiny_f32_dir, ctx_size=24)
    prompt = _ids(small, PROMPT + "</think>")

    def spec(pipeline: bool) -> TurnSpec:
        return TurnSpec(GREEDY, 100, parse=False, ignore_eos=True, pipeline=pipeline)

    both = _run_both(engine, spec, prompt, ctx=small)
    _assert_same(both)
    assert both[0][0].finish == "context" and len(both[0][1][0]) == 24


# --------------------------------------------------------------------------- hooks


def test_hooks_poll_mask_draft_and_force_feed(engine, session):
    """The loop's extension points (``TurnHooks``): a per-step poll ends the turn with
    its reason, a logits mask decides what is sampled, drafts are verified against the
    sampled tokens, and ``force_feed`` at the end feeds tokens as if sampled."""
    from ds4mlx.engine import TurnHooks

    tok = engine.tokenizer
    prompt = _ids(engine, PROMPT + "<think>")
    target = _ids(engine, "ok")[0]
    vocab = tok.vocab_size
    seen = {"prefill": 0, "steps": 0}

    class Hooks(TurnHooks):
        def after_prefill(self, turn):
            seen["prefill"] = turn.result.prefilled

        def before_step(self, turn):
            seen["steps"] += 1
            return "steered" if turn.result.completion_tokens >= 3 else None

        def mask(self, turn, logits):
            # Only ``target`` may be sampled (whatever the model prefers).
            return mx.where(mx.arange(logits.shape[-1]) == target, 0.0, -mx.inf)

        def draft(self, turn):
            return [target, target + 1]  # the second one is always wrong

        def at_end(self, turn):
            # A cut reasoning block is closed, as the agent does.
            if turn.in_thinking:
                turn.force_feed([tok.think_end_id])

    spec = TurnSpec(SamplingParams(temperature=1.0), 50, thinking=True)
    res = run_turn(session, tok, spec, prefill=prompt, hooks=Hooks())
    assert seen["prefill"] == len(prompt) and seen["steps"] == 4
    assert res.finish == "steered" and res.completion_tokens == 3
    assert res.drafted >= 2 and 1 <= res.accepted < res.drafted
    # The sampled tokens, then the forced ``</think>`` (fed, counted apart).
    assert res.forced == 1 and res.fed == 4
    assert session.tokens == prompt + [target] * 3 + [tok.think_end_id]
    assert res.raw.endswith("</think>") and vocab > target
    _assert_state_is_prompt_plus_fed(engine, session, prompt, [target] * 3 + [tok.think_end_id])


def test_force_feed_at_a_full_context_feeds_what_fits(tiny_f32_dir):
    """After the loop, a forced feed never overflows: without room nothing is fed."""
    from ds4mlx.engine import TurnHooks

    small = Engine.load(tiny_f32_dir, ctx_size=24)
    tok = small.tokenizer
    fed = []

    class Close(TurnHooks):
        def at_end(self, turn):
            fed.append(turn.force_feed([tok.think_end_id]))

    spec = TurnSpec(GREEDY, 100, parse=False, ignore_eos=True)
    res = run_turn(small.session, tok, spec, prefill=_ids(small, PROMPT + "<think>"), hooks=Close())
    assert res.finish == "context" and fed == [0] and res.forced == 0
    assert len(small.session.tokens) == 24


@pytest.mark.parametrize("in_reasoning", [False, True])
def test_one_call_when_parallel_calls_are_off(engine, session, in_reasoning):
    """``parallel_calls`` False: the model writes two invokes (after ``</think>``, or in a
    block opened inside its reasoning); the turn ends after the first one, the block
    closed and EOS forced: one call, and the state holds exactly that one-call turn."""
    inv = '<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="command" string="true">{}</｜DSML｜parameter>\n</｜DSML｜invoke>'
    head = "\n\n<｜DSML｜tool_calls>\n" + inv.format("ls")
    two = head + "\n" + inv.format("pwd") + "\n</｜DSML｜tool_calls>"
    reasoning = "Let me look." + ("" if in_reasoning else "</think>")
    prompt = _ids(engine, PROMPT + "<think>")
    spec = TurnSpec(GREEDY, 200, thinking=True, tools=(TOOL,), parallel_calls=False)
    script = _ids(engine, reasoning + two)
    res = run_turn(session, engine.tokenizer, spec, prefill=prompt, script=script)
    assert [c.arguments for c in res.tool_calls] == [{"command": "ls"}]
    assert res.finish == "stop" and res.call_errors == {}
    one = reasoning + head + "\n</｜DSML｜tool_calls>"
    assert res.raw == one
    assert engine.tokenizer.decode(session.tokens[len(prompt) :]) == one


# --------------------------------------------------------------------------- steering

TWO_CALLS = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls</｜DSML｜parameter>\n'
    '</｜DSML｜invoke>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">pwd</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def _steered_turn(engine, session, prompt_text: str, script_text: str, when, **kw):
    """Run a scripted turn under `Steering` whose poll holds once ``when(seen)`` does
    (``seen``: the events so far; ``kw``: TurnSpec fields, ``cancel``)."""
    from ds4mlx.engine import Steering

    tok = engine.tokenizer
    prompt = _ids(engine, prompt_text)
    script = _ids(engine, script_text) + [tok.eos_id]
    seen: list = []
    cancel = kw.pop("cancel", None)
    hooks = Steering(lambda: when(seen), close_cancelled=True)
    spec = TurnSpec(GREEDY, kw.pop("max_tokens", 300), tools=(TOOL,), **kw)
    memory = ToolMemory()
    res = run_turn(
        session,
        tok,
        spec,
        prefill=prompt,
        script=script,
        emit=seen.append,
        tool_memory=memory,
        hooks=hooks,
        cancel=cancel and (lambda: cancel(seen)),
    )
    return res, prompt, hooks, memory


def _ends_at_rendered_turn(engine, session, prompt, res, memory, thinking: bool) -> None:
    """The live state is the prompt plus this turn as the renderer writes it (no EOS):
    the next rendered turn's suffix starts right here."""
    from ds4mlx.dsml import Message, render_assistant_turn

    msg = Message(
        "assistant",
        content=res.text,
        reasoning=res.reasoning if thinking else None,
        tool_calls=list(res.tool_calls),
    )
    turn = render_assistant_turn(msg, thinking=thinking, tool_memory=memory, eos=False)
    assert engine.tokenizer.decode(session.tokens[len(prompt) :]) == turn
    _assert_state_is_prompt_plus_fed(engine, session, prompt, session.tokens[len(prompt) :])


def _text_of(seen, kind) -> str:
    return "".join(e.text for e in seen if isinstance(e, kind))


def test_steer_during_reasoning_closes_it_at_the_next_token(engine, session):
    from ds4mlx.dsml import ThinkingDelta

    res, prompt, hooks, memory = _steered_turn(
        engine,
        session,
        PROMPT + "<think>",
        "let me look at the files first</think>Sure.",
        lambda seen: "let me" in _text_of(seen, ThinkingDelta),
        thinking=True,
    )
    assert res.finish == "steered" and res.reasoning.startswith("let me")
    assert "files" not in res.reasoning and res.text == "" and res.tool_calls == []
    # Closed as a cancelled turn is: ``</think>`` fed (one forced token), not sampled.
    assert res.forced == 1 and res.raw.endswith("</think>") and not hooks.cut_in_block
    _ends_at_rendered_turn(engine, session, prompt, res, memory, thinking=True)


def test_steer_during_text_stops_at_the_next_token(engine, session):
    from ds4mlx.dsml import TextDelta

    res, prompt, hooks, memory = _steered_turn(
        engine,
        session,
        PROMPT + "<think>",
        "hmm</think>Sure, I will write it in Python now.",
        lambda seen: "Sure" in _text_of(seen, TextDelta),
        thinking=True,
    )
    assert res.finish == "steered" and res.reasoning == "hmm" and res.forced == 0
    assert res.text.startswith("Sure") and "Python" not in res.text
    _ends_at_rendered_turn(engine, session, prompt, res, memory, thinking=True)


def test_steer_inside_a_block_waits_for_its_close(engine, session):
    """Steered at the first ``｜DSML｜`` token (the opener still held back): the turn runs
    on to ``</｜DSML｜tool_calls>`` (both calls complete, runnable) and stops before the
    EOS would be sampled."""
    from ds4mlx.dsml import ToolCallStart

    tok = engine.tokenizer
    first_marker = [False]

    def when(seen) -> bool:
        return first_marker[0]

    script_text = "Sure." + TWO_CALLS
    prompt = _ids(engine, PROMPT + "</think>")
    script = _ids(engine, script_text)
    from ds4mlx.engine import Steering

    seen: list = []
    memory = ToolMemory()

    def after_token(s) -> None:
        first_marker[0] = first_marker[0] or s.tokens[-1] == tok.dsml_id

    res = run_turn(
        session,
        tok,
        TurnSpec(GREEDY, 300, tools=(TOOL,)),
        prefill=prompt,
        script=script + [tok.eos_id],
        emit=seen.append,
        tool_memory=memory,
        after_token=after_token,
        hooks=Steering(lambda: when(seen)),
    )
    assert res.finish == "steered" and res.text == "Sure."
    assert [c.arguments for c in res.tool_calls] == [{"command": "ls"}, {"command": "pwd"}]
    assert res.call_errors == {} and sum(isinstance(e, ToolCallStart) for e in seen) == 2
    # Every scripted token but the EOS: the state ends where EOS would have ended it.
    assert res.completion_tokens == len(script) and res.raw.endswith("</｜DSML｜tool_calls>")
    _ends_at_rendered_turn(engine, session, prompt, res, memory, thinking=False)


def test_steer_then_max_tokens_or_cancel_cuts_the_block_stays_text(engine, session):
    """A block that ``max_tokens`` or a cancel cuts while a steer waits for its close is
    never a call (it stays text in the live state; `Steering.cut_in_block`)."""
    from ds4mlx.dsml import ToolCallStart

    def started(seen) -> bool:
        return any(isinstance(e, ToolCallStart) for e in seen)

    n_open = len(_ids(engine, "Sure." + TWO_CALLS.split("</｜DSML｜invoke>")[0]))
    res, _, hooks, _ = _steered_turn(
        engine, session, PROMPT + "</think>", "Sure." + TWO_CALLS, started, max_tokens=n_open
    )
    assert res.finish == "length" and res.tool_calls == [] and hooks.cut_in_block
    session.reset()
    res, _, hooks, _ = _steered_turn(
        engine, session, PROMPT + "</think>", "Sure." + TWO_CALLS, started, cancel=started
    )
    assert res.finish == "cancelled" and res.tool_calls == [] and hooks.cut_in_block


def test_hooks_compose_single_call_steering_and_a_mask(engine, session):
    """Several features in one turn (`chain_hooks`): with ``parallel_calls`` False the
    single-call limit runs before the caller's hooks, and every hook of the chain is
    called: a steer that never fires, a mask that bans a token, a recorder of the end.
    The turn ends after the first call, closed as a one-call block."""
    from ds4mlx.engine import Steering, TurnHooks

    tok = engine.tokenizer
    banned = tok.encode("zzz")[0]
    calls: list[str] = []

    class Record(TurnHooks):
        def mask(self, turn, logits):
            calls.append("mask")
            return mx.where(mx.arange(logits.shape[0]) == banned, -mx.inf, logits)

        def at_end(self, turn):
            calls.append("end")

    prompt = _ids(engine, PROMPT + "</think>")
    res = run_turn(
        session,
        tok,
        TurnSpec(GREEDY, 300, tools=(TOOL,), parallel_calls=False),
        prefill=prompt,
        script=_ids(engine, "Sure." + TWO_CALLS) + [tok.eos_id],
        tool_memory=ToolMemory(),
        hooks=[Steering(lambda: False), Record()],
    )
    assert [c.arguments for c in res.tool_calls] == [{"command": "ls"}]
    assert res.finish == "tool_calls" or res.raw.rstrip().endswith("</｜DSML｜tool_calls>")
    assert "</｜DSML｜invoke>" in res.raw and res.raw.count("<｜DSML｜invoke") == 1
    assert calls[-1] == "end" and "mask" in calls


def _greedy_raw_turns(engine):
    """``(prompt ids, turn)``: ``turn(hooks=None)`` runs a 24-token greedy raw turn after
    the prompt on a new session and returns the tokens it fed."""
    prompt = _ids(engine, PROMPT + "</think>")
    spec = TurnSpec(GREEDY, 24, parse=False)

    def turn(hooks=None) -> list[int]:
        s = engine.new_session()
        run_turn(s, engine.tokenizer, spec, prefill=prompt, hooks=hooks)
        return list(s.tokens[len(prompt) :])

    return prompt, turn


def test_the_repetition_penalty_follows_ctrls_rule_over_the_whole_context(engine, session):
    """`RepetitionPenalty` (vLLM's ``repetition_penalty``), replayed step by step: each
    greedy token of a raw turn is the argmax of the step's logits with every token of the
    context so far (prompt and reply) divided by the penalty where positive, multiplied
    where not (CTRL's rule, computed here in numpy from the tokens alone); below 1 the
    greedy turn, whose tokens are all distinct, repeats."""
    import numpy as np

    from ds4mlx.engine.bias import RepetitionPenalty

    prompt, turn = _greedy_raw_turns(engine)
    plain = turn()
    assert len(set(plain)) == len(plain)
    for penalty in (1.8, 0.3):
        penalized = turn(RepetitionPenalty(penalty))
        if penalty < 1:  # above 1 only tokens already there lose; these were new
            assert len(set(penalized)) < len(penalized), penalized
        ref = engine.new_session()
        ref.prefill(prompt)
        for t in penalized:
            logits = np.array(ref.logits, dtype=np.float64)
            seen = np.array(sorted(set(ref.tokens)))
            logits[seen] = np.where(
                logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty
            )
            assert int(np.argmax(logits)) == t
            ref.decode(t)


def test_presence_and_frequency_penalties_follow_openais_formula(engine, session):
    """`Penalties` (OpenAI's ``presence_penalty``/``frequency_penalty``): replayed step by
    step, each greedy token of a raw turn is the argmax of the step's logits less
    ``count * frequency + presence`` on every token produced so far (OpenAI's formula,
    computed here in numpy from the tokens alone), for penalties and for negative ones
    (which favour repetition: the greedy turn, whose tokens are all distinct, then
    repeats)."""
    import numpy as np

    from ds4mlx.engine.bias import Penalties

    prompt, turn = _greedy_raw_turns(engine)
    plain = turn()
    assert len(set(plain)) == len(plain)
    for presence, frequency in ((1.5, 0.75), (-2.0, -2.0)):
        penalized = turn(Penalties(presence, frequency))
        if presence < 0:
            assert len(set(penalized)) < len(penalized), penalized
        ref = engine.new_session()
        ref.prefill(prompt)
        counts: dict[int, int] = {}
        for t in penalized:
            logits = np.array(ref.logits, dtype=np.float64)
            for tid, n in counts.items():
                logits[tid] -= n * frequency + presence
            assert int(np.argmax(logits)) == t
            counts[t] = counts.get(t, 0) + 1
            ref.decode(t)
