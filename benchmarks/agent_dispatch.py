"""Read-only calls dispatched at their block's close (issue 23 item 5): wall time of an
agent turn with two ``read`` calls, dispatch on vs off.

A scripted turn (tiny float32 model, every token through the network) writes two
``read`` calls of ``--file-mb`` MB files, then a third call (a ``write`` of ``--pad``
words, denied: no UI asks) standing in for a model still writing after the reads; then a
final answer. With dispatch the reads run while the model writes the rest of the turn.
Reported: median seconds of ``Agent.send`` over ``--repeats`` runs for each setting.

    python benchmarks/agent_dispatch.py [--file-mb 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from ds4mlx.agent.loop import Agent
from ds4mlx.engine import Engine
from ds4mlx.model.demo import DEMO_TINY_KWARGS
from ds4mlx.model.tiny import make_tiny
from tests.agent_script import invoke, turn


def script(pad: int) -> list[str]:
    """Two reads, a long denied write, then the answer."""
    return [
        turn(
            "Read both.",
            "",
            invoke("read", path="one.txt"),
            invoke("read", path="two.txt"),
            invoke("write", path="x", content="w " * pad),
        ),
        turn("Read.", "Both read."),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file-mb", type=float, default=4.0)
    ap.add_argument("--pad", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        make_tiny(str(work / "tiny"), **DEMO_TINY_KWARGS)
        engine = Engine.load(str(work / "tiny"), ctx_size=8192)
        ws = work / "ws"
        ws.mkdir()
        line = "x" * 99 + "\n"
        for name in ("one.txt", "two.txt"):
            (ws / name).write_text(line * int(args.file_mb * 1e6 / 100))
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for enabled in (True, False):
                agent = Agent(engine, ws, script=script(args.pad))
                agent.turns.dispatcher.enabled = enabled
                t0 = time.perf_counter()
                ok = agent.send("read them").ok
                times[enabled].append(time.perf_counter() - t0)
                agent.close()
                assert ok
        for enabled in (True, False):
            print(
                f"dispatch {'on ' if enabled else 'off'}: {statistics.median(times[enabled]):.3f} s"
            )


if __name__ == "__main__":
    main()
