"""Unit tests of server pieces that need no running server: the prefill planner's
prefix rules (docs/ARCHITECTURE.md §3), the reasoning carrier, error shapes; and the app
in process (`/health` once shutdown began)."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest

from ds4mlx.kv.cache import Prompt, PromptCache
from ds4mlx.routes.anthropic import error_body as anthropic_error
from ds4mlx.routes.carrier import ReasoningCarrier
from ds4mlx.routes.errors import APIError, _loc_to_path, openai_error
from ds4mlx.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load()


class FakeSession:
    """What the planner reads: live tokens, logits presence, decoded text."""

    ctx_size = 1 << 20

    def __init__(self, tok: Tokenizer, tokens: list[int]):
        self.tokenizer = tok
        self.tokens = tokens
        self.logits = object() if tokens else None

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.tokens)

    def reset(self) -> None:
        self.tokens, self.logits = [], None


def _gen():
    """A minimal job request (the tests here never run it)."""
    from ds4mlx.jobs import GenRequest, TurnSpec
    from ds4mlx.sampling import SamplingParams

    return GenRequest("/t", TurnSpec(SamplingParams(), 1), None, prompt_tokens=[1])


def plan_prefill(session: FakeSession, tok: Tokenizer, rendered: str | None, prompt: list[int]):
    """The prompt cache without a disk tier or live bindings (rules 4, 5, 7)."""
    cache = PromptCache(SimpleNamespace(tokenizer=tok, ctx_size=1 << 20, session=session))
    return cache.begin(Prompt(prompt, rendered)).plan


BOS = "<｜begin▁of▁sentence｜>"


def test_exact_token_prefix_keeps_live_and_prefills_the_rest(tok):
    prompt = (
        BOS + "<｜User｜>hello<｜Assistant｜></think>Hi there.<｜end▁of▁sentence｜><｜User｜>more"
    )
    toks = tok.encode(prompt)
    live = toks[:7]
    p = plan_prefill(FakeSession(tok, live), tok, prompt, toks)
    assert (p.decision, p.keep, p.cached) == ("exact-token-prefix", 7, 7)
    assert live + p.suffix_tokens == toks


def test_text_prefix_tokenizes_only_the_remaining_bytes(tok):
    # The model sampled "Hello wor" as ["Hello", " wor"]; the replayed prompt continues
    # "ld", so tokenizing the whole prompt would merge " world" into one token.
    head = BOS + "<｜User｜>say<｜Assistant｜></think>"
    live = tok.encode(head) + tok.encode("Hello wor")
    prompt = head + "Hello world and more"
    full = tok.encode(prompt)
    assert full[: len(live)] != live  # not a token prefix: BPE merged across the boundary
    p = plan_prefill(FakeSession(tok, live), tok, prompt, full)
    assert p.decision == "text-prefix" and p.keep == len(live)
    assert p.suffix_tokens == tok.encode("ld and more")
    assert tok.decode(live + p.suffix_tokens) == prompt


def test_cold_when_live_state_diverges_or_is_empty(tok):
    prompt = BOS + "<｜User｜>new question<｜Assistant｜><think>"
    toks = tok.encode(prompt)
    other = tok.encode(BOS + "<｜User｜>old question<｜Assistant｜><think>x")
    p = plan_prefill(FakeSession(tok, other), tok, prompt, toks)
    assert (p.decision, p.keep, p.suffix_tokens) == ("cold", 0, toks)
    p = plan_prefill(FakeSession(tok, []), tok, prompt, toks)
    assert (p.decision, p.keep) == ("cold", 0)


def test_a_side_prompt_right_after_the_first_turn_takes_a_state_of_its_own(tok):
    """With ``--sessions 2`` the states are made as needed: after a conversation's first
    turn only its state exists. A side request then (Claude Code's prompt suggestion,
    or a scored prompt) that continues it must still take a new state, not the
    conversation's (it counted the states made, one, and continued it live)."""
    first = FakeSession(tok, [])
    engine = SimpleNamespace(tokenizer=tok, ctx_size=1 << 20, session=first)
    engine.new_session = lambda: FakeSession(tok, [])
    cache = PromptCache(engine, sessions=2)
    conv = BOS + "<｜User｜>the main task<｜Assistant｜></think>"
    lease = cache.begin(Prompt(tok.encode(conv), conv))
    lease.session.tokens = tok.encode(conv + "Sure.")
    lease.session.logits = object()
    fork = conv + "Sure.<｜end▁of▁sentence｜><｜User｜>suggest the next prompt<｜Assistant｜>"
    for flags in ({"side": True}, {"whole": True}):
        side = cache.begin(Prompt(tok.encode(fork), fork, **flags))
        assert side.state.index == 1 and side.session is not first, (flags, side.plan)
        assert first.tokens == tok.encode(conv + "Sure.")  # the conversation is untouched
    again = cache.begin(Prompt(tok.encode(fork), fork))
    assert again.state.index == 0 and again.plan.decision == "exact-token-prefix"


