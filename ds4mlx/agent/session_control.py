"""Session commands of the agent (``/new``, ``/list``, ``/switch``, ``/save``, quit).

`SessionControl`, a part of `ds4mlx.agent.loop.Agent`: sessions are transcripts in a
`SessionBook` plus snapshots of the live state written and restored through the
agent's prompt cache (``PromptCache.save`` / ``resume``), so switching sessions is a
restore, not a prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ds4mlx.agent import once
from ds4mlx.agent.events import AgentError, Step
from ds4mlx.agent.live import Live, LiveState
from ds4mlx.agent.sessions import SessionBook, SessionRecord, transcript_digest
from ds4mlx.dsml import Conversation


class SessionControl:
    """Sessions of ``live`` in ``book`` (None: sessions off) for ``workspace``.

    Args:
        live: the agent's `Live`.
        book: the `SessionBook`, or None.
        workspace: the workspace (sessions belong to one).
        toolbox: the ``Toolbox`` (its permissions reset per session; closed at quit).
        fresh: ``f(thinking)`` that starts an empty transcript.
    """

    def __init__(self, live: Live, book: SessionBook | None, workspace, toolbox, fresh: Callable):
        self.live = live
        self.book = book
        self.workspace = workspace
        self.toolbox = toolbox
        self._fresh = fresh

    def sessions(self) -> list[SessionRecord]:
        """Stored sessions of this workspace, plus the current one (by id)."""
        if self.book is None:
            raise AgentError("sessions are off (no session directory)")
        recs = {r.id: r for r in self.book.list(str(self.workspace))}
        if self.live.record is not None:
            recs[self.live.record.id] = self.live.record
        return [recs[k] for k in sorted(recs)]

    def save(self, reason: str = "continued") -> SessionRecord | None:
        """Snapshot the live state to the disk KV cache and write the transcript.

        Returns the session record (None when the session is empty). A snapshot that
        cannot be written (budget, disk error) is skipped (``kv_key`` None, a notice).
        """
        lv = self.live
        if lv.record is None:
            return None
        rec = lv.record
        rec.messages = lv.messages
        rec.thinking = lv.conv.thinking
        rec.exact = lv.exact
        if lv.cache.disk is not None and lv.session.tokens:
            entry = lv.cache.save(reason)
            if entry is None:
                lv.ui.notice("KV snapshot not saved (over the disk budget?)", "warn")
            rec.kv_key = entry.key if entry else None
            rec.kv_tokens = entry.tokens if entry else 0
            rec.state = str(lv.state)
            rec.kv_digest = transcript_digest(lv.messages)
        if self.book is not None:
            self.book.put(rec)
        return rec

    def new_session(self) -> None:
        """Save the current session (``evict`` snapshot) and start an empty one."""
        lv = self.live
        if lv.record is not None and len(lv.messages) > 1:
            self.save("evict")
        lv.record = None
        self._fresh(lv.conv.thinking)
        lv.cache.reset()
        self.toolbox.permissions.reset()

    def switch(self, sid: int) -> str:
        """Make session ``sid`` current: restore its disk-KV snapshot (no prefill).

        The current session is saved first (``evict``). When the target's snapshot is
        gone (evicted, budget), the transcript is loaded and the next message rebuilds
        the live state from it (longest disk prefix, then prefill).

        Returns:
            A one-line description of what happened.
        Raises:
            AgentError: sessions are off, or ``sid`` is unknown / of another workspace.
        """
        lv = self.live
        if self.book is None:
            raise AgentError("sessions are off (no session directory)")
        if lv.record is not None and sid == lv.record.id:
            return f"session {sid} is already the current one"
        rec = self.book.get(sid)
        if rec is None:
            raise AgentError(f"no session {sid}; /list shows the sessions")
        if rec.workspace != str(self.workspace):
            raise AgentError(f"session {sid} belongs to workspace {rec.workspace}")
        if lv.record is not None and len(lv.messages) > 1:
            self.save("evict")
        t0 = time.monotonic()
        lv.record = rec
        lv.conv = Conversation(
            messages=list(rec.messages), tools=self.toolbox.specs, thinking=rec.thinking
        )
        lv.exact = rec.exact
        self.toolbox.permissions.reset()
        lv.state = LiveState.DIRTY
        n = lv.cache.resume(rec.kv_key) if rec.kv_key else None
        if n is None:
            lv.cache.reset()
            return self._close_cut(
                f"switched to session {sid} ({len(rec.messages)} messages); its KV snapshot "
                "is not on disk, the next message rebuilds it"
            )
        # A snapshot older than the transcript (no clean exit since): the live tokens
        # end somewhere before it, so continue by rendered-text prefix.
        lv.state = LiveState(rec.state) if rec.snapshot_matches() else LiveState.DIRTY
        if lv.state == LiveState.TURN_END:
            lv.bind_transcript()
        lv.steps.append(Step("restore", 0, n, n, time.monotonic() - t0))
        return self._close_cut(
            f"switched to session {sid}: restored {n} tokens from the disk KV cache in "
            f"{(time.monotonic() - t0) * 1e3:.0f} ms (no prefill)"
        )

    def _close_cut(self, said: str) -> str:
        """Answer the calls a crash cut "outcome unknown" (never rerun them); ``said``
        plus a note when there were any. After the restore: they are pending results."""
        n = once.close_cut_calls(self.live.messages)
        if n:
            self.persist()
            said += f"; {n} tool call(s) cut by a crash answered 'outcome unknown', not rerun"
        return said

    def close(self) -> None:
        """Save the session (``shutdown`` snapshot) and stop background jobs."""
        try:
            if self.live.record is not None and len(self.live.messages) > 1:
                self.save("shutdown")
        finally:
            self.toolbox.close()

    def persist(self) -> None:
        """Write the transcript (not the KV state: that is saved at switch/save/quit)."""
        lv = self.live
        if self.book is None or lv.record is None:
            return
        lv.record.messages = lv.messages
        lv.record.thinking = lv.conv.thinking
        lv.record.exact = lv.exact
        try:
            self.book.put(lv.record)
        except OSError as e:
            lv.ui.notice(f"could not write the session file: {e}", "warn")
