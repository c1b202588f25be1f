"""JSON-schema helpers for the agent's tools: build parameter schemas, explain violations.

Validation itself is :mod:`jsonschema` (Draft 2020-12); this module turns its errors
into an envelope the model can fix its call from (one JSON line: each error's ``loc``,
``input_value``, ``error_type``, ``message``, ``expected``), fills in defaults, and summarises a call for the UI.
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


def problems(validator: Draft202012Validator, arguments: Any) -> list[dict[str, Any]]:
    """What is wrong with ``arguments`` under ``validator``'s schema; ``[]`` if valid.

    Returns:
        One dict per problem, ordered by field: ``loc`` (the path to the value, a list
        of keys and indices; ``[]`` for the arguments themselves), ``input_value`` (the
        value, None for a missing field), ``error_type`` (the JSON-schema keyword that
        failed: ``type``, ``minimum``, ``required``, ``additionalProperties`` …),
        ``message`` (one line the model can act on) and ``expected`` (what would pass).
    """
    if not isinstance(arguments, dict):
        return [
            _problem(
                [], arguments, "type", f"expected object, got {json_type(arguments)}", "object"
            )
        ]
    props = validator.schema.get("properties", {})
    found: dict[tuple[str, ...], dict[str, Any]] = {}
    for err in validator.iter_errors(arguments):
        # (jsonschema reports each missing field apart, each with the whole list.)
        for p in _explain(err, props):
            found.setdefault((*map(str, p["loc"]), p["error_type"]), p)
    order = {name: i for i, name in enumerate(props)}  # schema order; extras last
    return sorted(
        found.values(), key=lambda p: order.get(p["loc"][0], len(order)) if p["loc"] else -1
    )


def _problem(loc: list[Any], value: Any, kind: str, message: str, expected: str) -> dict[str, Any]:
    return {
        "loc": loc,
        "input_value": value,
        "error_type": kind,
        "message": message,
        "expected": expected,
    }


def _expected(schema: dict[str, Any]) -> str:
    """``integer >= 1`` — the type and bounds of one parameter's schema."""
    kind = str(schema.get("type", "any"))
    if schema.get("minLength") == 1:
        kind = f"non-empty {kind}"
    return " ".join([kind, *(f"{w} {schema[k]}" for k, w in _BOUND_WORDS.items() if k in schema)])


def _explain(err: ValidationError, props: dict[str, Any]) -> list[dict[str, Any]]:
    loc = list(err.absolute_path)
    got = f"got {json_type(err.instance)} {show(err.instance)}"
    if err.validator == "required":
        return [
            _problem(
                [*loc, missing],
                None,
                "required",
                "missing (required)",
                _expected(props.get(missing, {})) if not loc else "a value",
            )
            for missing in err.validator_value
            if missing not in err.instance
        ]
    if err.validator == "additionalProperties":
        allowed = ", ".join(props)
        return [
            _problem(
                [*loc, extra],
                err.instance[extra],
                "additionalProperties",
                f"unexpected field; allowed fields: {allowed}",
                f"one of: {allowed}",
            )
            for extra in err.instance
            if extra not in props
        ]
    schema = err.schema if isinstance(err.schema, dict) else {}
    if err.validator == "type":
        return [
            _problem(
                loc,
                err.instance,
                "type",
                f"expected {err.validator_value}, {got}",
                _expected(schema),
            )
        ]
    if err.validator in _BOUND_WORDS:
        word = _BOUND_WORDS[err.validator]
        msg = f"expected a number {word} {err.validator_value}, {got}"
        return [_problem(loc, err.instance, str(err.validator), msg, _expected(schema))]
    if err.validator == "minLength":
        msg = f"expected a non-empty string, {got}"
        return [_problem(loc, err.instance, "minLength", msg, _expected(schema))]
    return [_problem(loc, err.instance, str(err.validator), err.message, _expected(schema))]


def invalid_arguments_text(name: str, schema: dict[str, Any], errors: list[dict[str, Any]]) -> str:
    """The whole ``invalid arguments`` message: a headline, the JSON envelope, the parameters.

    The envelope is one line, ``{"status": "validation_error", "tool_name", "error_count",
    "errors": [...]}`` with :func:`problems`' dicts, so a model (or a client reading the
    transcript) can fix each field by its ``loc``.
    """
    req = set(schema.get("required", []))
    # An object schema may leave out "properties" (MCP tools without arguments do).
    props = schema.get("properties", {})
    params = ", ".join(describe_param(k, v, k in req) for k, v in props.items()) or "none"
    envelope = {
        "status": "validation_error",
        "tool_name": name,
        "error_count": len(errors),
        "errors": errors,
    }
    return (
        f"invalid arguments for {name}\n"
        + json.dumps(envelope, ensure_ascii=False, default=repr)
        + f"\n{name} parameters: {params}. Fix the arguments and call again."
    )


def unknown_tool_text(name: Any, available: list[str], hint: str | None) -> str:
    """The ``unknown tool`` message: a headline, then ``{"status": "unknown_tool", …}``."""
    close = f" Did you mean {hint!r}?" if hint else ""
    envelope = {
        "status": "unknown_tool",
        "tool_name": name,
        "suggestion": hint,
        "available_tools": available,
    }
    return f"unknown tool {name!r}.{close} Available tools: {', '.join(available)}.\n" + json.dumps(
        envelope, ensure_ascii=False, default=repr
    )


def with_defaults(schema: dict[str, Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """A copy of valid ``arguments`` with schema defaults filled in and integers as int."""
    args = dict(arguments)
    for key, prop in schema.get("properties", {}).items():
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
