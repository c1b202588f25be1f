"""Streaming decoder: render -> parse round trips, split invariance, malformed DSML,
structure/payload state (issue 3, must-hold 2, 3, 5)."""

from __future__ import annotations

import json
import os

import pytest
from dsml_cases import CASES, TOOLS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4mlx.dsml import (
    Message,
    ParseError,
    StreamDecoder,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    render_assistant_turn,
    render_invoke,
)
from ds4mlx.dsml.tokens import EOS, PARAM_CLOSE, THINK_END, TOOL_CALLS_OPEN

# DS4MLX_HYPOTHESIS_EXAMPLES raises the example count for a long local soak.
FAST = settings(
    max_examples=int(os.environ.get("DS4MLX_HYPOTHESIS_EXAMPLES", "120")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# ------------------------------------------------------------------ helpers


def run(text_pieces, *, thinking, tools=TOOLS):
    """Feed pieces, finish; return (decoder, events). Fails if anything raises."""
    dec = StreamDecoder(thinking, tools)
    events = []
    for piece in text_pieces:
        events += dec.feed(piece)
    events += dec.finish()
    return dec, events


def normalized(dec, events):
    """Result and event stream with random ids removed and adjacent deltas merged."""
    res = dec.result
    calls = [(c.name, c.arguments, c.dsml) for c in res.tool_calls]
    merged = []
    for e in events:
        if isinstance(e, ToolCallStart):
            key = ("start", e.index, e.name)
        elif isinstance(e, ToolCallEnd):
            key = ("end", e.index, e.call.name, e.arguments_json, e.error)
        elif isinstance(e, ToolCallArgsDelta):
            key = ("args", e.index, e.text)
        elif isinstance(e, ThinkingDelta):
            key = ("think", None, e.text)
        elif isinstance(e, TextDelta):
            key = ("text", None, e.text)
        else:
            key = ("error", None, e.message)
        if merged and key[0] in ("args", "think", "text") and merged[-1][:2] == key[:2]:
            merged[-1] = (key[0], key[1], merged[-1][2] + key[2])
        else:
            merged.append(key)
    return (res.reasoning, res.content, calls, res.errors, res.ended), merged


def check_stream_consistency(events):
    """Starts/ends pair up, a closed call's args deltas parse to its final arguments (a cut
    call's never do), text is never split."""
    starts, ends, args = {}, {}, {}
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index not in starts
            starts[e.index] = e
            args[e.index] = ""
        elif isinstance(e, ToolCallArgsDelta):
            assert e.index in starts and e.index not in ends
            args[e.index] += e.text
        elif isinstance(e, ToolCallEnd):
            assert e.index in starts and e.index not in ends
            ends[e.index] = e
            assert e.call.id == starts[e.index].id
            if e.closed:
                assert json.loads(args[e.index]) == e.call.arguments
            else:
                # Cut by the end of the turn (hardening item 2): what was streamed stays
                # unterminated and never parses as the cut-off arguments.
                assert e.error and "truncated" in e.error
                with pytest.raises(ValueError):
                    json.loads(args[e.index])
            assert json.loads(e.arguments_json) == e.call.arguments
            assert list(json.loads(e.arguments_json)) == list(e.call.arguments)
        elif isinstance(e, (TextDelta, ThinkingDelta)):
            assert e.text and not ("\ud800" <= e.text[-1] <= "\udbff")
    assert set(starts) == set(ends)


def roundtrippable(msg: Message, thinking: bool) -> bool:
    """Texts the format cannot carry unambiguously (same limits as DeepSeek's parser)."""
    if thinking and msg.reasoning and (THINK_END in msg.reasoning or EOS in msg.reasoning):
        return False
    if thinking and msg.reasoning and TOOL_CALLS_OPEN in msg.reasoning:
        return False  # a complete block there is recovered as a call (issue 13 item 3)
    if TOOL_CALLS_OPEN in msg.content or EOS in msg.content:
        return False
    for c in msg.tool_calls:
        for v in c.arguments.values():
            if isinstance(v, str) and PARAM_CLOSE in v:
                return False
    return True


def schema_order(name, args):
    props = next((list(t.parameters.get("properties", {})) for t in TOOLS if t.name == name), [])
    return [k for k in props if k in args] + [k for k in args if k not in props]


def check_roundtrip(msg: Message, thinking: bool, pieces=None):
    text = render_assistant_turn(msg, thinking=thinking)
    dec, events = run(pieces if pieces is not None else [text], thinking=thinking)
    res = dec.result
    assert res.errors == []
    assert res.ended
    assert res.reasoning == ((msg.reasoning or "") if thinking else "")
    assert res.content == msg.content
    assert [c.name for c in res.tool_calls] == [c.name for c in msg.tool_calls]
    for got, want in zip(res.tool_calls, msg.tool_calls, strict=True):
        assert got.arguments == want.arguments
        assert list(got.arguments) == schema_order(want.name, want.arguments)
        assert got.dsml == render_invoke(want)
    check_stream_consistency(events)
    return dec, events


def assistant_turns():
    for name, make in sorted(CASES.items()):
        conv = make()
        for i, m in enumerate(conv.messages):
            if m.role == "assistant":
                for thinking in (True, False):
                    if roundtrippable(m, thinking):
                        yield pytest.param(
                            m, thinking, id=f"{name}-{i}-{'think' if thinking else 'chat'}"
                        )


# ------------------------------------------------------------- round trips


@pytest.mark.parametrize(("msg", "thinking"), list(assistant_turns()))
def test_render_parse_roundtrip_whole_and_per_char(msg, thinking):
    dec1, ev1 = check_roundtrip(msg, thinking)
    text = render_assistant_turn(msg, thinking=thinking)
    dec2, ev2 = check_roundtrip(msg, thinking, pieces=list(text))
    assert normalized(dec1, ev1) == normalized(dec2, ev2)


def test_corpus_has_many_assistant_turns():
    assert len(list(assistant_turns())) >= 60


SPLIT_SAMPLES = [
    ("dsml_like_args", 1),
    ("long_agent_session", 2),
    ("unicode_everywhere", 2),
    ("content_trailing_newlines", 1),
    ("nested_args", 1),
]


@pytest.mark.parametrize(("name", "idx"), SPLIT_SAMPLES)
def test_split_at_every_position(name, idx):
    msg = CASES[name]().messages[idx]
    assert msg.role == "assistant"
    for thinking in (True, False):
        text = render_assistant_turn(msg, thinking=thinking)
        whole = normalized(*run([text], thinking=thinking))
        for i in range(len(text) + 1):
            assert normalized(*run([text[:i], text[i:]], thinking=thinking)) == whole, i


# --------------------------------------------------------- property tests

FRAGMENTS = [
    "a", "Z", " ", "\n", "\n\n", "<", ">", "/", '"', "=", "｜", "｜DSML｜", "<｜DSML｜",
    "</｜DSML｜", "parameter", "invoke", "tool_calls", "think", "<think>", "é", "日本", "🎉",
    "\\", "{", "}", "<｜end", "▁of", "string=\"true\"", "name=\"x\"",
]  # fmt: skip
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    texts,
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["k", "ü", "a b"]), inner, max_size=3),
    ),
    max_leaves=6,
)
arg_names = st.sampled_from(["path", "old", "new", "all", "query", "limit", "options", "x", "ключ"])
calls = st.builds(
    lambda name, args: ToolCall("id", name, args),
    st.sampled_from(["edit", "search", "configure", "ping", "not_a_tool"]),
    st.dictionaries(arg_names, st.one_of(texts, json_values), max_size=4),
)
turns = st.builds(
    lambda reasoning, content, cs: Message("assistant", content, reasoning, cs),
    texts,
    texts,
    st.lists(calls, max_size=3),
)


