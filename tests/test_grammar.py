"""Grammar-constrained decoding in the one turn loop (``ds4mlx.engine.grammar``), on the
real tiny model: validity of sampled JSON under a schema (and its invalidity without
one), free reasoning before ``</think>``, strict tool calls, exactness against
unconstrained decoding, and compile errors naming the problem and its path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future

import jsonschema
import llguidance
import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.dsml import ToolSpec
from ds4mlx.engine import Engine, SamplingParams, TurnSpec, run_turn
from ds4mlx.engine import grammar as grammar_mod
from ds4mlx.engine.grammar import (
    GrammarError,
    ToolRule,
    json_grammar,
    ll_tokenizer,
    turn_grammar,
)
from ds4mlx.jobs import (
    COMPILE_THREADS,
    ConstraintError,
    OutputConstraint,
    start_compile,
)
from tests.grammar_cases import SCHEMAS, bounded

CHAT = "<｜begin▁of▁sentence｜><｜User｜>answer in JSON<｜Assistant｜></think>"
THINK = "<｜begin▁of▁sentence｜><｜User｜>answer in JSON<｜Assistant｜><think>"
SAMPLE = SamplingParams(temperature=1.0, top_p=1.0, min_p=0.0)


@pytest.fixture(scope="module")
def engine(tiny_f32_dir):
    return Engine.load(tiny_f32_dir, ctx_size=1024)


@pytest.fixture(scope="module")
def llt(engine):
    return ll_tokenizer(engine.tokenizer, 129280)


def _run(engine, prompt: str, spec: TurnSpec, script=None):
    s = engine.new_session()
    try:
        r = run_turn(
            s, engine.tokenizer, spec, prefill=engine.tokenizer.encode(prompt), script=script
        )
        return r, list(s.tokens), s.logits
    finally:
        s.reset()


def _spec(seed: int, grammar=None, max_tokens: int = 120, **kw) -> TurnSpec:
    sp = SamplingParams(temperature=1.0, top_p=1.0, min_p=0.0, seed=seed)
    return TurnSpec(sp, max_tokens=max_tokens, grammar=grammar, **kw)


def _accepts_prefix(llt, grammar, engine, text: str) -> bool:
    m = llguidance.LLMatcher(llt, grammar.source, log_level=0)
    return m.consume_tokens(engine.tokenizer.encode(text))


def test_ll_tokenizer_without_transformers(engine):
    """The llguidance tokenizer is built from tokenizer.json alone: building it (and
    compiling a constraint the way a route does) imports no transformers or torch."""
    tok = ll_tokenizer(engine.tokenizer, 129280)
    assert tok.vocab_size == 129280 and tok.eos_token == engine.tokenizer.eos_id
    code = (
        "import sys\n"
        "from ds4mlx.jobs import OutputConstraint, start_compile\n"
        "from ds4mlx.tokenizer import Tokenizer\n"
        "g = start_compile(OutputConstraint(schema={'type': 'object'}), tools=[],"
        " calls=True, required=False, tool_name=None, tokenizer=Tokenizer.load()).wait()\n"
        "assert g is not None\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_json_schema_validity_and_unconstrained_invalid(engine, llt):
    """Every schema: the constrained reply validates when it finishes (>= 90 % finish),
    a reply cut by max_tokens is a prefix the grammar accepts; the same seeds without
    the grammar give no valid JSON at all."""
    finished = 0
    invalid_free = 0
    for i, schema in enumerate(SCHEMAS):
        g = json_grammar(bounded(schema), llt)
        r, _, _ = _run(engine, CHAT, _spec(i, g))
        if r.finish == "stop":
            finished += 1
            jsonschema.validate(json.loads(r.text), schema)
        else:
            assert r.finish == "length" and _accepts_prefix(llt, g, engine, r.raw)
        free, _, _ = _run(engine, CHAT, _spec(i, None, max_tokens=24))
        try:
            jsonschema.validate(json.loads(free.text), schema)
        except (ValueError, jsonschema.ValidationError):
            invalid_free += 1
    assert finished >= 0.9 * len(SCHEMAS)
    assert invalid_free == len(SCHEMAS)


def test_reasoning_is_free_then_constrained(engine, llt):
    """Thinking mode: the scripted reasoning (not JSON) goes through untouched; the
    reply after </think> is sampled under the mask and validates."""
    schema = SCHEMAS[1]
    g = json_grammar(bounded(schema), llt)
    script = engine.tokenizer.encode("let me think about it. no JSON here {</think>")
    r, _, _ = _run(engine, THINK, _spec(3, g, thinking=True), script=script)
    assert r.reasoning.startswith("let me think about it. no JSON here {")
    assert r.finish == "stop", r.raw
    jsonschema.validate(json.loads(r.text), schema)


def test_exactness_scripted_output_inside_grammar(engine, llt):
    """A scripted reply the grammar accepts: the same tokens and the same state (logits)
    with and without the constraint."""
    schema = SCHEMAS[1]
    g = json_grammar(schema, llt)
    script = engine.tokenizer.encode('{"name":"Ada","age":36}') + [engine.tokenizer.eos_id]
    a, toks_a, logits_a = _run(engine, CHAT, _spec(0, g), script=script)
    b, toks_b, logits_b = _run(engine, CHAT, _spec(0, None), script=script)
    assert a.finish == b.finish == "stop"
    assert (a.grammar, b.grammar) == ("complete", "")
    assert toks_a == toks_b and a.raw == b.raw
    assert np.array_equal(np.array(logits_a), np.array(logits_b))


class _Inline:
    """An executor that runs each task at once on the caller's thread."""

    def submit(self, fn, *args):
        f = Future()
        f.set_result(fn(*args))
        return f


