"""Wire formats → the neutral `Conversation` (DESIGN.md §4, "Mapping wire formats").

Each function takes a request body that the route has already validated (plain dicts
and lists, as ``pydantic``'s ``model_dump`` returns them) and builds the
`ds4mlx.dsml.conversation.Conversation` that `render_prompt` turns into DeepSeek V4
prompt text. Nothing here knows about HTTP, tokens or the engine; stdlib only.

Protocol references:
- Anthropic Messages: https://docs.anthropic.com/en/api/messages
- OpenAI Chat Completions: https://platform.openai.com/docs/api-reference/chat/create
- OpenAI Responses: https://platform.openai.com/docs/api-reference/responses/create

Mapping rules where DeepSeek's official encoding has no answer (DESIGN.md §4):
- Anthropic ``system`` blocks are joined with ``\\n`` (only when the previous part does
  not already end with one); lines starting with ``x-anthropic-`` (Claude Code's
  per-session billing header) are client metadata: the line is dropped unless asked to
  keep it, the rest of its block stays (a block that was only that line is dropped).
- An assistant message's thinking blocks (interleaved with its tool calls) become the one
  reasoning block of the DS4 format, joined by a blank line; the calls keep their order.
- A ``tool_result`` with ``is_error: true`` renders its text after `TOOL_ERROR_PREFIX`,
  so the model knows the call failed.
- ``system`` messages inside ``messages`` and OpenAI ``developer`` messages are hoisted
  into the leading system block, after the top-level system text, joined by a blank line.
- Tool results (Anthropic ``tool_result`` blocks, OpenAI ``tool`` messages, Responses
  ``function_call_output`` items) become official ``tool`` messages; text in the same
  user message follows them. A list-valued result renders its text blocks joined by a
  blank line and any other block as a short placeholder naming its type.
- Hosted tools (Responses ``web_search`` and friends, Anthropic server tools) are
  accepted but not offered to the model: the server cannot run them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ds4mlx.dsml.conversation import Conversation, Message, ToolCall, ToolSpec

__all__ = [
    "WireError",
    "anthropic_to_conversation",
    "openai_chat_to_conversation",
    "responses_to_conversation",
    "responses_tool_kinds",
    "ResponsesToolKind",
    "effort_to_reasoning",
]

BILLING_PREFIX = "x-anthropic-"
# Anthropic ``tool_result.is_error``: the DS4 format has no error flag, so the text says it.
TOOL_ERROR_PREFIX = "[tool error] "


class WireError(ValueError):
    """A request that validated structurally but cannot be mapped (client error → 400).

    ``param`` names the offending field path (e.g. ``"input[3].call_id"``) or is None.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


# ---------------------------------------------------------------------------
# tool_choice


def _forced_tool(choice: Any, protocol: str, tools: list[ToolSpec]) -> tuple[bool, str | None]:
    """``tool_choice`` → ``(tool_required, tool_name)`` (``none`` is handled by callers).

    OpenAI chat: ``"auto"``, ``"required"``, ``{"type": "function", "function": {"name"}}``,
    ``{"type": "allowed_tools", "allowed_tools": {"mode"}}``. Anthropic: ``{"type": "auto" |
    "any" | "tool", "name"}``. Responses: ``"auto"``, ``"required"``, ``{"type": "function" |
    "custom", "name"}``, ``{"type": "allowed_tools", "mode"}``.

    Raises:
        WireError: an unknown value, a forced choice without tools, or a named tool that
            is not offered (param ``tool_choice``).
    """
    required, name = False, None
    if choice is None or choice == "auto" or choice == "none":
        return False, None
    if choice == "required" and protocol != "anthropic":
        required = True
    elif isinstance(choice, dict):
        typ = choice.get("type")
        if protocol == "anthropic":
            if typ in ("auto", "none"):
                return False, None
            if typ == "any":
                required = True
            elif typ == "tool":
                required, name = True, choice.get("name")
                if not isinstance(name, str) or not name:
                    raise WireError(
                        "tool_choice.name: required for type 'tool'", "tool_choice.name"
                    )
            else:
                raise WireError(
                    f"tool_choice.type: {typ!r} is not one of 'auto', 'any', 'tool', 'none'",
                    "tool_choice.type",
                )
        elif typ == "allowed_tools":
            mode = choice.get("mode")
            if protocol == "chat":
                mode = (choice.get("allowed_tools") or {}).get("mode", mode)
            if mode not in ("auto", "required"):
                raise WireError(
                    f"tool_choice: allowed_tools mode {mode!r} is not 'auto' or 'required'",
                    "tool_choice",
                )
            required = mode == "required"
        elif typ == "function" or (typ == "custom" and protocol == "responses"):
            fn = choice.get("function") if protocol == "chat" else choice
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str) or not name:
                field = "tool_choice.function.name" if protocol == "chat" else "tool_choice.name"
                raise WireError(f"{field}: required for a named tool choice", field)
            required = True
        else:
            raise WireError(
                f"tool_choice: type {typ!r} is not supported by this server "
                "(use auto, none, required or a named function)",
                "tool_choice",
            )
    else:
        allowed = "'auto', 'none', 'required'" if protocol != "anthropic" else "an object"
        raise WireError(f"tool_choice: {choice!r} is not {allowed} or a named tool", "tool_choice")
    if required and not tools:
        raise WireError(
            "tool_choice forces a tool call but no callable tools were given", "tool_choice"
        )
    if name is not None and name not in {t.name for t in tools}:
        raise WireError(f"tool_choice names tool {name!r}, which is not in tools", "tool_choice")
    return required, name


