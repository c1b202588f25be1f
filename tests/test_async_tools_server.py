"""Issue 22: asynchronous tool calls through a real ``ds4mlx serve``.

One server (tiny float32 model, scripted decoding, no disk tier, one live state) for the
module. For each protocol a scripted conversation: a turn calls an async tool (``sleep``)
and a sync one (``read``); the client answers only the sync call (a live continuation:
the async call is answered by its pending status result), talks two unrelated turns, then
sends the late result by its id. Each plan comes from the ``--trace`` ``plan`` record, each
rendered prompt from the ``prompt`` record.
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
    tool_calls,
    traced_server,
)

SYSTEM = long_system(20, seed=5)
SLEEP = {
    "name": "sleep",
    "description": "Wait, in the background",
    "schema": {"type": "object", "properties": {"seconds": {"type": "integer"}}},
}
READ = {
    "name": "read",
    "description": "Read a file",
    "schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    extra = ["--kv-disk-dir", "none", "--sessions", "1"]
    with traced_server(tiny_model_dir, tmp_path_factory, ctx=16384, extra=extra) as s:
        yield s


class Chat:
    path, live, unknown = "/v1/chat/completions", "live-chat", "unknown tool_call_id {}"
    field = "tools.0.function.async"

    def body(self, msgs, flag=True):
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t["description"],
                    "parameters": t["schema"],
                    **({"async": flag} if t is SLEEP else {}),
                },
            }
            for t in (SLEEP, READ)
        ]
        msgs = [{"role": "system", "content": SYSTEM}, *msgs]
        return {"model": "deepseek-chat", "messages": msgs, "tools": tools, "max_tokens": 200}

    def user(self, text):
        return [{"role": "user", "content": text}]

    def calls(self, r):
        return [c["id"] for c in r["choices"][0]["message"]["tool_calls"]]

    def replay(self, r):
        m = r["choices"][0]["message"]
        return [{k: v for k, v in m.items() if k in ("role", "content", "tool_calls")}]

    def results(self, *pairs):
        return [{"role": "tool", "tool_call_id": i, "content": t} for i, t in pairs]

    def usage(self, r):
        return (*chat_usage(r), r["usage"]["completion_tokens"])

    def error(self, err):
        return err["error"]["message"]


class Anthropic:
    path, live = "/v1/messages", "live-anthropic"
    unknown, field = "unknown tool_use_id {}", "tools.0.async"

    def body(self, msgs, flag=True):
        tools = [
            {
                "name": t["name"],
                "description": t["description"],
                "input_schema": t["schema"],
                **({"async": flag} if t is SLEEP else {}),
            }
            for t in (SLEEP, READ)
        ]
        return {
            "model": "deepseek-v4-flash",
            "max_tokens": 200,
            "system": SYSTEM,
            "tools": tools,
            "messages": msgs,
            "thinking": {"type": "disabled"},
        }

    def user(self, text):
        return [{"role": "user", "content": text}]

    def calls(self, r):
        return [b["id"] for b in r["content"] if b["type"] == "tool_use"]

    def replay(self, r):
        return [{"role": "assistant", "content": r["content"]}]

    def results(self, *pairs):
        blocks = [{"type": "tool_result", "tool_use_id": i, "content": t} for i, t in pairs]
        return [{"role": "user", "content": blocks}]

    def usage(self, r):
        return (*anthropic_usage(r), r["usage"]["output_tokens"])

    def error(self, err):
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        return err["error"]["message"]


class Responses:
    path, live, unknown = "/v1/responses", "live-responses", "unknown call_id {}"
    field = "tools.0.async"

    def body(self, items, flag=True):
        tools = [
            {
                "type": "function",
                "name": t["name"],
                "description": t["description"],
                "parameters": t["schema"],
                **({"async": flag} if t is SLEEP else {}),
            }
            for t in (SLEEP, READ)
        ]
        return {
            "model": "deepseek-chat",
            "input": items,
            "instructions": SYSTEM,
            "tools": tools,
            "max_output_tokens": 200,
        }

    def user(self, text):
        return [{"type": "message", "role": "user", "content": text}]

    def calls(self, r):
        return [i["call_id"] for i in r["output"] if i["type"] == "function_call"]

    def replay(self, r):
        out = []
        for i in r["output"]:
            if i["type"] == "function_call":
                out.append({k: i[k] for k in ("type", "call_id", "name", "arguments")})
            elif i["type"] == "message":
                text = "".join(p["text"] for p in i["content"] if p["type"] == "output_text")
                out.append(
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": text}],
                    }
                )
        return out

    def results(self, *pairs):
        return [{"type": "function_call_output", "call_id": i, "output": t} for i, t in pairs]

    def usage(self, r):
        return (*responses_usage(r), r["usage"]["output_tokens"])

    def error(self, err):
        return err["error"]["message"]


PROTOCOLS = {"chat": Chat(), "anthropic": Anthropic(), "responses": Responses()}


def _reset(server) -> None:
    """Replace the live state with an unrelated conversation (and bind nothing)."""
    script(server, "x" + EOS)
    body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "unrelated"}]}
    post(server, "/v1/chat/completions", body)


def _turn(server, p, history, reply: str):
    """One request whose reply is scripted; its plan and rendered prompt from the trace."""
    script(server, reply)
    r = post(server, p.path, p.body(history))
    plan = server.trace.last()
    prompt = [rec for rec in server.trace.prompts() if rec["job"] == plan["job"]]
    return r, plan, prompt[-1]["text"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_async_call_live_status_then_late_result(server, protocol):
    p = PROTOCOLS[protocol]
    _reset(server)
    start = p.user("Start a 5 second timer and read a.txt.")
    calls = tool_calls(
        invoke("sleep", ("seconds", 5, None)), invoke("read", ("path", "a.txt", None))
    )
    r1, plan1, _ = _turn(server, p, start, calls)
    x, y = p.calls(r1)
    p1, _, out1 = p.usage(r1)
    assert plan1["decision"] == "cold"

    # The sync result alone: live, only the suffix (status result of x, result of y).
    h2 = start + p.replay(r1) + p.results((y, "R-Y"))
    r2, plan2, text2 = _turn(server, p, h2, "First answer." + EOS)
    assert plan2["decision"] == p.live, plan2
    p2, c2, out2 = p.usage(r2)
    assert c2 == p1 + out1 - 1
    status = f"[{x} sleep: running in the background; its result will come later with this id]"
    suffix = (
        f"{EOS}{USER}<tool_result>{status}</tool_result>\n\n<tool_result>R-Y</tool_result>"
        f"{ASSISTANT}</think>"
    )
    assert text2.endswith(suffix)
    assert p2 - c2 == count_tokens(server, suffix)

    # Two unrelated user turns: each request prefills only its new suffix.
    h3 = h2 + p.replay(r2) + p.user("Unrelated question one?")
    r3, _, text3 = _turn(server, p, h3, "Second answer." + EOS)
    p3, c3, out3 = p.usage(r3)
    assert c3 == p2 + out2 - 1
    h4 = h3 + p.replay(r3) + p.user("Unrelated question two?")
    r4, _, text4 = _turn(server, p, h4, "Third answer." + EOS)
    p4, c4, out4 = p.usage(r4)
    assert c4 == p3 + out3 - 1

    # Bad input changes nothing: a late result for an id never called (and not bound) is
    # today's 400; a non-boolean async flag is the protocol's 400 naming the field.
    bad = h4 + p.replay(r4) + p.results(("call_never0123", "?"))
    err = post(server, p.path, p.body(bad), status=400)
    assert p.error(err).startswith(p.unknown.format("call_never0123") + ": no call has this id")
    h5 = h4 + p.replay(r4) + p.results((x, "slept 5 s"))
    err = post(server, p.path, p.body(h5, flag="yes"), status=400)
    assert p.error(err).startswith(p.field + ":")
    assert err["error"].get("param", p.field) == p.field  # OpenAI's param names it too

    # The late result by id: named beside its call, and only the new suffix prefilled.
    r5, plan5, text5 = _turn(server, p, h5, "Timer done." + EOS)
    p5, c5, _ = p.usage(r5)
    assert c5 == p4 + out4 - 1, plan5
    assert text5.endswith(
        f"{USER}<tool_result>[result of {x} sleep(seconds=5)]\nslept 5 s</tool_result>"
        f"{ASSISTANT}</think>"
    )
    # Append-only: every rendering extends the one before; the status stays in place.
    texts = [text2, text3, text4, text5]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert text5.count(status) == 1
