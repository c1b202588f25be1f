"""Shared route plumbing: protocol-shaped errors, body parsing, SSE framing, auth, CORS.

Errors follow each protocol's own shape:

- Anthropic (``/v1/messages*``): ``{"type": "error", "error": {"type", "message"}}``
  (https://docs.anthropic.com/en/api/errors).
- OpenAI (everything else): ``{"error": {"message", "type", "param", "code"}}``
  (https://platform.openai.com/docs/guides/error-codes).

Client mistakes (malformed JSON, invalid UTF-8, wrong types, unknown roles, oversized
bodies, prompts over the context) are 4xx; only server faults are 5xx.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from quart import Response, current_app, request
from werkzeug.exceptions import HTTPException

M = TypeVar("M", bound=BaseModel)

# Anthropic error "type" per HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class APIError(Exception):
    """An error answered in the protocol's shape.

    Args:
        status: HTTP status (int).
        message: human-readable text.
        type: OpenAI ``type`` (``invalid_request_error``…); Anthropic's type is derived
            from the status unless ``anthropic_type`` is given.
        param: the offending field path, or None.
        code: OpenAI ``code`` (e.g. ``context_length_exceeded``), or None.
        fields: extra members of the error object in both shapes, for clients that
            read numbers rather than parse the message (e.g. ``n_prompt_tokens`` and
            ``n_ctx`` of a context-length error, as llama.cpp's server reports them).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        anthropic_type: str | None = None,
        fields: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.fields = dict(fields or {})
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.anthropic_type = anthropic_type


def protocol_of(path: str) -> str:
    """``"anthropic"`` for the Messages API paths, else ``"openai"``."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_body(protocol: str, err: APIError) -> dict[str, Any]:
    """The JSON error object of ``protocol`` for ``err``."""
    if protocol == "anthropic":
        return {
            "type": "error",
            "error": {
                "type": err.anthropic_type
                or _ANTHROPIC_TYPES.get(
                    err.status, "api_error" if err.status >= 500 else "invalid_request_error"
                ),
                "message": err.message,
                **err.fields,
            },
        }
    return {
        "error": {
            "message": err.message,
            "type": err.type,
            "param": err.param,
            "code": err.code,
            **err.fields,
        }
    }


def error_response(err: APIError, protocol: str | None = None) -> Response:
    """A JSON `Response` for ``err`` in the current request's protocol shape."""
    protocol = protocol or protocol_of(request.path)
    resp = current_app.response_class(
        json.dumps(error_body(protocol, err), ensure_ascii=False),
        status=err.status,
        mimetype="application/json",
    )
    return resp


def http_exception_to_api(e: HTTPException) -> APIError:
    """Map Werkzeug/Quart HTTP errors (404, 405, 413, 400…) onto `APIError`."""
    status = e.code or 500
    if status == 413:
        limit = current_app.config.get("MAX_CONTENT_LENGTH")
        msg = f"request body too large (limit {limit} bytes)" if limit else "request body too large"
        return APIError(413, msg, code="request_too_large")
    if status == 404:
        return APIError(
            404,
            f"no route {request.method} {request.path}",
            type="not_found_error",
            code="not_found",
        )
    if status == 405:
        return APIError(
            405, f"method {request.method} not allowed on {request.path}", code="method_not_allowed"
        )
    return APIError(
        status,
        e.description or e.name,
        type="invalid_request_error" if status < 500 else "server_error",
    )


_TYPE_LABELS = {"str", "int", "float", "bool", "dict", "list", "none", "bytes", "any"}


def _is_label(p: str) -> bool:
    """A pydantic union-member / tag label in an error location, not a field name."""
    return (
        any(c in p for c in "[]()'\",")
        or p.startswith("function-")
        or p.lower() in _TYPE_LABELS
        or p[:1].isupper()
    )


def _loc_to_path(loc: tuple[Any, ...], data: Any = None, missing: bool = False) -> str:
    """Pydantic error location → ``messages.0.content`` style path.

    Union member labels (``str``, ``list[…]``) and discriminator tags (``message``,
    ``text``…) are not field names: with ``data`` (the validated input) a word is kept
    only where the input has that key (or, last in a ``missing`` error, names the field).
    """
    parts: list[str] = []
    node = data
    for i, p in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(p, int):
            parts.append(str(p))
            node = node[p] if isinstance(node, list) and -len(node) <= p < len(node) else None
        elif isinstance(p, str):
            if _is_label(p):
                continue
            keep_missing = last and (missing or data is None)
            if data is not None and not keep_missing and not (isinstance(node, dict) and p in node):
                continue  # a discriminator tag
            parts.append(p)
            node = node.get(p) if isinstance(node, dict) else None
    return ".".join(parts)


def validation_error_to_api(e: ValidationError, data: Any = None) -> APIError:
    """The most specific pydantic error as a 400 naming the field path (``param``).

    A union field reports one error per member (``input`` as ``str`` and as a list of
    items); the deepest location is the branch the client meant.
    """
    errs = e.errors(include_url=False)
    if not errs:
        return APIError(400, str(e))
    paths = [
        _loc_to_path(tuple(err.get("loc", ())), data, err.get("type") == "missing") for err in errs
    ]
    best = max(range(len(errs)), key=lambda i: (len(errs[i].get("loc", ())), -i))
    path = paths[best]
    msg = errs[best].get("msg", "invalid value")
    others = {p.split(".", 1)[0] for p in paths} - {path.split(".", 1)[0]}
    more = f" (and errors in {len(others)} more fields)" if others else ""
    text = f"{path}: {msg}{more}" if path else f"{msg}{more}"
    return APIError(400, text, param=path or None)


async def read_json() -> Any:
    """Read the request body as JSON.

    Raises:
        APIError: 413 oversized, 400 invalid UTF-8, malformed or too deeply nested JSON.
    """
    try:
        raw = await request.get_data(cache=False, as_text=False)
    except HTTPException as e:
        raise http_exception_to_api(e) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        return json.loads(text)
    except RecursionError:
        raise APIError(400, "request JSON is nested too deeply") from None
    except ValueError as e:
        raise APIError(400, f"malformed JSON: {e}") from None


async def parse_body(model: type[M]) -> tuple[M, dict[str, Any]]:
    """Read and validate the body with ``model``; return the model and its dump.

    Unknown fields are tolerated (the models allow extras: clients send beta fields).

    Raises:
        APIError: 4xx for any malformed, mistyped or oversized body.
    """
    data = await read_json()
    return validate(model, data)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(v), "number" if isinstance(v, int | float) else type(v).__name__
    )


