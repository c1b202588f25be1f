"""The neutral conversation model every wire protocol is converted into.

Routes (OpenAI chat, Anthropic messages, OpenAI Responses) and the agent build a
`Conversation`; `ds4mlx.dsml` renders it to DeepSeek V4 prompt text. Field meanings
follow DeepSeek's official V4 encoding (`encoding_dsv4.py`): roles ``system``,
``developer``, ``user``, ``assistant``, ``tool`` and ``latest_reminder``.
Stdlib only: no MLX, no JSON transport concerns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool", "latest_reminder")


# ``Conversation.response_format`` for a reply that is any JSON object (OpenAI's
# ``json_object``).
JSON_OBJECT = "json_object"


@dataclass
class ToolSpec:
    """A function tool offered to the model.

    ``parameters`` is a JSON Schema object (dict). Its ``properties`` order is the
    order arguments are reported back in. ``background``: the client declared the tool
    ``async: true`` (docs/ARCHITECTURE.md §4, asynchronous tools): a call to it that has
    no result yet gets a pending status result, and its result may arrive turns later.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    background: bool = False


@dataclass
class ToolCall:
    """One tool call made by an assistant turn.

    ``id`` is the protocol id (``toolu_…`` for Anthropic, ``call_…`` for OpenAI).
    ``arguments`` is the decoded JSON object. ``dsml`` is the exact DSML ``invoke``
    block the model sampled when known (from tool memory); renderers prefer it.
    """

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    dsml: str | None = None


@dataclass
class Message:
    """One turn. ``tool_call_id`` is set for role ``tool`` (the result's call id).

    The last three fields are DeepSeek-internal extras of ``encoding_dsv4.py`` that
    protocol routes normally leave at their defaults:

    - ``tools``: tools attached to this ``system``/``developer`` message (the official
      encoding renders the tools section after that message's text). Prefer
      ``Conversation.tools``, which the renderer attaches to the leading system message.
    - ``task``: one of ``action``, ``query``, ``authority``, ``domain``, ``title``,
      ``read_url`` (DeepSeek's quick-instruction tasks); None for normal turns.
    - ``response_format``: a JSON schema dict rendered as a "## Response Format"
      section after a ``system``/``developer`` message's text.

    ``prefix`` (DeepSeek's chat field, and every trailing Anthropic assistant message):
    the conversation's last message is an assistant turn the model continues (a
    prefill): it renders open, without EOS (``<think>reasoning</think>content``, or
    ``<think>reasoning`` still thinking when it has no content); ignored elsewhere.
    """

    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    tools: list[ToolSpec] = field(default_factory=list)
    task: str | None = None
    response_format: dict[str, Any] | None = None
    prefix: bool = False


@dataclass
class Conversation:
    """A whole request: messages, tools and the generation mode.

    ``thinking`` selects thinking mode (``<think>`` opens the reply) versus chat mode
    (``</think>``). ``reasoning_effort`` is ``"max"``, ``"high"`` or None; "max"
    adds DeepSeek's Think-Max preamble when the context is large enough.

    ``tool_required`` / ``tool_name``: the client's forced ``tool_choice`` (any tool /
    that tool). It does not change the rendered prompt; the generation loop opens the
    tool-call block itself once the visible reply starts. ``tool_none``: the client's
    ``tool_choice: none``: no tools are rendered and a call the model writes anyway is
    dropped (never reported as a call nor shown as text). ``single_call``: the client
    allows no parallel calls (``parallel_tool_calls: false``, Anthropic's
    ``disable_parallel_tool_use``): the turn ends after the first closed invoke (the
    generation loop closes the block itself); it does not change the rendered prompt.
    ``allowed_tools``: the names of the tools the client lets the model call (OpenAI's
    ``tool_choice: {"type": "allowed_tools"}``), or None for any; every tool still
    renders, so the prompt stays a stable prefix, and the reply's grammar keeps the
    calls to these.

    ``loaded_tools``: tools a tool search the client ran loaded during the conversation
    (Responses ``tool_search_output``): their schemas render inside that search's tool
    result, not in the tools section (which stays a stable prefix); the model may call
    them like ``tools`` (the decoder orders their arguments too).

    ``late_system``: system instructions that arrive inside the conversation before the
    first assistant turn (Claude Code's environment block, OpenAI ``developer``
    messages). They render in the leading system block *after* the tools section, joined
    by a blank line, so the top-level system text and the tools form a prefix that a
    request and its retry share even when the retry carries the same text elsewhere.
    Later system text is user-turn text (``<system-reminder>``), placed by the routes
    (docs/ARCHITECTURE.md §4).

    ``response_format``: the reply format the model is told in the leading system block,
    after the tools section, as DeepSeek's conversion of an OpenAI request renders it: a
    JSON schema (dict) under "## Response Format", or `JSON_OBJECT` ("Reply with JSON
    object ONLY."); None: nothing is said (the routes' grammar enforces it either way).

    ``open_reply``: a conversation that ends with a closed assistant turn (no
    ``prefix``) is a request for a new reply after it: a reply opener follows its EOS,
    as DeepSeek's conversion renders it. Protocol routes set it; the agent's transcript
    keys (a conversation through a sampled turn) leave it off.
    """

    messages: list[Message] = field(default_factory=list)
    tools: list[ToolSpec] = field(default_factory=list)
    thinking: bool = True
    reasoning_effort: str | None = None
    tool_required: bool = False
    tool_name: str | None = None
    tool_none: bool = False
    single_call: bool = False
    late_system: str = ""
    open_reply: bool = False
    # Last: fields are also given by position (messages, tools, thinking, …).
    loaded_tools: list[ToolSpec] = field(default_factory=list)
    allowed_tools: frozenset[str] | None = None
    response_format: dict[str, Any] | str | None = None
