"""Anthropic's ``thinking.budget_tokens``: the reasoning ends after that many tokens
(``ds4mlx.engine.thinking_budget``), ``</think>`` fed as if sampled, and the live state
is the turn as a replay renders it."""

from __future__ import annotations

import pytest
from server_util import HTTP

from ds4mlx.dsml import Message, render_assistant_turn
from ds4mlx.engine import Engine, SamplingParams, TurnSpec, run_turn

GREEDY = SamplingParams(temperature=0)
PROMPT = "<｜begin▁of▁sentence｜><｜User｜>hello there<｜Assistant｜><think>"


@pytest.fixture(scope="module")
def engine(tiny_f32_dir):
    return Engine.load(tiny_f32_dir, ctx_size=512)


def _turn(engine, script_text: str, budget: int | None):
    tok = engine.tokenizer
    s = engine.new_session()
    prompt = tok.encode(PROMPT)
    script = tok.encode(script_text) + [tok.eos_id]
    spec = TurnSpec(GREEDY, 100, thinking=True, thinking_budget=budget)
    return s, prompt, run_turn(s, tok, spec, prefill=prompt, script=script)


def test_the_reasoning_ends_at_the_budget_and_the_reply_follows(engine):
    tok = engine.tokenizer
    reasoning = "one two three four"
    budget = len(tok.encode(reasoning))
    s, prompt, res = _turn(engine, reasoning + "Done.", budget)
    assert res.reasoning == reasoning and res.text == "Done." and res.finish == "stop"
    # The budget's tokens, then the forced </think> (counted as reasoning, as a sampled
    # one is).
    assert res.reasoning_tokens == budget + 1
    # The state is the prompt plus this turn as the renderer writes it: a replay of the
    # turn continues it exactly.
    msg = Message("assistant", content=res.text, reasoning=res.reasoning)
    assert tok.decode(s.tokens[len(prompt) :]) == render_assistant_turn(
        msg, thinking=True, eos=False
    )


def test_without_a_budget_or_within_it_the_model_ends_its_reasoning(engine):
    _, _, res = _turn(engine, "one two three four" + "Done.", None)
    assert res.reasoning == "one two three fourDone." and res.text == ""
    _, _, res = _turn(engine, "short</think>Done.", 50)
    assert res.reasoning == "short" and res.text == "Done."


def test_a_budget_never_cuts_a_call_opened_in_the_reasoning(engine):
    """A tool-call block the model opened inside its reasoning closes first (cut, it
    would be unparseable markup): the budget is met once its ``｜DSML｜`` token is in,
    and the block's close ends the reasoning as ever."""
    from ds4mlx.dsml import ToolSpec

    tool = ToolSpec(
        "bash", "run", {"type": "object", "properties": {"command": {"type": "string"}}}
    )
    call = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
        '<｜DSML｜parameter name="command" string="true">ls -la</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    tok = engine.tokenizer
    s = engine.new_session()
    script = tok.encode("Look." + call) + [tok.eos_id]
    budget = len(tok.encode("Look.\n\n<｜DSML｜"))
    spec = TurnSpec(GREEDY, 100, thinking=True, tools=(tool,), thinking_budget=budget)
    res = run_turn(s, tok, spec, prefill=tok.encode(PROMPT), script=script)
    assert [c.arguments for c in res.tool_calls] == [{"command": "ls -la"}]
    assert res.call_errors == {} and res.finish == "stop"


@pytest.mark.slow
def test_budget_tokens_caps_an_anthropic_reply(server_factory, tiny_model_dir):
    """Over HTTP: Anthropic's floor is 1024 tokens, so the reasoning is 1024 scripted
    tokens and the reply the script's rest."""
    srv = server_factory(tiny_model_dir, ctx=2048)
    srv.script("x " * 1100)
    r = HTTP.post(
        srv.url + "/v1/messages",
        json={
            "model": "deepseek-v4-flash",
            "max_tokens": 1040,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "think"}],
        },
        timeout=600,
    )
    assert r.status_code == 200, r.text
    blocks = {b["type"]: b for b in r.json()["content"]}
    thinking, text = blocks["thinking"]["thinking"], blocks["text"]["text"]
    assert thinking.count("x") == 1024 and 0 < text.count("x") < 1040 - 1024
    assert (thinking + text).replace(" ", "") == "x" * (thinking + text).count("x")


def test_budget_tokens_caps_a_chat_reply_too(server_factory, tiny_model_dir):
    """The same field sent through chat (DeepSeek's ``thinking`` object with Anthropic's
    ``budget_tokens``, as some clients send it) caps the reasoning there too (it was
    accepted and ignored); it has no 1024 floor, and a budget that is not a positive
    integer is a 400 naming it."""
    srv = server_factory(tiny_model_dir, ctx=2048)
    url = srv.url + "/v1/chat/completions"
    body = {
        "model": "deepseek-v4-flash",
        "max_tokens": 30,
        "messages": [{"role": "user", "content": "think"}],
    }
    srv.script("x " * 40)
    r = HTTP.post(url, json={**body, "thinking": {"type": "enabled", "budget_tokens": 8}})
    assert r.status_code == 200, r.text
    d = r.json()
    msg = d["choices"][0]["message"]
    assert msg["reasoning_content"].count("x") == 8, msg
    assert d["usage"]["completion_tokens_details"]["reasoning_tokens"] == 9, d["usage"]
    assert "x" in msg["content"], msg
    for bad in (0, "8", 1.5, True):
        th = {"type": "enabled", "budget_tokens": bad}
        r = HTTP.post(url, json={**body, "thinking": th})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "thinking.budget_tokens", r.text
