"""Issue 4, must-hold 1: the official openai and anthropic SDKs against a real server.

One ``ds4mlx serve`` process (tiny model, scripted decoding) for the module. Scripted
decoding makes the model emit thinking, text and DSML tool calls while
the forward passes, KV state and usage stay real.
"""

from __future__ import annotations

import json
import re

import pytest
from server_util import EOS, HTTP, Server, sse_events, tool_call_dsml

MODEL = "deepseek-ai/DeepSeek-V4-Flash"  # a served id with a "/" in it

WEATHER_OAI = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
WEATHER_ANT = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": WEATHER_OAI["function"]["parameters"],
}


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    return tmp_path_factory.mktemp("trace") / "trace.jsonl"


@pytest.fixture(scope="module")
def server(tiny_model_dir, trace_file):
    extra = ["--served-model-name", MODEL, "--keepalive", "0.2", "--trace", str(trace_file)]
    extra += ["--sessions", "1"]  # an unrelated request replaces the one live state
    with Server(tiny_model_dir, ctx=8192, extra=extra) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    import openai  # here, not at module level: collecting the suite need not import the SDKs

    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


# --------------------------------------------------------------------------- models, tokenize


def test_models_list_and_retrieve_ids_with_slash(oai, ant, server):
    ids = [m.id for m in oai.models.list()]
    assert ids[0] == MODEL and "deepseek-chat" in ids
    assert oai.models.retrieve(MODEL).id == MODEL
    assert ant.models.retrieve("deepseek-chat").id == "deepseek-chat"
    # Issue 13 item 15 (was a 404): any name is served, so any id is found, with the
    # model that answers it.
    r = HTTP.get(server.url + "/v1/models/no/such-model")
    assert r.status_code == 200 and r.json()["id"] == "no/such-model"
    assert r.json()["served_as"] == MODEL


def test_tokenize_detokenize_roundtrip(server):
    text = "<｜begin▁of▁sentence｜>Hello, wörld</think>"
    toks = HTTP.post(server.url + "/v1/tokenize", json={"text": text}).json()
    assert toks["count"] == len(toks["tokens"]) and 128822 in toks["tokens"]
    back = HTTP.post(server.url + "/v1/detokenize", json={"tokens": toks["tokens"]}).json()
    assert back["text"] == text
    chat = HTTP.post(
        server.url + "/v1/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat["count"] > 2


# --------------------------------------------------------------------------- OpenAI chat


def test_chat_non_streaming_alias_is_non_thinking(oai):
    r = oai.chat.completions.create(
        model="deepseek-chat",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 3
    assert getattr(r.choices[0].message, "reasoning_content", None) is None


def test_chat_streaming_reasoning_and_usage(oai, server):
    server.script("Think first.</think>Answer." + EOS)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "q"}],
            max_tokens=50,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for c in chunks
        if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == "Think first." and content == "Answer."
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 3


def test_chat_tool_call_round_trip(oai, server):
    server.script(tool_call_dsml("get_weather", city="Paris", days=3), "It is sunny." + EOS)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = oai.chat.completions.create(
        model="deepseek-chat", messages=msgs, tools=[WEATHER_OAI], max_tokens=100, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    msgs += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"},
    ]
    r2 = oai.chat.completions.create(
        model="deepseek-chat", messages=msgs, tools=[WEATHER_OAI], max_tokens=100, temperature=0
    )
    assert r2.choices[0].message.content == "It is sunny."
    assert r2.choices[0].finish_reason == "stop"
    # The live state held the sampled call: only the tool-result suffix was prefilled.
    assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens


def test_chat_streaming_tool_call_header_then_argument_deltas(oai, server):
    server.script("Need weather.</think>" + tool_call_dsml("get_weather", city="Oslo"))
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Oslo?"}],
        tools=[WEATHER_OAI],
        stream=True,
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    tc = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert tc[0].id and tc[0].function.name == "get_weather" and tc[0].function.arguments == ""
    assert len(tc) > 2, "arguments should stream in pieces"
    assert json.loads("".join(t.function.arguments or "" for t in tc)) == {"city": "Oslo"}


def test_stop_sequences(oai, server):
    server.script("alpha beta STOP gamma" + EOS)
    r = oai.chat.completions.create(
        model="deepseek-chat",
        messages=[{"role": "user", "content": "x"}],
        stop=["STOP"],
        max_tokens=50,
    )
    assert r.choices[0].message.content == "alpha beta " and r.choices[0].finish_reason == "stop"


def _after_invoke_name(name: str | None, **params) -> str:
    """What the model samples after a forced tool-call opening (``invoke name="``)."""
    full = tool_call_dsml(name or "get_weather", **params)
    rest = full.split('<｜DSML｜invoke name="', 1)[1]
    return rest if name is None else rest.split('">\n', 1)[1]


