"""Mid-turn steering and cancel over the Responses WebSocket, and streaming tool dispatch
(chat ``event: tool_call_dispatch``; Anthropic / Responses events at a call's close).

A real ``ds4mlx serve`` on the tiny checkpoint with scripted decoding; the WebSocket is
driven with the official ``openai`` SDK (``client.beta.responses.connect()``, which
needs ``websockets``). Scripted turns are long enough that a steer or cancel sent at
their first streamed delta lands mid-turn.
"""

from __future__ import annotations

import json

import pytest
from server_util import HTTP, sse_events

from ds4mlx.dsml.tokens import EOS

MODEL = "deepseek-v4-flash"
# Long enough to outlive a round trip even when the machine is loaded and the client reads
# behind the worker (a steer or cancel sent at the first delta lands mid-turn).
LONG = " ".join(f"word{i}" for i in range(800))
SHORT = " ".join(f"word{i}" for i in range(100))
TOOL = {
    "type": "function",
    "name": "bash",
    "description": "run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
}
CHAT_TOOL = {
    "type": "function",
    "function": {k: v for k, v in TOOL.items() if k != "type"},
}
ANT_TOOL = {
    "name": "bash",
    "description": "run a command",
    "input_schema": TOOL["parameters"],
}


def _calls(*commands: str, eos: bool = True) -> str:
    """A DSML block of ``bash`` calls, one per command (then EOS)."""
    invokes = "".join(
        f'<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="command" string="true">'
        f"{c}</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
        for c in commands
    )
    return f"\n\n<｜DSML｜tool_calls>\n{invokes}</｜DSML｜tool_calls>" + (EOS if eos else "")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return tmp_path_factory.mktemp("steer") / "trace.jsonl"


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir, trace):
    extra = ["--served-model-name", MODEL, "--keepalive", "0.2", "--sessions", "1"]
    return server_factory(tiny_model_dir, extra=extra + ["--trace", str(trace)])


def _last_prompt(trace) -> str:
    """The rendered prompt of the latest job (the trace's ``prompt`` record)."""
    recs = [json.loads(ln) for ln in trace.read_text().splitlines()]
    return [r for r in recs if r["kind"] == "prompt"][-1]["text"]


@pytest.fixture(scope="module")
def client(server):
    import openai
    from openai._models import construct_type_unchecked
    from openai.types.beta import BetaResponsesServerEvent

    # The SDK builds its event models on first use, seconds on a loaded machine: warmed
    # here, so the client reads events in step with the server (a steer sent at the
    # first delta must land mid-turn).
    for typ in ("response.created", "response.output_text.delta", "response.incomplete"):
        construct_type_unchecked(value={"type": typ}, type_=BetaResponsesServerEvent)
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _until(conn, stop, on=None) -> list:
    """Events from ``conn`` up to the first for which ``stop(ev)`` holds (inclusive);
    ``on(ev)`` sees each first (it may send frames)."""
    seen = []
    for ev in conn:
        seen.append(ev)
        if on is not None:
            on(ev)
        if stop(ev):
            return seen
    raise AssertionError(f"connection closed after {[e.type for e in seen]}")


def _types(evs) -> list[str]:
    return [e.type for e in evs]


def _ended(ev) -> bool:
    return ev.type in ("response.completed", "response.incomplete", "response.failed")


# --------------------------------------------------------------------------- steering


