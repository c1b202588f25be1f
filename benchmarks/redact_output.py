"""Redaction of command output (issue 21, item 7): seconds per 1.6 MB of output.

Two outputs without secrets, as a command prints them, redacted whole
(:func:`ds4mlx.agent.redact.redact`): ``code`` is the standard library's own Python
source (``cat`` of many files: ``key``, ``token``, ``pass`` and ``cl`` are everywhere),
``log`` is lines of words with git SHAs and lockfile ``integrity`` hashes. Reported:
seconds (median of ``--repeats``) and MB/s for each.

    python benchmarks/redact_output.py [--mb 1.6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sysconfig
import time
from pathlib import Path

from ds4mlx.agent.redact import redact


def code_output(size: int) -> str:
    """``size`` characters of the standard library's Python source."""
    parts: list[str] = []
    total = 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = f.read_text(errors="replace")
        parts.append(text)
        total += len(text)
        if total >= size:
            break
    return "".join(parts)[:size]


def log_output(size: int) -> str:
    """``size`` characters (about) of words, commit SHAs and ``integrity`` hashes."""
    rng = random.Random(0)
    words = "the build step test passed failed warning info debug value cache".split()
    lines: list[str] = []
    total = 0
    while total < size:
        r = rng.random()
        digest = hashlib.sha512(str(r).encode()).hexdigest()
        if r < 0.1:
            line = f'  "integrity": "sha512-{digest}",'
        elif r < 0.2:
            line = f"commit {digest[:40]}"
        else:
            line = " ".join(rng.choice(words) for _ in range(12))
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=1.6)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    size = int(args.mb * 1e6)
    redact("warm up: the plugins are made once\n")
    for name, text in (("code", code_output(size)), ("log", log_output(size))):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = redact(text)
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        changed = sum(a != b for a, b in zip(out.splitlines(), text.splitlines(), strict=True))
        print(
            f"{name}: {len(text) / 1e6:.2f} MB in {s:.3f} s ({len(text) / 1e6 / s:.1f} MB/s), "
            f"{changed} lines redacted"
        )


if __name__ == "__main__":
    main()
