"""Issue 17: ``cache_salt`` and per-key cache isolation through a real server.

A request's ``cache_salt`` (all three protocols) and, with several ``--api-key``s, the key
it presents, salt the prompt cache: a live state or disk snapshot made under one salt is
never reused under another, so ``cached_tokens`` and latency tell one client nothing of
another's prompts. One ``ds4mlx serve`` (tiny model, scripted decoding, one live state,
two API keys) for the module; plan decisions come from ``--trace``.
"""

from __future__ import annotations

import pytest
from kv_server_util import (
    EOS,
    Trace,
    anthropic_usage,
    chat_usage,
    long_system,
    responses_usage,
)
from server_util import HTTP, Server

KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    trace = tmp_path_factory.mktemp("salt") / "trace.jsonl"
    extra = [
        "--trace", str(trace),
        "--sessions", "1",
        "--kv-cache-min-tokens", "256",
        "--kv-cache-boundary-align-tokens", "256",
        "--kv-cache-continued-interval-tokens", "8192",
        "--api-key", KEYS[0],
        "--api-key", KEYS[1],
    ]  # fmt: skip
    with Server(tiny_model_dir, ctx=8192, extra=extra) as s:
        s.trace = Trace(trace)
        yield s


def _post(server, path: str, body: dict, key: str, status: int = 200) -> dict:
    r = HTTP.post(server.url + path, json=body, headers={"x-api-key": key}, timeout=300)
    assert r.status_code == status, (r.status_code, r.text[:2000])
    return r.json()


def _script(server, text: str) -> None:
    _post(server, "/debug/script", {"texts": [text]}, KEYS[0])


def _chat(system: str, turns: list[str], salt: str | None) -> tuple[str, dict]:
    """A Chat Completions body: ``turns`` alternate user/assistant, user first."""
    msgs = [{"role": "system", "content": system}]
    msgs += [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
    ]
    body = {"model": "deepseek-chat", "max_tokens": 20, "messages": msgs}
    if salt is not None:
        body["cache_salt"] = salt
    return "/v1/chat/completions", body


def _messages(system: str, turns: list[str], salt: str | None) -> tuple[str, dict]:
    path, body = _chat(system, turns, salt)
    return "/v1/messages", {**body, "system": system, "messages": body["messages"][1:]}


def _responses(system: str, turns: list[str], salt: str | None) -> tuple[str, dict]:
    body = {
        "model": "deepseek-chat",
        "max_output_tokens": 20,
        "instructions": system,
        "input": [
            {"role": "user" if i % 2 == 0 else "assistant", "content": t}
            for i, t in enumerate(turns)
        ],
    }
    if salt is not None:
        body["cache_salt"] = salt
    return "/v1/responses", body


PROTOCOLS = {
    "chat": (_chat, chat_usage),
    "messages": (_messages, anthropic_usage),
    "responses": (_responses, responses_usage),
}


def _run(server, protocol: str, system: str, turns, salt, key=KEYS[0]) -> tuple[str, int]:
    """One scripted turn (reply ``ok``): its plan decision and cached prompt tokens."""
    build, usage = PROTOCOLS[protocol]
    _script(server, "ok" + EOS)
    path, body = build(system, turns, salt)
    resp = _post(server, path, body, key)
    return server.trace.last()["decision"], usage(resp)[1]


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_another_cache_salt_finds_nothing_the_same_salt_does(server, protocol):
    """The same long prompt under salt A, then B (a disk miss: cold, nothing cached,
    where an unsalted repeat restores the prompt's snapshot), then A again (restored)."""
    system = long_system(60, seed=len(protocol))
    assert _run(server, protocol, system, ["q"], "tenant-a") == ("cold", 0)
    assert _run(server, protocol, system, ["q"], "tenant-b") == ("cold", 0)
    decision, cached = _run(server, protocol, system, ["q"], "tenant-a")
    assert decision == "disk" and cached > 256


def test_another_salt_never_continues_the_live_state(server):
    """A continuation of salt A's live conversation sent under salt B is served cold (no
    live prefix, no snapshot); under A it reuses A's state, then continues live."""
    system = long_system(60, seed=11)
    assert _run(server, "chat", system, ["q"], "a") == ("cold", 0)
    turns = ["q", "ok", "more"]
    assert _run(server, "chat", system, turns, "b") == ("cold", 0)
    decision, cached = _run(server, "chat", system, turns, "a")
    assert decision == "disk" and cached > 256
    decision, cached2 = _run(server, "chat", system, [*turns, "ok", "again"], "a")
    assert decision == "exact-token-prefix" and cached2 > cached


def test_each_api_key_is_its_own_salt(server):
    """With two ``--api-key``s and no ``cache_salt``: key two's continuation of key
    one's conversation reuses nothing; key one's reuses its own."""
    system = long_system(60, seed=23)
    turns = ["q", "ok", "more"]
    assert _run(server, "chat", system, ["q"], None, KEYS[0]) == ("cold", 0)
    assert _run(server, "chat", system, turns, None, KEYS[1]) == ("cold", 0)
    decision, cached = _run(server, "chat", system, turns, None, KEYS[0])
    assert decision == "disk" and cached > 256


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
@pytest.mark.parametrize("salt", [7, "", "x" * 257, ["a"]])
def test_a_bad_cache_salt_is_a_400(server, protocol, salt):
    build, _ = PROTOCOLS[protocol]
    path, body = build("s", ["q"], None)
    r = HTTP.post(
        server.url + path, json={**body, "cache_salt": salt}, headers={"x-api-key": KEYS[0]}
    )
    assert r.status_code == 400, r.text
    assert "cache_salt" in r.text
