"""Schemas for the grammar tests, and the bounded variants the noise model can finish.

The random tiny model never chooses to end a JSON string or a number (almost every
token of its vocabulary extends one), so the validity suites serve a *bounded* variant
of each schema (`bounded`): strings get a ``maxLength``, integers a range, numbers become
integers, arrays a ``maxItems``, objects ``additionalProperties: false``. Every value
the bounded schema accepts is accepted by the original, and the outputs are validated
against the original.
"""

from __future__ import annotations

import copy
from typing import Any

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"mode": {"enum": ["fast", "slow", "off"]}, "on": {"type": "boolean"}},
        "required": ["mode", "on"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{1,3}$"}},
        "required": ["id"],
    },
    {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]}},
        "required": ["v"],
    },
    {
        "type": "object",
        "properties": {
            "pt": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "required": ["pt"],
    },
    {
        "type": "object",
        "properties": {
            "grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}
        },
        "required": ["grid"],
    },
    {
        "type": "object",
        "properties": {"node": {"$ref": "#/$defs/leaf"}},
        "required": ["node"],
        "$defs": {
            "leaf": {"type": "object", "properties": {"k": {"const": "leaf"}}, "required": ["k"]}
        },
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 1},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2}}, "required": ["s"]},
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "string"}},
        "required": ["a"],
    },
]


def bounded(schema: Any, *, chars: int = 6, items: int = 2) -> Any:
    """A stricter copy of ``schema`` whose every instance the noise model can finish
    (see the module doc); ``chars``: string maxLength, ``items``: array maxItems."""
    s = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
            return
        if not isinstance(node, dict):
            return
        for k, v in node.items():
            if k != "propertyNames":  # the keys' schema: capped, it would constrain them
                walk(v)
        t = node.get("type")
        types = t if isinstance(t, list) else [t]
        if "string" in types and "enum" not in node and "const" not in node:
            # A pattern may need more than ``chars`` (e.g. ``^wf_[a-z0-9-]{6,}$``).
            cap = 4 * chars if "pattern" in node else chars
            node["maxLength"] = min(node.get("maxLength", cap), max(cap, node.get("minLength", 0)))
        if "number" in types:
            node["type"] = (
                ["integer" if x == "number" else x for x in types]
                if isinstance(t, list)
                else "integer"
            )
        if "integer" in types or "number" in types:
            node.setdefault("minimum", -99)
            node.setdefault("maximum", 999)
        if "array" in types:
            node["maxItems"] = min(node.get("maxItems", items), max(items, node.get("minItems", 0)))
        if "object" in types or "properties" in node:
            node.setdefault("additionalProperties", False)

    walk(s)
    return s
