"""Structured outputs and strict tools on the wire: each protocol's fields mapped onto the
job vocabulary's `OutputConstraint` (the pipeline compiles it; docs/STRUCTURED_OUTPUTS.md).

- OpenAI chat: ``response_format`` ``{"type": "json_schema", "json_schema": {"schema"}}``
  or ``{"type": "json_object"}``; ``tools[].function.strict: true``.
- Responses: ``text.format`` (``json_schema`` with ``schema``, ``json_object``); function
  tools with ``strict: true``; custom tools (always: their input under their
  ``format`` grammar, ``lark`` or ``regex``, or free text).
- OpenAI legacy completions: ``response_format`` as in chat (the raw continuation is
  the reply).
- vLLM's spellings on both (``guided_json``, ``structured_outputs.json`` /
  ``json_object``) as ``response_format``; its regex, choice and grammar forms are
  refused.
- Anthropic Messages: ``output_config.format`` ``{"type": "json_schema", "schema"}`` (or
  the beta's top-level ``output_format``); tools with ``strict: true``.

``parallel_tool_calls: false`` (OpenAI protocols) allows one call per turn. A shape this
module cannot read is a `WireError` naming its field (400 in the protocol's shape).
"""

from __future__ import annotations

import json
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


def _schema_of(
    fmt: dict[str, Any] | None, param: str, key: str
) -> tuple[dict[str, Any] | None, bool]:
    """``(schema, json_object)`` of an OpenAI-style format object at ``param`` (None:
    the field is absent).

    Raises:
        WireError: no ``type`` (a format whose kind is unknown would be served free),
            an unknown ``type``, or a ``json_schema`` without a schema object.
    """
    if fmt is None:
        return None, False
    kind = fmt.get("type")
    if kind is None:
        raise WireError(f"{param}.type: required (text, json_object, json_schema)", f"{param}.type")
    if kind == "text":
        return None, False
    if kind == "json_object":
        return None, True
    if kind == "json_schema":
        holder = fmt.get(key) if key else fmt
        strict = holder.get("strict") if isinstance(holder, dict) else None
        if strict is not None and not isinstance(strict, bool):
            where = f"{param}.{key}.strict" if key else f"{param}.strict"
            raise WireError(f"{where}: must be a boolean", where)
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


def _strict(tool: Any, where: str) -> bool:
    """Whether ``tool`` (a wire model whose extras may hold ``strict``) is strict.

    Raises:
        WireError: ``strict`` is neither a JSON boolean nor null: a client asking for a
            strict tool in a shape this server cannot read must not get a free one.
    """
    value = (tool.model_extra or {}).get("strict")
    if value is not None and not isinstance(value, bool):
        raise WireError(f"{where}.strict: must be a boolean", f"{where}.strict")
    return value is True


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
        if t.type == "function" and _strict(f, f"tools[{i}].function"):
            c.tools[f.name] = ToolRule(strict=True)
            c.tool_params[f.name] = f"tools[{i}].function.parameters"
    return _response_format(c, extra)


def _response_format(c: OutputConstraint, extra: dict[str, Any]) -> OutputConstraint | None:
    """``c`` with the OpenAI ``response_format`` of a body's extra fields (or vLLM's
    spellings of it, `_vllm_format`), or None.

    Raises:
        WireError: a format of the wrong shape, or given both ways.
    """
    rf = extra.get("response_format")
    if rf is not None and not isinstance(rf, dict):
        raise WireError("response_format: must be an object", "response_format")
    vllm = _vllm_format(extra)
    if vllm is not None:
        if rf is not None and rf.get("type") != "text":
            raise WireError(
                f"{vllm[2]}: give the output format once (response_format or {vllm[2]})",
                vllm[2],
            )
        return _finish(c, *vllm)
    schema, obj = _schema_of(rf, "response_format", "json_schema")
    return _finish(c, schema, obj, "response_format.json_schema.schema")


# vLLM's structured-output fields this server cannot enforce (a reply under a regex, a
# choice of strings, a grammar): refused, never served free.
_VLLM_REFUSED = ("guided_regex", "guided_choice", "guided_grammar")
_VLLM_OPTIONS_REFUSED = ("regex", "choice", "grammar", "structural_tag")


def _vllm_format(extra: dict[str, Any]) -> tuple[dict[str, Any] | None, bool, str] | None:
    """``(schema, json_object, its wire path)`` of vLLM's structured-output fields:
    ``guided_json`` (a schema object or its JSON text), ``structured_outputs`` with
    ``json`` or ``json_object: true`` (vLLM 0.10's spelling); None when none is set.

    Raises:
        WireError: a regex, choice or grammar (``guided_regex``, ``guided_choice``,
            ``guided_grammar``, ``structured_outputs.regex``/``choice``/``grammar``/
            ``structural_tag``), a schema that is neither an object nor JSON text of one,
            or both spellings at once.
    """
    for name in _VLLM_REFUSED:
        if extra.get(name) is not None:
            raise WireError(
                f"{name}: not supported (structured outputs here are JSON: guided_json, "
                "response_format json_schema or json_object)",
                name,
            )
    found = []
    if extra.get("guided_json") is not None:
        found.append((_vllm_schema(extra["guided_json"], "guided_json"), False, "guided_json"))
    so = extra.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise WireError("structured_outputs: must be an object", "structured_outputs")
        for key in _VLLM_OPTIONS_REFUSED:
            if so.get(key) is not None:
                where = f"structured_outputs.{key}"
                raise WireError(f"{where}: not supported (use json or json_object)", where)
        if so.get("json") is not None:
            where = "structured_outputs.json"
            found.append((_vllm_schema(so["json"], where), False, where))
        elif so.get("json_object") is True:
            found.append((None, True, "structured_outputs.json_object"))
    if len(found) > 1:
        raise WireError("structured_outputs: give the output format once", "structured_outputs")
    return found[0] if found else None