def test_token_id_prompts_never_match_by_text(tok):
    head = tok.encode(BOS + "abc")
    live = head + tok.encode("Hello wor")
    prompt_ids = head + tok.encode("Hello world")
    p = plan_prefill(FakeSession(tok, live), tok, None, prompt_ids)
    assert p.decision == "cold"


def test_live_state_ending_mid_utf8_character_is_not_a_text_prefix(tok):
    head = tok.encode(BOS + "x")
    euro = "€".encode()
    # A token sequence that ends inside the 3-byte "€": its text ends in U+FFFD.
    byte_ids = [i for i in range(tok.vocab_size) if tok.token_bytes(i) == euro[:1]][:1]
    if not byte_ids:
        pytest.skip("no single-byte token for the lead byte")
    live = head + byte_ids
    prompt = BOS + "x€ rest"
    p = plan_prefill(FakeSession(tok, live), tok, prompt, tok.encode(prompt))
    assert p.decision == "cold"


def test_reasoning_carrier_round_trip_and_forgery():
    c = ReasoningCarrier(b"k" * 32)
    secret = "step 1… ünïcode\n</think> inside"
    token = c.seal(secret)
    assert c.open(token) == secret
    # Opaque: encrypted, not a readable encoding of the reasoning.
    body = token.removeprefix(ReasoningCarrier.PREFIX)
    raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    assert "step 1" not in token and secret.encode() not in raw and b"step" not in raw
    assert c.seal(secret) == token  # synthetic nonce: deterministic per text
    assert c.seal(secret + ".") != token
    flipped = body[:20] + ("A" if body[20] != "A" else "B") + body[21:]
    assert c.open(ReasoningCarrier.PREFIX + flipped) is None  # tampered
    assert c.open(token[:-3]) is None  # truncated
    assert ReasoningCarrier(b"x" * 32).open(token) is None  # another server's key
    assert c.open("") is None and c.open("EqUKCk…openai-blob") is None and c.open(None) is None
    assert c.open("ds4r1.c3RlcA.bWFj") is None  # the old HMAC format


def test_error_shapes():
    e = APIError(400, "bad", param="messages.0.role", code="x")
    assert openai_error(e) == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "messages.0.role",
            "code": "x",
        }
    }
    assert anthropic_error(e) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "bad"},
    }
    assert anthropic_error(APIError(413, "big"))["error"]["type"] == "request_too_large"
    assert (
        _loc_to_path(("messages", 0, "content", "list[Block]", 1, "text", "text"))
        == "messages.0.content.1.text.text"
    )


