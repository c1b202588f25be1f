"""Streaming decoder for a generated assistant turn (docs/ARCHITECTURE.md §4).

Fed the detokenized text of each sampled token, `StreamDecoder` separates thinking,
visible text and DSML tool calls and yields typed events as early as they are
certain. The format is DeepSeek V4's (``encoding_dsv4.py``: the assistant template
and ``parse_message_from_completion_text``)::

    [reasoning</think>]content[\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="P" string="true|false">VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>]<｜end▁of▁sentence｜>

Rules (the official parser's, made streaming and forgiving):

- In thinking mode the prompt ended with ``<think>``: text is reasoning until
  ``</think>``. A *complete* tool-call block the model opens inside its reasoning
  (``\\n\\n<｜DSML｜tool_calls>`` … ``</｜DSML｜tool_calls>`` before ``</think>``) is
  recovered as tool calls, and the reasoning ends where the block starts (DeepSeek
  models do this; ds4 recovers it too). Until its close arrives the block is held back;
  a block that ``</think>``, EOS or the end of generation cuts short was never a call
  and is reasoning text after all. A ``</think>`` right after a recovered block is
  accepted; then only EOS may follow, as after any block.
- Visible text ends at ``<｜DSML｜tool_calls>``; one ``\\n\\n`` right before it is part
  of the marker, not of the content. ``<｜end▁of▁sentence｜>`` outside a parameter
  value ends the turn; later text is ignored.
- ``string="true"`` values are raw text up to ``</｜DSML｜parameter>``; other values are
  JSON. Whitespace between DSML elements is not checked.
- Malformed DSML (bad header, duplicate parameter, missing close, invalid JSON,
  truncation at `finish`) yields a `ParseError` event and the best recoverable result;
  no exception escapes `feed`/`finish`.

Streaming guarantees: nothing that could begin a marker is emitted until it is
disproven (bytes are held back across feeds); the result does not depend on how the
text is split into feeds; a closed call's `ToolCallArgsDelta` texts concatenate to JSON
that parses to the same object as its final arguments, while a call the generation cut
off (``ToolCallEnd.closed`` False) keeps them unterminated, so they never parse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .conversation import ToolCall, ToolSpec
from .ids import new_tool_id
from .tokens import (
    DSML,
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    THINK_END,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    TOOL_CALLS_SEP,
)

__all__ = [
    "DecodeResult",
    "Event",
    "ParseError",
    "StreamDecoder",
    "TextDelta",
    "ThinkingDelta",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "decode_text",
]


# -------------------------------------------------------------------------- events


@dataclass
class ThinkingDelta:
    """Reasoning text (thinking mode, before ``</think>``)."""

    text: str


@dataclass
class TextDelta:
    """Visible answer text."""

    text: str


@dataclass
class ToolCallStart:
    """A tool call's header was parsed. ``index`` counts calls from 0 in this turn."""

    index: int
    id: str
    name: str


@dataclass
class ToolCallArgsDelta:
    """A piece of the call's arguments as JSON text (concatenate all pieces of a call)."""

    index: int
    text: str


@dataclass
class ToolCallEnd:
    """The call is complete.

    ``call``: the `ToolCall` (arguments in tool-schema property order, ``dsml`` the
    exact sampled invoke bytes). ``arguments_json``: ``call.arguments`` as JSON text.
    ``error``: None for a well-formed invoke, else why it was closed early (a
    `ParseError` with the same message was emitted too). ``closed``: False when the
    generation ended inside the call (its ``</｜DSML｜invoke>`` never came): such a call
    is never runnable; its streamed `ToolCallArgsDelta` texts are left unterminated, so
    they do not parse as the cut-off arguments (docs/ARCHITECTURE.md §4).
    """

    index: int
    call: ToolCall
    arguments_json: str
    error: str | None = None
    closed: bool = True