def test_steer_mid_text_ends_steered_and_a_successor_continues_live(server, client, trace):
    server.wait_idle()
    n0 = len(server.request_lines())
    server.script("plan</think>" + LONG + EOS, "Go it is." + EOS)
    sent = []
    with client.beta.responses.connect() as conn:
        conn.response.create(model=MODEL, input="write a web server")

        def on(ev):
            if ev.type == "response.output_text.delta" and not sent:
                sent.append(ev)
                conn.response.steer(input="use Go instead", previous_response_id=first_id[0])

        first_id = []

        def stop(ev):
            if ev.type == "response.created" and not first_id:
                first_id.append(ev.response.id)
            return ev.type == "response.completed"

        evs = _until(conn, stop, on)
    types = _types(evs)
    assert "response.steer.accepted" in types
    acc = evs[types.index("response.steer.accepted")]
    assert acc.steer.previous_response_id == first_id[0] and acc.steer.id
    inc = evs[types.index("response.incomplete")]
    assert inc.response.id == first_id[0] and inc.response.incomplete_details.reason == "steered"
    text = inc.response.output[-1].content[0].text
    # Steered after the first text delta: how many more tokens it takes to land depends
    # on timing, so the text is a non-empty prefix of the script, well short of its end.
    assert text and LONG.startswith(text) and "word799" not in text, (text, server.request_line(n0))
    # The successor: created after the incomplete, continuing the steered response.
    created = [e for e in evs if e.type == "response.created"]
    assert len(created) == 2 and types.index("response.incomplete") < types.index(
        "response.created", types.index("response.incomplete")
    )
    succ = created[1].response
    assert succ.previous_response_id == first_id[0]
    assert evs[-1].response.id == succ.id and evs[-1].response.output[-1].content[0].text == (
        "Go it is."
    )
    # Append-only: the successor kept the steered turn's live state and prefilled only
    # the user turn that carries the steering text.
    first, second = server.request_line(n0), server.request_line(n0 + 1)
    assert "finish=steered" in first
    assert " live-thinking " in second, second
    cached = int(second.split(" cached=")[1].split()[0])
    prompt = int(second.split(" prompt=")[1].split()[0])
    assert prompt - cached <= 16
    # The rendered suffix: the steered turn as the client saw it, then the steering text.
    assert _last_prompt(trace).endswith(
        f"</think>{text}<｜end▁of▁sentence｜><｜User｜>use Go instead<｜Assistant｜><think>"
    )


def test_steer_inside_a_call_waits_for_required_input_then_prepends(server, client, trace):
    server.wait_idle()
    n0 = len(server.request_lines())
    # The second call is long: the steer, sent when the first call's item opens, must
    # land while the block is still decoding (a short block ended before a loaded
    # client's steer arrived: answered steer.failed, response_already_completed).
    long_cmd = "echo " + SHORT
    server.script("ok</think>" + _calls("ls", long_cmd), "Switching to Go." + EOS)
    ids: list[str] = []
    with client.beta.responses.connect() as conn:
        conn.response.create(model=MODEL, input="list files", tools=[TOOL])

        def on(ev):
            if ev.type == "response.created":
                ids.append(ev.response.id)
            if ev.type == "response.output_item.added" and ev.item.type == "function_call":
                if len(ids) == 1 and not getattr(on, "sent", False):
                    on.sent = True
                    conn.response.steer(
                        input=[{"type": "message", "role": "user", "content": "use Go instead"}],
                        previous_response_id=ids[0],
                    )

        answered = ("response.steer.pending", "response.steer.failed")
        evs = _until(conn, lambda ev: ev.type in answered, on)
        assert evs[-1].type == "response.steer.pending", evs[-1]
        types = _types(evs)
        done = evs[types.index("response.completed")]
        calls = [o for o in done.response.output if o.type == "function_call"]
        args = [json.loads(c.arguments) for c in calls]
        assert args == [{"command": "ls"}, {"command": long_cmd}]
        assert types.index("response.completed") < types.index("response.steer.pending")
        pending = evs[-1]
        assert pending.reason == "waiting_for_required_input"
        assert [(r.type, r.call_id) for r in pending.required_input] == [
            ("function_call_output", c.call_id) for c in calls
        ]
        # The client runs its calls and sends their outputs; the queued input goes first.
        outputs = [
            {"type": "function_call_output", "call_id": c.call_id, "output": f"out {i}"}
            for i, c in enumerate(calls)
        ]
        conn.response.create(model=MODEL, input=outputs, previous_response_id=ids[0], tools=[TOOL])
        evs = _until(conn, _ended)
    assert evs[-1].type == "response.completed"
    line = server.request_line(n0 + 1)
    assert " live-responses " in line and "ids=2" in line, line
    # The queued input went first, in the same user turn as the results; only that
    # suffix was prefilled.
    assert _last_prompt(trace).endswith(
        "</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜>use Go instead\n\n"
        "<tool_result>out 0</tool_result>\n\n<tool_result>out 1</tool_result>"
        "<｜Assistant｜><think>"
    )
    cached = int(line.split(" cached=")[1].split()[0])
    assert int(line.split(" prompt=")[1].split()[0]) - cached <= 40