def test_chat_tool_choice_required_forces_the_call_block(oai, server):
    """tool_choice=required: the worker opens the DSML block; the model only continues
    it (without the fix, the scripted continuation is plain text and no call comes back).
    The forced bytes are in the live state: the tool result continues it."""
    server.script(_after_invoke_name(None, city="Bern"), "Mild." + EOS)
    msgs = [{"role": "user", "content": "Bern?"}]
    kw = {"model": "deepseek-chat", "tools": [WEATHER_OAI], "max_tokens": 100}
    r = oai.chat.completions.create(messages=msgs, tool_choice="required", **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Bern"}
    msgs += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "mild"},
    ]
    r2 = oai.chat.completions.create(messages=msgs, **kw)
    assert r2.choices[0].message.content == "Mild."
    assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens


def test_messages_tool_choice_named_tool_after_thinking(ant, server):
    """Anthropic {"type":"tool","name":…} in thinking mode: forced after </think>."""
    server.script("Must call it.</think>" + _after_invoke_name("get_weather", city="Riga"))
    m = ant.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=[{"role": "user", "content": "Riga?"}],
        tools=[WEATHER_ANT],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert [b.type for b in m.content] == ["thinking", "tool_use"], m.content
    assert m.content[0].thinking == "Must call it."
    assert m.content[1].input == {"city": "Riga"} and m.stop_reason == "tool_use"
    server.script("</think>" + _after_invoke_name(None, city="Oslo"))
    m = ant.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=[{"role": "user", "content": "Oslo?"}],
        tools=[WEATHER_ANT],
        tool_choice={"type": "any"},
    )
    assert [b.type for b in m.content] == ["tool_use"], m.content  # empty thinking: no block
    assert m.content[0].input == {"city": "Oslo"}


def test_responses_tool_choice_function_streams_the_forced_call(oai, server):
    server.script("Hm.</think>" + _after_invoke_name("get_weather", city="Nice"))
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "parameters": WEATHER_OAI["function"]["parameters"],
        }
    ]
    events = list(
        oai.responses.create(
            model=MODEL,
            input="Nice?",
            tools=tools,
            tool_choice={"type": "function", "name": "get_weather"},
            stream=True,
        )
    )
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "function_call"], done.output
    assert json.loads(done.output[1].arguments) == {"city": "Nice"}


def test_chat_logprobs_top_n_streaming_and_not(oai):
    kw = {
        "model": "deepseek-chat",
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    r = oai.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert e.token == e.top_logprobs[0].token  # greedy picks the most likely token
        assert abs(e.logprob - lps[0]) < 1e-4 and bytes(e.bytes).decode("utf-8", "replace")
    assert "".join(e.token for e in content) == r.choices[0].message.content
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]
    r = oai.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert r.choices[0].logprobs is None


def test_chat_top_logprobs_needs_logprobs_and_a_range(oai):
    """OpenAI's answer: ``top_logprobs`` without ``logprobs: true`` (or out of 0..20) is a
    400 naming ``top_logprobs``, not a wish silently dropped."""
    import openai

    kw = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "Hi"}]}
    for extra in (
        {"top_logprobs": 2},
        {"top_logprobs": 0, "logprobs": False},
        {"logprobs": True, "top_logprobs": 21},
    ):
        with pytest.raises(openai.BadRequestError) as ei:
            oai.chat.completions.create(**kw, **extra, max_tokens=2)
        assert ei.value.param == "top_logprobs", (extra, ei.value.body)
        assert "top_logprobs" in ei.value.message