def _lone_surrogate_path(data: Any) -> str | None:
    """Path (``messages.0.content``) of the first string holding a lone UTF-16 surrogate.

    JSON allows ``"\\ud800"`` escapes that decode to no Unicode character; the tokenizer
    (and UTF-8 output) cannot take them. Fast path: one C-level encode of the whole
    body; the walk only runs when that fails.
    """
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    except (RecursionError, ValueError, TypeError):
        return None
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        v, path = stack.pop()
        items: Any = ()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(v, dict):
            items = reversed(list(v.items()))
        elif isinstance(v, list):
            items = reversed(list(enumerate(v)))
        for k, sub in items:
            if isinstance(k, str):
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "(key)"
            stack.append((sub, f"{path}.{k}" if path else str(k)))
    return None


def validate(model: type[M], data: Any) -> tuple[M, dict[str, Any]]:
    """Validate ``data`` with ``model``; 400 `APIError` with the field path on failure.

    Also rejects a body that is not an object and strings holding a lone UTF-16
    surrogate (``"\\ud800"``), naming the field.
    """
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {_json_type(data)}")
    bad = _lone_surrogate_path(data)
    if bad is not None:
        raise APIError(
            400,
            f"{bad}: string contains a lone UTF-16 surrogate escape (\\uD800-\\uDFFF "
            "without its pair), which is not a Unicode character",
            param=bad,
        )
    try:
        obj = model.model_validate(data)
    except ValidationError as e:
        raise validation_error_to_api(e, data) from None
    except RecursionError:
        raise APIError(400, "request JSON is nested too deeply") from None
    return obj, obj.model_dump()


# --------------------------------------------------------------------------- SSE


class OpenModel(BaseModel):
    """Base of every wire schema: unknown fields are kept, not rejected.

    Clients send beta and vendor fields (DESIGN.md §6); only what a route reads is
    declared and validated.
    """

    model_config = ConfigDict(extra="allow")


class Keepalive:
    """Decides when a streaming route sends a keepalive (idle for ``every`` seconds)."""

    def __init__(self, every: float):
        self.every = every
        self.last = time.monotonic()

    def sent(self) -> None:
        self.last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.every


