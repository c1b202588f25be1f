"""OpenAI Responses API: ``POST /v1/responses`` (SSE or JSON), and what its WebSocket shares.

Reference: https://platform.openai.com/docs/api-reference/responses/create and the
streaming events https://platform.openai.com/docs/api-reference/responses-streaming:
``response.created`` → ``response.in_progress`` → per output item
``response.output_item.added`` … ``response.output_item.done`` (reasoning:
``response.content_part.added`` (a ``reasoning_text`` part),
``response.reasoning_text.delta/done``, ``response.content_part.done``; message:
``response.content_part.added``, ``response.output_text.delta/done``,
``response.content_part.done``; function call:
``response.function_call_arguments.delta/done``; custom tool call:
``response.custom_tool_call_input.delta/done``) → ``response.completed`` |
``response.incomplete`` | ``response.failed``. Every event has ``sequence_number``.

What Codex sends (captured from codex-cli 0.171): ``developer``/``user`` message
items with ``input_text`` parts, ``function`` tools plus ``namespace`` groups and hosted
types such as ``web_search`` (accepted, not offered to the model), ``tool_choice``,
``parallel_tool_calls``, ``reasoning: {"summary": "auto"}``, ``store: false``,
``include: ["reasoning.encrypted_content"]``, ``prompt_cache_key``, ``client_metadata``.

Reasoning items carry ``encrypted_content``: the server's integrity-protected carrier
of the sampled reasoning (``ds4mlx.routes.common.ReasoningCarrier``), so a stateless
client replaying it renders the exact prefix the model sampled.

``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` (0..20) asks for the
message text's per-token logprobs (`_TextLogprobs`): each ``output_text.delta`` carries its
tokens' entries, ``output_text.done`` and the ``output_text`` part all of the message's.
Without the include none are computed and every ``logprobs`` is ``[]``.

``previous_response_id`` and ``conversation`` need a response store: over HTTP they
are rejected with a clear 400. On the WebSocket transport (`ds4mlx.routes.responses_ws`:
``GET /v1/responses`` upgrade, steering and cancel frames) the connection keeps its own
responses, so a ``response.create`` that continues the previous response of the same
connection by id is served.

This module owns the whole protocol: the request schema, its mapping onto the neutral
``Conversation`` (`to_conversation`), its names for the planner (`NAMES`), and one
encoder (`ResponseEncoder`) for the SSE stream, the WebSocket and the JSON body alike.
Mapping rules (docs/ARCHITECTURE.md §4): ``instructions`` and ``system``/``developer``
message items form the system block; consecutive assistant-side items (``reasoning``,
assistant ``message``, ``function_call``, ``custom_tool_call``) form one assistant turn;
``function_call_output`` items become tool results; custom tools are offered as a
function with one string parameter ``input``; hosted tools (``web_search`` …) are
accepted and not offered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, StrictBool, Tag, ValidationError
from quart import Blueprint, request

from ds4mlx.dsml import (
    Conversation,
    Message,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolSpec,
)
from ds4mlx.dsml.render import to_json, tool_schema_dict
from ds4mlx.jobs import GenRequest, JobDone, JobFailed, JobStarted, LiveLabels, TokenLogprob
from ds4mlx.routes import constraints
from ds4mlx.routes.access import key_salt
from ds4mlx.routes.body import ContentPart, OpenModel, offload, parse_json, read_body, validate
from ds4mlx.routes.carrier import carrier
from ds4mlx.routes.common import (
    STATE_HEADERS,
    cache_salt,
    json_response,
    model_thinking,
    new_id,
    note_unoffered,
    now,
    state,
    state_key,
)
from ds4mlx.routes.errors import APIError, Wording, failed_to_api
from ds4mlx.routes.items import ItemMemory, item_memory, resolve_references
from ds4mlx.routes.mapping import (
    WireError,
    allowed_names,
    effort_to_reasoning,
    empty_schema,
    hoisted_system,
    json_object,
    late_system,
    logprob_entries,
    openai_tool_choice,
    parts_text,
    system_in_conversation,
    unique_names,
)
from ds4mlx.routes.pipeline import (
    demo_policy,
    drop_oldest_turns,
    prepare,
    respond,
    sampling_params,
    stream,
)
from ds4mlx.routes.sse import sse
from ds4mlx.sampling import SamplingParams

bp = Blueprint("responses", __name__)


# This protocol's names: its jobs' live decision ``live-responses`` with the log detail
# ``match=call-ids ids=N``, and the 400 for a ``call_id`` nothing explains.
# The ``include`` value asking for the message text's per-token logprobs.
LOGPROBS_INCLUDE = "message.output_text.logprobs"

NAMES = Wording(
    param="input",
    id_field="call_id",
    calls="a function_call item of the input",
    labels=LiveLabels(live_tools="live-responses", ids="call-ids"),
)


# --------------------------------------------------------------------------- schemas


class MessageItem(OpenModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(OpenModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = ""


class FunctionCallOutputItem(OpenModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart] | None = None


class CustomToolCallItem(OpenModel):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str = ""


class CustomToolCallOutputItem(OpenModel):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: str | list[ContentPart] | None = None


class ReasoningItem(OpenModel):
    type: Literal["reasoning"]
    summary: list[ContentPart] = Field(default_factory=list)
    content: list[ContentPart] | None = None
    encrypted_content: str | None = None


class ToolSearchCallItem(OpenModel):
    """A tool search the model started (the SDK's ``ResponseToolSearchCall``)."""

    type: Literal["tool_search_call"]
    id: str | None = None
    call_id: str | None = None
    arguments: Any = None
    execution: str | None = None
    status: str | None = None


class ToolSearchOutputItem(OpenModel):
    """The tools a tool search loaded (the SDK's ``ResponseToolSearchOutputItem``):
    function and namespace tool definitions, as in ``tools``."""

    type: Literal["tool_search_output"]
    id: str | None = None
    call_id: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    execution: str | None = None
    status: str | None = None


class AdditionalToolsItem(OpenModel):
    """Tools declared in the input (Codex with a catalog model name sends its tools as
    one leading ``{"type": "additional_tools", "role": "developer", "tools": [...]}``
    item, the top-level ``tools`` empty): tool definitions as in ``tools``, offered for
    this request (`hoist_tools`)."""

    type: Literal["additional_tools"]
    role: str | None = None
    tools: list[ResponsesTool] = Field(default_factory=list)


class OtherItem(OpenModel):
    """Hosted-tool call records, compaction items, item references…"""

    type: str


_ITEMS = {
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
    "tool_search_call",
    "tool_search_output",
    "additional_tools",
}


def _item_tag(v: Any) -> str:
    if isinstance(v, dict):
        t = v.get("type") or ("message" if "role" in v else None)
    else:
        t = getattr(v, "type", None)
    return t if isinstance(t, str) and t in _ITEMS else "other"


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[ToolSearchCallItem, Tag("tool_search_call")]
    | Annotated[ToolSearchOutputItem, Tag("tool_search_output")]
    | Annotated[AdditionalToolsItem, Tag("additional_tools")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_tag),
]


