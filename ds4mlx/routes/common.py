"""Shared route plumbing: the server state, ids, JSON responses, the model-name rule.
(Access checks and the API key are `ds4mlx.routes.access`.)

Errors are `ds4mlx.routes.errors`, body parsing `ds4mlx.routes.body`, SSE framing
`ds4mlx.routes.sse`, the reasoning carrier `ds4mlx.routes.carrier`; the request pipeline
and the stream driver are `ds4mlx.routes.pipeline`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import Iterable
from typing import Any

from quart import Response, current_app

log = logging.getLogger("ds4mlx.server")

# Claude Code's conversation headers, the most specific first: a sub-agent's id, then
# the session's (the main conversation and its side requests).
STATE_HEADERS = ("x-claude-code-agent-id", "x-claude-code-session-id")
MAX_STATE_KEY_BYTES = 256
# Claude Code names a forked helper agent (its session title, prompt suggestion,
# compaction, memory extraction, speculation, side question…) "a" + label + "-" + 16 hex
# digits; an Agent-tool sub-agent is "a" + 16 hex digits, a teammate "name@team".
HELPER_AGENT_ID = re.compile(r"a[A-Za-z0-9_-]+-[0-9a-f]{16}")
MAX_CACHE_SALT_CHARS = 256


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


# Keys a `first_time` set keeps at most: they are client-chosen (model names, tool types).
MAX_NOTED = 1000


def first_time(seen: set[str], key: str) -> bool:
    """True the first time ``key`` comes to ``seen`` (it is added): what is logged once
    per name. False once ``seen`` holds `MAX_NOTED` keys, so a client sending ever new
    names cannot grow it, nor flood the log."""
    if key in seen or len(seen) >= MAX_NOTED:
        return False
    seen.add(key)
    return True


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
    if model and model not in cfg.model_ids() and first_time(st.unknown_models, model):
        logging.getLogger("ds4mlx.server").info(
            "model %r is not a served id; serving %s (thinking %s) under that name",
            model,
            cfg.model_name,
            "on" if thinking else "off",
        )
    return thinking


# Hosted tool types already logged by `note_unoffered` (one line per type and process).
_UNOFFERED: set[str] = set()


def note_unoffered(kinds: Iterable[str]) -> None:
    """Log once per server process each hosted (server-run) or provider-defined tool
    type a request carried (Responses ``web_search``, Anthropic ``web_search_20250305``):
    it is accepted, as the protocols' clients send them with every request (Codex's
    ``web_search``), and not offered to the model, since no hosted tool runs here. The
    operator then learns why a web search never happens; a line per request would flood
    a Codex user's log."""
    for kind in kinds:
        if first_time(_UNOFFERED, kind):
            log.info(
                "tool type %r is accepted and not offered to the model: it is a hosted or "
                "provider-defined tool, and none run on this server (logged once)",
                kind[:80],
            )


def state_key(headers: Any = None, body_key: Any = None) -> str | None:
    """The client's name of the conversation a request belongs to, for the prompt cache's
    resident states (docs/ARCHITECTURE.md §3): Claude Code's ``x-claude-code-agent-id``,
    else its ``x-claude-code-session-id`` (``headers``: a mapping, case-insensitive as
    Quart's), else a body's ``prompt_cache_key`` (Codex). Returned with its source
    (``agent:ID``, ``session:ID``, ``cache:KEY``) so names never collide across sources,
    or None. A value that is not a printable string of 1 to `MAX_STATE_KEY_BYTES` bytes
    is ignored, with one log line."""
    found = [(h, headers.get(h)) for h in STATE_HEADERS] if headers is not None else []
    found.append(("prompt_cache_key", body_key))
    for name, value in found:
        if value is None:
            continue
        if (
            not isinstance(value, str)
            or not value
            or not value.isprintable()
            or len(value.encode("utf-8", "surrogatepass")) > MAX_STATE_KEY_BYTES
        ):
            log.warning(
                "ignoring %s: not a printable value of 1 to %d bytes", name, MAX_STATE_KEY_BYTES
            )
            continue
        # x-claude-code-agent-id -> agent, x-claude-code-session-id -> session.
        source = "cache" if name == "prompt_cache_key" else name.split("-")[-2]
        return f"{source}:{value}"
    return None


def helper_agent(headers: Any = None) -> bool:
    """Whether a request comes from one of Claude Code's helper agents: its
    ``x-claude-code-agent-id`` has a label (`HELPER_AGENT_ID`). Such a request is a side
    request (``ds4mlx.jobs.GenRequest.side``): it forks the conversation for a moment and
    must not take the state the conversation continues. A sub-agent of the ``Agent`` tool
    (no label) is a conversation of its own. A value `state_key` ignores is no helper."""
    if headers is None:
        return False
    value = headers.get(STATE_HEADERS[0])
    return (
        isinstance(value, str)
        and len(value) <= MAX_STATE_KEY_BYTES
        and HELPER_AGENT_ID.fullmatch(value) is not None
    )


def cache_salt(body_salt: Any, key_salt: str = "") -> str:
    """The prompt cache salt of a request (``ds4mlx.kv.cache.Prompt.salt``): its body's
    ``cache_salt`` (as vLLM's: prompts of other salts never share cached state, so the
    cached-token count and latency tell nothing across them) combined with the API key's
    salt (``ds4mlx.routes.access.key_salt``). A SHA-256 hex digest of both, or ``""``
    when neither is given (unsalted: every prompt may reuse every other's prefix).

    Raises:
        APIError: 400 (``param`` ``cache_salt``) when ``body_salt`` is given and is not
            a non-empty string of at most `MAX_CACHE_SALT_CHARS` characters.
    """
    from ds4mlx.routes.errors import APIError

    if body_salt is not None and (
        not isinstance(body_salt, str) or not body_salt or len(body_salt) > MAX_CACHE_SALT_CHARS
    ):
        raise APIError(
            400,
            f"cache_salt: must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            param="cache_salt",
        )
    if body_salt is None and not key_salt:
        return ""
    data = f"{key_salt}\0{body_salt or ''}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()