def test_steer_bad_frames_fail_with_the_input_returned(server, client):
    server.wait_idle()
    server.script("hm</think>" + SHORT + EOS, "done" + EOS)
    with client.beta.responses.connect() as conn, client.beta.responses.connect() as other:
        conn.response.create(model=MODEL, input="hello")
        rid = _until(conn, lambda ev: ev.type == "response.output_text.delta")[0].response.id
        raw = conn._connection  # the websockets connection: frames the SDK would not send
        raw.send("{not json")
        raw.send(json.dumps({"type": "response.nonsense"}))
        bad = [
            ({"input": "x", "previous_response_id": "resp_unknown"}, "response_not_found"),
            ({"input": "", "previous_response_id": rid}, "invalid_input"),
            ({"input": [], "previous_response_id": rid}, "invalid_input"),
            (
                {"input": [{"role": "assistant", "content": "x"}], "previous_response_id": rid},
                "invalid_input",
            ),
            ({"input": "x"}, "invalid_input"),
        ]
        for frame, _ in bad:
            raw.send(json.dumps({"type": "response.steer", **frame}))
        # Another connection cannot steer this one's response.
        other.response.steer(input="psst", previous_response_id=rid)
        (failed_other,) = _until(other, lambda ev: True)
        assert failed_other.type == "response.steer.failed"
        assert failed_other.error.code == "response_not_found"
        evs = _until(conn, _ended)
        errors = [e for e in evs if e.type == "error"]
        failed = [e for e in evs if e.type == "response.steer.failed"]
        assert len(errors) == 2 and [f.error.code for f in failed] == [c for _, c in bad]
        assert [f.steer.input for f in failed] == [f["input"] for f, _ in bad]
        # Nothing was steered: the response ran to its end.
        assert evs[-1].type == "response.completed"
        assert "word99" in evs[-1].response.output[-1].content[0].text
        # A steer for the finished response; then the connection still serves.
        conn.response.steer(input="late", previous_response_id=rid)
        (late,) = _until(conn, lambda ev: True)
        assert late.type == "response.steer.failed"
        assert late.error.code == "response_already_completed"
        conn.response.create(model=MODEL, input="next", previous_response_id=rid)
        assert _until(conn, _ended)[-1].type == "response.completed"


# --------------------------------------------------------------------------- cancel


def test_steer_cancel_frame_frees_the_worker_and_the_next_request_continues(server, client):
    server.wait_idle()
    n0 = len(server.request_lines())
    server.script("think</think>" + LONG + EOS, "again" + EOS)
    with client.beta.responses.connect() as conn:
        conn.response.create(model=MODEL, input="count")
        first = _until(conn, lambda ev: ev.type == "response.output_text.delta")
        rid = first[0].response.id
        # A create while it streams: an error frame, and the stream goes on.
        conn.response.create(model=MODEL, input="meanwhile")
        conn.send({"type": "response.cancel", "response_id": rid})
        evs = _until(conn, _ended)
        assert [e.type for e in evs].count("error") == 1
        end = evs[-1]
        assert end.type == "response.incomplete" and end.response.status == "cancelled"
        # The message the cancel cut ends incomplete, in its done event and the response.
        (msg_done,) = [
            e for e in evs if e.type == "response.output_item.done" and e.item.type == "message"
        ]
        assert msg_done.item.status == "incomplete"
        assert [i.status for i in end.response.output if i.type == "message"] == ["incomplete"]
        server.wait_idle()
        conn.response.create(model=MODEL, input="go on", previous_response_id=rid)
        assert _until(conn, _ended)[-1].type == "response.completed"
    line = server.request_line(n0)
    assert "finish=cancelled" in line
    # Stopped at the cancel, never run on to the script's end (~2,400 tokens).
    assert int(line.split(" generated=")[1].split()[0]) < len(LONG.split()), line
    nxt = server.request_line(n0 + 1)
    assert " live-thinking " in nxt, nxt