class ResponsesTool(OpenModel):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    format: dict[str, Any] | None = None  # custom tools
    tools: list[dict[str, Any]] | None = None  # namespace groups
    # The openai SDK's beta ``FunctionTool.async``: the function runs in the background.
    async_: StrictBool | None = Field(None, alias="async")
    execution: str | None = None  # tool_search: "client" or "server"
    defer_loading: bool | None = None  # loaded by a tool search, not offered up front


class ReasoningConfig(OpenModel):
    effort: str | None = None
    summary: str | None = None


# What a Responses ``include`` may name (OpenAI's list; only the reasoning's encrypted
# content and the text's logprobs add anything here).
Includable = Literal[
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]


class ResponsesRequest(OpenModel):
    """Body of ``POST /v1/responses`` (unknown fields tolerated)."""

    model: str = ""
    input: str | list[Item]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[Includable] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    parallel_tool_calls: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    # Refused when true (`_prepare`): a background response is fetched later by id, and
    # this server stores none.
    background: StrictBool | None = None
    # OpenAI counts only its built-in (hosted) tools' calls against it; none run here.
    max_tool_calls: int | None = Field(None, ge=1)

    refused: ClassVar[dict[str, str]] = {
        "prompt": "stored prompts are not supported: this server keeps no prompt "
        "templates; send their instructions and input themselves",
        "max_tokens": "not a Responses parameter: use max_output_tokens",
        "max_completion_tokens": "not a Responses parameter: use max_output_tokens",
        "response_format": "not a Responses parameter: use text.format",
        "logprobs": "not a Responses parameter: use top_logprobs with include "
        '["message.output_text.logprobs"]',
        **dict.fromkeys(
            ("stop", "logit_bias", "frequency_penalty", "presence_penalty", "n"),
            "not a Responses parameter (Chat Completions has it)",
        ),
    }


# --------------------------------------------------------------------------- mapping


@dataclass
class ToolKind:
    """How a tool the model may call is reported back in a Responses stream.

    ``kind`` is ``"function"`` (item ``function_call``, JSON ``arguments``),
    ``"custom"`` (item ``custom_tool_call``, free-form ``input``; offered to the model
    as a function with one string parameter ``input``) or ``"tool_search"`` (item
    ``tool_search_call``, its ``arguments`` an object; the client runs the search).
    ``namespace`` is the ``namespace`` tool group the function was declared in, or None.
    """

    kind: str
    namespace: str | None = None


CUSTOM_INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "the raw tool input"}},
    "required": ["input"],
}

# The function a client-run ``tool_search`` tool is offered as (its name, and the
# description and schema when the client sends none).
TOOL_SEARCH = "tool_search"
TOOL_SEARCH_DESCRIPTION = "Search the deferred tools; the matching ones can be called next."
TOOL_SEARCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "description": "what the tools should do"},
        "limit": {"type": "integer", "description": "most tools to load"},
    },
    "required": ["query"],
}


def _search_tool(tools: list[ResponsesTool] | None) -> ResponsesTool | None:
    """The ``tool_search`` tool the client runs (``execution`` other than ``server``),
    or None. A hosted (server-run) search is not offered: this server runs none."""
    for t in tools or []:
        if t.type == "tool_search" and t.execution != "server":
            return t
    return None


