"""Read-only calls started at their DSML block's close (docs/ARCHITECTURE.md §7).

While the model is still writing a turn, a ``read``, ``list``, ``search`` or ``more``
call whose ``</｜DSML｜invoke>`` has been sampled can already run: it changes nothing, and
reads never ask (a path outside the workspace is refused, not asked). :class:`Dispatcher`
sees the decoder's `ToolCallEnd` events (on the MLX thread, from the turn's ``emit``)
and submits each such call to one worker thread, in call order; MLX stays on its thread.
Only the turn's leading read-only calls start early: once another call (a ``write``, a
``bash``, a malformed one) has closed, later reads wait for their turn after it, since
they may read what it changes.
After the turn, ``Steps.run_tools`` takes each call's outcome from here (waiting for it
if it still runs) instead of running it, so results are appended in call order into the
same suffix as without dispatch. A turn that ends cut (``max_tokens``, Ctrl+C, Esc) runs
no calls: :meth:`Dispatcher.drop` discards their results.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from ds4mlx.agent.tools import ToolOutcome
from ds4mlx.dsml import Event, ToolCallEnd

#: Tools that only read: started early when their call closes.
READ_ONLY = frozenset({"read", "list", "search", "more"})


class Dispatcher:
    """Early runs of one turn's read-only calls.

    Args:
        toolbox: the ``ds4mlx.agent.tools.Toolbox`` the calls run through.
        enabled: start calls early (False: every call runs after the turn).

    Attributes:
        enabled: as above; may be changed between turns.
    """

    def __init__(self, toolbox, enabled: bool = True) -> None:
        self.toolbox = toolbox
        self.enabled = enabled
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[str, Future[ToolOutcome]] = {}
        self._blocked = False  # a call that is not an early read came first in this turn

    def event(self, ev: Event) -> None:
        """A decoder event of the turn being generated: a closed, well-formed read-only
        call that would not ask is submitted to the worker."""
        if not (self.enabled and isinstance(ev, ToolCallEnd)):
            return
        call = ev.call
        if self._blocked or call.id in self._futures:
            return
        if not ev.closed or ev.error is not None or call.name not in READ_ONLY:
            self._blocked = True  # a later read may depend on what this call changes
            return
        if self.toolbox.permissions.needs_ask(call.name):
            self._blocked = True
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dispatch")
        self._futures[call.id] = self._pool.submit(self.toolbox.run, call.name, call.arguments)

    def started(self, call_id: str) -> bool:
        """True if the call was dispatched and has started (or finished) running."""
        f = self._futures.get(call_id)
        return f is not None and (f.running() or f.done())

    def done(self, call_id: str) -> bool:
        """True if the call was dispatched and has finished."""
        f = self._futures.get(call_id)
        return f is not None and f.done()

    def take(self, call_id: str) -> ToolOutcome | None:
        """The dispatched call's outcome (waiting for it to finish), or None if it was
        not dispatched. Each outcome is taken once."""
        f = self._futures.pop(call_id, None)
        return None if f is None else f.result()

    def drop(self) -> None:
        """Discard every outcome not taken (the turn was cut, or a steer skipped the
        calls): calls not started are cancelled, running ones finish unread; the next
        turn starts afresh."""
        for f in self._futures.values():
            f.cancel()
        self._futures.clear()
        self._blocked = False

    def close(self) -> None:
        """Drop what is left and stop the worker thread."""
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