def test_responses_logprobs_on_deltas_done_event_and_output_text(oai):
    """``include: ["message.output_text.logprobs"]`` + ``top_logprobs``: each
    ``output_text.delta`` carries its tokens' entries, ``output_text.done`` and the final
    ``output_text`` part all of them (the SDK's ``Logprob`` types); without the include,
    none."""
    import openai

    kw = {
        "model": "deepseek-chat",
        "input": "Count.",
        "max_output_tokens": 6,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 3,
    }
    r = oai.responses.create(**kw)
    part = r.output[-1].content[0]
    assert part.type == "output_text" and part.text and part.logprobs
    for e in part.logprobs:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert e.token == e.top_logprobs[0].token  # greedy picks the most likely token
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token or "\ufffd" in e.token
    assert "".join(e.token for e in part.logprobs) == part.text
    events = list(oai.responses.create(**kw, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [(lp.token, round(lp.logprob, 4)) for d in deltas for lp in d.logprobs]
    assert streamed == [(e.token, round(e.logprob, 4)) for e in part.logprobs]
    assert all(len(lp.top_logprobs) == 3 for d in deltas for lp in d.logprobs)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.token for lp in done.logprobs] == [e.token for e in part.logprobs]
    final = events[-1].response.output[-1].content[0]
    assert [lp.token for lp in final.logprobs] == [e.token for e in part.logprobs]
    # Without the include nothing is asked of the engine, and every list stays empty.
    plain = {k: v for k, v in kw.items() if k != "include"}
    assert oai.responses.create(**plain).output[-1].content[0].logprobs == []
    events = list(oai.responses.create(**plain, stream=True))
    assert all(not e.logprobs for e in events if e.type.startswith("response.output_text."))
    with pytest.raises(openai.BadRequestError) as ei:
        oai.responses.create(**{**kw, "top_logprobs": 21})
    assert ei.value.param == "top_logprobs" and "top_logprobs" in ei.value.message
    # The WebSocket speaks the same events.
    with oai.beta.responses.connect() as conn:
        conn.response.create(**kw)
        events = []
        for ev in conn:
            events.append(ev)
            if ev.type in ("response.completed", "response.incomplete", "response.failed"):
                break
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [lp.token for d in deltas for lp in d.logprobs] == [e.token for e in part.logprobs]
    final = events[-1].response.output[-1].content[0]
    assert [lp.token for lp in final.logprobs] == [e.token for e in part.logprobs]


# --------------------------------------------------------------------------- OpenAI completions


def test_completions_text_logprobs_echo(oai):
    r = oai.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    c = r.choices[0]
    assert c.text.startswith("The sky is") and len(c.text) > len("The sky is")
    # Echoed prompt tokens come first, scored (the first one after the BOS the server
    # prepended, which is not echoed); then the 4 sampled.
    n_prompt = r.usage.prompt_tokens - 1
    assert len(c.logprobs.tokens) == n_prompt + 4
    assert "".join(c.logprobs.tokens[:n_prompt]) == "The sky is"
    assert all(len(t) == 2 for t in c.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert c.logprobs.text_offset[n_prompt] == len("The sky is")
    assert r.usage.completion_tokens == 4


def _lm_eval_loglikelihood(out: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's ``local-completions`` reading of a scoring response (its
    ``parse_logprobs``): the continuation's summed logprobs and whether each of its
    tokens was the most likely."""
    lp = out["choices"][0]["logprobs"]
    tokens_logprobs = lp["token_logprobs"][ctxlen:-1]
    tops = lp["top_logprobs"][ctxlen:-1]
    greedy = all(t == max(top.values()) for t, top in zip(tokens_logprobs, tops, strict=True))
    return sum(tokens_logprobs), greedy


def test_completions_score_the_prompt_as_lm_eval_asks(oai, server, trace_file):
    """lm-eval's loglikelihood requests (``local-completions``: a token-id prompt,
    ``echo``, ``logprobs`` 1, ``max_tokens`` 1) get every prompt token scored: a
    continuation fed back as prompt scores as it was sampled (scripted ids, their
    logprobs under the real logits), and each top entry is its position's best. A scored
    prompt reuses no cached prefix (decision ``cold``, every time), and ``max_tokens`` 0
    scores it alone. (Before, the echoed tokens had null logprobs: lm-eval's sum failed.)"""
    url = server.url + "/v1/completions"
    # lm-eval's remote tokenizer (vLLM's routes at the server's root): the probe, then
    # each text encoded without special tokens.
    info = HTTP.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == EOS and info["bos_token"] == "<｜begin▁of▁sentence｜>"

    def encode(text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False}
        return HTTP.post(server.url + "/tokenize", json=body).json()["tokens"]

    context = [0, *encode("Paris is the capital of")]
    cont = encode(" France, and")
    back = HTTP.post(server.url + "/detokenize", json={"tokens": cont}).json()
    assert back["prompt"] == " France, and"
    r = HTTP.post(server.url + "/debug/script", json={"tokens": [cont]})
    assert r.status_code == 200, r.text
    gen = oai.completions.create(
        model=MODEL, prompt=context, max_tokens=len(cont), temperature=0, logprobs=1
    ).choices[0]
    sampled = gen.logprobs.token_logprobs
    greedy_then = all(
        v == max(top.values()) for v, top in zip(sampled, gen.logprobs.top_logprobs, strict=True)
    )
    body = {"model": MODEL, "prompt": [context + cont], "temperature": 0, "max_tokens": 1}
    body |= {"logprobs": 1, "seed": 1234, "echo": True}
    n = len(context) + len(cont)
    for _ in range(2):  # the second time too: no cached prefix leaves tokens unscored
        r = HTTP.post(url, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        lp = out["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == n + 1 and out["usage"]["prompt_tokens"] == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
        assert all(
            max(top.values()) >= v
            for v, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True)
        )
        assert lp["token_logprobs"][len(context) : n] == pytest.approx(sampled, abs=1e-3)
        total, greedy = _lm_eval_loglikelihood(out, len(context))
        assert total == pytest.approx(sum(sampled), abs=1e-3) and greedy == greedy_then
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    records = [json.loads(line) for line in trace_file.read_text().splitlines()]
    plans = [rec for rec in records if rec.get("kind") == "plan"]
    assert [p["decision"] for p in plans[-2:]] == ["cold", "cold"], plans[-2:]
    # max_tokens 0: the prompt scored, nothing generated; streamed, the echo comes first
    # with its logprobs.
    body |= {"max_tokens": 0}
    alone = HTTP.post(url, json=body).json()
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]
    assert alone["usage"]["completion_tokens"] == 0
    chunks = list(oai.completions.create(**{**body, "prompt": context + cont}, stream=True))
    first = chunks[0].choices[0]
    assert first.logprobs.token_logprobs == lp["token_logprobs"][:-1]
    assert first.text == alone["choices"][0]["text"]
    r = HTTP.post(url, json={**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # The one token generated is EOS: it is listed too (lm-eval drops the last entry as
    # the generated one; without it the continuation's last token was dropped instead).
    eos = HTTP.post(server.url + "/tokenize", json={"prompt": EOS}).json()["tokens"]
    body |= {"max_tokens": 1, "logit_bias": {str(eos[0]): 100}}
    out = HTTP.post(url, json=body).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 1
    assert choice["logprobs"]["token_logprobs"][:-1] == lp["token_logprobs"][:-1]
    assert choice["logprobs"]["tokens"][-1] == EOS and choice["text"] == alone["choices"][0]["text"]
    assert _lm_eval_loglikelihood(out, len(context))[0] == pytest.approx(sum(sampled), abs=1e-3)


def test_completions_logprobs_of_characters_split_across_tokens(server):
    """Emoji and CJK characters split across tokens: each part is spelled
    ``bytes:\\xNN…`` (OpenAI's spelling; U+FFFD made every part the same
    ``top_logprobs`` key, and a less likely one overwrote the best), and ``text_offset``
    follows the text (each part at its character's start; it counted U+FFFD as a
    character per part, so every later offset was off)."""
    text = "🤗😀 日本語 𝔘 and more"
    body = {"model": MODEL, "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 5}
    r = HTTP.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert r.json()["choices"][0]["text"] == text
    parts = [t for t in lp["tokens"] if t.startswith("bytes:")]
    assert parts and all(re.fullmatch(r"bytes:(\\x[0-9a-f]{2})+", t) for t in parts), parts
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for token, at in zip(lp["tokens"], offsets, strict=True):
        if not token.startswith("bytes:"):
            assert text[at:].startswith(token), (token, at)
    for top in lp["top_logprobs"][1:]:
        assert list(top.values()) == sorted(top.values(), reverse=True)


def test_a_scored_prompt_may_fill_the_context(server_factory, tiny_model_dir):
    """``max_tokens: 0`` with ``echo`` generates nothing, so a prompt of exactly ``--ctx``
    tokens is scored (lm-eval's rolling windows are ``max_length`` tokens long, which a
    user may set to the server's context); one token more, or the same prompt asking for
    a token, is the usual ``context_length_exceeded``. (Before, the exact fit was refused
    as "leaving no room for output".)"""
    ctx = 256
    s = server_factory(tiny_model_dir, ctx=ctx, extra=["--kv-disk-dir", "none"])
    url = s.url + "/v1/completions"
    ids = [0, *range(1000, 1000 + ctx - 1)]
    text = " a" * (ctx - 1)  # one token per " a", after the BOS the route puts first
    tokens = HTTP.post(s.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    assert len(tokens) == ctx - 1 and 0 not in tokens, tokens[:4]
    body = {"model": MODEL, "echo": True, "logprobs": 0, "max_tokens": 0, "temperature": 0}
    for prompt in (ids, text):
        r = HTTP.post(url, json={**body, "prompt": prompt})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert len(lp) == ctx - (prompt is text) and all(v is not None for v in lp[1:])
    for extra in (
        {"prompt": [*ids, 1000]},
        {"prompt": text + " a"},
        {"prompt": ids, "max_tokens": 1},
        {"prompt": text, "max_tokens": 1},
    ):
        r = HTTP.post(url, json={**body, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_completions_of_several_prompts_answer_each_at_its_index(oai, server):
    """A list of prompts (lm-eval's ``batch_size``; texts or token-id lists): one choice
    per prompt, at its index, each as its own request would have it (a scored echo
    included), usage summed. Streaming several, or more than 128, is a 400. (Before,
    several prompts were a 400.)"""
    url = server.url + "/v1/completions"
    a, b = [0, 19923, 2058], [0, 1000, 1001, 1002]
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
    alone = [HTTP.post(url, json={**body, "prompt": p}).json() for p in (a, b)]
    both = HTTP.post(url, json={**body, "prompt": [a, b]}).json()
    assert [c["index"] for c in both["choices"]] == [0, 1]
    for got, want in zip(both["choices"], alone, strict=True):
        want = want["choices"][0]
        assert got["text"] == want["text"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(
            want["logprobs"]["token_logprobs"], abs=1e-4
        )
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert both["usage"][k] == sum(r["usage"][k] for r in alone)
    texts = oai.completions.create(
        model=MODEL, prompt=["The sky is", "Paris is"], max_tokens=2, temperature=0
    )
    assert [c.index for c in texts.choices] == [0, 1] and texts.usage.completion_tokens == 4
    # Refusals name the prompt, and come before anything is queued (a too-long last
    # prompt cost the others' generation, then said only "prompt").
    submitted = server.health()["submitted"]
    long = [0] * server.health()["ctx"]
    for extra, param in (
        ({"stream": True}, "stream"),
        ({"prompt": [a] * 129}, "prompt"),
        ({"prompt": [a, [3, -1]]}, "prompt.1"),
        ({"prompt": [a, []]}, "prompt.1"),
        ({"prompt": [a, long]}, "prompt.1"),
    ):
        r = HTTP.post(url, json={**body, "prompt": [a, b], **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # A list of mixed kinds is named as such (it said "prompt.0: Input should be a valid
    # string" of a valid token-id prompt).
    for mixed in ([a, "The sky is"], [1, [2]], ["The sky is", 3]):
        r = HTTP.post(url, json={**body, "prompt": mixed})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "not a mix" in r.json()["error"]["message"], r.text
    assert server.health()["submitted"] == submitted and server.health()["queued"] == 0


def test_several_prompts_leave_room_for_other_clients(server, trace_file):
    """The prompts of one request are queued one at a time: another client's request,
    sent while the first prompt runs, is served before the list's later prompts (all
    were queued at once: it waited for the whole list, 130 s behind 128 prompts)."""
    import threading

    url = server.url + "/v1/completions"
    many = {"model": MODEL, "max_tokens": 48, "prompt": [f"List item {i}:" for i in range(4)]}
    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(r=HTTP.post(url, json=many)))
    runner.start()
    while not server.health()["busy"] and runner.is_alive():  # the first prompt runs
        pass
    other = HTTP.post(url, json={"model": MODEL, "max_tokens": 2, "prompt": "Another client"})
    runner.join(120)
    assert other.status_code == 200 and out["r"].status_code == 200
    records = [json.loads(line) for line in trace_file.read_text().splitlines()]
    jobs = {rec["text"]: rec["job"] for rec in records if rec.get("kind") == "prompt"}
    theirs = [jobs[f"<｜begin▁of▁sentence｜>List item {i}:"] for i in range(4)]
    assert theirs == sorted(theirs)
    assert jobs["<｜begin▁of▁sentence｜>Another client"] < theirs[-1], (jobs, theirs)


def test_completions_token_ids_and_streaming(oai):
    ids = HTTP.post(
        str(oai.base_url).rstrip("/").removesuffix("/v1") + "/v1/tokenize", json={"text": "Hello"}
    ).json()
    prompt = [0, *ids["tokens"]]
    full = (
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
        .choices[0]
        .text
    )
    parts = list(
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, stream=True)
    )
    assert "".join(p.choices[0].text for p in parts if p.choices) == full
    assert parts[-1].choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- Anthropic


def test_messages_non_streaming_thinking_and_text(ant, server):
    server.script("Pondering.</think>Hi!" + EOS)
    m = ant.messages.create(
        model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "hello"}]
    )
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Pondering." and m.content[0].signature
    assert m.content[1].text == "Hi!" and m.stop_reason == "end_turn"
    n = ant.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hello"}])
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_messages_streaming_tool_use_round_trip(ant, server):
    server.script(
        "Checking.</think>" + tool_call_dsml("get_weather", city="Rome", days=2),
        "Ok.</think>Warm." + EOS,
    )
    msgs = [{"role": "user", "content": "Weather in Rome?"}]
    with ant.messages.stream(
        model=MODEL, max_tokens=32000, messages=msgs, tools=[WEATHER_ANT]
    ) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert "ping" not in events[:1] and events[0] == "message_start"
    assert final.stop_reason == "tool_use"
    tool = [b for b in final.content if b.type == "tool_use"][0]
    assert tool.id.startswith("toolu_") and tool.input == {"city": "Rome", "days": 2}
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "25C"}],
        },
    ]
    with ant.messages.stream(
        model=MODEL, max_tokens=32000, messages=msgs, tools=[WEATHER_ANT]
    ) as s:
        final2 = s.get_final_message()
    assert final2.stop_reason == "end_turn"
    assert [b.text for b in final2.content if b.type == "text"] == ["Warm."]
    assert final2.usage.cache_read_input_tokens > 0


def test_messages_thinking_display_omitted_and_signature_replay(ant, server):
    """Thinking sent without text still replays exactly: the signature carries it."""
    server.script("Secret plan." + "</think>" + tool_call_dsml("get_weather", city="Lima"))
    msgs = [{"role": "user", "content": "Lima?"}]
    m = ant.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=msgs,
        tools=[WEATHER_ANT],
        extra_body={"thinking": {"type": "adaptive", "display": "omitted"}},
    )
    assert m.content[0].type == "thinking" and m.content[0].thinking == ""
    tool = m.content[-1]
    # Replay on a session that lost the live state: the rendered prefix must be exact.
    HTTP.post(server.url + "/v1/completions", json={"prompt": "unrelated", "max_tokens": 1})
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "20C"}],
        },
    ]
    body = {"model": MODEL, "max_tokens": 10, "messages": msgs, "tools": [WEATHER_ANT]}
    server.script("</think>Done." + EOS)
    rendered = HTTP.post(server.url + "/v1/messages/count_tokens", json=body).json()["input_tokens"]
    unsigned = json.loads(json.dumps(body))
    unsigned["messages"][1]["content"][0]["signature"] = ""
    without = HTTP.post(server.url + "/v1/messages/count_tokens", json=unsigned).json()[
        "input_tokens"
    ]
    assert rendered - without == 3  # "Secret plan." came back through the signature
    m2 = ant.messages.create(**body)
    assert [b.text for b in m2.content if b.type == "text"] == ["Done."]
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == rendered