def test_mask_on_a_thread_samples_what_a_synchronous_mask_does(engine, llt, monkeypatch):
    """The fill runs on `grammar._FILL` beside the loop; the same seeded turns with the
    fill run inline (synchronously) give the same tokens: the thread changes when the
    mask is computed, never which."""
    g = json_grammar(bounded(SCHEMAS[3]), llt)
    threaded = [_run(engine, CHAT, _spec(seed, g, max_tokens=40))[0].raw for seed in (1, 2)]
    monkeypatch.setattr(grammar_mod, "_FILL", _Inline())
    inline = [_run(engine, CHAT, _spec(seed, g, max_tokens=40))[0].raw for seed in (1, 2)]
    assert threaded == inline


def test_turn_reports_how_its_grammar_went(engine, llt):
    """`TurnResult.grammar`: a scripted token outside the grammar is ``violated`` (the
    constraint stops there, the script goes on), a reply cut by ``max_tokens`` is
    ``incomplete``, a thinking turn whose reasoning never ends is ``unstarted``."""
    g = json_grammar(SCHEMAS[1], llt)
    tok = engine.tokenizer
    bad = tok.encode('{"name":"Ada","oops":1}') + [tok.eos_id]
    r, _, _ = _run(engine, CHAT, _spec(0, g), script=bad)
    assert (r.grammar, r.text) == ("violated", '{"name":"Ada","oops":1}')
    cut = tok.encode('{"name":"Ada"')
    r, _, _ = _run(engine, CHAT, _spec(0, g, max_tokens=len(cut)), script=cut)
    assert (r.finish, r.grammar) == ("length", "incomplete")
    r, _, _ = _run(engine, THINK, _spec(0, g, max_tokens=5, thinking=True))
    assert r.grammar == "unstarted"
    # A grammar that dead-ends (the schema check refuses this one at the route: it is
    # compiled here without it) leaves the reply cut: llguidance stops in error, which
    # once read as "complete".
    dead = {
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/a"}},
        "required": ["x"],
        "$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}},
    }
    g = grammar_mod.validate(f"start: {grammar_mod._json_lark(dead)}\n", llt, schema=dead)
    r, _, _ = _run(engine, CHAT, _spec(0, g, max_tokens=12))
    assert (r.text, r.grammar) == ('{"x":', "incomplete"), r.text


