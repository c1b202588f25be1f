"""Byte sizes as users type them (``--shard-size 256MB``, ``DS4MLX_MEMORY_LIMIT=24GiB``)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Bytes in ``text``: a number with an optional unit (decimal ``KB/MB/GB/TB``, binary
    ``KiB/MiB/GiB/TiB``; single letters are decimal), case-insensitive.

    Examples: ``"256MB"`` -> 256_000_000, ``"24GiB"`` -> 25_769_803_776, ``1e9`` -> 10**9.

    Raises:
        ValueError: not a size, or not positive.
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _SIZE.match(str(text).lower())
        if not m or m.group(2) not in _UNITS:
            raise ValueError(f"not a size: {text!r} (examples: 256MB, 5GB, 24GiB)")
        value = float(m.group(1)) * _UNITS[m.group(2)]
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units with three significant digits, e.g. ``"81.2 GB"``."""
    n = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"
