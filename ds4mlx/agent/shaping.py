"""Output shaping: fit a tool's output into a token budget without losing it.

A tool result goes straight into the model's context, so every result is cut to a
token budget. The cut keeps the head and the tail (where the useful parts of
command output and files usually are), marks the gap with a one-line note that
names a handle, and stores the full text so the model can page through the gap
with the ``more`` tool.

Sizes: ``budget`` and ``count_tokens`` are in tokens; offsets are in characters
(Python ``str`` indices); line numbers are 1-based.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

CountTokens = Callable[[str], int]

# A token practically never covers more characters than this, so a budget of N
# tokens never needs more than N * 32 characters measured. Guessing too low here
# would only cut an output that might just have fit; it never overruns a budget.
_MAX_CHARS_PER_TOKEN = 32


def approx_tokens(text: str) -> int:
    """Approximate token count of ``text``: one token per 4 characters, rounded up.

    The default ``count_tokens``; pass the real tokenizer's length for exact budgets.
    """
    return (len(text) + 3) // 4


def line_of(text: str, pos: int) -> int:
    """1-based number of the line that contains character offset ``pos``."""
    return text.count("\n", 0, pos) + 1


def count_lines(text: str) -> int:
    """Number of ``\\n``-separated lines; a final line without ``\\n`` counts, "" has 0."""
    if not text:
        return 0
    return text.count("\n") + (0 if text.endswith("\n") else 1)


def fit_prefix(text: str, start: int, end: int, budget: int, count: CountTokens) -> int:
    """Largest ``p`` in ``[start, end]`` with ``count(text[start:p]) <= budget``.

    Prefers to stop just after a newline; only when not even one whole line fits is
    the cut made inside a line. Returns ``start`` when nothing fits.
    """
    if budget <= 0 or start >= end:
        return start
    # Never measure more text than could possibly fit.
    limit = min(end, start + budget * _MAX_CHARS_PER_TOKEN)
    if limit == end and count(text[start:end]) <= budget:
        return end
    # Candidate cut points: just after each newline in [start, limit).
    bounds = [i + 1 for i in _find_all(text, "\n", start, limit)]
    lo, hi = 0, len(bounds)  # bounds[:lo] fit; find the count of fitting bounds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[start : bounds[mid - 1]]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    if lo > 0:
        return bounds[lo - 1]
    # Not one full line fits: cut inside the first line, by characters.
    line_end = bounds[0] if bounds else limit
    lo, hi = start, line_end
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[start:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit_suffix(text: str, start: int, end: int, budget: int, count: CountTokens) -> int:
    """Smallest ``p`` in ``[start, end]`` with ``count(text[p:end]) <= budget``.

    Prefers to start at the beginning of a line (mirror of :func:`fit_prefix`).
    Returns ``end`` when nothing fits.
    """
    if budget <= 0 or start >= end:
        return end
    limit = max(start, end - budget * _MAX_CHARS_PER_TOKEN)
    if limit == start and count(text[start:end]) <= budget:
        return start
    # Candidate starts: just after each newline in [limit, end - 1), nearest first.
    starts = [i + 1 for i in _find_all(text, "\n", max(limit - 1, 0), end - 1) if i + 1 >= limit]
    starts.reverse()  # starts[0] is the shortest suffix
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[starts[mid - 1] : end]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    if lo > 0:
        return starts[lo - 1]
    line_start = starts[0] if starts else limit
    lo, hi = line_start, end  # find the smallest p in [line_start, end] that fits
    while lo < hi:
        mid = (lo + hi) // 2
        if count(text[mid:end]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _find_all(text: str, sub: str, start: int, end: int):
    i = text.find(sub, start, end)
    while i != -1:
        yield i
        i = text.find(sub, i + 1, end)


@dataclass
class _Stored:
    text: str
    cursor: int  # next character `more` returns
    stop: int  # where `more` stops (start of the tail already shown, or the end)
    tail_start: int


@dataclass(frozen=True)
class Shaped:
    """A shaped output: ``text`` fits the budget; ``handle`` is set when a part was cut."""

    text: str
    handle: str | None = None


class OutputStore:
    """Shapes outputs to a token budget and keeps the full text of cut ones for ``more``.

    Args:
        budget: tokens one shaped output (or one ``more`` chunk) may take, marker
            included. At least 64.
        count_tokens: token counter (``str -> int``); :func:`approx_tokens` by default.
        max_outputs: how many cut outputs stay retrievable; the oldest are dropped first.
        max_chars: total characters kept across stored outputs; oldest dropped first
            (the newest is always kept).
        head_fraction: share of the budget given to the head (the rest is the tail).
    """

    def __init__(
        self,
        budget: int,
        count_tokens: CountTokens = approx_tokens,
        *,
        max_outputs: int = 64,
        max_chars: int = 64 << 20,
        head_fraction: float = 0.5,
    ) -> None:
        if budget < 64:
            raise ValueError(f"output token budget must be at least 64, got {budget}")
        self.budget = budget
        self.count_tokens = count_tokens
        self.max_outputs = max_outputs
        self.max_chars = max_chars
        self.head_fraction = head_fraction
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._ids = itertools.count(1)

    @property
    def handles(self) -> list[str]:
        """Handles still retrievable, oldest first."""
        return list(self._items)

    def shape(self, text: str, *, budget: int | None = None) -> Shaped:
        """Return ``text`` unchanged if it fits ``budget`` tokens, else head + marker + tail.

        The marker line reads ``[… N lines (C chars) cut: lines a–b of T; call more with
        handle="out_K" to read them]``; the full text is stored under that handle.
        """
        budget = self.budget if budget is None else budget
        n = len(text)
        if n <= budget * _MAX_CHARS_PER_TOKEN and self.count_tokens(text) <= budget:
            return Shaped(text)
        handle = f"out_{next(self._ids)}"
        total = count_lines(text)
        # Reserve room for the marker, measured on a worst-case-length sample.
        sample = self._marker(handle, total, total, total, n, total)
        room = max(budget - self.count_tokens(sample) - 2, 2)
        head_budget = max(int(room * self.head_fraction), 1)
        head_end = fit_prefix(text, 0, n, head_budget, self.count_tokens)
        tail_start = fit_suffix(text, head_end, n, room - head_budget, self.count_tokens)
        first_cut = line_of(text, head_end) if head_end < n else total
        last_cut = line_of(text, max(tail_start - 1, head_end))
        cut_lines = last_cut - first_cut + 1
        marker = self._marker(handle, cut_lines, first_cut, last_cut, tail_start - head_end, total)
        head = text[:head_end]
        sep = "" if not head or head.endswith("\n") else "\n"
        tail = text[tail_start:]
        tail_sep = "\n" if tail else ""
        self._put(handle, _Stored(text, head_end, tail_start, tail_start))
        return Shaped(f"{head}{sep}{marker}{tail_sep}{tail}", handle)

    @staticmethod
    def _marker(handle: str, lines: int, first: int, last: int, chars: int, total: int) -> str:
        return (
            f"[… {lines} lines ({chars} chars) cut: lines {first}–{last} of {total}; "
            f'call more with handle="{handle}" to read them]'
        )

    def _put(self, handle: str, item: _Stored) -> None:
        self._items[handle] = item
        while len(self._items) > self.max_outputs:
            self._items.popitem(last=False)
        while (
            len(self._items) > 1 and sum(len(v.text) for v in self._items.values()) > self.max_chars
        ):
            self._items.popitem(last=False)

    def more(self, handle: str, line: int | None = None) -> str:
        """Next chunk (at most ``budget`` tokens) of the stored output ``handle``.

        Without ``line``, continues where the previous chunk (or the head) ended and
        stops where the already-shown tail begins. With ``line`` (1-based), jumps to
        that line and continues to the end of the full output.

        Raises:
            KeyError: unknown or expired handle (message lists the live handles).
            ValueError: ``line`` beyond the end of the output.
        """
        item = self._items.get(handle)
        if item is None:
            live = ", ".join(self._items) or "none"
            raise KeyError(f"unknown or expired output handle {handle!r} (available: {live})")
        self._items.move_to_end(handle)
        text = item.text
        total = count_lines(text)
        if line is not None:
            if line < 1 or line > max(total, 1):
                raise ValueError(f"line {line} is outside the output (lines 1–{total})")
            item.cursor = _line_start(text, line)
            item.stop = len(text)
        if item.cursor >= item.stop:
            if item.stop < len(text):
                first = line_of(text, item.stop)
                return (
                    f"[end of the cut part of {handle}; lines {first}–{total} were shown "
                    f"after the cut. Call more with line=N to re-read from line N]"
                )
            return f"[end of output {handle} ({total} lines)]"
        footer_sample = self._footer(handle, total, total, total, True, True)
        room = max(self.budget - self.count_tokens(footer_sample) - 2, 1)
        end = fit_prefix(text, item.cursor, item.stop, room, self.count_tokens)
        if end == item.cursor:  # always make progress, even past a budget-sized char
            end = item.cursor + 1
        chunk = text[item.cursor : end]
        first, last = line_of(text, item.cursor), line_of(text, max(end - 1, item.cursor))
        item.cursor = end
        footer = self._footer(handle, first, last, total, end < item.stop, item.stop < len(text))
        sep = "" if chunk.endswith("\n") else "\n"
        return f"{chunk}{sep}{footer}"

    @staticmethod
    def _footer(
        handle: str, first: int, last: int, total: int, remaining: bool, tail_shown: bool
    ) -> str:
        if remaining:
            return f'[lines {first}–{last} of {total}; call more with handle="{handle}" for the next part]'
        if tail_shown:
            return f"[lines {first}–{last} of {total}; end of the cut part, the rest was shown after the cut]"
        return f"[lines {first}–{last} of {total}; end of output {handle}]"


def _line_start(text: str, line: int) -> int:
    """Character offset where 1-based ``line`` begins."""
    pos = 0
    for _ in range(line - 1):
        nxt = text.find("\n", pos)
        if nxt == -1:
            return len(text)
        pos = nxt + 1
    return pos
