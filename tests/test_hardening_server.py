"""Issue 13 (hardening), server items on one real ``ds4mlx serve`` process.

Each test names the item it proves. Servers run on 127.0.0.1 with the tiny float32
model and scripted decoding (``POST /debug/script``) to steer the output.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from server_util import Server, sse_events, tiny_model_dir  # noqa: F401

CTX = 2048


@pytest.fixture(scope="module")
def server(tiny_model_dir):  # noqa: F811 (fixture from server_util)
    with Server(tiny_model_dir, ctx=CTX) as s:
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