def tool_kinds(tools: list[ResponsesTool] | None) -> dict[str, ToolKind]:
    """Callable tools of a request by name; hosted tool types are left out."""
    out: dict[str, ToolKind] = {}
    for t in tools or []:
        if t.type in ("function", "custom"):
            out[t.name or ""] = ToolKind(t.type)
        elif t.type == "namespace":
            for sub in t.tools or []:
                kind = sub.get("type", "function")
                if kind in ("function", "custom"):
                    out[sub.get("name") or ""] = ToolKind(kind, t.name)
    if _search_tool(tools) is not None:
        out[TOOL_SEARCH] = ToolKind("tool_search")
    return out


def _custom_spec(t: ResponsesTool) -> ToolSpec:
    desc = t.description or ""
    fmt = t.format or {}
    if fmt.get("type") == "grammar" and fmt.get("definition"):
        desc += (
            f"\n\nThe input must follow this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
        )
    return ToolSpec(name=t.name or "", description=desc, parameters=CUSTOM_INPUT_SCHEMA)


def _namespace_specs(t: ResponsesTool, deferring: bool, where: str) -> list[ToolSpec]:
    """The function and custom tools of a ``namespace`` group (Codex puts its freeform
    ``exec`` in one), each described with the group's description; ``where``: the
    group's wire path.

    Raises:
        WireError: a custom tool that is not a tool definition (its path named).
    """
    ns_desc = t.description or ""
    specs = []
    for j, sub in enumerate(t.tools or []):
        kind = sub.get("type", "function")
        if kind not in ("function", "custom") or (deferring and sub.get("defer_loading")):
            continue
        if kind == "custom":
            try:
                custom = ResponsesTool.model_validate(sub)
            except ValidationError as e:
                loc = ".".join(str(p) for p in e.errors()[0]["loc"])
                path = f"{where}.tools.{j}.{loc}"
                raise WireError(f"{path}: {e.errors()[0]['msg']}", path) from None
            if not custom.name:
                raise WireError(
                    f"{where}.tools.{j}.name: required for a custom tool", f"{where}.tools.{j}.name"
                )
            spec = _custom_spec(custom)
        else:
            spec = ToolSpec(
                name=sub.get("name") or "",
                description=sub.get("description") or "",
                parameters=sub.get("parameters") or empty_schema(),
            )
        if ns_desc:
            spec = dataclasses.replace(
                spec, description=f"{spec.description}\n({t.name}: {ns_desc})"
            )
        specs.append(spec)
    return specs


# The tool types a request declares for the model (the rest are hosted types).
_CALLABLE_TYPES = ("function", "custom", "namespace")


def tool_specs(tools: list[ResponsesTool] | None, *, loaded: bool = False) -> list[ToolSpec]:
    """The tools offered to the model.

    Hosted tools (web_search, file_search, code_interpreter, image_generation, mcp,
    computer_use, local_shell, a server-run tool_search…) are accepted and not offered.
    With a client-run ``tool_search`` tool, it is offered as the function
    `TOOL_SEARCH` and tools marked ``defer_loading`` are not: the client's search loads
    them (``tool_search_output``). ``loaded``: ``tools`` are such a search's output
    (nothing in them is deferred).

    Raises:
        WireError: a function or custom tool without a name.
    """
    specs: list[ToolSpec] = []
    search = None if loaded else _search_tool(tools)
    note_unoffered(t.type for t in tools or [] if t.type not in _CALLABLE_TYPES and t is not search)
    for i, t in enumerate(tools or []):
        if t.type in ("function", "custom") and not t.name:
            raise WireError(f"tools[{i}].name: required for a {t.type} tool", f"tools.{i}.name")
        if search is not None and t.defer_loading:
            continue
        if t.type == "function":
            specs.append(
                ToolSpec(
                    name=t.name or "",
                    description=t.description or "",
                    parameters=t.parameters or empty_schema(),
                    background=bool(t.async_),
                )
            )
        elif t.type == "custom":
            specs.append(_custom_spec(t))
        elif t.type == "namespace":
            specs.extend(_namespace_specs(t, search is not None, f"tools.{i}"))
        elif t is search:
            specs.append(
                ToolSpec(
                    name=TOOL_SEARCH,
                    description=t.description or TOOL_SEARCH_DESCRIPTION,
                    parameters=t.parameters or TOOL_SEARCH_SCHEMA,
                )
            )
    return specs


def loaded_tools(it: ToolSearchOutputItem, i: int) -> list[ResponsesTool]:
    """The tool definitions a ``tool_search_output`` item (input item ``i``) loaded.

    Raises:
        WireError: a definition that is not a tool object.
    """
    try:
        return [ResponsesTool.model_validate(t) for t in it.tools]
    except ValidationError as e:
        where = ".".join(str(p) for p in e.errors()[0]["loc"])
        raise WireError(
            f"input[{i}].tools: not a tool definition ({where})", f"input.{i}.tools"
        ) from None


def search_result_text(tools: list[ToolSpec]) -> str:
    """A tool search's result as the model reads it: the loaded tools' schemas, one JSON
    line each, exactly as the tools section writes them."""
    return "\n".join(to_json(tool_schema_dict(t)) for t in tools)