def test_validation_errors_name_the_real_field():
    """Union members (``input.str``) and discriminator tags are not field names; a
    non-object body names its JSON type; a lone surrogate names its field."""
    from ds4mlx.routes.body import validate
    from ds4mlx.routes.openai import ChatRequest
    from ds4mlx.routes.responses import ResponsesRequest

    cases = [
        (ResponsesRequest, {"input": [{"role": "wizard", "content": "x"}]}, "input.0.role"),
        (ResponsesRequest, {"input": [{"type": "function_call_output"}]}, "input.0.call_id"),
        (ResponsesRequest, {"input": 42}, "input"),
        (
            ChatRequest,
            {"messages": [{"role": "user", "content": "a\ud800b"}]},
            "messages.0.content",
        ),
        (ChatRequest, None, None),
    ]
    for model, data, param in cases:
        with pytest.raises(APIError) as e:
            validate(model, data)
        assert e.value.status == 400 and e.value.param == param, e.value.message
    assert "'user'" in _message(ResponsesRequest, {"input": [{"role": "wizard", "content": "x"}]})
    assert _message(ChatRequest, None) == "request body must be a JSON object, got null"
    assert "surrogate" in _message(
        ChatRequest, {"messages": [{"role": "user", "content": "\udfff"}]}
    )


def test_a_long_token_id_prompt_validates_as_ids():
    """A legacy completion's ``prompt`` of token ids longer than the validation slice is
    a list of ids (the first list arm of its union, ``list[str]``, would refuse it)."""
    from ds4mlx.routes.body import SLICE, validate
    from ds4mlx.routes.completions import CompletionRequest

    ids = list(range(1, SLICE * 3))
    assert validate(CompletionRequest, {"prompt": ids}).prompt == ids
    words = ["a"] * (SLICE * 3)
    assert validate(CompletionRequest, {"prompt": words}).prompt == words


def _message(model, data) -> str:
    from ds4mlx.routes.body import validate

    try:
        validate(model, data)
    except APIError as e:
        return e.message
    raise AssertionError("no error")


# ----------------------------------------------------------------- issue 13, item 17


@pytest.mark.parametrize("steps", [0, 1, 2, 3, 4])
def test_job_events_never_swallow_a_cancel_that_races_an_event(steps):
    """A handler cancelled (client gone) just as an event arrives must end cancelled.

    ``asyncio.wait_for`` on 3.11 returned the event and dropped the cancel when the
    inner ``get()`` had completed in the same loop iterations; the stream then kept
    reading and its job ran to ``max_tokens``. ``steps`` walks the cancel across those
    iterations.
    """
    import asyncio

    from ds4mlx.jobs import Job

    async def main() -> tuple[bool, list]:
        job = Job(_gen(), asyncio.get_running_loop())
        got: list = []

        async def consume() -> None:
            async for ev in job.events(keepalive_s=30):
                got.append(ev)

        task = asyncio.create_task(consume())
        for _ in range(3):
            await asyncio.sleep(0)  # the consumer waits on the queue
        job.queue.put_nowait("event")
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await asyncio.wait_for(asyncio.shield(task), 1.0)
        except asyncio.CancelledError:
            return True, got
        except TimeoutError:
            task.cancel()  # still running: the first cancel was swallowed
            return False, got
        return task.cancelled(), got

    cancelled, _ = asyncio.run(main())
    assert cancelled


# ----------------------------------------------------------------- issue 13, item 7


@pytest.mark.parametrize("probe", [True, False])
def test_stream_events_write_between_prefill_chunks(probe):
    """A stream writes a comment (None) after every prefill chunk but the last, and none
    before the first: the write is what notices a client whose connection the server no
    longer reads (tests/test_disconnect_prefill.py). The WebSocket does not probe."""
    import asyncio

    from ds4mlx.jobs import Job, JobDone, JobStarted, PrefillProgress
    from ds4mlx.routes.pipeline import events

    class Enc:
        def opening(self):
            return []

        def idle(self):
            return "idle"

        def started(self, e):
            return ["started"]

        def feed(self, e):
            return [e]

        def done(self, e):
            return ["done"]

        def failed(self, e):
            return ["failed"]

    async def main() -> list:
        job = Job(_gen(), asyncio.get_running_loop())
        for ev in [
            JobStarted(3, 0, "cold"),
            *(PrefillProgress(d, 3) for d in range(4)),
            JobDone("stop", None, 3, 0, 0),
        ]:
            job.queue.put_nowait(ev)
        return [ev async for ev in events(job, Enc(), 60.0, probe=probe)]

    got = asyncio.run(main())
    assert got == (["started", None, None, "done"] if probe else ["started", "done"])