@dataclass
class ParseError:
    """Malformed DSML; decoding continued with the best recoverable result."""

    message: str


Event = ThinkingDelta | TextDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd | ParseError
_CALL_EVENTS = (ToolCallStart, ToolCallArgsDelta, ToolCallEnd)


@dataclass
class DecodeResult:
    """Everything decoded so far.

    ``reasoning``/``content``: text; ``tool_calls``: completed calls in order;
    ``errors``: every `ParseError` message; ``ended``: an EOS was seen.
    """

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ended: bool = False


# ------------------------------------------------------------------- JSON lexing


class _JsonShape:
    """Tracks where a JSON text is, to tell structure from payload byte by byte.

    Payload: inside string values and scalars (numbers, literals), and where a value
    is about to start (its type is the model's choice). Structure: punctuation,
    whitespace between tokens, object keys. Invalid JSON degrades gracefully.
    """

    __slots__ = ("stack", "expect", "in_string", "is_key", "escape", "in_scalar")

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.expect = "value"  # value | key | colon | next | end
        self.in_string = False
        self.is_key = False
        self.escape = False
        self.in_scalar = False

    def _after_value(self) -> None:
        self.expect = "next" if self.stack else "end"

    def feed(self, text: str) -> None:
        for ch in text:
            self._char(ch)

    def _char(self, ch: str) -> None:  # noqa: C901 (docs/ARCHITECTURE.md §1)
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.is_key:
                    self.expect = "colon"
                else:
                    self._after_value()
            return
        if self.in_scalar:
            if ch not in " \t\r\n,]}:":
                return
            self.in_scalar = False
            self._after_value()
        if ch in " \t\r\n":
            return
        exp = self.expect
        if exp == "value":
            if ch == '"':
                self.in_string, self.is_key = True, False
            elif ch == "{":
                self.stack.append("{")
                self.expect = "key"
            elif ch == "[":
                self.stack.append("[")
                self.expect = "value"
            elif ch == "]" and self.stack and self.stack[-1] == "[":
                self.stack.pop()
                self._after_value()
            else:
                self.in_scalar = True
        elif exp == "key":
            if ch == '"':
                self.in_string, self.is_key = True, True
            elif ch == "}" and self.stack:
                self.stack.pop()
                self._after_value()
        elif exp == "colon":
            if ch == ":":
                self.expect = "value"
        elif exp == "next":
            if ch == ",":
                self.expect = "key" if self.stack[-1] == "{" else "value"
            elif ch in "]}":
                self.stack.pop()
                self._after_value()

    @property
    def structure(self) -> bool:
        if self.in_string:
            return self.is_key
        if self.in_scalar:
            return False
        return self.expect != "value"


# ------------------------------------------------------------------------ decoder

(
    _THINK,
    _TEXT,
    _BLOCK,
    _INV_HEAD,
    _INV_BODY,
    _PAR_HEAD,
    _PAR_STR,
    _PAR_JSON,
    _SKIP,
    _AFTER,
    _DONE,
    _PROBE,
    _DELEGATE,
) = range(13)

_INVOKE_HEADER_RE = re.compile(r'\s*name="(.*)"\s*', re.DOTALL)
_PARAM_HEADER_RE = re.compile(r'\s+name="(.*?)"\s+string="(true|false)"\s*', re.DOTALL)
_MAX_HEADER = 4096  # a header longer than this is garbage, not a slow name
_WS = " \t\r\n"

_TEXT_STOPS = (TOOL_CALLS_SEP + TOOL_CALLS_OPEN, TOOL_CALLS_OPEN, EOS)
_THINK_STOPS = (THINK_END, EOS, TOOL_CALLS_SEP + TOOL_CALLS_OPEN, TOOL_CALLS_OPEN)
_PROBE_ENDS = (THINK_END, EOS)  # end a tool-call block opened in reasoning, unclosed
_BLOCK_MARKERS = (INVOKE_OPEN, TOOL_CALLS_CLOSE, EOS)
_BODY_MARKERS = (PARAM_OPEN, INVOKE_CLOSE, INVOKE_OPEN, TOOL_CALLS_CLOSE, EOS)