class _Turns:
    """The messages of an input item list. An assistant turn stays open (later
    assistant-side items join it) until a user or tool item arrives."""

    def __init__(self, decode_reasoning: Callable[[str], str | None] | None):
        self.decode_reasoning = decode_reasoning
        self.msgs: list[Message] = []
        self.system: list[str] = []  # instructions + leading system/developer items
        self.late: list[str] = []  # system/developer items met after the conversation began
        self.open = False
        self.loaded: list[ToolSpec] = []  # tools loaded by tool_search_output items
        self.search_id: str | None = None  # the last tool_search_call's call id

    def _assistant(self, fresh: bool = False) -> Message:
        if self.open and not fresh and self.msgs and self.msgs[-1].role == "assistant":
            return self.msgs[-1]
        self.msgs.append(Message(role="assistant"))
        self.open = True
        return self.msgs[-1]

    def _other(self, m: Message) -> None:
        self.open = False
        self.msgs.append(m)

    def message(self, it: MessageItem) -> None:
        text = parts_text(it.content)
        if it.role in ("system", "developer"):
            if self.msgs:
                self.open = False  # a reminder after an assistant turn closes it
                system_in_conversation(self.msgs, self.late, text)
            else:
                self.system.append(text)
        elif it.role == "user":
            self._other(Message(role="user", content=text))
        else:
            m = self._assistant()
            # Text after a call starts a new turn: DSML puts content before calls.
            m = self._assistant(fresh=True) if m.tool_calls else m
            m.content += text

    def reasoning(self, it: ReasoningItem) -> None:
        m = self._assistant()
        if m.content or m.tool_calls:
            m = self._assistant(fresh=True)
        text = None
        if it.encrypted_content and self.decode_reasoning is not None:
            text = self.decode_reasoning(it.encrypted_content)
        if text is None:
            texts = [c.text or "" for c in it.content or []]
            text = "".join(texts) if texts else None
        if text is not None:
            m.reasoning = (m.reasoning or "") + text

    def call(self, it: FunctionCallItem | CustomToolCallItem) -> None:
        if isinstance(it, FunctionCallItem):
            args = json_object(it.arguments)
        else:
            args = {"input": it.input}
        self._assistant().tool_calls.append(ToolCall(id=it.call_id, name=it.name, arguments=args))

    def output(self, it: FunctionCallOutputItem | CustomToolCallOutputItem) -> None:
        self._other(Message(role="tool", tool_call_id=it.call_id, content=parts_text(it.output)))

    def search_call(self, it: ToolSearchCallItem, i: int) -> None:
        """A tool search the model started: a call of the `TOOL_SEARCH` function (a
        server-run one without a call id is named by its item id or position)."""
        self.search_id = it.call_id or it.id or f"tool_search_{i}"
        args = it.arguments if isinstance(it.arguments, dict) else json_object(it.arguments)
        call = ToolCall(id=self.search_id, name=TOOL_SEARCH, arguments=args)
        self._assistant().tool_calls.append(call)

    def search_output(self, it: ToolSearchOutputItem, i: int) -> None:
        """The tools a search loaded: its tool result (their schemas), and callable."""
        tools = tool_specs(loaded_tools(it, i), loaded=True)
        self.loaded.extend(tools)
        call_id = it.call_id or self.search_id or it.id or f"tool_search_{i}"
        self._other(Message(role="tool", tool_call_id=call_id, content=search_result_text(tools)))


def _add_item(turns: _Turns, i: int, it: Any) -> None:
    if isinstance(it, MessageItem):
        turns.message(it)
    elif isinstance(it, ReasoningItem):
        turns.reasoning(it)
    elif isinstance(it, FunctionCallItem | CustomToolCallItem):
        turns.call(it)
    elif isinstance(it, FunctionCallOutputItem | CustomToolCallOutputItem):
        turns.output(it)
    elif isinstance(it, ToolSearchCallItem):
        turns.search_call(it, i)
    elif isinstance(it, ToolSearchOutputItem):
        turns.search_output(it, i)
    elif it.type == "item_reference":
        # `routes.items` resolved every reference to an item this server still holds.
        raise WireError(
            f"item_reference {getattr(it, 'id', None)!r} is not an item this server answered "
            "recently (it keeps no response store, only its latest output items); send "
            "the full input items (store: false)",
            f"input[{i}]",
        )
    # Other item types (web_search_call, compaction, local_shell_call…) describe
    # hosted actions this server never performs; they carry nothing to render.


