"""Command output as a terminal shows it: one line buffer driven by pyte's ECMA-48 parser.

A command's output is a byte stream for a terminal, not text: progress bars redraw a
line with ``\\r`` hundreds of times, ``\\b`` steps back over a spinner, colours and
titles are escape sequences. The model should read what a user would see, in as few
tokens as possible, and never a raw escape (see :mod:`ds4mlx.sanitize`).

:class:`TerminalText` keeps the state of one stream across reads (a sequence or a line
split between two reads is rendered as if it came at once):

1. A small state machine drops the control-string payloads pyte would print as text:
   DCS, SOS, PM and APC (``ESC P``/``X``/``^``/``_`` or C1 ``\\x90``/``\\x98``/``\\x9e``/
   ``\\x9f``) up to ST (``ESC \\`` or ``\\x9c``); CAN/SUB abort one, another escape
   sequence ends it. A lone ``ESC`` before a control character (or at the end) is kept
   visible as ``\\x1b`` instead of being swallowed with the character after it.
2. :class:`pyte.Stream` parses the rest (CSI, OSC up to BEL or ST, charset selection,
   two-byte escapes, C0 controls) and calls the listener, a one-line buffer: text
   overwrites from the cursor column, ``\\r`` returns to column 0, ``\\b`` steps back,
   ``\\t`` is kept as a character (``edit`` must be able to match it), erase-in-line
   and cursor moves along the line apply, BEL and the rest are ignored. ``\\n`` commits
   the line; so does the end of the stream. Nothing wraps: lines keep their length.
   Not :class:`pyte.Screen`: it wraps at its width, expands tabs and is ~30x slower.
3. What is left that a terminal could act on (a C0 control pyte drew as text) is
   escaped by :func:`~ds4mlx.sanitize.escape_controls`.

Lines only grow or get overwritten; moves to other rows (``ESC [ A``, clear screen)
are ignored, since committed lines are already handed over.
"""

from __future__ import annotations

import codecs
from typing import Any

import pyte

from ds4mlx.sanitize import escape_controls

ESC = "\x1b"
ESCAPED_ESC = "\\x1b"  # how sanitize writes a lone ESC
# Control strings whose payload pyte would draw as text (ECMA-48 §5.6).
_STRING_OPENERS_7BIT = frozenset("PX^_")
_STRING_OPENERS_C1 = "\x90\x98\x9e\x9f"
_ST_C1 = "\x9c"
_CAN_SUB = "\x18\x1a"


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


class _LineBuffer:
    """pyte listener: the current line (a ``str``) and the cursor column in it.

    ``committed`` collects finished lines (each ending in ``\\n``) until taken.
    Events pyte dispatches that have no meaning on one line (title, modes, rows) are
    no-ops through :meth:`__getattr__`.
    """

    def __init__(self) -> None:
        self.line = ""
        self.col = 0
        self.saved_col = 0
        self.committed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        # Only the names pyte may dispatch; anything else is a real attribute error.
        if name in pyte.Stream.events:
            return _noop
        raise AttributeError(name)

    # --- text ------------------------------------------------------------------

    def draw(self, text: str) -> None:
        line, col = self.line, self.col
        if col == len(line):
            self.line = line + text
        elif col > len(line):
            self.line = line + " " * (col - len(line)) + text
        else:
            self.line = line[:col] + text + line[col + len(text) :]
        self.col = col + len(text)

    def tab(self) -> None:
        self.draw("\t")

    def linefeed(self) -> None:
        self.committed.append(self.line + "\n")
        self.line = ""
        self.col = 0

    index = linefeed  # ESC D: next line

    def carriage_return(self) -> None:
        self.col = 0

    def backspace(self) -> None:
        self.col = max(0, self.col - 1)

    def reset(self) -> None:  # ESC c: the terminal is cleared
        self.line = ""
        self.col = self.saved_col = 0

    # --- cursor moves along the line (CSI parameters are 1-based counts) -----------

    def cursor_back(self, count: int | None = None, *_: Any, **__: Any) -> None:
        self.col = max(0, self.col - (count or 1))

    def cursor_forward(self, count: int | None = None, *_: Any, **__: Any) -> None:
        self.col += count or 1

    def cursor_to_column(self, column: int | None = None, *_: Any, **__: Any) -> None:
        self.col = max(0, (column or 1) - 1)

    def cursor_position(
        self, line: int | None = None, column: int | None = None, *_: Any, **__: Any
    ) -> None:
        self.col = max(0, (column or 1) - 1)

    def save_cursor(self) -> None:
        self.saved_col = self.col

    def restore_cursor(self) -> None:
        self.col = self.saved_col

    # --- editing ---------------------------------------------------------------

    def erase_in_line(self, how: int = 0, *_: Any, **__: Any) -> None:
        if how == 0:  # cursor to end
            self.line = self.line[: self.col]
        elif how == 1:  # start to cursor (inclusive): blanks
            keep = self.line[self.col + 1 :]
            self.line = " " * min(self.col + 1, len(self.line)) + keep
        else:  # whole line
            self.line = ""

    def erase_characters(self, count: int | None = None, *_: Any, **__: Any) -> None:
        n = count or 1
        tail = self.line[self.col + n :]
        blank = max(0, min(n, len(self.line) - self.col))
        self.line = self.line[: self.col] + " " * blank + tail

    def delete_characters(self, count: int | None = None, *_: Any, **__: Any) -> None:
        self.line = self.line[: self.col] + self.line[self.col + (count or 1) :]

    def insert_characters(self, count: int | None = None, *_: Any, **__: Any) -> None:
        if self.col < len(self.line):
            n = count or 1
            self.line = self.line[: self.col] + " " * n + self.line[self.col :]