def _vllm_schema(value: Any, where: str) -> dict[str, Any]:
    """A vLLM schema field's object (vLLM takes the object or its JSON text).

    Raises:
        WireError: neither a JSON object nor the text of one.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise WireError(f"{where}: not valid JSON", where) from None
    if not isinstance(value, dict):
        raise WireError(f"{where}: a JSON schema object is required", where)
    return value


def completion_constraint(req: Any) -> OutputConstraint | None:
    """The constraint of a legacy completion (``CompletionRequest``: ``response_format``
    as in chat, no tools), or None."""
    return _response_format(OutputConstraint(), req.model_extra or {})


def _custom_rule(c: OutputConstraint, name: str, fmt: Any, where: str) -> None:
    """``c`` with the rule of the custom tool ``name`` (its input under its ``format``'s
    grammar, or free text); ``where``: its wire path.

    Raises:
        WireError: a format that is not an object of type text or grammar.
    """
    fmt = fmt or {}
    if not isinstance(fmt, dict) or fmt.get("type") not in (None, "text", "grammar"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise WireError(
            f"{where}.format.type: {kind!r} is not supported (text, grammar)",
            f"{where}.format.type",
        )
    grammar = fmt.get("type") == "grammar"
    if grammar and not isinstance(fmt.get("definition"), str):
        raise WireError(
            f"{where}.format.definition: the grammar definition must be a string",
            f"{where}.format.definition",
        )
    c.tools[name] = ToolRule(
        custom=True,
        syntax=fmt.get("syntax") if grammar else None,
        definition=fmt.get("definition") if grammar else None,
    )
    c.tool_params[name] = f"{where}.format" + (".definition" if grammar else "")


def responses_constraint(req: Any) -> OutputConstraint | None:
    """The constraint of a Responses request (``ResponsesRequest``), or None."""
    extra = req.model_extra or {}
    c = OutputConstraint(parallel=_parallel(req))
    for i, t in enumerate(req.tools or []):
        if t.type == "function" and _strict(t, f"tools[{i}]"):
            c.tools[t.name or ""] = ToolRule(strict=True)
            c.tool_params[t.name or ""] = f"tools[{i}].parameters"
        elif t.type == "custom":
            _custom_rule(c, t.name or "", t.format, f"tools[{i}]")
        elif t.type == "namespace":  # Codex puts its freeform ``exec`` in one
            for j, sub in enumerate(t.tools or []):
                if isinstance(sub, dict) and sub.get("type") == "custom":
                    _custom_rule(
                        c, sub.get("name") or "", sub.get("format"), f"tools[{i}].tools[{j}]"
                    )
    text = extra.get("text")
    if text is not None and not isinstance(text, dict):
        raise WireError("text: must be an object", "text")
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise WireError("text.format: must be an object", "text.format")
    schema, obj = _schema_of(fmt, "text.format", "")
    return _finish(c, schema, obj, "text.format.schema")


def anthropic_constraint(req: Any) -> OutputConstraint | None:
    """The constraint of a Messages request (``MessagesRequest``), or None."""
    c = OutputConstraint()
    for i, t in enumerate(req.tools or []):
        if _strict(t, f"tools.{i}"):
            c.tools[t.name] = ToolRule(strict=True)
            c.tool_params[t.name] = f"tools.{i}.input_schema"
    fmt, where = _anthropic_format(req)
    if fmt is not None and not isinstance(fmt, dict):
        raise WireError(f"{where}: must be an object", where)
    kind = (fmt or {}).get("type", "json_schema")
    if kind != "json_schema":
        raise WireError(f"{where}.type: {kind!r} is not supported (json_schema)", f"{where}.type")
    schema, obj = _schema_of(fmt, where, "")
    return _finish(c, schema, obj, f"{where}.schema")


def _anthropic_format(req: Any) -> tuple[Any, str]:
    """``(format, its wire path)`` of a Messages request: ``output_config.format``, or the
    structured-outputs beta's top-level ``output_format`` (still sent by older SDKs and
    other clients; dropping it as an unknown field would serve the reply free).

    Raises:
        WireError: both are given.
    """
    fmt = (req.output_config or {}).get("format")
    legacy = (req.model_extra or {}).get("output_format")
    if legacy is None:
        return fmt, "output_config.format"
    if fmt is not None:
        raise WireError(
            "output_format: give the format once, as output_config.format "
            "(output_format is the beta's older spelling of it)",
            "output_format",
        )
    return legacy, "output_format"
