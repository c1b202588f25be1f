"""Mapping rules shared by the protocol modules (typed request → neutral `Conversation`).

Each protocol module (`ds4mlx.routes.anthropic`, `.openai`, `.responses`) owns its own
mapping; this module holds only the rules they share (docs/ARCHITECTURE.md §4), so each
rule exists once:

- system text joins: ``\\n`` between Anthropic system blocks (only where the previous
  part lacks one), a blank line between hoisted system parts;
- a non-text content block (image, document, audio, file…) renders as the placeholder
  DeepSeek's own conversion writes (``[Unsupported Image]``, ``[Unsupported document
  type: application/pdf]``…), and is noted for the request's log line;
- tool-call arguments that are not a JSON object are kept under ``"arguments"``;
- an "effort" word maps onto DeepSeek's thinking switch and Think-Max;
- a forced ``tool_choice`` needs a callable tool, and a named one must be offered;
- the OpenAI ``tool_choice`` shapes (chat and Responses differ only in where the name
  and the ``allowed_tools`` mode live);
- OpenAI's per-token logprob entries (chat ``logprobs.content``, Responses
  ``output_text.logprobs``: the same shape).

Nothing here knows HTTP or the engine (token text comes from the tokenizer a caller
passes in).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any

from ds4mlx.dsml import Message, ToolSpec


class WireError(ValueError):
    """A request that validated structurally but cannot be mapped (client error → 400).

    ``param`` names the offending field path (e.g. ``"input[3]"``) or is None.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def empty_schema() -> dict[str, Any]:
    """A fresh empty JSON-Schema object: the parameters of a tool that declares none."""
    return {"type": "object", "properties": {}}


def join_newline(parts: Iterable[str]) -> str:
    """Join parts with ``\\n``, inserted only when the previous part lacks one."""
    out = ""
    for p in parts:
        if out and not out.endswith("\n"):
            out += "\n"
        out += p
    return out


def join_blank(parts: Iterable[str]) -> str:
    """Join the non-empty parts with a blank line."""
    return "\n\n".join(p for p in parts if p)


# What a placeholder stands for, by wire type, as DeepSeek's own conversion
# (deepseek-recipe) names it: chat's ``file`` part is taken for an image input there,
# Responses' ``input_file`` for a document.
_NOUNS = {
    "image": "Image",
    "image_url": "Image",
    "input_image": "Image",
    "file": "Image",
    "input_file": "Document",
    "input_audio": "Audio",
    "audio": "Audio",
}
# The parts the current request replaced by placeholders, ``(wire type, text)`` (a list
# set per HTTP request / WebSocket by `note_unsupported`; thread-pool copies of the
# request's context share it).
_UNSUPPORTED: ContextVar[list[tuple[str, str]] | None] = ContextVar(
    "unsupported_parts", default=None
)


def placeholder(kind: str | None, media_type: Any = None) -> str:
    """The text the model sees instead of a non-text block of wire type ``kind`` (the
    model reads text only), noted with ``kind`` for the request's log line; DeepSeek's
    own conversion's spellings: ``[Unsupported Image]`` for ``image``, ``image_url``,
    ``input_image`` and chat's ``file`` alike, ``[Unsupported Document]`` for
    ``input_file``, ``[Unsupported Audio]``, an Anthropic ``document`` as
    ``[Unsupported document type: MEDIA]`` (its source's ``media_type``, else
    ``unknown``), else ``[Unsupported KIND]``."""
    if kind == "document":
        media = media_type if isinstance(media_type, str) and media_type else "unknown"
        text = f"[Unsupported document type: {media}]"
    else:
        text = f"[Unsupported {_NOUNS.get(kind or '', kind or 'content')}]"
    seen = _UNSUPPORTED.get()
    if seen is not None:
        seen.append((kind or "content", text))
    return text


def note_unsupported() -> None:
    """Start noting the placeholders of the current request (a request hook calls it)."""
    _UNSUPPORTED.set([])


def take_unsupported() -> list[tuple[str, str]]:
    """The ``(wire type, placeholder text)`` noted since the last call (or
    `note_unsupported`), in order; clears them (a WebSocket carries several requests)."""
    seen = _UNSUPPORTED.get()
    if not seen:
        return []
    out = list(seen)
    seen.clear()
    return out


