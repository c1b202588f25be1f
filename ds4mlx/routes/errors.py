"""Protocol-shaped errors: `APIError`, OpenAI's error object, HTTP and validation
errors mapped onto it, and the wording of the job vocabulary's neutral failures.

Errors follow each protocol's own shape: OpenAI's (`openai_error`, every route but the
Messages API's): ``{"error": {"message", "type", "param", "code"}}``
(https://platform.openai.com/docs/guides/error-codes); Anthropic's is
``ds4mlx.routes.anthropic.error_body``. Client mistakes (malformed JSON, invalid UTF-8,
wrong types, unknown roles, oversized bodies, prompts over the context) are 4xx; only
server faults are 5xx.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from quart import Response, current_app, request
from werkzeug.exceptions import HTTPException

from ds4mlx.jobs import Failure, JobFailed, LiveLabels


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

    def __reduce__(self):
        # Pickled by the body-vetting child (``routes.body``): ``Exception`` would call
        # ``APIError(message)``; rebuild from the required arguments, then the fields.
        return (type(self), (self.status, self.message), dict(self.__dict__))


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
    the Messages API passes ``ds4mlx.routes.anthropic.error_body``).

    A client error that the same request would meet again (a 4xx but 408, 409 and 429)
    carries ``x-should-retry: false``, the header the Anthropic and OpenAI SDKs and
    Claude Code read before their own retry rules: without it Claude Code retried a 401
    (a missing ``--api-key`` key) for three minutes before telling its user."""
    response = current_app.response_class(
        json.dumps(shape(err), ensure_ascii=False),
        status=err.status,
        mimetype="application/json",
    )
    if 400 <= err.status < 500 and err.status not in (408, 409, 429):
        response.headers["x-should-retry"] = "false"
    return response


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
            f"no route {request.method} {request.path}{_route_hint(request.method, request.path)}",
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


def _route_hint(method: str, path: str) -> str:
    """``"; did you mean /v1/messages? …"`` when ``path`` is a route with its ``/v1``
    missing or doubled (a client's base URL set without or with ``/v1`` where the other
    was wanted), else ``""``."""
    from werkzeug.exceptions import HTTPException as RouteMiss

    meant = path[3:] if path.startswith("/v1/v1/") else "/v1" + path
    try:
        current_app.url_map.bind("").match(meant, method=method)
    except RouteMiss:
        return ""
    return f"; did you mean {meant}? (check the client's base URL: with or without /v1)"


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


def errors_to_api(errs: list[dict[str, Any]], data: Any = None) -> APIError:
    """The most specific of pydantic's error dicts (``loc``, ``msg``, ``type``) as a 400
    naming the field path (``param``).

    A union field reports one error per member (``input`` as ``str`` and as a list of
    items); the deepest location is the branch the client meant.
    """
    if not errs:
        return APIError(400, "invalid request")
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


def validation_error_to_api(e: ValidationError, data: Any = None) -> APIError:
    """A pydantic `ValidationError` as a 400 naming the field path (`errors_to_api`)."""
    return errors_to_api(list(e.errors(include_url=False)), data)


# --------------------------------------------------------------------------- job failures


@dataclass(frozen=True)
class Wording:
    """How a protocol names its jobs and words their neutral failures.

    Attributes:
        param: the request field holding the prompt (``messages``, ``input``,
            ``prompt``), named by the context and unknown-id errors.
        id_field: its name of a tool result's id (``tool_use_id``, ``call_id``).
        calls: where its requests hold the calls (``a tool_use block of the messages``).
        labels: the `ds4mlx.jobs.LiveLabels` its jobs carry (its live-continuation
            decision and id word in the log line and trace), or None.
    """

    param: str = "messages"
    id_field: str = "tool result id"
    calls: str = "one of the history"
    labels: LiveLabels | None = None

    def unknown_id(self, tool_id: str) -> str:
        """The 400's text for a result whose ``tool_id`` no call has (kv's neutral
        ``unknown_tool_id``: neither a call of the request nor a live one explains it)."""
        return (
            f"unknown {self.id_field} {tool_id}: no call has this id, neither {self.calls} "
            "nor one the server is waiting on; each result must answer a call (send the "
            "whole history)"
        )


def context_error(n_prompt: int, ctx: int, param: str, *, at_least: bool = False) -> APIError:
    """400 ``context_length_exceeded`` for a prompt of ``n_prompt`` tokens (``at_least``:
    a lower bound) in a context of ``ctx``, with the counts as the error's
    ``n_prompt_tokens`` / ``n_ctx`` fields."""
    n = f"at least {n_prompt}" if at_least else str(n_prompt)
    return APIError(
        400,
        f"This model's maximum context length is {ctx} tokens. However, your prompt "
        f"resulted in {n} tokens, leaving no room for output. Shorten the "
        "conversation or restart the server with a larger --ctx.",
        code="context_length_exceeded",
        param=param,
        fields={"n_prompt_tokens": n_prompt, "n_ctx": ctx},
    )


def failed_to_api(ev: JobFailed, wording: Wording = Wording()) -> APIError:
    """A job's neutral failure worded in the protocol's terms (``wording``)."""
    if ev.kind == Failure.UNKNOWN_TOOL_ID:
        return APIError(400, wording.unknown_id(ev.tool_id or ""), param=wording.param)
    if ev.kind == Failure.CONTEXT_FULL:
        return context_error(ev.n_prompt_tokens or 0, ev.n_ctx or 0, wording.param)
    if ev.kind == Failure.EMPTY_PROMPT:
        return APIError(400, "empty prompt", param=wording.param)
    if ev.kind in (Failure.SHUTTING_DOWN, Failure.RANK_LOST):
        why = "server is shutting down"
        if ev.kind == Failure.RANK_LOST:  # the line names a rank and the ring's error only
            why = f"{ev.detail}; the server is stopping"
        return APIError(503, why, type="server_error", anthropic_type="overloaded_error")
    return internal_error(ev.detail)


def internal_error(what: str) -> APIError:
    """The 500 of a server fault, naming only ``what`` (an exception's type, a neutral
    failure's detail): never its message, which may hold a request's text."""
    return APIError(500, f"internal error: {what}", type="server_error")