def test_ws_error_texts_name_the_missing_field(server):
    """A cancel without ``response_id`` and a frame without ``type`` are 400 error frames
    that say which field is missing (they read "response None …", "event type None")."""
    from websockets.sync.client import connect

    with connect(server.url.replace("http", "ws", 1) + "/v1/responses") as ws:
        errors = []
        for frame in (
            {"type": "response.cancel"},
            {"type": "response.cancel", "response_id": 7},
            {},
        ):
            ws.send(json.dumps(frame))
            errors.append(json.loads(ws.recv(timeout=30)))
        # A list where an item's type goes: a 400 frame (it closed the socket, 1011).
        bad = [{"type": ["message"], "role": "user", "content": "hi"}]
        ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": bad}))
        errors.append(json.loads(ws.recv(timeout=30)))
    with connect(server.url.replace("http", "ws", 1) + "/v1/responses") as ws:
        ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "hi",
                            "previous_response_id": "resp_elsewhere"}))  # fmt: skip
        errors.append(json.loads(ws.recv(timeout=30)))
    assert "this connection's latest response" in errors[-1]["error"]["message"], errors[-1]
    assert "HTTP" not in errors[-1]["error"]["message"], errors[-1]
    for ev in errors:
        assert ev["type"] == "error" and ev["status"] == 400, ev
        assert "None" not in ev["error"]["message"], ev
    assert [e["error"]["param"] for e in errors] == [
        "response_id",
        "response_id",
        "type",
        "input.0.type",
        "previous_response_id",
    ]
    assert errors[0]["error"]["message"] == "response_id: required, a string"
    assert errors[2]["error"]["message"].startswith("type: required, one of response.create")


def test_responses_sse_message_cut_by_the_limit_ends_incomplete(server):
    """``response.output_item.done`` of a message cut by ``max_output_tokens`` says
    ``incomplete`` (it said ``completed`` under a ``response.incomplete``)."""
    server.wait_idle()
    server.script("x</think>" + SHORT + EOS)
    body = {"model": MODEL, "input": "count", "max_output_tokens": 12, "stream": True}
    with HTTP.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as r:
        evs = [json.loads(d) for e, d in sse_events(r.iter_lines()) if e]
    end = evs[-1]
    assert end["type"] == "response.incomplete", end
    assert end["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    (msg_done,) = [
        d
        for d in evs
        if d["type"] == "response.output_item.done" and d["item"]["type"] == "message"
    ]
    assert msg_done["item"]["status"] == "incomplete"
    assert [i["status"] for i in end["response"]["output"] if i["type"] == "message"] == [
        "incomplete"
    ]


def test_steer_socket_close_cancels_the_response(server, client):
    server.wait_idle()
    n0 = len(server.request_lines())
    server.script("x</think>" + LONG + EOS)
    with client.beta.responses.connect() as conn:
        conn.response.create(model=MODEL, input="count")
        _until(conn, lambda ev: ev.type == "response.output_text.delta")
    server.wait_idle(timeout=60)  # the cancel lands at the next token
    assert "finish=cancelled" in server.request_line(n0)


# --------------------------------------------------------------------------- dispatch


