"""Content spans of a rendered prompt: what the renderer wrote vs what it was given.

Only the renderer's own markers may become special tokens (`<｜User｜>`, EOS, `</think>`,
`｜DSML｜` …). Every piece of content — system and user text, tool results, tool schemas,
replayed reasoning, tool-call argument values — must be tokenized as plain text, so that a
file or a web page that spells `<｜end▁of▁sentence｜><｜User｜>` cannot end a turn or forge one
(docs/ARCHITECTURE.md §4, "Content is text, markers are ours").

The renderer builds its text with every content insertion wrapped by `content`: the text
between two Unicode noncharacters (U+FDD0 … U+FDD1; Unicode reserves U+FDD0–U+FDEF for a
program's internal use), with those characters inside the content escaped. `Rendered.parse`
strips the marks and keeps the content spans as character offsets, which the tokenizer uses
(``ds4mlx.tokenizer.Tokenizer.encode(text, content=spans)``). The marks never leave the
renderer: every public rendering function returns plain text or a `Rendered`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_OPEN = "\ufdd0"
_CLOSE = "\ufdd1"
_ESC = "\ufdd2"
_MARKS = re.compile("[\ufdd0\ufdd1\ufdd2]")


def content(text: str) -> str:
    """``text`` marked as content (see the module doc); "" stays ""."""
    if not text:
        return ""
    if _MARKS.search(text):
        text = _MARKS.sub(lambda m: _ESC + m.group(0), text)
    return _OPEN + text + _CLOSE


@dataclass(frozen=True)
class Rendered:
    """A rendered prompt (or part of one) and where its content lies.

    Attributes:
        text: the prompt text, exactly as the official encoding writes it.
        content: ``(start, end)`` character offsets of the content spans in ``text``,
            ascending and disjoint.
    """

    text: str
    content: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, text: Rendered | str) -> Rendered:
        """``text`` as a `Rendered`: a ``str`` is a rendering without content spans
        (every special-token spelling in it is a marker)."""
        return cls(text) if isinstance(text, str) else text

    @classmethod
    def parse(cls, marked: str) -> Rendered:
        """Strip the content marks of ``marked`` (renderer output) into a `Rendered`.

        Raises:
            ValueError: unbalanced marks (a renderer bug, never client input: client
                text containing the mark characters is escaped by `content`).
        """
        if not _MARKS.search(marked):
            return cls(marked)
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        n = 0  # length of the plain text so far
        start = -1
        pos = 0
        for m in _MARKS.finditer(marked):
            if m.start() < pos:  # an escaped mark, consumed with its escape
                continue
            piece = marked[pos : m.start()]
            out.append(piece)
            n += len(piece)
            ch = m.group(0)
            if ch == _ESC:
                out.append(marked[m.end() : m.end() + 1])
                n += 1
                pos = m.end() + 1
                continue
            if (ch == _OPEN) != (start < 0):
                raise ValueError("unbalanced content marks")
            if ch == _OPEN:
                start = n
            else:
                if n > start:
                    spans.append((start, n))
                start = -1
            pos = m.end()
        if start >= 0:
            raise ValueError("unbalanced content marks")
        out.append(marked[pos:])
        return cls("".join(out), tuple(spans))

    def tail(self, start: int) -> Rendered:
        """The part of this rendering from character ``start`` on (spans clipped)."""
        spans = tuple((max(a, start) - start, b - start) for a, b in self.content if b > start)
        return Rendered(self.text[start:], spans)

    def head(self, end: int) -> Rendered:
        """The part of this rendering before character ``end`` (spans clipped)."""
        spans = tuple((a, min(b, end)) for a, b in self.content if a < end)
        return Rendered(self.text[:end], spans)

    def __add__(self, other: Rendered) -> Rendered:
        shift = len(self.text)
        return Rendered(
            self.text + other.text,
            self.content + tuple((a + shift, b + shift) for a, b in other.content),
        )


def unmark(marked: str) -> str:
    """The plain text of renderer output ``marked``."""
    return Rendered.parse(marked).text
