"""Issue 5, must-hold 1, 2, 3 and 8: live continuation through a real server.

One ``ds4mlx serve`` process (tiny float32 model, scripted decoding, no disk cache) for
the module; each job's plan decision is read from the server's ``--trace`` file.
Scripted decoding makes the model emit thinking and DSML tool calls while every token
still runs through the network (KV state, logits and usage are real); a script with
``greedy`` continues with argmax once it runs out, so outputs are deterministic.

"Cold" references are produced by the same server after an unrelated request has
replaced the live state and with no disk cache: the worker resets the session, which
is exactly the state of a freshly started server.
"""

from __future__ import annotations

import pytest
from kv_server_util import (
    ASSISTANT,
    EOS,
    USER,
    anthropic_usage,
    chat_usage,
    count_tokens,
    invoke,
    long_system,
    post,
    responses_usage,
    script,
    tokenize,
    tool_calls,
    traced_server,
)
from server_util import (
    HTTP,
    Server,  # noqa: F401
)

READ = {
    "name": "read",
    "description": "Read a file",
    "input_schema": {
        "type": "object",
        "properties": {"path": {"type": "string"}},
        "required": ["path"],
    },
}
GREP = {
    "name": "grep",
    "description": "Search files",
    "input_schema": {
        "type": "object",
        "properties": {"pattern": {"type": "string"}, "max": {"type": "integer"}},
        "required": ["pattern"],
    },
}
READ_OAI = {
    "type": "function",
    "function": {
        "name": READ["name"],
        "description": READ["description"],
        "parameters": READ["input_schema"],
    },
}
READ_RESP = {"type": "function", **READ_OAI["function"]}
SHORT_SYSTEM = long_system(20, seed=3)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # No disk tier: the cold references below must be cold, not disk hits.
    extra = ["--kv-disk-dir", "none", "--sessions", "1"]  # _unrelated replaces the one state
    with traced_server(tiny_model_dir, tmp_path_factory, ctx=16384, extra=extra) as s:
        yield s


def _unrelated(server) -> None:
    """Replace the live state with an unrelated short conversation."""
    script(server, "x" + EOS)
    post(
        server,
        "/v1/chat/completions",
        {"model": "deepseek-chat", "messages": [{"role": "user", "content": "unrelated"}]},
    )


def _ant_body(messages, *, system=SHORT_SYSTEM, thinking=False, max_tokens=300, **kw):
    return {
        "model": "deepseek-v4-flash",
        "max_tokens": max_tokens,
        "system": system,
        "tools": [READ, GREP],
        "messages": messages,
        "thinking": {"type": "enabled" if thinking else "disabled"},
        **kw,
    }


def _two_calls(a="a.txt", pattern="foo") -> str:
    return tool_calls(invoke("read", ("path", a, None)), invoke("grep", ("pattern", pattern, None)))


def _tool_uses(resp: dict) -> list[dict]:
    return [b for b in resp["content"] if b["type"] == "tool_use"]


def _results(uses, texts) -> list[dict]:
    return [
        {"type": "tool_result", "tool_use_id": u["id"], "content": t}
        for u, t in zip(uses, texts, strict=True)
    ]


# --------------------------------------------------------------------------- item 1


