"""Shared route plumbing: protocol-shaped errors, body parsing, SSE framing, the
reasoning carrier. (Access checks and the API key are `ds4mlx.routes.access`.) (The request pipeline and the stream driver are `ds4mlx.routes.pipeline`.)

Errors follow each protocol's own shape: OpenAI's (`openai_error`, every route but the
Messages API's): ``{"error": {"message", "type", "param", "code"}}``
(https://platform.openai.com/docs/guides/error-codes); Anthropic's is
``ds4mlx.routes.anthropic.error_body``.

Client mistakes (malformed JSON, invalid UTF-8, wrong types, unknown roles, oversized
bodies, prompts over the context) are 4xx; only server faults are 5xx.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from quart import Response, current_app, request
from werkzeug.exceptions import HTTPException

M = TypeVar("M", bound=BaseModel)


class APIError(Exception):
    """An error answered in the protocol's shape.

    Args:
        status: HTTP status (int).
        message: human-readable text.
        type: OpenAI ``type`` (``invalid_request_error``…); Anthropic's type is derived
            from the status (``ds4mlx.routes.anthropic.error_body``) unless
            ``anthropic_type`` is given.
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


def openai_error(err: APIError) -> dict[str, Any]:
    """The OpenAI error object for ``err`` (every route but the Messages API's)."""
    return {
        "error": {
            "message": err.message,
            "type": err.type,
            "param": err.param,
            "code": err.code,
            **err.fields,
        }
    }


def error_response(
    err: APIError, shape: Callable[[APIError], dict[str, Any]] = openai_error
) -> Response:
    """A JSON `Response` for ``err`` in the protocol's ``shape`` (OpenAI's by default;
    the Messages API passes ``ds4mlx.routes.anthropic.error_body``)."""
    return current_app.response_class(
        json.dumps(shape(err), ensure_ascii=False),
        status=err.status,
        mimetype="application/json",
    )


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


async def parse_body(model: type[M]) -> M:
    """Read and validate the body with ``model``; return the typed request.

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


def validate(model: type[M], data: Any) -> M:
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
    return obj


# --------------------------------------------------------------------------- SSE


class OpenModel(BaseModel):
    """Base of every wire schema: unknown fields are kept, not rejected.

    Clients send beta and vendor fields (docs/ARCHITECTURE.md §6); only what a route reads is
    declared and validated.
    """

    model_config = ConfigDict(extra="allow")


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
    (thinking on unless the name is a non-thinking alias or the demo policy applies). The
    first request naming an id the server does not list logs which model it was served
    as.
    """
    st = state()
    cfg = st.config
    thinking = cfg.thinking_default(model)
    if model and model not in cfg.model_ids() and model not in st.unknown_models:
        if len(st.unknown_models) < 1000:  # a bound: names are client-chosen
            st.unknown_models.add(model)
        logging.getLogger("ds4mlx.server").info(
            "model %r is not a served id; serving %s (thinking %s) under that name",
            model,
            cfg.model_name,
            "on" if thinking else "off",
        )
    return thinking


# --------------------------------------------------------------------------- reasoning carrier


def load_reasoning_key() -> bytes:
    """The secret reasoning carriers (`ReasoningCarrier`) derive their AES-SIV key from.

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
    sampled (docs/ARCHITECTURE.md §6: opaque, integrity-protected). Format: ``ds4r3.`` +
    base64url(AES-SIV (RFC 5297, ``cryptography``'s ``AESSIV``) of the UTF-8 text, the
    prefix as associated data). AES-SIV is deterministic by design: the same reasoning
    always seals to the same carrier, so replies stay reproducible, and equal carriers
    reveal only equal texts. A tampered, foreign-key or foreign-format carrier opens to
    None.
    """

    PREFIX = "ds4r3."
    _AAD = b"ds4r3"

    def __init__(self, key: bytes):
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESSIV
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        # AES-256-SIV takes a 512-bit key (two AES-256 keys), derived from the secret.
        siv_key = HKDF(
            algorithm=hashes.SHA256(), length=64, salt=None, info=b"ds4mlx reasoning carrier"
        ).derive(key)
        self._aead = AESSIV(siv_key)

    def seal(self, text: str) -> str:
        blob = self._aead.encrypt(text.encode("utf-8"), [self._AAD])
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
        if len(blob) < 16:  # the synthetic IV alone
            return None
        try:
            return self._aead.decrypt(blob, [self._AAD]).decode("utf-8")
        except (InvalidTag, UnicodeDecodeError, ValueError):
            return None


# --------------------------------------------------------------------------- jobs


def failed_to_api(ev) -> APIError:
    """A worker `JobFailed` as an `APIError` (400 for context overflow, else its status)."""
    code = "context_length_exceeded" if ev.kind == "context_length_exceeded" else None
    typ = "invalid_request_error" if ev.status < 500 else "server_error"
    fields = getattr(ev, "fields", None) or {}
    return APIError(ev.status, ev.message, type=typ, code=code, fields=fields)
