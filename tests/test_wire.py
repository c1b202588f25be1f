"""Wire formats → Conversation: each protocol module's mapping of its typed request
(docs/ARCHITECTURE.md §4)."""

from __future__ import annotations

import pytest

from ds4mlx.dsml import render_prompt
from ds4mlx.dsml.conversation import Message, ToolCall
from ds4mlx.routes import anthropic, openai, responses
from ds4mlx.routes.body import validate
from ds4mlx.routes.errors import APIError
from ds4mlx.routes.mapping import WireError


def anthropic_conv(body, **kw):
    return anthropic.to_conversation(validate(anthropic.CountTokensRequest, body), **kw)


def chat_conv(body, **kw):
    return openai.to_conversation(validate(openai.ChatRequest, body), **kw)


def responses_conv(body, **kw):
    return responses.to_conversation(validate(responses.ResponsesRequest, body), **kw)


BILLING = "x-anthropic-billing-header: cc_version=2.1.197.123; cc_entrypoint=sdk-cli;"


def _roles(conv):
    return [m.role for m in conv.messages]


# --------------------------------------------------------------------------- Anthropic


def test_anthropic_system_blocks_join_and_billing_header_dropped():
    body = {
        "system": [
            {"type": "text", "text": BILLING},
            {
                "type": "text",
                "text": "You are a Claude agent.",
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "text", "text": "\nBe terse."},
            {"type": "text", "text": "Third"},
        ],
        "messages": [{"role": "user", "content": "hi"}],
    }
    conv = anthropic_conv(body)
    # "\n" inserted only where the previous part does not already end with one.
    assert conv.messages[0] == Message(
        role="system", content="You are a Claude agent.\n\nBe terse.\nThird"
    )
    kept = anthropic_conv(body, keep_billing_header=True)
    assert kept.messages[0].content.startswith(BILLING + "\nYou are")


def test_two_sessions_differing_only_in_billing_header_render_the_same():
    def body(h):
        return {
            "system": [{"type": "text", "text": h}, {"type": "text", "text": "S"}],
            "messages": [{"role": "user", "content": "q"}],
        }

    a = render_prompt(anthropic_conv(body(BILLING)))
    b = render_prompt(anthropic_conv(body(BILLING.replace("123", "999"))))
    assert a == b


def test_anthropic_mid_conversation_system_is_hoisted_after_top_level_system():
    body = {
        "system": "TOP",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hello"}]},
            {"role": "system", "content": "ENV"},
        ],
    }
    conv = anthropic_conv(body)
    assert _roles(conv) == ["system", "user"]
    # Hoisted, after the top-level text and the tools (issue 12, "stable prompts"): the
    # top-level text + tools stay a prefix that a retry carrying ENV elsewhere shares.
    assert conv.messages[0].content == "TOP" and conv.late_system == "ENV"
    assert render_prompt(conv).startswith("<｜begin▁of▁sentence｜>TOP\n\nENV<｜User｜>")
    # Rendered in place the official encoding would not open the assistant turn.
    assert render_prompt(conv).endswith("<｜User｜>hello<｜Assistant｜><think>")


def test_anthropic_tool_results_precede_text_and_lists_render_placeholders():
    body = {
        "messages": [
            {"role": "user", "content": "run"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "plan", "signature": "foreign-sig"},
                    {"type": "text", "text": "ok"},
                    {
                        "type": "tool_use",
                        "id": "toolu_a",
                        "name": "Bash",
                        "input": {"command": "ls"},
                    },
                    {
                        "type": "tool_use",
                        "id": "toolu_b",
                        "name": "Bash",
                        "input": {"command": "pwd"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "after"},
                    {"type": "tool_result", "tool_use_id": "toolu_b", "content": "/w"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_a",
                        "content": [
                            {"type": "text", "text": "a"},
                            {"type": "image", "source": {}},
                            {"type": "text", "text": "b"},
                        ],
                        "is_error": False,
                    },
                ],
            },
        ],
        "tools": [
            {
                "name": "Bash",
                "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
            }
        ],
    }
    conv = anthropic_conv(body)
    assert _roles(conv) == ["user", "assistant", "tool", "tool", "user"]
    a = conv.messages[1]
    assert a.reasoning == "plan" and a.content == "ok"
    assert [c.id for c in a.tool_calls] == ["toolu_a", "toolu_b"]
    assert conv.messages[3].content == "a\n\n[Unsupported Image]\n\nb"
    text = render_prompt(conv)
    # Results in call order (a before b), the user's text after them.
    assert (
        "<tool_result>a\n\n[Unsupported Image]\n\nb</tool_result>\n\n<tool_result>/w</tool_result>\n\nafter"
        in text
    )


