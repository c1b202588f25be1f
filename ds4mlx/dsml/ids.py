"""Unguessable tool-call ids (docs/ARCHITECTURE.md §4, "Tool memory").

A tool-call id selects sampled state (the exact DSML bytes in tool memory and the
live KV), so it must not be guessable or collide across sessions: 18 random bytes
from `secrets`, base64url-encoded to exactly 24 characters.
"""

from __future__ import annotations

import secrets

ANTHROPIC_PREFIX = "toolu_"


def new_tool_id(prefix: str = ANTHROPIC_PREFIX) -> str:
    """Return ``prefix`` + 24 url-safe random characters (``[A-Za-z0-9_-]``).

    Use ``"toolu_"`` for Anthropic, ``"call_"`` for OpenAI chat / Responses.
    """
    # 18 bytes -> exactly 24 base64url characters, no padding.
    return prefix + secrets.token_urlsafe(18)
