"""A client that goes away during a long prefill frees the worker at the next prefill chunk,
not after the whole prompt (hardening issue, item 7), streaming or not."""

from __future__ import annotations

import time

import httpx
import pytest
from server_util import Server, tiny_model_dir  # noqa: F401

PROMPT_WORDS = 24000  # ~24k tokens: tens of seconds of prefill on this CPU


def _leave_mid_prefill(s: Server, body: dict) -> None:
    if not body["stream"]:
        try:
            httpx.post(s.url + "/v1/chat/completions", json=body, timeout=3.0)
        except httpx.TimeoutException:
            return  # the client gave up mid-prefill and closed its connection
        raise AssertionError("the prefill finished before the client left")
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", s.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            deadline = time.monotonic() + 30
            while not s.health()["busy"] and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)  # well inside the prefill
        # The response (and its connection) is closed here, mid-prefill.


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_disconnect_during_prefill_cancels_between_chunks(tiny_model_dir, stream):  # noqa: F811
    with Server(tiny_model_dir, ctx=32768, extra=["--kv-disk-dir", "none"]) as s:
        body = {
            "model": "deepseek-chat",
            "stream": stream,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "word " * PROMPT_WORDS}],
        }
        _leave_mid_prefill(s, body)
        t_gone = time.monotonic()
        s.wait_idle(timeout=20)
        freed = time.monotonic() - t_gone
        deadline = time.monotonic() + 10
        while not s.request_lines() and time.monotonic() < deadline:
            time.sleep(0.1)
        (line,) = s.request_lines()
        assert "finish=cancelled" in line and "prefill=cancelled after" in line, line
        done, total = line.split("cancelled after ")[1].split(" ")[0].split("/")
        assert int(done) < int(total), line
        assert freed < 10, f"worker busy {freed:.1f}s after the client left"
        # The server still answers.
        r = httpx.post(
            s.url + "/v1/chat/completions",
            json={
                "model": "deepseek-chat",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}],
            },
            timeout=60,
        )
        assert r.status_code == 200
