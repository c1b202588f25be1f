"""Issue 12: resident states (``ds4mlx serve --sessions 2``) through a real server.

Two conversations interleave as Claude Code's main conversation and a side request do:
each keeps its own live state and bindings, so a tool result of the first still
continues it live after the second ran; a third conversation replaces the least
valuable state (saved to disk first): fewest tokens per job since its last use, so a
small side request goes before a long conversation it interrupted. Usage on the resident path is what the
model processed. Plan decisions and the state each job ran on come from ``--trace``.
"""

from __future__ import annotations

import time

import pytest
from kv_server_util import (
    EOS,
    LOOKUP_TOOL,
    anthropic_usage,
    chat_usage,
    invoke,
    long_system,
    post,
    script,
    tool_calls,
    traced_server,
)
from server_util import (
    HTTP,
    Server,  # noqa: F401
)

from ds4mlx.kv.store import scan_dir

TOOL = LOOKUP_TOOL


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with traced_server(tiny_model_dir, tmp_path_factory, extra=["--sessions", "2"]) as s:
        h = s.health()
        assert h["sessions"] == 2 and 1 <= len(h["states"]) <= 2, h  # states made as needed
        assert h["kv_writer"]["dropped"] == 0, h  # the disk tier's writer thread
        yield s


def _side(server, seed: int, messages=None) -> dict:
    """A side conversation (another system prompt, as a title request has)."""
    script(server, "Title." + EOS)
    messages = messages or [
        {"role": "system", "content": long_system(60, seed=seed)},
        {"role": "user", "content": f"side {seed}"},
    ]
    return post(
        server,
        "/v1/chat/completions",
        {"model": "deepseek-chat", "max_tokens": 20, "messages": messages},
    )