# --------------------------------------------------------------------------- encoders


def _turn_events(cut: bool = False):
    """A turn as the decoder reports it: reasoning, text, one tool call (cut or whole)."""
    from ds4mlx.dsml import (
        TextDelta,
        ThinkingDelta,
        ToolCall,
        ToolCallArgsDelta,
        ToolCallEnd,
        ToolCallStart,
    )

    call = ToolCall("toolu_1", "read", {"path": "a.py"})
    return [
        ThinkingDelta("let me "),
        ThinkingDelta("look"),
        TextDelta("Reading."),
        ToolCallStart(0, "toolu_1", "read"),
        ToolCallArgsDelta(0, '{"path": "a'),
        *([] if cut else [ToolCallArgsDelta(0, '.py"}')]),
        ToolCallEnd(0, call, '{"path": "a.py"}', closed=not cut),
    ]


def _done(finish="stop"):
    from ds4mlx.jobs import JobDone

    return JobDone(finish, None, 10, 4, 7)


def test_anthropic_encoder_stream_and_body_agree():
    """One encoder: the message the stream spells out is the non-streaming body."""
    from ds4mlx.jobs import JobStarted
    from ds4mlx.routes.anthropic import MessageEncoder

    carrier = ReasoningCarrier(b"k" * 32)
    for cut in (False, True):
        enc = MessageEncoder("msg_1", "m", omitted=False, carrier=carrier)
        evs = enc.started(JobStarted(10, 4, "cold"))
        for e in _turn_events(cut):
            evs += enc.feed(e)
        evs += enc.done(_done("length" if cut else "stop"))
        blocks: list[dict] = []
        for ev in evs:
            if ev["type"] == "content_block_start":
                blocks.append(dict(ev["content_block"]))
            elif ev["type"] == "content_block_delta":
                d, b = ev["delta"], blocks[ev["index"]]
                if d["type"] == "thinking_delta":
                    b["thinking"] += d["thinking"]
                elif d["type"] == "signature_delta":
                    b["signature"] = d["signature"]
                elif d["type"] == "text_delta":
                    b["text"] += d["text"]
        body = enc.result()
        assert [b["type"] for b in body["content"]] == (
            ["thinking", "text"] if cut else ["thinking", "text", "tool_use"]
        )
        assert body["content"][:2] == blocks[:2]
        assert carrier.open(body["content"][0]["signature"]) == "let me look"
        assert body["stop_reason"] == ("max_tokens" if cut else "tool_use")
        assert evs[-2]["delta"]["stop_reason"] == body["stop_reason"]
        if not cut:
            assert body["content"][2]["input"] == {"path": "a.py"}


def test_chat_encoder_stream_and_body_agree():
    from ds4mlx.routes.openai import ChatEncoder

    meta = {"id": "c", "created": 0, "model": "m", "system_fingerprint": "x"}
    for cut in (False, True):
        enc = ChatEncoder(meta, thinking=True, include_usage=True, logprobs=False)
        chunks = enc.opening()
        for e in _turn_events(cut):
            chunks += enc.feed(e)
        chunks += enc.done(_done("length" if cut else "stop"))
        assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["prompt_tokens"] == 10
        deltas = [c["choices"][0]["delta"] for c in chunks if isinstance(c, dict) and c["choices"]]
        msg = enc.result()["choices"][0]
        assert msg["message"]["reasoning_content"] == "".join(
            d.get("reasoning_content", "") for d in deltas
        )
        assert msg["message"]["content"] == "".join(d.get("content") or "" for d in deltas)
        assert msg["finish_reason"] == chunks[-3]["choices"][0]["finish_reason"]
        assert msg["finish_reason"] == ("length" if cut else "tool_calls")
        assert ("tool_calls" in msg["message"]) is not cut