def sse(data: Any, event: str | None = None) -> bytes:
    """One Server-Sent Events frame (``event:`` line when given, one ``data:`` line).

    ``data`` is JSON-encoded unless it is already a str (e.g. ``"[DONE]"``).
    """
    payload = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


SSE_COMMENT = b": keepalive\n\n"

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def sse_response(gen: AsyncIterator[bytes]) -> Response:
    """A streaming `Response` over ``gen`` (no response timeout)."""
    resp = current_app.response_class(gen, status=200, headers=dict(SSE_HEADERS))
    resp.timeout = None
    return resp


def json_response(obj: Any, status: int = 200) -> Response:
    return current_app.response_class(
        json.dumps(obj, ensure_ascii=False), status=status, mimetype="application/json"
    )


# --------------------------------------------------------------------------- helpers


def state():
    """The `ds4mlx.server.ServerState` of the running app."""
    return current_app.extensions["ds4mlx"]


def now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    """A random response/item id (``msg_…``, ``chatcmpl-…``, ``resp_…``)."""
    return prefix + secrets.token_hex(12)


def model_thinking(model: str | None) -> bool:
    """Thinking default for a request naming ``model``; any name is served.

    Clients send their own model names (Claude Code's ``claude-haiku-…`` for side
    requests, an SDK's default): the server has one model and serves it under any name
    (thinking on unless the name is a non-thinking alias). The first request naming an
    id the server does not list logs which model it was served as.
    """
    st = state()
    cfg = st.config
    if model and model not in cfg.model_ids() and model not in st.unknown_models:
        if len(st.unknown_models) < 1000:  # a bound: names are client-chosen
            st.unknown_models.add(model)
        logging.getLogger("ds4mlx.server").info(
            "model %r is not a served id; serving %s (thinking on) under that name",
            model,
            cfg.model_name,
        )
    return cfg.thinking_default(model)


def check_auth(headers=None) -> APIError | None:
    """Check ``--api-key`` (``Authorization: Bearer`` or ``x-api-key``); None when ok.

    ``headers``: the request's (default) or a WebSocket's headers.
    """
    key = state().config.api_key
    if not key:
        return None
    headers = request.headers if headers is None else headers
    got = headers.get("x-api-key") or ""
    auth = headers.get("authorization") or ""
    if auth.lower().startswith("bearer "):
        got = got or auth[7:].strip()
    if got and hmac.compare_digest(got.encode(), key.encode()):
        return None
    return APIError(
        401, "invalid or missing API key", type="invalid_request_error", code="invalid_api_key"
    )


def context_check(n_prompt: int, param: str = "messages") -> None:
    """Reject a prompt that leaves no room to generate (before queueing).

    ``param``: the request field holding the prompt (``messages``, ``input``, ``prompt``).

    Raises:
        APIError: 400 ``context_length_exceeded`` with the counts in the message and as
            the error's ``n_prompt_tokens`` / ``n_ctx`` fields.
    """
    ctx = state().ctx_size
    if n_prompt >= ctx:
        raise APIError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, your prompt "
            f"resulted in {n_prompt} tokens, leaving no room for output. Shorten the "
            "conversation or restart the server with a larger --ctx.",
            code="context_length_exceeded",
            param=param,
            fields={"n_prompt_tokens": n_prompt, "n_ctx": ctx},
        )


def clamp_max_tokens(requested: int | None, n_prompt: int) -> int:
    """Output limit: the request's (or ``--tokens``) capped by the context left
    (and by ``--demo``'s per-request cap).

    A limit beyond the context is not an error (DESIGN.md §6): generation stops when
    the context is full and reports ``length`` / ``max_tokens``.
    """
    st = state()
    room = st.ctx_size - n_prompt
    want = requested if requested is not None else st.config.default_max_tokens
    cap = st.config.max_tokens_cap
    if cap is not None:
        want = cap if want is None else min(int(want), cap)
    if want is None:
        return max(1, room)
    return max(1, min(int(want), room))