def _partial(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of a marker."""
    longest = max(len(m) for m in markers) - 1
    for k in range(min(len(buf), longest), 0, -1):
        tail = buf[-k:]
        if any(m.startswith(tail) and m != tail for m in markers):
            return k
    return 0


def _without_cut_marker(buf: str, markers: tuple[str, ...] = _TEXT_STOPS) -> str:
    """Text at the end of a turn, minus a marker cut by that end.

    The tail held back as a possible marker (``\n\n<｜DSML｜tool_calls>`` in visible
    text, ``</｜DSML｜parameter>`` in a parameter value) is the model writing markup once
    it holds the ``｜DSML｜`` token (as for `StreamDecoder.in_structure`); a turn cut
    there (``max_tokens``) must not show the marker's bytes as text or arguments. A tail
    without it (``\n\n``, ``<``, ``</``) is ordinary text and is kept.
    """
    held = _partial(buf, markers)
    if held and DSML in buf[len(buf) - held :]:
        return buf[: len(buf) - held]
    return buf


def _safe_cut(text: str, end: int) -> int:
    """Move a cut point back so it never separates a surrogate pair."""
    if 0 < end <= len(text) and "\ud800" <= text[end - 1] <= "\udbff":
        return end - 1
    return end


def _esc(text: str) -> str:
    """``text`` escaped as the inside of a JSON string (escaping is per character)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class _Call:
    __slots__ = ("index", "id", "name", "raw", "args", "emitted")

    def __init__(self, index: int, call_id: str) -> None:
        self.index = index
        self.id = call_id
        self.name = ""
        self.raw: list[str] = []  # exact invoke bytes consumed so far
        self.args: dict[str, Any] = {}  # sampled order
        self.emitted = False  # any argument key streamed yet


class StreamDecoder:
    """Incremental parser for one assistant turn.

    ``thinking`` (bool): the prompt ended with ``<think>``, so decoding starts in
    reasoning. ``tools``: the offered tools; their schemas order each call's
    arguments (unknown names or properties keep the sampled order). ``id_prefix``:
    ``"toolu_"`` (Anthropic) or ``"call_"`` (OpenAI) for new call ids (`new_tool_id`).
    ``calls`` False (the client's ``tool_choice: none``): a tool-call block the model
    writes anyway is parsed as usual but yields no ``ToolCall*`` event and no
    ``result.tool_calls``; its bytes are never text either (the visible text ends where
    the block starts). ``dropped_calls`` counts the calls left out.

    ``feed(text)`` and ``finish()`` return lists of events (`ThinkingDelta`,
    `TextDelta`, `ToolCallStart`, `ToolCallArgsDelta`, `ToolCallEnd`, `ParseError`);
    they never raise on any input text. After ``finish()`` further feeds are ignored.
    ``in_structure`` says whether the next bytes are DSML/JSON structure (sample
    greedily) or payload (use the request's sampling). ``result`` is the
    `DecodeResult` so far; ``tool_block_closed`` turns True at
    ``</｜DSML｜tool_calls>`` (the model should emit EOS next). ``invokes_closed`` counts
    the invokes whose ``</｜DSML｜invoke>`` arrived (one in a block opened inside the
    reasoning included, before that block closes).
    """

    def __init__(
        self,
        thinking: bool,
        tools: list[ToolSpec] | None = None,
        id_prefix: str = "toolu_",
        *,
        calls: bool = True,
    ) -> None:
        self.thinking = thinking
        self.id_prefix = id_prefix
        self.calls = calls
        self.dropped_calls = 0
        self._order: dict[str, list[str]] = {}
        for tool in tools or []:
            props = (tool.parameters or {}).get("properties") or {}
            self._order[tool.name] = list(props) if isinstance(props, dict) else []
        self._state = _THINK if thinking else _TEXT
        self._buf = ""  # received, not yet consumed
        self._head = ""  # header text being accumulated
        self._body: list[str] = []  # current parameter value
        self._param: tuple[str, bool] | None = None  # (name, is_string)
        self._json = _JsonShape()
        self._call: _Call | None = None
        self._garbage = False  # an "unexpected text" error was reported for this run
        self._finished = False
        # Text accumulates in lists: per-token string concatenation would be quadratic.
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._errors: list[str] = []
        self._ended = False
        self.tool_block_closed = False
        self._closed_invokes = 0
        self._events: list[Event] = []
        self._probe: _ReasoningBlock | None = None  # a tool-call block opened in reasoning

    # ------------------------------------------------------------------ public

    def feed(self, text: str) -> list[Event]:
        """Consume ``text`` (any split of the generated text) and return new events."""
        if self._finished or not text:
            return []
        self._buf += text
        try:
            self._run()
        except Exception as exc:  # never let a decoder bug kill the worker
            self._error(f"internal decoder error: {exc!r}")
            self._state = _DONE
            self._buf = ""
        return self._take()

    def finish(self) -> list[Event]:
        """End of generation (EOS, stop, or max_tokens): flush held text, close open calls."""
        if self._finished:
            return []
        self._finished = True
        try:
            self._flush()
        except Exception as exc:
            self._error(f"internal decoder error: {exc!r}")
        self._state = _DONE
        return self._take()

    @property
    def result(self) -> DecodeResult:
        """A snapshot `DecodeResult` of everything decoded so far."""
        res = DecodeResult(
            reasoning="".join(self._reasoning),
            content="".join(self._content),
            tool_calls=list(self._calls),
            errors=list(self._errors),
            ended=self._ended,
        )
        if self._probe is not None and self.tool_block_closed:
            self._probe.merge_into(res)
        if not self.calls:
            res.tool_calls = []
        return res

    @property
    def invokes_closed(self) -> int:
        """Invokes closed by their ``</｜DSML｜invoke>`` so far (see the class doc)."""
        probe = self._probe.parser.invokes_closed if self._probe is not None else 0
        return self._closed_invokes + probe

    @property
    def in_structure(self) -> bool:
        """True if the next generated bytes are protocol structure.

        Structure: DSML markers and headers (once the ``｜DSML｜`` token of a marker has
        been generated), whitespace between DSML elements, JSON punctuation and keys
        in non-string parameter values, anything after ``</｜DSML｜tool_calls>``.
        Payload: reasoning, visible text, string parameter bodies, JSON string values
        and scalars, and the point where a JSON value is about to start (its type is
        the model's choice) (docs/ARCHITECTURE.md §4). A partial marker is payload until its
        ``｜DSML｜`` token arrives: ``<`` or ``</`` may still be ordinary text.
        """
        st = self._state
        if st in (_THINK, _PROBE):
            # A block opened inside reasoning is sampled as reasoning is (docs/).
            return False
        if st == _DELEGATE and self._probe is not None:
            return self._probe.parser.in_structure
        if st in (_TEXT, _PAR_STR, _SKIP):
            return DSML in self._buf
        if st == _PAR_JSON:
            return DSML in self._buf or self._json.structure
        return True

    @property
    def in_tool_block(self) -> bool:
        """True while a tool-call block is open or being opened: from the ``｜DSML｜``
        token of its opener (held back in text or reasoning) to ``</｜DSML｜tool_calls>``.

        A turn stopped here would leave a half-written block (never a call); a steered
        turn waits for the block's close instead (``ds4mlx.engine.steer``).
        """
        st = self._state
        if st in (_TEXT, _THINK):
            return DSML in self._buf
        return st in (_BLOCK, _INV_HEAD, _PAR_HEAD, _INV_BODY, _PAR_STR, _PAR_JSON, _SKIP, _PROBE)

    # ----------------------------------------------------------------- plumbing

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        if self.calls:
            return events
        self.dropped_calls += sum(isinstance(e, ToolCallEnd) for e in events)
        return [e for e in events if not isinstance(e, _CALL_EVENTS)]

    def _error(self, message: str) -> None:
        self._errors.append(message)
        self._events.append(ParseError(message))

    def _thinking(self, text: str) -> None:
        if text:
            self._reasoning.append(text)
            self._events.append(ThinkingDelta(text))

    def _text(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._events.append(TextDelta(text))

    def _consume(self, n: int) -> str:
        """Drop ``n`` chars from the buffer, recording them as invoke bytes if inside one."""
        piece, self._buf = self._buf[:n], self._buf[n:]
        if self._call is not None:
            self._call.raw.append(piece)
        return piece

    def _run(self) -> None:
        handlers = {
            _THINK: self._st_think,
            _TEXT: self._st_text,
            _BLOCK: self._st_block,
            _INV_HEAD: self._st_header,
            _PAR_HEAD: self._st_header,
            _INV_BODY: self._st_invoke_body,
            _PAR_STR: self._st_param_body,
            _PAR_JSON: self._st_param_body,
            _SKIP: self._st_param_body,
            _AFTER: self._st_after,
            _DONE: self._st_done,
            _PROBE: lambda: self._probe is not None and self._probe.step(),
            _DELEGATE: lambda: self._probe is not None and self._probe.after(),
        }
        while self._buf and handlers[self._state]():
            pass

    # ------------------------------------------------------------------ states
    # Each returns True if it made progress (consumed text or changed state).

    def _st_done(self) -> bool:
        self._buf = ""
        return False

    def _scan_text(self, stops: tuple[str, ...]) -> tuple[int, str | None]:
        """Earliest stop in the buffer -> (position, stop); else (safe length, None)."""
        best_pos, best = -1, None
        for s in stops:
            pos = self._buf.find(s)
            if pos >= 0 and (best is None or pos < best_pos):
                best_pos, best = pos, s
        if best is not None:
            return best_pos, best
        return _safe_cut(self._buf, len(self._buf) - _partial(self._buf, stops)), None

    def _st_think(self) -> bool:
        pos, stop = self._scan_text(_THINK_STOPS)
        if stop is None:
            self._thinking(self._consume(pos))
            return False
        self._thinking(self._consume(pos))
        if stop in (THINK_END, EOS):
            self._consume(len(stop))
            if stop == EOS:
                self._end()
            else:
                self._state = _TEXT
            return True
        # A tool-call block opens inside the reasoning: parse it on the side.
        self._probe = _ReasoningBlock(self)
        self._state = _PROBE
        return True

    def _st_text(self) -> bool:
        pos, stop = self._scan_text(_TEXT_STOPS)
        if stop is None:
            self._text(self._consume(pos))
            return False
        self._text(self._consume(pos))
        self._consume(len(stop))
        if stop == EOS:
            self._end()
        else:
            self._state = _BLOCK
            self._garbage = False
        return True

    def _end(self) -> None:
        self._ended = True
        self._state = _DONE
        self._buf = ""

    def _skip_ws(self) -> bool:
        n = len(self._buf) - len(self._buf.lstrip(_WS))
        if n:
            self._consume(n)
        return n > 0

    def _garbage_char(self, where: str) -> None:
        if not self._garbage:
            self._garbage = True
            # The message must not quote the buffer: its extent depends on feed splits.
            self._error(f"unexpected text {where}; skipped")
        # Skip up to the next possible marker start.
        nxt = self._buf.find("<", 1)
        self._consume(nxt if nxt > 0 else len(self._buf))

    def _st_block(self) -> bool:
        if self._skip_ws():
            return True
        buf = self._buf
        if buf.startswith(INVOKE_OPEN):
            self._garbage = False
            self._call = _Call(len(self._calls), "")
            self._consume(len(INVOKE_OPEN))
            self._head = ""
            self._state = _INV_HEAD
            return True
        if buf.startswith(TOOL_CALLS_CLOSE):
            self._consume(len(TOOL_CALLS_CLOSE))
            self._state = _AFTER
            self.tool_block_closed = True
            return True
        if buf.startswith(EOS):
            self._error(f"missing {TOOL_CALLS_CLOSE}")
            self._end()
            return True
        if any(m.startswith(buf) for m in _BLOCK_MARKERS):
            return False  # a marker may be arriving
        self._garbage_char("inside the tool_calls block")
        return True

    def _st_header(self) -> bool:
        end = self._buf.find(">")
        room = _MAX_HEADER - len(self._head)
        if end < 0 and len(self._buf) <= room:
            self._head += self._consume(len(self._buf))
            return False
        if end < 0 or end > room:
            # Consume exactly up to the limit so the outcome does not depend on how the
            # text was split into feeds.
            self._head += self._consume(room + 1)
            self._bad_header("header too long")
            return True
        self._head += self._consume(end)
        self._consume(1)
        if self._state == _INV_HEAD:
            self._open_invoke(self._head)
        else:
            self._open_param(self._head)
        return True

    def _bad_header(self, why: str) -> None:
        if self._state == _INV_HEAD:
            self._error(f"bad invoke header {self._head[:80]!r}: {why}")
            # Nothing was announced for this call; drop it and resync on the next marker.
            self._call = None
            self._state = _BLOCK
            self._garbage = True
        else:
            self._error(f"bad parameter header {self._head[:80]!r}: {why}")
            self._param = None
            self._body = []
            self._state = _SKIP

    def _open_invoke(self, head: str) -> None:
        m = _INVOKE_HEADER_RE.fullmatch(head)
        if m is None or not m.group(1):
            self._bad_header('expected name="..."')
            return
        call = self._call
        assert call is not None
        call.name = m.group(1)
        call.id = new_tool_id(self.id_prefix)
        self._events.append(ToolCallStart(call.index, call.id, call.name))
        self._state = _INV_BODY
        self._garbage = False

    def _open_param(self, head: str) -> None:
        m = _PARAM_HEADER_RE.fullmatch(head)
        if m is None:
            self._bad_header('expected name="..." string="true|false"')
            return
        name, is_str = m.group(1), m.group(2) == "true"
        call = self._call
        assert call is not None
        if name in call.args:
            self._error(f"duplicate parameter {name!r} in {call.name!r}; kept the first")
            self._param = None
            self._state = _SKIP
            return
        self._param = (name, is_str)
        self._body = []
        if is_str:
            self._args_delta(self._key_prefix(name) + '"')
            self._state = _PAR_STR
        else:
            self._json = _JsonShape()
            self._state = _PAR_JSON

    def _key_prefix(self, name: str) -> str:
        call = self._call
        assert call is not None
        lead = ", " if call.emitted else "{"
        call.emitted = True
        return f"{lead}{json.dumps(name, ensure_ascii=False)}: "

    def _args_delta(self, text: str) -> None:
        call = self._call
        assert call is not None
        if text:
            self._events.append(ToolCallArgsDelta(call.index, text))

    def _st_invoke_body(self) -> bool:
        if self._skip_ws():
            return True
        buf = self._buf
        if buf.startswith(PARAM_OPEN):
            self._garbage = False
            self._consume(len(PARAM_OPEN))
            self._head = ""
            self._state = _PAR_HEAD
            return True
        if buf.startswith(INVOKE_CLOSE):
            self._consume(len(INVOKE_CLOSE))
            self._closed_invokes += 1
            self._close_invoke(None)
            self._state = _BLOCK
            return True
        for marker in (INVOKE_OPEN, TOOL_CALLS_CLOSE, EOS):
            if buf.startswith(marker):
                # Leave the marker for the block state to handle.
                self._close_invoke(f"missing {INVOKE_CLOSE}")
                self._state = _BLOCK
                return True
        if any(m.startswith(buf) for m in _BODY_MARKERS):
            return False
        self._garbage_char("inside an invoke")
        return True

    def _st_param_body(self) -> bool:
        pos = self._buf.find(PARAM_CLOSE)
        if pos < 0:
            cut = _safe_cut(self._buf, len(self._buf) - _partial(self._buf, (PARAM_CLOSE,)))
            if cut:
                self._body_piece(self._consume(cut))
            return False
        if pos:
            self._body_piece(self._consume(pos))
        self._consume(len(PARAM_CLOSE))
        self._close_param()
        self._state = _INV_BODY
        return True

    def _body_piece(self, piece: str) -> None:
        if self._state == _SKIP:
            return
        self._body.append(piece)
        if self._state == _PAR_STR:
            self._args_delta(_esc(piece))
        else:
            self._json.feed(piece)

    def _close_param(self, truncated: bool = False) -> None:
        """Store the finished (or, when ``truncated``, partial) parameter value."""
        if self._state == _SKIP or self._param is None:
            self._param = None
            return
        name, is_str = self._param
        call = self._call
        assert call is not None
        raw = "".join(self._body)
        if is_str:
            call.args[name] = raw
            if not truncated:
                self._args_delta('"')
        elif not truncated:
            try:
                value = json.loads(raw)
            except ValueError:
                self._error(f"parameter {name!r} of {call.name!r} is not valid JSON; kept as text")
                value = raw
            call.args[name] = value
            self._args_delta(self._key_prefix(name) + json.dumps(value, ensure_ascii=False))
        # A truncated JSON value was never streamed; it is dropped.
        self._param = None
        self._body = []

    def _close_invoke(self, error: str | None, *, closed: bool = True) -> None:
        call = self._call
        assert call is not None
        self._call = None
        if error is not None:
            self._error(f"{error} in call {call.name!r}")
        if closed:
            self._events.append(ToolCallArgsDelta(call.index, "}" if call.emitted else "{}"))
        order = self._order.get(call.name, [])
        args = {k: call.args[k] for k in order if k in call.args}
        args.update((k, v) for k, v in call.args.items() if k not in args)
        raw = "".join(call.raw)
        tool_call = ToolCall(
            id=call.id,
            name=call.name,
            arguments=args,
            # An invoke closed early keeps its bytes minus trailing whitespace, which the
            # renderer's "\n" separator restores.
            dsml=raw if error is None else raw.rstrip(_WS),
        )
        self._calls.append(tool_call)
        self._events.append(
            ToolCallEnd(call.index, tool_call, json.dumps(args, ensure_ascii=False), error, closed)
        )

    def _st_after(self) -> bool:
        if self._skip_ws():
            return True
        if self._buf.startswith(EOS):
            self._end()
            return True
        if EOS.startswith(self._buf):
            return False
        # Anything but EOS after the block: text the official format does not allow.
        self._error(f"unexpected text after {TOOL_CALLS_CLOSE}; ignored")
        self._state = _DONE
        self._buf = ""
        return False

    # ----------------------------------------------------------------- finish

    def _flush(self) -> None:
        st = self._state
        buf, self._buf = self._buf, ""
        # A lone high surrogate at the very end can never be completed now.
        if buf and "\ud800" <= buf[-1] <= "\udbff":
            buf = buf[:-1]
        if st in (_PROBE, _DELEGATE) and self._probe is not None:
            self._probe.finish(buf)
        elif st == _THINK:
            self._thinking(buf)
        elif st == _TEXT:
            self._text(_without_cut_marker(buf))
        elif st == _BLOCK:
            self._error(
                f"generation ended inside the tool_calls block (missing {TOOL_CALLS_CLOSE})"
            )
        elif st == _INV_HEAD:
            self._call = None
            self._error("generation ended inside an invoke header")
        elif st in (_INV_BODY, _PAR_HEAD, _PAR_STR, _PAR_JSON, _SKIP):
            buf = _without_cut_marker(buf, (PARAM_CLOSE,))
            if st in (_PAR_STR, _PAR_JSON) and buf:
                self._body_piece(buf)
            if st == _PAR_HEAD:
                self._param = None
            else:
                self._close_param(truncated=True)
            self._close_invoke("generation ended inside the call (truncated)", closed=False)


class _ReasoningBlock:
    """A tool-call block the model opened inside its reasoning (see the module doc).

    A chat-mode `StreamDecoder` parses it on the side while ``owner`` holds its events
    back. When ``</｜DSML｜tool_calls>`` arrives the calls are real: the events go out and
    this parser decides the rest of the turn. When ``</think>``, EOS or the end of the
    generation comes first, its exact text (``raw``) becomes reasoning after all.
    """

    def __init__(self, owner: StreamDecoder) -> None:
        self.owner = owner
        self.parser = StreamDecoder(False, None, owner.id_prefix)
        self.parser._order = owner._order
        self.raw: list[str] = []
        self.held: list[Event] = []

    def step(self) -> bool:
        """Owner state ``_PROBE``: feed the side parser up to a possible end of the block."""
        own = self.owner
        buf = own._buf
        ends = [p for p in (buf.find(m) for m in _PROBE_ENDS) if p >= 0]
        end = min(ends) if ends else -1
        n = end if end >= 0 else _safe_cut(buf, len(buf) - _partial(buf, _PROBE_ENDS))
        if n:
            piece = own._consume(n)
            self.raw.append(piece)
            self.held += self.parser.feed(piece)
        if self.parser.tool_block_closed:
            # Complete: the calls are real. The reasoning ended where the block began.
            own._events += self.held
            self.held = []
            own.tool_block_closed = True
            own._state = _DELEGATE
            return True
        if end >= 0:
            self.abandon()  # </think> or EOS cut it: it stays reasoning
            return True
        return False

    def abandon(self) -> None:
        """The block never closed: its text is reasoning, and the owner thinks on."""
        own = self.owner
        own._thinking("".join(self.raw))
        own._probe = None
        own._state = _THINK

    def after(self) -> bool:
        """Owner state ``_DELEGATE``: one ``</think>`` right after the block is accepted;
        then the side parser (after its block: only EOS is expected) takes the rest."""
        own = self.owner
        stripped = own._buf.lstrip(_WS)
        if not self.parser.result.ended and stripped.startswith(THINK_END):
            own._consume(own._buf.index(THINK_END) + len(THINK_END))
            return True
        if stripped and THINK_END.startswith(stripped) and stripped != THINK_END:
            return False  # a </think> may be arriving
        own._events += self.parser.feed(own._consume(len(own._buf)))
        return False

    def finish(self, buf: str) -> None:
        """The generation ended with ``buf`` still unconsumed."""
        own = self.owner
        if own._state == _DELEGATE:
            own._events += self.parser.feed(buf) + self.parser.finish()
        else:
            self.raw.append(buf)
            self.abandon()

    def merge_into(self, res: DecodeResult) -> None:
        """Add what the recovered block decoded to the owner's result."""
        sub = self.parser.result
        res.content += sub.content
        res.tool_calls += sub.tool_calls
        res.errors += sub.errors
        res.ended = res.ended or sub.ended


def decode_text(text: str, *, thinking: bool, tools: list[ToolSpec] | None = None) -> DecodeResult:
    """Decode a whole generated turn at once (`StreamDecoder` fed once, then finished)."""
    dec = StreamDecoder(thinking, tools)
    dec.feed(text)
    dec.finish()
    return dec.result
