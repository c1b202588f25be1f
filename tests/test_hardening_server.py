"""Issue 13 (hardening), server items on one real ``ds4mlx serve`` process.

Each test names the item it proves. Servers run on 127.0.0.1 with the tiny float32
model and scripted decoding (``POST /debug/script``) to steer the output.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from kv_server_util import traced_server
from server_util import EOS, Server, sse_events  # noqa: F401

CTX = 2048


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with traced_server(tiny_model_dir, tmp_path_factory, ctx=CTX) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# ----------------------------------------------------------------- item 17


_ABORT_BODIES = {
    "/v1/chat/completions": {
        "model": "deepseek-chat",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 1500,
        "stream": True,
    },
    "/v1/responses": {
        "model": "deepseek-chat",
        "input": "Tell me a long story.",
        "max_output_tokens": 1500,
        "stream": True,
    },
    "/v1/messages": {
        "model": "deepseek-chat",
        "max_tokens": 1500,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": True,
    },
}


def _finish_of_line(line: str) -> str:
    m = re.search(r"\bfinish=(\S+)", line)
    return m.group(1) if m else "?"


def test_item17_aborted_streams_are_cancelled_never_run_to_max_tokens(server):
    """50 client aborts across the three streaming APIs: every job ends ``cancelled``."""
    paths = list(_ABORT_BODIES)
    n = 50
    before = len(server.request_lines())
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for i in range(n):
            path = paths[i % len(paths)]
            with c.stream("POST", path, json=_ABORT_BODIES[path]) as r:
                assert r.status_code == 200
                # Abort as soon as generated tokens stream: events are arriving while the
                # handler is cancelled, which is where a cancel used to be swallowed.
                seen = 0
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        seen += 1
                        if seen >= 3 + (i % 4):
                            break
            server.wait_idle(timeout=120)
    lines = server.request_lines()[before:]
    finishes = [_finish_of_line(ln) for ln in lines]
    assert len(finishes) == n, lines
    runaways = [ln for ln in lines if _finish_of_line(ln) != "cancelled"]
    assert not runaways, runaways


# ----------------------------------------------------------------- items 3 and 16

EDIT_TOOL_ANTHROPIC = {
    "name": "edit",
    "description": "Edit a file.",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}
EDIT_TOOL_OPENAI = {
    "type": "function",
    "function": {
        "name": "edit",
        "description": "Edit a file.",
        "parameters": EDIT_TOOL_ANTHROPIC["input_schema"],
    },
}
BLOCK = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="edit">\n'
    '<｜DSML｜parameter name="path" string="true">a.py</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def test_item3_a_complete_call_opened_in_thinking_is_a_tool_call(server, client):
    """Anthropic and OpenAI chat: the block before </think> comes back as a tool call,
    the reasoning ends where it starts, and the tool result continues the live state."""
    server.script("I will edit it." + BLOCK + EOS)
    body = {
        "model": "deepseek-v4-flash",
        "max_tokens": 200,
        "tools": [EDIT_TOOL_ANTHROPIC],
        "messages": [{"role": "user", "content": "Edit a.py"}],
    }
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["stop_reason"] == "tool_use"
    kinds = [b["type"] for b in msg["content"]]
    assert kinds == ["thinking", "tool_use"], msg["content"]
    assert msg["content"][0]["thinking"] == "I will edit it."
    call = msg["content"][1]
    assert call["name"] == "edit" and call["input"] == {"path": "a.py"}
    # The tool result continues the live state (the tokens stay as sampled).
    server.script("Done." + EOS)
    body["messages"] += [
        {"role": "assistant", "content": msg["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "ok"}],
        },
    ]
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["stop_reason"] == "end_turn"
    server.wait_idle()
    plan = server.trace.last()
    assert plan["decision"] == "live-anthropic" and "match=tool-use-ids" in plan["detail"], plan

    server.script("Let me look." + BLOCK + EOS)
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": "deepseek-v4-flash",
            "max_tokens": 200,
            "tools": [EDIT_TOOL_OPENAI],
            "messages": [{"role": "user", "content": "Edit a.py"}],
        },
    )
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    assert ch["message"]["reasoning_content"] == "Let me look."
    assert json.loads(ch["message"]["tool_calls"][0]["function"]["arguments"]) == {"path": "a.py"}


def test_item3_an_incomplete_block_in_thinking_stays_reasoning(server, client):
    cut = BLOCK[: BLOCK.index("</｜DSML｜invoke>")]
    server.script("Maybe." + cut + "</think>Answer." + EOS)
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": "deepseek-v4-flash",
            "max_tokens": 200,
            "tools": [EDIT_TOOL_OPENAI],
            "messages": [{"role": "user", "content": "Edit a.py"}],
        },
    )
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop"
    assert ch["message"]["reasoning_content"] == "Maybe." + cut
    assert ch["message"]["content"] == "Answer."
    assert not ch["message"].get("tool_calls")


def _opener_tokens(client) -> int:
    """Tokens of ``</think>Hi.`` (the scripted visible reply before the opener)."""
    r = client.post("/v1/tokenize", json={"text": "</think>Hi."})
    return r.json()["count"]


def test_item16_an_opener_cut_by_max_tokens_never_shows_as_text(server, client):
    n0 = _opener_tokens(client)
    opener = client.post("/v1/tokenize", json={"text": BLOCK[:40]}).json()["tokens"]
    leaks = []
    for extra in range(2, min(len(opener), 6) + 1):
        for path, body, text_of in _cut_requests(n0 + extra):
            server.script("</think>Hi." + BLOCK + EOS)
            text = text_of(client, path, body)
            if "DSML" in text or "｜" in text:
                leaks.append((path, extra, text))
    assert not leaks, leaks


def _chat_text(client, path, body) -> str:
    return client.post(path, json=body).json()["choices"][0]["message"]["content"] or ""


def _chat_stream_text(client, path, body) -> str:
    out = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        for _, data in sse_events(r.iter_lines()):
            if data and data != "[DONE]":
                for ch in json.loads(data).get("choices", []):
                    out.append(ch["delta"].get("content") or "")
    return "".join(out)


def _anthropic_text(client, path, body) -> str:
    msg = client.post(path, json=body).json()
    return "".join(b.get("text", "") for b in msg["content"] if b["type"] == "text")


def _cut_requests(max_tokens: int):
    chat = {
        "model": "deepseek-v4-flash",
        "max_tokens": max_tokens,
        "tools": [EDIT_TOOL_OPENAI],
        "messages": [{"role": "user", "content": "Edit a.py"}],
    }
    anth = {**chat, "tools": [EDIT_TOOL_ANTHROPIC]}
    return [
        ("/v1/chat/completions", chat, _chat_text),
        ("/v1/chat/completions", chat, _chat_stream_text),
        ("/v1/messages", anth, _anthropic_text),
    ]


# ----------------------------------------------------------------- item 8


def test_item8_context_errors_carry_the_counts_as_fields(server, client):
    long = "w " * (CTX + 500)
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}),
        ("/v1/completions", {"prompt": long, "max_tokens": 4}),
        ("/v1/responses", {"input": long}),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": long}]}),
    ]
    for path, body in cases:
        r = client.post(path, json={"model": "deepseek-chat", **body})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["n_ctx"] == CTX, (path, err)
        assert err["n_prompt_tokens"] > CTX, (path, err)
        assert str(err["n_prompt_tokens"]) in err["message"] and str(CTX) in err["message"]
        if path == "/v1/messages":
            assert r.json()["type"] == "error" and err["type"] == "invalid_request_error"
            # The Messages API's own wording, which Claude Code compacts on (item 11;
            # its pattern, from the 2.1 CLI): N prompt tokens > M, the largest prompt.
            m = re.search(
                r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", err["message"], re.I
            )
            assert m and (int(m[1]), int(m[2])) == (err["n_prompt_tokens"], CTX - 1), err
        else:
            assert err["code"] == "context_length_exceeded"
        # The log line says what the client was told (it showed OpenAI's wording for the
        # Messages API).
        assert f"POST {path} rejected 400: {err['message']}" in server.log(), path


def test_count_tokens_counts_a_prompt_over_the_context(client):
    """``/v1/messages/count_tokens`` answers a prompt the context cannot hold with its
    count, as Anthropic's API does: a client counts precisely to learn that the
    conversation no longer fits (Claude Code compacts on it), and a 400 there hides the
    number it asked for. ``/v1/messages`` still refuses the same prompt. Long enough
    that the route's early bound counts it (over 4 characters a token)."""
    long = "w " * (3 * CTX)
    body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": long}]}
    r = client.post("/v1/messages/count_tokens", json=body)
    assert r.status_code == 200, r.text
    n = r.json()["input_tokens"]
    refused = client.post("/v1/messages", json={**body, "max_tokens": 4})
    assert refused.status_code == 400
    assert n > 3 * CTX


# ----------------------------------------------------------------- item 15


def test_item15_unknown_model_names_are_served_logged_once_and_retrievable(server, client):
    import anthropic
    import openai

    name = "claude-haiku-4-5-20251001"
    ant = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    got = ant.models.retrieve(name)
    assert got.id == name
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    assert oai.models.retrieve("gpt-5-codex").id == "gpt-5-codex"
    for _ in range(2):
        server.script("Fine." + EOS)
        msg = ant.messages.create(
            model=name, max_tokens=8, messages=[{"role": "user", "content": "title?"}]
        )
        assert msg.model == name and msg.stop_reason == "end_turn"
    server.wait_idle()
    assumed = [ln for ln in server.log().splitlines() if repr(name) in ln and "serving" in ln]
    assert len(assumed) == 1, assumed
    assert "deepseek-v4-flash" in assumed[0]
