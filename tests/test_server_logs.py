"""Issue 26 item 6: the server's log says what happened to requests that did not finish
normally (cancelled, refused, interrupted by shutdown), with their job ids, and names the
content parts the model could not see (real server, real HTTP)."""

from __future__ import annotations

import re
import threading
import time

import httpx
from server_util import HTTP, Server

PNG = "data:image/png;base64,iVBORw0KGgo="


def test_unsupported_parts_are_logged_once_per_request(tiny_model_dir):
    with Server(tiny_model_dir, ctx=2048) as srv:
        chat = {"model": "deepseek-chat", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": PNG}},
            {"type": "image_url", "image_url": {"url": PNG}},
        ]}]}  # fmt: skip
        assert HTTP.post(srv.url + "/v1/chat/completions", json=chat, timeout=120).is_success
        ant = {"model": "deepseek-chat", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}},
            {"type": "text", "text": "summarize"},
        ]}]}  # fmt: skip
        assert HTTP.post(srv.url + "/v1/messages", json=ant, timeout=120).is_success
        resp = {"model": "deepseek-chat", "max_output_tokens": 2, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": PNG},
        ]}]}  # fmt: skip
        assert HTTP.post(srv.url + "/v1/responses", json=resp, timeout=120).is_success
        plain = {
            "model": "deepseek-chat",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
        }
        assert HTTP.post(srv.url + "/v1/chat/completions", json=plain, timeout=120).is_success
        srv.request_line(3)
        lines = [ln for ln in srv.log().splitlines() if "unsupported content parts" in ln]
    assert len(lines) == 3, lines
    assert "/v1/chat/completions: unsupported content parts image_url×2" in lines[0]
    assert "the model sees only [Unsupported Image]" in lines[0]
    assert "/v1/messages: unsupported content parts document" in lines[1]
    assert "[Unsupported document type: text/plain]" in lines[1]
    assert "/v1/responses: unsupported content parts input_image" in lines[2]
    assert "[Unsupported Image]" in lines[2]


def _stream(url: str, started: threading.Event, out: list) -> None:
    body = {"model": "deepseek-chat", "max_tokens": 6000, "stream": True,
            "messages": [{"role": "user", "content": "write forever"}]}  # fmt: skip
    try:
        with HTTP.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    started.set()
                out.append(line)
    except httpx.HTTPError as e:
        out.append(repr(e))
    started.set()


def test_cancelled_and_shutdown_requests_are_logged_with_ids(tiny_model_dir):
    srv = Server(tiny_model_dir, ctx=8192).start()
    try:
        # A client that goes away mid-stream: its job's line says finish=cancelled job=N.
        body = {"model": "deepseek-chat", "max_tokens": 6000, "stream": True,
                "messages": [{"role": "user", "content": "go"}]}  # fmt: skip
        with HTTP.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if '"content"' in line:
                    break
        first = srv.request_line(0, timeout=120)
        assert re.search(r"finish=cancelled .*job=\d+$", first), first

        # Shutdown with one job running and one queued behind it.
        started, out1, out2 = threading.Event(), [], []
        t1 = threading.Thread(target=_stream, args=(srv.url, started, out1))
        t1.start()
        assert started.wait(120)
        t2 = threading.Thread(target=_stream, args=(srv.url, threading.Event(), out2))
        t2.start()
        deadline = time.monotonic() + 60
        while HTTP.get(srv.url + "/health").json().get("queued", 2) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        srv.stop(timeout=120)
    t1.join(60)
    t2.join(60)
    log = srv.log()
    running = re.search(r"shutdown: /v1/chat/completions job (\d+) interrupted", log)
    queued = re.search(r"shutdown: /v1/chat/completions job (\d+) refused before it started", log)
    assert running and queued, log[-3000:]
    assert int(queued.group(1)) == int(running.group(1)) + 1
