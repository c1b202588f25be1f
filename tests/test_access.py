"""Issue 17, Origin and Host: no web page drives the server.

A real ``ds4mlx serve`` on the tiny checkpoint. A foreign ``Host`` (DNS rebinding), a
foreign or ``null`` ``Origin`` (HTTP on every route and the Responses WebSocket
upgrade) get 403, a ``text/plain`` POST with an ``Origin`` 415, each in its protocol's
error shape; loopback origins, ``curl -d`` without a content type and the official
SDKs still work; ``--allowed-origin`` / ``--allowed-host`` admit exactly what they
name; ``--api-key`` is repeatable and ``DS4MLX_API_KEY`` comma-separated; debug routes
answer loopback clients only.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

import httpx
import pytest
from server_util import HTTP, Server, ws_upgrade

from ds4mlx.origins import host_name, json_content_type, origin_key
from ds4mlx.server.app import access_rows
from ds4mlx.server.config import ServerConfig

CHAT = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MSGS = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# Every route, with a body that route accepts (None: GET/HEAD).
ROUTES = [
    ("GET", "/", None),
    ("HEAD", "/", None),
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/deepseek-chat", None),
    ("GET", "/v1/responses/resp_x", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/messages", MSGS),
    ("POST", "/v1/messages/count_tokens", {"model": "m", "messages": MSGS["messages"]}),
    ("POST", "/v1/responses", {"model": "deepseek-chat", "input": "hi", "max_output_tokens": 2}),
    ("POST", "/v1/responses/input_tokens", {"model": "deepseek-chat", "input": "hi"}),
    ("POST", "/v1/tokenize", {"text": "hi"}),
    ("POST", "/v1/detokenize", {"tokens": [1, 2]}),
    ("POST", "/tokenize", {"prompt": "hi", "add_special_tokens": False}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/tokenizer_info", None),
    ("POST", "/debug/script", {"texts": []}),
]
POSTS = [r for r in ROUTES if r[0] == "POST"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):  # noqa: F811
    with Server(tiny_model_dir, ctx=1024, extra=["--kv-disk-dir", "none"]) as s:
        yield s


@pytest.fixture(scope="module")
def allowing(tiny_model_dir):  # noqa: F811
    extra = [
        "--kv-disk-dir",
        "none",
        "--allowed-origin",
        "https://App.example:443/",
        "--allowed-host",
        "proxy.example",
        "--api-key",
        "k1",
        "--api-key",
        "k2",
    ]
    with Server(tiny_model_dir, ctx=1024, extra=extra) as s:
        yield s


def call(server, method, path, body=None, headers=None, key=None) -> httpx.Response:
    """One request; ``body`` as JSON text, its content type from ``headers`` only."""
    h = dict(headers or {})
    if key:
        h["x-api-key"] = key
    content = json.dumps(body) if body is not None else None
    return HTTP.request(method, server.url + path, content=content, headers=h, timeout=120)


def assert_shaped(r: httpx.Response, path: str, status: int, code: str | None = None) -> dict:
    """``r`` is ``status`` in its protocol's error shape (Anthropic's on /v1/messages)."""
    assert r.status_code == status, (path, r.status_code, r.text)
    # The same request would be refused again: clients must not retry it.
    assert r.headers.get("x-should-retry") == ("false" if status not in (408, 429) else None)
    if r.request.method == "HEAD":
        return {}
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"], body
    else:
        assert body["error"]["message"], body
        if code is not None:
            assert body["error"]["code"] == code, body
    return body


# --------------------------------------------------------------------------- Host


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_a_foreign_host_gets_403_on_every_route(server, method, path, body):
    ct = {"Content-Type": "application/json"}
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example"):
        r = call(server, method, path, body, {"Host": host, **ct})
        assert_shaped(r, path, 403, "host_not_allowed")


def test_loopback_hosts_are_answered(server):
    for host in ("localhost", f"LOCALHOST:{server.port}", "127.0.0.1", f"[::1]:{server.port}"):
        assert call(server, "GET", "/v1/models", headers={"Host": host}).status_code == 200


def test_a_request_without_host_is_answered(server):
    """HTTP/1.0 without ``Host`` (no browser sends one; the server reads it as an empty
    ``Host``): answered, as the Host check says, not a 403 naming ``Host ''``."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        head = sock.recv(64)
    assert head.split(b"\r\n")[0].endswith(b" 200 "), head