def _chat_stream(server, body) -> list[tuple[str | None, str | None]]:
    with HTTP.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        return [e for e in sse_events(r.iter_lines()) if e != (None, None)]


def test_dispatch_event_arrives_at_the_first_calls_close(server):
    server.wait_idle()
    server.script("ok</think>" + _calls("ls -la", "pwd"))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "look"}],
        "tools": [CHAT_TOOL],
        "stream": True,
        "tool_call_dispatch": True,
    }
    evs = _chat_stream(server, body)
    dispatch = [(i, json.loads(d)) for i, (e, d) in enumerate(evs) if e == "tool_call_dispatch"]
    assert len(dispatch) == 2
    (i0, d0), (_, d1) = dispatch
    assert d0["choice_index"] == 0
    call = d0["tool_call"]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "bash", "arguments": json.dumps({"command": "ls -la"})}
    assert d1["tool_call"]["index"] == 1
    # Before the second call's first argument byte.
    second_args = next(
        i
        for i, (e, d) in enumerate(evs)
        if e is None
        and d != "[DONE]"
        and any(
            tc["index"] == 1 and tc.get("function", {}).get("arguments")
            for tc in (json.loads(d)["choices"] or [{}])[0].get("delta", {}).get("tool_calls") or []
        )
    )
    assert i0 < second_args


def test_dispatch_off_the_sdk_stream_is_unchanged(server, client):
    server.wait_idle()
    server.script("ok</think>" + _calls("ls"))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "look"}],
        "tools": [CHAT_TOOL],
        "stream": True,
    }
    assert all(e is None for e, _ in _chat_stream(server, body))
    server.script("ok</think>" + _calls("ls"))
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=body["messages"], tools=body["tools"], stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("value", ["true", 1, {"on": True}])
def test_dispatch_field_must_be_a_boolean(server, value):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "tool_call_dispatch": value,
    }
    r = HTTP.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "tool_call_dispatch" in json.dumps(r.json())


def test_dispatch_anthropic_and_responses_close_events_come_at_the_close(server):
    """``content_block_stop`` (Anthropic) and ``function_call_arguments.done`` (Responses)
    of the first call go out before the second call's first argument byte."""
    server.wait_idle()
    server.script("ok</think>" + _calls("ls", "pwd"), "ok</think>" + _calls("ls", "pwd"))
    body = {
        "model": MODEL,
        "max_tokens": 300,
        "messages": [{"role": "user", "content": "look"}],
        "tools": [ANT_TOOL],
        "stream": True,
    }
    with HTTP.stream("POST", server.url + "/v1/messages", json=body, timeout=120) as r:
        evs = [(e, json.loads(d)) for e, d in sse_events(r.iter_lines()) if e and e != "ping"]
    tool_blocks = [
        d["index"]
        for e, d in evs
        if e == "content_block_start" and d["content_block"]["type"] == "tool_use"
    ]
    first, second = tool_blocks
    stop_first = next(
        i for i, (e, d) in enumerate(evs) if e == "content_block_stop" and d["index"] == first
    )
    second_delta = next(
        i
        for i, (e, d) in enumerate(evs)
        if e == "content_block_delta" and d["index"] == second and d["delta"].get("partial_json")
    )
    assert stop_first < second_delta
    body = {"model": MODEL, "input": "look", "tools": [TOOL], "stream": True}
    with HTTP.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as r:
        evs = [json.loads(d) for e, d in sse_events(r.iter_lines()) if e]
    calls = [
        d["item"]["id"]
        for d in evs
        if d["type"] == "response.output_item.added" and d["item"]["type"] == "function_call"
    ]
    done_first = next(
        i
        for i, d in enumerate(evs)
        if d["type"] == "response.function_call_arguments.done" and d["item_id"] == calls[0]
    )
    second_delta = next(
        i
        for i, d in enumerate(evs)
        if d["type"] == "response.function_call_arguments.delta" and d["item_id"] == calls[1]
    )
    assert done_first < second_delta
