"""Issue 4, must-hold 4: bad input gets a 4xx in the protocol's error shape, never a
5xx or a dead worker; after 200 such requests a normal request is still answered
correctly. Also: context clamping, the API key, CORS.
"""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
from server_util import HTTP, ws_upgrade

KEY = "sekret"
CTX = 1024
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir):
    return server_factory(
        tiny_model_dir, ctx=CTX, extra=["--api-key", KEY, "--cors"], scripted=False
    )


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


NORMAL = {
    "model": "deepseek-chat",
    "messages": [{"role": "user", "content": "Say something."}],
    "max_tokens": 6,
    "temperature": 0,
}

CHAT = "/v1/chat/completions"
MSGS = "/v1/messages"
RESP = "/v1/responses"
COMP = "/v1/completions"
OK_MSG = [{"role": "user", "content": "hi"}]


def _bad_requests():
    """(path, raw body bytes, expected status) for every kind of client mistake."""
    j = lambda o: json.dumps(o).encode()  # noqa: E731
    huge_prompt = "word " * (CTX * 2)
    deep = b"[" * 100_000 + b"]" * 100_000
    return [
        (CHAT, b'{"model": "x", "messages": [', 400),  # malformed JSON
        (MSGS, b'{"model": "x", max_tokens: 5}', 400),
        (RESP, b"not json at all", 400),
        (CHAT, b"", 400),  # empty body
        (CHAT, b"[1, 2, 3]", 400),  # not an object
        (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),  # invalid UTF-8
        (MSGS, b'{"max_tokens": 5, "messages": [{"role": "user", "content": "\xc3\x28"}]}', 400),
        (CHAT, deep, 400),  # deeply nested
        (MSGS, b'{"model":"m","max_tokens":5,"messages":' + deep + b"}", 400),
        (CHAT, j({"messages": "hello"}), 400),  # wrong types
        (CHAT, j({"messages": [{"role": "user", "content": 5}]}), 400),
        (CHAT, j({"messages": OK_MSG, "max_tokens": "many"}), 400),
        (CHAT, j({"messages": OK_MSG, "stream": {"yes": 1}}), 400),
        (CHAT, j({"messages": OK_MSG, "tools": [{"type": "function"}]}), 400),
        (
            MSGS,
            j(
                {
                    "model": "m",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": [{"type": "text"}]}],
                }
            ),
            400,
        ),
        (
            MSGS,
            j({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [5]}]}),
            400,
        ),
        (RESP, j({"input": [{"type": "function_call_output"}]}), 400),
        (RESP, j({"input": 42}), 400),
        (CHAT, j({"messages": [{"role": "wizard", "content": "x"}]}), 400),  # unknown roles
        (
            MSGS,
            j({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}),
            400,
        ),
        (RESP, j({"input": [{"role": "narrator", "content": "x"}]}), 400),
        (MSGS, j({"model": "m", "messages": OK_MSG}), 400),  # missing max_tokens
        (CHAT, j({"messages": []}), 400),  # empty messages
        (CHAT, j({"messages": OK_MSG, "max_tokens": -1}), 400),  # negative / huge numbers
        (CHAT, j({"messages": OK_MSG, "max_tokens": 0}), 400),
        (MSGS, j({"model": "m", "max_tokens": -5, "messages": OK_MSG}), 400),
        (CHAT, j({"messages": OK_MSG, "temperature": 1e308}), 400),
        (CHAT, j({"messages": OK_MSG, "temperature": -0.5}), 400),
        (CHAT, j({"messages": OK_MSG, "top_p": 7}), 400),
        (CHAT, j({"messages": OK_MSG, "top_k": -9}), 400),
        (CHAT, j({"messages": OK_MSG, "n": 3}), 400),
        (MSGS, j({"model": "m", "max_tokens": 5, "messages": OK_MSG, "temperature": 9}), 400),
        (RESP, j({"input": "hi", "max_output_tokens": -3}), 400),
        (COMP, j({"prompt": [0, 10**12]}), 400),  # token id outside the vocabulary
        (COMP, j({"prompt": "x", "logprobs": 1000}), 400),
        ("/v1/detokenize", j({"tokens": [-1]}), 400),
        ("/v1/tokenize", j({"text": "a", "prompt": "bbbb"}), 400),  # which one? (was: text)
        (RESP, j({"input": "hi", "previous_response_id": "resp_1"}), 400),  # no store
        (RESP, j({"input": [{"type": "item_reference", "id": "msg_1"}]}), 400),
        (RESP, j({"input": "hi", "conversation": "conv_1"}), 400),
        (
            CHAT,
            j({"messages": [{"role": "user", "content": huge_prompt}]}),
            400,
        ),  # over the context
        (
            MSGS,
            j(
                {
                    "model": "m",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": huge_prompt}],
                }
            ),
            400,
        ),
        (RESP, j({"input": huge_prompt}), 400),
        (COMP, j({"prompt": huge_prompt}), 400),
        (CHAT, b"null", 400),
        # tool_choice values that cannot be honoured
        (CHAT, j({"messages": OK_MSG, "tool_choice": "banana"}), 400),
        (CHAT, j({"messages": OK_MSG, "tool_choice": "required"}), 400),  # no tools
        (
            CHAT,
            j(
                {
                    "messages": OK_MSG,
                    "tools": [TOOL_OAI],
                    "tool_choice": {"type": "function", "function": {"name": "nope"}},
                }
            ),
            400,
        ),
        (MSGS, j({"max_tokens": 5, "messages": OK_MSG, "tool_choice": {"type": "any"}}), 400),
        (
            MSGS,
            j(
                {
                    "max_tokens": 5,
                    "messages": OK_MSG,
                    "tools": [TOOL_ANT],
                    "tool_choice": {"type": "banana"},
                }
            ),
            400,
        ),
        (
            MSGS,
            j(
                {
                    "max_tokens": 5,
                    "messages": OK_MSG,
                    "tools": [TOOL_ANT],
                    "tool_choice": {"type": "tool", "name": "nope"},
                }
            ),
            400,
        ),
        (RESP, j({"input": "hi", "tools": [TOOL_RESP], "tool_choice": "banana"}), 400),
        (RESP, j({"input": "hi", "tool_choice": {"type": "function", "name": "f"}}), 400),
        (
            RESP,
            j({"input": "hi", "tools": [{"type": "namespace", "name": "n", "tools": [5]}]}),
            400,
        ),
        (RESP, j({"input": "hi", "tools": [{"type": "custom", "name": "c", "format": "x"}]}), 400),
        (RESP, j({"input": "hi", "tools": [{"type": "function"}], "tool_choice": "required"}), 400),
        (CHAT, b"{" + b'"a":' * 1 + b'"' + b"x" * (40 * 2**20) + b'"}', 413),  # 40 MB body
    ]