def to_conversation(
    req: ResponsesRequest,
    *,
    default_thinking: bool = True,
    decode_reasoning: Callable[[str], str | None] | None = None,
) -> Conversation:
    """Map a validated Responses request onto a `Conversation`.

    A reasoning item's text comes from ``decode_reasoning(encrypted_content)`` (the
    server's integrity-checked carrier; None when it does not verify) or its
    ``content`` reasoning text.

    Raises:
        WireError: ``item_reference`` items (no server-side store), an unnamed
            function/custom tool, an invalid ``tool_choice``.
    """
    turns = _Turns(decode_reasoning)
    turns.system.append(req.instructions or "")
    items = (
        [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    )
    for i, it in enumerate(items):
        _add_item(turns, i, it)
    thinking = default_thinking
    forced, effort = effort_to_reasoning(
        req.reasoning.effort if req.reasoning else None, "reasoning.effort"
    )
    if forced is not None:
        thinking = forced
    tools = [] if req.tool_choice == "none" else unique_names(tool_specs(req.tools))
    allowed = allowed_names(req.tool_choice, tools, lambda c: c.get("tools"))
    required, name = openai_tool_choice(
        req.tool_choice,
        tools,
        named_types=("function", "custom"),
        name_field="name",
        mode_of=lambda c: c.get("mode"),
    )
    return Conversation(
        messages=hoisted_system(turns.msgs, turns.system),
        late_system=late_system(turns.late),
        tools=tools,
        loaded_tools=[] if req.tool_choice == "none" else turns.loaded,
        thinking=thinking,
        reasoning_effort=effort if thinking else None,
        tool_required=required,
        tool_name=name,
        tool_none=req.tool_choice == "none",
        single_call=req.parallel_tool_calls is False,
        open_reply=True,
        allowed_tools=allowed,
    )


def _loaded_kinds(req: ResponsesRequest) -> dict[str, ToolKind]:
    """How the tools that ``tool_search_output`` input items loaded are reported."""
    out: dict[str, ToolKind] = {}
    if isinstance(req.input, list):
        for i, it in enumerate(req.input):
            if isinstance(it, ToolSearchOutputItem):
                out.update(tool_kinds(loaded_tools(it, i)))
    return out


# --------------------------------------------------------------------------- preparing a job


@dataclass
class _Prepared:
    """A validated request, its input items as sent (dicts, a previous response's
    prepended), the job to submit, and the body as the client sent it (``data``: the
    settings a steered response's successor inherits)."""

    req: ResponsesRequest
    items: list[Any]
    gen: GenRequest
    data: dict[str, Any]


def hoist_tools(req: ResponsesRequest) -> ResponsesRequest:
    """``req`` with the tools of its ``additional_tools`` input items (`AdditionalToolsItem`,
    a replayed history's too) added to ``tools`` and those items taken out of ``input``.
    A tool already offered (same type and name) is kept once, the first declaration."""
    if isinstance(req.input, str) or not any(
        isinstance(it, AdditionalToolsItem) for it in req.input
    ):
        return req
    tools = list(req.tools or [])
    seen = {(t.type, t.name) for t in tools}
    for it in req.input:
        for t in it.tools if isinstance(it, AdditionalToolsItem) else ():
            if (t.type, t.name) not in seen:
                seen.add((t.type, t.name))
                tools.append(t)
    rest = [it for it in req.input if not isinstance(it, AdditionalToolsItem)]
    return req.model_copy(update={"tools": tools, "input": rest})


def _raw_items(inp: Any) -> list[Any]:
    return (
        [{"type": "message", "role": "user", "content": inp}] if isinstance(inp, str) else list(inp)
    )


def _resolve_previous(data: dict[str, Any], req: ResponsesRequest, store) -> dict[str, Any]:
    """``data`` with the items of the stored response ``previous_response_id`` names
    prepended (WebSocket connections only).

    Raises:
        APIError: 400 ``previous_response_not_found`` when no such response is stored.
    """
    prev = store.get(req.previous_response_id) if store is not None else None
    if prev is None and store is not None:
        raise APIError(
            400,
            f"previous_response_id {req.previous_response_id!r} is not this connection's "
            "latest response, the only one it keeps; send the full history in input",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if prev is None:
        raise APIError(
            400,
            f"previous_response_id {req.previous_response_id!r} is not supported: this server keeps "
            "no response store over HTTP; send the full history in input with store: false",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return {**data, "input": prev + _raw_items(data["input"])}


def _prepare(
    data: Any,
    *,
    path: str,
    store: dict[str, list[Any]] | None = None,
    headers=None,
    key: str = "",
) -> _Prepared:
    """Validate a Responses body and build its `GenRequest` (off the event loop; raises
    `APIError`).

    ``store`` is a WebSocket connection's own responses (id → full item list); with it,
    ``previous_response_id`` naming one of them is resolved by prepending its items.
    ``headers``: the conversation headers (`state_key`), with the body's
    ``prompt_cache_key`` naming the request's resident state. ``key``: the API key's
    `key_salt`, with the body's ``cache_salt`` the request's cache salt (`cache_salt`).
    """
    data = resolve_references(data, item_memory()) if isinstance(data, dict) else data
    req = validate(ResponsesRequest, data)
    sent = dict(data)
    if req.conversation is not None:
        raise APIError(
            400,
            "conversation is not supported: this server keeps no conversation store; "
            "send the full history in input",
            param="conversation",
        )
    if req.previous_response_id is not None:
        data = _resolve_previous(data, req, store)
        req = validate(ResponsesRequest, data)
    req = hoist_tools(req)
    if req.background:
        raise APIError(
            400,
            "background: not supported: a background response is fetched later by id, and "
            "this server stores no responses; send it with background: false",
            param="background",
        )
    if not req.input:
        raise APIError(400, "input: must not be empty", param="input")
    try:
        conv = demo_policy(
            to_conversation(
                req, default_thinking=model_thinking(req.model), decode_reasoning=carrier().open
            )
        )
    except WireError as e:
        raise APIError(400, e.message, param=e.param) from None
    if not any(m.role in ("user", "tool") for m in conv.messages):
        raise APIError(400, "input: needs at least one user message or tool output", param="input")
    if req.truncation == "auto":
        conv = drop_oldest_turns(conv)
    sampling = sampling_params(conv.thinking, req)
    # Logprobs cost a top-k per token: computed only when the include asks for them.
    want_lps = LOGPROBS_INCLUDE in (req.include or [])
    gen = prepare(
        conv,
        NAMES,
        path=path,
        max_tokens=req.max_output_tokens,
        sampling=sampling,
        id_prefix="call_",
        top_logprobs=(req.top_logprobs or 0) if want_lps else None,
        state_key=state_key(headers, (req.model_extra or {}).get("prompt_cache_key")),
        salt=cache_salt((req.model_extra or {}).get("cache_salt"), key),
        constraint=constraints.read(constraints.responses_constraint, req),
        show_format=True,
    )
    return _Prepared(req, _raw_items(data["input"]), gen, sent)


# --------------------------------------------------------------------------- encoder


def _usage(d: JobDone) -> dict[str, Any]:
    return {
        "input_tokens": d.prompt_tokens,
        "input_tokens_details": {"cached_tokens": d.cached_tokens},
        "output_tokens": d.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": d.reasoning_tokens},
        "total_tokens": d.prompt_tokens + d.completion_tokens,
    }


def _output_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


class _TextLogprobs:
    """The logprob entries (`logprob_entries`) of the message text being streamed: the
    engine sends a token's `TokenLogprob` before the text it completes (its text may be
    held back across tokens), so entries wait for the next text delta; the message's
    whole list goes on its ``output_text.done`` and its content part. ``tokenizer``: ids
    → texts and bytes (needed only when logprobs were asked for)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.pending: list[TokenLogprob] = []
        self.part: list[dict[str, Any]] = []

    def add(self, e: TokenLogprob) -> list[dict[str, Any]]:
        self.pending.append(e)
        return []  # no event of its own

    def delta(self) -> list[dict[str, Any]]:
        """The entries the next ``output_text.delta`` carries."""
        out = logprob_entries(self.pending, self.tokenizer) if self.pending else []
        self.pending = []
        self.part += out
        return out

    def close(self) -> list[dict[str, Any]]:
        """All the ended message's entries (those still held back included)."""
        self.delta()
        out, self.part = self.part, []
        return out


def _echo_text(req: ResponsesRequest) -> dict[str, Any]:
    """The response's ``text`` field: the request's ``text`` (its ``format`` included,
    as the Responses API echoes it), else the plain-text default."""
    text = (req.model_extra or {}).get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict):
        return text
    return {"format": {"type": "text"}}


def _echo_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The response's ``tools``: as the client spelled them (``async``, not the Python
    name ``async_``), without nulls for fields it did not send."""
    return [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools or []]


def _response_object(req: ResponsesRequest, model: str, sampling: SamplingParams) -> dict[str, Any]:
    """The response object of ``req`` before its output (``in_progress``): the request's
    settings as they served it (``sampling``: what drew the reply)."""
    return {
        "id": new_id("resp_"),
        "object": "response",
        "created_at": now(),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls
        if req.parallel_tool_calls is not None
        else True,
        "previous_response_id": req.previous_response_id,
        "reasoning": {
            "effort": req.reasoning.effort if req.reasoning else None,
            "summary": None,
        },
        # Nothing is kept past the connection: a stored response could be fetched.
        "store": False,
        # What sampled the reply (thinking mode samples at DeepSeek's settings,
        # whatever the request asked).
        "temperature": sampling.temperature,
        "text": _echo_text(req),
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": _echo_tools(req),
        "top_p": sampling.top_p,
        "truncation": req.truncation or "disabled",
        "max_tool_calls": req.max_tool_calls,
        "usage": None,
        "metadata": req.metadata or {},
    }


class ResponseEncoder:
    """Job events → Responses stream events, and the response object (`result`).

    The same events serve SSE (`frame`), the WebSocket (one JSON text frame each) and,
    fed at once, the non-streaming body. A function call cut by the end of the turn
    ends its item ``incomplete`` (no ``function_call_arguments.done``) and is dropped
    from the final response; a custom tool call is reported once it ends, whole.
    """

    def __init__(
        self,
        req: ResponsesRequest,
        model: str,
        carrier,
        tokenizer,
        sampling: SamplingParams,
        items: ItemMemory | None = None,
    ):
        self.carrier = carrier
        self.items = items  # where the output items are remembered (`routes.items`)
        self.lps = _TextLogprobs(tokenizer)
        self.include_encrypted = "reasoning.encrypted_content" in (req.include or [])
        self.kinds = {**_loaded_kinds(req), **tool_kinds(req.tools)}
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text: list[str] = []
        self.custom: dict[int, dict[str, Any]] = {}
        self.response = _response_object(req, model, sampling)
        self._feed = {
            ThinkingDelta: self._thinking,
            TextDelta: self._text,
            ToolCallStart: self._tool_start,
            ToolCallArgsDelta: self._tool_args,
            ToolCallEnd: self._tool_end,
            TokenLogprob: self.lps.add,
        }

    def _ev(self, typ: str, **fields: Any) -> dict[str, Any]:
        d = {"type": typ, "sequence_number": self.seq, **fields}
        self.seq += 1
        return d

    def result(self) -> dict[str, Any]:
        """The response object as it stands (the final one after `done`/`failed`)."""
        return {**self.response, "output": list(self.output)}

    def frame(self, ev: dict[str, Any]) -> bytes:
        return sse(ev, ev["type"])

    def opening(self) -> list[dict[str, Any]]:
        return [self._ev("response.created", response=self.result())]

    def idle(self) -> dict[str, Any]:
        # Codex's idle timer counts events, not comments: send in_progress.
        return self._ev("response.in_progress", response=self.result())

    def started(self, e: JobStarted) -> list[dict[str, Any]]:
        return [self.idle()]

    # ---- items

    def _index(self) -> int:
        return len(self.output) - 1

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self.open = item
        return [self._ev("response.output_item.added", output_index=self._index(), item=dict(item))]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the open item: its ``.done`` events. ``status``: a message's or reasoning
        item's (``incomplete`` when the end of the response cut it)."""
        item, self.open = self.open, None
        if item is None:
            return []
        idx = self.output.index(item)
        text = "".join(self.text)
        self.text = []
        ids = {"item_id": item["id"], "output_index": idx, "content_index": 0}
        out: list[dict[str, Any]] = []
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            item["status"] = status
            if self.include_encrypted:
                item["encrypted_content"] = self.carrier.seal(text)
            out.append(self._ev("response.reasoning_text.done", **ids, text=text))
            part = {"type": "reasoning_text", "text": text}
            out.append(self._ev("response.content_part.done", **ids, part=part))
        elif item["type"] == "message":
            lps = self.lps.close()
            part = _output_part(text, lps)
            item["content"] = [part]
            item["status"] = status
            out.append(self._ev("response.output_text.done", **ids, text=text, logprobs=lps))
            out.append(self._ev("response.content_part.done", **ids, part=part))
        out.append(self._ev("response.output_item.done", output_index=idx, item=dict(item)))
        return out

    def _thinking(self, e: ThinkingDelta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != "reasoning":
            out = self._close()
            out += self._add({"id": new_id("rs_"), "type": "reasoning", "summary": []})
            # Its reasoning_text part is opened as a message's output_text part is:
            # clients that build the response from the events (openai-node's
            # accumulator) write each delta into a part this event added.
            ids = {"item_id": self.open["id"], "output_index": self._index(), "content_index": 0}
            part = {"type": "reasoning_text", "text": ""}
            out.append(self._ev("response.content_part.added", **ids, part=part))
        self.text.append(e.text)
        if e.text:
            ids = {"item_id": self.open["id"], "output_index": self._index(), "content_index": 0}
            out.append(self._ev("response.reasoning_text.delta", **ids, delta=e.text))
        return out

    def _text(self, e: TextDelta) -> list[dict[str, Any]]:
        if not e.text:
            return []
        out: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != "message":
            out = self._close()
            item = {
                "id": new_id("msg_"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            out += self._add(item)
            ids = {"item_id": item["id"], "output_index": self._index(), "content_index": 0}
            out.append(self._ev("response.content_part.added", **ids, part=_output_part("")))
        self.text.append(e.text)
        ids = {"item_id": self.open["id"], "output_index": self._index(), "content_index": 0}
        lps = self.lps.delta()
        out.append(self._ev("response.output_text.delta", **ids, delta=e.text, logprobs=lps))
        return out

    def _tool_start(self, e: ToolCallStart) -> list[dict[str, Any]]:
        out = self._close()
        kind = self.kinds.get(e.name) or ToolKind("function")
        if kind.kind in ("custom", "tool_search"):
            # Free-form input is the "input" argument, a search's arguments an object:
            # both are known once the call ends.
            self.custom[e.index] = {
                "name": e.name,
                "id": e.id,
                "kind": kind.kind,
                "namespace": kind.namespace,
            }
            return out
        item = {
            "id": new_id("fc_"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": e.id,
            "name": e.name,
            "arguments": "",
        }
        if kind.namespace:
            item["namespace"] = kind.namespace
        return out + self._add(item)

    def _open_call(self) -> dict[str, Any] | None:
        return self.open if self.open is not None and self.open["type"] == "function_call" else None

    def _tool_args(self, e: ToolCallArgsDelta) -> list[dict[str, Any]]:
        item = self._open_call()
        if item is None or not e.text:
            return []
        item["arguments"] += e.text
        ev = self._ev(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=self._index(),
            delta=e.text,
        )
        return [ev]

    def _tool_end(self, e: ToolCallEnd) -> list[dict[str, Any]]:
        if e.index in self.custom:
            return self._custom_call(self.custom.pop(e.index), e)
        item = self._open_call()
        if item is None:
            return []
        if not e.closed:
            # Cut by the end of the turn: never a runnable call. Streamed clients see the
            # item end as incomplete, its arguments unterminated; the final response
            # leaves it out (`done`).
            item["status"] = "incomplete"
            return self._close()
        item["arguments"] = e.arguments_json
        item["status"] = "completed"
        ev = self._ev(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=self._index(),
            name=item["name"],
            arguments=e.arguments_json,
        )
        return [ev, *self._close()]

    def _custom_call(self, info: dict[str, Any], e: ToolCallEnd) -> list[dict[str, Any]]:
        if not e.closed:
            return []  # cut by the end of the turn: never shown as a call
        if info["kind"] == "tool_search":
            return self._search_call(info, e)
        args = e.call.arguments
        # The tool's one string parameter, whatever the model named it (``input``, ``patch``).
        raw = args.get("input", next(iter(args.values())) if len(args) == 1 else None)
        text = raw if isinstance(raw, str) else e.arguments_json
        item = {
            "id": new_id("ctc_"),
            "type": "custom_tool_call",
            "status": "in_progress",
            "call_id": info["id"],
            "name": info["name"],
            "input": "",
        }
        if info.get("namespace"):
            item["namespace"] = info["namespace"]
        out = self._add(item)
        ids = {"item_id": item["id"], "output_index": self._index()}
        out.append(self._ev("response.custom_tool_call_input.delta", **ids, delta=text))
        out.append(self._ev("response.custom_tool_call_input.done", **ids, input=text))
        item["input"] = text
        item["status"] = "completed"
        return out + self._close()

    def _search_call(self, info: dict[str, Any], e: ToolCallEnd) -> list[dict[str, Any]]:
        """A search the model started: a ``tool_search_call`` item the client runs
        (``ResponseToolSearchCall``), answered by a ``tool_search_output`` with its
        ``call_id``."""
        item = {
            "id": new_id("tsc_"),
            "type": "tool_search_call",
            "status": "in_progress",
            "call_id": info["id"],
            "arguments": e.call.arguments,
            "execution": "client",
        }
        out = self._add(item)
        item["status"] = "completed"
        return out + self._close()

    def feed(self, e: Any) -> list[dict[str, Any]]:
        """Stream events for one job event (empty for events with no wire form)."""
        handler = self._feed.get(type(e))
        return handler(e) if handler is not None else []

    # ---- the end

    def done(self, d: JobDone) -> list[dict[str, Any]]:
        # A message the end cut (a cancel, the output limit, a steer) is incomplete, as
        # its response is; one that ended on its own (EOS, a stop, a call) is complete.
        cut = d.finish in ("cancelled", "length", "context", "steered")
        out = self._close("incomplete" if cut else "completed")
        self.output[:] = [
            it
            for it in self.output
            if not (it["type"] == "function_call" and it["status"] == "incomplete")
        ]
        self.response["usage"] = _usage(d)
        if self.items is not None:  # a later request may name them by item_reference
            self.items.put_all(self.output)
        if d.finish == "cancelled":  # a client's cancel (or a shutdown), not a failure
            self.response["status"] = "cancelled"
            return [*out, self._ev("response.incomplete", response=self.result())]
        calls = any(it["type"] in ("function_call", "custom_tool_call") for it in self.output)
        reason = {"length": "max_output_tokens", "context": "max_output_tokens"}.get(d.finish)
        if d.finish == "steered" and not calls:
            reason = "steered"  # a steered turn with calls waits for their results
        if reason is not None:  # Responses has no context-full reason
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": reason}
            return [*out, self._ev("response.incomplete", response=self.result())]
        self.response["status"] = "completed"
        return [*out, self._ev("response.completed", response=self.result())]

    def failed(self, f: JobFailed) -> list[dict[str, Any]]:
        out = self._close()
        err = failed_to_api(f, NAMES)
        self.response["status"] = "failed"
        self.response["error"] = {
            "code": err.code or ("server_error" if err.status >= 500 else "invalid_request"),
            "message": err.message,
            **err.fields,
        }
        return [*out, self._ev("response.failed", response=self.result())]


# --------------------------------------------------------------------------- HTTP


def _encoder(prep: _Prepared) -> ResponseEncoder:
    st = state()
    return ResponseEncoder(
        prep.req,
        prep.req.model or st.config.model_name,
        carrier(),
        st.tokenizer,
        sampling=prep.gen.turn.sampling,
        items=item_memory(),
    )


@bp.post("/v1/responses")
async def create_response():
    """Create a response (SSE when ``stream`` is true, else the response object)."""
    headers = {h: request.headers.get(h) for h in STATE_HEADERS}
    prep = await offload(
        _http_request, await read_body(), request.path, headers, key_salt(request.headers)
    )
    job = state().submit(prep.gen)
    enc = _encoder(prep)
    if prep.req.stream:
        return await stream(job, enc, NAMES)
    return json_response(await respond(job, enc, NAMES))


def _http_request(raw: bytes, path: str, headers, key: str = "") -> _Prepared:
    return _prepare(parse_json(raw), path=path, headers=headers, key=key)


@bp.post("/v1/responses/input_tokens")
async def count_input_tokens():
    """``{"object": "response.input_tokens", "input_tokens": n}``: the input tokens the
    same body to ``/v1/responses`` would be charged now (openai's
    ``responses.input_tokens.count``), answered by the prompt cache's read-only query
    (``ServerState.charged``): no job is queued, so it answers while a generation runs."""
    headers = {h: request.headers.get(h) for h in STATE_HEADERS}
    n = await offload(_count, await read_body(), headers, key_salt(request.headers))
    return json_response({"object": "response.input_tokens", "input_tokens": n})


def _count(raw: bytes, headers, key: str = "") -> int:
    prep = _prepare(parse_json(raw), path="/v1/responses", headers=headers, key=key)
    return state().charged(prep.gen)


@bp.get("/v1/responses/<path:response_id>")
async def get_response(response_id: str):
    raise APIError(
        404,
        f"response {response_id!r} not found: this server does not store responses (use store: false and resend input)",
        type="invalid_request_error",
        code="not_found",
    )
