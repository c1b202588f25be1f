"""Grammar-constrained decoding: the per-step logits mask of the turn loop (llguidance).

A `Grammar` is a compiled, validated llguidance grammar over the *reply* — the text a
turn generates after ``</think>`` in thinking mode, from its first token in chat mode.
Reasoning is never constrained. The turn loop installs `Grammar.hooks` around its own
`TurnHooks` when ``TurnSpec.grammar`` is set (`GrammarHooks`):

- every token handed to the loop after the reasoning (sampled, scripted, force-fed, a
  verified draft: `TurnHooks.on_token`) is consumed by the matcher, so the mask always
  describes the tokens before the step it masks;
- the next-token bitmask is filled (llguidance's numpy API, into a preallocated
  ``int32`` buffer) on a thread (`_FILL`) as soon as token t is known, while the loop
  streams t and the forward of t runs; the sampling step for t+1 waits for that fill
  and applies it: ``mx.where`` over the unpacked bits, on every device (llguidance's
  MLX helper is a Metal-only kernel; on Metal it could replace the unpacking,
  unmeasured here). The same consume / fill sequence as a synchronous mask, so the
  output is the same;
- speculative decoding: drafts are cut before the first one the grammar forbids
  (`GrammarHooks.admit`: llguidance checks them without advancing the matcher), and
  each verify row is masked by the matcher advanced through the accepted tokens before
  it. The matcher only ever consumes tokens the loop keeps, so nothing needs rolling
  back;
- a token the grammar rejects (a script that leaves it, a forced feed it does not
  expect) ends the constraint for the turn (`GrammarHooks.violated`): nothing is
  masked afterwards and the output claims no validity; `TurnResult.grammar` says how
  the constraint went.

Grammars are built from what callers have already checked (`json_grammar`, `turn_grammar`
take JSON-schema dicts, the engine's `ToolSpec` schemas; no wire format): a schema or
grammar llguidance cannot compile raises `GrammarError` with the feature and its path.

The `llguidance.LLTokenizer` is built from the DeepSeek V4 ``tokenizer.json`` text
(``Tokenizer.path``) directly, never through llguidance's ``hf`` helper (it imports
transformers), once per file (~1–2 s), and cached.
"""

from __future__ import annotations

import copy
import json
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.numpy as llnp
import mlx.core as mx
import numpy as np

from ds4mlx.dsml import ToolSpec
from ds4mlx.dsml.tokens import (
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    TOOL_CALLS_SEP,
)
from ds4mlx.engine.turn import Turn, TurnHooks

# Bounds on what one request may make the matcher do (llguidance's own fuel limits):
# a schema that compiles into a grammar beyond them is refused before it is queued.
MAX_SOURCE_CHARS = 256 * 1024  # the grammar text (schemas, tool grammars) in characters
LIMITS = dict(max_grammar_size=400_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000)

# The DSML marker any free text must not contain: a tool-call block outside the grammar.
_DSML_WORD = "｜DSML｜"


class GrammarError(ValueError):
    """A schema or grammar that cannot be enforced.

    ``message``: what is wrong (llguidance's reason, the unsupported keyword);
    ``path``: dotted path of the offending part inside what the caller passed (e.g.
    ``properties.when.not``), or "" when unknown.
    """

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.message = message
        self.path = path


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


# --------------------------------------------------------------------------- tokenizer

_tok_lock = threading.Lock()
_ll_tokenizers: dict[tuple[str, int, int], llguidance.LLTokenizer] = {}


def ll_tokenizer(tokenizer, n_vocab: int | None = None) -> llguidance.LLTokenizer:
    """The `llguidance.LLTokenizer` of a ``ds4mlx.tokenizer.Tokenizer`` (cached per file).

    ``n_vocab``: the model's logits width (129280 for DeepSeek V4); defaults to the
    tokenizer's own size. The EOS token is the tokenizer's ``<｜end▁of▁sentence｜>``.
    """
    n = int(n_vocab or tokenizer.vocab_size)
    key = (str(tokenizer.path), n, int(tokenizer.eos_id))
    with _tok_lock:
        hit = _ll_tokenizers.get(key)
        if hit is None:
            text = tokenizer.path.read_text(encoding="utf-8")
            hit = llguidance.LLTokenizer(text, n_vocab=n, eos_token=tokenizer.eos_id)
            _ll_tokenizers[key] = hit
        return hit


# --------------------------------------------------------------------------- grammars