def test_messages_disabled_thinking_and_system_blocks(ant, server):
    server.script("Plain." + EOS)
    m = ant.messages.create(
        model=MODEL,
        max_tokens=20,
        system=[{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}],
        thinking={"type": "disabled"},
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            }
        ],
        metadata={"user_id": "u"},
    )
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Plain."


def test_anthropic_keepalive_pings_during_long_prefill(server):
    long = " ".join(f"word{i}" for i in range(1500))
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "stream": True,
        "messages": [{"role": "user", "content": long}],
    }
    with HTTP.stream("POST", server.url + "/v1/messages", json=body, timeout=120) as r:
        evs = [e for e, _ in sse_events(r.iter_lines())]
    first_block = (
        evs.index("content_block_start")
        if "content_block_start" in evs
        else evs.index("message_delta")
    )
    assert "ping" in evs[:first_block] or None in evs[:first_block], evs[:10]


# --------------------------------------------------------------------------- Responses


def test_responses_text_and_function_call_round_trip(oai, server):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "parameters": WEATHER_OAI["function"]["parameters"],
        },
        {"type": "web_search"},
    ]
    server.script("Let me look.</think>" + tool_call_dsml("get_weather", city="Kyiv"))
    r = oai.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Kyiv weather?"}]}],
        tools=tools,
        store=False,
        include=["reasoning.encrypted_content"],
    )
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "function_call"] and r.status == "completed"
    reasoning, call = r.output
    assert reasoning.encrypted_content and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Kyiv"}
    # Lose the live state, then replay statelessly: the carrier rebuilds the exact prefix.
    oai.completions.create(model=MODEL, prompt="unrelated", max_tokens=1)
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Kyiv weather?"}]},
        reasoning.model_dump(exclude_none=True),
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "-5C"},
    ]
    server.script("Hm.</think>Cold." + EOS)
    events = list(
        oai.responses.create(model=MODEL, input=items, tools=tools, stream=True, store=False)
    )
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.output_text.delta" in types
    done = events[-1].response
    assert done.output_text == "Cold."
    assert done.usage.input_tokens > 0 and done.usage.output_tokens > 0