# ---------------------------------------------------------------------------
# shared helpers


def _join_newline(parts: Iterable[str]) -> str:
    """Join parts with ``\\n``, inserted only when the previous part lacks one."""
    out = ""
    for p in parts:
        if out and not out.endswith("\n"):
            out += "\n"
        out += p
    return out


def _join_blank(parts: Iterable[str]) -> str:
    """Join the non-empty parts with a blank line."""
    return "\n\n".join(p for p in parts if p)


def _placeholder(block: dict[str, Any]) -> str:
    """Short text standing in for a non-text block (image, document, audio…)."""
    return f"[{block.get('type') or 'content'}]"


def _json_object(text: str | dict[str, Any] | None) -> dict[str, Any]:
    """Decode a tool call's JSON arguments string; non-objects are wrapped.

    Clients replay arguments exactly as the server produced them, so this normally
    succeeds; when it does not (hand-written history) the raw text is kept under
    ``"arguments"`` rather than failing the request.
    """
    if isinstance(text, dict):
        return text
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return {"arguments": text}
    return value if isinstance(value, dict) else {"arguments": value}


def effort_to_reasoning(effort: str | None) -> tuple[bool | None, str | None]:
    """Map a client "effort" word onto (thinking override, reasoning_effort).

    ``"none"`` turns thinking off; ``"max"`` and ``"xhigh"`` select DeepSeek's
    Think-Max (``"max"``); every other value keeps the default thinking with no preamble,
    as DeepSeek's own API maps low/medium/high onto its single "high" level.
    """
    if effort is None:
        return None, None
    e = str(effort).lower()
    if e == "none":
        return False, None
    if e in ("max", "xhigh"):
        return True, "max"
    return None, "high"


def _hoisted_system(conv_msgs: list[Message], system_parts: list[str]) -> list[Message]:
    """Put the system text (if any) first, as one ``system`` message."""
    text = _join_blank(system_parts)
    return ([Message(role="system", content=text)] if text else []) + conv_msgs


# ---------------------------------------------------------------------------
# Anthropic Messages


def _anthropic_tool_result_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for b in content:
        if isinstance(b, dict) and b.get("type") == "text":
            parts.append(b.get("text") or "")
        elif isinstance(b, dict):
            parts.append(_placeholder(b))
    return _join_blank(parts)


def _anthropic_tool_message(block: dict[str, Any]) -> Message:
    """A ``tool_result`` block as an official ``tool`` message (``is_error``: prefixed)."""
    result = _anthropic_tool_result_text(block.get("content"))
    if block.get("is_error") is True:
        result = TOOL_ERROR_PREFIX + result
    return Message(role="tool", tool_call_id=block.get("tool_use_id"), content=result)


