"""HTTP routes of ``ds4mlx serve``: one module per protocol (docs/ARCHITECTURE.md §1, §6).

- `ds4mlx.routes.anthropic`: ``/v1/messages``, ``/v1/messages/count_tokens``
- `ds4mlx.routes.openai`: ``/v1/chat/completions``
- `ds4mlx.routes.responses`: ``/v1/responses`` (HTTP + WebSocket)
- `ds4mlx.routes.completions`: ``/v1/completions`` (raw text)
- `ds4mlx.routes.models`: ``/v1/models``, ``/v1/tokenize``, ``/v1/detokenize``,
  ``/health``, ``/debug/script``
- `ds4mlx.routes.pipeline`: the shared request pipeline (render, the cheap context
  bound, the ``GenRequest``) and the stream driver over an encoder
- `ds4mlx.routes.mapping`: mapping rules the protocol modules share
- `ds4mlx.routes.body`: reading bodies, parsing and validating them off the event loop
- `ds4mlx.routes.errors`: protocol-shaped errors and the wording of job failures
- `ds4mlx.routes.sse`: SSE framing
- `ds4mlx.routes.carrier`: the reasoning carrier
- `ds4mlx.routes.common`: server state, ids, JSON responses, auth

Each protocol module owns its schema, its mapping onto the neutral ``Conversation``,
its `ds4mlx.routes.errors.Wording` (``NAMES``: the prompt's field, its live labels, its
unknown-id text), and one encoder for streaming and non-streaming answers
(docs/INTERFACES.md).

`register` adds them to a Quart app with protocol-shaped error handlers, the API-key
check, (opt-in) CORS and the reasoning carrier. The server calls it without importing
this package (``ds4mlx serve`` hands it over).
"""

from __future__ import annotations

import logging

log = logging.getLogger("ds4mlx.server")


def _answer(err):
    """``err`` as a response in its protocol's error shape: Anthropic's on the Messages
    API's paths, OpenAI's on every other route."""
    from quart import request

    from ds4mlx.routes import anthropic
    from ds4mlx.routes.errors import error_response, openai_error

    anthropic_path = request.path.startswith(anthropic.PATH_PREFIX)
    return error_response(err, anthropic.error_body if anthropic_path else openai_error)


def register(app) -> None:
    """Register every blueprint, error handler and request hook on ``app``, and build
    the app's reasoning carrier (``--reasoning-key``, else the stored key)."""
    from quart import request
    from werkzeug.exceptions import HTTPException

    from ds4mlx.routes import anthropic, carrier, completions, models, openai, responses
    from ds4mlx.routes.common import check_auth, state
    from ds4mlx.routes.errors import APIError, http_exception_to_api

    carrier.install(app, app.extensions["ds4mlx"].config.reasoning_key)
    for mod in (openai, completions, anthropic, responses, models):
        app.register_blueprint(mod.bp)

    def rejected(e: APIError) -> None:
        # A client mistake is not a server fault, but the operator should see why a
        # client failed (a wrong key, a route an SDK expects, a body too large).
        if e.status < 500:
            log.info("%s %s rejected %d: %s", request.method, request.path, e.status, e.message)

    @app.errorhandler(APIError)
    async def _api_error(e: APIError):
        rejected(e)
        return _answer(e)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException):
        err = http_exception_to_api(e)
        rejected(err)
        return _answer(err)

    @app.errorhandler(Exception)
    async def _any_error(e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _answer(APIError(500, f"internal error: {type(e).__name__}", type="server_error"))

    @app.before_request
    async def _auth():
        if request.method == "OPTIONS" and state().config.cors:
            return app.response_class("", status=204)
        if request.path in ("/", "/health", "/api/hello"):
            return None
        err = check_auth()
        if err is not None:
            rejected(err)
            return _answer(err)
        return None

    @app.after_request
    async def _cors(resp):
        if state().config.cors:
            resp.headers["Access-Control-Allow-Origin"] = "*"
            resp.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            allowed = (
                "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta, "
                "anthropic-dangerous-direct-browser-access, openai-beta"
            )
            # SDKs send their own headers (x-stainless-*, …): allow what the preflight asks.
            asked = request.headers.get("Access-Control-Request-Headers", "").strip()
            resp.headers["Access-Control-Allow-Headers"] = (
                f"{allowed}, {asked}" if asked else allowed
            )
            resp.headers["Access-Control-Max-Age"] = "600"
        return resp