def test_a_foreign_host_gets_403_on_the_websocket_upgrade(server):
    status, data = ws_upgrade(server.port, {"Host": "evil.example"})
    assert status == 403 and b"host_not_allowed" in data


# --------------------------------------------------------------------------- Origin


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_a_foreign_or_null_origin_gets_403_on_every_route(server, method, path, body):
    ct = {"Content-Type": "application/json"}
    for origin in ("https://evil.example", "null", "http://localhost.evil.example", "file://"):
        r = call(server, method, path, body, {"Origin": origin, **ct})
        assert_shaped(r, path, 403, "origin_not_allowed")


def test_a_foreign_or_null_origin_gets_403_on_the_websocket_upgrade(server):
    for origin in ("https://evil.example", "null"):
        status, data = ws_upgrade(server.port, {"Origin": origin})
        assert status == 403 and b"origin_not_allowed" in data, data


def test_a_second_origin_or_host_header_is_refused(server):
    """Each check reads one value: a request carrying ``Origin`` (or ``Host``) twice was
    judged by its first, so a loopback one let a foreign one through. Now a 400 naming
    the header, in either order, on HTTP and on the WebSocket upgrade; a second Host
    never reaches a route."""
    evil, local = "http://evil.example", "http://localhost"
    url = server.url + "/v1/chat/completions"
    for first, second in ((local, evil), (evil, local), (local, local)):
        h = [("Origin", first), ("Origin", second), ("Content-Type", "application/json")]
        r = HTTP.post(url, content=json.dumps(CHAT), headers=h, timeout=60)
        body = assert_shaped(r, "/v1/chat/completions", 400, "duplicate_header")
        assert body["error"]["param"] == "Origin", body
    status, data = ws_upgrade(server.port, {"Origin": local, "origin": evil})
    assert status == 400 and b"duplicate_header" in data, data
    # A second Host (after the loopback one ws_upgrade sends): HTTP/1.1's parser
    # refuses it before any route, as it should.
    assert ws_upgrade(server.port, {"host": "evil.example"})[0] == 400


def test_loopback_origins_are_answered_on_http_and_only_the_servers_own_on_the_websocket(
    server,
):
    """Over HTTP a loopback page's request is answered (its browser's CORS check keeps
    the answer from a page of another port). A WebSocket has no CORS: a page of another
    local server (a dev server, `python -m http.server` serving a downloaded file) drove
    the model and read every event, unasked. Only the server's own origin (its port) may
    open it, or what --allowed-origin / --cors admit."""
    origins = (
        "http://localhost:3000",
        "http://127.0.0.1:8080",
        "https://[::1]",
        "http://localhost",
    )
    for origin in origins:
        h = {"Origin": origin, "Content-Type": "application/json"}
        assert call(server, "POST", "/v1/chat/completions", CHAT, h).status_code == 200
        status, data = ws_upgrade(server.port, {"Origin": origin})
        assert status == 403 and b"origin_not_allowed" in data, (origin, data)
    for own in (f"http://127.0.0.1:{server.port}", f"http://localhost:{server.port}"):
        assert ws_upgrade(server.port, {"Origin": own})[0] == 101, own
    assert ws_upgrade(server.port, {})[0] == 101  # no Origin: not a browser (Codex)


@pytest.mark.parametrize(("method", "path", "body"), POSTS, ids=[p for _, p, _ in POSTS])
def test_a_post_with_an_origin_must_declare_json(server, method, path, body):
    origin = {"Origin": "http://localhost:3000"}
    for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        h = {**origin, **({"Content-Type": ct} if ct else {})}
        r = call(server, method, path, body, h)
        err = assert_shaped(r, path, 415, "unsupported_media_type")
        assert "Content-Type" in (err["error"].get("param") or err["error"]["message"])
    for ct in ("application/json; charset=utf-8", "application/vnd.api+json"):
        r = call(server, method, path, body, {**origin, "Content-Type": ct})
        assert r.status_code not in (403, 415), (ct, r.text)