def test_mask_forbids_what_the_grammar_rejects(engine, llt):
    """Greedy decoding under an enum: the reply is one of the values, whatever the
    model's favourite tokens are (greedy-inside-structure uses the masked logits)."""
    schema = {"enum": ["alpha", "beta"]}
    g = json_grammar(schema, llt)
    r, _, _ = _run(engine, CHAT, TurnSpec(SamplingParams(temperature=0), max_tokens=20, grammar=g))
    assert r.finish == "stop" and json.loads(r.text) in ("alpha", "beta")
    mx.eval(mx.array(0))


TOOLS = [
    ToolSpec(
        "Bash",
        "run a command",
        {
            "type": "object",
            "properties": {
                "command": {"type": "string"},
                "timeout": {"type": "integer", "maximum": 600},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        "Read",
        "read a file",
        {
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["file_path"],
        },
    ),
]


def test_strict_tool_calls_validate(engine, llt):
    """tool_choice required, strict tools: every call closes, names a declared tool and
    its arguments validate against that tool's schema."""
    bounded_tools = [ToolSpec(t.name, t.description, bounded(t.parameters)) for t in TOOLS]
    rules = {t.name: ToolRule(strict=True) for t in TOOLS}
    g = turn_grammar(bounded_tools, rules, required=True, tokenizer=llt)
    schemas = {t.name: t.parameters for t in TOOLS}
    calls = 0
    for seed in range(4):
        r, _, _ = _run(
            engine, CHAT, _spec(seed, g, max_tokens=160, tools=TOOLS, tool_required=True)
        )
        for c in r.tool_calls:
            jsonschema.validate(c.arguments, schemas[c.name])
            assert c.id not in r.call_errors
            calls += 1
        if r.finish == "stop":
            assert r.tool_calls
    assert calls >= 3


def test_demo_cap_stands_in_for_eos_only_where_the_grammar_ends(engine, llt):
    """``cap_is_eos`` (``serve --demo``): the cap ends a turn as an EOS would only where
    the grammar would let an EOS through. Cut inside a strict tool call, the turn ends
    ``length`` with the grammar ``incomplete`` (a natural ``stop`` would pass a cut call
    off as whole); cut in free text beside the tools, it is still a natural ``stop``."""
    rules = {t.name: ToolRule(strict=True) for t in TOOLS}
    g = turn_grammar(TOOLS, rules, required=False, tokenizer=llt)
    tok = engine.tokenizer
    call = tok.encode(
        'Running it.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="Bash">\n'
        '<｜DSML｜parameter name="command" string="true">ls -l'
    )
    cut = _spec(0, g, max_tokens=len(call), tools=TOOLS, cap_is_eos=True)
    r, tokens, _ = _run(engine, CHAT, cut, script=call)
    assert (r.finish, r.grammar, r.tool_calls) == ("length", "incomplete", [])
    assert tokens[-1] == call[-2]  # a length cut samples its last token without feeding it
    text = tok.encode("Just an answer")
    free = _spec(0, g, max_tokens=len(text), tools=TOOLS, cap_is_eos=True)
    r, tokens, _ = _run(engine, CHAT, free, script=text)
    assert (r.finish, r.grammar, r.text) == ("stop", "complete", "Just an answer")
    assert tokens[-1] == text[-1]  # the cap stood in for EOS: its token is fed


def test_parallel_false_one_call(engine, llt):
    rules = {t.name: ToolRule(strict=True) for t in TOOLS}
    g = turn_grammar(TOOLS, rules, required=True, parallel=False, tokenizer=llt)
    m = llguidance.LLMatcher(llt, g.source, log_level=0)
    one = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="Read">\n'
        '<｜DSML｜parameter name="file_path" string="true">a</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
    )
    assert m.consume_tokens(engine.tokenizer.encode(one))
    second = engine.tokenizer.encode('<｜DSML｜invoke name="Read">')
    assert m.validate_tokens(second) < len(second)  # no second call
    close = engine.tokenizer.encode("</｜DSML｜tool_calls>")
    assert m.validate_tokens(close) == len(close)


def test_allowed_tools_grammar_calls_only_the_listed_tools(engine, llt):
    """``allowed``: plain (non-strict) tools, all rendered, only the listed ones callable
    (OpenAI's ``allowed_tools``): the grammar accepts a call of ``Read`` and refuses
    ``Bash``'s name; sampled under it with a call required, every call is ``Read``;
    without a list, a required call or a strict tool there is nothing to constrain."""
    assert turn_grammar(TOOLS, {}, required=False, tokenizer=llt) is None
    g = turn_grammar(TOOLS, {}, required=True, allowed=frozenset({"Read"}), tokenizer=llt)
    opener = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="'
    m = llguidance.LLMatcher(llt, g.source, log_level=0)
    assert m.consume_tokens(engine.tokenizer.encode(opener))
    for name, ok in (("Read", True), ("Bash", False)):
        ids = engine.tokenizer.encode(f'{name}">')
        assert (m.validate_tokens(ids) == len(ids)) is ok, name
    names = []
    for seed in range(3):
        spec = _spec(seed, g, max_tokens=60, tools=TOOLS, tool_required=True)
        r, _, _ = _run(engine, CHAT, spec)
        names += [c.name for c in r.tool_calls]
    assert names and set(names) == {"Read"}, names


@pytest.mark.parametrize(
    "schema, path, word",
    [
        (
            {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
            "properties.a.not",
            "not",
        ),
        (
            {"type": "object", "properties": {"p": {"type": "string", "pattern": "(?<=x)y"}}},
            "properties.p.pattern",
            "look",
        ),
    ],
)
def test_unsupported_schema_names_feature_and_path(llt, schema, path, word):
    with pytest.raises(GrammarError) as e:
        json_grammar(schema, llt)
    assert e.value.path == path and word in e.value.message


@pytest.mark.parametrize(
    "schema, path",
    [
        (
            {
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/a"}},
                "required": ["a"],
                "$defs": {"a": {"$ref": "#/$defs/a"}},
            },
            "properties.a.$ref",
        ),
        (
            {
                "$ref": "#/$defs/a",
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            },
            "$ref",
        ),
        # Through allOf / anyOf members (compiled, and answered '{"x":' as finished).
        (
            {
                "type": "object",
                "properties": {"x": {"$ref": "#/$defs/a"}},
                "required": ["x"],
                "$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}},
            },
            "properties.x.$ref",
        ),
        ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}, "$ref"),
        # Through a required property and a non-empty array of itself.
        (
            {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
                "required": ["kids"],
            },
            "properties.kids.items.$ref",
        ),
    ],
)
def test_ref_cycle_is_refused_with_its_path(llt, schema, path):
    """A ``$ref`` that only leads back to itself defines no value: refused (it compiled
    and produced empty or invalid replies), while recursive schemas with a way out (a
    tree whose children may be none, a list that may end in null) still compile."""
    with pytest.raises(GrammarError) as e:
        json_grammar(schema, llt)
    assert e.value.path == path and "$ref cycle" in e.value.message
    tree = {
        "type": "object",
        "properties": {"children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    }
    json_grammar(tree, llt)
    node = {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/cell"}]}
    cell = {"type": "object", "properties": {"next": node}, "required": ["next"]}
    json_grammar({"$ref": "#/$defs/cell", "$defs": {"cell": cell}}, llt)
    # A "$ref" inside a value (const, enum, default, examples) is data, not a schema.
    json_grammar({"type": "object", "const": {"$ref": "#/nowhere"}}, llt)


def test_overlapping_one_of_and_deep_schemas_are_refused_in_our_words(llt):
    """llguidance's own texts named an option the client cannot see ("Enable
    'coerce_one_of'") and a parser detail ("failed to parse \"%json\": recursion limit
    exceeded"): a 400 says what is wrong with the schema instead, with the path. A
    oneOf with disjoint branches (a discriminated union) compiles, and so does an
    overlapping one the schema asks llguidance to coerce."""
    overlap = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    with pytest.raises(GrammarError) as e:
        json_grammar({"type": "object", "properties": {"a": overlap}}, llt)
    assert e.value.path == "properties.a.oneOf" and "use anyOf" in e.value.message
    assert "coerce" not in e.value.message
    json_grammar({**overlap, "x-guidance": {"coerce_one_of": True}}, llt)
    cat = {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]}
    dog = {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]}
    json_grammar({"oneOf": [cat, dog]}, llt)
    deep: dict = {"type": "string"}
    for _ in range(300):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarError) as e:
        json_grammar(deep, llt)
    assert e.value.message == "the schema is nested too deeply"


