"""Issue 22: asynchronous tool calls (``async: true``), in process.

The flag through each protocol's request model, the tools-section sentence, pending
status results that stay where they were rendered (append-only), late results headed by
their call, and the live tool binding answered by the synchronous ids. The same behaviour
through a real ``ds4mlx serve`` is in ``test_async_tools_server.py``.
"""

from __future__ import annotations

import pytest

from ds4mlx.dsml import (
    Conversation,
    Message,
    ToolCall,
    ToolSpec,
    render_pending_status,
    render_prompt,
)
from ds4mlx.dsml.tokens import ASSISTANT, EOS, USER
from ds4mlx.kv.live import ToolBinding, tool_results_suffix, unexplained_tool_ids
from ds4mlx.routes import anthropic, openai, responses
from ds4mlx.routes.body import validate
from ds4mlx.routes.errors import APIError

SLEEP_SCHEMA = {"type": "object", "properties": {"seconds": {"type": "integer"}}}
READ_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
NOTE = "These tools run in the background"


def _chat(flag):
    sleep = {"name": "sleep", "description": "Wait", "parameters": SLEEP_SCHEMA}
    if flag is not None:
        sleep["async"] = flag
    read = {"name": "read", "description": "Read", "parameters": READ_SCHEMA}
    body = {
        "model": "deepseek-chat",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": f} for f in (sleep, read)],
    }
    return openai.to_conversation(validate(openai.ChatRequest, body))


def _anthropic(flag):
    sleep = {"name": "sleep", "description": "Wait", "input_schema": SLEEP_SCHEMA}
    if flag is not None:
        sleep["async"] = flag
    body = {
        "model": "deepseek-v4-flash",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [sleep, {"name": "read", "description": "Read", "input_schema": READ_SCHEMA}],
        "thinking": {"type": "disabled"},
    }
    return anthropic.to_conversation(validate(anthropic.MessagesRequest, body))


def _responses(flag):
    sleep = {"type": "function", "name": "sleep", "description": "Wait", "parameters": SLEEP_SCHEMA}
    if flag is not None:
        sleep["async"] = flag
    read = {"type": "function", "name": "read", "description": "Read", "parameters": READ_SCHEMA}
    body = {"model": "deepseek-chat", "input": "hi", "tools": [sleep, read]}
    return responses.to_conversation(validate(responses.ResponsesRequest, body))


PROTOCOLS = {"chat": _chat, "anthropic": _anthropic, "responses": _responses}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_async_flag_through_each_protocol_names_the_background_tools(protocol):
    build = PROTOCOLS[protocol]
    conv = build(True)
    assert [(t.name, t.background) for t in conv.tools] == [("sleep", True), ("read", False)]
    text = render_prompt(conv)
    # One sentence after the tool list, before the closing instruction; only async tools.
    schemas_end = text.index('"name": "read"')
    note = text.index(NOTE)
    assert schemas_end < note < text.index("You MUST strictly follow the above defined tool")
    assert text[note:].split("\n")[0].endswith("): sleep.")
    # Without an async tool (absent, false or null) the prompt is the official one.
    plain = render_prompt(build(None))
    assert NOTE not in plain
    assert render_prompt(build(False)) == plain
    assert text.replace(text[note - 2 : text.index("\n", note)], "") == plain


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("value", ["yes", 1, "true", [True]])
def test_async_non_boolean_flag_is_the_protocols_400_naming_the_field(protocol, value):
    with pytest.raises(APIError) as e:
        PROTOCOLS[protocol](value)
    field = "tools.0.function.async" if protocol == "chat" else "tools.0.async"
    assert e.value.status == 400 and e.value.param == field
    assert e.value.message.startswith(field + ":")


TOOLS = [
    ToolSpec("sleep", parameters=SLEEP_SCHEMA, background=True),
    ToolSpec("read", parameters=READ_SCHEMA),
]
CALLS = [ToolCall("call_x", "sleep", {"seconds": 5}), ToolCall("call_y", "read", {"path": "a"})]


def _conv(*messages: Message, thinking: bool = False) -> Conversation:
    return Conversation(messages=list(messages), tools=TOOLS, thinking=thinking)


def test_async_pending_status_stays_in_place_and_renderings_only_grow():
    start = [Message("user", "go"), Message("assistant", "", tool_calls=list(CALLS))]
    r2 = start + [Message("tool", "R-Y", tool_call_id="call_y")]
    r3 = r2 + [Message("assistant", "first"), Message("user", "unrelated")]
    r4 = r3 + [Message("assistant", "second"), Message("user", "another")]
    r5 = r4 + [Message("assistant", "third"), Message("tool", "slept 5 s", tool_call_id="call_x")]
    texts = [render_prompt(_conv(*m, thinking=True)) for m in (r2, r3, r4, r5)]
    for a, b in zip(texts, texts[1:], strict=False):
        assert b.startswith(a)
    status = render_pending_status("call_x", "sleep")
    assert status == (
        "[call_x sleep: running in the background; its result will come later with this id]"
    )
    # Right after the call's turn, in call order before the synchronous result.
    assert texts[0].endswith(
        f"{EOS}{USER}<tool_result>{status}</tool_result>\n\n<tool_result>R-Y</tool_result>"
        f"{ASSISTANT}<think>"
    )
    assert texts[-1].endswith(
        f"{USER}<tool_result>[result of call_x sleep(seconds=5)]\nslept 5 s</tool_result>"
        f"{ASSISTANT}<think>"
    )
    assert texts[-1].count(status) == 1