def test_the_size_check_runs_before_the_content_type_check(server):
    # A declared size over the 32 MiB limit: refused before any of the body is read.
    head = (
        f"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        "Origin: http://localhost:3000\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {32 * 1024 * 1024 + 1}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode() + b"x" * 1024)
        data = b""
        while b"}}" not in data:
            more = sock.recv(65536)
            if not more:
                break
            data += more
    status = int(data.split(b" ", 2)[1])
    body = json.loads(data.partition(b"\r\n\r\n")[2])
    assert status == 413 and body["type"] == "error", data


def test_requests_without_origin_are_parsed_as_before(server):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl not installed")
    # curl -d sends Content-Type: application/x-www-form-urlencoded: no Origin, so parsed.
    out = subprocess.run(
        [curl, "-s", "-w", "\n%{http_code}", server.url + "/v1/chat/completions"]
        + ["-d", json.dumps(CHAT)],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    body, status = out.rsplit("\n", 1)
    assert status == "200" and json.loads(body)["object"] == "chat.completion", out
    r = call(server, "POST", "/v1/messages", MSGS, {"Content-Type": "text/plain"})
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_the_official_sdks_still_work(server):
    # Imported here: the SDKs take seconds to import, a cost every worker's collection paid.
    import anthropic
    import openai

    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = oai.chat.completions.create(**CHAT)
    assert r.choices[0].finish_reason in ("length", "stop")
    ant = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    m = ant.messages.create(**MSGS)
    assert m.type == "message"


# --------------------------------------------------------------------------- allow-lists


def test_allowed_origin_admits_exactly_that_origin(allowing):
    k = "k1"
    h = {"Origin": "https://app.example", "Content-Type": "application/json"}
    r = call(allowing, "POST", "/v1/chat/completions", CHAT, h, key=k)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert "origin" in r.headers.get("vary", "").lower()
    pre = httpx.options(
        allowing.url + "/v1/chat/completions",
        headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"},
    )
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == "https://app.example"
    assert ws_upgrade(allowing.port, {"Origin": "https://app.example", "x-api-key": k})[0] == 101
    for other in ("http://app.example", "https://app.example:8443", "https://x.app.example"):
        r = call(allowing, "GET", "/v1/models", headers={"Origin": other}, key=k)
        assert_shaped(r, "/v1/models", 403, "origin_not_allowed")
        assert "access-control-allow-origin" not in r.headers
        assert ws_upgrade(allowing.port, {"Origin": other, "x-api-key": k})[0] == 403


def test_allowed_host_admits_exactly_that_host(allowing):
    for host in ("proxy.example", "PROXY.example:443", "localhost"):
        assert (
            call(allowing, "GET", "/v1/models", headers={"Host": host}, key="k2").status_code == 200
        )
    for host in ("other.example", "proxy.example.evil", "x.proxy.example"):
        r = call(allowing, "GET", "/v1/models", headers={"Host": host}, key="k2")
        assert_shaped(r, "/v1/models", 403, "host_not_allowed")


def test_api_key_is_repeatable(allowing):
    for key in ("k1", "k2"):
        assert call(allowing, "GET", "/v1/models", key=key).status_code == 200
        r = HTTP.get(allowing.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
    for key in ("k3", "k1k2", None):
        assert_shaped(call(allowing, "GET", "/v1/models", key=key), "/v1/models", 401)
    # Both headers, one of them stale (an SDK's api_key beside an auth_token): the
    # matching one authorizes, whichever it is (a stale x-api-key shadowed the bearer).
    for stale, good in (("x-api-key", "Authorization"), ("Authorization", "x-api-key")):
        value = lambda name, k: f"Bearer {k}" if name == "Authorization" else k  # noqa: E731
        h = {stale: value(stale, "old"), good: value(good, "k2")}
        assert HTTP.get(allowing.url + "/v1/models", headers=h).status_code == 200
    h = {"x-api-key": "old", "Authorization": "Bearer older"}
    assert_shaped(HTTP.get(allowing.url + "/v1/models", headers=h), "/v1/models", 401)


def test_debug_routes_answer_loopback_clients_only_even_with_their_flag(allowing):
    body = {"reset": True}
    # The allow-lists admit this origin and host on every other route...
    h = {"Origin": "https://app.example", "Content-Type": "application/json"}
    assert call(allowing, "POST", "/v1/tokenize", {"text": "x"}, h, key="k1").status_code == 200
    # ...not on the debug routes.
    for headers in (h, {"Host": "proxy.example", "Content-Type": "application/json"}):
        r = call(allowing, "POST", "/debug/script", body, headers, key="k1")
        assert_shaped(r, "/debug/script", 403, "debug_loopback_only")
    h = {"Origin": "http://localhost:3000", "Content-Type": "application/json"}
    assert call(allowing, "POST", "/debug/script", body, h, key="k1").status_code == 200


def test_api_keys_from_the_environment_are_comma_separated(tiny_model_dir):  # noqa: F811
    env = {"DS4MLX_API_KEY": " e1, e2 ,"}
    with Server(tiny_model_dir, ctx=1024, extra=["--kv-disk-dir", "none"], env=env) as s:
        for key in ("e1", "e2"):
            assert call(s, "GET", "/v1/models", key=key).status_code == 200
        for key in ("e1, e2", "", None):
            assert call(s, "GET", "/v1/models", key=key).status_code == 401
        assert "one of 2 API keys required" in s.log()


# --------------------------------------------------------------------------- units


def test_banner_warns_on_a_non_loopback_bind_without_a_key():
    rows = dict(access_rows(ServerConfig(host="0.0.0.0")))
    assert "without --api-key" in rows["[bold red]warning[/]"]
    assert "[bold red]warning[/]" not in dict(access_rows(ServerConfig(host="127.0.0.1")))
    assert "[bold red]warning[/]" not in dict(
        access_rows(ServerConfig(host="0.0.0.0", api_keys=("k",)))
    )


def test_header_parsing():
    assert host_name("LocalHost:8000") == "localhost"
    assert host_name("[::1]:8000") == "::1" and host_name("[::1]") == "::1"
    assert host_name("::1") == "::1"  # unbracketed: kept whole
    assert origin_key("HTTPS://App.Example:443/") == "https://app.example"
    assert origin_key("http://[::1]:80") == "http://[::1]"
    assert origin_key("null") is None and origin_key("https://a/b") is None
    assert json_content_type("application/json;charset=utf-8")
    assert json_content_type("application/problem+json")
    assert not json_content_type("text/plain") and not json_content_type("application/jsonx")
    assert not json_content_type(None)


def test_empty_api_keys_are_refused_not_dropped():
    """An empty ``--api-key`` (a script's ``--api-key "$KEY"`` with ``KEY`` unset), a
    ``DS4MLX_API_KEY`` set empty (``docker run -e DS4MLX_API_KEY=$KEY``; it was taken as
    unset) or holding only separators must not turn authentication off; a key outside
    printable ASCII (a client's UTF-8 bytes never equal it) is refused too."""
    from ds4mlx.origins import api_keys_from

    assert api_keys_from(None, None) == ()
    assert api_keys_from(None, "a, b,") == ("a", "b")
    assert api_keys_from(["k1", "k1"], "ignored") == ("k1",)
    bad = (([""], None), (["k", "  "], None), (None, " , "), (None, "a,,b"), (None, ""))
    for flags, env in bad:
        with pytest.raises(ValueError, match="empty key|no key"):
            api_keys_from(flags, env)
    for flags, env in ((["clé"], None), (None, "a,b\tc"), (["k\x00"], None)):
        with pytest.raises(ValueError, match="printable ASCII"):
            api_keys_from(flags, env)
