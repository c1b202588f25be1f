"""Server-Sent Events framing (one implementation for every streaming route)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from quart import Response, current_app


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