@dataclass(frozen=True)
class Grammar:
    """A validated llguidance grammar for a turn's reply (opaque to callers).

    ``source``: llguidance's grammar text (a Lark grammar or its JSON form);
    ``what``: a short description for logs (``json_schema``, ``tools``);
    ``matcher``: the grammar compiled against a tokenizer of ``vocab`` ids when it was
    validated with one (`validate`), or None: each turn starts from a copy of it, so
    the inference thread never compiles a grammar the request thread already did.
    """

    source: str
    what: str = "grammar"
    matcher: Any = field(default=None, compare=False, repr=False)
    vocab: int = 0

    def hooks(self, inner: TurnHooks) -> GrammarHooks:
        """The turn's hooks with this grammar's mask around ``inner``'s."""
        return GrammarHooks(self, inner)


def _lit(text: str) -> str:
    """A Lark string literal for ``text``."""
    return json.dumps(text, ensure_ascii=False)


def _key_path(node: Any, key: str, path: tuple[str, ...] = ()) -> str | None:
    """Dotted path of the first dict key ``key`` inside ``node``."""
    if isinstance(node, dict):
        if key in node:
            return ".".join((*path, key))
        items = node.items()
    elif isinstance(node, list):
        items = ((str(i), v) for i, v in enumerate(node))
    else:
        return None
    for k, v in items:
        hit = _key_path(v, key, (*path, str(k)))
        if hit is not None:
            return hit
    return None


def _value_path(node: Any, value: str, path: tuple[str, ...] = ()) -> str | None:
    """Dotted path of the first string ``value`` inside ``node``."""
    if node == value:
        return ".".join(path)
    if isinstance(node, dict | list):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            hit = _value_path(v, value, (*path, str(k)))
            if hit is not None:
                return hit
    return None


_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_REGEX_ERR = re.compile(r"regex parse error:\s*\n\s*(.+?)\s*\n", re.S)


def _explain(message: str, schema: Any) -> GrammarError:
    """A `GrammarError` for llguidance's ``message`` about ``schema``, with the path."""
    first = message.strip().splitlines()[0] if message.strip() else message
    first = re.sub(r"^at \d+\(\d+\): ", "", first)
    m = _UNIMPLEMENTED.search(message)
    if m:
        path = _key_path(schema, m.group(1)) or ""
        return GrammarError(f"unsupported JSON schema keyword {m.group(1)!r}", path)
    m = _UNKNOWN_FORMAT.search(message)
    if m:
        return GrammarError(
            f"unsupported string format {m.group(1)!r}", _value_path(schema, m.group(1)) or ""
        )
    if "oneOf constraints are not supported" in message:
        # llguidance compiles a oneOf only when its branches cannot both match a value;
        # its advice names an option of its own (docs/STRUCTURED_OUTPUTS.md).
        return GrammarError(
            "a oneOf whose branches may both match one value is not supported (nothing "
            "would check that exactly one matches): use anyOf, or make the branches "
            "disjoint (a const property each, as a discriminated union has)",
            _key_path(schema, "oneOf") or "",
        )
    if "recursion limit exceeded" in message:
        return GrammarError("the schema is nested too deeply", "")
    m = _REGEX_ERR.search(message)
    if m:
        path = _value_path(schema, m.group(1)) or ""
        detail = message.strip().splitlines()
        reason = next((ln.strip() for ln in detail if ln.strip().startswith("error:")), first)
        return GrammarError(f"pattern {m.group(1)!r} is not supported ({reason})", path)
    return GrammarError(first, "")


def validate(source: str, tokenizer=None, *, schema: Any = None, what: str = "grammar") -> Grammar:
    """Check that llguidance compiles ``source`` within `LIMITS`; return the `Grammar`.

    ``tokenizer``: an `llguidance.LLTokenizer` for the full check (lexer against the
    vocabulary), or None (structure only, e.g. in a process without the tokenizer).
    ``schema``: what ``source`` was built from, to locate the error.

    Raises:
        GrammarError: the grammar does not compile, or exceeds the size limits.
    """
    if len(source) > MAX_SOURCE_CHARS:
        raise GrammarError(
            f"the grammar is {len(source)} characters; the limit is {MAX_SOURCE_CHARS}"
        )
    if tokenizer is not None:  # the full compile, kept for the turns (`Grammar.matcher`)
        m = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=_limits())
        if m.is_error():
            raise _explain(m.get_error() or "the grammar does not compile", schema)
        return Grammar(source, what, m, int(tokenizer.vocab_size))
    is_error, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(
        source, None, limits=_limits()
    )
    if is_error:
        raise _explain(msgs[0] if msgs else "the grammar does not compile", schema)
    return Grammar(source, what)


