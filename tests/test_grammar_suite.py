"""Issue 24's validity suite (slow): >= 50 schemas on the random tiny model, engine level.

The tool schemas are captured at test time from the real CLIs in ``tests/clients``
(``claude -p`` and ``codex exec`` against a loopback capture server, as
``benchmarks/client_capture.py`` captures client traffic; nothing of them is stored here).
Each compilable client tool is offered as a *strict* tool with ``tool_choice``
required: every call that closes must validate against the tool's original schema.
`grammar_cases.SCHEMAS` and a few more are sampled as JSON replies. A schema llguidance
cannot compile must fail with a `GrammarError` naming the keyword and its path (none of
Claude Code's does today: ``TaskCreate``/``TaskUpdate``'s ``propertyNames`` is a zod
record's, which every key satisfies, and is dropped).

Served schemas are the `grammar_cases.bounded` variants (the noise model never ends an
unbounded string) and a tool-call block holds one call (an unbounded repetition of calls
ends by chance too); validation is against the originals. Figures: >= 90 % finish, 100 %
of finished outputs valid, cut outputs are prefixes the grammar accepts.
"""

from __future__ import annotations

import json
import sys

import jsonschema
import llguidance
import pytest
from grammar_cases import SCHEMAS, bounded
from server_util import REPO, require_cli

from ds4mlx.dsml import ToolSpec
from ds4mlx.engine import Engine, SamplingParams, TurnSpec, run_turn
from ds4mlx.engine.grammar import (
    GrammarError,
    ToolRule,
    custom_grammar,
    json_grammar,
    ll_tokenizer,
    turn_grammar,
)

pytestmark = pytest.mark.slow

CHAT = "<｜begin▁of▁sentence｜><｜User｜>go<｜Assistant｜></think>"
EXTRA = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["n"],
    },
    {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1}},
        "required": ["xs"],
    },
    {"type": "object", "properties": {"u": {"type": ["string", "null"]}}, "required": ["u"]},
    {
        "type": "object",
        "properties": {
            "o": {
                "type": "object",
                "properties": {
                    "p": {
                        "type": "object",
                        "properties": {"q": {"type": "integer"}},
                        "required": ["q"],
                    }
                },
                "required": ["p"],
            }
        },
        "required": ["o"],
    },
    {
        "type": "object",
        "properties": {"k": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}},
        "required": ["k"],
    },
    {"type": "string", "enum": ["red", "green", "blue"]},
    {
        "type": "object",
        "properties": {"d": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"}},
        "required": ["d"],
    },
]


def _capture() -> tuple[list[dict], list[dict]]:
    require_cli("claude")
    require_cli("codex")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import client_capture
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return client_capture.capture_claude, client_capture.capture_codex


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> tuple[list[ToolSpec], list[dict]]:
    """``(function tools, custom tools)`` the CLIs send; Codex with the example model
    catalog, so that its freeform ``apply_patch`` (a Lark grammar) is among them."""
    claude, codex = _capture()
    c = claude(tmp_path_factory.mktemp("claude"))["main"]["tools"]
    catalog = REPO / "examples" / "codex-model-catalog.json"
    x = codex(tmp_path_factory.mktemp("codex"), catalog)["main"]["tools"]
    specs = [ToolSpec(t["name"], "", t["input_schema"]) for t in c if "input_schema" in t]
    specs += [
        ToolSpec(t["name"], "", t["parameters"])
        for t in x
        if t.get("type") == "function" and t.get("parameters")
    ]
    return specs, [t for t in x if t.get("type") == "custom"]


@pytest.fixture(scope="module")
def client_tools(captured) -> list[ToolSpec]:
    return captured[0]


@pytest.fixture(scope="module")
def engine(tiny_f32_dir):
    return Engine.load(tiny_f32_dir, ctx_size=2048)