TOOL_OAI = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_ANT = {"name": "f", "input_schema": {"type": "object"}}
TOOL_RESP = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def _check_shape(path: str, r: httpx.Response) -> None:
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}, body
    else:
        # A context-length error also names its counts (n_prompt_tokens, n_ctx).
        extra = (
            {"n_prompt_tokens", "n_ctx"}
            if body["error"].get("code") == "context_length_exceeded"
            else set()
        )
        assert set(body["error"]) == {"message", "type", "param", "code"} | extra, body


def test_bad_input_gets_protocol_shaped_4xx_and_server_survives(client):
    baseline = client.post(CHAT, json=NORMAL).json()["choices"][0]["message"]["content"]
    cases = _bad_requests()
    sent = 0
    for path, raw, status in itertools.islice(itertools.cycle(cases), 200):
        if len(raw) > 2**20 and sent >= len(cases):
            raw, status = b'{"messages": 1}', 400  # send the 40 MB body once only
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status, (path, raw[:80], r.status_code, r.text[:300])
        _check_shape(path, r)
        sent += 1
    assert sent == 200
    # Deeply nested tool schemas and odd-but-valid values do not crash the worker either.
    odd = {**NORMAL, "seed": 2**80, "temperature": 1e-9, "stop": ["\x00"], "top_k": -1}
    assert client.post(CHAT, json=odd).status_code == 200
    again = client.post(CHAT, json=NORMAL).json()["choices"][0]["message"]["content"]
    assert again == baseline


def test_lone_surrogate_is_a_400_naming_the_field_on_every_endpoint(client):
    """``"\\ud800"`` is valid JSON but no Unicode character: a 400 naming the field,
    never the tokenizer's TypeError as a 500."""
    bad = '"hi \\ud800 x"'
    msgs = '[{"role":"user","content":' + bad + "}]"
    cases = [
        (CHAT, '{"messages":' + msgs + ',"max_tokens":3}', "messages.0.content"),
        (MSGS, '{"max_tokens":3,"messages":' + msgs + "}", None),
        ("/v1/messages/count_tokens", '{"messages":' + msgs + "}", None),
        (COMP, '{"prompt":' + bad + ',"max_tokens":3}', "prompt"),
        (RESP, '{"input":' + bad + "}", "input"),
        ("/v1/tokenize", '{"text":' + bad + "}", "text"),
        ("/v1/tokenize", '{"messages":' + msgs + "}", "messages.0.content"),
        (CHAT, '{"messages":[{"role":"user","content":"ok"}],"stop":["\\udc00"]}', "stop.0"),
    ]
    for path, raw, param in cases:
        r = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.status_code, r.text)
        _check_shape(path, r)
        err = r.json()["error"]
        assert "surrogate" in err["message"], err
        if param:
            assert err["param"] == param, err
    # A proper surrogate pair is an ordinary character.
    ok = '{"messages":[{"role":"user","content":"\\ud83d\\ude00"}],"max_tokens":2}'
    r = client.post(CHAT, content=ok.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


TOOL_TURN = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
]


