"""Argument types and the parser class of the ``ds4mlx`` command line.

A bad value is caught while the arguments are parsed, before any model loads, and is
reported as one line on stderr with exit status 2 (``OneLineParser``): no usage block,
no traceback. Each type raises ``argparse.ArgumentTypeError`` with the reason.
"""

from __future__ import annotations

import argparse
import sys
from typing import TypeVar

N = TypeVar("N", int, float)


class OneLineParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose usage errors are one line: ``PROG: error: WHY (see PROG --help)``.

    Sub-parsers made with ``add_subparsers`` use this class too (argparse defaults the
    sub-parser class to the parent's)."""

    def error(self, message: str):  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def port(text: str) -> int:
    """A TCP port number, 1..65535 (0 would make the OS pick one nobody knows)."""
    n = _int(text)
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port (1..65535)")
    return n


def positive_int(text: str) -> int:
    """An integer >= 1 (context sizes, token counts)."""
    n = _int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return n


def nonempty(text: str) -> str:
    """A value that is not empty or blank (an unset ``$VAR`` passed as the value)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty value (an unset variable?)")
    return text


def positive_seconds(text: str) -> float:
    """A finite duration in seconds above 0 (a timeout, an interval): 0 or less would
    time out at once or, as an interval, fire without pause."""
    try:
        n = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < n < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds above 0")
    return n


def size(text: str) -> str:
    """A byte size such as ``96GB`` or ``24GiB``, checked here and kept as written (the
    fit check parses it again where it reads ``$DS4MLX_MEMORY_LIMIT``)."""
    from ds4mlx.model.units import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that names every option's default: ``(default: X)`` is appended unless the help
    text already shows the value (most say ``(8000)``) or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if d in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = {str(d), f"{d:g}" if isinstance(d, float) else str(d)}
        if "%(default)" in text or any(f"({v}" in text or f" {v})" in text for v in shown):
            return text
        return f"{text} (default: %(default)s)"


def int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1 in increasing order, e.g. ``512,1024,2048``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or min(values) < 1 or values != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"{text!r}: give increasing positive integers")
    return values


def env_positive(name: str, default: N) -> N:
    """A number > 0 from the environment variable ``name``, of ``default``'s type (int or
    float), else ``default``.

    For values the server settles on its own that users have no reason to tune but a
    test shortens, so that it does not sit through the production value: periods
    (an idle child's lifetime, a log interval, in seconds) and the demo model's output
    cap (tokens). Read when a module is imported, so a bad value cannot be a usage error
    with an exit code: it is named in one line on stderr and the default is used (a
    traceback at import would stop every command, ``--help`` included).
    """
    import os

    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = type(default)(raw)
    except ValueError:
        value = 0
    if not value > 0 or value == float("inf"):
        kind = "an integer" if isinstance(default, int) else "a number"
        print(
            f"ds4mlx: ignoring ${name}={raw!r} (give {kind} > 0); using {default}", file=sys.stderr
        )
        return default
    return value
