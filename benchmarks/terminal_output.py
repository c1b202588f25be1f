"""Terminal rendering of command output (issue 21, item 2): 1 MiB of progress bars.

A download-style progress bar (``\\r`` redraws with colour, an erase-in-line and a
percentage; one committed line every 100 redraws) is generated up to ``--mib`` MiB and
fed to :class:`ds4mlx.agent.terminal.TerminalText` in 64 KiB reads, as the job reader
delivers it. Reported: seconds for the whole stream (median of ``--repeats``), MB/s,
and the same for :class:`pyte.Screen` for comparison (``--screen``; slow). Goal: the
1 MiB stream in under 1 s.

    python benchmarks/terminal_output.py [--mib 1] [--repeats 5] [--screen]
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyte

from ds4mlx.agent.terminal import TerminalText

READ = 65536


def progress_stream(size: int) -> bytes:
    """``size`` bytes (about) of a coloured ``\\r`` progress bar, in UTF-8."""
    parts: list[str] = []
    total = 0
    i = 0
    while total < size:
        pct = i % 101
        bar = "█" * (pct // 4) + "░" * (25 - pct // 4)
        piece = f"\r\x1b[2K\x1b[32mfile_{i // 101}.bin\x1b[0m |{bar}| {pct:3d}% 12.3MB/s"
        if pct == 100:
            piece += "\n"
        parts.append(piece)
        total += len(piece.encode())
        i += 1
    return "".join(parts).encode()


def render(data: bytes) -> tuple[float, int]:
    """Seconds to render ``data`` in reads of 64 KiB, and the number of lines out."""
    t = TerminalText()
    start = time.perf_counter()
    lines = 0
    for k in range(0, len(data), READ):
        lines += t.feed(data[k : k + READ]).count("\n")
    lines += bool(t.feed(b"", final=True))
    return time.perf_counter() - start, lines


def render_screen(data: bytes) -> float:
    screen = pyte.Screen(200, 50)
    stream = pyte.ByteStream(screen)
    start = time.perf_counter()
    for k in range(0, len(data), READ):
        stream.feed(data[k : k + READ])
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--screen", action="store_true", help="also time pyte.Screen")
    args = ap.parse_args()
    data = progress_stream(int(args.mib * (1 << 20)))
    runs = [render(data) for _ in range(args.repeats)]
    secs = statistics.median(r[0] for r in runs)
    mb = len(data) / 1e6
    goal = "ok" if secs < args.mib else "over the goal"
    print(
        f"TerminalText: {len(data)} bytes ({runs[0][1]} lines out) in {secs:.3f} s "
        f"= {mb / secs:.1f} MB/s (goal < {args.mib:g} s per {args.mib:g} MiB: {goal})"
    )
    if args.screen:
        s = render_screen(data)
        print(f"pyte.Screen:  {s:.3f} s = {mb / s:.2f} MB/s")


if __name__ == "__main__":
    main()
