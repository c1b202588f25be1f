"""Issue 20, items 3, 5 and 7: one call when the client allows no parallel calls, Codex's
deferred tools (``tool_search``), and ``count_tokens`` predicting the next request's
usage. One real ``ds4mlx serve`` (tiny checkpoint, scripted decoding, one live state, no
disk tier: a cold reference is really cold) for the module; each job's plan decision
comes from its ``--trace`` file.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from kv_server_util import (
    ASSISTANT,
    EOS,
    USER,
    count_tokens,
    invoke,
    post,
    script,
    tool_calls,
    traced_server,
)
from server_util import HTTP, sse_events

CHAT = "/v1/chat/completions"
MSGS = "/v1/messages"
RESP = "/v1/responses"
PROTOCOLS = [CHAT, MSGS, RESP]
LIVE = {CHAT: "live-chat", MSGS: "live-anthropic", RESP: "live-responses"}

PARAMS = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOL = {
    CHAT: {"type": "function", "function": {"name": "read", "parameters": PARAMS}},
    MSGS: {"name": "read", "input_schema": PARAMS},
    RESP: {"type": "function", "name": "read", "parameters": PARAMS},
}
# The client's "no parallel calls" in each protocol.
ONE_CALL = {
    CHAT: {"parallel_tool_calls": False},
    MSGS: {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
    RESP: {"parallel_tool_calls": False},
}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    extra = ["--kv-disk-dir", "none", "--sessions", "1"]
    with traced_server(tiny_model_dir, tmp_path_factory, ctx=4096, extra=extra) as s:
        yield s


def _unrelated(server) -> None:
    """Replace the live state (the next request is cold: no disk tier, one state)."""
    script(server, "x" + EOS)
    post(server, CHAT, {"model": "deepseek-chat", "messages": [{"role": "user", "content": "zz"}]})


def _body(path: str, history: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A thinking-off request of ``path`` with the ``read`` tool and ``history``."""
    body: dict[str, Any] = {"model": "deepseek-chat", "tools": [TOOL[path]], **extra}
    if path == RESP:
        return {**body, "input": history, "reasoning": {"effort": "none"}}
    if path == MSGS:
        body.setdefault("max_tokens", 200)
    return {**body, "messages": history, "thinking": {"type": "disabled"}}


