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


@cache
def _prefilter() -> re.Pattern[str]:
    """Every plugin regex as one multi-line alternation: a quick test on a whole chunk.

    A superset of the plugins' own per-line matches (JWT shape checks and the like are
    left to them), so text it does not match holds no flagged line.
    """
    pats = [
        f"(?:{rx.pattern})"
        for p in _plugins()
        if isinstance(p, RegexBasedDetector)
        for rx in p.denylist
    ]
    return re.compile("|".join(pats), re.MULTILINE)


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
        # Which lines a plugin or the assignment rule may flag: one scan of the whole
        # chunk per pattern set (the plugins' own per-line checks are ~10x slower).
        starts = [m.start() for m in _PEM_BEGIN_RE.finditer(text)]
        for rx in (_prefilter(), _ASSIGNMENT_RE):
            for m in rx.finditer(text):
                starts += (m.start(), max(m.start(), m.end() - 1))
        if not starts and not self._in_pem:
            return text  # the common case
        newlines = [m.start() for m in re.finditer("\n", text)]
        candidates = {bisect.bisect_left(newlines, at) for at in starts}
        return "".join(self._lines(text, candidates))

    def peek(self, line: str) -> str:
        """An unfinished line redacted as :meth:`feed` would, without changing state."""
        if self._in_pem:
            return ""
        if _PEM_BEGIN_RE.search(line):
            return f"{MARKER}{PRIVATE_KEY_TYPE}]"
        return redact_line(line)

    def _lines(self, text: str, candidates: set[int]) -> Iterator[str]:
        pieces = text.split("\n")
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
