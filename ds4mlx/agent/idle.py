"""Background jobs' end notices, also at the idle prompt (docs/ARCHITECTURE.md §7, "Jobs
and notices").

:class:`JobNotices` turns each ended job the model has not heard of into a late result of
the call that started it (``Steps.answer`` adds them before each answer). A job that ends
while the user sits at the prompt is shown at once, not only when the next message is
sent: :func:`idle_notices` runs around the prompt's blocking read, a thread polls every
``interval`` seconds, takes each notice into :attr:`JobNotices.pending` (once: the toolbox
marks the end seen) and shows its line through ``show``. No turn starts: the late result
goes out with the next user message, in the same user turn.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from ds4mlx.dsml import Message, ToolCall

IDLE_POLL_S = 0.25


class JobNotices:
    """Late results of ended background jobs for ``live``'s transcript.

    Attributes:
        job_calls: background job handle -> the `ToolCall` that started it.
        pending: late-result messages taken but not yet in the transcript.
    """

    def __init__(self, live, toolbox) -> None:
        self.live = live
        self.toolbox = toolbox
        self.job_calls: dict[str, ToolCall] = {}
        self.pending: list[Message] = []
        self._lock = threading.Lock()

    def collect(self) -> list[str]:
        """Take the ends of jobs the model has not heard of (each once: the toolbox marks
        them seen) into :attr:`pending`; their UI lines, returned (shown by the caller)."""
        with self._lock:
            shown = []
            for handle, outcome, detail in self.toolbox.job_notices():
                call = self.job_calls.get(handle)
                if call is None:
                    continue
                text = f"{outcome}\n{detail.rstrip()}" if detail.strip() else outcome
                self.pending.append(Message("tool", text, tool_call_id=call.id))
                shown.append(outcome)  # it names the job: "job_1 exited 0 after 2.0 s"
            return shown

    def add(self) -> None:
        """Append the pending notices (and any new ones, shown in the UI) to the
        transcript: each a ``tool`` message answering its call (the renderer heads it
        with the call: ``dsml.render_late_result``), after the pending results or user
        text, so it goes out in the next suffix. A notice whose call is in another
        session (after ``/new`` or ``/switch``) waits until that session is current
        again: the job's call was told it would hear of the end."""
        for line in self.collect():
            self.live.ui.notice(line)
        calls = {c.id for m in self.live.messages for c in m.tool_calls}
        with self._lock:
            here = [m for m in self.pending if m.tool_call_id in calls]
            self.pending = [m for m in self.pending if m.tool_call_id not in calls]
        self.live.messages.extend(here)


@contextlib.contextmanager
def idle_notices(
    notices: JobNotices, show: Callable[[str], None], interval: float = IDLE_POLL_S
) -> Iterator[None]:
    """While the block runs, show each background job's end at once.

    Args:
        notices: the agent's `JobNotices` (``Steps.notices``).
        show: called on the watcher thread with each notice line (``job_1: job_1
            exited 0 after 2.0 s``); it must be safe to call while the prompt waits.
        interval: seconds between polls.
    """
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval):
            for line in notices.collect():
                show(line)

    watcher = threading.Thread(target=watch, name="idle-notices", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
