"""The Responses WebSocket transport (``GET /v1/responses`` upgrade): one JSON event per
text frame, as Codex's ``responses_websockets`` client and the official SDK's
``client.beta.responses.connect()`` speak it.

Client frames:

- ``response.create`` (a Responses body): runs one response and streams its events
  (`ds4mlx.routes.responses.ResponseEncoder`). The connection keeps its latest response,
  so ``previous_response_id`` naming it continues it. A ``response.create`` while a
  response streams gets an error frame and the stream goes on.
- ``response.steer`` ``{previous_response_id, input}`` (OpenAI's beta steering; ``input``
  text or user messages): read *while* a response streams. Answered
  ``response.steer.accepted`` ``{steer: {id, previous_response_id}}`` and delivered into
  the running job (``Job.steer``): the turn loop ends it at its next safe boundary
  (``ds4mlx.engine.steer``). Then:

  - the response ends without client-run calls: ``response.incomplete`` with
    ``incomplete_details.reason: "steered"`` (or ``response.completed`` if it ended on its
    own first), and a successor ``response.created`` follows at once: the same settings,
    ``previous_response_id`` the steered response, the queued input appended to the live
    state (the steered turn is bound as an end of turn: nothing is re-prefilled);
  - it ends with function calls the client runs: ``response.completed``, then
    ``response.steer.pending`` (``reason: "waiting_for_required_input"``,
    ``required_input``: one ``{type, call_id[, name]}`` stub per call). The queued input
    is prepended to the input of the client's next ``response.create`` that continues
    that response; results of client-run calls are never fabricated.

- ``response.cancel`` ``{response_id}`` (ours): stops the streaming response at the next
  token; it ends ``response.incomplete`` with ``status: "cancelled"`` and stays the
  connection's latest response (the next request continues its live state). Closing the
  socket cancels the same way.
- ``response.processed`` acknowledgements are ignored.

Bad input: a malformed frame or an unknown event type gets today's error frame
``{"type": "error", "status": 400, "error": {...}}``; a bad steer (malformed, unknown,
finished or another connection's response, a non-user role, empty input) gets
``response.steer.failed`` with its input returned. Either way the connection, the
running response and the live state are untouched.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from quart import Blueprint, websocket

from ds4mlx.jobs import Job
from ds4mlx.routes.access import key_salt
from ds4mlx.routes.body import offload, parse_json
from ds4mlx.routes.common import new_id, state
from ds4mlx.routes.errors import APIError, internal_error, openai_error
from ds4mlx.routes.pipeline import events, guard, start
from ds4mlx.routes.responses import NAMES, ResponseEncoder, _encoder, _prepare, _Prepared

log = logging.getLogger("ds4mlx.server")

bp = Blueprint("responses_ws", __name__)

# The client events this transport reads (`_Connection.frame`).
_TYPES = "response.create, response.steer, response.cancel, response.processed"
# Client-run call items: a response that ends with one waits for the client's results.
_CALL_ITEMS = {
    "function_call": "function_call_output",
    "custom_tool_call": "custom_tool_call_output",
}


@dataclass
class _Steer:
    """Accepted steering input: its ``id``, the response it targets, the input items."""

    id: str
    target: str
    input: Any
    items: list[dict[str, Any]]


@dataclass
class _Running:
    """The response streaming now: its job, encoder and accepted steers."""

    job: Job
    enc: ResponseEncoder
    steers: list[_Steer] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.enc.response["id"]


class _SteerError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def steer_items(inp: Any) -> list[dict[str, Any]]:
    """``response.steer`` input as user message items (text or user messages whose
    content is a string or ``input_text`` parts; nothing else).

    Raises:
        _SteerError: ``invalid_input``, saying what is wrong.
    """
    if isinstance(inp, str):
        if not inp.strip():
            raise _SteerError("invalid_input", "input: must not be empty")
        return [{"type": "message", "role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise _SteerError("invalid_input", "input: a non-empty string or array of user messages")
    items = []
    for i, m in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(m, dict) or set(m) - {"type", "role", "content"}:
            raise _SteerError("invalid_input", f"{where}: only type, role and content")
        if m.get("type", "message") != "message" or m.get("role") != "user":
            raise _SteerError("invalid_input", f"{where}: steering accepts user messages only")
        content = m.get("content")
        parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and p.get("type") == "input_text" and isinstance(p.get("text"), str)
            for p in parts
        ):
            raise _SteerError("invalid_input", f"{where}.content: a string or input_text parts")
        if not "".join(p["text"] for p in parts).strip():
            raise _SteerError("invalid_input", f"{where}.content: must not be empty")
        items.append({"type": "message", "role": "user", "content": content})
    return items


class _Connection:
    """One WebSocket connection: its latest response (``store``), the response running
    now, steering input waiting for a client's tool results, and the frame being read.

    Every frame is read and every event sent on the handler's task (no concurrent
    sends): while a response streams, its next event and the next client frame are
    awaited together (`_stream`).
    """

    def __init__(self, key: str):
        self.st = state()
        self.key = key
        self.store: dict[str, list[Any]] = {}
        self.running: _Running | None = None
        self.waiting: list[_Steer] = []  # queued for the create that answers their calls
        self.finished: set[str] = set()  # ids of this connection's finished responses
        self.seq = 0  # sequence numbers of events outside a response
        self._frame: asyncio.Future | None = None

    # ---- sending

    async def send(self, ev: dict[str, Any]) -> None:
        await websocket.send(json.dumps(ev, ensure_ascii=False))

    def event(self, typ: str, **fields: Any) -> dict[str, Any]:
        """An event numbered in the running response's sequence, else the connection's."""
        if self.running is not None:
            return self.running.enc._ev(typ, **fields)
        ev = {"type": typ, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    async def error(self, e: APIError) -> None:
        await self.send({"type": "error", "status": e.status, **openai_error(e)})

    async def steer_failed(self, code: str, message: str, frame: dict[str, Any], sid=None):
        steer = {
            "input": frame.get("input"),
            "previous_response_id": frame.get("previous_response_id"),
        }
        if sid is not None:
            steer["id"] = sid
        err = {"code": code, "message": message, "type": "invalid_request_error"}
        await self.send(self.event("response.steer.failed", error=err, steer=steer))

    # ---- reading

    def next_frame(self) -> asyncio.Future:
        """The pending read of the next client frame (one at a time; never dropped)."""
        if self._frame is None:
            self._frame = asyncio.ensure_future(websocket.receive())
        return self._frame

    def take_frame(self) -> str | bytes:
        frame, self._frame = self._frame, None
        assert frame is not None
        return frame.result()

    async def serve(self) -> None:
        while True:
            raw = await self.next_frame()
            self._frame = None
            try:
                await self.frame(raw)
            except Exception as e:  # a server fault answers its frame; the connection lives
                log.exception("unhandled error on a ws /v1/responses frame")
                await self.error(internal_error(type(e).__name__))

    async def frame(self, raw: str | bytes) -> None:
        """Handle one client frame (a response may be streaming: ``self.running``)."""
        try:
            data = await offload(_frame, raw)
        except APIError as e:
            await self.error(e)
            return
        typ = data.get("type")
        if typ == "response.processed":
            return
        if typ == "response.steer":
            await self.steer(data)
        elif typ == "response.cancel":
            await self.cancel(data)
        elif typ == "response.create" and self.running is not None:
            await self.error(
                APIError(
                    400,
                    f"response {self.running.id} is in progress on this connection: wait for "
                    "its end, or send response.cancel",
                    param="type",
                )
            )
        elif typ == "response.create":
            await self.create(raw)
        elif not isinstance(typ, str):
            await self.error(APIError(400, f"type: required, one of {_TYPES}", param="type"))
        else:
            await self.error(
                APIError(400, f"unsupported event type {typ!r}; one of {_TYPES}", param="type")
            )

    # ---- client events

    async def steer(self, data: dict[str, Any]) -> None:
        run = self.running
        target = data.get("previous_response_id")
        try:
            extra = set(data) - {"type", "previous_response_id", "input"}
            if extra:
                raise _SteerError("invalid_input", f"unsupported field {sorted(extra)[0]!r}")
            if not isinstance(target, str):
                raise _SteerError("invalid_input", "previous_response_id: required, a string")
            items = steer_items(data.get("input"))
            if run is None or target != run.id:
                if target in self.finished:
                    raise _SteerError(
                        "response_already_completed", f"response {target} has finished"
                    )
                raise _SteerError(
                    "response_not_found", f"response {target} is not streaming on this connection"
                )
        except _SteerError as e:
            await self.steer_failed(e.code, e.message, data)
            return
        s = _Steer(new_id("steer_"), target, data["input"], items)
        run.steers.append(s)
        run.job.steer.set()
        await self.send(
            self.event(
                "response.steer.accepted", steer={"id": s.id, "previous_response_id": target}
            )
        )

    async def cancel(self, data: dict[str, Any]) -> None:
        run = self.running
        rid = data.get("response_id")
        if not isinstance(rid, str):
            await self.error(APIError(400, "response_id: required, a string", param="response_id"))
            return
        if run is None or rid != run.id:
            await self.error(
                APIError(
                    400,
                    f"response {rid!r} is not streaming on this connection",
                    param="response_id",
                    code="response_not_found",
                )
            )
            return
        run.job.cancel.set()

    async def create(self, raw: str | bytes) -> None:
        """Run a client's ``response.create``, then any successor steering asks for."""
        queued, self.waiting = self.waiting, []
        try:
            prep = await offload(_ws_request, raw, self.store, self.key, _prefix(queued, raw))
        except APIError as e:
            await self.error(e)
            for s in queued:  # its input was never committed
                await self.steer_failed(
                    "successor_creation_failed", e.message, _steer_frame(s), s.id
                )
            return
        if queued and not _continues(raw, queued):
            for s in queued:
                await self.steer_failed(
                    "response_not_active",
                    f"response {s.target} was not continued; its steering input was dropped",
                    _steer_frame(s),
                    s.id,
                )
        while prep is not None:
            prep = await self.run(prep)

    async def run(self, prep: _Prepared) -> _Prepared | None:
        """Stream one response; the successor to run when steering asks for one."""
        job = self.st.submit(prep.gen)
        try:
            await start(job, NAMES)
        except APIError as e:
            await self.error(e)
            return None
        run = self.running = _Running(job, _encoder(prep))
        try:
            await self._stream(run)
            return await self._after(prep, run)
        finally:
            self.running = None

    async def _stream(self, run: _Running) -> None:
        """Send ``run``'s events while handling the client's frames as they come."""
        agen = guard(run.job, events(run.job, run.enc, self.st.config.keepalive_s))
        nxt = asyncio.ensure_future(anext(agen))
        try:
            while True:
                frame = self.next_frame()
                await asyncio.wait({nxt, frame}, return_when=asyncio.FIRST_COMPLETED)
                if frame.done():
                    await self.frame(self.take_frame())
                if nxt.done():
                    try:
                        ev = nxt.result()
                    except StopAsyncIteration:
                        return
                    if ev is not None:
                        await self.send(ev)
                    nxt = asyncio.ensure_future(anext(agen))
        finally:
            nxt.cancel()
            await _aclose(agen)

    async def _after(self, prep: _Prepared, run: _Running) -> _Prepared | None:
        """Keep the finished response; answer its steers (pending, a successor, failed)."""
        resp = run.enc.response
        self.finished.add(run.id)
        if resp["status"] in ("completed", "incomplete", "cancelled"):
            self.store.clear()  # only the latest response can be continued
            self.store[run.id] = prep.items + [dict(i) for i in run.enc.output]
        if not run.steers:
            return None
        calls = [i for i in run.enc.output if i["type"] in _CALL_ITEMS]
        if resp["status"] in ("failed", "cancelled"):
            for s in run.steers:
                await self.steer_failed(
                    "response_not_active",
                    f"response {run.id} ended {resp['status']}",
                    _steer_frame(s),
                    s.id,
                )
            return None
        if calls:
            stubs = [_stub(c) for c in calls]
            for s in run.steers:
                await self.send(
                    self.event(
                        "response.steer.pending",
                        reason="waiting_for_required_input",
                        required_input=stubs,
                        steer={"id": s.id, "previous_response_id": s.target},
                    )
                )
            self.waiting = list(run.steers)
            return None
        body = {**prep.data, "previous_response_id": run.id}
        body["input"] = [it for s in run.steers for it in s.items]
        try:
            return await offload(_ws_request, json.dumps(body), self.store, self.key, [])
        except APIError as e:
            for s in run.steers:
                await self.steer_failed(
                    "successor_creation_failed", e.message, _steer_frame(s), s.id
                )
            return None


