"""Tool ids, tool memory and exact replay of sampled DSML (issue 3, must-hold 4)."""

from __future__ import annotations

import json
import re

import pytest
from dsml_cases import TOOLS

from ds4mlx.dsml import (
    Conversation,
    Message,
    StreamDecoder,
    ToolCall,
    ToolMemory,
    canonical_invoke,
    new_tool_id,
    render_prompt,
    render_tool_results_suffix,
)
from ds4mlx.dsml.tokens import EOS

# What the model sampled: parameters out of schema order, compact JSON, an extra space.
SAMPLED_INVOKE = (
    '<｜DSML｜invoke name="edit">\n'
    '<｜DSML｜parameter name="new" string="true">b = 2</｜DSML｜parameter>\n'
    '<｜DSML｜parameter  name="path" string="true">a.py</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="all" string="false">true</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="old" string="false">"a =\\u00201"</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>"
)
SAMPLED_TURN = (
    "I will edit.</think>Editing.\n\n<｜DSML｜tool_calls>\n"
    + SAMPLED_INVOKE
    + '\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="limit" string="false">{"n":1}'
    + "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def _sample():
    dec = StreamDecoder(True, TOOLS)
    dec.feed(SAMPLED_TURN)
    dec.finish()
    assert dec.result.errors == []
    return dec.result


def _conversation(calls, results_order=(0, 1)):
    head = [Message("system", "sys"), Message("user", "fix it")]
    turn = Message("assistant", "Editing.", "I will edit.", calls)
    tools = [Message("tool", f"result {i}", tool_call_id=calls[i].id) for i in results_order]
    return Conversation(head + [turn] + tools, tools=TOOLS, thinking=True)


def _client_echo(call: ToolCall) -> ToolCall:
    """A client's replay: same id/name, JSON re-serialized with sorted keys (no dsml)."""
    args = json.loads(json.dumps(call.arguments, sort_keys=True, indent=2))
    return ToolCall(call.id, call.name, args)


def test_new_tool_id_format_and_uniqueness():
    ids = {new_tool_id() for _ in range(2000)}
    assert len(ids) == 2000
    for i in list(ids)[:50]:
        assert re.fullmatch(r"toolu_[A-Za-z0-9_-]{24}", i)
    assert re.fullmatch(r"call_[A-Za-z0-9_-]{24}", new_tool_id("call_"))


def test_decoder_keeps_exact_invoke_bytes():
    res = _sample()
    assert res.tool_calls[0].dsml == SAMPLED_INVOKE
    assert res.tool_calls[0].arguments == {
        "path": "a.py",
        "old": "a = 1",
        "new": "b = 2",
        "all": True,
    }
    assert list(res.tool_calls[0].arguments) == ["path", "old", "new", "all"]  # schema order


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_replay_from_memory_is_byte_identical(order):
    res = _sample()
    mem = ToolMemory()
    for c in res.tool_calls:
        mem.put(c.id, c.dsml)
    echoed = [_client_echo(c) for c in res.tool_calls]
    conv = _conversation(echoed, order)
    prompt = render_prompt(conv, tool_memory=mem)
    # The live state: the prompt before the turn, then exactly what was sampled.
    before = render_prompt(Conversation(conv.messages[:2], TOOLS, True))
    live = before + SAMPLED_TURN
    assert prompt == live + render_tool_results_suffix(conv, tool_memory=mem).text
    assert prompt.startswith(live + EOS)
    # ToolCall.dsml (e.g. set by the server from its own records) works the same way.
    with_dsml = [
        ToolCall(e.id, e.name, e.arguments, c.dsml)
        for e, c in zip(echoed, res.tool_calls, strict=True)
    ]
    assert render_prompt(_conversation(with_dsml, order)) == prompt


def test_canonical_when_memory_disabled_or_id_unknown():
    res = _sample()
    echoed = [_client_echo(c) for c in res.tool_calls]
    canonical = [canonical_invoke(c.name, c.arguments) for c in echoed]
    disabled = ToolMemory(enabled=False)
    for c in res.tool_calls:
        disabled.put(c.id, c.dsml)
    assert len(disabled) == 0
    other = ToolMemory()
    other.put("toolu_someone_else", SAMPLED_INVOKE)
    for mem in (None, disabled, other):
        prompt = render_prompt(_conversation(echoed), tool_memory=mem)
        assert SAMPLED_INVOKE not in prompt
        for text in canonical:
            assert text in prompt
    assert canonical[0].startswith(
        '<｜DSML｜invoke name="edit">\n<｜DSML｜parameter name="all" string="false">true<'
    )


def test_memory_bounded_lru():
    mem = ToolMemory(max_ids=3)
    for i in range(3):
        mem.put(f"id{i}", f"d{i}")
    assert mem.get("id0") == "d0"  # use refreshes id0
    mem.put("id3", "d3")
    assert "id1" not in mem and len(mem) == 3
    assert [k for k, _ in mem.entries()] == ["id2", "id0", "id3"]
    again = ToolMemory(max_ids=2)
    again.load(mem.entries())
    assert again.entries() == [("id0", "d0"), ("id3", "d3")]
    assert mem.get("nope") is None and mem.get(None) is None
    mem.clear()
    assert len(mem) == 0
    with pytest.raises(ValueError):
        ToolMemory(max_ids=0)


def test_memory_default_size():
    assert ToolMemory().max_ids == 100_000