def test_responses_streaming_function_call_events(oai, server):
    server.script("</think>" + tool_call_dsml("get_weather", city="Nice", days=1))
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "parameters": WEATHER_OAI["function"]["parameters"],
        }
    ]
    events = list(oai.responses.create(model=MODEL, input="Nice?", tools=tools, stream=True))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    assert "response.function_call_arguments.done" in types
    done = [
        e
        for e in events
        if e.type == "response.output_item.done" and e.item.type == "function_call"
    ][0]
    assert json.loads(done.item.arguments) == {"city": "Nice", "days": 1}
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_stream_opens_every_content_part_it_writes_to(oai, server):
    """Each text or reasoning delta of a Responses stream goes to a content part a
    ``response.content_part.added`` opened, and ``content_part.done`` closes it, for
    the reasoning item too: openai-node's accumulator (``responses.stream()``) raised
    ``missing content at index 0`` on the first reasoning delta of every thinking
    reply. Replayed here as that accumulator builds the response."""
    server.script("Thinking R.</think>Answer R." + EOS)
    events = [e.model_dump() for e in oai.responses.create(model=MODEL, input="hi", stream=True)]
    items: dict[int, dict] = {}
    for e in events:
        t = e["type"]
        if t == "response.output_item.added":
            items[e["output_index"]] = {**e["item"], "content": []}
        elif t == "response.content_part.added":
            items[e["output_index"]]["content"].append(dict(e["part"]))
        elif t in ("response.reasoning_text.delta", "response.output_text.delta"):
            part = items[e["output_index"]]["content"][e["content_index"]]  # IndexError
            part["text"] += e["delta"]
        elif t == "response.content_part.done":
            assert items[e["output_index"]]["content"][e["content_index"]] == e["part"], e
    kinds = [(i["type"], [p["type"] for p in i["content"]]) for _, i in sorted(items.items())]
    assert kinds == [("reasoning", ["reasoning_text"]), ("message", ["output_text"])], kinds
    assert [p["text"] for _, i in sorted(items.items()) for p in i["content"]] == [
        "Thinking R.",
        "Answer R.",
    ]
    done = [e["type"] for e in events if e["type"].endswith(".done")]
    assert done.count("response.content_part.done") == 2, done


