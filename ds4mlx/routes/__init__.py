"""HTTP routes of ``ds4mlx serve``: one module per protocol (docs/ARCHITECTURE.md §1, §6).

- `ds4mlx.routes.anthropic`: ``/v1/messages``, ``/v1/messages/count_tokens``
- `ds4mlx.routes.openai`: ``/v1/chat/completions``
- `ds4mlx.routes.responses`: ``/v1/responses`` (HTTP)
- `ds4mlx.routes.responses_ws`: the Responses WebSocket (``GET /v1/responses`` upgrade),
  with steering and cancel frames
- `ds4mlx.routes.completions`: ``/v1/completions`` (raw text)
- `ds4mlx.routes.models`: ``/v1/models``, ``/v1/tokenize``, ``/v1/detokenize``,
  ``/health``, ``/debug/script``
- `ds4mlx.routes.pipeline`: the shared request pipeline (render, the cheap context
  bound, the ``GenRequest``) and the stream driver over an encoder
- `ds4mlx.routes.mapping`: mapping rules the protocol modules share
- `ds4mlx.routes.access`: Host and Origin checks, the JSON content type of browser
  POSTs, the API key, loopback-only debug routes
- `ds4mlx.routes.body`: reading bodies, parsing and validating them off the event loop
- `ds4mlx.routes.errors`: protocol-shaped errors and the wording of job failures
- `ds4mlx.routes.sse`: SSE framing
- `ds4mlx.routes.carrier`: the reasoning carrier
- `ds4mlx.routes.common`: server state, ids, JSON responses

Each protocol module owns its schema, its mapping onto the neutral ``Conversation``,
its `ds4mlx.routes.errors.Wording` (``NAMES``: the prompt's field, its live labels, its
unknown-id text), and one encoder for streaming and non-streaming answers
(docs/INTERFACES.md).

`register` adds them to a Quart app with protocol-shaped error handlers, the access
checks (`ds4mlx.routes.access`: Host, Origin, API key, content type), (opt-in) CORS and
the reasoning carrier. The server calls it without importing this package
(``ds4mlx serve`` hands it over).
"""

from __future__ import annotations

import logging

log = logging.getLogger("ds4mlx.server")


def _unread_body_closes(resp):
    """``resp`` (an error answered before the route read the request's body: a refusal
    of the access hooks, no such route, a body over the limit) with ``Connection:
    close`` when the request declared a body. The server does not read a refused body
    (up to 32 MiB) just to keep the connection, and Hypercorn closes a connection whose
    request body is still arriving: without the header, a client reusing it for its
    next request saw that one fail ("server disconnected")."""
    from quart import request

    declared = request.headers.get("content-length", "0") not in ("", "0")
    if declared or "chunked" in request.headers.get("transfer-encoding", "").lower():
        resp.headers["Connection"] = "close"
    return resp


def _shape(path: str):
    """The error shape of route ``path``: Anthropic's on the Messages API's paths,
    OpenAI's on every other route."""
    from ds4mlx.routes import anthropic
    from ds4mlx.routes.errors import openai_error

    return anthropic.error_body if path.startswith(anthropic.PATH_PREFIX) else openai_error


def _answer(err, path: str | None = None):
    """``err`` as a response in its protocol's error shape (`_shape`). ``path``: the
    request's by default (a WebSocket hook passes its own: there is no ``request`` then)."""
    from quart import request

    from ds4mlx.routes.errors import error_response

    return error_response(err, _shape(request.path if path is None else path))


def register(app) -> None:
    """Register every blueprint, error handler and request hook on ``app``, and build
    the app's reasoning carrier (``--reasoning-key``, else the stored key)."""
    from quart import request
    from werkzeug.exceptions import HTTPException

    from ds4mlx.routes import (
        anthropic,
        body,
        carrier,
        completions,
        items,
        models,
        openai,
        responses,
        responses_ws,
    )
    from ds4mlx.routes.errors import APIError, http_exception_to_api, internal_error

    carrier.install(app, app.extensions["ds4mlx"].config.reasoning_key)
    items.install(app)
    for mod in (openai, completions, anthropic, responses, responses_ws, models):
        app.register_blueprint(mod.bp)

    @app.after_serving
    async def _stop_vetting() -> None:
        body.shutdown()

    def rejected(e: APIError, method: str | None = None, path: str | None = None) -> None:
        # A client mistake is not a server fault, but the operator should see why a
        # client failed (a wrong key, a route an SDK expects, a body too large).
        if e.status < 500:
            path = path or request.path
            log.info(
                "%s %s rejected %d: %s",
                method or request.method,
                path,
                e.status,
                # The client's wording (the Messages API words a context overflow its own
                # way, and Claude Code acts on that text).
                _shape(path)(e)["error"]["message"],
            )

    @app.errorhandler(APIError)
    async def _api_error(e: APIError):
        rejected(e)
        return _answer(e)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException):
        err = http_exception_to_api(e)
        rejected(err)
        return _unread_body_closes(_answer(err))

    @app.errorhandler(Exception)
    async def _any_error(e: Exception):
        from quart import has_request_context, websocket

        # Also raised under a WebSocket (an upgrade's hook), where there is no request.
        method, path = (
            (request.method, request.path)
            if has_request_context()
            else ("WEBSOCKET", websocket.path)
        )
        log.exception("unhandled error on %s %s", method, path)
        return _answer(internal_error(type(e).__name__), path)

    _install_access(app, rejected)


def _install_access(app, rejected) -> None:
    """The access hooks (`ds4mlx.routes.access`): Host and Origin on every request and
    WebSocket upgrade, the API key, size and content type of HTTP requests, CORS answers.
    ``rejected(err, method=None, path=None)`` logs a refusal."""
    from quart import request, websocket

    from ds4mlx.routes import access, mapping
    from ds4mlx.routes.common import state

    @app.before_request
    async def _access():
        mapping.note_unsupported()
        # Host and Origin first, on every route (a rebound page reads /health too).
        config = state().config
        err = access.check_request(request.path, request.headers, config)
        if err is None and request.method == "OPTIONS":
            if access.cors_origin(request.headers.get("origin"), config):
                return app.response_class("", status=204)
        err = err or access.check_http(request)
        if err is not None:
            rejected(err)
            return _unread_body_closes(_answer(err))
        return None

    @app.before_websocket
    async def _ws_access():
        mapping.note_unsupported()
        # The upgrade is refused with an HTTP answer before it is accepted.
        err = access.check_request(
            websocket.path, websocket.headers, state().config, websocket=True
        )
        err = err or access.check_auth(websocket.headers)
        if err is not None:
            rejected(err, "WEBSOCKET", websocket.path)
            return _answer(err, websocket.path)
        return None

    @app.after_request
    async def _cors(resp):
        config = state().config
        resp.headers.update(access.cors_headers(request.headers, config))
        if config.allowed_origins:
            resp.vary.add("Origin")  # the answer depends on the Origin sent
        return resp
