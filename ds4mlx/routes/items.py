"""Responses output items kept by id, so an ``item_reference`` to one resolves.

A client that keeps ``store: true`` (the Vercel AI SDK's OpenAI provider does by default)
replays the earlier turns' assistant items as ``{"type": "item_reference", "id":
"msg_…"}`` instead of their content. The server keeps no response store (nothing can be
fetched by response id), but it remembers the output items it answered — messages,
reasoning, calls — by their unguessable ids, in a bounded map (the least recently used
pruned first: the tool memory's map), so such a reference resolves to the item as it
was sent. An id it no longer holds is a 400 naming it. Thread-safe: requests are
prepared off the event loop while responses end on it.
"""

from __future__ import annotations

import json
from typing import Any

from quart import current_app

from ds4mlx.dsml import ToolMemory

_KEY = "ds4mlx.items"
# Items remembered (one turn writes a few: reasoning, message, calls).
MAX_ITEMS = 20_000


class ItemMemory:
    """Bounded map ``item id -> output item`` (the JSON object as sent).

    Kept in a `ds4mlx.dsml.ToolMemory`: the same bounded, thread-safe map of id -> text,
    least recently used pruned first, here holding each item's JSON (so every `get` is
    a fresh copy)."""

    def __init__(self, max_items: int = MAX_ITEMS) -> None:
        self._map = ToolMemory(max_items)

    def put_all(self, items: list[dict[str, Any]]) -> None:
        """Remember each item that has an ``id``."""
        for it in items:
            if isinstance(it.get("id"), str):
                self._map.put(it["id"], json.dumps(it, ensure_ascii=False))

    def get(self, item_id: str) -> dict[str, Any] | None:
        """A copy of the item ``item_id`` names, or None."""
        text = self._map.get(item_id)
        return None if text is None else json.loads(text)


def install(app) -> ItemMemory:
    """Build the app's `ItemMemory` and keep it on ``app``."""
    memory = ItemMemory()
    app.extensions[_KEY] = memory
    return memory


def item_memory() -> ItemMemory:
    """The running app's `ItemMemory`."""
    return current_app.extensions[_KEY]


def resolve_references(data: dict[str, Any], memory: ItemMemory) -> dict[str, Any]:
    """``data`` (a Responses body) with each ``item_reference`` input item the memory
    holds replaced by that item; references it does not hold stay, for the request's
    validation to refuse by position."""
    inp = data.get("input")
    if not isinstance(inp, list) or not any(_is_reference(it) for it in inp):
        return data
    out = []
    for it in inp:
        held = memory.get(it["id"]) if _is_reference(it) and isinstance(it.get("id"), str) else None
        out.append(held if held is not None else it)
    return {**data, "input": out}


def _is_reference(it: Any) -> bool:
    return isinstance(it, dict) and it.get("type") == "item_reference"