def test_responses_input_tokens_count_what_the_response_is_charged(oai, server):
    """``POST /v1/responses/input_tokens`` (openai's ``responses.input_tokens.count``)
    answers the input tokens the same request is then charged, without queueing a job
    (it was a 405: only ``GET /v1/responses/{id}`` matched the path)."""
    body = {"model": "deepseek-chat", "input": "Count me, please.", "instructions": "Be brief."}
    submitted = server.health()["submitted"]
    n = oai.responses.input_tokens.count(**body)
    assert n.object == "response.input_tokens" and n.input_tokens > 5, n
    assert server.health()["submitted"] == submitted  # no job
    r = oai.responses.create(**body, max_output_tokens=2)
    assert r.usage.input_tokens == n.input_tokens, (r.usage, n)


def test_responses_item_references_to_answered_items_resolve(oai, server):
    """A client with ``store: true`` (the Vercel AI SDK's default) replays earlier
    output items as ``item_reference``s: those the server answered resolve to the items
    as sent, and the conversation goes on from the live state (its prefix cached); an
    id it never answered is a 400 naming the item (every reference was a 400)."""
    import openai

    server.script("Thinking it over.</think>First answer." + EOS)
    first = oai.responses.create(model=MODEL, input="Question one?")
    ids = [it.id for it in first.output]
    assert [it.type for it in first.output] == ["reasoning", "message"], first.output
    history = [
        {"role": "user", "content": "Question one?"},
        *({"type": "item_reference", "id": i} for i in ids),
        {"role": "user", "content": "And two?"},
    ]
    server.script("More.</think>Second answer." + EOS)
    second = oai.responses.create(model=MODEL, input=history)
    assert second.output_text == "Second answer.", second
    assert second.usage.input_tokens_details.cached_tokens > 0, second.usage
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(
            model=MODEL, input=[*history[:1], {"type": "item_reference", "id": "msg_unknown"}]
        )
    assert "msg_unknown" in str(e.value) and e.value.body["param"] == "input[1]", e.value.body


