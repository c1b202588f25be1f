"""Issue 13, must-hold: a schema-driven fuzz run against a real server.

Request bodies are generated from the routes' own pydantic models (their JSON schemas,
through ``hypothesis-jsonschema``) and sent to every JSON endpoint of a real
``ds4mlx serve`` whose output is capped to 2 tokens: no 5xx (nor a server error inside
a 200 stream), the worker alive, and a valid request answered correctly afterwards.

``hypothesis-jsonschema`` composes a whole request schema slowly (its ``oneOf`` /
``anyOf`` handling filters candidates: ~0.5 s per Anthropic body), and pydantic's
callable discriminators (Anthropic content blocks, Responses items) only show up as
unions. So the composite parts (objects, arrays, unions, ``$ref``) are walked here
with plain hypothesis strategies and only the leaves (strings with limits, enums,
numbers, free-form objects) go through ``from_schema``. One body in eight gets one
field replaced by arbitrary JSON, for the 400 paths; most others have their lone
surrogates removed, so that they reach rendering and generation.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from server_util import EOS, HTTP, Server

pytestmark = pytest.mark.slow

if find_spec("hypothesis_jsonschema") is None:
    # find_spec: hypothesis is imported by the test itself, not when the suite is collected.
    pytest.skip("hypothesis-jsonschema not installed", allow_module_level=True)

CTX = 2048

# endpoint -> (pydantic model, bodies)
PLAN = {
    "/v1/chat/completions": ("ds4mlx.routes.openai:ChatRequest", 400),
    "/v1/completions": ("ds4mlx.routes.completions:CompletionRequest", 300),
    "/v1/responses": ("ds4mlx.routes.responses:ResponsesRequest", 350),
    "/v1/messages": ("ds4mlx.routes.anthropic:MessagesRequest", 400),
    "/v1/messages/count_tokens": ("ds4mlx.routes.anthropic:CountTokensRequest", 250),
    "/v1/tokenize": ("ds4mlx.routes.models:TokenizeRequest", 200),
    "/v1/detokenize": ("ds4mlx.routes.models:DetokenizeRequest", 150),
}

if TYPE_CHECKING:
    from hypothesis import strategies as st


@functools.cache
def _json_values() -> st.SearchStrategy:
    """Arbitrary small JSON values."""
    from hypothesis import strategies as st

    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False)
        | st.text(max_size=20),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
        ),
        max_leaves=8,
    )


def _model(ref: str):
    import importlib

    mod, name = ref.split(":")
    return getattr(importlib.import_module(mod), name)


def _walk(node: dict[str, Any], defs: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
    """A strategy for JSON instances of ``node`` (composites by hand, leaves by
    ``hypothesis_jsonschema.from_schema``)."""
    import hypothesis_jsonschema
    from hypothesis import strategies as st

    if "$ref" in node:
        return _walk(defs[node["$ref"].rsplit("/", 1)[-1]], defs, depth)
    for key in ("anyOf", "oneOf"):
        if key in node:
            return st.one_of([_walk(n, defs, depth) for n in node[key]])
    kind = node.get("type")
    if kind == "array" and isinstance(node.get("items"), dict):
        lo = node.get("minItems", 0)
        hi = min(node.get("maxItems", 4), lo + (4 if depth < 2 else 2))
        return st.lists(_walk(node["items"], defs, depth + 1), min_size=lo, max_size=hi)
    if kind == "object" and node.get("properties"):
        props = {k: _walk(v, defs, depth + 1) for k, v in node["properties"].items()}
        req = set(node.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in req},
            optional={k: v for k, v in props.items() if k not in req},
        )
    if kind == "object":
        return st.dictionaries(st.text(max_size=8), _json_values(), max_size=3)
    leaf = {k: v for k, v in node.items() if k not in ("title", "description", "default")}
    return hypothesis_jsonschema.from_schema(leaf or {})


def _no_surrogates(v: Any) -> Any:
    """``v`` with lone UTF-16 surrogates dropped from every string (keys included)."""
    if isinstance(v, str):
        return v.encode("utf-8", "ignore").decode("utf-8")
    if isinstance(v, list):
        return [_no_surrogates(x) for x in v]
    if isinstance(v, dict):
        return {_no_surrogates(k): _no_surrogates(x) for k, x in v.items()}
    return v


def bodies(ref: str) -> st.SearchStrategy:
    """Bodies for the model ``ref``; one in eight with one field replaced by junk."""
    from hypothesis import strategies as st

    schema = _model(ref).model_json_schema()
    valid = _walk(schema, schema.get("$defs", {}))

    def spoil(args):
        body, k, junk = args
        if k == 0 and body:
            key = sorted(body)[len(body) // 2]
            body = {**body, key: junk}
        elif k > 2:
            body = _no_surrogates(body)  # most bodies get past the lone-surrogate 400
        return body

    return st.tuples(valid, st.integers(0, 7), _json_values()).map(spoil)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("fuzz_cache")
    (cache / "ds4mlx").mkdir()
    (cache / "ds4mlx" / "demo").symlink_to(tiny_model_dir)  # the demo model
    # --demo --tokens 2: every request's output is capped to 2 tokens.
    s = Server(
        None,
        ctx=CTX,
        extra=["--demo", "--tokens", "2", "--keepalive", "0.5"],
        env={"XDG_CACHE_HOME": str(cache)},
    )
    with s:
        yield s


def _generate(ref: str, n: int, submit) -> None:
    """Draw ``n`` bodies for ``ref`` and hand each to ``submit`` as it is generated."""
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies(ref))
    def draw(body):
        submit(body)

    draw()


def _send(client: httpx.Client, path: str, body: Any) -> tuple[int, str]:
    """Status and (for streams: the whole) text of one request."""
    raw = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    with client.stream("POST", path, content=raw, headers=headers) as r:
        text = r.read().decode("utf-8", "replace")
    return r.status_code, text


def test_schema_fuzz_never_5xx_and_the_worker_survives(server):
    failures: list[tuple[str, int, str, str]] = []
    counts: dict[str, int] = {}
    statuses: dict[tuple[str, int], int] = {}
    lock = threading.Lock()
    t0 = time.monotonic()
    client = httpx.Client(base_url=server.url, timeout=60)
    pool = ThreadPoolExecutor(max_workers=4)
    futures = []

    def check(path: str, body: Any) -> None:
        try:
            status, text = _send(client, path, body)
        except httpx.HTTPError as e:
            status, text = 0, f"{type(e).__name__}: {e}"
        bad = status >= 500 or status == 0 or "internal error" in text
        with lock:
            counts[path] = counts.get(path, 0) + 1
            statuses[(path, status)] = statuses.get((path, status), 0) + 1
            if bad:
                failures.append((path, status, json.dumps(body)[:400], text[:400]))

    for path, (ref, n) in PLAN.items():
        _generate(ref, n, lambda body, path=path: futures.append(pool.submit(check, path, body)))
    for f in futures:
        f.result()
    pool.shutdown()
    took = time.monotonic() - t0
    client.close()
    print(
        f"fuzz: {sum(counts.values())} bodies in {took:.0f}s; by status: {sorted(statuses.items())}"
    )

    assert sum(counts.values()) >= 2000, counts
    assert not failures, failures[:5]
    assert "Traceback" not in server.log() and "unhandled error" not in server.log()
    # The worker is alive and a valid request is answered correctly.
    h = server.wait_idle(timeout=60)
    assert h["status"] == "ok" and h["submitted"] == h["done"], h
    server.script("OK" + EOS)
    r = HTTP.post(
        server.url + "/v1/chat/completions",
        json={"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "OK" and choice["finish_reason"] == "stop", choice


def test_item10_demo_tokens_is_a_real_output_limit(server):
    """Issue 13 item 10: ``--demo --tokens N`` (this module's server) keeps thinking as
    asked and ends a cut turn with ``max_tokens`` (how a client's retry reproduces)."""
    body = {
        "model": "deepseek-v4-flash",
        "max_tokens": 32000,
        "thinking": {"type": "enabled", "budget_tokens": 30000},
        "messages": [{"role": "user", "content": "hi"}],
    }
    msg = HTTP.post(server.url + "/v1/messages", json=body, timeout=120).json()
    assert msg["stop_reason"] == "max_tokens", msg
    assert msg["usage"]["output_tokens"] == 2
    assert [b["type"] for b in msg["content"]][:1] == ["thinking"], msg["content"]
    assert "ends with max_tokens" in " ".join(server.log().split())  # the banner says so