@FAST
@given(msg=turns, thinking=st.booleans(), data=st.data())
def test_property_roundtrip_any_split(msg, thinking, data):
    if not roundtrippable(msg, thinking):
        return
    text = render_assistant_turn(msg, thinking=thinking)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    whole = normalized(*check_roundtrip(msg, thinking))
    assert normalized(*check_roundtrip(msg, thinking, pieces=pieces)) == whole
    assert normalized(*check_roundtrip(msg, thinking, pieces=list(text))) == whole


GARBAGE = FRAGMENTS + [
    "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", '<｜DSML｜invoke name="edit">',
    "</｜DSML｜invoke>", '<｜DSML｜parameter name="path" string="true">',
    '<｜DSML｜parameter name="all" string="false">', '<｜DSML｜parameter name="path">',
    "</｜DSML｜parameter>", "</think>", EOS, "[1, ", "true", "\ud83d\ude00",
]  # fmt: skip


FUZZ_PREFIXES = [
    "",
    "r" + THINK_END,
    "r" + THINK_END + "t\n\n" + TOOL_CALLS_OPEN,
    "t" + TOOL_CALLS_OPEN,
]


@FAST
@given(
    prefix=st.sampled_from(FUZZ_PREFIXES),
    frags=st.lists(st.sampled_from(GARBAGE), max_size=30),
    thinking=st.booleans(),
    data=st.data(),
)
def test_property_fuzz_never_raises_and_is_split_invariant(prefix, frags, thinking, data):
    text = prefix + "".join(frags)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    d1, e1 = run([text], thinking=thinking)
    d2, e2 = run(pieces, thinking=thinking)
    check_stream_consistency(e1)
    check_stream_consistency(e2)
    assert not any(m.startswith("internal") for m in d1.result.errors)
    assert normalized(d1, e1) == normalized(d2, e2)