def demo_cap_ends_turn(requested: int | None, n_prompt: int) -> bool:
    """True when ``--demo``'s per-request cap, not the request's own limit (nor
    ``--tokens`` for a request that sets none, nor the context), bounds the output.

    The demo model is noise and never samples EOS: the cap stands in for its EOS, so a
    turn that reaches it ends as a natural end of turn (``end_turn`` / ``stop`` /
    ``completed``), not ``max_tokens`` (Claude Code retries those and then fails).
    Real models (no cap) are unaffected.
    """
    st = state()
    cap = st.config.max_tokens_cap
    if cap is None or not st.config.demo_policy:
        return False  # no cap, or --tokens chose a real output limit
    room = st.ctx_size - n_prompt
    if requested is not None:
        return cap < min(int(requested), room)
    default = st.config.default_max_tokens
    return cap < room and (default is None or cap <= default)


def demo_policy(conv):
    """``serve --demo`` without ``--tokens``: ``conv`` runs without thinking.

    The noise model would spend the whole demo cap inside its reasoning, and a client
    (Claude Code turns thinking on) would show nothing: in chat mode every token of the
    cap is visible text. Real models and ``--demo --tokens N`` are unaffected. Returns
    ``conv`` (changed in place).
    """
    if state().config.demo_policy:
        conv.thinking = False
        conv.reasoning_effort = None
    return conv


def sampling_params(
    thinking: bool, *, temperature=None, top_p=None, top_k=None, min_p=None, seed=None
):
    """``SamplingParams`` for a request (DESIGN.md §6).

    Thinking mode ignores the client's knobs, as DeepSeek's API does: temperature 1,
    top_p 1, min_p 0.05. Otherwise the client's values with those defaults; top_k
    ``-1`` (vLLM's "off") is 0; a temperature below 1e-4 is greedy. ``seed`` is any
    int (taken modulo 2**64).
    """
    from ds4mlx.engine import SamplingParams
    from ds4mlx.server.jobs import DEFAULT_MIN_P, DEFAULT_TEMPERATURE, DEFAULT_TOP_P

    if seed is not None:
        seed = int(seed) % 2**64  # MLX keys take an unsigned 64-bit seed
    if thinking:
        return SamplingParams(DEFAULT_TEMPERATURE, DEFAULT_TOP_P, 0, DEFAULT_MIN_P, seed)
    if temperature is not None and temperature < 1e-4:
        temperature = 0.0  # 1/T would overflow the logits: this is greedy
    return SamplingParams(
        DEFAULT_TEMPERATURE if temperature is None else float(temperature),
        DEFAULT_TOP_P if top_p is None else float(top_p),
        0 if top_k is None or top_k < 0 else int(top_k),
        DEFAULT_MIN_P if min_p is None else float(min_p),
        seed,
    )


async def tokenize(text: str) -> list[int]:
    """Tokenize off the event loop (long prompts take tens of milliseconds)."""
    import asyncio

    return await asyncio.to_thread(state().tokenizer.encode, text)


def check_tool_results(conv, protocol: str) -> None:
    """Reject tool results whose ids nothing explains, before the job is queued.

    A tool result must answer a call the request replays (an assistant turn with that
    id), or the trailing results must answer exactly the calls the live state just
    sampled (DESIGN.md §3). The worker checks again when the job runs (the live state
    may change while it waits) and then fails it with the same 400.

    Args:
        conv: the request's ``Conversation``.
        protocol: ``"anthropic"``, ``"chat"`` or ``"responses"`` (names the id field).
    Raises:
        APIError: 400 ``unknown tool_use_id …; replay the full messages history`` (or
            the protocol's equivalent).
    """
    from ds4mlx.kv.live import unexplained_tool_ids, unknown_id_message

    kv = getattr(state(), "kv", None)
    bound = kv.bound_tool_ids() if kv is not None else frozenset()
    bad = unexplained_tool_ids(conv, bound)
    if bad:
        param = {"anthropic": "messages", "chat": "messages", "responses": "input"}[protocol]
        raise APIError(400, unknown_id_message(protocol, bad[0]), param=param)


def render(conv) -> str:
    """Render ``conv`` with the server's context size and tool memory (400 on errors)."""
    from ds4mlx.dsml import render_prompt

    st = state()
    try:
        return render_prompt(conv, context_size=st.ctx_size, tool_memory=st.tool_memory)
    except (ValueError, TypeError, RecursionError) as e:
        raise APIError(400, f"cannot render the conversation: {e}") from None


# --------------------------------------------------------------------------- reasoning carrier