def test_log_line_prefill_field():
    """Hardening item 14: a request served wholly from cache does not log 0.0 tok/s."""
    from ds4mlx.server.worker import _prefill_words

    assert _prefill_words(0, 0, 0.0) == "none (all cached)"
    assert _prefill_words(100, 100, 0.5) == "200.0 tok/s"
    assert _prefill_words(100, 40, 0.25) == "cancelled after 40/100 tokens in 0.25s"


def test_text_prefix_requires_the_same_markers(tok):
    """Issue 12, "keys after the hardening issue": the same bytes are not the same prompt
    when content spells a marker the live state holds as a token (or the reverse)."""
    from ds4mlx.dsml import Rendered

    text = BOS + "<｜User｜>a<｜Assistant｜>b"
    rest = "<｜end▁of▁sentence｜><｜User｜>next<｜Assistant｜></think>"
    real = tok.encode(text)  # the state holds real User/Assistant tokens
    # The new prompt has the same bytes, but there "<｜Assistant｜>b" is user content.
    start = len(BOS + "<｜User｜>")
    spelled = Rendered(text + rest, ((start, len(text)),))
    p = plan_prefill(
        FakeSession(tok, real), tok, spelled, tok.encode(spelled.text, content=spelled.content)
    )
    assert p.decision == "cold"
    # The reverse: the state holds the spelling as text, the prompt has real markers.
    plain = tok.encode(BOS) + tok.encode_plain(text[len(BOS) :])
    p = plan_prefill(FakeSession(tok, plain), tok, Rendered(text + rest), tok.encode(text + rest))
    assert p.decision == "cold"
    # Same markers: the text prefix is kept.
    p = plan_prefill(
        FakeSession(tok, real), tok, Rendered(text + rest), tok.encode(text + "x") + [1]
    )
    assert p.decision in ("exact-token-prefix", "text-prefix") and p.keep == len(real)


def test_state_key_from_claude_code_headers_and_prompt_cache_key(caplog):
    """Issue 19: a sub-agent's id over the session's over a body's prompt_cache_key;
    values that are not printable or longer than 256 bytes are ignored, one log line."""
    import logging

    from ds4mlx.routes.common import state_key

    sub = {"x-claude-code-agent-id": "a1", "x-claude-code-session-id": "s1"}
    assert state_key(sub, "k") == "agent:a1"
    assert state_key({"x-claude-code-session-id": "s1"}, "k") == "session:s1"
    assert state_key({}, "k") == state_key(None, "k") == "cache:k"
    assert state_key({}, None) is None
    for bad in ("a\nb", "x" * 257, "", "é" * 129):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ds4mlx.server"):
            assert state_key({"x-claude-code-agent-id": bad}, None) is None
        assert len(caplog.records) == 1, caplog.text
    assert state_key({"x-claude-code-agent-id": "x" * 256}, None) == "agent:" + "x" * 256
    assert state_key({"x-claude-code-agent-id": "a\tb", "x-claude-code-session-id": "s"}) == (
        "session:s"
    )


def test_helper_agents_are_told_by_their_labelled_agent_id():
    """Issue 19: Claude Code names a forked helper agent "a" + label + "-" + 16 hex digits
    (``aprompt_suggestion-…``, ``acompact-…``); an ``Agent``-tool sub-agent is "a" + 16 hex
    digits and is a conversation of its own; no header is no helper."""
    from ds4mlx.routes.common import helper_agent

    def h(v):
        return {"x-claude-code-agent-id": v, "x-claude-code-session-id": "s"}

    for helper in ("aprompt_suggestion-0123456789abcdef", "acompact-00ff00ff00ff00ff"):
        assert helper_agent(h(helper)), helper
    for other in ("a7e7bae38e0463195", "worker@team", "acompact-xyz", "a\nb-0123456789abcdef"):
        assert not helper_agent(h(other)), other
    assert not helper_agent({"x-claude-code-session-id": "s"}) and not helper_agent(None)


