"""Control characters made visible: the one sanitizer for text the agent shows and the
server logs.

Files the agent reads, command output and the model's own text are untrusted: a raw
``ESC`` in them is a terminal instruction (set the title, write the clipboard with OSC
52, clear the screen, move the cursor up over a permission prompt). Every character
that a terminal may act on instead of drawing — the C0 controls except ``\\n`` and
``\\t``, DEL and the C1 controls U+0080–U+009F (``\\x9b`` is CSI, ``\\x9d`` OSC on a
terminal that honours 8-bit controls) — is replaced by its escape in one form,
``\\xNN`` (two lowercase hex digits): ``ESC`` shows as ``\\x1b``, BEL as ``\\x07``,
CSI as ``\\x9b``. So are the Unicode bidi embeddings, overrides and isolates
(U+202A–U+202E, U+2066–U+2069), as ``\\uNNNN``: a bidi-aware terminal (macOS Terminal,
iTerm2, Konsole) reorders the text around them, so a command could read as something
else than what runs (Trojan Source, CVE-2021-42574). So are the Unicode tag characters
(U+E0000–U+E007F), as ``\\UNNNNNNNN``: invisible in a terminal, they spell ASCII a file can
carry unseen ("ASCII smuggling": instructions to the model the user never sees); so are
the supplementary variation selectors (U+E0100–U+E01EF), which carry a byte each behind
any visible character ("emoji smuggling"). The basic selectors U+FE00–U+FE0F (an emoji's
text or colour form) stay.
Right-to-left letters and the plain direction marks stay. The escape is plain printable
text, so sanitizing is idempotent.

The agent's terminal UI (:mod:`ds4mlx.agent.ui`) applies it to everything it prints, the
shell tool to the command output the model reads
(:func:`ds4mlx.agent.tools.shell.clean_terminal_output`), and the server's log to every
line it writes (`LogFormatter`: a path, a tool-call id or a schema key a client sent is
quoted in log lines as it came).
"""

from __future__ import annotations

import logging
import re

# C0 without \t (0x09) and \n (0x0a), DEL (0x7f), C1 (0x80-0x9f), the bidi
# embeddings/overrides (U+202A-U+202E) and isolates (U+2066-U+2069), the tags and the
# supplementary variation selectors.
CONTROL_RE = re.compile(
    r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069"
    r"\U000e0000-\U000e007f\U000e0100-\U000e01ef]"
)


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape_controls(text: str) -> str:
    """``text`` with every control character except ``\\n``/``\\t`` written as ``\\xNN``
    (a bidi control as ``\\uNNNN``, a tag character or supplementary variation selector
    as ``\\UNNNNNNNN``).

    Args:
        text: any string (Python ``str``, so a C1 control is one code point).

    Returns:
        The same string when it holds no such character (the common case costs one
        regex search), else a copy where each one is its escape (four characters,
        six for a bidi control, ten for a tag character).
    """
    if CONTROL_RE.search(text) is None:
        return text
    return CONTROL_RE.sub(_escape, text)


def has_controls(text: str) -> bool:
    """True if :func:`escape_controls` would change ``text``."""
    return CONTROL_RE.search(text) is not None


def split_controls(text: str) -> list[tuple[str, bool]]:
    """``text`` cut into runs of ``(piece, escaped)``: plain text, and escapes of controls.

    For a UI that styles the escapes apart from the text around them (so ``\\x1b``
    written by a file cannot pass for the escape of a real ``ESC``). Joining the pieces
    gives :func:`escape_controls`'s result.
    """
    out: list[tuple[str, bool]] = []
    pos = 0
    for m in CONTROL_RE.finditer(text):
        if m.start() > pos:
            out.append((text[pos : m.start()], False))
        out.append((_escape(m), True))
        pos = m.end()
    if pos < len(text):
        out.append((text[pos:], False))
    return out


class LogFormatter(logging.Formatter):
    """A `logging.Formatter` whose lines hold no control character: the message (with
    its arguments) goes through `escape_controls` and its newlines are written ``\\n``
    (one record, one line: a client's newline cannot start a line that passes for the
    server's own); a traceback goes through `escape_controls` too (its last line quotes
    the exception's message) and keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return escape_controls(super().formatMessage(record)).replace("\n", "\\n")

    def formatException(self, ei) -> str:  # noqa: N802
        return escape_controls(super().formatException(ei))


# Lone surrogates: no Unicode character (UTF-8 and the tokenizer refuse them).
_SURROGATE_RE = re.compile(r"[\ud800-\udfff]")


def valid_unicode(text: str) -> str:
    """``text`` with each lone surrogate escaped: ``\\xNN`` for U+DC80–U+DCFF, the
    undecodable byte NN a file name carries through ``os.fsdecode`` (surrogateescape: a
    Latin-1 ``café`` lists as ``caf\\xe9``), ``\\uNNNN`` otherwise (a JSON
    ``"\\ud800"`` a tool returned). Text without them is returned as is."""
    if not _SURROGATE_RE.search(text):
        return text

    def one(m: re.Match[str]) -> str:
        code = ord(m.group())
        return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"

    return _SURROGATE_RE.sub(one, text)