def test_interleaved_conversations_keep_their_own_state(server):
    assert "live states" in server.log() and "2 resident" in server.log()
    main = {
        "model": "deepseek-chat",
        "max_tokens": 200,
        "system": long_system(70, seed=71),
        "tools": [TOOL],
        "messages": [{"role": "user", "content": "look it up"}],
    }
    script(server, "Looking." + tool_calls(invoke("lookup", ("word", "state", None))))
    r1 = post(server, "/v1/messages", main)
    p1, _ = anthropic_usage(r1)
    live_main = p1 + r1["usage"]["output_tokens"] - 1
    assert "state=0/2 via=" in server.trace.last()["detail"]
    (use,) = [b for b in r1["content"] if b["type"] == "tool_use"]

    side_msgs = [
        {"role": "system", "content": long_system(60, seed=72)},
        {"role": "user", "content": "side 72"},
    ]
    rs = _side(server, 72, side_msgs)  # another state: the main one stays resident
    plan = server.trace.last()
    assert plan["decision"] == "cold" and "state=1/2 via=" in plan["detail"], plan

    # The main conversation's tool result continues its state live: its binding was
    # not cleared by the side request, which ran on the other state.
    main2 = {
        **main,
        "messages": main["messages"]
        + [
            {"role": "assistant", "content": r1["content"]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}],
            },
        ],
    }
    script(server, "Done." + EOS)
    r2 = post(server, "/v1/messages", main2)
    plan = server.trace.last()
    assert plan["decision"] == "live-anthropic" and "state=0/2 via=" in plan["detail"], plan
    total, cached = anthropic_usage(r2)
    assert cached == live_main
    assert (total, cached) == (plan["prompt"], plan["cached"])  # usage on this path

    # The side conversation continues its own state too.
    side2 = side_msgs + [
        {"role": "assistant", "content": rs["choices"][0]["message"]["content"]},
        {"role": "user", "content": "again"},
    ]
    r3 = _side(server, 72, side2)
    plan = server.trace.last()
    assert "state=1/2 via=" in plan["detail"], plan
    assert plan["decision"] in ("exact-token-prefix", "text-prefix"), plan
    ps, _ = chat_usage(rs)
    assert chat_usage(r3)[1] >= ps + rs["usage"]["completion_tokens"] - 1
    assert chat_usage(r3) == (plan["prompt"], plan["cached"])

    # A third conversation: no state matches and both are live, so the least valuable
    # (the main one: fewer tokens than the side one, and two jobs older) is saved to
    # disk and replaced.
    _side(server, 73)
    plan = server.trace.last()
    assert plan["decision"] == "cold" and "state=0/2 via=" in plan["detail"], plan
    # Its evict snapshot (written by the writer thread) holds the main conversation's
    # whole live state.
    want = total + r2["usage"]["output_tokens"] - 1
    deadline = time.monotonic() + 20
    while want not in (evicts := _evict_sizes(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert want in evicts, (want, evicts)


def test_a_small_recent_state_goes_before_a_long_interrupted_one(server):
    """A long conversation, then a small side request, then an unrelated one: the small
    state is replaced (least-recently-used would drop the long conversation), so the
    long conversation's next turn still continues its live state."""
    big = [
        {"role": "system", "content": long_system(200, seed=91)},
        {"role": "user", "content": "big"},
    ]
    rb = _side(server, 91, big)
    big_state = server.trace.last()["detail"].split("state=")[1].split()[0]
    _side(server, 92, [{"role": "user", "content": "title?"}])  # a few tokens
    small_state = server.trace.last()["detail"].split("state=")[1].split()[0]
    assert small_state != big_state
    _side(server, 93)  # matches neither
    plan = server.trace.last()
    assert plan["decision"] == "cold" and f"state={small_state} via=" in plan["detail"], plan
    big2 = big + [
        {"role": "assistant", "content": rb["choices"][0]["message"]["content"]},
        {"role": "user", "content": "more"},
    ]
    _side(server, 91, big2)
    plan = server.trace.last()
    assert plan["decision"] in ("exact-token-prefix", "text-prefix"), plan
    assert f"state={big_state} via=" in plan["detail"], plan


def _evict_sizes(server) -> list[int]:
    return [e.tokens for e in scan_dir(server.kv_dir).entries if e.reason == "evict"]


def test_claude_code_headers_keep_each_agent_on_its_own_state(server):
    """Issue 19: requests carrying Claude Code's agent/session headers go to their
    agent's state. The main conversation (session id only) restarts compacted — it
    continues nothing — and goes to its own state, not the sub-agent's (the least
    valuable one), so the sub-agent's next turn still continues live."""

    def send(headers, system, messages):
        script(server, "Sure." + EOS)
        body = {"model": "deepseek-chat", "max_tokens": 20, "system": system, "tools": [TOOL]}
        r = HTTP.post(
            server.url + "/v1/messages",
            json={**body, "messages": messages},
            headers=headers,
            timeout=300,
        )
        assert r.status_code == 200, r.text[:2000]
        return r.json(), server.trace.last()

    main_h = {"x-claude-code-session-id": "sess-1"}
    sub_h = {**main_h, "x-claude-code-agent-id": "agent-7"}
    main_sys, sub_sys = long_system(200, seed=101), long_system(20, seed=102)
    sub = [{"role": "user", "content": "explore"}]
    send(main_h, main_sys, [{"role": "user", "content": "main task"}])
    rs, plan = send(sub_h, sub_sys, sub)
    sub_state = plan["detail"].split("state=")[1].split()[0]
    _, plan = send(main_h, main_sys, [{"role": "user", "content": "summary of the task so far"}])
    assert f"state={sub_state} " not in plan["detail"] + " ", plan
    assert "via=key" in plan["detail"], plan
    sub += [
        {"role": "assistant", "content": rs["content"]},
        {"role": "user", "content": "go on"},
    ]
    _, plan = send(sub_h, sub_sys, sub)
    assert plan["decision"] in ("exact-token-prefix", "text-prefix"), plan
    assert f"state={sub_state} via=live" in plan["detail"], plan
    states = {s["key"]: s["tokens"] for s in server.health()["states"]}
    assert {"session:sess-1", "agent:agent-7"} <= set(states), states


def test_a_helper_agent_never_takes_the_conversation_it_forks(server):
    """Issue 19: Claude Code's helper agents (``x-claude-code-agent-id`` with a label, as
    its prompt suggestion or compaction fork) resend the conversation plus their own
    request. That would continue the conversation's state live and leave it holding the
    fork; it is a side request instead: it runs on another state, and the conversation's
    next turn still continues its own state live."""

    def send(headers, messages):
        script(server, "Sure." + EOS)
        body = {"model": "deepseek-chat", "max_tokens": 20, "system": main_sys, "tools": [TOOL]}
        r = HTTP.post(
            server.url + "/v1/messages",
            json={**body, "messages": messages},
            headers=headers,
            timeout=300,
        )
        assert r.status_code == 200, r.text[:2000]
        return r.json(), server.trace.last()

    main_sys = long_system(150, seed=121)
    main_h = {"x-claude-code-session-id": "sess-helper"}
    helper_h = {**main_h, "x-claude-code-agent-id": "aprompt_suggestion-0123456789abcdef"}
    msgs = [{"role": "user", "content": "the main task"}]
    r1, plan = send(main_h, msgs)
    main_state = plan["detail"].split("state=")[1].split()[0]
    msgs.append({"role": "assistant", "content": r1["content"]})
    _, plan = send(helper_h, [*msgs, {"role": "user", "content": "suggest the next prompt"}])
    assert "via=side" in plan["detail"] and f"state={main_state} " not in plan["detail"], plan
    _, plan = send(main_h, [*msgs, {"role": "user", "content": "go on"}])
    assert plan["decision"] in ("exact-token-prefix", "text-prefix"), plan
    assert f"state={main_state} via=live" in plan["detail"], plan


def test_count_tokens_predicts_the_state_a_tool_result_continues(server):
    """Two conversations with one visible turn and different hidden reasoning (the
    client drops thinking blocks): the tool result continues the state whose call ids
    it names (a tool-id match outranks a text one), and ``count_tokens`` predicts that
    state's usage. It took the state that keeps the most tokens: the other one."""
    base = {
        "model": "deepseek-v4-flash",
        "max_tokens": 2000,
        "system": long_system(40, seed=91),
        "tools": [TOOL],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "look it up"}],
    }

    def first(thinking: str) -> dict:
        call = tool_calls(invoke("lookup", ("word", "state", None)))
        script(server, f"{thinking}</think>Checking." + call)
        r = post(server, "/v1/messages", base)
        visible = [b for b in r["content"] if b["type"] != "thinking"]
        (use,) = [b for b in visible if b["type"] == "tool_use"]
        result = {"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}
        turns = [{"role": "assistant", "content": visible}, {"role": "user", "content": [result]}]
        return {**base, "messages": base["messages"] + turns}

    first("A long hidden reasoning " + "that goes on and on " * 30)
    b = first("short")
    counted = {k: v for k, v in b.items() if k != "max_tokens"}
    predicted = post(server, "/v1/messages/count_tokens", counted)["input_tokens"]
    script(server, "ok</think>fine" + EOS)
    r = post(server, "/v1/messages", b)
    plan = server.trace.last()
    assert plan["decision"] == "live-anthropic", plan
    assert predicted == anthropic_usage(r)[0] == plan["prompt"], (predicted, plan)