def test_anthropic_parallel_tool_calls_prefill_only_the_suffix(server):
    """Two parallel calls, 2000+ token system prompt: the next request prefills exactly
    the tool-results suffix, the hidden thinking stays live, and the output equals a
    cold prefill of the full prompt with that thinking."""
    system = long_system(240)
    assert count_tokens(server, system) >= 2000
    user = [{"role": "user", "content": "Read a.txt and grep foo, in parallel."}]
    reasoning = "Both are independent, so I call read and grep at once."
    script(server, reasoning + "</think>" + _two_calls())
    body = _ant_body(user, system=system)
    body["thinking"] = {"type": "enabled", "budget_tokens": 2048, "display": "omitted"}
    body["max_tokens"] = 4096
    r1 = post(server, "/v1/messages", body)
    p1, c1 = anthropic_usage(r1)
    assert server.trace.last()["decision"] == "cold" and c1 == 0
    uses = _tool_uses(r1)
    assert [u["name"] for u in uses] == ["read", "grep"] and r1["stop_reason"] == "tool_use"
    thinking = [b for b in r1["content"] if b["type"] == "thinking"]
    assert thinking and thinking[0]["thinking"] == "" and thinking[0]["signature"]  # omitted

    # Results arrive in the reverse order; the suffix orders them by sampled call order.
    follow = user + [
        {"role": "assistant", "content": r1["content"]},
        {"role": "user", "content": _results(uses, ["R-A", "R-B"])[::-1]},
    ]
    body2 = {**body, "messages": follow, "max_tokens": 12}
    body2["thinking"] = {"type": "enabled", "display": "omitted"}
    script(server, "", greedy=True)
    r2 = post(server, "/v1/messages", body2)
    plan = server.trace.last()
    assert plan["decision"] == "live-anthropic", plan
    assert "ids=2" in plan["detail"]
    p2, c2 = anthropic_usage(r2)
    # Everything the first turn left live is reused: its prompt and every sampled token
    # (hidden reasoning included) but the EOS, which was sampled, not fed.
    assert c2 == p1 + r1["usage"]["output_tokens"] - 1
    suffix = (
        EOS
        + USER
        + "<tool_result>R-A</tool_result>\n\n<tool_result>R-B</tool_result>"
        + ASSISTANT
        + "<think>"
    )
    assert p2 - c2 == count_tokens(server, suffix)

    # Cold reference: same request once the live state is gone (binding cleared, no
    # disk cache): rendered from the thinking carrier and the exact DSML in tool memory.
    _unrelated(server)
    script(server, "", greedy=True)
    r3 = post(server, "/v1/messages", body2)
    assert server.trace.last()["decision"] == "cold"
    p3, c3 = anthropic_usage(r3)
    assert (p3, c3) == (p2, 0)
    assert r3["content"] == r2["content"]
    assert r3["usage"]["output_tokens"] == r2["usage"]["output_tokens"] == 12


# --------------------------------------------------------------------------- item 2


def _fresh_tool_turn(server, user_text: str, calls: str | None = None):
    user = [{"role": "user", "content": user_text}]
    _unrelated(server)
    script(server, calls or _two_calls())
    r = post(server, "/v1/messages", _ant_body(user))
    return user, r, _tool_uses(r)


def test_anthropic_partial_stale_and_old_ids(server):
    # Partial id set: no live match.
    user, r1, (a, b) = _fresh_tool_turn(server, "partial")
    only_a = {"role": "user", "content": _results([a], ["RA"])}
    err = post(server, "/v1/messages", _ant_body([user[0], only_a]), status=400)
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"] == (
        f"unknown tool_use_id {a['id']}: no call has this id, neither a tool_use block of the messages nor one the server is waiting on; each result must answer a call (send the whole history)"
    )
    script(server, "ok" + EOS)
    replayed = user + [{"role": "assistant", "content": r1["content"]}, only_a]
    r = post(server, "/v1/messages", _ant_body(replayed))
    plan = server.trace.last()
    p1, _ = anthropic_usage(r1)
    # Exact DSML replay keeps the live text a prefix of the render: nothing re-prefilled.
    assert plan["decision"] in ("exact-token-prefix", "text-prefix"), plan
    assert anthropic_usage(r)[1] == p1 + r1["usage"]["output_tokens"] - 1

    # Stale id: never sampled by this server.
    user, r1, _ = _fresh_tool_turn(server, "stale")
    stale = {"type": "tool_result", "tool_use_id": "toolu_stale0123456789", "content": "R"}
    err = post(
        server, "/v1/messages", _ant_body(user + [{"role": "user", "content": [stale]}]), status=400
    )
    assert (
        "unknown tool_use_id toolu_stale0123456789: no call has this id, neither a tool_use block of the messages nor one the server is waiting on; each result must answer a call (send the whole history)"
        == (err["error"]["message"])
    )
    call = {
        "type": "tool_use",
        "id": "toolu_stale0123456789",
        "name": "read",
        "input": {"path": "z"},
    }
    script(server, "ok" + EOS)
    msgs = user + [{"role": "assistant", "content": [call]}, {"role": "user", "content": [stale]}]
    post(server, "/v1/messages", _ant_body(msgs))
    assert not server.trace.last()["decision"].startswith("live-")

    # An id from an older turn: the live binding is the newer call.
    user, r1, (old_a, old_b) = _fresh_tool_turn(server, "older")
    turn1 = user + [
        {"role": "assistant", "content": r1["content"]},
        {"role": "user", "content": _results([old_a, old_b], ["1", "2"])},
    ]
    script(server, tool_calls(invoke("read", ("path", "c.txt", None))))
    r2 = post(server, "/v1/messages", _ant_body(turn1))
    assert server.trace.last()["decision"] == "live-anthropic"
    assert len(_tool_uses(r2)) == 1
    old_only = {"role": "user", "content": _results([old_a], ["again"])}
    err = post(server, "/v1/messages", _ant_body([user[0], old_only]), status=400)
    assert err["error"]["message"].startswith(f"unknown tool_use_id {old_a['id']}:")
    script(server, "ok" + EOS)
    older = user + [{"role": "assistant", "content": r1["content"][:1]}, old_only]
    post(server, "/v1/messages", _ant_body(older))
    assert not server.trace.last()["decision"].startswith("live-")