# ---------------------------------------------------------- malformed DSML

OPEN = "\n\n<｜DSML｜tool_calls>\n"
CLOSE = "\n</｜DSML｜tool_calls>" + EOS
EDIT_HEAD = '<｜DSML｜invoke name="edit">\n'
P_PATH = '<｜DSML｜parameter name="path" string="true">a.py</｜DSML｜parameter>\n'

MALFORMED = {
    "missing_param_close": (OPEN + EDIT_HEAD + '<｜DSML｜parameter name="path" string="true">a.py\n</｜DSML｜invoke>' + CLOSE, 1),
    "bad_param_header": (OPEN + EDIT_HEAD + '<｜DSML｜parameter name="old">x</｜DSML｜parameter>\n' + P_PATH + "</｜DSML｜invoke>" + CLOSE, 1),
    "bad_param_header_flag": (OPEN + EDIT_HEAD + '<｜DSML｜parameter name="old" string="yes">x</｜DSML｜parameter>\n' + P_PATH + "</｜DSML｜invoke>" + CLOSE, 1),
    "duplicate_param": (OPEN + EDIT_HEAD + P_PATH + P_PATH.replace("a.py", "b.py") + "</｜DSML｜invoke>" + CLOSE, 1),
    "missing_invoke_close": (OPEN + EDIT_HEAD + P_PATH + '<｜DSML｜invoke name="ping">\n\n</｜DSML｜invoke>' + CLOSE, 2),
    "missing_invoke_close_at_block_end": (OPEN + EDIT_HEAD + P_PATH + CLOSE, 1),
    "missing_block_close": (OPEN + EDIT_HEAD + P_PATH + "</｜DSML｜invoke>\n" + EOS, 1),
    "invalid_json": (OPEN + EDIT_HEAD + '<｜DSML｜parameter name="all" string="false">yes please</｜DSML｜parameter>\n</｜DSML｜invoke>' + CLOSE, 1),
    "garbage_in_block": (OPEN + "oops\n" + EDIT_HEAD + P_PATH + "</｜DSML｜invoke>" + CLOSE, 1),
    "garbage_in_invoke": (OPEN + EDIT_HEAD + "stray words\n" + P_PATH + "</｜DSML｜invoke>" + CLOSE, 1),
    "bad_invoke_header": (OPEN + '<｜DSML｜invoke nam="edit">\n' + P_PATH + "</｜DSML｜invoke>\n" + '<｜DSML｜invoke name="ping">\n\n</｜DSML｜invoke>' + CLOSE, 1),
    "text_after_block": (OPEN + '<｜DSML｜invoke name="ping">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>and more text', 1),
    "truncated_in_string_value": (OPEN + EDIT_HEAD + P_PATH + '<｜DSML｜parameter name="new" string="true">partial cont', 1),
    "truncated_in_json_value": (OPEN + EDIT_HEAD + P_PATH + '<｜DSML｜parameter name="all" string="false">[1, 2', 1),
    "truncated_in_invoke_header": (OPEN + '<｜DSML｜invoke name="ed', 0),
    "truncated_in_param_header": (OPEN + EDIT_HEAD + P_PATH + '<｜DSML｜parameter name="ne', 1),
    "truncated_between_params": (OPEN + EDIT_HEAD + P_PATH, 1),
    "truncated_in_close_marker": (OPEN + EDIT_HEAD + '<｜DSML｜parameter name="new" string="true">abc</｜DSML｜para', 1),
    "truncated_in_block": (OPEN, 0),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MALFORMED))