def test_the_model_is_told_the_reply_format(oai, server):
    """A structured-output schema (descriptions included) is rendered into the system
    block, as DeepSeek's conversion renders it (tests/test_recipe_conformance.py checks
    the bytes): before, only the grammar mask knew it, and the prompt was the same
    8 tokens with or without it. Chat's response_format and Responses' text.format."""
    schema = {
        "type": "object",
        "properties": {"temp": {"type": "integer", "description": "Fahrenheit, never Celsius"}},
        "required": ["temp"],
    }
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    counts = []
    for fmt in (None, {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}):
        server.script('{"temp":70}' + EOS)
        kw = {"response_format": fmt} if fmt else {}
        r = oai.chat.completions.create(model="deepseek-chat", messages=ask, max_tokens=8, **kw)
        counts.append(r.usage.prompt_tokens)
    assert counts[1] > counts[0] + 20, counts
    server.script('{"temp":70}' + EOS)
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": schema}}
    r = oai.responses.create(model="deepseek-chat", input=ask, text=fmt, max_output_tokens=8)
    assert r.usage.input_tokens == counts[1], (r.usage, counts)


def test_responses_previous_response_id_rejected_clearly(oai):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in str(e.value) and "store" in str(e.value)


def test_responses_max_output_tokens_incomplete(oai, server):
    r = oai.responses.create(model="deepseek-chat", input="hi", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    # Cut inside its reasoning, the reasoning item is incomplete too (as a cut message is);
    # a whole one is completed.
    think = {"effort": "high"}
    server.script("Weighing the options at some length.</think>Done." + EOS)
    r = oai.responses.create(model=MODEL, input="hi", max_output_tokens=3, reasoning=think)
    assert [(it.type, it.status) for it in r.output] == [("reasoning", "incomplete")]
    server.script("Brief.</think>Done." + EOS)
    r = oai.responses.create(model=MODEL, input="hi again", reasoning=think)
    assert [(it.type, it.status) for it in r.output] == [
        ("reasoning", "completed"),
        ("message", "completed"),
    ]


def test_trace_records_prompts_decisions_output_and_parser_events(oai, server, trace_file):
    server.script("Trace me.</think>" + tool_call_dsml("get_weather", city="Bern"))
    oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Bern?"}], tools=[WEATHER_OAI]
    )
    server.wait_idle()
    recs = [json.loads(line) for line in trace_file.read_text().splitlines()]
    job = recs[-1]["job"]
    mine = [r for r in recs if r["job"] == job]
    kinds = [r["kind"] for r in mine]
    assert kinds[:2] == ["prompt", "plan"] and kinds[-2:] == ["output", "done"]
    assert mine[0]["text"].startswith("<｜begin▁of▁sentence｜>") and "Bern?" in mine[0]["text"]
    assert mine[1]["decision"] in ("cold", "exact-token-prefix", "text-prefix")
    parser = [r["event"]["type"] for r in mine if r["kind"] == "parser"]
    assert "ThinkingDelta" in parser and "ToolCallEnd" in parser
    assert mine[-2]["text"].startswith("Trace me.</think>")


