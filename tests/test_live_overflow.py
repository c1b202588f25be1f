"""A live continuation that would overflow where the rendered request fits is served by a
rebuild, with a normal answer (hardening issue, item 18: it was refused as a
context_length_exceeded error inside an HTTP 200 stream)."""

from __future__ import annotations

import json

import pytest
from kv_server_util import Trace, post, script
from server_util import HTTP, Server, sse_events

CTX = 1024


@pytest.mark.slow
def test_live_thinking_that_would_overflow_is_rebuilt(tiny_model_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with Server(tiny_model_dir, ctx=CTX, extra=["--trace", str(trace)]) as s:
        t = Trace(trace)
        first = [{"role": "user", "content": "hi"}]
        # ~900 tokens of hidden reasoning stay in the live state; the client drops them.
        script(s, "ok " * 900 + "</think>ok<｜end▁of▁sentence｜>")
        r1 = post(s, "/v1/chat/completions", {"messages": first, "max_tokens": 1000})
        assert r1["choices"][0]["message"]["content"] == "ok"
        assert r1["usage"]["completion_tokens"] > 900
        long_question = "please tell me more about it " * 70  # ~420 tokens
        nxt = [
            *first,
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": long_question},
        ]
        script(s, "</think>sure<｜end▁of▁sentence｜>")
        body = {"messages": nxt, "max_tokens": 16, "stream": True}
        events = []
        with HTTP.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for _, data in sse_events(r.iter_lines()):
                if data and data != "[DONE]":
                    events.append(json.loads(data))
        assert not any("error" in e for e in events), events[-3:]
        text = "".join(
            c["delta"].get("content") or "" for e in events for c in e.get("choices", [])
        )
        assert text == "sure"
        plan = t.last()
        # Keeping the live state (reasoning included) would not fit: rebuilt from the prompt.
        assert plan["decision"] in ("cold", "disk") and plan["prompt"] < CTX
