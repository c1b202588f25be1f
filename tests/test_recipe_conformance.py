"""Issue 20: DeepSeek's own request conversion (``deepseek-recipe``) as an oracle.

Every request below is converted and rendered twice: by ds4mlx (the protocol module's
``to_conversation``, then ``dsml.render``) and by recipe (its protocol request's
``convert``, then ``DeepseekV4Encoding.render_conversation``). The prompts must be equal,
or the request must be listed in `DIFFERENCES` with its class and reason (mirrored in
docs/CONFORMANCE.md, checked here too). A difference that is not listed fails, and so does a listed one
that vanished: the table cannot rot.

One difference is normalised rather than listed per request (class ``effort-preamble``):
recipe 0.2.0 renders DeepSeek V4 *Pro*'s reasoning-effort preamble ("Absolute maximum…"
for no effort or ``high``, "Beyond maximum…" for ``max``), where the V4 Flash encoding
ds4mlx matches renders "Absolute maximum…" for ``max`` only. Recipe has no V4 Flash
version, so the suite replaces recipe's preamble with the one the Flash rule gives, and
checks that it did so for exactly the thinking requests.
"""

from __future__ import annotations

import re
from typing import Any

import deepseek_recipe as recipe
import pytest

from ds4mlx.dsml import render
from ds4mlx.dsml.tokens import BOS, REASONING_EFFORT_MAX_PREAMBLE
from ds4mlx.routes import anthropic, constraints, openai, responses
from ds4mlx.routes.body import validate
from ds4mlx.routes.pipeline import tell_format

MODEL = "ds4mlx-test"
CHAT, MSGS, RESP = "chat", "messages", "responses"

# --------------------------------------------------------------------------- requests

U = {"role": "user", "content": "What is the capital of France?"}
FN = {
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
CHAT_TOOL = {"type": "function", "function": FN}
ANT_TOOL = {"name": FN["name"], "description": FN["description"], "input_schema": FN["parameters"]}
RESP_TOOL = {"type": "function", **FN}
PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"
    "z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
PDF = "data:application/pdf;base64,JVBERi0xLjQK"


def _chat_call(call_id: str, city: str) -> dict[str, Any]:
    args = '{"city": "' + city + '"}'
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": args},
    }


# A structured-output format (its schema has a description the model must see).
_FORMAT = {
    "name": "weather",
    "strict": True,
    "schema": {
        "type": "object",
        "properties": {"temp": {"type": "integer", "description": "Fahrenheit, not Celsius"}},
        "required": ["temp"],
        "additionalProperties": False,
    },
}