def _calls(path: str, resp: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(id, name, arguments)`` of the calls in a non-streaming answer."""
    if path == CHAT:
        tcs = resp["choices"][0]["message"].get("tool_calls") or []
        return [
            (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tcs
        ]
    if path == MSGS:
        return [
            (b["id"], b["name"], b["input"]) for b in resp["content"] if b["type"] == "tool_use"
        ]
    return [
        (o["call_id"], o["name"], json.loads(o["arguments"]))
        for o in resp["output"]
        if o["type"] == "function_call"
    ]


def _stream_calls(path: str, body: dict[str, Any], client: httpx.Client):
    """POST ``body`` streaming; ``(calls as in _calls, finish reason)`` from the events."""
    calls: dict[int, list[Any]] = {}
    finish = None
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        datas = [json.loads(d) for _, d in sse_events(r.iter_lines()) if d not in (None, "[DONE]")]
    for d in datas:
        if path == CHAT:
            for c in d.get("choices", []):
                for tc in c["delta"].get("tool_calls") or []:
                    entry = calls.setdefault(tc["index"], [None, None, ""])
                    entry[0] = tc.get("id") or entry[0]
                    entry[1] = tc.get("function", {}).get("name") or entry[1]
                    entry[2] += tc.get("function", {}).get("arguments") or ""
                finish = c.get("finish_reason") or finish
        elif path == MSGS:
            if d["type"] == "content_block_start" and d["content_block"]["type"] == "tool_use":
                calls[d["index"]] = [d["content_block"]["id"], d["content_block"]["name"], ""]
            elif d["type"] == "content_block_delta" and d["delta"]["type"] == "input_json_delta":
                calls[d["index"]][2] += d["delta"]["partial_json"]
            elif d["type"] == "message_delta":
                finish = d["delta"]["stop_reason"]
        elif d["type"] == "response.output_item.done" and d["item"]["type"] == "function_call":
            it = d["item"]
            calls[d["output_index"]] = [it["call_id"], it["name"], it["arguments"]]
        elif d["type"] in ("response.completed", "response.incomplete"):
            finish = d["response"]["status"]
    return [(i, n, json.loads(a)) for i, n, a in calls.values()], finish


def _answered(path: str, history: list, calls, result: str) -> list[dict[str, Any]]:
    """``history`` + the assistant turn making ``calls`` + the client's ``result``."""
    if path == CHAT:
        tcs = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, n, a in calls
        ]
        return [
            *history,
            {"role": "assistant", "content": None, "tool_calls": tcs},
            *({"role": "tool", "tool_call_id": i, "content": result} for i, _, _ in calls),
        ]
    if path == MSGS:
        uses = [{"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in calls]
        results = [
            {"type": "tool_result", "tool_use_id": i, "content": result} for i, _, _ in calls
        ]
        return [
            *history,
            {"role": "assistant", "content": uses},
            {"role": "user", "content": results},
        ]
    items = [
        {"type": "function_call", "call_id": i, "name": n, "arguments": json.dumps(a)}
        for i, n, a in calls
    ]
    outs = [{"type": "function_call_output", "call_id": i, "output": result} for i, _, _ in calls]
    return [*history, *items, *outs]


def _prompt_usage(path: str, resp: dict[str, Any]) -> tuple[int, int, int]:
    """``(prompt tokens, cached tokens, output tokens)`` of an answer."""
    u = resp["usage"]
    if path == CHAT:
        return (
            u["prompt_tokens"],
            u["prompt_tokens_details"]["cached_tokens"],
            u["completion_tokens"],
        )
    if path == MSGS:
        cached = u["cache_read_input_tokens"]
        return u["input_tokens"] + cached, cached, u["output_tokens"]
    return u["input_tokens"], u["input_tokens_details"]["cached_tokens"], u["output_tokens"]


def _text(path: str, resp: dict[str, Any]) -> str:
    if path == CHAT:
        return resp["choices"][0]["message"]["content"] or ""
    if path == MSGS:
        return "".join(b.get("text", "") for b in resp["content"] if b["type"] == "text")
    return "".join(
        p.get("text", "") for o in resp["output"] if o["type"] == "message" for p in o["content"]
    )


# --------------------------------------------------------------------------- item 3

TWO = tool_calls(invoke("read", ("path", "a.txt", None)), invoke("read", ("path", "b.txt", None)))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", PROTOCOLS)
def test_no_parallel_calls_gives_one_call_and_an_exact_live_state(server, path, stream):
    """The model writes two invokes; the client allowed one call: it gets the first, and
    the live state holds exactly that one-call turn. The client's answer to it continues
    live with only its suffix prefilled, and a cold prefill of the same request (no live
    state, no disk tier) has the same tokens and continues with the same greedy text."""
    _unrelated(server)
    history = [{"role": "user", "content": "Read a.txt and b.txt."}]
    body = _body(path, history, **ONE_CALL[path])
    script(server, TWO)
    if stream:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            calls, finish = _stream_calls(path, body, client)
        assert finish == {CHAT: "tool_calls", MSGS: "tool_use", RESP: "completed"}[path]
    else:
        r1 = post(server, path, body)
        calls = _calls(path, r1)
    assert [(n, a) for _, n, a in calls] == [("read", {"path": "a.txt"})]
    job1 = server.trace.jobs()[-1]
    p1 = job1["prompt"]

    follow = _body(path, _answered(path, history, calls, "R-A"), **ONE_CALL[path])
    limit = {"max_output_tokens": 6} if path == RESP else {"max_tokens": 6}
    script(server, "", greedy=True)
    r2 = post(server, path, {**follow, **limit})
    plan = server.trace.last()
    assert plan["decision"] == LIVE[path], plan
    p2, c2, _ = _prompt_usage(path, r2)
    suffix = f"{EOS}{USER}<tool_result>R-A</tool_result>{ASSISTANT}</think>"
    assert p2 - c2 == count_tokens(server, suffix)
    assert c2 > p1

    _unrelated(server)
    script(server, "", greedy=True)
    r3 = post(server, path, {**follow, **limit})
    assert server.trace.last()["decision"] == "cold"
    p3, c3, _ = _prompt_usage(path, r3)
    assert (p3, c3) == (p2, 0)
    assert _text(path, r3) == _text(path, r2)


@pytest.mark.parametrize("path", PROTOCOLS)
def test_parallel_calls_allowed_by_default(server, path):
    """The control: without the flag both invokes are calls."""
    script(server, TWO)
    r = post(server, path, _body(path, [{"role": "user", "content": "Read a.txt and b.txt."}]))
    assert [a["path"] for _, _, a in _calls(path, r)] == ["a.txt", "b.txt"]


@pytest.mark.parametrize(
    ("generated", "closer"),
    [
        ("</｜DSML｜invoke>\n", "</｜DSML｜tool_calls>"),
        ("</｜DSML｜invoke>", "\n</｜DSML｜tool_calls>"),
        ("</｜DSML｜invoke>\n<", "/｜DSML｜tool_calls>"),
        ("</｜DSML｜invoke>\n\n", "</｜DSML｜tool_calls>"),
    ],
)
def test_block_closer_completes_what_the_invoke_token_began(generated, closer):
    from ds4mlx.engine.single_call import block_closer

    assert (
        block_closer('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="x">\n' + generated) == closer
    )


# --------------------------------------------------------------------------- item 7


def _count_request(server, body: dict[str, Any]) -> int:
    fields = ("model", "system", "messages", "tools", "thinking", "cache_salt")
    probe = {k: v for k, v in body.items() if k in fields}
    return post(server, "/v1/messages/count_tokens", probe)["input_tokens"]


def test_count_tokens_predicts_a_live_thinking_turns_usage(server):
    """After a thinking turn the live state holds its hidden reasoning, which the next
    request's rendering leaves out: count_tokens counts what that request is charged
    (the live state kept + the new suffix), under the request's own cache salt; under
    another salt nothing is reused and the count is the rendering's."""
    _unrelated(server)
    msgs = [{"role": "user", "content": "Q0"}]
    base = {
        "model": "deepseek-v4-flash",
        "max_tokens": 2000,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "cache_salt": "tenant-a",
    }
    script(server, "Hidden reasoning the client never sends back, " * 3 + "</think>A0." + EOS)
    r1 = post(server, MSGS, {**base, "messages": msgs})
    text = "".join(b["text"] for b in r1["content"] if b["type"] == "text")
    body2 = {
        **base,
        "messages": [
            *msgs,
            {"role": "assistant", "content": [{"type": "text", "text": text}]},
            {"role": "user", "content": "Q1"},
        ],
    }
    predicted = _count_request(server, body2)
    rendering = _count_request(server, {**body2, "cache_salt": "tenant-b"})
    script(server, "ok</think>A1." + EOS)
    r2 = post(server, MSGS, body2)
    assert server.trace.last()["decision"] == "live-thinking"
    p2, c2, _ = _prompt_usage(MSGS, r2)
    assert predicted == p2 and c2 > 0
    # The rendering drops the reasoning the live state holds.
    assert rendering < predicted


@pytest.mark.slow
def test_count_tokens_answers_while_a_generation_streams(server):
    """count_tokens queues no job: it answers while a long generation streams, which goes
    on after the answer."""
    _unrelated(server)
    script(server, "word " * 500)
    body = {
        "model": "deepseek-chat",
        "messages": [{"role": "user", "content": "Talk."}],
        "max_tokens": 500,
        "stream": True,
    }
    probe = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "Count me."}]}
    after = 0
    with (
        httpx.Client(base_url=server.url, timeout=300) as client,
        client.stream("POST", CHAT, json=body) as r,
    ):
        lines = r.iter_lines()
        for _, d in sse_events(lines):
            if d and d != "[DONE]" and json.loads(d)["choices"][0]["delta"].get("content"):
                break
        got = client.post("/v1/messages/count_tokens", json=probe)
        assert got.status_code == 200 and got.json()["input_tokens"] > 0
        assert client.get("/health").json()["busy"]
        for _, d in sse_events(lines):
            if d and d != "[DONE]":
                after += bool(json.loads(d)["choices"][0]["delta"].get("content"))
    assert after > 0  # the generation was still streaming when the count came back