def test_a_property_names_every_key_satisfies_compiles(llt):
    """zod's ``z.record(z.string(), z.number())`` writes ``propertyNames: {"type":
    "string"}`` (JSON keys are strings anyway): dropped, the record compiles and keeps
    its value type; a ``propertyNames`` that constrains keys is still refused by path."""
    record = {
        "type": "object",
        "propertyNames": {"type": "string"},
        "additionalProperties": {"type": "number"},
    }
    schema = {"type": "object", "properties": {"scores": record}, "required": ["scores"]}
    g = json_grammar(schema, llt)
    assert (
        "propertyNames" not in g.source and '"additionalProperties": {"type": "number"}' in g.source
    )
    assert schema["properties"]["scores"]["propertyNames"] == {"type": "string"}  # not mutated
    keyed = {**record, "propertyNames": {"pattern": "^[a-z]+$"}}
    with pytest.raises(GrammarError) as e:
        json_grammar({"type": "object", "properties": {"s": keyed}}, llt)
    assert e.value.path == "properties.s.propertyNames", e.value


def test_null_values_in_a_schema_compile(llt):
    """JSON ``null`` anywhere in a schema (``default``, ``const``, ``enum``, as pydantic
    and the Anthropic SDK write them) is a value like any other: the ``$ref`` cycle walk
    once took a ``null`` node for its own "start at the root" sentinel and recursed
    until RecursionError (a 500 on the wire)."""
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": ["string", "null"], "default": None},
            "b": {"enum": ["x", None]},
            "c": {"const": {"d": [1, {"e": None}]}},
        },
        "required": ["b", "c"],
    }
    json_grammar(schema, llt)
    with pytest.raises(GrammarError) as e:
        json_grammar({**schema, "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, llt)
    assert "$ref cycle" in e.value.message


def test_custom_tool_grammar_errors(llt):
    tool = ToolSpec(
        "apply_patch", "", {"type": "object", "properties": {"input": {"type": "string"}}}
    )
    with pytest.raises(GrammarError, match="syntax"):
        turn_grammar(
            [tool],
            {"apply_patch": ToolRule(custom=True, syntax="ebnf", definition="x")},
            tokenizer=llt,
        )
    with pytest.raises(GrammarError):
        turn_grammar(
            [tool],
            {"apply_patch": ToolRule(custom=True, syntax="lark", definition="start: (")},
            tokenizer=llt,
        )
    # A grammar that spells a prompt-format marker: the DSML parameter closer ended the
    # call after "a" (reported as a complete call the grammar does not accept), the EOS
    # spelling ended the turn with no call under a required tool choice.
    for syntax, definition in [
        ("lark", 'start: "a</｜DSML｜parameter>b"'),
        ("regex", "x<｜end▁of▁sentence｜>"),
    ]:
        with pytest.raises(GrammarError, match="marker"):
            turn_grammar(
                [tool],
                {"apply_patch": ToolRule(custom=True, syntax=syntax, definition=definition)},
                tokenizer=llt,
            )


# A schema that takes llguidance a while to compile (2000 patterned properties: about a
# third of a second here), for the clock bound.
SLOW_SCHEMA = {
    "type": "object",
    "properties": {
        f"p{i}": {"type": "string", "pattern": "^[a-z]{3,60}[0-9]{1,40}$"} for i in range(2000)
    },
}


def test_compile_is_bounded_by_the_clock(engine):
    """Past ``limit_ms`` a compile is refused naming the part being compiled (the
    compile is left to finish on its own thread); a small schema compiles under the
    default limit and carries its compiled matcher for the turns."""
    c = OutputConstraint(schema=SLOW_SCHEMA, schema_param="response_format.json_schema.schema")
    kw = dict(tools=[], calls=True, required=False, tool_name=None, tokenizer=engine.tokenizer)
    with pytest.raises(ConstraintError) as e:
        start_compile(c, limit_ms=1, **kw).wait()
    assert e.value.param == "response_format.json_schema.schema"
    assert "longer than the 1 ms limit" in e.value.message
    g = start_compile(OutputConstraint(schema=SCHEMAS[1]), **kw).wait()
    assert g is not None and g.matcher is not None and g.vocab == 129280


def test_compiles_share_bounded_threads_and_wait_their_turn(engine):
    """Compiles run on `COMPILE_THREADS` shared threads: with all of them taken, a new
    compile waits its turn within its own limit (and compiles once one is free); one
    whose limit passes while it waits is refused ``busy`` (never tried, never run)."""
    kw = dict(tools=[], calls=True, required=False, tool_name=None, tokenizer=engine.tokenizer)
    slow = OutputConstraint(schema=SLOW_SCHEMA)
    held = [start_compile(slow, limit_ms=600_000, **kw) for _ in range(COMPILE_THREADS)]
    small = OutputConstraint(schema=SCHEMAS[1], schema_param="text.format.schema")
    refused = start_compile(small, limit_ms=1, **kw)
    with pytest.raises(ConstraintError) as e:
        refused.wait()
    assert e.value.busy and e.value.param == "text.format.schema"
    assert "busy for the whole 1 ms limit" in e.value.message
    assert refused.future.cancelled()  # dropped from the queue, not run later
    waiting = start_compile(small, limit_ms=600_000, **kw)
    assert not waiting.future.done()  # queued behind the held compiles
    assert waiting.wait() is not None
    assert any(t.future.done() for t in held)  # it ran only once a thread came free
    assert all(t.wait() is not None for t in held)


def test_agent_tools_are_strict(engine, llt, tmp_path):
    """``ds4mlx agent`` constrains calls to its own tools: a call with the schema's
    parameters is accepted, an unknown parameter or a non-integer limit is not."""
    from ds4mlx.agent.permissions import Permissions
    from ds4mlx.agent.steps import strict_grammar
    from ds4mlx.agent.tools import Toolbox

    specs = Toolbox(tmp_path, Permissions(yes=True)).specs
    g = strict_grammar(specs, engine.tokenizer)
    head = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="read">\n'
    path = '<｜DSML｜parameter name="path" string="true">a.txt</｜DSML｜parameter>\n'
    tok = engine.tokenizer

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(llt, g.source, log_level=0)
        ids = tok.encode(text)
        return m.validate_tokens(ids) == len(ids)

    assert accepts("ok" + head + path + "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    assert not accepts(head + '<｜DSML｜parameter name="nope" string="true">')
    assert not accepts(head + path + '<｜DSML｜parameter name="limit" string="false">"x"')