def _chat_cases() -> dict[str, dict[str, Any]]:
    on, off = {"thinking": {"type": "enabled"}}, {"thinking": {"type": "disabled"}}
    sys = {"role": "system", "content": "You are terse."}
    call_turn = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need the weather.",
        "tool_calls": [_chat_call("call_1", "Paris")],
    }
    two_calls = {
        "role": "assistant",
        "content": "Checking both.",
        "reasoning_content": "Two cities.",
        "tool_calls": [_chat_call("call_a", "Paris"), _chat_call("call_b", "Rome")],
    }
    result = {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21C"}
    answer = {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy."}
    return {
        "chat-plain-off": {"messages": [U], **off},
        "chat-system-off": {"messages": [sys, U], **off},
        "chat-system-high": {"messages": [sys, U], **on, "reasoning_effort": "high"},
        "chat-max": {"messages": [sys, U], **on, "reasoning_effort": "max"},
        "chat-default-thinking": {"messages": [U]},
        "chat-effort-none": {"messages": [U], "reasoning_effort": "none"},
        "chat-tools-on": {"messages": [sys, U], "tools": [CHAT_TOOL], **on},
        "chat-tools-off": {"messages": [U], "tools": [CHAT_TOOL], **off},
        "chat-tool-result-on": {"messages": [U, call_turn, result], "tools": [CHAT_TOOL], **on},
        "chat-tool-result-off": {
            "messages": [U, {**call_turn, "reasoning_content": None}, result],
            "tools": [CHAT_TOOL],
            **off,
        },
        "chat-two-results-reordered": {
            "messages": [
                U,
                two_calls,
                {"role": "tool", "tool_call_id": "call_b", "content": "Rain"},
                {"role": "tool", "tool_call_id": "call_a", "content": "Sun"},
            ],
            "tools": [CHAT_TOOL],
            **on,
        },
        "chat-result-then-user-text": {
            "messages": [U, call_turn, result, {"role": "user", "content": "And tomorrow?"}],
            "tools": [CHAT_TOOL],
            **on,
        },
        "chat-multi-turn-on": {
            "messages": [U, answer, {"role": "user", "content": "And Italy?"}],
            **on,
        },
        "chat-multi-turn-off": {
            "messages": [U, {"role": "assistant", "content": "Paris."}, {**U, "content": "Italy?"}],
            **off,
        },
        "chat-late-developer": {
            "messages": [sys, U, answer, {"role": "developer", "content": "Be brief."}, U],
            **on,
        },
        "chat-late-system-tools": {
            "messages": [sys, U, {"role": "system", "content": "Env: linux."}],
            "tools": [CHAT_TOOL],
            **on,
        },
        "chat-developer-first": {
            "messages": [{"role": "developer", "content": "Rules."}, U],
            **off,
        },
        "chat-tool-choice-none": {
            "messages": [U],
            "tools": [CHAT_TOOL],
            "tool_choice": "none",
            **on,
        },
        "chat-tool-choice-required": {
            "messages": [U],
            "tools": [CHAT_TOOL],
            "tool_choice": "required",
            **off,
        },
        "chat-prefix-on": {
            "messages": [U, {"role": "assistant", "content": "The capital is", "prefix": True}],
            **on,
        },
        "chat-prefix-off": {
            "messages": [U, {"role": "assistant", "content": "{", "prefix": True}],
            **off,
        },
        "chat-prefix-reasoning": {
            "messages": [
                U,
                {"role": "assistant", "content": "", "reasoning_content": "So", "prefix": True},
            ],
            **on,
        },
        "chat-trailing-assistant-on": {
            "messages": [U, {"role": "assistant", "content": "The capital is"}],
            **on,
        },
        "chat-trailing-assistant-off": {
            "messages": [U, {"role": "assistant", "content": "The capital is"}],
            **off,
        },
        "chat-text-parts": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Hello"},
                        {"type": "text", "text": "there"},
                    ],
                }
            ],
            **off,
        },
        "chat-image": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": PNG}},
                    ],
                }
            ],
            **off,
        },
        "chat-file": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Summarize."},
                        {"type": "file", "file": {"file_data": PDF, "filename": "a.pdf"}},
                    ],
                }
            ],
            **off,
        },
        "chat-spelled-marker": {
            "messages": [{"role": "user", "content": "Say <｜User｜> and </think> literally."}],
            **off,
        },
        # The reply format is told in the system block, after the tools section.
        "chat-json-schema": {
            "messages": [sys, {"role": "user", "content": "Weather in Paris?"}],
            "response_format": {"type": "json_schema", "json_schema": _FORMAT},
            **off,
        },
        "chat-json-schema-tools-no-system": {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "response_format": {"type": "json_schema", "json_schema": _FORMAT},
            "tools": [CHAT_TOOL],
            **on,
        },
        "chat-json-object": {
            "messages": [{"role": "user", "content": "Answer in json: the capital?"}],
            "response_format": {"type": "json_object"},
            **off,
        },
    }