# --------------------------------------------------------------------------- item 5

# Codex 0.171's client-run tool search (its request, captured with an MCP server
# configured: the MCP tools are not in ``tools`` at all, only this tool).
TOOL_SEARCH = {
    "type": "tool_search",
    "execution": "client",
    "description": "# Tool discovery\n\nSearches over deferred tool metadata with BM25.",
    "parameters": {
        "type": "object",
        "properties": {
            "limit": {"type": "number", "description": "Maximum number of tools to return."},
            "query": {"type": "string", "description": "Search query for deferred tools."},
        },
        "required": ["query"],
        "additionalProperties": False,
    },
}
CRM = {
    "type": "namespace",
    "name": "mcp__crm__",
    "description": "CRM records",
    "tools": [
        {
            "type": "function",
            "name": "lookup",
            "description": "Look up a CRM record.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        }
    ],
}
CRM_LINE = (
    '{"name": "lookup", "description": "Look up a CRM record.\\n(mcp__crm__: CRM records)", '
    '"parameters": {"type": "object", "properties": {"query": {"type": "string"}}, '
    '"required": ["query"]}}'
)


def _search_items(server, body: dict[str, Any], stream: bool) -> list[dict[str, Any]]:
    """The output items of a Responses request (from the stream's done items)."""
    if not stream:
        return post(server, RESP, body)["output"]
    with (
        httpx.Client(base_url=server.url, timeout=120) as client,
        client.stream("POST", RESP, json={**body, "stream": True}) as r,
    ):
        datas = [json.loads(d) for _, d in sse_events(r.iter_lines()) if d not in (None, "[DONE]")]
    assert not any(d["type"].startswith("response.function_call") for d in datas)
    (final,) = [d for d in datas if d["type"] == "response.completed"]
    done = [d["item"] for d in datas if d["type"] == "response.output_item.done"]
    assert done == final["response"]["output"]
    return done


@pytest.mark.parametrize("stream", [False, True])
def test_codex_tool_search_is_answered_rendered_and_continued_live(server, stream):
    """A search the model starts is a ``tool_search_call`` (object arguments, client
    execution), not a function_call; the client's ``tool_search_call`` +
    ``tool_search_output`` items render as that call and its result (the loaded tools'
    schemas), the loaded tools are callable (a namespaced call keeps its namespace), and
    the exchange continues live by call_id with only the result prefilled."""
    _unrelated(server)
    user = [{"type": "message", "role": "user", "content": "Find the Acme record."}]
    body = {
        "model": "deepseek-chat",
        "reasoning": {"effort": "none"},
        "tools": [TOOL["/v1/responses"], TOOL_SEARCH],
        "input": user,
    }
    script(
        server, tool_calls(invoke("tool_search", ("query", "crm record", None), ("limit", 3, None)))
    )
    out = _search_items(server, body, stream)
    (call,) = out
    assert call["type"] == "tool_search_call", call
    assert call["arguments"] == {"query": "crm record", "limit": 3}
    assert (call["execution"], call["status"]) == ("client", "completed")
    assert call["call_id"].startswith("call_")
    text = server.trace.prompts()[-1]["text"]
    assert '"name": "tool_search"' in text and "Search query for deferred tools." in text
    p1 = server.trace.jobs()[-1]["prompt"]

    # Codex runs the search and sends the exchange back (its item shapes).
    output = {
        "type": "tool_search_output",
        "id": "tso_1",
        "call_id": call["call_id"],
        "status": "completed",
        "execution": "client",
        "tools": [CRM],
    }
    body2 = {**body, "input": [*user, call, output], "max_output_tokens": 200}
    script(server, tool_calls(invoke("lookup", ("query", "Acme", None))))
    r2 = post(server, RESP, body2)
    plan = server.trace.last()
    assert plan["decision"] == "live-responses", plan
    p2, c2, _ = _prompt_usage(RESP, r2)
    suffix = f"{EOS}{USER}<tool_result>{CRM_LINE}</tool_result>{ASSISTANT}</think>"
    assert p2 - c2 == count_tokens(server, suffix) and c2 > p1
    (fc,) = r2["output"]
    assert (fc["type"], fc["name"], fc["namespace"]) == ("function_call", "lookup", "mcp__crm__")
    assert json.loads(fc["arguments"]) == {"query": "Acme"}
    # The loaded tool renders in the result only: the tools section stays a prefix.
    text = server.trace.prompts()[-1]["text"]
    assert text.count('"name": "lookup"') == 1

    # Cold, the same request renders to the same tokens (the search call from its
    # exact sampled DSML).
    _unrelated(server)
    script(server, "x" + EOS)
    r3 = post(server, RESP, body2)
    assert server.trace.last()["decision"] == "cold"
    assert _prompt_usage(RESP, r3)[:2] == (p2, 0)


def test_tool_search_output_that_is_not_tools_is_a_400(server):
    body = {
        "model": "deepseek-chat",
        "tools": [TOOL_SEARCH],
        "input": [
            {"type": "message", "role": "user", "content": "x"},
            {"type": "tool_search_call", "call_id": "c1", "arguments": {"query": "q"}},
            {"type": "tool_search_output", "call_id": "c1", "tools": [{"name": "no type"}]},
        ],
    }
    r = HTTP.post(server.url + RESP, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input.2.tools"


@pytest.mark.parametrize(
    "path, field, body",
    [
        (
            "/v1/chat/completions",
            "parallel_tool_calls",
            {"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": "no"},
        ),
        ("/v1/responses", "parallel_tool_calls", {"input": "x", "parallel_tool_calls": 0}),
        (
            "/v1/messages",
            "disable_parallel_tool_use",
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "auto", "disable_parallel_tool_use": "false"},
            },
        ),
    ],
    ids=["chat", "responses", "anthropic"],
)
def test_no_parallel_calls_flag_must_be_a_boolean(server, path, field, body):
    """A string or number where a JSON boolean belongs is the protocol's 400 naming the
    field, not silently ignored (``"no"`` read as absent would allow parallel calls)."""

    r = HTTP.post(server.url + path, json={"model": "deepseek-v4-flash", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.text


def test_codex_additional_tools_item_offers_its_tools(server):
    """Codex with a catalog model name sends ``tools: []`` and its tools as a leading
    ``additional_tools`` input item (``{type, role: "developer", tools}``); those tools
    are offered exactly as top-level ``tools`` would be (same rendered prompt), a call to
    one is reported as its kind (a namespaced function keeps its namespace), and a tool
    declared in both places is offered once. The item was dropped: no tools at all."""
    user = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Find Acme."}]},
    ]  # fmt: skip
    tools = [TOOL[RESP], CRM]
    base = {"model": "gpt-5.5", "reasoning": {"effort": "none"}, "store": False}
    texts = []
    for body in (
        {**base, "tools": tools, "input": user},
        {**base, "tools": [], "input": [{"type": "additional_tools", "role": "developer", "tools": tools}, *user]},
        {**base, "tools": [TOOL[RESP]], "input": [{"type": "additional_tools", "role": "developer", "tools": tools}, *user]},
    ):  # fmt: skip
        _unrelated(server)
        script(server, tool_calls(invoke("lookup", ("query", "Acme", None))))
        out = post(server, RESP, body)["output"]
        (fc,) = out
        assert (fc["type"], fc["name"], fc.get("namespace")) == (
            "function_call",
            "lookup",
            "mcp__crm__",
        ), out
        texts.append(server.trace.prompts()[-1]["text"])
    assert '"name": "read"' in texts[0] and '"name": "lookup"' in texts[0]
    assert texts[1] == texts[0] and texts[2] == texts[0]
    # Codex's responses-lite tools: a custom (freeform) tool inside a namespace is offered
    # (one string parameter, its grammar) and its call is a namespaced custom_tool_call.
    grammar = 'start: "echo " WORD\nWORD: /[a-z]+/'
    functions = {
        "type": "namespace",
        "name": "functions",
        "description": "",
        "tools": [
            {"type": "custom", "name": "exec", "description": "Run JavaScript.",
             "format": {"type": "grammar", "syntax": "lark", "definition": grammar}},
        ],
    }  # fmt: skip
    body = {
        **base,
        "tools": [],
        "input": [{"type": "additional_tools", "tools": [functions]}, *user],
    }
    _unrelated(server)
    script(server, tool_calls(invoke("exec", ("input", "echo hi", None))))
    (call,) = post(server, RESP, body)["output"]
    assert (call["type"], call["name"], call["namespace"], call["input"]) == (
        "custom_tool_call",
        "exec",
        "functions",
        "echo hi",
    ), call
    assert "Run JavaScript." in server.trace.prompts()[-1]["text"]
    # A malformed tool in the item is a 400 naming its path.
    bad = {**base, "input": [{"type": "additional_tools", "tools": [{"name": "x"}]}, *user]}
    r = HTTP.post(server.url + RESP, json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.tools.0.type", r.text
    # So is a malformed custom tool inside a namespace (it was a 500).
    for sub, param in [
        ({"type": "custom", "name": 5}, "name"),
        ({"type": "custom", "name": "x", "format": "lark"}, "format"),
    ]:
        bad = {**base, "tools": [{**functions, "tools": [sub]}], "input": user}
        r = HTTP.post(server.url + RESP, json=bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == f"tools.0.tools.0.{param}", (
            r.text
        )
