"""Job notices at the idle prompt (docs/ARCHITECTURE.md §7, "Jobs and notices").

A background job that ends while the user sits at the prompt is shown at once, not only
when the next message is sent. :func:`idle_notices` runs around the prompt's blocking
read: a thread polls the toolbox every ``interval`` seconds, takes each ended job's
notice into ``Steps.pending_notices`` (once: the toolbox marks the end seen) and shows
its line through ``show``. No turn starts: the late result goes out with the next user
message (``Steps.add_notices``), in the same user turn.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

IDLE_POLL_S = 0.25


@contextlib.contextmanager
def idle_notices(
    steps, show: Callable[[str], None], interval: float = IDLE_POLL_S
) -> Iterator[None]:
    """While the block runs, show each background job's end at once.

    Args:
        steps: the agent's ``ds4mlx.agent.steps.Steps`` (its ``collect_notices``).
        show: called on the watcher thread with each notice line (``job_1: job_1
            exited 0 after 2.0 s``); it must be safe to call while the prompt waits.
        interval: seconds between polls.
    """
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval):
            for line in steps.collect_notices():
                show(line)

    watcher = threading.Thread(target=watch, name="idle-notices", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