# DS4's prompt-format markers as a grammar could spell them: special tokens
# (``<｜end▁of▁sentence｜>``, ``<｜User｜>``) and DSML tags (``</｜DSML｜parameter>``).
_MARKER_RE = re.compile(r"<｜[^｜<>]*｜>|｜DSML｜")


def _check_markers(definition: str, where: str = "") -> None:
    """Raise GrammarError when a custom tool grammar spells a prompt-format marker: the
    DSML decoder would end the call (a parameter closer) or the turn (EOS) at that text,
    whatever the grammar says comes next, so its input could never be generated."""
    marker = _MARKER_RE.search(definition)
    if marker is not None:
        raise GrammarError(
            f"{where}the grammar spells the prompt-format marker {marker.group()!r}: the "
            "model cannot write it as a tool's input"
        )


def custom_grammar(syntax: str | None, definition: str | None, tokenizer=None) -> Grammar:
    """Check a custom tool's input grammar on its own (``syntax`` ``"lark"`` or
    ``"regex"``).

    Raises:
        GrammarError: an unknown syntax, a definition that spells a prompt-format marker
            (`_MARKER_RE`), or one that does not compile.
    """
    if syntax not in ("lark", "regex"):
        raise GrammarError(f"unknown grammar syntax {syntax!r} (supported: lark, regex)")
    if not isinstance(definition, str) or not definition.strip():
        raise GrammarError("the grammar definition is empty")
    _check_markers(definition)
    lark = definition if syntax == "lark" else f"start: /{_regex_body(definition)}/"
    gram = validate(json.dumps({"grammars": [{"lark_grammar": lark}]}), tokenizer, what=syntax)
    if gram.matcher is not None and _matches_nothing(gram.matcher, gram.vocab):
        # Embedded in the tool-call grammar, such a rule lets no input start: the call
        # would end empty and be dropped, and a required tool choice silently unmet.
        raise GrammarError("the grammar matches no text (no rule derives a finite string)")
    return gram


def _matches_nothing(matcher: Any, vocab: int) -> bool:
    """Whether a compiled grammar refuses every first token and the empty input (a copy
    of ``matcher`` is probed; ``matcher`` stays at its start)."""
    probe = matcher.deep_copy()
    mask = llnp.allocate_token_bitmask(1, vocab)
    llnp.fill_next_token_bitmask(probe, mask)
    return probe.is_error() or (not probe.is_accepting() and not mask.any())


def _json_lark(schema: dict[str, Any]) -> str:
    """A Lark ``%json`` rule for ``schema``: compact JSON (no free whitespace between
    tokens: a model could otherwise spend its whole budget on blanks).

    Raises:
        GrammarError: a number that is not finite (``1e400`` parses as infinity: JSON
            has no spelling for it, and llguidance's parser only said "expected value").
    """
    _check_finite(schema)
    schema = _without_noop_property_names(schema)
    guide = {"whitespace_flexible": False, **(schema.get("x-guidance") or {})}
    return "%json " + json.dumps({**schema, "x-guidance": guide}, ensure_ascii=False)


def _noop_names(node: dict) -> bool:
    """Whether ``node`` has a ``propertyNames`` every JSON key satisfies (keys are
    strings): ``true``, ``{}`` or ``{"type": "string"}``, which zod's
    ``z.record(z.string(), …)`` writes; llguidance refuses the keyword itself."""
    v = node.get("propertyNames")
    return v is True or (isinstance(v, dict) and v in ({}, {"type": "string"}))