@pytest.mark.parametrize("thinking", [True, False])
def test_malformed_gives_error_and_recoverable_result(name, thinking):
    body, n_calls = MALFORMED[name]
    text = ("reasoning" + THINK_END if thinking else "") + "Visible." + body
    results = []
    for pieces in ([text], list(text)):
        dec, events = run(pieces, thinking=thinking)
        assert any(isinstance(e, ParseError) for e in events), name
        check_stream_consistency(events)
        assert dec.result.content == "Visible."
        assert len(dec.result.tool_calls) == n_calls
        for call in dec.result.tool_calls:
            assert call.dsml and call.dsml.startswith("<｜DSML｜invoke")
        results.append(normalized(dec, events))
    assert results[0] == results[1]


def test_malformed_details():
    dec, _ = run(["x" + MALFORMED["duplicate_param"][0]], thinking=False)
    assert dec.result.tool_calls[0].arguments == {"path": "a.py"}
    dec, _ = run([MALFORMED["invalid_json"][0]], thinking=False)
    assert dec.result.tool_calls[0].arguments == {"all": "yes please"}
    dec, events = run([MALFORMED["truncated_in_string_value"][0]], thinking=False)
    assert dec.result.tool_calls[0].arguments == {"path": "a.py", "new": "partial cont"}
    end = [e for e in events if isinstance(e, ToolCallEnd)][0]
    assert end.error and "truncated" in end.error
    dec, _ = run([MALFORMED["truncated_in_json_value"][0]], thinking=False)
    assert dec.result.tool_calls[0].arguments == {"path": "a.py"}
    dec, _ = run([MALFORMED["truncated_in_close_marker"][0]], thinking=False)
    # Issue 20 item 6: the cut closing tag's bytes are not part of the value.
    assert dec.result.tool_calls[0].arguments == {"new": "abc"}
    dec, _ = run([MALFORMED["bad_param_header"][0]], thinking=False)
    assert dec.result.tool_calls[0].arguments == {"path": "a.py"}
    dec, _ = run([MALFORMED["missing_invoke_close"][0]], thinking=False)
    assert [c.name for c in dec.result.tool_calls] == ["edit", "ping"]
    assert dec.result.tool_calls[0].dsml == EDIT_HEAD + P_PATH.rstrip("\n")


def test_incomplete_dsml_inside_thinking_is_text():
    # Issue 13 item 3: a block opened in reasoning that </think> cuts short (no
    # </｜DSML｜tool_calls>) was never a call; it stays reasoning text, split anyhow.
    text = "I could call " + OPEN + EDIT_HEAD + P_PATH + "</｜DSML｜invoke>\n"
    whole = text + THINK_END + "Answer." + EOS
    for pieces in ([whole], list(whole)):
        dec, events = run(pieces, thinking=True)
        assert dec.result.reasoning == text
        assert dec.result.content == "Answer."
        assert dec.result.tool_calls == [] and dec.result.errors == []
        assert not any(isinstance(e, ToolCallStart) for e in events)