def load_reasoning_key() -> bytes:
    """AES-256-GCM key for reasoning carriers (`ReasoningCarrier`).

    ``DS4MLX_REASONING_KEY`` when set; else a random key kept in
    ``$XDG_CACHE_HOME/ds4mlx/reasoning.key`` (created 0600) so carriers handed out
    before a restart still verify after it; else a per-process random key.
    """
    env = os.environ.get("DS4MLX_REASONING_KEY")
    if env:
        return hashlib.sha256(env.encode()).digest()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "ds4mlx" / "reasoning.key"
    try:
        data = path.read_bytes()
        if len(data) >= 32:
            return data[:32]
    except OSError:
        pass
    key = secrets.token_bytes(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
    except OSError:
        try:
            data = path.read_bytes()  # lost a creation race: use the winner's key
            if len(data) >= 32:
                return data[:32]
        except OSError:
            pass
    return key


class ReasoningCarrier:
    """Opaque, authenticated-encrypted carrier of sampled reasoning text.

    Used as the Responses reasoning item's ``encrypted_content`` and the Anthropic
    thinking block's ``signature``: a stateless client hands it back and the server
    recovers the exact reasoning, so a replay renders the exact prefix the model
    sampled (DESIGN.md §6: opaque, integrity-protected). Format: ``ds4r2.`` +
    base64url(12-byte nonce + AES-256-GCM ciphertext and tag of the UTF-8 text), the
    prefix as associated data. A tampered, foreign-key or foreign-format carrier opens
    to None.

    The nonce is synthetic (HMAC of the text under a separate subkey), so the same
    reasoning always seals to the same carrier: replies stay reproducible, and a
    nonce repeats only with its own plaintext (which reveals only that equality).
    """

    PREFIX = "ds4r2."
    _AAD = b"ds4r2"

    def __init__(self, key: bytes):
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(hmac.new(key, b"ds4r2 enc", hashlib.sha256).digest())
        self._nonce_key = hmac.new(key, b"ds4r2 nonce", hashlib.sha256).digest()

    def seal(self, text: str) -> str:
        plain = text.encode("utf-8")
        nonce = hmac.new(self._nonce_key, plain, hashlib.sha256).digest()[:12]
        blob = nonce + self._aead.encrypt(nonce, plain, self._AAD)
        return self.PREFIX + base64.urlsafe_b64encode(blob).rstrip(b"=").decode()

    def open(self, token: str | None) -> str | None:
        """The reasoning text, or None for a foreign, corrupted or forged carrier."""
        from cryptography.exceptions import InvalidTag

        if not token or not isinstance(token, str) or not token.startswith(self.PREFIX):
            return None
        body = token[len(self.PREFIX) :]
        try:
            blob = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (ValueError, TypeError):
            return None
        if len(blob) < 12 + 16:
            return None
        try:
            plain = self._aead.decrypt(blob[:12], blob[12:], self._AAD)
            return plain.decode("utf-8")
        except (InvalidTag, UnicodeDecodeError, ValueError):
            return None


# --------------------------------------------------------------------------- jobs


def failed_to_api(ev) -> APIError:
    """A worker `JobFailed` as an `APIError` (400 for context overflow, else its status)."""
    code = "context_length_exceeded" if ev.kind == "context_length_exceeded" else None
    typ = "invalid_request_error" if ev.status < 500 else "server_error"
    fields = getattr(ev, "fields", None) or {}
    return APIError(ev.status, ev.message, type=typ, code=code, fields=fields)


async def collect(job) -> tuple[list[Any], Any]:
    """Drain a job for a non-streaming response: ``(events, JobDone)``.

    Cancels the job if the handler is cancelled (client gone).

    Raises:
        APIError: the job failed.
    """
    from ds4mlx.server.jobs import JobDone, JobFailed

    events: list[Any] = []
    try:
        async for ev in job.events():
            if isinstance(ev, JobFailed):
                raise failed_to_api(ev)
            if isinstance(ev, JobDone):
                return events, ev
            events.append(ev)
    finally:
        if not job.done:
            job.cancel.set()
    raise APIError(500, "job ended without a result", type="server_error")  # pragma: no cover


async def guard(job, gen: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Wrap a streaming generator so that a client disconnect cancels ``job``."""
    try:
        async for chunk in gen:
            yield chunk
    finally:
        if not job.done:
            job.cancel.set()