class TerminalText:
    """One output stream (stdout or stderr) rendered as a terminal shows it; stateful.

    Feed it everything the stream produces, in order, with :meth:`feed`; each call
    returns the lines completed since the previous one. :attr:`pending` is the line
    still being drawn (a progress bar); ``final=True`` (end of stream) commits it.
    """

    def __init__(self) -> None:
        self._buf = _LineBuffer()
        self._stream = pyte.Stream(self._buf, strict=False)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._in_string = False  # inside a DCS/SOS/PM/APC payload
        self._carry = ""  # an ESC at the end of the previous feed, not yet classified

    @property
    def pending(self) -> str:
        """The current, uncommitted line (escaped like the committed ones)."""
        return escape_controls(self._buf.line)

    def feed(self, data: str | bytes, final: bool = False) -> str:
        """Render ``data``; return the lines it completed, each ending in ``\\n``.

        Args:
            data: decoded text, or raw bytes (decoded here as UTF-8, a character split
                between two feeds joined, bad bytes replaced by U+FFFD).
            final: the stream ended: the current line is committed too (without a
                ``\\n``) and an unterminated sequence is dropped.

        Returns:
            Plain text: no escape sequence, every control but ``\\n``/``\\t`` as ``\\xNN``.
        """
        text = self._decoder.decode(data, final=final) if isinstance(data, bytes) else data
        text = self._strip_strings(self._carry + text, final)
        if text:
            self._stream.feed(text)
        buf = self._buf
        if final:
            if buf.line:
                buf.committed.append(buf.line)
            buf.line, buf.col = "", 0
            # A sequence cut by the end of the stream: start clean if fed again.
            self._stream = pyte.Stream(buf, strict=False)
            self._in_string = False
            self._carry = ""
        out = "".join(buf.committed)
        buf.committed.clear()
        return escape_controls(out)

    def _strip_strings(self, text: str, final: bool) -> str:
        """``text`` without control-string payloads; a lone ESC made visible (see module)."""
        self._carry = ""
        if (
            not self._in_string
            and ESC not in text
            and not any(c in text for c in _STRING_OPENERS_C1)
        ):
            return text
        out: list[str] = []
        i, n = 0, len(text)
        while i < n:
            if self._in_string:
                i = self._skip_string(text, i)
                continue
            j = _next_special(text, i)
            out.append(text[i:j])
            if j >= n:
                break
            c = text[j]
            if c != ESC:  # a C1 string opener
                self._in_string = True
                i = j + 1
                continue
            if j + 1 >= n:  # ESC at the end: decide with the next feed
                if final:
                    out.append(ESCAPED_ESC)
                else:
                    self._carry = ESC
                break
            nxt = text[j + 1]
            if nxt in _STRING_OPENERS_7BIT:
                self._in_string = True
                i = j + 2
            elif nxt < " ":  # ESC before a control: pyte would eat both
                out.append(ESCAPED_ESC)
                i = j + 1
            else:
                out.append(ESC)
                i = j + 1
        return "".join(out)

    def _skip_string(self, text: str, i: int) -> int:
        """Skip payload from ``i``; return where normal text resumes."""
        n = len(text)
        while i < n:
            c = text[i]
            if c == _ST_C1 or c in _CAN_SUB:
                self._in_string = False
                return i + 1
            if c == ESC:
                if i + 1 >= n:
                    self._carry = ESC  # maybe ESC \: look again with the next feed
                    return n
                self._in_string = False
                # ESC \ is ST; another ESC starts a new sequence (the string ends there).
                return i + 2 if text[i + 1] == "\\" else i
            i += 1
        return n


def _next_special(text: str, i: int) -> int:
    """Index of the next ESC or C1 string opener at or after ``i`` (``len`` if none)."""
    best = len(text)
    for ch in (ESC, *_STRING_OPENERS_C1):
        k = text.find(ch, i, best)
        if k != -1:
            best = k
    return best


def clean_terminal_output(text: str | bytes) -> str:
    """What a terminal shows of a whole output: :meth:`TerminalText.feed` with ``final``."""
    return TerminalText().feed(text, final=True)