# --------------------------------------------------------------------------- cut tool calls

# A call the output limit cuts inside its command (hardening issue, item 2).
CUT = (
    '</think>Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris and then rm -rf everything else'
)


def _cut_budget(server) -> int:
    """max_tokens that stops the scripted turn inside the city value."""
    r = HTTP.post(server.url + "/v1/tokenize", json={"text": CUT}, timeout=30)
    return r.json()["count"] - 4


def test_cut_tool_call_is_never_a_runnable_call_anthropic(server, ant):
    n = _cut_budget(server)
    server.script(CUT)
    msg = ant.messages.create(
        model=MODEL, max_tokens=n, tools=[WEATHER_ANT], messages=[{"role": "user", "content": "go"}]
    )
    assert msg.stop_reason == "max_tokens"
    assert [b.type for b in msg.content if b.type == "tool_use"] == []
    server.script(CUT)
    with ant.messages.stream(
        model=MODEL, max_tokens=n, tools=[WEATHER_ANT], messages=[{"role": "user", "content": "go"}]
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    for b in final.content:
        if b.type == "tool_use":  # streamed before the cut: its input is not the cut value
            assert "city" not in b.input, b.input


def test_cut_tool_call_is_never_a_runnable_call_openai_chat(server, oai):
    n = _cut_budget(server)
    server.script(CUT)
    kw = dict(
        model=MODEL, max_tokens=n, tools=[WEATHER_OAI], messages=[{"role": "user", "content": "go"}]
    )
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    server.script(CUT)
    args, finish = "", None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                args += (tc.function and tc.function.arguments) or ""
            finish = c.finish_reason or finish
    assert finish == "length" and args.startswith('{"city": "Paris')
    with pytest.raises(ValueError):
        json.loads(args)


def test_cut_tool_call_is_never_a_runnable_call_responses(server, oai):
    n = _cut_budget(server)
    tool = {"type": "function", **WEATHER_OAI["function"]}
    kw = dict(model=MODEL, max_output_tokens=n, tools=[tool], input="go")
    server.script(CUT)
    r = oai.responses.create(**kw)
    assert (
        r.status == "incomplete" and [o.type for o in r.output if o.type == "function_call"] == []
    )
    server.script(CUT)
    done_items, final = [], None
    for ev in oai.responses.create(stream=True, **kw):
        if ev.type == "response.output_item.done":
            done_items.append(ev.item)
        elif ev.type == "response.function_call_arguments.done":
            raise AssertionError("a cut call must not report complete arguments")
        elif ev.type in ("response.incomplete", "response.completed"):
            final = ev.response
    calls = [i for i in done_items if i.type == "function_call"]
    assert [c.status for c in calls] == ["incomplete"]
    with pytest.raises(ValueError):
        json.loads(calls[0].arguments)
    assert final.status == "incomplete" and not [
        o for o in final.output if o.type == "function_call"
    ]
