"""Issue 20: what the client asked for is what it gets, in every protocol, streaming and
not. One real ``ds4mlx serve`` (tiny checkpoint, scripted decoding) for the module.
"""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Any

import httpx
import pytest
from server_util import EOS, HTTP, Server, sse_events, tool_call_dsml

CTX = 1024
CHAT = "/v1/chat/completions"
MSGS = "/v1/messages"
RESP = "/v1/responses"
ANT_HEADERS = {"anthropic-version": "2023-06-01"}

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOL = {
    CHAT: {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    MSGS: {"name": "get_weather", "input_schema": PARAMS},
    RESP: {"type": "function", "name": "get_weather", "parameters": PARAMS},
}
NONE = {CHAT: "none", MSGS: {"type": "none"}, RESP: "none"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with Server(tiny_model_dir, ctx=CTX, extra=["--keepalive", "0.2"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=ANT_HEADERS, timeout=120) as c:
        yield c


def body_for(path: str, text: str, *, thinking: bool = False, **extra: Any) -> dict[str, Any]:
    """A one-user-message request of ``path`` with thinking on or off."""
    if path == RESP:
        body: dict[str, Any] = {
            "input": text,
            "reasoning": {"effort": "high" if thinking else "none"},
        }
    else:
        body = {"messages": [{"role": "user", "content": text}]}
        if path == MSGS:
            body["thinking"] = {"type": "enabled" if thinking else "disabled"}
            body["max_tokens"] = 200
        else:
            body["thinking"] = {"type": "enabled" if thinking else "disabled"}
    return {"model": "deepseek-v4", **body, **extra}


def call(client: httpx.Client, path: str, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """POST ``body``; returns a summary: ``text``, ``calls`` (names), ``finish``, ``raw``
    (every byte the client received), ``args`` (streamed argument texts joined)."""
    body = {**body, "stream": stream}
    if not stream:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        return {**_summary(path, r.json()), "raw": r.text, "args": ""}
    events = []
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        raw = []
        lines = (raw.append(ln) or ln for ln in r.iter_lines())
        events = [(e, d) for e, d in sse_events(lines) if d not in (None, "[DONE]")]
    datas = [json.loads(d) for _, d in events]
    return {**_stream_summary(path, datas), "raw": "\n".join(raw)}


def _summary(path: str, b: dict[str, Any]) -> dict[str, Any]:
    if path == CHAT:
        m = b["choices"][0]
        calls = [c["function"]["name"] for c in m["message"].get("tool_calls") or []]
        return {"text": m["message"]["content"] or "", "calls": calls, "finish": m["finish_reason"]}
    if path == MSGS:
        text = "".join(c.get("text", "") for c in b["content"] if c["type"] == "text")
        calls = [c["name"] for c in b["content"] if c["type"] == "tool_use"]
        return {"text": text, "calls": calls, "finish": b["stop_reason"]}
    text = "".join(
        p.get("text", "") for o in b["output"] if o["type"] == "message" for p in o["content"]
    )
    calls = [o["name"] for o in b["output"] if o["type"] == "function_call"]
    reason = (b.get("incomplete_details") or {}).get("reason") or b["status"]
    return {"text": text, "calls": calls, "finish": reason}


def _stream_summary(path: str, datas: list[dict[str, Any]]) -> dict[str, Any]:
    text, calls, args, finish = "", [], "", None
    for d in datas:
        if path == CHAT:
            for c in d.get("choices", []):
                text += c["delta"].get("content") or ""
                for tc in c["delta"].get("tool_calls") or []:
                    if tc.get("function", {}).get("name"):
                        calls.append(tc["function"]["name"])
                    args += tc.get("function", {}).get("arguments") or ""
                finish = c.get("finish_reason") or finish
        elif path == MSGS:
            if d["type"] == "content_block_start" and d["content_block"]["type"] == "tool_use":
                calls.append(d["content_block"]["name"])
            elif d["type"] == "content_block_delta":
                text += d["delta"].get("text", "")
                args += d["delta"].get("partial_json", "")
            elif d["type"] == "message_delta":
                finish = d["delta"]["stop_reason"]
        else:
            t = d["type"]
            if t == "response.output_text.delta":
                text += d["delta"]
            elif t == "response.output_item.added" and d["item"]["type"] == "function_call":
                calls.append(d["item"]["name"])
            elif t == "response.function_call_arguments.delta":
                args += d["delta"]
            elif t in ("response.completed", "response.incomplete"):
                resp = d["response"]
                finish = (resp.get("incomplete_details") or {}).get("reason") or resp["status"]
    return {"text": text, "calls": calls, "finish": finish, "args": args}


END_TURN = {CHAT: "stop", MSGS: "end_turn", RESP: "completed"}
LENGTH = {CHAT: "length", MSGS: "max_tokens", RESP: "max_output_tokens"}
PROTOCOLS = [CHAT, MSGS, RESP]


# --------------------------------------------------------------------------- item 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", PROTOCOLS)
def test_tool_choice_none_never_returns_a_call_nor_its_markup(server, client, path, stream):
    """tool_choice none: a call the model writes anyway is dropped: the client gets the
    text before it, a plain end of turn, and none of the DSML bytes."""
    server.script("Sure." + tool_call_dsml("get_weather", city="Qwzx"))
    body = body_for(path, "Weather in Bern?", tools=[TOOL[path]], tool_choice=NONE[path])
    out = call(client, path, body, stream)
    assert out["calls"] == [] and out["args"] == ""
    assert out["text"] == "Sure."
    assert out["finish"] == END_TURN[path]
    assert "DSML" not in out["raw"] and "Qwzx" not in out["raw"]
    # With tool_choice auto the same continuation is a call (the test's control).
    server.script("Sure." + tool_call_dsml("get_weather", city="Bern"))
    out = call(client, path, body_for(path, "Weather in Bern?", tools=[TOOL[path]]), stream)
    assert out["calls"] == ["get_weather"]


@pytest.mark.parametrize("path", PROTOCOLS)
def test_tool_choice_none_in_reasoning_and_no_live_binding(server, client, path):
    """A block written inside the reasoning is dropped too, and the turn binds nothing:
    the live state holds the dropped DSML, which no rendering of the turn has."""
    server.script("Let me call." + tool_call_dsml("get_weather", city="Qwzx"))
    body = body_for(
        path, "Weather in Oslo?", thinking=True, tools=[TOOL[path]], tool_choice=NONE[path]
    )
    out = call(client, path, body, False)
    assert out["calls"] == [] and "DSML" not in out["raw"] and "Qwzx" not in out["raw"]
    assert out["finish"] == END_TURN[path]
    n = len(server.request_lines())
    # The client's next request replays the turn as it saw it (no call): no live
    # continuation may claim the state, which holds the dropped block.
    if path == CHAT:
        follow = {
            **body,
            "messages": [
                *body["messages"],
                {"role": "assistant", "content": ""},
                {"role": "user", "content": "And Rome?"},
            ],
        }
    elif path == MSGS:
        follow = {
            **body,
            "messages": [
                *body["messages"],
                {"role": "assistant", "content": [{"type": "text", "text": " "}]},
                {"role": "user", "content": "And Rome?"},
            ],
        }
    else:
        follow = {
            **body,
            "input": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "user", "content": "And Rome?"},
            ],
        }
    server.script("Fine." + EOS)
    call(client, path, follow, False)
    line = server.request_line(n)
    assert " live-" not in line, line


# --------------------------------------------------------------------------- item 8


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("url", ["/", "/api/hello"])
def test_base_url_probes_answer_200(server, method, url):
    r = httpx.request(method, server.url + url, timeout=10)
    assert r.status_code == 200, r.text
    if method == "GET":
        assert r.json()["status"] == "ok"
    else:
        assert r.content == b""


CHAT_BODY = json.dumps(
    {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
).encode()


@pytest.mark.parametrize(
    ("coding", "data"),
    [
        ("gzip", gzip.compress(CHAT_BODY)),
        ("deflate", zlib.compress(CHAT_BODY)),
        ("deflate", zlib.compress(CHAT_BODY)[2:-4]),  # a bare deflate stream
        ("identity", CHAT_BODY),
    ],
    ids=["gzip", "deflate", "raw-deflate", "identity"],
)
def test_compressed_bodies_are_decoded(server, coding, data):
    headers = {"Content-Encoding": coding, "Content-Type": "application/json"}
    r = HTTP.post(server.url + CHAT, content=data, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("path", [CHAT, MSGS, RESP])
def test_unknown_content_encoding_is_415_naming_it(server, path):
    headers = {"Content-Encoding": "br", "Content-Type": "application/json", **ANT_HEADERS}
    r = HTTP.post(server.url + path, content=b"\x0b\x02\x80", headers=headers, timeout=30)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert "'br'" in err["message"] and "gzip" in err["message"]
    if path == MSGS:
        assert r.json()["type"] == "error"


def test_zstd_is_decoded_only_with_zstandard(server):
    try:
        import zstandard
    except ImportError:
        zstandard = None
    headers = {"Content-Encoding": "zstd", "Content-Type": "application/json"}
    data = zstandard.ZstdCompressor().compress(CHAT_BODY) if zstandard else b"(\xb5/\xfd"
    r = HTTP.post(server.url + CHAT, content=data, headers=headers, timeout=60)
    assert r.status_code == (200 if zstandard else 415), r.text


def test_decoded_size_limit_holds_against_a_zip_bomb(server):
    """40 MiB of zeros gzip to ~40 KB: the 32 MiB body limit applies to what the body
    decodes to, and the server stops expanding there (413), then answers normally."""
    bomb = gzip.compress(b"0" * (40 << 20), compresslevel=9)
    assert len(bomb) < 1 << 20
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    r = HTTP.post(server.url + CHAT, content=bomb, headers=headers, timeout=60)
    assert r.status_code == 413, r.text
    assert "decoded" in r.json()["error"]["message"]
    r = HTTP.post(server.url + CHAT, content=b"\x1f\x8bnot gzip", headers=headers, timeout=60)
    assert r.status_code == 400 and "gzip" in r.json()["error"]["message"]
    assert HTTP.post(server.url + CHAT, content=CHAT_BODY, timeout=60).status_code == 200


# --------------------------------------------------------------------------- item 4


def _fill(client: httpx.Client, room: int) -> str:
    """A user text whose chat-mode prompt leaves ``room`` tokens of the context."""
    text = "w " * (CTX - room - 20)
    n = client.post("/v1/tokenize", json={"text": text}).json()["count"]
    # The rendering adds BOS, the user/assistant markers and </think>: measure it.
    msgs = [{"role": "user", "content": text}]
    n = client.post("/v1/tokenize", json={"messages": msgs, "model": "deepseek-chat"}).json()[
        "count"
    ]
    extra = CTX - room - n
    return text + "w " * extra


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", PROTOCOLS)
def test_context_full_stop_is_reported_as_such(server, client, path, stream):
    """The worker clamps max_tokens to the room the prompt leaves: a turn that stops
    there is a context-full stop (Anthropic's model_context_window_exceeded; chat and
    Responses have no such word: length / max_output_tokens); one that stops at the
    client's own limit stays a max-tokens stop."""
    text = _fill(client, 12)
    long = "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3
    server.script(long)
    body = body_for(path, text)
    key = {CHAT: "max_tokens", MSGS: "max_tokens", RESP: "max_output_tokens"}[path]
    out = call(client, path, {**body, key: 500}, stream)
    assert out["finish"] == {**LENGTH, MSGS: "model_context_window_exceeded"}[path], out
    server.script(long)
    out = call(client, path, {**body, key: 5}, stream)
    assert out["finish"] == LENGTH[path], out


# --------------------------------------------------------------------------- item 6

CUT_AT = (
    'Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter'
)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", PROTOCOLS)
def test_call_cut_inside_its_closing_tag_streams_no_markup(server, client, path, stream):
    """max_tokens ends the turn inside ``</｜DSML｜parameter>``: the streamed arguments
    stop at the value, with none of the tag's bytes; the cut call is never a call."""
    n = client.post("/v1/tokenize", json={"text": CUT_AT}).json()["count"]
    server.script(CUT_AT + ">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS)
    key = "max_output_tokens" if path == RESP else "max_tokens"
    out = call(client, path, body_for(path, "go", tools=[TOOL[path]], **{key: n}), stream)
    assert out["finish"] == LENGTH[path] and out["text"] == "Sure."
    assert "DSML" not in out["raw"] and "｜" not in out["raw"]
    if stream:
        assert out["args"] == '{"city": "Paris', out["args"]
    assert out["calls"] == ([] if not stream else ["get_weather"])


def _logprob_text(entries: list[dict[str, Any]]) -> str:
    return "".join(e["token"] for e in entries)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_cover_the_visible_content_only(server, client, stream):
    """Logprobs are the tokens of the content the client sees: none for the tool call's
    DSML (markup and arguments) nor for the separator held back as part of its opener."""
    server.script("Sure thing." + tool_call_dsml("get_weather", city="Qwzx"))
    body = body_for(CHAT, "go", tools=[TOOL[CHAT]], logprobs=True, top_logprobs=2)
    if not stream:
        r = client.post(CHAT, json=body)
        choice = r.json()["choices"][0]
        content, entries = choice["message"]["content"], choice["logprobs"]["content"]
    else:
        content, entries = "", []
        with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
            for _, d in sse_events(r.iter_lines()):
                if d in (None, "[DONE]"):
                    continue
                for c in json.loads(d).get("choices", []):
                    content += c["delta"].get("content") or ""
                    entries += (c.get("logprobs") or {}).get("content") or []
    assert content == "Sure thing."
    seen = _logprob_text(entries)
    assert "DSML" not in seen and "Qwzx" not in seen
    # Every token shown, and none past it (a token may end in the held "\n\n").
    assert seen.rstrip("\n") == content, seen
    assert all(len(e["top_logprobs"]) == 2 for e in entries)


# --------------------------------------------------------------------------- item 2

BOS = "<｜begin▁of▁sentence｜>"
Q = {"role": "user", "content": "Capital of France?"}
PREFILL = "The capital of France is"
HEAD = f"{BOS}<｜User｜>Capital of France?<｜Assistant｜>"


def _count(client: httpx.Client, text: str) -> int:
    return client.post("/v1/tokenize", json={"text": text}).json()["count"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("thinking", [False, True])
def test_chat_prefix_true_continues_the_assistant_message(server, client, thinking, stream):
    """DeepSeek's ``prefix: true``: the trailing assistant message renders open and the
    response is only the continuation, as visible text even in thinking mode."""
    msgs = [Q, {"role": "assistant", "content": PREFILL, "prefix": True}]
    body = body_for(CHAT, "", thinking=thinking, max_tokens=20)
    body["messages"] = msgs
    rendered = client.post("/v1/tokenize", json={**body, "messages": msgs}).json()["tokens"]
    text = client.post("/v1/detokenize", json={"tokens": rendered}).json()["text"]
    assert text == HEAD + ("<think></think>" if thinking else "</think>") + PREFILL
    server.script(" Paris." + EOS)
    out = call(client, CHAT, body, stream)
    assert out["text"] == " Paris." and out["finish"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("thinking", [False, True])
def test_chat_trailing_assistant_without_prefix_gets_a_new_reply(server, client, thinking, stream):
    """Without ``prefix`` the trailing assistant message is a finished turn and a new
    reply opens after it (DeepSeek's conversion): nothing is generated after EOS."""
    msgs = [Q, {"role": "assistant", "content": PREFILL}]
    body = body_for(CHAT, "", thinking=thinking, max_tokens=20)
    body["messages"] = msgs
    rendered = client.post("/v1/tokenize", json=body).json()["tokens"]
    text = client.post("/v1/detokenize", json={"tokens": rendered}).json()["text"]
    opener = "<think>" if thinking else "</think>"
    assert text == f"{HEAD}</think>{PREFILL}{EOS}<｜Assistant｜>{opener}"
    server.script(("Hm.</think>" if thinking else "") + "Paris." + EOS)
    out = call(client, CHAT, body, stream)
    assert out["text"] == "Paris." and out["finish"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("thinking", [False, True])
def test_anthropic_prefill_continues_the_assistant_message(server, client, thinking, stream):
    """Anthropic's prefill contract: a trailing assistant message is continued (open),
    and the response holds only the continuation (a JSON ``{`` prefill too)."""
    for prefill, cont in ((PREFILL, " Paris."), ("{", '"city": "Paris"}')):
        body = body_for(MSGS, "", thinking=thinking)
        body["messages"] = [Q, {"role": "assistant", "content": prefill}]
        n = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
        assert n == _count(client, HEAD + ("<think></think>" if thinking else "</think>") + prefill)
        server.script(cont + EOS)
        out = call(client, MSGS, body, stream)
        assert out["text"] == cont and out["finish"] == "end_turn"