def strip_billing_lines(text: str) -> str | None:
    """``text`` without its ``x-anthropic-…`` lines (client metadata, DESIGN §4 mapping).

    Returns None when the text was nothing but such lines (the block is dropped, not
    rendered as an empty part), else the remaining lines, unchanged.
    """
    if BILLING_PREFIX not in text:
        return text
    lines = text.splitlines(keepends=True)
    kept = [ln for ln in lines if not ln.startswith(BILLING_PREFIX)]
    if len(kept) == len(lines):
        return text
    return "".join(kept) if kept else None


def anthropic_system_text(system: Any, *, keep_billing_header: bool = False) -> str:
    """The top-level ``system`` (string or text blocks) as one string.

    Blocks are joined with ``\\n`` (inserted only when missing); lines beginning with
    ``x-anthropic-`` are dropped unless ``keep_billing_header`` (the rest of their block
    is kept; a block of only such lines is dropped).
    """
    if system is None:
        return ""
    if isinstance(system, str):
        if keep_billing_header:
            return system
        return strip_billing_lines(system) or ""
    parts = []
    for b in system:
        text = b.get("text") or "" if isinstance(b, dict) else str(b)
        if not keep_billing_header:
            text = strip_billing_lines(text)
            if text is None:
                continue
        parts.append(text)
    return _join_newline(parts)