def _resp_body(items, **kw):
    return {
        "model": "deepseek-chat",
        "input": items,
        "instructions": SHORT_SYSTEM,
        "tools": [READ_RESP],
        "max_output_tokens": 300,
        **kw,
    }


def _resp_calls(resp):
    return [i for i in resp["output"] if i["type"] == "function_call"]


def _replay_items(resp):
    return [{k: i[k] for k in ("type", "call_id", "name", "arguments")} for i in _resp_calls(resp)]


def test_responses_live_partial_stale_and_old_ids(server):
    _unrelated(server)
    user = [{"type": "message", "role": "user", "content": "read two"}]
    script(
        server, tool_calls(invoke("read", ("path", "a", None)), invoke("read", ("path", "b", None)))
    )
    r1 = post(server, "/v1/responses", _resp_body(user))
    a, b = _resp_calls(r1)
    assert a["call_id"].startswith("call_")
    out = lambda c, t: {"type": "function_call_output", "call_id": c["call_id"], "output": t}  # noqa: E731

    # Partial set without the calls replayed: 400 from the worker (a is live).
    err = post(server, "/v1/responses", _resp_body(user + [out(a, "A")]), status=400)
    assert (
        err["error"]["message"]
        == f"unknown call_id {a['call_id']}: no call has this id, neither a function_call item of the input nor one the server is waiting on; each result must answer a call (send the whole history)"
    )
    # Both results, calls not replayed: a live match by call_id, suffix only.
    script(server, "done" + EOS)
    r2 = post(server, "/v1/responses", _resp_body(user + [out(b, "B"), out(a, "A")]))
    assert server.trace.last()["decision"] == "live-responses"
    p1, _ = responses_usage(r1)
    p2, c2 = responses_usage(r2)
    assert c2 == p1 + r1["usage"]["output_tokens"] - 1
    suffix = f"{EOS}{USER}<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>{ASSISTANT}</think>"
    assert p2 - c2 == count_tokens(server, suffix)

    # Partial set with the calls replayed: exact replay + prefix match.
    _unrelated(server)
    script(
        server, tool_calls(invoke("read", ("path", "a", None)), invoke("read", ("path", "b", None)))
    )
    r1 = post(server, "/v1/responses", _resp_body(user))
    a, b = _resp_calls(r1)
    script(server, "done" + EOS)
    post(server, "/v1/responses", _resp_body(user + _replay_items(r1) + [out(a, "A")]))
    assert server.trace.last()["decision"] in ("exact-token-prefix", "text-prefix")

    # Stale id.
    stale = {"type": "function_call_output", "call_id": "call_stale42", "output": "x"}
    err = post(server, "/v1/responses", _resp_body(user + [stale]), status=400)
    assert (
        err["error"]["message"]
        == "unknown call_id call_stale42: no call has this id, neither a function_call item of the input nor one the server is waiting on; each result must answer a call (send the whole history)"
    )
    call = {
        "type": "function_call",
        "call_id": "call_stale42",
        "name": "read",
        "arguments": '{"path": "q"}',
    }
    script(server, "done" + EOS)
    post(server, "/v1/responses", _resp_body(user + [call, stale]))
    assert not server.trace.last()["decision"].startswith("live-")

    # An id from an older turn.
    _unrelated(server)
    script(server, tool_calls(invoke("read", ("path", "a", None))))
    r1 = post(server, "/v1/responses", _resp_body(user))
    (old,) = _resp_calls(r1)
    turn1 = user + _replay_items(r1) + [out(old, "1")]
    script(server, tool_calls(invoke("read", ("path", "c", None))))
    post(server, "/v1/responses", _resp_body(turn1))
    assert server.trace.last()["decision"] == "live-responses"
    err = post(server, "/v1/responses", _resp_body(user + [out(old, "again")]), status=400)
    assert err["error"]["message"].startswith(f"unknown call_id {old['call_id']}:")
    script(server, "done" + EOS)
    post(server, "/v1/responses", _resp_body(turn1))
    assert not server.trace.last()["decision"].startswith("live-")


# --------------------------------------------------------------------------- item 3