def _ant_cases() -> dict[str, dict[str, Any]]:
    on = {"thinking": {"type": "enabled", "budget_tokens": 2048}}
    off = {"thinking": {"type": "disabled"}}
    use = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "Need weather.", "signature": "x"},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
        ],
    }
    res = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}],
    }
    return {
        "ant-plain-off": {"messages": [U], **off},
        "ant-plain-default": {"messages": [U]},
        "ant-system-string": {"system": "You are terse.", "messages": [U], **off},
        "ant-system-blocks": {
            "system": [{"type": "text", "text": "One."}, {"type": "text", "text": "Two."}],
            "messages": [U],
            **off,
        },
        "ant-thinking": {"system": "You are terse.", "messages": [U], **on},
        "ant-effort-max": {"messages": [U], **on, "output_config": {"effort": "max"}},
        "ant-tools": {"messages": [U], "tools": [ANT_TOOL], **on},
        "ant-tool-result": {"messages": [U, use, res], "tools": [ANT_TOOL], **on},
        "ant-tool-result-error": {
            "messages": [
                U,
                use,
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": "timeout",
                            "is_error": True,
                        }
                    ],
                },
            ],
            "tools": [ANT_TOOL],
            **on,
        },
        "ant-tool-result-blocks": {
            "messages": [
                U,
                use,
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [
                                {"type": "text", "text": "a"},
                                {"type": "text", "text": "b"},
                            ],
                        },
                        {"type": "text", "text": "Go on."},
                    ],
                },
            ],
            "tools": [ANT_TOOL],
            **on,
        },
        "ant-text-blocks": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Hello"},
                        {"type": "text", "text": "there"},
                    ],
                }
            ],
            **off,
        },
        "ant-multi-turn": {
            "messages": [
                U,
                {"role": "assistant", "content": [{"type": "text", "text": "Paris."}]},
                {"role": "user", "content": "And Italy?"},
            ],
            **on,
        },
        "ant-prefill": {
            "messages": [U, {"role": "assistant", "content": "The capital is"}],
            **off,
        },
        "ant-prefill-thinking": {
            "messages": [U, {"role": "assistant", "content": "{"}],
            **on,
        },
        "ant-tool-choice-none": {
            "messages": [U],
            "tools": [ANT_TOOL],
            "tool_choice": {"type": "none"},
            **off,
        },
        "ant-image": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": PNG.split(",", 1)[1],
                            },
                        },
                        {"type": "text", "text": "What is this?"},
                    ],
                }
            ],
            **off,
        },
        # Documents name their media type (unknown for a source without one).
        "ant-documents": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Compare."},
                        {
                            "type": "document",
                            "source": {"type": "text", "media_type": "text/plain", "data": "A"},
                        },
                        {"type": "document", "source": {"type": "text", "data": "B"}},
                        {
                            "type": "document",
                            "source": {
                                "type": "base64",
                                "media_type": "application/pdf",
                                "data": PDF.split(",", 1)[1],
                            },
                        },
                    ],
                }
            ],
            **off,
        },
        "ant-document-in-tool-result": {
            "messages": [
                U,
                {"role": "assistant", "content": use["content"][1:]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [
                                {"type": "text", "text": "Found:"},
                                {
                                    "type": "document",
                                    "source": {"type": "url", "url": "https://x.example/a.pdf"},
                                },
                            ],
                        }
                    ],
                },
            ],
            "tools": [ANT_TOOL],
            **off,
        },
    }