async def _aclose(agen: AsyncIterator[Any]) -> None:
    try:
        await agen.aclose()  # type: ignore[attr-defined]
    except RuntimeError:  # still running (cancelled mid-step): its guard ran already
        pass


def _stub(item: dict[str, Any]) -> dict[str, Any]:
    """A ``required_input`` stub for a client-run call item (identifying fields only)."""
    stub = {"type": _CALL_ITEMS[item["type"]], "call_id": item["call_id"]}
    if item["type"] == "function_call":
        stub["name"] = item["name"]
    return stub


def _steer_frame(s: _Steer) -> dict[str, Any]:
    return {"input": s.input, "previous_response_id": s.target}


def _continues(raw: str | bytes, queued: list[_Steer]) -> bool:
    """The create ``raw`` continues the response the ``queued`` steers wait on."""
    try:
        data = json.loads(raw)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("previous_response_id") == queued[0].target


def _prefix(queued: list[_Steer], raw: str | bytes) -> list[dict[str, Any]]:
    """Input items to prepend to a create: the queued steers' when it continues their
    response (in submission order), else none."""
    if not queued or not _continues(raw, queued):
        return []
    return [it for s in queued for it in s.items]


def _frame(raw: str | bytes) -> dict[str, Any]:
    """A client frame as a JSON object with a ``type`` (off the event loop).

    Raises:
        APIError: 400 for a malformed frame.
    """
    try:
        data = parse_json(raw)
    except APIError as e:
        raise APIError(400, f"malformed JSON frame: {e.message}") from None
    if not isinstance(data, dict):
        raise APIError(400, "malformed JSON frame: not an object")
    return data


def _ws_request(
    raw: str | bytes, store: dict[str, list[Any]], key: str = "", prefix: list | None = None
) -> _Prepared:
    """A ``response.create`` frame's prepared job (off the event loop); ``prefix``: input
    items to put before the frame's own (queued steering input).

    Raises:
        APIError: 400 for a malformed frame or a bad request.
    """
    data = _frame(raw)
    data.pop("type", None)
    if prefix:
        inp = data.get("input")
        own = [{"type": "message", "role": "user", "content": inp}] if isinstance(inp, str) else inp
        data["input"] = list(prefix) + list(own or [])
    return _prepare(data, path="ws /v1/responses", store=store, key=key)


@bp.websocket("/v1/responses")
async def responses_ws():
    """The Responses WebSocket (module doc). Request errors come back as error frames
    and the connection stays open."""
    await websocket.accept()  # the API key was checked before (the access hook: a 401)
    conn = _Connection(key_salt(websocket.headers))
    try:
        await conn.serve()
    finally:
        if conn._frame is not None:
            conn._frame.cancel()
