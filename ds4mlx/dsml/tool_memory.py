"""Tool memory: tool-call id -> exact sampled DSML ``invoke`` block (docs/ARCHITECTURE.md §4).

When a client replays an assistant turn, its JSON arguments may have reordered keys
or reformatted whitespace. Rendering those would give different prompt bytes than
the model sampled, which breaks the text-prefix and disk-cache matches (docs/ARCHITECTURE.md §3, §5). The renderer therefore renders a known id from these bytes instead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

DEFAULT_MAX_IDS = 100_000


class ToolMemory:
    """Bounded map ``id -> DSML invoke block`` (``<｜DSML｜invoke …</｜DSML｜invoke>``).

    ``max_ids`` (int, > 0) bounds the number of entries; the least recently used
    entry is pruned first (``put`` and a successful ``get`` both count as use, so a
    call that every request replays stays). With ``enabled=False`` the memory stores
    nothing and ``get`` always returns None, so the renderer falls back to canonical
    DSML. Thread-safe: routes render on the event loop while the worker stores.
    """

    def __init__(self, max_ids: int = DEFAULT_MAX_IDS, enabled: bool = True) -> None:
        if max_ids <= 0:
            raise ValueError(f"max_ids must be positive, got {max_ids}")
        self.max_ids = max_ids
        self.enabled = enabled
        self._map: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, call_id: str, dsml: str) -> None:
        """Remember the exact invoke bytes ``dsml`` for ``call_id`` (no-op if disabled)."""
        if not self.enabled or not call_id:
            return
        with self._lock:
            self._map[call_id] = dsml
            self._map.move_to_end(call_id)
            while len(self._map) > self.max_ids:
                self._map.popitem(last=False)

    def get(self, call_id: str | None) -> str | None:
        """The invoke bytes stored for ``call_id``, or None (unknown id or disabled)."""
        if not self.enabled or not call_id:
            return None
        with self._lock:
            dsml = self._map.get(call_id)
            if dsml is not None:
                self._map.move_to_end(call_id)
            return dsml

    def __contains__(self, call_id: object) -> bool:
        with self._lock:
            return self.enabled and call_id in self._map

    def __len__(self) -> int:
        with self._lock:
            return len(self._map)

    def entries(self) -> list[tuple[str, str]]:
        """All ``(id, dsml)`` pairs, least recently used first (for disk snapshots)."""
        with self._lock:
            return list(self._map.items())

    def load(self, entries: Iterable[tuple[str, str]]) -> None:
        """Add ``(id, dsml)`` pairs (e.g. from a disk snapshot), in order, via ``put``."""
        for call_id, dsml in entries:
            self.put(call_id, dsml)

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._map.clear()