def test_async_status_with_user_text_only_and_as_the_last_turn():
    only_async = Message("assistant", "", tool_calls=[CALLS[0]])
    status = f"<tool_result>{render_pending_status('call_x', 'sleep')}</tool_result>"
    text = render_prompt(_conv(Message("user", "go"), only_async, Message("user", "meanwhile")))
    assert text.endswith(f"{EOS}{USER}{status}\n\nmeanwhile{ASSISTANT}</think>")
    # A request ending with the call's turn: the status is a user turn of its own, which
    # opens the reply (no second opener).
    open_reply = _conv(Message("user", "go"), only_async)
    open_reply.open_reply = True
    assert render_prompt(open_reply).endswith(f"{EOS}{USER}{status}{ASSISTANT}</think>")
    # Its result sent right away is an ordinary result: no status, no heading.
    direct = render_prompt(
        _conv(Message("user", "go"), only_async, Message("tool", "done", tool_call_id="call_x"))
    )
    assert direct.endswith(f"{EOS}{USER}<tool_result>done</tool_result>{ASSISTANT}</think>")


def test_async_live_binding_is_answered_by_the_sync_ids():
    user = Message("user", "go")
    turn = Message("assistant", "", tool_calls=list(CALLS))
    b = ToolBinding(("call_x", "call_y"), 40, ("sleep", "read"))
    sync_only = _conv(user, turn, Message("tool", "R-Y", tool_call_id="call_y"))
    assert b.sync_ids(sync_only) == {"call_y"}
    suffix = tool_results_suffix(sync_only, b)
    full = render_prompt(sync_only)
    assert suffix is not None and full.endswith(suffix.text)
    assert suffix.text.startswith(EOS + USER + "<tool_result>[call_x sleep: running")
    # Not replayed: the same suffix by ids alone.
    assert tool_results_suffix(_conv(user, Message("tool", "R-Y", tool_call_id="call_y")), b) == (
        suffix
    )
    # Both results (the async one answered at once) still match; the sync one missing
    # does not, nor a request that does not refer to the turn at all.
    both = _conv(
        user,
        turn,
        Message("tool", "R-X", tool_call_id="call_x"),
        Message("tool", "R-Y", tool_call_id="call_y"),
    )
    assert render_prompt(both).endswith(tool_results_suffix(both, b).text)
    assert (
        tool_results_suffix(_conv(user, turn, Message("tool", "R-X", tool_call_id="call_x")), b)
        is None
    )
    assert (
        tool_results_suffix(
            _conv(user, Message("user", "hi")), ToolBinding(("call_x",), 9, ("sleep",))
        )
        is None
    )
    # Without names (an older binding) every call is synchronous: today's rule.
    assert tool_results_suffix(sync_only, ToolBinding(("call_x", "call_y"), 40)) is None
    # Only async calls, then user text: live, the status results open the suffix.
    only = ToolBinding(("call_x",), 9, ("sleep",))
    talk = _conv(
        user, Message("assistant", "", tool_calls=[CALLS[0]]), Message("user", "meanwhile")
    )
    assert render_prompt(talk).endswith(tool_results_suffix(talk, only).text)


def test_async_late_result_beside_a_new_rounds_results_continues_live():
    """A late result arriving with the next round's sync results: the suffix heads it
    and puts it after them, exactly as the whole prompt renders it."""
    first = Message("assistant", "", tool_calls=[CALLS[0]])
    second = Message("assistant", "", tool_calls=[ToolCall("call_z", "read", {"path": "b"})])
    conv = _conv(
        Message("user", "go"),
        first,
        Message("user", "meanwhile"),
        second,
        Message("tool", "slept", tool_call_id="call_x"),
        Message("tool", "R-Z", tool_call_id="call_z"),
    )
    suffix = tool_results_suffix(conv, ToolBinding(("call_z",), 70, ("read",)))
    assert suffix is not None and render_prompt(conv).endswith(suffix.text)
    assert suffix.text == (
        f"{EOS}{USER}<tool_result>R-Z</tool_result>\n\n"
        f"<tool_result>[result of call_x sleep(seconds=5)]\nslept</tool_result>{ASSISTANT}</think>"
    )
    # An unknown id is explained by nothing: today's rejection.
    bad = _conv(Message("user", "go"), first, Message("tool", "?", tool_call_id="call_never"))
    assert unexplained_tool_ids(bad) == ["call_never"]