def test_incomplete_dsml_at_end_of_thinking_is_text():
    text = "Maybe " + OPEN + EDIT_HEAD + '<｜DSML｜parameter name="path" string="true">a.'
    for pieces in ([text], list(text)):
        dec, events = run(pieces, thinking=True)
        assert dec.result.reasoning == text and dec.result.tool_calls == []
        assert dec.result.errors == [] and not dec.result.ended
    dec, _ = run([text + EOS], thinking=True)
    assert dec.result.reasoning == text and dec.result.ended and dec.result.tool_calls == []


@pytest.mark.parametrize("after", [EOS, THINK_END + EOS, "\n" + THINK_END + "\n" + EOS])
def test_complete_dsml_inside_thinking_is_recovered_as_a_call(after):
    # Issue 13 item 3: DeepSeek models sometimes open the call before </think>.
    block = OPEN + EDIT_HEAD + P_PATH + "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    whole = "I will edit it." + block + after
    results = []
    for pieces in ([whole], list(whole)):
        dec, events = run(pieces, thinking=True)
        res = dec.result
        assert res.reasoning == "I will edit it."
        assert res.content == ""
        assert [(c.name, c.arguments) for c in res.tool_calls] == [("edit", {"path": "a.py"})]
        assert res.tool_calls[0].dsml == EDIT_HEAD + P_PATH + "</｜DSML｜invoke>"
        assert res.errors == [] and res.ended and dec.tool_block_closed
        check_stream_consistency(events)
        thinking = "".join(e.text for e in events if isinstance(e, ThinkingDelta))
        assert thinking == "I will edit it."
        results.append(normalized(dec, events))
    assert results[0] == results[1]


def test_reasoning_text_after_a_recovered_block_is_not_a_second_answer():
    block = OPEN + EDIT_HEAD + P_PATH + "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    dec, _ = run(["r" + block + THINK_END + "Answer." + EOS], thinking=True)
    assert dec.result.reasoning == "r" and dec.result.content == ""
    assert [c.name for c in dec.result.tool_calls] == ["edit"]
    assert any("after" in e for e in dec.result.errors)


def test_truncated_thinking_is_not_an_error():
    dec, events = run(["still thinking </thi"], thinking=True)
    assert dec.result.reasoning == "still thinking </thi"
    assert dec.result.errors == [] and not dec.result.ended


def test_holds_back_partial_markers():
    dec = StreamDecoder(False, TOOLS)
    assert dec.feed("Hello\n") == [TextDelta("Hello")]
    assert dec.feed("\n<｜DSML｜tool") == []
    assert dec.feed("s") == [TextDelta("\n\n<｜DSML｜tools")]
    dec = StreamDecoder(True, TOOLS)
    assert dec.feed("abc</thi") == [ThinkingDelta("abc")]
    assert dec.feed("nk>x") == [TextDelta("x")]


@pytest.mark.parametrize(
    "cut", ["\n\n<｜DSML｜", "\n\n<｜DSML｜tool", "\n\n<｜DSML｜tool_c", "\n\n<｜DSML｜tool_calls"]
)
def test_an_opener_cut_by_the_end_of_the_turn_is_not_text(cut):
    # Issue 13 item 16: max_tokens ending inside the opener must not leak its bytes.
    for thinking, prefix in ((False, "Hi."), (True, "r" + THINK_END + "Hi.")):
        for pieces in ([prefix + cut], list(prefix + cut)):
            dec, events = run(pieces, thinking=thinking)
            assert dec.result.content == "Hi."
            assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Hi."
    # Without the DSML token the held bytes are ordinary text.
    for tail in ("\n\n", "\n\n<", "a <"):
        dec, _ = run(["Hi." + tail], thinking=False)
        assert dec.result.content == "Hi." + tail