def test_env_positive_reads_a_setting_and_names_a_bad_one(monkeypatch, capsys):
    """The server's own periods (`VET_IDLE_S`, `LOG_INTERVAL_S`) and the demo cap
    (`DEMO_MAX_TOKENS`) read their variable: unset or blank keeps the default, a number
    > 0 of the default's type replaces it, anything else is named in one stderr line and
    the default kept (it is read at import: a raise would be a traceback on every command)."""
    from ds4mlx.argtypes import env_positive

    var = "DS4MLX_TEST_SETTING"
    monkeypatch.delenv(var, raising=False)
    assert env_positive(var, 30.0) == 30.0 and env_positive(var, 256) == 256
    monkeypatch.setenv(var, " ")
    assert env_positive(var, 30.0) == 30.0
    monkeypatch.setenv(var, "2.5")
    assert env_positive(var, 30.0) == 2.5
    monkeypatch.setenv(var, "64")
    assert env_positive(var, 256) == 64 and isinstance(env_positive(var, 256), int)
    for bad, default in [
        ("0", 1.0),
        ("-1", 1.0),
        ("soon", 1.0),
        ("inf", 1.0),
        ("nan", 1.0),
        ("2.5", 256),
        ("0", 256),
    ]:
        monkeypatch.setenv(var, bad)
        assert env_positive(var, default) == default
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"ignoring ${var}={bad!r}" in err, err


def test_a_bad_setting_variable_does_not_stop_a_command():
    """The variables are read at import: ``serve`` still says why it cannot start, after
    one line naming the bad value (it was a traceback)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DS4MLX_DEMO_MAX_TOKENS": "abc", "DS4MLX_VET_IDLE_S": "-1"}
    r = subprocess.run(
        [sys.executable, "-m", "ds4mlx.cli", "serve", "-m", "/nonexistent-ds4mlx-model"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "cannot load model" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert "ignoring $DS4MLX_DEMO_MAX_TOKENS='abc'" in r.stderr, r.stderr


# ----------------------------------------------------------------- worker shutdown race


def _stopped_while_held(worker, held, seen, go) -> list:
    """One job submitted to ``worker``: once its thread is held (``held``, an Event),
    ``worker.stop()`` runs on another thread; once ``seen()`` holds, ``go`` releases the
    worker. The job's events, after the stop returned."""
    import asyncio
    import threading

    async def main() -> list:
        job = worker.submit(_gen())
        await asyncio.to_thread(held.wait)
        stopper = threading.Thread(target=worker.stop, kwargs={"timeout": 120})
        stopper.start()
        while not seen():
            await asyncio.sleep(0.01)
        go.set()
        await asyncio.to_thread(stopper.join)
        await asyncio.sleep(0)  # the events the worker posted to this loop
        return [job.queue.get_nowait() for _ in range(job.queue.qsize())]

    return asyncio.run(main())