def parts_text(content: str | list[Any] | None) -> str:
    """Text of an OpenAI message ``content``: a string, or typed parts (``.type``,
    ``.text``: `ds4mlx.routes.body.ContentPart`) joined by a blank line,
    as DeepSeek's own conversion joins them (concatenated, ``"Hello"`` and ``"there"``
    would read ``Hellothere``) — text parts (``text``, ``input_text``, ``output_text``)
    as their text, ``refusal`` as its refusal, anything else as a placeholder."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if p.type in ("text", "input_text", "output_text"):
            parts.append(p.text or "")
        elif p.type == "refusal":
            refusal = getattr(p, "refusal", None)  # an undeclared (extra) field
            parts.append(refusal if isinstance(refusal, str) else "")
        else:
            parts.append(placeholder(p.type))
    return join_blank(parts)


def json_object(text: str | dict[str, Any] | Any) -> dict[str, Any]:
    """Decode a tool call's JSON arguments string; non-objects are wrapped.

    Clients replay arguments exactly as the server produced them, so this normally
    succeeds; when it does not (hand-written history) the raw text is kept under
    ``"arguments"`` rather than failing the request.
    """
    if isinstance(text, dict):
        return text
    if not text:
        return {}
    if not isinstance(text, str):  # any other JSON value a client sent in its place
        return {"arguments": text}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return {"arguments": text}
    return value if isinstance(value, dict) else {"arguments": value}


# Every reasoning-effort word the three protocols define (OpenAI's ``reasoning_effort``
# and ``reasoning.effort``, Anthropic's ``output_config.effort``).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


# A tool name is written inside the DSML attribute ``name="…"`` of each call: a quote,
# an angle bracket or a white-space or control character would end or break it.
_NAME_BREAKS = re.compile(r'["<>\s\x00-\x1f\x7f]')


def unique_names(tools: list[ToolSpec], param: str = "tools") -> list[ToolSpec]:
    """``tools``, checked to name each tool once, each with a name a call can carry: a
    call names its tool, so two of one name would leave the model's calls (and their
    results) ambiguous, and a name with a quote, ``<``, ``>``, white space or a control
    character cannot be written in a call's ``name="…"`` (the model's call to it would
    not parse back).

    Raises:
        WireError: a name given twice, or one with such a character (``param``).
    """
    seen: set[str] = set()
    for t in tools:
        bad = _NAME_BREAKS.search(t.name)
        if bad:
            raise WireError(
                f"{param}: the tool name {t.name!r} has {bad.group()!r}: a tool name cannot "
                "hold quotes, angle brackets, white space or control characters",
                param,
            )
        if t.name in seen:
            raise WireError(f"{param}: more than one tool is named {t.name!r}", param)
        seen.add(t.name)
    return tools


def effort_to_reasoning(
    effort: str | None, param: str = "reasoning_effort"
) -> tuple[bool | None, str | None]:
    """Map a client "effort" word onto (thinking override, reasoning_effort).

    ``"none"`` turns thinking off; ``"max"`` and ``"xhigh"`` select DeepSeek's
    Think-Max (``"max"``); every other word of `EFFORTS` keeps the default thinking with
    no preamble, as DeepSeek's own API maps low/medium/high onto its single "high" level.

    Raises:
        WireError: a word not in `EFFORTS` (any case), or not a string (``param``).
    """
    if effort is None:
        return None, None
    e = effort.lower() if isinstance(effort, str) else None
    if e not in EFFORTS:
        words = ", ".join(repr(w) for w in EFFORTS)
        raise WireError(f"{param}: {effort!r} is not one of {words}", param)
    if e == "none":
        return False, None
    if e in ("max", "xhigh"):
        return True, "max"
    return None, "high"


def hoisted_system(msgs: list[Message], system_parts: list[str]) -> list[Message]:
    """Put the top-level system text (if any) first, as one ``system`` message.

    System instructions met later in the conversation go to ``Conversation.late_system``
    instead (`late_system`): rendered after the tools section, they leave the top-level
    text + tools a prefix that a retry carrying them elsewhere still shares.
    """
    text = join_blank(system_parts)
    return ([Message(role="system", content=text)] if text else []) + msgs


def late_system(parts: list[str]) -> str:
    """``Conversation.late_system`` from system parts met inside the conversation."""
    return join_blank(parts)


def system_in_conversation(msgs: list[Message], late: list[str], text: str) -> None:
    """Place system text met inside the conversation (docs/ARCHITECTURE.md §4).

    Before the first assistant turn it goes to ``late`` (``Conversation.late_system``,
    rendered after the tools section). After it, it becomes text of the user turn it
    belongs to, ``<system-reminder>\nTEXT\n</system-reminder>``: a user message appended
    to ``msgs``, which the renderer joins with a blank line to the user turn it follows
    (after its tool results and text), or which opens the next user turn when it follows
    an assistant turn. So a live continuation's suffix carries it, as the KV must hold
    the request's rendering; the official encoding has no place for it there.
    """
    if not text:
        return
    if any(m.role == "assistant" for m in msgs):
        msgs.append(Message(role="user", content=f"<system-reminder>\n{text}\n</system-reminder>"))
    else:
        late.append(text)


def checked_choice(
    required: bool, name: str | None, tools: list[ToolSpec]
) -> tuple[bool, str | None]:
    """A forced tool choice, checked against the tools offered.

    Raises:
        WireError: a forced choice without tools, or a named tool that is not offered
            (param ``tool_choice``).
    """
    if required and not tools:
        raise WireError(
            "tool_choice forces a tool call but no callable tools were given", "tool_choice"
        )
    if name is not None and name not in {t.name for t in tools}:
        raise WireError(f"tool_choice names tool {name!r}, which is not in tools", "tool_choice")
    return required, name


def allowed_names(
    choice: str | dict[str, Any] | None, tools: list[ToolSpec], entries_of
) -> frozenset[str] | None:
    """The names of the tools an OpenAI ``tool_choice`` lets the model call: None (any
    of ``tools``), or for ``{"type": "allowed_tools", …}`` those its list names
    (``entries_of(choice)`` reads the list where the protocol keeps it; an entry names
    its tool at ``name`` or ``function.name``). Every tool is still rendered, so the
    prompt (and its cache) stays the same whatever the list, which is what the field is
    for; the reply's grammar keeps the calls to the list (``Conversation.allowed_tools``).

    Raises:
        WireError: the list is missing, not a list, empty, or names a tool not in
            ``tools`` (param ``tool_choice``).
    """
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
        return None
    entries = entries_of(choice)
    if not isinstance(entries, list) or not entries:
        raise WireError("tool_choice: allowed_tools needs its list of tools", "tool_choice")
    offered = {t.name for t in tools}
    names = set()
    for e in entries:
        if not isinstance(e, dict):
            raise WireError(
                f"tool_choice: allowed_tools entry {e!r} is not a tool object", "tool_choice"
            )
        fn = e.get("function")
        name = e.get("name") or (fn.get("name") if isinstance(fn, dict) else None)
        if not isinstance(name, str) or name not in offered:
            raise WireError(
                f"tool_choice: allowed_tools names {name!r}, which is not in tools",
                "tool_choice",
            )
        names.add(name)
    return frozenset(names)


def openai_tool_choice(
    choice: str | dict[str, Any] | None,
    tools: list[ToolSpec],
    *,
    named_types: tuple[str, ...],
    name_field: str,
    mode_of,
) -> tuple[bool, str | None]:
    """OpenAI ``tool_choice`` (chat or Responses) → ``(tool_required, tool_name)``.

    ``"auto"``/``"none"``/None: no forcing; ``"required"``; ``{"type": "allowed_tools",
    …}`` with mode ``auto``/``required`` (``mode_of(choice)`` reads it where the
    protocol keeps it); a named choice of a type in ``named_types``, its name read at
    the dotted ``name_field`` path (``function.name`` or ``name``).

    Raises:
        WireError: an unknown value, a forced choice without tools, or a named tool that
            is not offered.
    """
    if choice is None or choice in ("auto", "none"):
        return False, None
    if choice == "required":
        return checked_choice(True, None, tools)
    if not isinstance(choice, dict):
        raise WireError(
            f"tool_choice: {choice!r} is not 'auto', 'none', 'required' or a named tool",
            "tool_choice",
        )
    typ = choice.get("type")
    if typ == "allowed_tools":
        mode = mode_of(choice)
        if mode not in ("auto", "required"):
            raise WireError(
                f"tool_choice: allowed_tools mode {mode!r} is not 'auto' or 'required'",
                "tool_choice",
            )
        return checked_choice(mode == "required", None, tools)
    if typ in named_types:
        node: Any = choice
        for key in name_field.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, str) or not node:
            field = f"tool_choice.{name_field}"
            raise WireError(f"{field}: required for a named tool choice", field)
        return checked_choice(True, node, tools)
    raise WireError(
        f"tool_choice: type {typ!r} is not supported by this server "
        "(use auto, none, required or a named function)",
        "tool_choice",
    )


def logprob_entries(lps: Iterable[Any], tok: Any) -> list[dict[str, Any]]:
    """OpenAI's per-token logprob entries, ``[{token, logprob, bytes, top_logprobs:
    [{token, logprob, bytes}]}]`` (chat ``logprobs.content``, Responses
    ``output_text.logprobs``).

    ``lps``: the engine's ``TokenLogprob``s (``.token`` an id, ``.logprob`` a natural-log
    float ≤ 0, ``.top`` ``(id, logprob)`` pairs, most likely first); ``tok``: the
    tokenizer giving each id's text (U+FFFD for part of a UTF-8 character) and raw bytes.
    """

    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {
            "token": tok.decode([token]),
            "logprob": logprob,
            "bytes": list(tok.token_bytes(token)),
        }

    return [
        {**entry(e.token, e.logprob), "top_logprobs": [entry(i, v) for i, v in e.top]} for e in lps
    ]