def test_surrogate_pairs_never_split():
    dec = StreamDecoder(False, TOOLS)
    assert dec.feed("a\ud83d") == [TextDelta("a")]
    assert dec.feed("\ude00b") == [TextDelta("\ud83d\ude00b")]


def test_eos_ends_turn_and_later_text_ignored():
    dec, events = run(["answer" + EOS + "junk"], thinking=False)
    assert dec.result.content == "answer" and dec.result.ended
    assert dec.feed("more") == []


def test_ids_use_prefix_and_are_unique():
    text = (
        OPEN
        + '<｜DSML｜invoke name="ping">\n\n</｜DSML｜invoke>\n<｜DSML｜invoke name="ping">\n\n</｜DSML｜invoke>'
        + CLOSE
    )
    dec = StreamDecoder(False, TOOLS, id_prefix="call_")
    dec.feed(text)
    dec.finish()
    ids = [c.id for c in dec.result.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    assert dec.tool_block_closed


def test_arguments_follow_schema_order():
    text = (
        OPEN
        + EDIT_HEAD
        + '<｜DSML｜parameter name="zzz" string="true">extra</｜DSML｜parameter>\n'
        + '<｜DSML｜parameter name="new" string="true">n</｜DSML｜parameter>\n'
        + P_PATH
        + "</｜DSML｜invoke>"
        + CLOSE
    )
    dec, events = run([text], thinking=False)
    end = [e for e in events if isinstance(e, ToolCallEnd)][0]
    assert end.arguments_json == '{"path": "a.py", "new": "n", "zzz": "extra"}'
    streamed = "".join(e.text for e in events if isinstance(e, ToolCallArgsDelta))
    assert streamed == '{"zzz": "extra", "new": "n", "path": "a.py"}'


# ------------------------------------------------------ structure / payload

# (in_structure expected *before* each character of the piece, piece)
STRUCTURE_SAMPLE = [
    (False, "Plan: call <b>it</b>."),  # reasoning
    (False, THINK_END),
    (False, "Let me check."),  # visible text
    (False, "\n\n<｜DSML"),  # could still be text until the DSML token is complete
    (False, "｜"),
    (True, 'tool_calls>\n<｜DSML｜invoke name="configure">\n'),
    (True, '<｜DSML｜parameter name="note" string="true">'),
    (False, 'a "quoted" <value>\nline 2</'),  # string body, even a "</" start
    (False, "｜DSML"),
    (False, "｜"),
    (True, "parameter>\n"),
    (True, '<｜DSML｜parameter name="options" string="false">'),
    (False, "{"),  # value start: the model picks the type
    (True, '"days"'),  # object key
    (True, ":"),
    (False, " [1, 2]"),  # a value; a scalar's end is only known after it
    (True, ", "),
    (True, '"label":'),
    (False, ' "x y'),
    (False, '"'),  # closing quote of a value
    (True, ", "),
    (True, '"on":'),
    (False, " true}"),  # '}' ends the scalar, not yet known
    (True, "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"),
    (True, EOS),
]


def test_in_structure_at_every_byte():
    dec = StreamDecoder(True, TOOLS)
    fed = ""
    for expected, piece in STRUCTURE_SAMPLE:
        for ch in piece:
            assert dec.in_structure == expected, (fed, ch)
            dec.feed(ch)
            fed += ch
    dec.finish()
    assert dec.result.errors == []
    call = dec.result.tool_calls[0]
    assert call.arguments == {
        "note": 'a "quoted" <value>\nline 2',
        "options": {"days": [1, 2], "label": "x y", "on": True},
    }


def test_in_structure_json_details():
    dec = StreamDecoder(False, TOOLS)
    dec.feed(OPEN + EDIT_HEAD + '<｜DSML｜parameter name="all" string="false">')
    labels = []
    for ch in '[1, "a", {"k": [true]}]':
        labels.append(dec.in_structure)
        dec.feed(ch)
    # [ 1 , ␠ " a " , ␠ { " k " : ␠ [ t r u e ] } ]
    expected = [False, False, False, False, False, False, False, True, False, False, True, True, True, True, False, False, False, False, False, False, False, True, True]  # fmt: skip
    assert labels == expected


def _mutate(text: str, ops: list[tuple[int, int, int, str]]) -> str:
    for kind, a, b, frag in ops:
        a, b = sorted((a % (len(text) + 1), b % (len(text) + 1)))
        if kind == 0:  # delete a slice
            text = text[:a] + text[b:]
        elif kind == 1:  # insert a fragment
            text = text[:a] + frag + text[a:]
        else:  # truncate (max_tokens)
            text = text[:b]
    return text


@FAST
@given(
    msg=turns.filter(lambda m: m.tool_calls),
    thinking=st.booleans(),
    ops=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.integers(0, 10**6),
            st.integers(0, 10**6),
            st.sampled_from(GARBAGE),
        ),
        min_size=1,
        max_size=3,
    ),
    data=st.data(),
)
def test_property_mutated_blocks_recover(msg, thinking, ops, data):
    text = _mutate(render_assistant_turn(msg, thinking=thinking), ops)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    d1, e1 = run([text], thinking=thinking)
    d2, e2 = run(pieces, thinking=thinking)
    check_stream_consistency(e1)
    check_stream_consistency(e2)
    assert not any(m.startswith("internal") for m in d1.result.errors)
    assert normalized(d1, e1) == normalized(d2, e2)