def _resp_cases() -> dict[str, dict[str, Any]]:
    high, none = {"reasoning": {"effort": "high"}}, {"reasoning": {"effort": "none"}}
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    out = {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}
    said = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Paris."}],
    }
    return {
        "resp-string": {"input": "What is the capital of France?", **none},
        "resp-string-default": {"input": "What is the capital of France?"},
        "resp-instructions": {"instructions": "You are terse.", "input": "Hi", **none},
        "resp-high": {"instructions": "You are terse.", "input": "Hi", **high},
        "resp-max": {"input": "Hi", "reasoning": {"effort": "xhigh"}},
        "resp-tools": {"input": "Weather?", "tools": [RESP_TOOL], **high},
        "resp-tool-output": {
            "input": [{"role": "user", "content": "Weather?"}, call, out],
            "tools": [RESP_TOOL],
            **high,
        },
        "resp-tool-output-off": {
            "input": [{"role": "user", "content": "Weather?"}, call, out],
            "tools": [RESP_TOOL],
            **none,
        },
        "resp-multi-turn": {
            "input": [
                {"role": "user", "content": "France?"},
                said,
                {"role": "user", "content": "Italy?"},
            ],
            **high,
        },
        "resp-developer": {
            "input": [
                {"role": "developer", "content": "Rules."},
                {"role": "user", "content": "Hi"},
            ],
            **none,
        },
        "resp-late-developer": {
            "instructions": "You are terse.",
            "input": [
                {"role": "user", "content": "Hi"},
                said,
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Again"},
            ],
            **high,
        },
        "resp-image": {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": PNG},
                    ],
                }
            ],
            **none,
        },
        "resp-file": {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Summarize."},
                        {"type": "input_file", "file_data": PDF, "filename": "a.pdf"},
                    ],
                }
            ],
            **none,
        },
        "resp-tool-choice-none": {
            "input": "Weather?",
            "tools": [RESP_TOOL],
            "tool_choice": "none",
            **none,
        },
        # Codex's client-run tool search: the search call and the tools it loaded.
        "resp-tool-search": {
            "input": [
                {"role": "user", "content": "Weather?"},
                {
                    "type": "tool_search_call",
                    "call_id": "call_s",
                    "arguments": {"query": "weather"},
                    "execution": "client",
                    "status": "completed",
                },
                {
                    "type": "tool_search_output",
                    "call_id": "call_s",
                    "tools": [RESP_TOOL],
                    "execution": "client",
                    "status": "completed",
                },
            ],
            "tools": [{"type": "tool_search", "execution": "client"}],
            **none,
        },
        "resp-trailing-assistant": {
            "input": [{"role": "user", "content": "France?"}, said],
            **none,
        },
        "resp-json-schema": {
            "instructions": "Be brief.",
            "input": "Weather in Paris?",
            "text": {"format": {"type": "json_schema", **_FORMAT}},
            **none,
        },
    }


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    **{k: (CHAT, v) for k, v in _chat_cases().items()},
    **{k: (MSGS, {"max_tokens": 1000, **v}) for k, v in _ant_cases().items()},
    **{k: (RESP, v) for k, v in _resp_cases().items()},
}

# --------------------------------------------------------------------------- differences

# request id -> (difference class, reason). Mirrored in docs/CONFORMANCE.md (checked).
_LATE = (
    "late-system-after-tools",
    "ds4mlx hoists system/developer text met inside the conversation into the leading system "
    "block after the tools section, so the top-level system text and tools stay a prefix a "
    "retry shares; recipe keeps it in place",
)
_PREFILL = (
    "anthropic-prefill",
    "Anthropic's prefill contract: ds4mlx continues a trailing assistant message (open, no "
    "EOS); recipe closes it and opens a new reply",
)
_DEV = (
    "recipe-rejects-developer",
    "recipe's chat conversion refuses OpenAI's developer role; ds4mlx treats it as system text",
)
DIFFERENCES: dict[str, tuple[str, str]] = {
    "chat-late-developer": _DEV,
    "chat-developer-first": _DEV,
    "chat-late-system-tools": _LATE,
    "resp-late-developer": _LATE,
    "resp-developer": (
        "developer-as-system",
        "a leading Responses developer message is system text in ds4mlx (as in chat); recipe "
        "renders it as user text joined to the next user message",
    ),
    "chat-tool-choice-required": (
        "forced-call-in-turn",
        "recipe writes the forced tool-call opener into the prompt; ds4mlx feeds the same "
        "bytes from the turn loop once the visible reply starts (after </think> in thinking "
        "mode), so they are part of the sampled turn and its live state",
    ),
    "ant-system-blocks": (
        "system-block-join",
        "ds4mlx joins Anthropic system blocks with a newline (Claude Code splits one prompt "
        "into blocks); recipe with a blank line",
    ),
    "ant-tool-result-error": (
        "tool-error-prefix",
        "ds4mlx marks an is_error tool result with '[tool error] ' so the model sees the "
        "failure; recipe drops is_error",
    ),
    "ant-prefill": _PREFILL,
    "ant-prefill-thinking": _PREFILL,
    "resp-tool-search": (
        "tool-search",
        "recipe drops a client-run tool_search tool and the tool_search_call / "
        "tool_search_output items; ds4mlx offers the search as a function tool_search and "
        "renders the exchange as its call and its tool result (the loaded tools' schemas)",
    ),
}

# --------------------------------------------------------------------------- rendering


