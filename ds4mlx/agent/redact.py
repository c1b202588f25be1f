"""Secrets kept out of the model's context: command (and MCP) output redacted by line.

Output a command prints goes into the model's context, the session transcript and the
KV snapshot. :class:`Redactor` replaces what looks like a credential before that:

- lines flagged by one of ``detect-secrets``' pattern plugins (AWS, GitHub, GitLab,
  Slack, Stripe, OpenAI, npm, PyPI, JWT, Basic-Auth URLs, …). Its entropy plugins
  (they flag git SHAs and lockfile hashes), its keyword heuristic (it flags ordinary
  code such as ``password = ask()``) and its public-IP plugin are not used;
- ``NAME=value`` assignments whose upper-case name has a ``KEY``, ``TOKEN``,
  ``SECRET``, ``PASSWORD`` or ``PASSWD`` part (``AWS_SECRET_ACCESS_KEY=…``,
  ``export GITHUB_TOKEN=…``; not ``KEYBOARD=`` or ``$``-references);
- PEM private-key blocks, whole: from ``-----BEGIN … PRIVATE KEY-----`` to its END line
  (to the end of the output if none comes), as one marker line.

A plugin reports a match value, not a span (a GitHub token reports ``ghp``), so the
cut is by line: the line is kept up to the first match (or up to an assignment's
``=``) and the rest replaced by ``[redacted: TYPE]``, ``TYPE`` the plugin's secret
type (``GitHub Token``) or ``Secret Assignment``. Over-redacting the tail of a line is
the accepted cost. :data:`MARKER` starts every replacement: ``write`` and ``edit``
refuse content holding it (the model must not write the placeholder over a real
secret). ``read`` is not redacted: ``edit`` needs the exact text.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator
from functools import cache
from re import _constants as _c
from re import _parser

from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
from detect_secrets.plugins.base import BasePlugin, RegexBasedDetector

#: What every replacement starts with.
MARKER = "[redacted: "

# Not pattern plugins, or not secrets (see the module docstring).
_UNUSED_PLUGINS = frozenset(
    {"Base64HighEntropyString", "HexHighEntropyString", "KeywordDetector", "IPPublicDetector"}
)
ASSIGNMENT_TYPE = "Secret Assignment"
PRIVATE_KEY_TYPE = "Private Key"
_ASSIGNMENT_RE = re.compile(
    r"(?<![A-Za-z0-9_])(?:[A-Z0-9]+_)*(?:KEY|TOKEN|SECRET|PASSWORD|PASSWD)(?:_[A-Z0-9]+)*"
    r"\s*=\s*(?=[^\s$])"
)
_PEM_BEGIN_RE = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")
_PEM_END_RE = re.compile(r"-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")


@cache
def _plugins() -> tuple[BasePlugin, ...]:
    """One instance of each detect-secrets pattern plugin (made once)."""
    return tuple(
        cls()
        for cls in get_mapping_from_secret_type_to_class().values()
        if cls.__name__ not in _UNUSED_PLUGINS
    )


# A literal alternation is kept exact up to this many strings (else it breaks a run).
_MAX_LITERALS = 32
_ZERO_WIDTH = (_c.AT, _c.ASSERT, _c.ASSERT_NOT)
_REPEATS = (_c.MAX_REPEAT, _c.MIN_REPEAT, _c.POSSESSIVE_REPEAT)


def _exact(node) -> frozenset[str] | None:
    """Every string the parsed item ``node`` can match, when they are few literals."""
    op, av = node
    if op is _c.LITERAL:
        return frozenset({chr(av)})
    if op in _ZERO_WIDTH:
        return frozenset({""})  # a zero-width item joins its neighbours' text
    if op is _c.IN:
        if len(av) > 8 or any(o is not _c.LITERAL for o, _ in av):
            return None
        return frozenset(chr(a) for _, a in av)
    if op is _c.SUBPATTERN:
        _, add_flags, del_flags, seq = av
        return None if add_flags or del_flags else _seq_exact(seq)
    if op is _c.BRANCH:
        alts = [_seq_exact(a) for a in av[1]]
        if any(a is None for a in alts):
            return None
        out = frozenset().union(*alts)
        return out if len(out) <= _MAX_LITERALS else None
    if op in _REPEATS and av[1] == 1:  # x? or x{1}
        inner = _seq_exact(av[2])
        if inner is not None and av[0] == 0:
            inner |= {""}
        return inner if av[0] <= 1 else None
    return None


def _seq_exact(seq) -> frozenset[str] | None:
    out = frozenset({""})
    for node in seq:
        e = _exact(node)
        if e is None:
            return None
        out = frozenset(a + b for a in out for b in e)
        if len(out) > _MAX_LITERALS:
            return None
    return out


def _reduce(strings) -> frozenset[str] | None:
    """The strings without those holding a shorter member (a line holding the longer one
    holds the shorter); None when the empty string is among them (no requirement)."""
    if strings is None or "" in strings:
        return None
    short = sorted(set(strings), key=len)
    kept: list[str] = []
    for s in short:
        if not any(k in s for k in kept):
            kept.append(s)
    return frozenset(kept)


def _better(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    """The more selective of two requirements: longer shortest member, then fewer."""
    if a is None or b is None:
        return a if b is None else b
    return a if (min(map(len, a)), -len(a)) > (min(map(len, b)), -len(b)) else b


def _required(seq) -> frozenset[str] | None:
    """Strings one of which every match of the parsed sequence ``seq`` contains, or None.

    Consecutive exact items multiply into literal runs; a group, an alternation (each
    branch's requirement) or a repeat of at least one contributes its own requirement.
    """
    best: frozenset[str] | None = None
    run = frozenset({""})
    for node in seq:
        e = _exact(node)
        if e is not None:
            joined = frozenset(a + b for a in run for b in e)
            if len(joined) <= _MAX_LITERALS:
                run = joined
                continue
            best, run = _better(best, _reduce(run)), e
            continue
        best, run = _better(best, _reduce(run)), frozenset({""})
        op, av = node
        if op is _c.SUBPATTERN and not (av[1] or av[2]):
            best = _better(best, _required(av[3]))
        elif op is _c.BRANCH:
            alts = [_required(a) for a in av[1]]
            if all(a is not None for a in alts):
                best = _better(best, _reduce(frozenset().union(*alts)))
        elif op in _REPEATS and av[0] >= 1:
            best = _better(best, _required(av[2]))
    return _better(best, _reduce(run))


def screen_for(rx: re.Pattern[str]) -> tuple[bytes, ...] | None:
    """Literals (UTF-8) every line ``rx`` matches holds one of, or None if none is
    known (``rx`` must then scan the text itself). For a case-insensitive ``rx`` the
    literals are lower-case and searched in the lower-cased text.

    Python's ``re`` tries each alternative at every position; the plugins' regexes (a
    keyword list behind a look-behind, ``(?:cloudant|cl|clou)…``) cost ~1.5 s per MB that
    way. A substring search finds candidates; the plugin regex then checks those lines.
    """
    need = _required(_parser.parse(rx.pattern, rx.flags))
    if need is None or min(map(len, need)) < 2:
        return None  # one character (``:``) hits most lines: the regex scans faster
    if rx.flags & re.IGNORECASE:
        if not all(s.isascii() for s in need):
            return None  # the bytes are lower-cased for ASCII only
        need = _reduce(frozenset(s.lower() for s in need))
    return tuple(s.encode() for s in sorted(need))


@cache
def _screens() -> tuple[tuple[tuple[bytes, ...] | None, re.Pattern[str]], ...]:
    """``(literal screen or None, regex)`` for every plugin regex and the assignment rule."""
    rxs = [rx for p in _plugins() if isinstance(p, RegexBasedDetector) for rx in p.denylist]
    return tuple((screen_for(rx), rx) for rx in [*rxs, _ASSIGNMENT_RE])


def _screened_lines(text: str, lines: list[str]) -> set[int]:
    """Indexes of the ``lines`` of ``text`` a plugin regex or the assignment rule matches.

    The literals are searched in the UTF-8 bytes (a newline is one byte there, so byte
    offsets give line numbers; ``bytes.lower`` folds ASCII only and keeps offsets).
    """
    data = text.encode("utf-8", "surrogatepass")
    lower = data.lower()
    newlines = [m.start() for m in re.finditer(b"\n", data)]
    hits: set[int] = set()
    for screen, rx in _screens():
        if screen is None:
            hits.update(_regex_lines(text, rx))
            continue
        hay = lower if rx.flags & re.IGNORECASE else data
        for i in {bisect.bisect_left(newlines, at) for lit in screen for at in _find(hay, lit)}:
            if i not in hits and rx.search(lines[i]):
                hits.add(i)
    return hits


def _regex_lines(text: str, rx: re.Pattern[str]) -> Iterator[int]:
    """Indexes of the lines ``rx`` matches in, scanning the whole ``text``."""
    line, pos = 0, 0
    for m in rx.finditer(text):
        line += text.count("\n", pos, m.start())
        pos = m.start()
        yield line


def _flag(line: str) -> tuple[int, str] | None:
    """``(column where the secret starts, type)`` of the first secret on ``line``."""
    best: tuple[int, str] | None = None
    for plugin in _plugins():
        for value in plugin.analyze_string(line):
            at = line.find(value) if value else -1
            at = 0 if at < 0 else at
            if best is None or at < best[0]:
                best = (at, plugin.secret_type)
    m = _ASSIGNMENT_RE.search(line)
    if m is not None and (best is None or m.end() < best[0]):
        best = (m.end(), ASSIGNMENT_TYPE)
    return best


def _find(text: bytes, literal: bytes) -> Iterator[int]:
    """Offsets of ``literal`` in ``text`` (``bytes.find``: a fast substring search)."""
    at = text.find(literal)
    while at >= 0:
        yield at
        at = text.find(literal, at + 1)


def redact_line(line: str) -> str:
    """``line`` (no newline) with its secret, if any, replaced: see the module docstring."""
    hit = _flag(line)
    if hit is None:
        return line
    at, kind = hit
    return f"{line[:at]}{MARKER}{kind}]"


class Redactor:
    """Redacts one output stream; stateful across reads (a PEM block may span two).

    Feed whole lines (the terminal renderer commits lines) with :meth:`feed`; a
    line still being drawn with :meth:`peek`, which keeps no state.
    """

    def __init__(self) -> None:
        self._in_pem = False

    def feed(self, text: str) -> str:
        """``text`` (lines ending in ``\\n``, the last one may not) with secrets replaced."""
        if not text:
            return text
        # Which lines a plugin or the assignment rule may flag: each regex's literal
        # screen finds candidate lines in the whole chunk, the regex checks only those.
        lines = text.split("\n")
        candidates = _screened_lines(text, lines)
        candidates.update(_regex_lines(text, _PEM_BEGIN_RE))
        if not candidates and not self._in_pem:
            return text  # the common case
        return "".join(self._lines(lines, candidates))

    def peek(self, line: str) -> str:
        """An unfinished line redacted as :meth:`feed` would, without changing state."""
        if self._in_pem:
            return ""
        if _PEM_BEGIN_RE.search(line):
            return f"{MARKER}{PRIVATE_KEY_TYPE}]"
        return redact_line(line)

    def _lines(self, pieces: list[str], candidates: set[int]) -> Iterator[str]:
        for i, body in enumerate(pieces):
            end = "\n" if i < len(pieces) - 1 else ""
            raw = body + end
            if not raw:
                continue
            if i not in candidates and not self._in_pem:
                yield raw
                continue
            if self._in_pem:
                if _PEM_END_RE.search(body):
                    self._in_pem = False
                continue
            m = _PEM_BEGIN_RE.search(body)
            if m is not None:
                self._in_pem = _PEM_END_RE.search(body, m.end()) is None
                yield f"{body[: m.start()]}{MARKER}{PRIVATE_KEY_TYPE}]{end}"
                continue
            yield redact_line(body) + end


def redact(text: str) -> str:
    """A whole output redacted at once (an MCP result, a finished command)."""
    return Redactor().feed(text)


@cache
def _marker_re() -> re.Pattern[str]:
    kinds = sorted({p.secret_type for p in _plugins()} | {ASSIGNMENT_TYPE, PRIVATE_KEY_TYPE})
    return re.compile(re.escape(MARKER) + "(?:" + "|".join(map(re.escape, kinds)) + r")\]")


def count_markers(text: str) -> int:
    """How many redaction markers (``[redacted: GitHub Token]`` …) ``text`` holds."""
    return len(_marker_re().findall(text))


def introduces_marker(new: str, old: str = "") -> bool:
    """True if ``new`` holds more redaction markers than ``old`` (what it replaces).

    ``write`` and ``edit`` refuse such content: the marker stands for a secret the model
    never saw, and writing it would replace the real value. Text that already held a
    marker (a test of this module) can still be edited around it.
    """
    return count_markers(new) > count_markers(old)
