"""Streaming-safe stop-sequence matching (docs/ARCHITECTURE.md §6: ``stop`` / ``stop_sequences``).

Text arrives in token-sized pieces, so a stop string can straddle two pieces. The
matcher holds back the longest tail that could still begin a stop and releases it
once it cannot; the stop itself is never emitted.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    """Match any of ``stops`` (strings; empty ones are ignored) in streamed text.

    ``feed(text) -> (emit, stopped)``: ``emit`` is the text safe to send now (never a
    possible stop prefix, never the stop); ``stopped`` is True once a stop matched,
    after which every feed returns ``("", True)`` and ``matched`` names the stop. At
    the end of generation call ``flush()`` for the held-back tail (empty after a stop).
    With no stops, text passes straight through.
    """

    def __init__(self, stops: Iterable[str] | None) -> None:
        self.stops: list[str] = [s for s in (stops or []) if s]
        self.matched: str | None = None
        self._held = ""
        self._max = max((len(s) for s in self.stops), default=0)

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, text: str) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        # The stop that is complete first wins (smallest end; at the same end the one
        # that starts earlier). That is what per-character streaming would see, so the
        # outcome does not depend on how text is split.
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            pos = buf.find(s)
            if pos >= 0 and (best is None or (pos + len(s), pos) < (best[0], best[1])):
                best = (pos + len(s), pos, s)
        if best is not None:
            self.matched = best[2]
            self._held = ""
            return buf[: best[1]], True
        keep = _partial_len(buf, self.stops, self._max)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release the held-back tail (call once generation ended without a stop)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held


def _partial_len(buf: str, stops: list[str], max_len: int) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of some stop."""
    for k in range(min(len(buf), max_len - 1), 0, -1):
        tail = buf[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0