def test_a_job_taken_as_the_server_stops_never_runs(tiny_model_dir):
    """``Worker.stop`` cancels the running job and refuses the queued ones. A job the
    worker had just taken off the queue was neither while the worker had not yet recorded
    it: the worker thread, preempted there, ran it to its end after the stop. The test
    pauses the worker thread at that point, stops the worker, then lets it go on."""
    import threading

    from ds4mlx.dsml import ToolMemory
    from ds4mlx.engine import Engine
    from ds4mlx.jobs import JobDone, JobStarted
    from ds4mlx.server.worker import Worker

    taken, looked, go = threading.Event(), threading.Event(), threading.Event()

    class Preempted(Worker):
        """Pauses its thread the first time it records a job, until ``go``; a read of the
        running job from another thread meanwhile (``stop``'s) sets ``looked``."""

        @property
        def current(self):
            if taken.is_set() and threading.current_thread().name != "ds4mlx-worker":
                looked.set()
            return self.__dict__.get("_running")

        @current.setter
        def current(self, job) -> None:
            if job is not None and not taken.is_set():
                taken.set()
                go.wait()
            self.__dict__["_running"] = job

    worker = Preempted(tool_memory=ToolMemory())
    worker.start(lambda: Engine.load(str(tiny_model_dir), ctx_size=256))
    # Released once stop() looked for a running job.
    events = _stopped_while_held(worker, taken, looked.is_set, go)
    assert not any(isinstance(e, JobStarted) for e in events), events
    assert [e.finish for e in events if isinstance(e, JobDone)] == ["cancelled"]


def test_a_job_submitted_as_the_server_stops_is_answered(tiny_model_dir, monkeypatch):
    """``submit`` checked "not stopping", then queued the job; a ``stop`` in between
    drained the queue first, so the job was queued after the drain: nothing ran or
    refused it, and its client waited for ever. The test runs ``stop`` there (the whole
    of it, unless it has to wait for the submit)."""
    import asyncio
    import threading

    from ds4mlx.dsml import ToolMemory
    from ds4mlx.engine import Engine
    from ds4mlx.jobs import Failure, JobDone, JobFailed
    from ds4mlx.server.worker import Worker

    worker = Worker(tool_memory=ToolMemory())
    worker.start(lambda: Engine.load(str(tiny_model_dir), ctx_size=256))
    stopper = threading.Thread(target=worker.stop, kwargs={"timeout": 120})
    put = worker._queue.put

    def put_after_a_stop(item, *args, **kwargs) -> None:
        if item is not None and stopper.ident is None:
            stopper.start()
            stopper.join(2)  # times out only while stop waits for this submit
        put(item, *args, **kwargs)

    monkeypatch.setattr(worker._queue, "put", put_after_a_stop)

    async def main() -> list:
        job = worker.submit(_gen())
        await asyncio.to_thread(stopper.join)
        await asyncio.sleep(0)  # the events the worker posted to this loop
        return [job.queue.get_nowait() for _ in range(job.queue.qsize())]

    events = asyncio.run(main())
    # Either answer is right: refused by the drain, or (when the worker thread took the
    # job between the submit's put and stop's flag) started and then cancelled by stop.
    # What was wrong is no answer at all.
    assert events, "the job was never answered"
    if isinstance(events[0], JobFailed):
        assert events == [JobFailed(Failure.SHUTTING_DOWN)]
    else:
        assert [type(e) for e in events if isinstance(e, (JobDone, JobFailed))] == [JobDone]
        assert events[-1].finish == "cancelled", events


def test_a_stop_after_the_answer_interrupts_nothing(tiny_model_dir, monkeypatch, caplog):
    """A job that already emitted its last event (its client has the answer) while its
    worker thread still finishes the bookkeeping (the log line, the bindings): a stop
    then was logged as ``job 1 interrupted`` (seen right after a request). The test
    holds the worker at that point, stops it, and lets it go on."""
    import logging
    import threading

    from ds4mlx.dsml import ToolMemory
    from ds4mlx.engine import Engine
    from ds4mlx.jobs import JobDone
    from ds4mlx.server import worker as worker_mod
    from ds4mlx.server.worker import Worker

    answered, go = threading.Event(), threading.Event()
    log_job = worker_mod._log_job

    def held(*args, **kwargs):
        answered.set()
        go.wait()
        return log_job(*args, **kwargs)

    monkeypatch.setattr(worker_mod, "_log_job", held)
    worker = Worker(tool_memory=ToolMemory())
    worker.start(lambda: Engine.load(str(tiny_model_dir), ctx_size=256))
    with caplog.at_level(logging.INFO, logger="ds4mlx.server"):
        events = _stopped_while_held(worker, answered, lambda: worker.stopping, go)
    assert [e.finish for e in events if isinstance(e, JobDone)] == ["length"]
    assert "interrupted" not in caplog.text, caplog.text