def ds4mlx_prompt(proto: str, body: dict[str, Any]) -> tuple[str, bool]:
    """ds4mlx's rendering of a request and whether it renders in thinking mode."""
    if proto == CHAT:
        req = validate(openai.ChatRequest, body)
        conv = openai.to_conversation(req)
        tell_format(conv, constraints.read(constraints.chat_constraint, req))
    elif proto == MSGS:
        conv = anthropic.to_conversation(validate(anthropic.MessagesRequest, body))
    else:
        req = validate(responses.ResponsesRequest, body)
        conv = responses.to_conversation(req)
        tell_format(conv, constraints.read(constraints.responses_constraint, req))
    return render(conv).text, conv.thinking


_KIND = {
    CHAT: recipe.ChatCompletionRequest,
    MSGS: recipe.MessagesRequest,
    RESP: recipe.ResponsesRequest,
}
_OPTIONS = recipe.ConversionOptions().with_model_alias(MODEL, recipe.ModelVersion.DeepseekV4Pro)
_PREAMBLE = re.compile(r"Reasoning Effort: [^\n]*\n(?:[^\n]+\n)*\n")


def recipe_prompt(proto: str, body: dict[str, Any]) -> str:
    """recipe's rendering of a request (V4 encoding), or ``error: …`` when it refuses."""
    try:
        req = _KIND[proto]({**body, "model": MODEL}).convert(_OPTIONS)
    except Exception as e:  # recipe's ConversionError
        return f"error: {e}"
    return recipe.DeepseekV4Encoding().render_conversation(req.conversation).prompt


def normalised(recipe_text: str, ours: str) -> tuple[str, bool]:
    """recipe's prompt with its V4 Pro effort preamble replaced by the one ds4mlx's V4
    Flash rule renders (the preamble ``ours`` carries, if any); True if it had one."""
    head = BOS
    if not recipe_text.startswith(head):
        return recipe_text, False
    m = _PREAMBLE.match(recipe_text, len(head))
    if m is None:
        return recipe_text, False
    flash = (
        REASONING_EFFORT_MAX_PREAMBLE
        if ours.startswith(head + REASONING_EFFORT_MAX_PREAMBLE)
        else ""
    )
    return head + flash + recipe_text[m.end() :], True


def _compare() -> tuple[dict[str, tuple[str, str]], set[str], set[str]]:
    """``(differing id -> (ours, recipe's)), ids normalised, ids recipe rendered in
    thinking mode)``."""
    diffs, normal, thinking = {}, set(), set()
    for rid, (proto, body) in CASES.items():
        ours, think = ds4mlx_prompt(proto, body)
        theirs, had = normalised(recipe_prompt(proto, body), ours)
        if had:
            normal.add(rid)
        if think and not theirs.startswith("error: "):
            thinking.add(rid)
        if ours != theirs:
            diffs[rid] = (ours, theirs)
    return diffs, normal, thinking


@pytest.fixture(scope="module")
def compared():
    return _compare()


def test_at_least_forty_requests_over_three_protocols():
    protos = [p for p, _ in CASES.values()]
    assert len(CASES) >= 40
    assert {CHAT, MSGS, RESP} == set(protos)


def test_every_difference_is_listed_and_every_listed_one_still_differs(compared):
    diffs, _, _ = compared
    new = {rid: diffs[rid] for rid in diffs if rid not in DIFFERENCES}
    gone = [rid for rid in DIFFERENCES if rid not in diffs]
    assert not new, "unlisted differences:\n" + "\n".join(
        f"{rid}:\n  ds4mlx: {o!r}\n  recipe: {t!r}" for rid, (o, t) in new.items()
    )
    assert not gone, f"listed differences that vanished (remove them): {gone}"
    assert set(DIFFERENCES) <= set(CASES)


def test_effort_preamble_is_the_one_normalised_difference(compared):
    """recipe renders a V4 Pro preamble in every thinking request and none outside."""
    _, normal, thinking = compared
    assert normal == thinking


def test_the_docs_table_mirrors_the_differences():
    """docs/CONFORMANCE.md lists exactly `DIFFERENCES` (id, class)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "CONFORMANCE.md").read_text()
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| `([a-z0-9-]+)` \|", text, re.M)
    assert dict(rows) == {rid: cls for rid, (cls, _) in DIFFERENCES.items()}