def _sample(engine, grammar, seed: int, **kw):
    s = engine.new_session()
    try:
        sp = SamplingParams(temperature=1.0, top_p=1.0, min_p=0.0, seed=seed)
        spec = TurnSpec(sp, max_tokens=400, grammar=grammar, **kw)
        return run_turn(s, engine.tokenizer, spec, prefill=engine.tokenizer.encode(CHAT))
    finally:
        s.reset()


def test_fifty_schemas(engine, client_tools):
    llt = ll_tokenizer(engine.tokenizer, 129280)
    total = finished = calls = 0
    uncompilable = {}
    for i, tool in enumerate(client_tools):
        try:
            json_grammar(tool.parameters, llt)
        except GrammarError as e:
            uncompilable[tool.name] = (e.message, e.path)
            assert e.path and e.message
            continue
        total += 1
        served = ToolSpec(tool.name, "", bounded(tool.parameters))
        # One call per block (``parallel_tool_calls`` false), for the reason the schemas
        # are bounded: with parallel calls allowed the block is an unbounded repetition
        # of invokes, which the noise model ends only by chance (a tool without
        # parameters drew invoke after invoke to ``max_tokens``), so the finish rate
        # measured the random weights, not the grammar.
        g = turn_grammar(
            [served],
            {tool.name: ToolRule(strict=True)},
            required=True,
            parallel=False,
            tokenizer=llt,
        )
        r = _sample(engine, g, i, tools=[tool], tool_required=True)
        assert len(r.tool_calls) <= 1
        for c in r.tool_calls:
            assert c.name == tool.name and c.id not in r.call_errors
            jsonschema.validate(c.arguments, tool.parameters)
            calls += 1
        if r.finish == "stop":
            finished += 1
            assert r.tool_calls
        else:
            assert llguidance.LLMatcher(llt, g.source, log_level=0).consume_tokens(
                engine.tokenizer.encode(r.raw)
            )
    for j, schema in enumerate(SCHEMAS + EXTRA):
        total += 1
        g = json_grammar(bounded(schema), llt)
        r = _sample(engine, g, 1000 + j)
        if r.finish == "stop":
            finished += 1
            jsonschema.validate(json.loads(r.text), schema)
    print(f"\nschemas={total} finished={finished} calls={calls} uncompilable={uncompilable}")
    assert total >= 50
    assert finished >= 0.9 * total


def test_codex_apply_patch_grammar(engine, captured):
    """Codex's captured ``apply_patch`` Lark grammar compiles, and calls sampled under it
    (``tool_choice`` required) carry an input its grammar accepts: whole when the call
    closed, a prefix when ``max_tokens`` cut it."""
    (patch,) = [t for t in captured[1] if t["name"] == "apply_patch"]
    fmt = patch["format"]
    assert (fmt["type"], fmt["syntax"]) == ("grammar", "lark") and "Begin Patch" in fmt[
        "definition"
    ]
    llt = ll_tokenizer(engine.tokenizer, 129280)
    alone = custom_grammar("lark", fmt["definition"], llt)
    tool = ToolSpec(
        "apply_patch", "", {"type": "object", "properties": {"input": {"type": "string"}}}
    )
    rule = ToolRule(custom=True, syntax="lark", definition=fmt["definition"])
    g = turn_grammar([tool], {"apply_patch": rule}, required=True, tokenizer=llt)
    closed = 0
    for seed in range(3):
        r = _sample(engine, g, 2000 + seed, tools=[tool], tool_required=True)
        assert r.grammar in ("complete", "incomplete"), r.raw
        m = llguidance.LLMatcher(llt, alone.source, log_level=0)
        if r.tool_calls:
            (call,) = r.tool_calls
            text = call.arguments["input"]
            assert m.consume_tokens(engine.tokenizer.encode(text)) and m.is_accepting(), text
            closed += 1
        else:
            assert r.finish == "length" and r.grammar == "incomplete"
    print(f"\napply_patch: {closed}/3 calls closed")