def test_anthropic_thinking_signature_carrier_restores_reasoning():
    body = {
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "", "signature": "SIG"}],
            },
            {"role": "user", "content": "more"},
        ]
    }
    conv = anthropic_conv(body, decode_reasoning=lambda s: "real reasoning" if s == "SIG" else None)
    assert conv.messages[1].reasoning == "real reasoning"
    conv = anthropic_conv(body, decode_reasoning=lambda s: None)
    assert conv.messages[1].reasoning == ""


def test_anthropic_thinking_modes_and_effort():
    base = {"messages": [{"role": "user", "content": "q"}]}
    assert anthropic_conv(base).thinking is True
    assert anthropic_conv(base, default_thinking=False).thinking is False
    assert anthropic_conv({**base, "thinking": {"type": "disabled"}}).thinking is False
    assert anthropic_conv(
        {**base, "thinking": {"type": "adaptive"}}, default_thinking=False
    ).thinking
    conv = anthropic_conv({**base, "output_config": {"effort": "max"}})
    assert conv.reasoning_effort == "max"


def test_anthropic_server_tools_not_offered_and_tool_choice_none():
    body = {
        "messages": [{"role": "user", "content": "q"}],
        "tools": [
            {"type": "web_search_20250305", "name": "web_search"},
            {"name": "Read", "input_schema": {"type": "object", "properties": {}}},
        ],
    }
    assert [t.name for t in anthropic_conv(body).tools] == ["Read"]
    assert anthropic_conv({**body, "tool_choice": {"type": "none"}}).tools == []


def test_anthropic_unknown_role_is_a_400_naming_the_field():
    # The typed request admits no other role: validation names the field.
    with pytest.raises(APIError) as e:
        anthropic_conv({"messages": [{"role": "robot", "content": "x"}]})
    assert e.value.status == 400 and e.value.param == "messages.0.role"


# --------------------------------------------------------------------------- OpenAI chat


def test_openai_chat_roles_tools_and_reasoning():
    body = {
        "messages": [
            {"role": "system", "content": "S1"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "q"}, {"type": "image_url", "image_url": {}}],
            },
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "think",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "f", "arguments": "not json"},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "r1"},
            {"role": "developer", "content": "D"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ],
    }
    conv = chat_conv(body)
    assert _roles(conv) == ["system", "user", "assistant", "tool", "user"]
    # A developer message after the first assistant turn is text of the user turn it
    # follows (issue 19: the KV holds the request's rendering).
    assert conv.messages[0].content == "S1" and conv.late_system == ""
    assert conv.messages[4].content == "<system-reminder>\nD\n</system-reminder>"
    assert conv.messages[1].content == "q\n\n[Unsupported Image]"
    a = conv.messages[2]
    assert a.reasoning == "think"
    assert a.tool_calls == [
        ToolCall(id="call_1", name="f", arguments={"x": 1}),
        ToolCall(id="call_2", name="f", arguments={"arguments": "not json"}),
    ]
    assert conv.tools[0].name == "f"


@pytest.mark.parametrize(
    "extra,thinking,effort",
    [
        ({}, True, None),
        ({"thinking": {"type": "disabled"}}, False, None),
        ({"think": False}, False, None),
        ({"chat_template_kwargs": {"thinking": False}}, False, None),
        ({"reasoning_effort": "none"}, False, None),
        ({"reasoning_effort": "max"}, True, "max"),
        ({"reasoning_effort": "low"}, True, "high"),
    ],
)
def test_openai_chat_thinking_switches(extra, thinking, effort):
    conv = chat_conv({"messages": [{"role": "user", "content": "q"}], **extra})
    assert (conv.thinking, conv.reasoning_effort) == (thinking, effort)


def test_openai_chat_alias_default_and_override():
    body = {"messages": [{"role": "user", "content": "q"}]}
    assert chat_conv(body, default_thinking=False).thinking is False
    assert chat_conv({**body, "thinking": {"type": "enabled"}}, default_thinking=False).thinking


# --------------------------------------------------------------------------- Responses


