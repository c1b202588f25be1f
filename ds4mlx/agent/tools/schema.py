"""JSON-schema helpers for the agent's tools: build parameter schemas, explain violations.

Validation itself is :mod:`jsonschema` (Draft 2020-12); this module turns its errors
into short lines the model can fix its call from (``- field 'limit': expected a
number >= 1, got integer 0``), fills in defaults, and summarises a call for the UI.
"""

from __future__ import annotations

import json
from typing import Any

from jsonschema import Draft202012Validator, ValidationError

PATH_DESC = "Path relative to the workspace root (absolute paths must lie inside it)."

_BOUND_WORDS = {
    "minimum": ">=",
    "maximum": "<=",
    "exclusiveMinimum": ">",
    "exclusiveMaximum": "<",
}


def object_schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """A closed object schema (no fields beyond ``properties``)."""
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def json_type(value: Any) -> str:
    """The JSON type name of a decoded JSON value (``integer``, ``object`` …)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def show(value: Any, limit: int = 80) -> str:
    """``value`` as JSON (repr if not serialisable), at most ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def describe_param(name: str, schema: dict[str, Any], required: bool) -> str:
    """``limit (integer, >= 1, default 2000)`` — one parameter, for error messages."""
    parts = [schema.get("type", "any")]
    for key, word in _BOUND_WORDS.items():
        if key in schema:
            parts.append(f"{word} {schema[key]}")
    if "minLength" in schema:
        parts.append(
            "non-empty" if schema["minLength"] == 1 else f"length >= {schema['minLength']}"
        )
    parts.append(
        "required"
        if required
        else f"default {show(schema['default'])}"
        if "default" in schema
        else "optional"
    )
    return f"{name} ({', '.join(parts)})"


def problems(validator: Draft202012Validator, arguments: Any) -> list[str]:
    """What is wrong with ``arguments`` under ``validator``'s schema, one ``- …`` line each.

    Returns an empty list for valid arguments. Non-objects get a single line.
    """
    if not isinstance(arguments, dict):
        return [f"- arguments: expected object, got {json_type(arguments)} {show(arguments)}"]
    props = validator.schema.get("properties", {})
    lines: list[str] = []
    for err in sorted(validator.iter_errors(arguments), key=lambda e: list(map(str, e.path))):
        lines.extend(_explain(err, props))
    return lines


def _explain(err: ValidationError, props: dict[str, Any]) -> list[str]:
    fld = ".".join(str(p) for p in err.absolute_path) or "arguments"
    got = f"got {json_type(err.instance)} {show(err.instance)}"
    if err.validator == "required":
        return [
            f"- field '{missing}': missing (required, expected "
            f"{props.get(missing, {}).get('type', 'a value')})"
            for missing in err.validator_value
            if missing not in err.instance
        ]
    if err.validator == "additionalProperties":
        return [
            f"- field '{extra}': unexpected (got {show(err.instance[extra])}); "
            f"allowed fields: {', '.join(props)}"
            for extra in err.instance
            if extra not in props
        ]
    if err.validator == "type":
        return [f"- field '{fld}': expected {err.validator_value}, {got}"]
    if err.validator in _BOUND_WORDS:
        word = _BOUND_WORDS[err.validator]
        return [f"- field '{fld}': expected a number {word} {err.validator_value}, {got}"]
    if err.validator == "minLength":
        return [f"- field '{fld}': expected a non-empty string, {got}"]
    return [f"- field '{fld}': {err.message}"]


def invalid_arguments_text(name: str, schema: dict[str, Any], lines: list[str]) -> str:
    """The whole ``invalid arguments`` message: the problems, then every parameter."""
    req = set(schema.get("required", []))
    params = ", ".join(describe_param(k, v, k in req) for k, v in schema["properties"].items())
    return (
        f"invalid arguments for {name}:\n"
        + "\n".join(lines)
        + f"\n{name} parameters: {params}. Fix the arguments and call again."
    )


def with_defaults(schema: dict[str, Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """A copy of valid ``arguments`` with schema defaults filled in and integers as int."""
    args = dict(arguments)
    for key, prop in schema["properties"].items():
        if key not in args and "default" in prop:
            args[key] = prop["default"]
        # JSON Schema accepts 5.0 as an integer; Python slicing does not.
        if prop.get("type") == "integer" and isinstance(args.get(key), float):
            args[key] = int(args[key])
    return args


def describe_call(name: str, arguments: Any) -> str:
    """One-line human summary of a call, for the UI (``read path=a.py offset=3``).

    String values are shown raw with newlines as ``⏎``, each cut after 60 characters.
    """
    if not isinstance(arguments, dict):
        return f"{name} {show(arguments)}"
    shown = []
    for key, value in arguments.items():
        text = value if isinstance(value, str) else show(value)
        text = text.replace("\n", "⏎")
        shown.append(f"{key}={text[:60] + '…' if len(text) > 60 else text}")
    return f"{name} " + " ".join(shown)