def anthropic_to_conversation(
    body: dict[str, Any],
    *,
    default_thinking: bool = True,
    keep_billing_header: bool = False,
    decode_reasoning: Callable[[str], str | None] | None = None,
) -> Conversation:
    """Map an Anthropic Messages request body onto a `Conversation`.

    Args:
        body: the validated request (``system``, ``messages``, ``tools``,
            ``tool_choice``, ``thinking``, ``output_config`` are read).
        default_thinking: the mode when ``thinking`` is absent (the served model's
            default; False for the ``deepseek-chat`` alias).
        keep_billing_header: keep ``x-anthropic-…`` system blocks (DESIGN.md §3).
        decode_reasoning: maps a thinking block's ``signature`` to the reasoning it
            carries (the server's integrity-checked carrier, None when it does not
            verify); lets a client that received the thinking without its text
            (``display: "omitted"``) replay it exactly. Empty or foreign signatures are
            accepted and the block's own ``thinking`` text is used.
    Raises:
        WireError: a role other than user/assistant/system.
    """
    system_parts = [
        anthropic_system_text(body.get("system"), keep_billing_header=keep_billing_header)
    ]
    msgs: list[Message] = []
    for i, m in enumerate(body.get("messages") or []):
        role = m.get("role")
        content = m.get("content")
        blocks: list[dict[str, Any]] = (
            [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        )
        if role == "system":
            text = _join_newline(b.get("text") or "" for b in blocks if b.get("type") == "text")
            kept = text if keep_billing_header else strip_billing_lines(text)
            if kept is not None:
                system_parts.append(kept)
        elif role == "user":
            texts: list[str] = []
            for b in blocks:
                t = b.get("type")
                if t == "tool_result":
                    msgs.append(_anthropic_tool_message(b))
                elif t == "text":
                    texts.append(b.get("text") or "")
                else:
                    texts.append(_placeholder(b))
            if texts or not any(b.get("type") == "tool_result" for b in blocks):
                msgs.append(Message(role="user", content=_join_newline(texts)))
        elif role == "assistant":
            texts, reasoning, calls = [], [], []
            for b in blocks:
                t = b.get("type")
                if t == "text":
                    texts.append(b.get("text") or "")
                elif t == "thinking":
                    text = None
                    if decode_reasoning is not None and b.get("signature"):
                        text = decode_reasoning(b["signature"])
                    reasoning.append(text if text is not None else (b.get("thinking") or ""))
                elif t in ("tool_use", "server_tool_use"):
                    inp = b.get("input")
                    calls.append(
                        ToolCall(
                            id=b.get("id") or "",
                            name=b.get("name") or "",
                            arguments=inp if isinstance(inp, dict) else {},
                        )
                    )
                # redacted_thinking and server tool results carry nothing we can render.
            msgs.append(
                Message(
                    role="assistant",
                    content="".join(texts),
                    # Interleaved thinking (thinking, tool_use, thinking, tool_use): the DS4
                    # format has one reasoning block; never glue its segments together.
                    reasoning=_join_blank(reasoning) if reasoning else None,
                    tool_calls=calls,
                )
            )
        else:
            raise WireError(f"unknown role {role!r}", f"messages.{i}.role")

    tools: list[ToolSpec] = []
    choice = body.get("tool_choice") or {}
    if not (isinstance(choice, dict) and choice.get("type") == "none"):
        for t in body.get("tools") or []:
            # Server tools (web_search_20250305, bash_20250124, …) have no input_schema.
            if t.get("input_schema") is None:
                continue
            tools.append(
                ToolSpec(
                    name=t.get("name") or "",
                    description=t.get("description") or "",
                    parameters=t.get("input_schema") or {"type": "object", "properties": {}},
                )
            )

    thinking = default_thinking
    th = body.get("thinking")
    if isinstance(th, dict) and th.get("type"):
        thinking = th.get("type") != "disabled"
    effort = (body.get("output_config") or {}).get("effort")
    _, reasoning_effort = effort_to_reasoning(effort)
    required, name = _forced_tool(body.get("tool_choice"), "anthropic", tools)
    return Conversation(
        messages=_hoisted_system(msgs, system_parts),
        tools=tools,
        thinking=thinking,
        reasoning_effort=reasoning_effort if thinking else None,
        tool_required=required,
        tool_name=name,
    )


# ---------------------------------------------------------------------------
# OpenAI Chat Completions


def _openai_content_text(content: Any) -> str:
    """Text of a chat message ``content`` (string or list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if not isinstance(p, dict):
            continue
        if p.get("type") in ("text", "input_text", "output_text"):
            parts.append(p.get("text") or "")
        elif p.get("type") == "refusal":
            parts.append(p.get("refusal") or "")
        else:
            parts.append(_placeholder(p))
    return "".join(parts)


def openai_chat_thinking(body: dict[str, Any], default_thinking: bool) -> tuple[bool, str | None]:
    """Thinking mode and reasoning effort of a chat request.

    Accepted spellings: DeepSeek's ``thinking: {"type": "enabled"|"disabled"}``,
    ``think: bool``, ``chat_template_kwargs: {"thinking"|"enable_thinking": bool}``
    and OpenAI's ``reasoning_effort`` (``"none"`` disables, ``"max"``/``"xhigh"`` = Think-Max).
    """
    thinking = default_thinking
    forced, effort = effort_to_reasoning(body.get("reasoning_effort"))
    if forced is not None:
        thinking = forced
    kw = body.get("chat_template_kwargs") or {}
    for key in ("thinking", "enable_thinking"):
        if isinstance(kw.get(key), bool):
            thinking = kw[key]
    if isinstance(body.get("think"), bool):
        thinking = body["think"]
    th = body.get("thinking")
    if isinstance(th, dict) and th.get("type"):
        thinking = th["type"] != "disabled"
    elif isinstance(th, bool):
        thinking = th
    return thinking, (effort if thinking else None)


def openai_chat_to_conversation(
    body: dict[str, Any], *, default_thinking: bool = True
) -> Conversation:
    """Map an OpenAI Chat Completions request body onto a `Conversation`.

    ``system``/``developer`` messages are hoisted into the leading system block;
    ``tool`` messages become official tool results; assistant ``reasoning_content``
    (DeepSeek's field; ``reasoning`` also accepted) is the turn's reasoning.

    Raises:
        WireError: an unknown role.
    """
    system_parts: list[str] = []
    msgs: list[Message] = []
    for i, m in enumerate(body.get("messages") or []):
        role = m.get("role")
        if role in ("system", "developer"):
            system_parts.append(_openai_content_text(m.get("content")))
        elif role == "user":
            msgs.append(Message(role="user", content=_openai_content_text(m.get("content"))))
        elif role == "assistant":
            calls = []
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") or {}
                calls.append(
                    ToolCall(
                        id=tc.get("id") or "",
                        name=fn.get("name") or "",
                        arguments=_json_object(fn.get("arguments")),
                    )
                )
            reasoning = m.get("reasoning_content")
            if reasoning is None:
                reasoning = m.get("reasoning")
            msgs.append(
                Message(
                    role="assistant",
                    content=_openai_content_text(m.get("content")),
                    reasoning=reasoning if isinstance(reasoning, str) else None,
                    tool_calls=calls,
                )
            )
        elif role in ("tool", "function"):
            msgs.append(
                Message(
                    role="tool",
                    tool_call_id=m.get("tool_call_id") or m.get("name"),
                    content=_openai_content_text(m.get("content")),
                )
            )
        else:
            raise WireError(f"unknown role {role!r}", f"messages[{i}].role")

    tools: list[ToolSpec] = []
    if body.get("tool_choice") != "none":
        for t in body.get("tools") or []:
            if t.get("type", "function") != "function":
                continue
            fn = t.get("function") or {}
            tools.append(
                ToolSpec(
                    name=fn.get("name") or "",
                    description=fn.get("description") or "",
                    parameters=fn.get("parameters") or {"type": "object", "properties": {}},
                )
            )
    thinking, effort = openai_chat_thinking(body, default_thinking)
    required, name = _forced_tool(body.get("tool_choice"), "chat", tools)
    return Conversation(
        messages=_hoisted_system(msgs, system_parts),
        tools=tools,
        thinking=thinking,
        reasoning_effort=effort,
        tool_required=required,
        tool_name=name,
    )


# ---------------------------------------------------------------------------
# OpenAI Responses


@dataclass
class ResponsesToolKind:
    """How a tool the model may call must be reported back in a Responses stream.

    ``kind`` is ``"function"`` (item ``function_call``, JSON ``arguments``) or
    ``"custom"`` (item ``custom_tool_call``, free-form ``input``; offered to the model
    as a function with one string parameter ``input``). ``namespace`` is the
    ``namespace`` tool group the function was declared in, or None.
    """

    kind: str
    namespace: str | None = None


CUSTOM_INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "the raw tool input"}},
    "required": ["input"],
}


def responses_tool_kinds(tools: list[dict[str, Any]] | None) -> dict[str, ResponsesToolKind]:
    """Callable tools of a Responses request by name; hosted tool types are left out."""
    out: dict[str, ResponsesToolKind] = {}
    for t in tools or []:
        typ = t.get("type")
        if typ == "function":
            out[t.get("name") or ""] = ResponsesToolKind("function")
        elif typ == "custom":
            out[t.get("name") or ""] = ResponsesToolKind("custom")
        elif typ == "namespace":
            for sub in t.get("tools") or []:
                if sub.get("type", "function") == "function":
                    out[sub.get("name") or ""] = ResponsesToolKind("function", t.get("name"))
    return out


def _responses_tool_specs(tools: list[dict[str, Any]] | None) -> list[ToolSpec]:
    specs = []
    for i, t in enumerate(tools or []):
        typ = t.get("type")
        if typ in ("function", "custom") and not t.get("name"):
            raise WireError(f"tools[{i}].name: required for a {typ} tool", f"tools.{i}.name")
        if typ == "function":
            specs.append(
                ToolSpec(
                    name=t.get("name") or "",
                    description=t.get("description") or "",
                    parameters=t.get("parameters") or {"type": "object", "properties": {}},
                )
            )
        elif typ == "custom":
            desc = t.get("description") or ""
            fmt = t.get("format") or {}
            if fmt.get("type") == "grammar" and fmt.get("definition"):
                desc += f"\n\nThe input must follow this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
            specs.append(
                ToolSpec(name=t.get("name") or "", description=desc, parameters=CUSTOM_INPUT_SCHEMA)
            )
        elif typ == "namespace":
            ns_desc = t.get("description") or ""
            for sub in t.get("tools") or []:
                if sub.get("type", "function") != "function":
                    continue
                desc = sub.get("description") or ""
                specs.append(
                    ToolSpec(
                        name=sub.get("name") or "",
                        description=f"{desc}\n({t.get('name')}: {ns_desc})" if ns_desc else desc,
                        parameters=sub.get("parameters") or {"type": "object", "properties": {}},
                    )
                )
        # Hosted tools (web_search, file_search, code_interpreter, image_generation,
        # mcp, computer_use, local_shell…) are accepted and not offered.
    return specs


def _responses_output_text(output: Any) -> str:
    """Text of a ``function_call_output.output`` (string or list of content parts)."""
    if output is None:
        return ""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        parts = []
        for p in output:
            if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text"):
                parts.append(p.get("text") or "")
            elif isinstance(p, dict):
                parts.append(_placeholder(p))
        return _join_blank(parts)
    return json.dumps(output, ensure_ascii=False)


def responses_to_conversation(
    body: dict[str, Any],
    *,
    default_thinking: bool = True,
    decode_reasoning: Callable[[str], str | None] | None = None,
) -> Conversation:
    """Map an OpenAI Responses request body onto a `Conversation`.

    ``instructions`` and ``system``/``developer`` message items form the system block.
    Consecutive assistant-side items (``reasoning``, assistant ``message``,
    ``function_call``, ``custom_tool_call``) form one assistant turn; a reasoning
    item's text comes from ``decode_reasoning(encrypted_content)`` (the server's
    integrity-checked carrier; None when it does not verify) or its ``content``
    reasoning text.

    Raises:
        WireError: ``item_reference`` items (no server-side store) or unknown roles.
    """
    system_parts = [body.get("instructions") or ""]
    msgs: list[Message] = []
    inp = body.get("input")
    items: list[Any] = (
        [{"type": "message", "role": "user", "content": inp}]
        if isinstance(inp, str)
        else list(inp or [])
    )

    # An assistant turn stays open (later assistant-side items join it) until a
    # user or tool item arrives.
    state = {"open": False}

    def open_assistant() -> Message:
        if state["open"] and msgs and msgs[-1].role == "assistant":
            return msgs[-1]
        msgs.append(Message(role="assistant"))
        state["open"] = True
        return msgs[-1]

    def close_assistant() -> None:
        state["open"] = False

    for i, it in enumerate(items):
        typ = it.get("type") or ("message" if "role" in it else None)
        if typ == "message":
            role = it.get("role")
            text = _openai_content_text(it.get("content"))
            if role in ("system", "developer"):
                system_parts.append(text)
            elif role == "user":
                close_assistant()
                msgs.append(Message(role="user", content=text))
            elif role == "assistant":
                m = open_assistant()
                if m.tool_calls:
                    # Text after a call starts a new turn: DSML puts content before calls.
                    close_assistant()
                    m = open_assistant()
                m.content += text
            else:
                raise WireError(f"unknown role {role!r}", f"input[{i}].role")
        elif typ == "reasoning":
            m = open_assistant()
            if m.content or m.tool_calls:
                close_assistant()
                m = open_assistant()
            text = None
            enc = it.get("encrypted_content")
            if enc and decode_reasoning is not None:
                text = decode_reasoning(enc)
            if text is None:
                content = it.get("content") or []
                texts = [c.get("text") or "" for c in content if isinstance(c, dict)]
                text = "".join(texts) if texts else None
            if text is not None:
                m.reasoning = (m.reasoning or "") + text
        elif typ in ("function_call", "custom_tool_call"):
            m = open_assistant()
            if typ == "function_call":
                args = _json_object(it.get("arguments"))
            else:
                args = {"input": it.get("input") or ""}
            m.tool_calls.append(
                ToolCall(id=it.get("call_id") or "", name=it.get("name") or "", arguments=args)
            )
        elif typ in ("function_call_output", "custom_tool_call_output"):
            close_assistant()
            msgs.append(
                Message(
                    role="tool",
                    tool_call_id=it.get("call_id"),
                    content=_responses_output_text(it.get("output")),
                )
            )
        elif typ == "item_reference":
            raise WireError(
                "item_reference needs a server-side response store, which this server does not keep; "
                "send the full input items (store: false)",
                f"input[{i}]",
            )
        # Other item types (web_search_call, compaction, local_shell_call…) describe
        # hosted actions this server never performs; they carry nothing to render.

    thinking = default_thinking
    forced, effort = effort_to_reasoning((body.get("reasoning") or {}).get("effort"))
    if forced is not None:
        thinking = forced
    tools = [] if body.get("tool_choice") == "none" else _responses_tool_specs(body.get("tools"))
    required, name = _forced_tool(body.get("tool_choice"), "responses", tools)
    return Conversation(
        messages=_hoisted_system(msgs, system_parts),
        tools=tools,
        thinking=thinking,
        reasoning_effort=effort if thinking else None,
        tool_required=required,
        tool_name=name,
    )