def _without_noop_property_names(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` without the ``propertyNames`` that constrain nothing (`_noop_names`;
    a copy, or the schema itself when it has none). Any other ``propertyNames`` stays,
    for llguidance to refuse with its path."""
    if not any(_noop_names(n) for n, _ in _schema_nodes(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for node, _ in _schema_nodes(schema):
        if _noop_names(node):
            del node["propertyNames"]
    return schema


def _check_finite(node: Any, path: str = "") -> None:
    """Raise GrammarError (with its dotted path) at the first non-finite number."""
    if isinstance(node, float) and not math.isfinite(node):
        raise GrammarError(f"{node} is not a finite number (too large for a float)", path)
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, value in items:
        _check_finite(value, f"{path}.{key}" if path else str(key))


# Keywords whose values are JSON values, not schemas: a "$ref" inside them is data.
_VALUE_KEYS = frozenset({"const", "enum", "default", "examples"})


def _pointer(root: Any, ref: Any) -> Any:
    """The node a local ``$ref`` (``#/a/b``) names in ``root``, or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _schema_nodes(node: Any, path: tuple[str, ...] = ()) -> list[tuple[dict, tuple[str, ...]]]:
    """Every object of the schema ``node`` with its path, in document order (values of
    `_VALUE_KEYS` left out: they are data). Iterative: a deep schema is llguidance's to
    refuse, not a RecursionError."""
    out: list[tuple[dict, tuple[str, ...]]] = []
    stack: list[tuple[Any, tuple[str, ...]]] = [(node, path)]
    while stack:
        cur, at = stack.pop()
        if isinstance(cur, dict):
            out.append((cur, at))
            kids = [(v, (*at, str(k))) for k, v in cur.items() if k not in _VALUE_KEYS]
        elif isinstance(cur, list):
            kids = [(v, (*at, str(i))) for i, v in enumerate(cur)]
        else:
            continue
        stack.extend(reversed(kids))
    return out


def _needs(root: Any, node: dict) -> list[tuple[bool, list[Any]]]:
    """What ``node`` needs to define a value, as ``(every, members)`` groups: every
    member (True) or some member (False) of each group must define one. The groups:
    its ``$ref`` target, its ``allOf`` members, its ``anyOf``/``oneOf`` members, the
    schemas of its required properties and of its least array items; anything else it
    constrains is llguidance's to judge."""
    out: list[tuple[bool, list[Any]]] = []
    if "$ref" in node:
        target = _pointer(root, node["$ref"])
        if target is not None:
            out.append((True, [target]))
    if isinstance(node.get("allOf"), list):
        out.append((True, node["allOf"]))
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key]:
            out.append((False, node[key]))
    props, required = node.get("properties"), node.get("required")
    if isinstance(props, dict) and isinstance(required, list):
        out.append((True, [props[r] for r in required if isinstance(r, str) and r in props]))
    least = node.get("minItems")
    if isinstance(least, int) and least > 0:
        prefix = node.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        out.append((True, prefix[:least]))
        if least > len(prefix) and "items" in node:
            out.append((True, [node["items"]]))
    return out


def _defines_value(root: Any, node: dict, known: set[int]) -> bool:
    """Whether some finite JSON value satisfies ``node`` as far as `_needs` goes, given
    the objects already ``known`` to (ids); ``false`` defines none, other non-objects
    (``true``, a draft-4 items list) count as defining one."""

    def ok(sub: Any) -> bool:
        return id(sub) in known if isinstance(sub, dict) else sub is not False

    return all(
        (all if every else any)(ok(m) for m in members) for every, members in _needs(root, node)
    )


def _ref_cycle(schema: Any) -> str | None:
    """The path of the first ``$ref`` in ``schema`` whose target no finite value
    satisfies, else None: it leads back to itself without defining a value on the way,
    directly (``$defs.a: {"$ref": "#/$defs/a"}``), through ``allOf``/``anyOf`` members
    (``{"allOf": [{"$ref": "#/$defs/a"}]}``) or through required properties. llguidance
    accepts such a schema, but answers empty or cut-off JSON: it must be refused like
    any schema that cannot be served. A recursive schema with a way out (a tree whose
    ``children`` may be empty) defines values.

    The objects that define a value are a least fixpoint: each is checked once, members
    before the objects holding them, and again whenever one it `_needs` turns out to
    define a value (a worklist: linear in the schema's size)."""
    nodes = _schema_nodes(schema)
    users: dict[int, list[dict]] = {}
    for node, _ in nodes:
        for _, members in _needs(schema, node):
            for m in members:
                if isinstance(m, dict):
                    users.setdefault(id(m), []).append(node)
    known: set[int] = set()
    todo = [node for node, _ in nodes]  # popped last first: members before holders
    while todo:
        node = todo.pop()
        if id(node) not in known and _defines_value(schema, node, known):
            known.add(id(node))
            todo += [u for u in users.get(id(node), ()) if id(u) not in known]
    for node, path in nodes:
        if "$ref" in node:
            target = _pointer(schema, node["$ref"])
            if isinstance(target, dict) and id(target) not in known:
                return ".".join((*path, "$ref"))
    return None


def _check_refs(schema: Any, where: str = "") -> None:
    """Raise GrammarError when ``schema`` holds a `_ref_cycle`."""
    found = _ref_cycle(schema)
    if found is not None:
        raise GrammarError(f"{where}$ref cycle: it defines no value", found)


def json_grammar(schema: dict[str, Any] | None, tokenizer=None) -> Grammar:
    """A reply that is one JSON value valid for ``schema`` (None: any JSON object).

    Raises:
        GrammarError: a keyword or pattern llguidance does not support (with its path).
    """
    schema = {"type": "object"} if schema is None else schema
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    _check_refs(schema)
    return validate(f"start: {_json_lark(schema)}\n", tokenizer, schema=schema, what="json")


@dataclass(frozen=True)
class ToolRule:
    """How one offered tool's calls are constrained.

    ``strict``: parameter names, order (the schema's) and values follow its schema.
    ``syntax``/``definition``: a custom tool's input grammar (``"lark"`` or
    ``"regex"``), or None for free text; a custom tool has one string parameter.
    """

    strict: bool = False
    custom: bool = False
    syntax: str | None = None
    definition: str | None = None


@dataclass
class _Builder:
    """Accumulates the Lark rules of a turn grammar and its subgrammars."""

    rules: list[str] = field(default_factory=list)
    subs: list[dict[str, Any]] = field(default_factory=list)
    n: int = 0

    def rule(self, body: str, prefix: str = "r") -> str:
        self.n += 1
        name = f"{prefix}{self.n}"
        self.rules.append(f"{name}: {body}")
        return name

    def sub(self, grammar: dict[str, Any]) -> str:
        name = f"g{len(self.subs) + 1}"
        self.subs.append({"name": name, **grammar})
        return "@" + name


def _regex_body(rx: str) -> str:
    """``rx`` inside a Lark ``/…/`` literal (its slashes escaped)."""
    return rx.replace("/", "\\/")


# Lexemes (llguidance's lexer is greedy: a free-text lexeme followed by a literal that
# could continue it would swallow the literal, so each free text ends *with* its closer).
# RAWC: a raw ``string="true"`` value and the parameter closer that ends it.
def _rx(text: str) -> str:
    """A regex matching ``text`` literally, for a Lark ``/…/`` literal."""
    return _regex_body(re.escape(text).replace("\\\n", "\\n"))


_CLOSE_RX = _rx(PARAM_CLOSE)
_RAWC = rf"/(?s:.*){_CLOSE_RX}/ & ~/(?s:.*{_CLOSE_RX}.+)/"
# TEXT: visible text without DSML; OPEN: such text, then the tool-call block opener.
_OPEN_RX = _rx(f"{TOOL_CALLS_SEP}{TOOL_CALLS_OPEN}\n")
_FREE_TEXT = rf"/(?s:.+)/ & ~/(?s:.*{_DSML_WORD}.*)/"
_OPEN = rf"/(?s:.*){_OPEN_RX}/ & ~/(?s:.*{_DSML_WORD}.*{_DSML_WORD}.*)/"


_NOTES = {"description", "title", "default", "examples", "$comment"}


def _raw_value(b: _Builder, sub: Any) -> str | None:
    """The Lark body of a string property written raw (``string="true"``, as the model
    is prompted to write strings) up to and including the parameter closer, or None when
    its constraints need the JSON form. Raw forms: any text; ``minLength``/``maxLength``;
    an ``enum``/``const`` of strings; a ``pattern`` anchored with ``^…$``."""
    if not isinstance(sub, dict):
        return None
    keys = set(sub) - _NOTES
    values = sub.get("enum", [sub["const"]] if "const" in sub else None)
    if values is not None and keys <= {"type", "enum", "const"}:
        if values and all(isinstance(v, str) and PARAM_CLOSE not in v for v in values):
            alts = " | ".join(_lit(v) for v in values)
            return f"({alts}) {_lit(PARAM_CLOSE)}"
        return None
    if sub.get("type") != "string":
        return None
    if keys == {"type"}:
        return "RAWC"
    if keys <= {"type", "minLength", "maxLength"}:
        lo, hi = int(sub.get("minLength", 0)), sub.get("maxLength")
        body = f"(?s:.{{{lo},{'' if hi is None else int(hi)}}})"
    elif keys == {"type", "pattern"}:
        rx = sub["pattern"]
        if not (rx.startswith("^") and rx.endswith("$") and not rx.endswith("\\$")):
            return None
        body = f"(?:{_regex_body(rx[1:-1])})"
    else:
        return None
    b.n += 1
    b.rules.append(f"RAW{b.n}: /{body}{_CLOSE_RX}/ & ~/(?s:.*{_CLOSE_RX}.+)/")
    return f"RAW{b.n}"


def _param(b: _Builder, name: str, sub: Any, defs: dict[str, Any]) -> str:
    head = f'{PARAM_OPEN} name="{name}" string='
    raw = _raw_value(b, sub)
    if raw is not None:
        return b.rule(f"{_lit(head + chr(34) + 'true' + chr(34) + '>')} {raw}")
    schema = dict(sub) if isinstance(sub, dict) else {}
    schema.update({k: v for k, v in defs.items() if k not in schema})
    return b.rule(
        f"{_lit(head + chr(34) + 'false' + chr(34) + '>')} {_json_lark(schema)} {_lit(PARAM_CLOSE)}"
    )


def _strict_params(b: _Builder, tool: ToolSpec) -> str:
    """The parameter lines of a strict tool: its properties in schema order, required
    ones present, optional ones optional, nothing else."""
    schema = tool.parameters or {}
    if schema.get("type", "object") != "object":
        raise GrammarError(f"tool {tool.name!r}: a strict tool's schema must be an object")
    _check_refs(schema, f"tool {tool.name!r}: ")
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    parts = []
    for name, sub in props.items():
        line = _param(b, name, sub, defs)
        parts.append(f'({line} "\\n")' + ("" if name in required else "?"))
    return " ".join(parts) if parts else '""'


def _custom_params(b: _Builder, tool: ToolSpec, rule: ToolRule) -> str:
    """A custom tool's one string parameter, its value under the tool's grammar."""
    props = list((tool.parameters or {}).get("properties") or {"input": {}})
    head = _lit(f'{PARAM_OPEN} name="{props[0]}" string="true">')
    if rule.syntax is None:
        return f"{head} RAWC {_lit(chr(10))}"
    _check_markers(rule.definition or "", f"tool {tool.name!r}: ")
    if rule.syntax == "lark":
        value = b.sub({"lark_grammar": rule.definition})
    elif rule.syntax == "regex":
        value = b.sub({"lark_grammar": f"start: /{_regex_body(rule.definition or '')}/"})
    else:
        raise GrammarError(f"tool {tool.name!r}: unknown grammar syntax {rule.syntax!r}")
    return f"{head} {value} {_lit(PARAM_CLOSE + chr(10))}"


_LOOSE_PARAM = (
    f'{_lit(PARAM_OPEN + " name=" + chr(34))} /[^"\\n]+/ '
    f'{_lit(chr(34) + " string=" + chr(34))} ("true" | "false") {_lit(chr(34) + ">")} '
    f"RAWC {_lit(chr(10))}"
)


def _invoke(b: _Builder, tool: ToolSpec, rule: ToolRule) -> str:
    if rule.custom:
        params = _custom_params(b, tool, rule)
    elif rule.strict:
        params = _strict_params(b, tool)
    else:
        params = "loose_param*"
    head = _lit(f'{INVOKE_OPEN} name="{tool.name}">\n')
    return b.rule(f"{head} {params} {_lit(INVOKE_CLOSE + chr(10))}", "invoke")


def turn_grammar(
    tools: Sequence[ToolSpec],
    rules: Mapping[str, ToolRule],
    *,
    text_schema: dict[str, Any] | None = None,
    text_json: bool = False,
    calls: bool = True,
    required: bool = False,
    tool_name: str | None = None,
    allowed: frozenset[str] | None = None,
    parallel: bool = True,
    tokenizer=None,
) -> Grammar | None:
    """The grammar of a chat reply: visible text, then optionally one DSML tool-call block.

    Args:
        tools: the offered tools (in the prompt's order).
        rules: name → `ToolRule` for tools whose calls are constrained (strict, custom);
            any other offered tool is held to its name and well-formed DSML only.
        text_schema / text_json: the visible text is one JSON value for this schema
            (``text_json`` with no schema: any JSON object); otherwise free text
            without DSML markers.
        calls: False (``tool_choice: none``): no tool-call block.
        required: the reply is a tool-call block only (``tool_choice`` required/named).
        tool_name: with ``required``, the only tool that may be called.
        allowed: the names of the tools that may be called (all rendered, only these
            callable), or None for any offered tool.
        parallel: False: exactly one call in the block.
        tokenizer: an `llguidance.LLTokenizer` for the full check, or None.
    Returns:
        The `Grammar`, or None when nothing needs constraining (no schema, no strict
        or custom tool, no ``allowed`` list, no required call).
    Raises:
        GrammarError: a tool schema or custom grammar that does not compile.
    """
    json_text = text_json or text_schema is not None
    constrained = (
        required or allowed is not None or any(r.strict or r.syntax for r in rules.values())
    )
    if allowed is not None:
        tools = [t for t in tools if t.name in allowed]
    if not json_text and not (calls and tools and constrained):
        return None
    b = _Builder()
    if calls and tools:
        offered = [t for t in tools if not (required and tool_name and t.name != tool_name)]
        invokes = [_invoke(b, t, rules.get(t.name, ToolRule())) for t in offered]
        b.rules.append("invoke_any: " + " | ".join(invokes))
        body = f"invoke_any{'+' if parallel else ''} {_lit(TOOL_CALLS_CLOSE)}"
        b.rules.append(f"calls: {_lit(TOOL_CALLS_SEP + TOOL_CALLS_OPEN + chr(10))} {body}")
        b.rules.append(f"text_calls: OPEN {body}")
    text = (
        _json_lark(text_schema if text_schema is not None else {"type": "object"})
        if json_text
        else "TEXT"
    )
    if not (calls and tools):
        start = f"start: {text}" if json_text else "start: TEXT?"
    elif required:
        start = "start: calls"
    elif json_text:
        start = f"start: {text} | calls"
    else:
        start = "start: TEXT? | text_calls"
    lark = "\n".join(
        [
            start,
            *b.rules,
            f"loose_param: {_LOOSE_PARAM}",
            f"TEXT: {_FREE_TEXT}",
            f"OPEN: {_OPEN}",
            f"RAWC: {_RAWC}",
        ]
    )
    source = json.dumps({"grammars": [{"lark_grammar": lark}, *b.subs]}, ensure_ascii=False)
    schema_ctx = {"text": text_schema, "tools": {t.name: t.parameters for t in tools}}
    return validate(source, tokenizer, schema=schema_ctx, what="tools" if tools else "json")


# --------------------------------------------------------------------------- the mask


def _bits_to_bool(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """``(words,)`` int32 llguidance bitmask → ``(vocab,)`` bool (bit i of word i//32)."""
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab].astype(bool)


@dataclass
class MaskStats:
    """Per-turn mask figures: ``steps`` masks applied, ``fill_s`` seconds filling
    bitmasks (matcher), ``apply_s`` seconds unpacking and building the masked logits,
    ``waits``: seconds the loop waited in each masked step (catch-up, fill, apply)."""

    steps: int = 0
    fill_s: float = 0.0
    apply_s: float = 0.0
    waits: list[float] = field(default_factory=list)


# The thread that advances matchers and fills bitmasks beside the inference thread: one,
# so that a turn's fills run in order (each turn waits on its own futures only).
_FILL = ThreadPoolExecutor(1, thread_name_prefix="ds4mlx-mask")


class GrammarHooks(TurnHooks):
    """`TurnHooks` that mask each sampling step by a `Grammar` (see the module doc); every
    other hook is ``inner``'s. ``violated``: a generated token left the grammar (the
    constraint stopped there); ``stats``: `MaskStats`.

    Threading: `on_token` (inference thread) hands the token to `_FILL`, which consumes
    it and fills the bitmask for the next step while the loop goes on (streaming the
    token, the forward pass); `mask` waits for that fill, then applies it. The matcher
    and bitmask are only touched by one thread at a time: the inference thread reads
    them after waiting on the last future.
    """

    def __init__(self, grammar: Grammar, inner: TurnHooks):
        self.grammar, self.inner = grammar, inner
        self.matcher: llguidance.LLMatcher | None = None
        self.bitmask: np.ndarray | None = None
        self.started = False  # the reply began: after </think> in thinking mode
        self.violated = False
        self.fresh = False  # the bitmask describes the matcher's current state
        self.pending: Future | None = None  # the last token's consume-and-fill
        self.queued = 0  # tokens handed over (a fill a later token supersedes is skipped)
        self.stats = MaskStats()

    def after_prefill(self, turn: Turn) -> None:
        self.inner.after_prefill(turn)

    def before_step(self, turn: Turn) -> str | None:
        return self.inner.before_step(turn)

    def draft(self, turn: Turn) -> Sequence[int]:
        return self.inner.draft(turn)

    def admit(self, turn: Turn, drafts: Sequence[int]) -> int:
        """The drafts the grammar allows after the tokens so far (llguidance checks
        them without advancing the matcher), within what ``inner`` admits."""
        n = self.inner.admit(turn, drafts)
        self._wait()
        if self.violated or not self.started or self.matcher is None:
            return n
        return min(n, self.matcher.validate_tokens(list(drafts[:n])))

    def may_end(self, turn: Turn) -> bool:
        """Where the grammar lets an EOS through: its matcher accepts (or stopped), or
        it has not started (reasoning is free) or was left (a violating script)."""
        self._wait()
        free = self.violated or not self.started or self.matcher is None
        return (free or self._accepts()) and self.inner.may_end(turn)

    def _accepts(self) -> bool:
        """The output so far is a sentence of the grammar (or the grammar ended)."""
        return self.matcher.is_stopped() or self.matcher.is_accepting()

    def at_end(self, turn: Turn) -> None:
        self._wait()
        if not (self.started or not turn.spec.thinking):
            turn.result.grammar = "unstarted"
        elif self.violated:
            turn.result.grammar = "violated"
        else:
            self._start(turn)
            # A matcher that stopped in error (a dead end: no token could extend the
            # reply) is stopped without accepting: the reply is cut, not complete.
            whole = self._accepts() and not self.matcher.is_error()
            turn.result.grammar = "complete" if whole else "incomplete"
        self.inner.at_end(turn)

    def _start(self, turn: Turn) -> None:
        """Compile the matcher (once), for the model's logits width."""
        if self.matcher is not None:
            return
        vocab, g = int(turn.s.logits.shape[-1]), self.grammar
        if g.matcher is not None and g.vocab == vocab:
            self.matcher = g.matcher.deep_copy()
        else:
            tok = ll_tokenizer(turn.tok, vocab)
            self.matcher = llguidance.LLMatcher(tok, g.source, log_level=0, limits=_limits())
        self.bitmask = llnp.allocate_token_bitmask(1, vocab)
        if self.matcher.is_error():  # validated at the route: a fault, not bad input
            raise RuntimeError(f"grammar failed to start: {self.matcher.get_error()}")
        self.started = self.started or not turn.spec.thinking

    def _fill(self) -> None:
        t0 = time.perf_counter()
        llnp.fill_next_token_bitmask(self.matcher, self.bitmask)
        self.stats.fill_s += time.perf_counter() - t0
        self.fresh = True

    def _advance(self, token: int, n: int) -> None:
        """On `_FILL`: consume ``token``; fill the next step's bitmask unless a later
        token was handed over meanwhile (its own task fills)."""
        if self.violated:
            return
        if not self.matcher.consume_token(token):
            self.violated = True
        elif n == self.queued:
            self._fill()

    def _wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()  # re-raises what failed on the fill thread

    def on_token(self, turn: Turn, token: int) -> None:
        self.inner.on_token(turn, token)
        if self.violated:
            return
        self._start(turn)
        if not self.started:  # reasoning: free until its </think> (not consumed)
            self.started = token == turn.tok.think_end_id
            return
        self.fresh = False
        self.queued += 1
        self.pending = _FILL.submit(self._advance, token, self.queued)

    def mask(self, turn: Turn, logits: mx.array) -> mx.array | None:
        inner = self.inner.mask(turn, logits)
        t_in = time.perf_counter()
        self._start(turn)
        self._wait()
        if self.violated or not self.started:
            return inner
        if not self.fresh:  # the reply's first step: nothing consumed yet
            self._fill()
        base = logits if inner is None else inner
        t1 = time.perf_counter()
        allowed = mx.array(_bits_to_bool(self.bitmask[0], base.shape[-1]))
        out = mx.where(allowed, base, mx.array(-mx.inf, dtype=base.dtype))
        t2 = time.perf_counter()
        self.stats.steps += 1
        self.stats.apply_s += t2 - t1
        self.stats.waits.append(t2 - t_in)
        return out


__all__ = [
    "Grammar",
    "GrammarError",
    "GrammarHooks",
    "MaskStats",
    "ToolRule",
    "custom_grammar",
    "json_grammar",
    "ll_tokenizer",
    "turn_grammar",
    "validate",
]
