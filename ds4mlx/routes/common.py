"""Shared route plumbing: the server state, ids, JSON responses, the model-name rule
and the API-key check.

Errors are `ds4mlx.routes.errors`, body parsing `ds4mlx.routes.body`, SSE framing
`ds4mlx.routes.sse`, the reasoning carrier `ds4mlx.routes.carrier`; the request pipeline
and the stream driver are `ds4mlx.routes.pipeline`.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import time
from typing import Any

from quart import Response, current_app, request

from ds4mlx.routes.errors import APIError


def json_response(obj: Any, status: int = 200) -> Response:
    return current_app.response_class(
        json.dumps(obj, ensure_ascii=False), status=status, mimetype="application/json"
    )


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