def test_stateless_chat_never_prefills_twice(server):
    """A client resending the whole growing conversation: every turn after the first is
    a token- or text-prefix hit that reuses everything live, including a turn whose
    sampled tokens ("hel" + "lo") re-tokenize as one token ("hello") on replay."""
    hel, lo = tokenize(server, "hel"), tokenize(server, "lo")
    assert len(hel) == len(lo) == 1 and tokenize(server, "hello") != hel + lo
    eos_id = tokenize(server, EOS)[0]
    _unrelated(server)
    msgs = [
        {"role": "system", "content": SHORT_SYSTEM},
        {"role": "user", "content": "Say something."},
    ]
    replies = []
    prev_live = None
    decisions = []
    for turn in range(4):
        if turn == 1:
            script(server, tokens=[hel + lo + [eos_id]])
        else:
            script(server, f"Answer number {turn}, with some words." + EOS)
        r = post(server, "/v1/chat/completions", {"model": "deepseek-chat", "messages": msgs})
        p, c = chat_usage(r)
        decisions.append(server.trace.last()["decision"])
        if prev_live is not None:
            assert c == prev_live, (turn, c, prev_live)  # nothing prefilled twice
        prev_live = p + r["usage"]["completion_tokens"] - 1
        text = r["choices"][0]["message"]["content"]
        replies.append(text)
        msgs = msgs + [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Next question {turn}?"},
        ]
    assert replies[1] == "hello"
    assert decisions[0] == "cold"
    assert decisions[1] == "exact-token-prefix"
    assert decisions[2] == "text-prefix"  # "hel"+"lo" live, "hello" in the re-render
    assert decisions[3] in ("exact-token-prefix", "text-prefix")


# --------------------------------------------------------------------------- item 8


def test_thinking_live_openai_chat_and_anthropic(server):
    """Three thinking turns without tools; the client drops the reasoning on replay.
    Each request prefills only the new user turn (cached = all the live state)."""
    # OpenAI chat
    _unrelated(server)
    msgs = [{"role": "system", "content": SHORT_SYSTEM}, {"role": "user", "content": "Q0"}]
    prev = None
    for turn in range(3):
        script(
            server,
            f"Hidden reasoning {turn} that the client never sends back.</think>A{turn}." + EOS,
        )
        r = post(server, "/v1/chat/completions", {"model": "deepseek-v4-flash", "messages": msgs})
        p, c = chat_usage(r)
        m = r["choices"][0]["message"]
        assert m["reasoning_content"].startswith(f"Hidden reasoning {turn}")
        if prev is not None:
            assert server.trace.last()["decision"] == "live-thinking"
            assert c == prev
            new_turn = f"{EOS}{USER}Q{turn}{ASSISTANT}<think>"
            assert p - c == count_tokens(server, new_turn)
        prev = p + r["usage"]["completion_tokens"] - 1
        msgs = msgs + [
            {"role": "assistant", "content": m["content"]},  # reasoning dropped
            {"role": "user", "content": f"Q{turn + 1}"},
        ]

    # Anthropic
    _unrelated(server)
    msgs = [{"role": "user", "content": "Q0"}]
    prev = None
    for turn in range(3):
        script(server, f"Private thoughts {turn}.</think>B{turn}." + EOS)
        body = {
            "model": "deepseek-v4-flash",
            "max_tokens": 2000,
            "system": SHORT_SYSTEM,
            "messages": msgs,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        }
        r = post(server, "/v1/messages", body)
        p, c = anthropic_usage(r)
        if prev is not None:
            assert server.trace.last()["decision"] == "live-thinking"
            assert c == prev
        prev = p + r["usage"]["output_tokens"] - 1
        text = "".join(b["text"] for b in r["content"] if b["type"] == "text")
        msgs = msgs + [
            {"role": "assistant", "content": [{"type": "text", "text": text}]},
            {"role": "user", "content": f"Q{turn + 1}"},
        ]


