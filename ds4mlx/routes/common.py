"""Shared route plumbing: the server state, ids, JSON responses, the model-name rule.
(Access checks and the API key are `ds4mlx.routes.access`.)

Errors are `ds4mlx.routes.errors`, body parsing `ds4mlx.routes.body`, SSE framing
`ds4mlx.routes.sse`, the reasoning carrier `ds4mlx.routes.carrier`; the request pipeline
and the stream driver are `ds4mlx.routes.pipeline`.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any

from quart import Response, current_app


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