def _tool_result(content) -> list:
    block = {"type": "tool_result", "tool_use_id": "t1", "content": content}
    return [*TOOL_TURN, {"role": "user", "content": [block]}]


def _resp_output(kind: str, output) -> list:
    call = {"type": kind.replace("_output", ""), "call_id": "c2", "name": "g"}
    return [
        {"role": "user", "content": "hi"},
        call,
        {"type": kind, "call_id": "c2", "output": output},
    ]


@pytest.mark.parametrize(
    "path, body, param",
    [
        (RESP, {"input": [{"type": ["message"], "role": "user", "content": "hi"}]}, "input.0.type"),
        (RESP, {"input": [{"type": {"a": 1}, "role": "user", "content": "hi"}]}, "input.0.type"),
        (
            MSGS,
            {"messages": [{"role": "user", "content": [{"type": ["text"], "text": "hi"}]}]},
            "messages.0.content.0.type",
        ),
        (
            "/v1/messages/count_tokens",
            {"messages": [{"role": "user", "content": [{"type": {"a": 1}, "text": "hi"}]}]},
            "messages.0.content.0.type",
        ),
        (
            MSGS,
            {"messages": _tool_result([{"type": "text", "text": 5}])},
            "messages.2.content.0.content.0.text",
        ),
        (
            MSGS,
            {"messages": _tool_result([{"type": ["image"]}])},
            "messages.2.content.0.content.0.type",
        ),
        (
            RESP,
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {
                        "type": "reasoning",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": 5}],
                    },
                ]
            },  # fmt: skip
            "input.1.content.0.text",
        ),
        (
            RESP,
            {"input": _resp_output("function_call_output", [{"type": 5}])},
            "input.2.output.0.type",
        ),
        (
            RESP,
            {"input": _resp_output("custom_tool_call_output", [{"type": "input_text", "text": 5}])},
            "input.2.output.0.text",
        ),
    ],
)
def test_a_content_part_of_the_wrong_shape_is_a_400_naming_it(client, path, body, param):
    """A list where a part's ``type`` goes, a number for its ``text``: 400s (they were
    500s, which the SDKs retried)."""
    body = {"model": "m", "max_tokens": 1, **body}
    r = client.post(path, json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    # OpenAI's shape names the field in param; Anthropic's (no param) in the message.
    assert err["param"] == param if "param" in err else param in err["message"], err


def test_error_params_point_at_the_real_field(client):
    r = client.post(RESP, json={"input": [{"role": "wizard", "content": "x"}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input.0.role", err
    assert "'user'" in err["message"]
    for path, body, param in [
        (RESP, {"input": "w " * 3000}, "input"),
        (COMP, {"prompt": "w " * 3000}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": "w " * 3000}]}, "messages"),
    ]:
        err = client.post(path, json=body).json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param, err
    r = client.post(CHAT, content=b"null", headers={"content-type": "application/json"})
    assert r.json()["error"]["message"] == "request body must be a JSON object, got null"


def _fn(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


# (path, body, param or None for Anthropic, words the message must hold)
STRICT_CASES = [
    # A JSON type is never coerced: `true` is no token count, `"yes"` no boolean, 2.0 no int.
    (CHAT, {"messages": OK_MSG, "max_tokens": True}, "max_tokens", "valid integer"),
    (CHAT, {"messages": OK_MSG, "stream": "yes"}, "stream", "valid boolean"),
    (COMP, {"prompt": "hi", "max_tokens": 2.0}, "max_tokens", "valid integer"),
    (COMP, {"prompt": "hi", "echo": "no"}, "echo", "valid boolean"),
    (RESP, {"input": "hi", "max_output_tokens": True}, "max_output_tokens", "valid integer"),
    (MSGS, {"messages": OK_MSG, "max_tokens": "5"}, None, "max_tokens"),
    # NaN is no number (Python's parser reads the literal).
    (CHAT, {"messages": OK_MSG, "temperature": float("nan")}, "temperature", "finite number"),
    # Effort words outside the protocols' own.
    (CHAT, {"messages": OK_MSG, "reasoning_effort": "huge"}, "reasoning_effort", "'huge'"),
    (RESP, {"input": "hi", "reasoning": {"effort": "huge"}}, "reasoning.effort", "'huge'"),
    (
        MSGS,
        {"messages": OK_MSG, "max_tokens": 5, "output_config": {"effort": "huge"}},
        None,
        "output_config.effort",
    ),
    # Thinking switches that are no switch: refused, not read as "on".
    (CHAT, {"messages": OK_MSG, "thinking": {"type": "bogus"}}, "thinking.type", "'bogus'"),
    (
        CHAT,
        {"messages": OK_MSG, "chat_template_kwargs": {"thinking": "no"}},
        "chat_template_kwargs.thinking",
        "a JSON boolean",
    ),
    # OpenAI's deprecated function calling: refused, not ignored (nothing was offered).
    (CHAT, {"messages": OK_MSG, "functions": [{"name": "f"}]}, "functions", "send tools"),
    (CHAT, {"messages": OK_MSG, "function_call": "auto"}, "function_call", "tool_choice"),
    # Two tools of one name: their calls would be ambiguous.
    (CHAT, {"messages": OK_MSG, "tools": [_fn("a"), _fn("a")]}, "tools", "named 'a'"),
    (RESP, {"input": "hi", "tools": [TOOL_RESP, TOOL_RESP]}, "tools", "named 'f'"),
    (MSGS, {"messages": OK_MSG, "max_tokens": 5, "tools": [TOOL_ANT, TOOL_ANT]}, None, "named 'f'"),
    # One tool_use id for two calls: a result could not name its call (Anthropic's 400).
    (
        MSGS,
        {
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
                        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}],
                },
            ],
        },
        None,
        "messages.1.content.1: `tool_use` ids must be unique",
    ),
    # A custom Anthropic tool needs its schema (server tools have a versioned type).
    (
        MSGS,
        {"messages": OK_MSG, "max_tokens": 5, "tools": [{"name": "x"}]},
        None,
        "tools[0].input_schema",
    ),
    (
        MSGS,
        {"messages": OK_MSG, "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": -1}},
        None,
        "budget_tokens",
    ),
    # The reasoning's budget must leave room for the reply.
    (
        MSGS,
        {
            "messages": OK_MSG,
            "max_tokens": 1400,
            "thinking": {"type": "enabled", "budget_tokens": 2000},
        },
        None,
        "max_tokens must be greater than thinking.budget_tokens",
    ),
    # A tool result without the id of its call.
    (
        CHAT,
        {
            "messages": [
                *OK_MSG,
                {"role": "assistant", "content": "x"},
                {"role": "tool", "content": "r"},
            ]
        },
        "messages.2.tool_call_id",
        "tool_call_id: required",
    ),
    (
        CHAT,
        {
            "messages": OK_MSG,
            "tools": [_fn("a")],
            "tool_choice": {
                "type": "allowed_tools",
                "allowed_tools": {"mode": "auto", "tools": [5]},
            },
        },
        "tool_choice",
        "entry 5 is not a tool object",
    ),
    (RESP, {"input": "hi", "truncation": "sometimes"}, "truncation", "'auto' or 'disabled'"),
    (CHAT, {"messages": OK_MSG, "metadata": "x"}, "metadata", "valid dictionary"),
    (RESP, {"input": "hi", "include": ["everything"]}, "include.0", "reasoning.encrypted_content"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), STRICT_CASES)
def test_values_of_the_wrong_type_or_outside_the_protocol_are_400s(
    client, path, body, param, words
):
    r = client.post(
        path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, (body, r.status_code, r.text[:300])
    _check_shape(path, r)
    err = r.json()["error"]
    assert words in err["message"], err
    if param is not None:
        assert err["param"] == param, err


def test_a_huge_integer_is_a_400_in_the_apis_words(client):
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"7" * 5000 + b"}"
    r = client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "more than 4300 digits" in msg and "sys." not in msg, msg


def test_the_protocols_own_values_are_accepted(client):
    ok = [
        (
            CHAT,
            {"messages": OK_MSG, "max_tokens": 2, "reasoning_effort": "XHigh", "temperature": 1},
        ),
        (CHAT, {"messages": OK_MSG, "max_tokens": 2, "logit_bias": {"1000": 1}}),
        (
            RESP,
            {
                "input": "hi",
                "max_output_tokens": 2,
                "truncation": "auto",
                "include": ["reasoning.encrypted_content"],
                "reasoning": {"effort": "minimal"},
            },
        ),
        (
            MSGS,
            {
                "messages": OK_MSG,
                "max_tokens": 2,
                "output_config": {"effort": "max"},
                "thinking": {"type": "enabled"},  # no budget: served uncapped
                "tools": [TOOL_ANT, {"type": "web_search_20250305", "name": "web_search"}],
            },
        ),
    ]
    for path, body in ok:
        r = client.post(path, json=body)
        assert r.status_code == 200, (body, r.text[:300])


def test_hosted_tool_types_are_logged_once_each(server, client):
    """Hosted (server-run) tool types are accepted and not offered: the log says so once
    per type, not per request (Codex sends ``web_search`` with every request). Before,
    nothing told the operator why a web search never happened."""
    resp = {"input": "hi", "max_output_tokens": 2, "store": False}
    msgs = {"messages": OK_MSG, "max_tokens": 2}
    for _ in range(2):
        for path, body in [
            (RESP, {**resp, "tools": [{"type": "web_search"}, {"type": "code_interpreter"}]}),
            (MSGS, {**msgs, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
        ]:
            r = client.post(path, json=body)
            assert r.status_code == 200, r.text[:300]
        # A model name the server does not list: said once too (the same rule).
        r = client.post(MSGS, json={**msgs, "model": "claude-hosted-tools-test"})
        assert r.status_code == 200, r.text[:300]
    log = server.log()
    for kind in ("web_search", "code_interpreter", "web_search_20250305"):
        line = f"tool type '{kind}' is accepted and not offered to the model"
        assert log.count(line) == 1, (kind, log[-2000:])
    assert log.count("model 'claude-hosted-tools-test' is not a served id") == 1, log[-2000:]


def test_first_time_is_bounded() -> None:
    """What is logged once per name: once each, and nothing past the bound (the names
    are client-chosen; a client sending ever new ones must not grow the set)."""
    from ds4mlx.routes.common import MAX_NOTED, first_time

    seen: set[str] = set()
    assert first_time(seen, "a") and not first_time(seen, "a")
    assert all(first_time(seen, f"n{i}") for i in range(MAX_NOTED - 1))
    assert not first_time(seen, "one more") and len(seen) == MAX_NOTED


@pytest.mark.parametrize("path", [CHAT, COMP])
def test_logit_bias_out_of_range_is_a_400_naming_the_entry(client, path):
    """Token ids outside the vocabulary (129280 ids) or negative, and biases outside
    OpenAI's [-100, 100], are refused with the entry's path (they were accepted)."""
    base = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    for bias, param in [
        ({"129280": 1}, "logit_bias.129280"),
        ({"10": 1, "999999999": -5}, "logit_bias.999999999"),
        ({"-1": 1}, "logit_bias.-1"),
        ({"5": 100.5}, "logit_bias.5"),
        ({"5": -101}, "logit_bias.5"),
        ({"x": 1}, "logit_bias.x"),
    ]:
        r = client.post(path, json={**base, "max_tokens": 1, "logit_bias": bias})
        assert r.status_code == 400, (bias, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"].startswith(param), (bias, err)
    r = client.post(path, json={**base, "max_tokens": 1, "logit_bias": {"129279": -100, "0": 1}})
    assert r.status_code == 200, r.text
    # The bias is applied: +100 on one id makes a greedy turn sample only that id.
    body = {**base, "model": "deepseek-chat", "max_tokens": 3, "temperature": 0}
    r = client.post(path, json={**body, "logit_bias": {"1000": 100}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    want = client.post("/v1/detokenize", json={"tokens": [1000] * 3}).json()["text"]
    assert text == want and r.json()["usage"]["completion_tokens"] == 3, (text, want)


@pytest.mark.parametrize("path", [CHAT, COMP])
def test_presence_and_frequency_penalties_are_applied_or_refused(client, path):
    """OpenAI's ``presence_penalty`` and ``frequency_penalty`` (they were accepted and
    ignored): outside [-2, 2], NaN or infinite they are a 400 naming the field; within
    it they change a greedy reply (negative penalties make the tiny model repeat the
    tokens it produced; the formula itself is `test_turn.py`'s)."""
    base = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    base = {**base, "model": "deepseek-chat", "max_tokens": 16, "temperature": 0}
    for field in ("presence_penalty", "frequency_penalty"):
        for value in ("2.5", "-2.01", "NaN", "Infinity"):
            raw = json.dumps(base)[:-1] + f', "{field}": {value}}}'
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (field, value, r.text)
            assert r.json()["error"]["param"] == field, r.text

    def text(**extra) -> str:
        r = client.post(path, json={**base, **extra})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if path == CHAT else choice["text"]

    plain = text()
    assert text(presence_penalty=0, frequency_penalty=0) == plain
    assert text(presence_penalty=-2, frequency_penalty=-2) != plain


@pytest.mark.parametrize("path", [CHAT, COMP])
def test_the_repetition_penalty_is_applied_or_refused(client, path):
    """vLLM's ``repetition_penalty``: a factor above 0 (else a 400 naming it) that
    changes a greedy reply (the formula is `test_turn.py`'s)."""
    base = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    base = {**base, "model": "deepseek-chat", "max_tokens": 16, "temperature": 0}
    for value in ("0", "-1", "NaN", "true"):
        raw = json.dumps(base)[:-1] + f', "repetition_penalty": {value}}}'
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text

    def text(**extra) -> str:
        r = client.post(path, json={**base, **extra})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if path == CHAT else choice["text"]

    assert text(repetition_penalty=1.0) == text()
    assert text(repetition_penalty=0.2) != text()


@pytest.mark.parametrize("path", [CHAT, COMP])
def test_min_tokens_and_ignore_eos_keep_eos_out_or_are_refused(client, path):
    """vLLM's ``min_tokens`` and ``ignore_eos`` (they were accepted and ignored): with
    EOS pushed to the top of a greedy turn the reply ends at once; ``min_tokens: 4``
    holds EOS off for 4 tokens, ``ignore_eos`` for the whole limit. Bad values, a
    ``min_tokens`` above the limit and either beside a grammar are 400s naming them."""
    eos = 1  # <｜end▁of▁sentence｜>
    base = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    base = {**base, "model": "deepseek-chat", "max_tokens": 8, "temperature": 0}
    base["logit_bias"] = {str(eos): 100}

    def run(**extra) -> tuple[int, str]:
        r = client.post(path, json={**base, **extra})
        assert r.status_code == 200, r.text
        d = r.json()
        return d["usage"]["completion_tokens"], d["choices"][0]["finish_reason"]

    assert run() == (1, "stop")
    assert run(min_tokens=4) == (5, "stop")
    assert run(ignore_eos=True) == (8, "length")
    assert run(min_tokens=0, ignore_eos=False) == (1, "stop")
    json_object = {"response_format": {"type": "json_object"}}
    for extra, param in [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"min_tokens": 2, **json_object}, "min_tokens"),
        ({"ignore_eos": True, **json_object}, "ignore_eos"),
        ({"best_of": 2}, "best_of"),
        ({"use_beam_search": True}, "use_beam_search"),
    ]:
        r = client.post(path, json={**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.text)


@pytest.mark.parametrize("name", ['f"><x', "two words", "a\nb", "x<｜DSML｜y"])
@pytest.mark.parametrize("path", [CHAT, MSGS, RESP])
def test_a_tool_name_a_call_cannot_carry_is_a_400(client, path, name):
    """A tool name goes inside a call's DSML ``name="…"``: one with a quote, an angle
    bracket, white space or a control character (it was accepted; the model's call to
    it could not parse back) is a 400 naming the tool."""
    params = {"type": "object", "properties": {}}
    if path == CHAT:
        tool = {"type": "function", "function": {"name": name, "parameters": params}}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    elif path == MSGS:
        tool = {"name": name, "input_schema": params}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    else:
        tool = {"type": "function", "name": name, "parameters": params}
        body = {"input": "hi", "max_output_tokens": 2}
    r = client.post(path, json={"model": "deepseek-chat", **body, "tools": [tool]})
    assert r.status_code == 400, r.text
    assert repr(name) in r.json()["error"]["message"], r.text


def test_completions_suffix_is_refused_not_ignored(client):
    """Fill-in-the-middle (``suffix``) has no template in DeepSeek V4's prompt format: a
    400 naming it, not a plain continuation that drops the suffix."""
    body = {"prompt": "Once upon", "max_tokens": 2}
    r = client.post(COMP, json={**body, "suffix": " the end"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
    assert client.post(COMP, json={**body, "suffix": ""}).status_code == 200


def test_responses_echo_what_was_done_and_refuse_background(client):
    """The response object tells what served it: the sampling that drew the reply
    (thinking mode samples at DeepSeek's settings, whatever was asked), ``store: false``
    (nothing can be fetched later), the truncation asked for, ``max_tool_calls``; a
    ``background`` request, which is fetched later by id, is a 400."""
    body = {"model": "deepseek-v4-flash", "input": "hi", "max_output_tokens": 2}
    r = client.post(RESP, json={**body, "temperature": 0, "top_p": 0.5, "store": True})
    assert r.status_code == 200, r.text
    d = r.json()
    assert (d["temperature"], d["top_p"], d["store"]) == (1.0, 1.0, False), d
    chat = {**body, "model": "deepseek-chat", "temperature": 0.25, "top_p": 0.5}
    d = client.post(RESP, json={**chat, "truncation": "auto", "max_tool_calls": 3}).json()
    assert (d["temperature"], d["top_p"], d["truncation"], d["max_tool_calls"]) == (
        0.25,
        0.5,
        "auto",
        3,
    ), d
    r = client.post(RESP, json={**body, "background": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text
    assert client.post(RESP, json={**body, "background": False}).status_code == 200


def test_a_seed_repeats_an_anthropic_reply(client):
    """``seed`` on the Messages API (not Anthropic's, as OpenAI's APIs take it): the
    same seed samples the same reply, another seed another (it was dropped unread)."""
    body = {"model": "deepseek-chat", "max_tokens": 8, "temperature": 1, "messages": OK_MSG}
    texts = [
        client.post(MSGS, json={**body, "seed": seed}).json()["content"][0]["text"]
        for seed in (5, 5, 6)
    ]
    assert texts[0] == texts[1] != texts[2], texts


@pytest.mark.parametrize(
    "path, field, value, hint",
    [
        (RESP, "prompt", {"id": "pmpt_abc", "variables": {"name": "Ann"}}, "stored prompts"),
        (RESP, "max_tokens", 3, "max_output_tokens"),
        (RESP, "response_format", {"type": "json_object"}, "text.format"),
        (RESP, "stop", ["a"], "not a Responses parameter"),
        (RESP, "logit_bias", {"15": 100}, "not a Responses parameter"),
        (RESP, "frequency_penalty", 1.0, "not a Responses parameter"),
        (CHAT, "modalities", ["text", "audio"], "text output only"),
        (CHAT, "audio", {"voice": "alloy", "format": "wav"}, "text output only"),
        (CHAT, "web_search_options", {}, "no hosted tools"),
        (MSGS, "mcp_servers", [{"type": "url", "url": "http://x", "name": "x"}], "MCP"),
        (MSGS, "container", "c_1", "no tools run"),
        (MSGS, "stop", ["a"], "stop_sequences"),
        (MSGS, "logit_bias", {"15": 100}, "not a Messages API parameter"),
        (MSGS, "n", 2, "not a Messages API parameter"),
    ],
)
def test_explicit_wishes_that_cannot_be_carried_out_are_refused(client, path, field, value, hint):
    """A wish the server cannot carry out, or another protocol's field the request's
    protocol does not read, is a 400 naming it, not a 200 that silently drops it (a
    stored prompt's instructions, audio, hosted MCP servers, Chat's ``stop`` on the
    Responses API all were); its absent or empty forms are served."""
    body = {
        RESP: {"model": "deepseek-chat", "input": "hi", "max_output_tokens": 2},
        CHAT: {**NORMAL, "max_tokens": 2},
        MSGS: {"model": "deepseek-chat", "max_tokens": 2, "messages": OK_MSG},
    }[path]
    r = client.post(path, json={**body, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err.get("param", field) == field and field in err["message"], r.text
    assert hint in err["message"], r.text
    fine = {"modalities": ["text"]}.get(field)
    assert client.post(path, json={**body, field: fine}).status_code == 200


def test_responses_truncation_auto_drops_the_oldest_turns(client):
    """``truncation: "auto"``: a history past the context loses its oldest turns until
    it fits (the instructions and the last message stay); ``disabled`` (the default)
    refuses it as before."""
    old = [
        {"role": "user", "content": f"question {i}: " + "word " * 200}
        if j == 0
        else {"role": "assistant", "content": "answer " * 5}
        for i in range(6)
        for j in (0, 1)
    ]
    body = {
        "model": "deepseek-chat",
        "instructions": "Be brief.",
        "input": [*old, {"role": "user", "content": "last question"}],
        "max_output_tokens": 2,
    }
    r = client.post(RESP, json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post(RESP, json={**body, "truncation": "auto"})
    assert r.status_code == 200, r.text
    kept = r.json()["usage"]["input_tokens"]
    assert CTX // 2 < kept < CTX, kept
    alone = {**body, "input": body["input"][-1:]}
    assert (
        client.post(RESP, json={**alone, "truncation": "auto"}).json()["usage"]["input_tokens"] < 40
    )


def test_context_length_exceeded_names_the_counts(client):
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": "w " * 3000}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert str(CTX) in err["message"] and "tokens" in err["message"]


def test_max_tokens_beyond_context_clamps_and_stops_at_full_context(client):
    prompt = "w " * (CTX - 40)
    n_prompt = client.post(
        "/v1/tokenize", json={"messages": [{"role": "user", "content": prompt}]}
    ).json()["count"]
    r = client.post(
        MSGS,
        json={
            "model": "deepseek-chat",
            "max_tokens": 32000,
            "temperature": 0,
            "messages": [{"role": "user", "content": prompt}],
        },
        headers={"anthropic-version": "2023-06-01"},
    )
    body = r.json()
    assert r.status_code == 200, body
    used = body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"]
    assert used == n_prompt
    if body["stop_reason"] == "model_context_window_exceeded":  # the context, not 32000
        assert used + body["usage"]["output_tokens"] == CTX
    r = client.post(
        CHAT,
        json={**NORMAL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 10**9},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= CTX - n_prompt


def test_api_key_required_except_health(server):
    r = HTTP.post(server.url + CHAT, json=NORMAL)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = HTTP.post(
        server.url + MSGS,
        json={"max_tokens": 1, "messages": OK_MSG},
        headers={"x-api-key": "wrong"},
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert HTTP.get(server.url + "/health").status_code == 200
    assert HTTP.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200


def test_health_without_the_key_names_no_clients_conversation(server, client):
    """``/health`` answers without the API key, but the resident states' keys (a Claude
    Code session id, a ``prompt_cache_key``) are left out of that answer."""
    # With a tool it is a conversation (a side request takes no key).
    body = {**NORMAL, "prompt_cache_key": "bob-project-xyz", "max_tokens": 2, "tools": [_fn("f")]}
    assert client.post(CHAT, json=body).status_code == 200
    mine = client.get("/health").json()
    assert mine["sessions"] > 1, mine  # states are listed (the server's default here)
    assert "cache:bob-project-xyz" in [st["key"] for st in mine["states"]], mine
    anyone = httpx.get(server.url + "/health", timeout=30)
    assert anyone.status_code == 200 and "bob-project" not in anyone.text, anyone.text
    assert [set(st) for st in anyone.json()["states"]] == [
        set(st) - {"key"} for st in mine["states"]
    ]


def test_unknown_routes_and_methods_are_shaped(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get(CHAT)
    assert r.status_code == 405 and "error" in r.json()
    r = client.get("/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    assert client.post("/debug/script", json={"texts": ["x"]}).status_code == 404  # not enabled
    # A base URL without /v1 (or with it twice) is the likeliest set-up mistake: the 404
    # names the route meant.
    for wrong, meant in (
        ("/messages", "/v1/messages"),
        ("/chat/completions", "/v1/chat/completions"),
        ("/v1/v1/responses", "/v1/responses"),
    ):
        r = client.post(wrong, json={})
        assert r.status_code == 404 and f"did you mean {meant}?" in r.text, r.text
    assert "did you mean" not in client.post("/v1/nothing", json={}).text


def test_cors_preflight_and_headers(server):
    r = httpx.options(
        server.url + CHAT, headers={"Origin": "http://x", "Access-Control-Request-Method": "POST"}
    )
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
    # The SDKs' own headers (x-stainless-*) must pass the preflight.
    asked = "x-stainless-os, x-stainless-retry-count, content-type"
    r = httpx.options(
        server.url + CHAT,
        headers={
            "Origin": "http://x",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": asked,
        },
    )
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert r.status_code == 204 and {"x-stainless-os", "x-stainless-retry-count"} <= allowed
    r = HTTP.get(server.url + "/health", headers={"Origin": "http://x"})
    assert r.headers["access-control-allow-origin"] == "*"


def test_responses_websocket_upgrade_checks_the_api_key(server):
    status, answer = ws_upgrade(server.port, {})
    assert status == 401 and b"x-should-retry: false" in answer.lower(), answer
    assert ws_upgrade(server.port, {"Authorization": f"Bearer {KEY}"})[0] == 101


def test_what_clients_send_reaches_the_log_escaped(server, client):
    """Log lines quote client strings (a path, a tool-call id, a schema key): a terminal
    escape in them is written as its ``\\xNN`` escape, never raw."""
    osc = "\x1b]0;PWNED\x07\x1b[2J\u202e\n12:00:00 forged line"
    msgs = [*OK_MSG, {"role": "tool", "tool_call_id": osc, "content": "r"}]
    assert client.post(CHAT, json={"messages": msgs, "max_tokens": 2}).status_code == 400
    schema = {"type": "object", "properties": {osc: {"not": {}}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = client.post(CHAT, json={"messages": OK_MSG, "max_tokens": 2, "response_format": fmt})
    assert r.status_code == 400, r.text
    assert client.get("/v1/%1b]0;PATH%07x").status_code == 404
    log = server.log()
    assert "\\x1b]0;PWNED\\x07\\x1b[2J\\u202e\\n12:00:00 forged line" in log, log[-2000:]
    assert "\\x1b]0;PATH\\x07x" in log and "\n12:00:00 forged" not in log, log[-2000:]
    for raw in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert raw not in log


def test_a_refused_body_closes_its_connection_and_the_client_goes_on(server):
    """A refusal before the body is read (no key, no route) says ``Connection: close``:
    the server never reads the body, so the connection cannot be reused, and a client
    reusing it anyway saw its next request fail. Without a body it stays open."""
    big = b'{"messages": [' + b" " * 2_000_000 + b"]}"
    json_type = {"content-type": "application/json"}
    with httpx.Client(base_url=server.url, timeout=60) as c:  # no API key; no retries
        for _ in range(5):
            r = c.post(CHAT, content=big, headers=json_type)
            assert r.status_code == 401 and r.headers.get("connection") == "close", r.headers
            r = c.post("/v1/nothing", content=b'{"a": 1}', headers={**json_type, **AUTH})
            assert r.status_code == 404 and r.headers.get("connection") == "close", r.headers
            assert c.get("/health").status_code == 200
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.headers.get("connection") != "close", r.headers