@pytest.mark.parametrize(
    ("value", "tail", "args"),
    [
        ('string="true">Paris', "</｜DSML｜parameter", '{"city": "Paris'),
        ('string="true">Paris', "</｜DSML｜", '{"city": "Paris'),
        ('string="true">a</b', "</", '{"city": "a</b</'),  # not markup: kept
        ('string="false">12', "</｜DSML｜param", ""),  # a cut JSON value is never streamed
    ],
)
def test_a_closing_tag_cut_by_the_end_of_the_turn_is_not_arguments(value, tail, args):
    """Issue 20 item 6: max_tokens ends the turn inside ``</｜DSML｜parameter>``: none of
    the tag's bytes reach the streamed arguments, fed whole or char by char."""
    text = (
        f'\n\n{TOOL_CALLS_OPEN}\n<｜DSML｜invoke name="get_weather">\n'
        f'<｜DSML｜parameter name="city" {value}{tail}'
    )
    for pieces in ([text], list(text)):
        dec = StreamDecoder(False, TOOLS)
        evs = [e for p in pieces for e in dec.feed(p)] + dec.finish()
        streamed = "".join(e.text for e in evs if isinstance(e, ToolCallArgsDelta))
        assert streamed == args
        (end,) = [e for e in evs if isinstance(e, ToolCallEnd)]
        assert not end.closed


def test_tool_choice_none_drops_calls_in_text_and_in_reasoning():
    """Issue 20 item 1: ``calls=False``: no call event, no call in the result, none of
    the block's bytes as text, wherever the block is."""
    block = (
        f'\n\n{TOOL_CALLS_OPEN}\n<｜DSML｜invoke name="get_weather">\n'
        f'<｜DSML｜parameter name="city" string="true">Qwzx{PARAM_CLOSE}\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS
    )
    for thinking, text in ((False, "Sure." + block), (True, "hmm" + block)):
        for pieces in ([text], list(text)):
            dec = StreamDecoder(thinking, TOOLS, calls=False)
            evs = [e for p in pieces for e in dec.feed(p)] + dec.finish()
            assert not [e for e in evs if isinstance(e, ToolCallStart | ToolCallEnd)]
            shown = "".join(e.text for e in evs if isinstance(e, TextDelta | ThinkingDelta))
            assert shown == ("hmm" if thinking else "Sure.") and dec.dropped_calls == 1
            assert dec.result.tool_calls == []
