"""Who may use the server: the Host and Origin checks, the JSON content type of browser
POSTs, the API key and the loopback-only debug routes.

The threat (docs/ARCHITECTURE.md §6): a web page the user visits can make the browser
send requests to ``http://127.0.0.1:PORT``.

- **DNS rebinding.** A page at ``evil.example`` re-points its own name at 127.0.0.1: the
  browser then treats the server as same-origin with the page and lets it read every
  answer. Its requests carry ``Host: evil.example:PORT``: bound to a loopback address,
  the server answers only ``Host`` ``localhost``, ``127.0.0.1``, ``[::1]`` (any loopback
  IP literal; any port) and the names ``--allowed-host`` adds.
- **Cross-site requests.** A page at any other origin can send a "simple" ``POST``
  (``Content-Type: text/plain``, no preflight) and open a WebSocket; the browser adds
  ``Origin`` to both. A request whose ``Origin`` is not loopback (``null``, sent by
  sandboxed frames and ``file:`` pages, counts as foreign) is refused unless ``--cors``
  (every origin, as before) or ``--allowed-origin`` (exactly those) admits it. A
  WebSocket has no CORS to keep its answers from a page, so a loopback ``Origin`` opens
  one only from the server's own port (a page of another local server, a dev server
  or ``python -m http.server`` serving a downloaded file, is refused like a foreign
  one). A POST that carries ``Origin`` must also declare a JSON content type, so even
  an admitted origin cannot skip the CORS preflight with a ``text/plain`` body. Requests
  without ``Origin`` (curl, the SDKs, the CLIs: no browser) are parsed as before, so
  ``curl -d`` keeps working.
- **Debug routes** (``/debug/…``, behind their own flag) answer only a loopback ``Host``
  and a loopback or absent ``Origin``, whatever ``--allowed-host``/``--cors`` admit.

Bound to another address (``--host 0.0.0.0``), ``Host`` is not checked (LAN names and
addresses are many) and the API key is what guards the server (the banner warns when
none is set).

Every check returns an `APIError` (or None when the request may pass); the hooks in
``ds4mlx.routes`` answer it in the protocol's shape. ``config`` is the server's
``ServerConfig`` (duck-typed: routes do not import the server).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from ds4mlx.origins import (
    LOOPBACK_NAMES,
    _loopback_host,
    bound_to_loopback,
    host_name,
    json_content_type,
    loopback_origin,
    origin_key,
)
from ds4mlx.routes.common import state
from ds4mlx.routes.errors import APIError, http_exception_to_api


def _forbidden(message: str, code: str) -> APIError:
    return APIError(403, message, type="permission_error", code=code)


def check_host(headers: Mapping[str, str], config) -> APIError | None:
    """403 when bound to loopback and ``Host`` names neither loopback nor an
    ``--allowed-host`` name. No ``Host`` at all (HTTP/1.0, which the server hands on as
    an empty one) is not a browser: it passes."""
    raw = headers.get("host")
    if not raw or not bound_to_loopback(config.host):
        return None
    name = host_name(raw)
    if _loopback_host(name) or name in {host_name(h) for h in config.allowed_hosts}:
        return None
    return _forbidden(
        f"Host {raw!r} is not allowed: this server answers Host "
        f"{', '.join(LOOPBACK_NAMES)} (--allowed-host NAME adds a name, e.g. a reverse proxy's)",
        "host_not_allowed",
    )


def check_origin(headers: Mapping[str, str], config, *, websocket: bool = False) -> APIError | None:
    """403 when ``Origin`` is present, not loopback, and neither ``--cors`` nor
    ``--allowed-origin`` admits it (``null`` is foreign). A WebSocket upgrade
    (``websocket``) from a loopback origin is admitted only from the server's own port:
    it has no CORS, so a page of another local server would otherwise drive the model and
    read every event."""
    raw = headers.get("origin")
    if raw is None or config.cors or _named_origin(raw, config):
        return None
    if loopback_origin(raw):
        if not websocket or _origin_port(raw) == config.port:
            return None
        return _forbidden(
            f"Origin {raw!r} may not open a WebSocket: a page of another local server "
            "could drive the model; name it with --allowed-origin (or --cors admits "
            "every origin)",
            "origin_not_allowed",
        )
    return _forbidden(
        f"Origin {raw!r} is not allowed: a web page may not use this server unless "
        "--allowed-origin names its origin (or --cors admits every origin)",
        "origin_not_allowed",
    )


def check_content_type(headers: Mapping[str, str]) -> APIError | None:
    """415 for a request with an ``Origin`` (a browser's) whose ``Content-Type`` is not
    JSON: a ``text/plain`` body needs no CORS preflight, a JSON one does."""
    if headers.get("origin") is None:
        return None
    ct = headers.get("content-type")
    if json_content_type(ct):
        return None
    return APIError(
        415,
        f"Content-Type {ct!r} is not JSON: a request with an Origin header must send "
        "Content-Type: application/json",
        param="Content-Type",
        code="unsupported_media_type",
    )


def check_debug(headers: Mapping[str, str]) -> APIError | None:
    """403 unless ``Host`` is loopback (or absent) and ``Origin`` loopback (or absent):
    debug routes steer the next client's reply, so no allow-list widens them."""
    host, origin = headers.get("host"), headers.get("origin")
    if (host is None or _loopback_host(host_name(host))) and (
        origin is None or loopback_origin(origin)
    ):
        return None
    return _forbidden("debug routes answer loopback clients only", "debug_loopback_only")


def check_auth(headers: Mapping[str, str] | None = None) -> APIError | None:
    """401 unless the request carries one of ``--api-key``'s keys (``Authorization:
    Bearer`` or ``x-api-key``); None when ok or when no key is configured.

    ``headers``: the request's (default) or a WebSocket's. Every key is compared in
    constant time, so the time taken does not tell which one nearly matched.
    """
    from quart import request

    keys = state().config.api_keys
    if not keys:
        return None
    if _authorized_key(request.headers if headers is None else headers, keys) is not None:
        return None
    return APIError(
        401, "invalid or missing API key", type="invalid_request_error", code="invalid_api_key"
    )


def _authorized_key(headers: Mapping[str, str], keys) -> str | None:
    """The key among ``keys`` the request presents, as ``x-api-key`` or as
    ``Authorization: Bearer`` (a client may send both, one of them stale: the Anthropic
    SDK's ``api_key`` beside an ``auth_token``), or None. Every presented value is
    compared with every key in constant time."""
    auth = headers.get("authorization") or ""
    bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    found = None
    for got in (headers.get("x-api-key") or "", bearer):
        for key in keys:
            if hmac.compare_digest(got.encode(), key.encode()) and got:
                found = found or got
    return found


def key_salt(headers: Mapping[str, str]) -> str:
    """The prompt cache's salt of the API key a request presents (its ``headers``, an
    authorized request's): with several ``--api-key``s each key is its own cache salt,
    so one key's client never reuses, or times, another's prefix. A SHA-256 hex digest
    of the key (never the key: the salt is written into snapshot headers); ``""`` with
    one key or none (every client is the same tenant)."""
    keys = state().config.api_keys
    if len(keys) < 2:
        return ""
    got = _authorized_key(headers, keys) or ""
    return hashlib.sha256(b"ds4mlx api key\0" + got.encode("utf-8", "surrogatepass")).hexdigest()


def check_single(headers: Mapping[str, str]) -> APIError | None:
    """400 for a request carrying ``Host`` or ``Origin`` more than once: the checks below
    read one value, and a second one must not slip past them (a browser sends each at
    most once; HTTP allows one ``Host``, RFC 9112 §3.2)."""
    getlist = getattr(headers, "getlist", None)  # werkzeug's Headers: every value
    for name in ("Host", "Origin"):
        if getlist is not None and len(getlist(name)) > 1:
            return APIError(
                400,
                f"the request carries {name} more than once",
                param=name,
                code="duplicate_header",
            )
    return None


def check_request(
    path: str, headers: Mapping[str, str], config, *, websocket: bool = False
) -> APIError | None:
    """The checks every HTTP request and WebSocket upgrade (``websocket``) passes before
    its route, in order: one Host and one Origin at most, Host, Origin, the debug routes'
    loopback rule. (The API key, the size and the content type follow in the request
    hook: ``/`` and ``/health`` need no key.)"""
    err = (
        check_single(headers)
        or check_host(headers, config)
        or check_origin(headers, config, websocket=websocket)
    )
    if err is None and path.startswith("/debug/"):
        err = check_debug(headers)
    return err


def check_http(request) -> APIError | None:
    """What an HTTP request passes after `check_request`: the API key (not on ``/``, ``/health``
    and ``/api/hello``: the probes clients send before their key), then for a POST the declared size (413) before the content type
    (415, `check_content_type`). ``request``: Quart's."""
    from werkzeug.exceptions import RequestEntityTooLarge

    if request.path not in ("/", "/health", "/api/hello"):
        err = check_auth(request.headers)
        if err is not None:
            return err
    if request.method != "POST":
        return None
    limit = request.max_content_length
    if limit is not None and (request.content_length or 0) > limit:
        return http_exception_to_api(RequestEntityTooLarge())
    return check_content_type(request.headers)


def cors_origin(origin: str | None, config) -> str | None:
    """The ``Access-Control-Allow-Origin`` value for a request from ``origin``: ``*``
    with ``--cors``, the origin itself when ``--allowed-origin`` names it, else None (no
    CORS headers: the browser keeps the answer from the page)."""
    if config.cors:
        return "*"
    if origin is None or not config.allowed_origins:
        return None
    return origin if _named_origin(origin, config) else None


def cors_headers(headers: Mapping[str, str], config) -> dict[str, str]:
    """The CORS answer headers for a request with ``headers`` (none when `cors_origin`
    admits no CORS for its origin)."""
    allow = cors_origin(headers.get("origin"), config)
    if allow is None:
        return {}
    allowed = (
        "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta, "
        "anthropic-dangerous-direct-browser-access, openai-beta"
    )
    # SDKs send their own headers (x-stainless-*, …): allow what the preflight asks.
    asked = (headers.get("access-control-request-headers") or "").strip()
    return {
        "Access-Control-Allow-Origin": allow,
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Allow-Headers": f"{allowed}, {asked}" if asked else allowed,
        "Access-Control-Max-Age": "600",
    }


def _origin_port(origin: str) -> int | None:
    """The port of ``origin`` (its scheme's default when it names none), or None."""
    from urllib.parse import urlsplit

    key = origin_key(origin)
    if key is None:
        return None
    parts = urlsplit(key)
    return parts.port or {"http": 80, "https": 443}.get(parts.scheme)


def _named_origin(origin: str, config) -> bool:
    """Whether ``--allowed-origin`` names ``origin`` (both compared as `origin_key`)."""
    key = origin_key(origin)
    return key is not None and key in {origin_key(o) for o in config.allowed_origins}