def test_responses_codex_shape():
    body = {
        "instructions": "INS",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "DEV"}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ENV"}]},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "say hi"}],
            },
            {"type": "reasoning", "summary": [], "encrypted_content": "ENC"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "exec_command",
                "arguments": '{"cmd":"ls"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "files"},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "r2"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "done"}],
            },
            {"type": "message", "role": "user", "content": "thanks"},
            {"type": "web_search_call", "status": "completed"},
        ],
        "tools": [
            {
                "type": "function",
                "name": "exec_command",
                "parameters": {"type": "object", "properties": {}},
            },
            {"type": "web_search", "external_web_access": False},
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "agents",
                "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}],
            },
            {
                "type": "custom",
                "name": "apply_patch",
                "description": "patch",
                "format": {"type": "text"},
            },
        ],
        "reasoning": {"summary": "auto"},
    }
    conv = responses_conv(body, decode_reasoning=lambda s: "r1" if s == "ENC" else None)
    assert _roles(conv) == ["system", "user", "user", "assistant", "tool", "assistant", "user"]
    assert conv.messages[0].content == "INS\n\nDEV"
    a1 = conv.messages[3]
    assert a1.reasoning == "r1" and a1.tool_calls[0].arguments == {"cmd": "ls"}
    a2 = conv.messages[5]
    assert (a2.reasoning, a2.content) == ("r2", "done")
    assert [t.name for t in conv.tools] == ["exec_command", "spawn", "apply_patch"]
    kinds = responses.tool_kinds(validate(responses.ResponsesRequest, body).tools)
    assert kinds["spawn"].namespace == "multi_agent_v1"
    assert kinds["apply_patch"].kind == "custom"
    assert "web_search" not in kinds


def test_responses_string_input_effort_and_item_reference():
    conv = responses_conv({"input": "hi", "reasoning": {"effort": "none"}})
    assert _roles(conv) == ["user"] and conv.thinking is False
    with pytest.raises(WireError) as e:
        responses_conv({"input": [{"type": "item_reference", "id": "x"}]})
    assert e.value.param == "input[0]"


def test_responses_custom_tool_call_replay():
    conv = responses_conv(
        {
            "input": [
                {"role": "user", "content": "patch it"},
                {
                    "type": "custom_tool_call",
                    "call_id": "call_9",
                    "name": "apply_patch",
                    "input": "*** Begin",
                },
                {"type": "custom_tool_call_output", "call_id": "call_9", "output": "ok"},
            ]
        }
    )
    assert conv.messages[1].tool_calls[0].arguments == {"input": "*** Begin"}
    assert conv.messages[2].tool_call_id == "call_9"


# ----------------------------------------------------------------- issue 13, items 4, 5, 9


def test_billing_header_line_inside_a_block_keeps_the_rest_of_the_block():
    # Item 4: the header line is dropped, not the text after it.
    for system in (
        [{"type": "text", "text": BILLING + "\nYou are Claude Code."}],
        BILLING + "\nYou are Claude Code.",
    ):
        body = {"system": system, "messages": [{"role": "user", "content": "hi"}]}
        conv = anthropic_conv(body)
        assert conv.messages[0] == Message(role="system", content="You are Claude Code.")
        assert "You are Claude Code." in render_prompt(conv)
    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": BILLING + "\nEnvironment: linux"},
        ]
    }
    assert anthropic_conv(body).late_system == "Environment: linux"
    kept = anthropic_conv(
        {"system": BILLING + "\nYou are Claude Code.", "messages": body["messages"][:1]},
        keep_billing_header=True,
    )
    assert kept.messages[0].content == BILLING + "\nYou are Claude Code."


def test_interleaved_thinking_segments_are_not_glued():
    # Item 5: thinking r0, tool_use, thinking r1, tool_use in one assistant message.
    body = {
        "tools": [{"name": "ping", "input_schema": {"type": "object", "properties": {}}}],
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "r0", "signature": ""},
                    {"type": "tool_use", "id": "toolu_a", "name": "ping", "input": {}},
                    {"type": "thinking", "thinking": "r1", "signature": ""},
                    {"type": "tool_use", "id": "toolu_b", "name": "ping", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_a", "content": "1"},
                    {"type": "tool_result", "tool_use_id": "toolu_b", "content": "2"},
                ],
            },
        ],
    }
    conv = anthropic_conv(body)
    asst = conv.messages[1]
    assert asst.reasoning == "r0\n\nr1"
    assert [c.id for c in asst.tool_calls] == ["toolu_a", "toolu_b"]
    text = render_prompt(conv)
    assert "r0\n\nr1</think>" in text and "r0r1" not in text
    assert text.index('invoke name="ping"') > text.index("r1</think>")


def test_tool_result_is_error_reaches_the_model():
    # Item 9: the DS4 format has no error flag; the rendered result says it failed.
    def conv(is_error):
        block = {"type": "tool_result", "tool_use_id": "toolu_a", "content": "No such file"}
        if is_error is not None:
            block["is_error"] = is_error
        return anthropic_conv(
            {
                "messages": [
                    {"role": "user", "content": "go"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "toolu_a", "name": "read", "input": {}}
                        ],
                    },
                    {"role": "user", "content": [block]},
                ]
            }
        )

    failed = conv(True).messages[-1]
    assert failed.role == "tool" and failed.content == anthropic.TOOL_ERROR_PREFIX + "No such file"
    assert "<tool_result>" + anthropic.TOOL_ERROR_PREFIX + "No such file" in render_prompt(
        conv(True)
    )
    for ok in (False, None):
        assert conv(ok).messages[-1].content == "No such file"