def test_openai_chat_tool_loop_by_tool_call_id(server):
    """Thinking + tools over OpenAI chat: each tool turn continues live by
    ``tool_call_id``, even though the client drops ``reasoning_content``."""
    _unrelated(server)
    msgs = [{"role": "system", "content": SHORT_SYSTEM}, {"role": "user", "content": "Go."}]
    prev = None
    for turn in range(3):
        last = turn == 2
        out = f"Thinking {turn}.</think>" + (
            "All done." + EOS if last else tool_calls(invoke("read", ("path", f"f{turn}", None)))
        )
        script(server, out)
        r = post(
            server,
            "/v1/chat/completions",
            {"model": "deepseek-v4-flash", "messages": msgs, "tools": [READ_OAI]},
        )
        p, c = chat_usage(r)
        if prev is not None:
            assert server.trace.last()["decision"] == "live-chat"
            assert c == prev
            suffix = f"{EOS}{USER}<tool_result>content {turn - 1}</tool_result>{ASSISTANT}<think>"
            assert p - c == count_tokens(server, suffix)
        prev = p + r["usage"]["completion_tokens"] - 1
        m = r["choices"][0]["message"]
        if last:
            assert m["content"] == "All done."
            break
        (call,) = m["tool_calls"]
        msgs = msgs + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": f"content {turn}"},
        ]
    # The final answer's reasoning is dropped too; with tools its slot renders empty
    # (``<think></think>All done.``) and still selects the live turn.
    msgs = msgs + [
        {"role": "assistant", "content": "All done."},
        {"role": "user", "content": "Thanks."},
    ]
    script(server, "ok</think>Bye." + EOS)
    r = post(
        server,
        "/v1/chat/completions",
        {"model": "deepseek-v4-flash", "messages": msgs, "tools": [READ_OAI]},
    )
    assert server.trace.last()["decision"] == "live-thinking"
    assert chat_usage(r)[1] == prev


def test_debug_script_reset_alone_drops_the_queue(server):

    url = server.url + "/debug/script"
    script(server, "a", "b")
    r = HTTP.post(url, json={"reset": True}, timeout=10)
    assert r.status_code == 200 and r.json() == {"queued": 0}, r.text
    r = HTTP.post(url, json={}, timeout=10)
    assert r.status_code == 400 and "give texts or tokens" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- issue 19

LATE = "Available agent types: general, explore."


def _late_turns(shape: str):
    """``(path, body(history), next(history, resp, result, late) -> history, start)`` of
    one API shape: a tool loop whose second request carries a system message after the
    first tool result (Claude Code's sub-agents)."""
    system = {"role": "system", "content": LATE}
    if shape == "chat":

        def nxt(h, r, result, late):
            (call,) = r["choices"][0]["message"]["tool_calls"]
            res = {"role": "tool", "tool_call_id": call["id"], "content": result}
            return (
                h
                + [{"role": "assistant", "content": None, "tool_calls": [call]}, res]
                + ([system] if late else [])
            )

        body = lambda h: {"model": "deepseek-chat", "messages": h, "tools": [READ_OAI]}  # noqa: E731
        start = [{"role": "system", "content": SHORT_SYSTEM}, {"role": "user", "content": "Go."}]
        return "/v1/chat/completions", body, nxt, start
    if shape == "anthropic":

        def nxt(h, r, result, late):
            res = {"role": "user", "content": _results(_tool_uses(r), [result])}
            return (
                h
                + [{"role": "assistant", "content": r["content"]}, res]
                + ([system] if late else [])
            )

        return "/v1/messages", _ant_body, nxt, [{"role": "user", "content": "Go."}]

    def nxt(h, r, result, late):
        (c,) = _resp_calls(r)
        out = {"type": "function_call_output", "call_id": c["call_id"], "output": result}
        return h + _replay_items(r) + [out] + ([{"type": "message", **system}] if late else [])

    start = [{"type": "message", "role": "user", "content": "Go."}]
    return "/v1/responses", _resp_body, nxt, start


@pytest.mark.parametrize("shape", ["chat", "anthropic", "responses"])
def test_late_system_text_is_in_the_live_state(server, shape):
    """Issue 19, must-hold 3: a system message after the first assistant turn is text of
    the user turn it follows, so the live tool-results continuation carries it: the
    tokens the state holds are the tokenized rendering of the request, and the next
    request continues live."""
    _unrelated(server)
    path, body, nxt, hist = _late_turns(shape)
    call = lambda f: tool_calls(invoke("read", ("path", f, None)))  # noqa: E731
    script(server, call("a"))
    r = post(server, path, body(hist))
    for turn, late in ((2, True), (3, False)):
        hist = nxt(hist, r, f"content {turn}", late)
        script(server, call(f"f{turn}"))
        r = post(server, path, body(hist))
        plan = server.trace.last()
        assert plan["decision"] == f"live-{shape}", plan
        text = server.trace.prompts()[-1]["text"]
        assert (
            f"<tool_result>content 2</tool_result>\n\n<system-reminder>\n{LATE}\n</system-reminder>"
            in text
        )
        assert plan["prompt"] == len(tokenize(server, text)), plan