def test_health_says_stopping_once_shutdown_began(tiny_model_dir):
    """Shutdown saves run while the socket still answers: a poller (a supervisor, a load
    balancer, a client waiting to send) must not read "ok" then. The real app and worker
    in process, on the real tiny engine."""
    import asyncio

    from ds4mlx.engine.core import Engine
    from ds4mlx.routes import register
    from ds4mlx.server.app import create_app, start_worker
    from ds4mlx.server.config import ServerConfig

    config = ServerConfig()
    engine, worker = start_worker(lambda: Engine.load(str(tiny_model_dir)), config)
    app = create_app(engine, config, worker, register)

    async def health():
        r = await app.test_client().get("/health")
        return r.status_code, (await r.get_json())["status"]

    try:
        assert asyncio.run(health()) == (200, "ok")
    finally:
        worker.stop()
    assert asyncio.run(health()) == (503, "stopping")


def test_a_lost_rank_fails_the_job_with_one_line_and_a_503(tiny_model_dir, caplog):
    """A job whose forward call finds a rank of the split gone (the ring's error): the
    worker logs one line naming the rank (no traceback, which a dead peer mid-request
    used to put in the log), answers the job with the neutral ``RANK_LOST``, which every
    route words as a 503 server error naming the rank (it was a 500 internal error
    quoting the ring), and stops the server (SIGTERM to itself, caught here) with exit
    code 1. The model's call raises what MLX's ring raises; the rest is real."""
    import asyncio
    import signal

    from ds4mlx.dsml import ToolMemory
    from ds4mlx.engine import Engine
    from ds4mlx.jobs import Failure, JobFailed
    from ds4mlx.routes.errors import failed_to_api
    from ds4mlx.server.worker import Worker

    class _LostRing:
        """The tiny model behind a ring whose peer is gone."""

        def __init__(self, model):
            self._model = model

        def __getattr__(self, name):
            return getattr(self._model, name)

        def __call__(self, *a, **k):
            raise RuntimeError("[ring] connection to a peer was lost")

        def lost_peer(self, exc):
            return f"rank 1 lost: {exc}" if "[ring]" in str(exc) else None

    def load():
        from ds4mlx.model.loading import load_model, read_config
        from ds4mlx.tokenizer import Tokenizer

        model, args = load_model(str(tiny_model_dir), check_memory=False)
        config = read_config(str(tiny_model_dir))
        tok = Tokenizer.load(tiny_model_dir)
        lost = _LostRing(model)
        return Engine(lost, args, tok, path=tiny_model_dir, config=config, ctx_size=256)

    stopped = []
    previous = signal.signal(signal.SIGTERM, lambda *a: stopped.append(a))
    worker = Worker(tool_memory=ToolMemory())
    try:
        worker.start(load)

        async def main() -> list:
            from ds4mlx.jobs import JobDone

            job, events = worker.submit(_gen()), []
            while not isinstance(events[-1:] and events[-1], JobDone | JobFailed):
                events.append(await job.queue.get())
            await asyncio.to_thread(worker.stop, 120)
            return events

        with caplog.at_level("INFO", logger="ds4mlx.server"):
            events = asyncio.run(main())
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = [e for e in events if isinstance(e, JobFailed)]
    assert [f.kind for f in failed] == [Failure.RANK_LOST], events
    error = failed_to_api(failed[0])
    assert error.status == 503 and "rank 1 lost" in error.message, error
    assert worker.exit_code == 1 and stopped
    assert not any(r.exc_info for r in caplog.records), caplog.text
    assert "rank 1 lost: [ring] connection to a peer was lost; stopping" in caplog.text