def test_system_text_after_the_first_assistant_turn_joins_a_user_turn():
    """Issue 19: before the first assistant turn, system text renders after the tools
    section; after it, as ``<system-reminder>`` text of the user turn it follows (after
    its tool results and text, joined by a blank line), or opening the next user turn."""
    reminder = lambda t: f"<system-reminder>\n{t}\n</system-reminder>"  # noqa: E731
    body = {
        "system": "TOP",
        "messages": [
            {"role": "user", "content": "hello"},
            {"role": "system", "content": "EARLY"},
            {"role": "assistant", "content": "hi"},
            {"role": "system", "content": "OPENS"},
            {"role": "user", "content": "next"},
            {"role": "system", "content": "AFTER"},
        ],
    }
    conv = anthropic_conv(body)
    assert conv.late_system == "EARLY"
    text = render_prompt(conv)
    assert text.startswith("<｜begin▁of▁sentence｜>TOP\n\nEARLY<｜User｜>hello")
    assert text.endswith(
        f"hi<｜end▁of▁sentence｜><｜User｜>{reminder('OPENS')}\n\nnext\n\n{reminder('AFTER')}"
        "<｜Assistant｜><think>"
    )


@pytest.mark.parametrize("arguments", [[[]], 7, None, '{"query": "x"}', "not json"])
def test_tool_search_call_arguments_of_any_json_shape_map_without_error(arguments):
    """Found by the schema fuzz test: a ``tool_search_call`` whose ``arguments`` was a
    list raised TypeError (a 500). Any JSON value maps, like a function call's arguments:
    an object as is, anything else kept under ``"arguments"``."""
    req = validate(
        responses.ResponsesRequest,
        {
            "model": "m",
            "input": [
                {"type": "message", "role": "user", "content": "find tools"},
                {"type": "tool_search_call", "call_id": "ts_1", "arguments": arguments},
            ],
        },
    )
    conv = responses.to_conversation(req)
    call = conv.messages[-1].tool_calls[0]
    assert call.id == "ts_1" and isinstance(call.arguments, dict)
    render_prompt(conv)


def _fn(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def test_allowed_tools_keeps_every_tool_and_names_the_callable_ones():
    """``tool_choice: {"type": "allowed_tools", …}`` limits the calls to its list (its
    list used to be ignored, and the model could call any tool the request carried),
    while every tool stays in the conversation: the rendered prompt is the same whatever
    the list, so changing the list keeps the prompt cache (OpenAI's reason for the
    field; offering only the listed tools made each change a cache miss). The reply's
    grammar enforces the list (`test_structured_outputs.py`)."""
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    chat = {
        **base,
        "tools": [_fn("a"), _fn("b")],
        "tool_choice": {
            "type": "allowed_tools",
            "allowed_tools": {
                "mode": "required",
                "tools": [{"type": "function", "function": {"name": "b"}}],
            },
        },
    }
    conv = chat_conv(chat)
    assert [t.name for t in conv.tools] == ["a", "b"] and conv.tool_required
    assert conv.allowed_tools == {"b"}
    auto = chat_conv({**chat, "tool_choice": "required"})
    assert auto.allowed_tools is None
    assert render_prompt(conv) == render_prompt(auto)
    resp = {
        "model": "m",
        "input": "hi",
        "tools": [
            {"type": "function", "name": "fn", "parameters": {"type": "object"}},
            {"type": "custom", "name": "ap"},
        ],
        "tool_choice": {
            "type": "allowed_tools",
            "mode": "auto",
            "tools": [{"type": "custom", "name": "ap"}],
        },
    }
    conv = responses_conv(resp)
    assert [t.name for t in conv.tools] == ["fn", "ap"] and not conv.tool_required
    assert conv.allowed_tools == {"ap"}
    # A name that is not offered, or no list, is a 400 naming tool_choice.
    bad = {
        **resp,
        "tool_choice": {
            "type": "allowed_tools",
            "mode": "auto",
            "tools": [{"type": "function", "name": "zz"}],
        },
    }
    with pytest.raises(WireError, match="zz") as e:
        responses_conv(bad)
    assert e.value.param.startswith("tool_choice")
    for missing in ({}, {"tools": []}):
        with pytest.raises(WireError, match="tools"):
            choice = {"type": "allowed_tools", "mode": "auto", **missing}
            responses_conv({**resp, "tool_choice": choice})
