"""OpenAI Responses API: ``POST /v1/responses`` (SSE or JSON) and its WebSocket transport.

Reference: https://platform.openai.com/docs/api-reference/responses/create and the
streaming events https://platform.openai.com/docs/api-reference/responses-streaming:
``response.created`` → ``response.in_progress`` → per output item
``response.output_item.added`` … ``response.output_item.done`` (reasoning:
``response.reasoning_text.delta/done``; message: ``response.content_part.added``,
``response.output_text.delta/done``, ``response.content_part.done``; function call:
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

``previous_response_id`` and ``conversation`` need a response store: over HTTP they
are rejected with a clear 400. On the WebSocket transport (``GET /v1/responses``
upgrade, one JSON event per text frame, as Codex's ``responses_websockets`` client
speaks it) the connection keeps its own responses, so a ``response.create`` that
continues the previous response of the same connection by id is served.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag
from quart import Blueprint, request, websocket

from ds4mlx.dsml import (
    ParseError,
    TextDelta,
    ThinkingDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    wire,
)
from ds4mlx.routes.common import (
    SSE_COMMENT,
    APIError,
    Keepalive,
    OpenModel,
    check_auth,
    check_tool_results,
    clamp_max_tokens,
    collect,
    context_check,
    demo_cap_ends_turn,
    demo_policy,
    failed_to_api,
    guard,
    json_response,
    model_thinking,
    new_id,
    now,
    read_json,
    render,
    sampling_params,
    sse,
    sse_response,
    state,
    tokenize,
    validate,
)
from ds4mlx.server.jobs import GenRequest, JobDone, JobFailed, JobStarted, PrefillProgress

bp = Blueprint("responses", __name__)


# --------------------------------------------------------------------------- schemas


class InputPart(OpenModel):
    type: str
    text: str | None = None


class MessageItem(OpenModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]


class FunctionCallItem(OpenModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = ""


class FunctionCallOutputItem(OpenModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]] | None = None


class CustomToolCallItem(OpenModel):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str = ""


class CustomToolCallOutputItem(OpenModel):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: str | list[dict[str, Any]] | None = None


class ReasoningItem(OpenModel):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


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
}


def _item_tag(v: Any) -> str:
    if isinstance(v, dict):
        t = v.get("type") or ("message" if "role" in v else None)
    else:
        t = getattr(v, "type", None)
    return t if t in _ITEMS else "other"


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
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


class ReasoningConfig(OpenModel):
    effort: str | None = None
    summary: str | None = None


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
    include: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None


# --------------------------------------------------------------------------- preparing a job


class _Prepared:
    def __init__(self, req: ResponsesRequest, body: dict[str, Any], gen: GenRequest, conv):
        self.req = req
        self.body = body
        self.gen = gen
        self.conv = conv


async def _prepare(
    data: Any, *, path: str, store: dict[str, list[dict[str, Any]]] | None = None
) -> _Prepared:
    """Validate a Responses body and build its `GenRequest` (raises `APIError`).

    ``store`` is a WebSocket connection's own responses (id → full item list); with it,
    ``previous_response_id`` naming one of them is resolved by prepending its items.
    """
    req, body = validate(ResponsesRequest, data)
    st = state()
    if req.conversation is not None:
        raise APIError(
            400,
            "conversation is not supported: this server keeps no conversation store; "
            "send the full history in input",
            param="conversation",
        )
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id) if store is not None else None
        if prev is None:
            raise APIError(
                400,
                f"previous_response_id {req.previous_response_id!r} is not supported: this server keeps "
                "no response store over HTTP; send the full history in input with store: false",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        items = (
            body["input"]
            if isinstance(body["input"], list)
            else [{"type": "message", "role": "user", "content": body["input"]}]
        )
        body["input"] = prev + items
        body["previous_response_id"] = None
    if not body.get("input"):
        raise APIError(400, "input: must not be empty", param="input")
    try:
        conv = wire.responses_to_conversation(
            body,
            default_thinking=model_thinking(req.model),
            decode_reasoning=st.carrier.open,
        )
    except wire.WireError as e:
        raise APIError(400, e.message, param=e.param) from None
    demo_policy(conv)
    if not any(m.role in ("user", "tool") for m in conv.messages):
        raise APIError(400, "input: needs at least one user message or tool output", param="input")
    check_tool_results(conv, "responses")
    text = render(conv)
    toks = await tokenize(text)
    context_check(len(toks), "input")
    gen = GenRequest(
        path=path,
        prompt_tokens=toks,
        prompt_text=text,
        sampling=sampling_params(
            conv.thinking,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
        ),
        max_tokens=clamp_max_tokens(req.max_output_tokens, len(toks)),
        cap_is_eos=demo_cap_ends_turn(req.max_output_tokens, len(toks)),
        thinking=conv.thinking,
        tools=conv.tools,
        id_prefix="call_",
        conversation=conv,
        protocol="responses",
        tool_required=conv.tool_required,
        tool_name=conv.tool_name,
    )
    return _Prepared(req, body, gen, conv)


# --------------------------------------------------------------------------- event builder


class _Builder:
    """Turns worker events into Responses stream events and the final response object."""

    def __init__(self, prep: _Prepared):
        st = state()
        req = prep.req
        self.carrier = st.carrier
        self.include_encrypted = "reasoning.encrypted_content" in (req.include or [])
        self.kinds = wire.responses_tool_kinds(prep.body.get("tools"))
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text: list[str] = []
        self.custom: dict[int, dict[str, Any]] = {}
        self.response: dict[str, Any] = {
            "id": new_id("resp_"),
            "object": "response",
            "created_at": now(),
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model or st.config.model_name,
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls
            if req.parallel_tool_calls is not None
            else True,
            "previous_response_id": req.previous_response_id,
            "reasoning": {
                "effort": req.reasoning.effort if req.reasoning else None,
                "summary": None,
            },
            "store": bool(req.store),
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": prep.body.get("tools") or [],
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": None,
            "metadata": req.metadata or {},
        }

    def _ev(self, typ: str, **fields: Any) -> dict[str, Any]:
        d = {"type": typ, "sequence_number": self.seq, **fields}
        self.seq += 1
        return d

    def _snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": list(self.output)}

    def created(self) -> list[dict[str, Any]]:
        return [self._ev("response.created", response=self._snapshot())]

    def in_progress(self) -> dict[str, Any]:
        return self._ev("response.in_progress", response=self._snapshot())

    # ---- items

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self.open = item
        return [
            self._ev(
                "response.output_item.added", output_index=len(self.output) - 1, item=dict(item)
            )
        ]

    def _close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = self.output.index(item)
        out: list[dict[str, Any]] = []
        if item["type"] == "reasoning":
            text = "".join(self.text)
            item["content"] = [{"type": "reasoning_text", "text": text}]
            if self.include_encrypted:
                item["encrypted_content"] = self.carrier.seal(text)
            out.append(
                self._ev(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=text,
                )
            )
        elif item["type"] == "message":
            text = "".join(self.text)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            item["status"] = "completed"
            out.append(
                self._ev(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            out.append(
                self._ev(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    part=part,
                )
            )
        self.text = []
        out.append(self._ev("response.output_item.done", output_index=idx, item=dict(item)))
        return out

    def feed(self, e: Any) -> list[dict[str, Any]]:
        """Stream events for one worker event (empty for events with no wire form)."""
        out: list[dict[str, Any]] = []
        if isinstance(e, ThinkingDelta):
            if self.open is None or self.open["type"] != "reasoning":
                out += self._close()
                out += self._add({"id": new_id("rs_"), "type": "reasoning", "summary": []})
            self.text.append(e.text)
            if e.text:
                idx = len(self.output) - 1
                out.append(
                    self._ev(
                        "response.reasoning_text.delta",
                        item_id=self.open["id"],
                        output_index=idx,
                        content_index=0,
                        delta=e.text,
                    )
                )
        elif isinstance(e, TextDelta):
            if not e.text:
                return out
            if self.open is None or self.open["type"] != "message":
                out += self._close()
                item = {
                    "id": new_id("msg_"),
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                out += self._add(item)
                out.append(
                    self._ev(
                        "response.content_part.added",
                        item_id=item["id"],
                        output_index=len(self.output) - 1,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                    )
                )
            self.text.append(e.text)
            out.append(
                self._ev(
                    "response.output_text.delta",
                    item_id=self.open["id"],
                    output_index=len(self.output) - 1,
                    content_index=0,
                    delta=e.text,
                    logprobs=[],
                )
            )
        elif isinstance(e, ToolCallStart):
            out += self._close()
            kind = self.kinds.get(e.name) or wire.ResponsesToolKind("function")
            if kind.kind == "custom":
                # Free-form input is the "input" argument; it is known once the call ends.
                self.custom[e.index] = {"name": e.name, "id": e.id}
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
            out += self._add(item)
        elif isinstance(e, ToolCallArgsDelta):
            if self.open is not None and self.open["type"] == "function_call" and e.text:
                self.open["arguments"] += e.text
                out.append(
                    self._ev(
                        "response.function_call_arguments.delta",
                        item_id=self.open["id"],
                        output_index=len(self.output) - 1,
                        delta=e.text,
                    )
                )
        elif isinstance(e, ToolCallEnd):
            if e.index in self.custom:
                info = self.custom.pop(e.index)
                raw = e.call.arguments.get("input")
                text = raw if isinstance(raw, str) else e.arguments_json
                item = {
                    "id": new_id("ctc_"),
                    "type": "custom_tool_call",
                    "status": "in_progress",
                    "call_id": info["id"],
                    "name": info["name"],
                    "input": "",
                }
                out += self._add(item)
                idx = len(self.output) - 1
                out.append(
                    self._ev(
                        "response.custom_tool_call_input.delta",
                        item_id=item["id"],
                        output_index=idx,
                        delta=text,
                    )
                )
                out.append(
                    self._ev(
                        "response.custom_tool_call_input.done",
                        item_id=item["id"],
                        output_index=idx,
                        input=text,
                    )
                )
                item["input"] = text
                item["status"] = "completed"
                out += self._close()
            elif self.open is not None and self.open["type"] == "function_call":
                item = self.open
                idx = len(self.output) - 1
                item["arguments"] = e.arguments_json
                item["status"] = "completed"
                out.append(
                    self._ev(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=idx,
                        name=item["name"],
                        arguments=e.arguments_json,
                    )
                )
                out += self._close()
        elif isinstance(e, ParseError):
            pass
        return out

    def usage(self, d: JobDone) -> dict[str, Any]:
        return {
            "input_tokens": d.prompt_tokens,
            "input_tokens_details": {"cached_tokens": d.cached_tokens},
            "output_tokens": d.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": d.reasoning_tokens},
            "total_tokens": d.prompt_tokens + d.completion_tokens,
        }

    def done(self, d: JobDone) -> list[dict[str, Any]]:
        out = self._close()
        self.response["usage"] = self.usage(d)
        if d.finish == "cancelled":
            self.response["status"] = "failed"
            self.response["error"] = {"code": "server_error", "message": "generation cancelled"}
            return [*out, self._ev("response.failed", response=self._snapshot())]
        if d.finish == "length":
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            return [*out, self._ev("response.incomplete", response=self._snapshot())]
        self.response["status"] = "completed"
        return [*out, self._ev("response.completed", response=self._snapshot())]

    def failed(self, f: JobFailed) -> list[dict[str, Any]]:
        out = self._close()
        err = failed_to_api(f)
        self.response["status"] = "failed"
        self.response["error"] = {
            "code": err.code or ("server_error" if err.status >= 500 else "invalid_request"),
            "message": err.message,
            **err.fields,
        }
        return [*out, self._ev("response.failed", response=self._snapshot())]


async def _events(job, builder: _Builder, keepalive_s: float, *, comments: bool):
    """Yield Responses stream events (dicts) for ``job``; None means an SSE comment."""
    ka = Keepalive(keepalive_s)
    for d in builder.created():
        yield d
    ka.sent()
    async for e in job.events(keepalive_s):
        if e is None or isinstance(e, PrefillProgress):
            if ka.due():
                ka.sent()
                # Codex's idle timer counts events, not comments: send in_progress.
                yield builder.in_progress()
            continue
        if isinstance(e, JobStarted):
            ka.sent()
            yield builder.in_progress()
            continue
        if isinstance(e, JobFailed):
            for d in builder.failed(e):
                yield d
            return
        if isinstance(e, JobDone):
            for d in builder.done(e):
                yield d
            return
        out = builder.feed(e)
        if out:
            ka.sent()
        for d in out:
            yield d


# --------------------------------------------------------------------------- HTTP


@bp.post("/v1/responses")
async def create_response():
    """Create a response (SSE when ``stream`` is true, else the response object)."""
    data = await read_json()
    prep = await _prepare(data, path=request.path)
    st = state()
    job = st.submit(prep.gen)
    builder = _Builder(prep)
    if prep.req.stream:

        async def gen():
            async for d in _events(job, builder, st.config.keepalive_s, comments=True):
                yield SSE_COMMENT if d is None else sse(d, d["type"])

        return sse_response(guard(job, gen()))
    events, done = await collect(job)
    for e in events:
        builder.feed(e)
    builder.done(done)
    if done.finish == "cancelled":
        raise APIError(503, "generation cancelled (server shutting down)", type="server_error")
    return json_response(builder._snapshot())


@bp.get("/v1/responses/<path:response_id>")
async def get_response(response_id: str):
    raise APIError(
        404,
        f"response {response_id!r} not found: this server does not store responses (use store: false and resend input)",
        type="invalid_request_error",
        code="not_found",
    )


# --------------------------------------------------------------------------- WebSocket


@bp.websocket("/v1/responses")
async def responses_ws():
    """Codex's Responses WebSocket transport: ``response.create`` frames in, events out.

    Each ``{"type": "response.create", ...body}`` text frame runs one response and
    streams its events as JSON text frames, ending with ``response.completed`` (or
    ``incomplete``/``failed``). Request errors come back as
    ``{"type": "error", "status": 4xx, "error": {...}}`` and the connection stays open.
    ``response.processed`` acknowledgements are ignored.
    """
    err = check_auth(websocket.headers)
    if err is not None:
        await websocket.close(1008, "invalid or missing API key")
        return
    await websocket.accept()
    st = state()
    store: dict[str, list[dict[str, Any]]] = {}
    while True:
        raw = await websocket.receive()
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except (ValueError, TypeError, RecursionError) as e:
            await websocket.send(_ws_error(APIError(400, f"malformed JSON frame: {e}")))
            continue
        typ = data.pop("type", None)
        if typ == "response.processed":
            continue
        if typ != "response.create":
            await websocket.send(
                _ws_error(APIError(400, f"unsupported event type {typ!r}", param="type"))
            )
            continue
        try:
            prep = await _prepare(data, path="ws /v1/responses", store=store)
        except APIError as e:
            await websocket.send(_ws_error(e))
            continue
        job = st.submit(prep.gen)
        builder = _Builder(prep)
        try:
            async for d in _events(job, builder, st.config.keepalive_s, comments=False):
                if d is not None:
                    await websocket.send(json.dumps(d, ensure_ascii=False))
        finally:
            if not job.done:
                job.cancel.set()
        if builder.response["status"] in ("completed", "incomplete"):
            items = (
                prep.body["input"]
                if isinstance(prep.body["input"], list)
                else [{"type": "message", "role": "user", "content": prep.body["input"]}]
            )
            store.clear()  # only the latest response can be continued
            store[builder.response["id"]] = list(items) + [dict(i) for i in builder.output]


def _ws_error(e: APIError) -> str:
    return json.dumps(
        {
            "type": "error",
            "status": e.status,
            "error": {"type": e.type, "code": e.code, "message": e.message, "param": e.param},
        },
        ensure_ascii=False,
    )
