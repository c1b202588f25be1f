"""Structured outputs and strict tools on the wire: each protocol's fields mapped onto the
job vocabulary's `OutputConstraint` (the pipeline compiles it; docs/STRUCTURED_OUTPUTS.md).

- OpenAI chat: ``response_format`` ``{"type": "json_schema", "json_schema": {"schema"}}``
  or ``{"type": "json_object"}``; ``tools[].function.strict: true``.
- Responses: ``text.format`` (``json_schema`` with ``schema``, ``json_object``); function
  tools with ``strict: true``; custom tools (always: their input under their
  ``format`` grammar, ``lark`` or ``regex``, or free text).
- Anthropic Messages: ``output_config.format`` ``{"type": "json_schema", "schema"}``;
  tools with ``strict: true``.

``parallel_tool_calls: false`` (OpenAI protocols) allows one call per turn. A shape this
module cannot read is a `WireError` naming its field (400 in the protocol's shape).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ds4mlx.jobs import OutputConstraint, ToolRule
from ds4mlx.routes.errors import APIError
from ds4mlx.routes.mapping import WireError


def read(fn: Callable[[Any], OutputConstraint | None], req: Any) -> OutputConstraint | None:
    """``fn(req)`` (one of the ``*_constraint`` readers); a `WireError` becomes a 400."""
    try:
        return fn(req)
    except WireError as e:
        raise APIError(400, e.message, param=e.param) from None


def _schema_of(fmt: dict[str, Any], param: str, key: str) -> tuple[dict[str, Any] | None, bool]:
    """``(schema, json_object)`` of an OpenAI-style format object at ``param``."""
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None, False
    if kind == "json_object":
        return None, True
    if kind == "json_schema":
        holder = fmt.get(key) if key else fmt
        schema = holder.get("schema") if isinstance(holder, dict) else None
        if not isinstance(schema, dict):
            where = f"{param}.{key}.schema" if key else f"{param}.schema"
            raise WireError(f"{where}: a JSON schema object is required", where)
        return schema, False
    raise WireError(
        f"{param}.type: {kind!r} is not supported (text, json_object, json_schema)",
        f"{param}.type",
    )


def _finish(
    c: OutputConstraint, schema: dict[str, Any] | None, json_object: bool, param: str
) -> OutputConstraint | None:
    c.schema, c.json_object, c.schema_param = schema, json_object, param
    if schema is None and not json_object and not c.tools:
        return None
    return c


def _parallel(req: Any) -> bool:
    value = getattr(req, "parallel_tool_calls", None)
    if value is None:
        value = (req.model_extra or {}).get("parallel_tool_calls")
    return value is not False


def chat_constraint(req: Any) -> OutputConstraint | None:
    """The constraint of a chat request (``ChatRequest``), or None."""
    extra = req.model_extra or {}
    c = OutputConstraint(parallel=_parallel(req))
    for i, t in enumerate(req.tools or []):
        f = t.function
        if t.type == "function" and (f.model_extra or {}).get("strict") is True:
            c.tools[f.name] = ToolRule(strict=True)
            c.tool_params[f.name] = f"tools[{i}].function.parameters"
    rf = extra.get("response_format")
    if rf is not None and not isinstance(rf, dict):
        raise WireError("response_format: must be an object", "response_format")
    schema, obj = _schema_of(rf or {}, "response_format", "json_schema")
    return _finish(c, schema, obj, "response_format.json_schema.schema")


def responses_constraint(req: Any) -> OutputConstraint | None:
    """The constraint of a Responses request (``ResponsesRequest``), or None."""
    extra = req.model_extra or {}
    c = OutputConstraint(parallel=_parallel(req))
    for i, t in enumerate(req.tools or []):
        if t.type == "function" and (t.model_extra or {}).get("strict") is True:
            c.tools[t.name or ""] = ToolRule(strict=True)
            c.tool_params[t.name or ""] = f"tools[{i}].parameters"
        elif t.type == "custom":
            fmt = t.format or {}
            if fmt.get("type") not in (None, "text", "grammar"):
                raise WireError(
                    f"tools[{i}].format.type: {fmt.get('type')!r} is not supported (text, grammar)",
                    f"tools[{i}].format.type",
                )
            grammar = fmt.get("type") == "grammar"
            c.tools[t.name or ""] = ToolRule(
                custom=True,
                syntax=fmt.get("syntax") if grammar else None,
                definition=fmt.get("definition") if grammar else None,
            )
            c.tool_params[t.name or ""] = f"tools[{i}].format" + (".definition" if grammar else "")
    text = extra.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is not None and not isinstance(fmt, dict):
        raise WireError("text.format: must be an object", "text.format")
    schema, obj = _schema_of(fmt or {}, "text.format", "")
    return _finish(c, schema, obj, "text.format.schema")


def anthropic_constraint(req: Any) -> OutputConstraint | None:
    """The constraint of a Messages request (``MessagesRequest``), or None."""
    c = OutputConstraint()
    for i, t in enumerate(req.tools or []):
        if (t.model_extra or {}).get("strict") is True:
            c.tools[t.name] = ToolRule(strict=True)
            c.tool_params[t.name] = f"tools.{i}.input_schema"
    fmt = (req.output_config or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise WireError("output_config.format: must be an object", "output_config.format")
    kind = (fmt or {}).get("type")
    if kind not in (None, "json_schema"):
        raise WireError(
            f"output_config.format.type: {kind!r} is not supported (json_schema)",
            "output_config.format.type",
        )
    schema, obj = _schema_of(fmt or {}, "output_config.format", "")
    return _finish(c, schema, obj, "output_config.format.schema")
