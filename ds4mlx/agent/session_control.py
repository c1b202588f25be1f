"""Session commands of the agent (``/new``, ``/list``, ``/switch``, ``/save``, quit).

A mixin of `ds4mlx.agent.loop.Agent`: sessions are transcripts in a `SessionBook` plus
disk-KV snapshots written and restored through the agent's prompt-cache planner
(``ds4mlx.kv.plan.Planner``), so switching sessions is a restore, not a prefill.
"""

from __future__ import annotations

import time

from ds4mlx.agent.events import AgentError, Step
from ds4mlx.agent.sessions import SessionRecord, transcript_digest
from ds4mlx.dsml import Conversation


class SessionCommands:
    """Mixin: needs the `Agent` attributes ``book``, ``record``, ``planner``, ``session``,
    ``conv``, ``messages``, ``state``, ``exact``, ``tool_memory``, ``toolbox``, ``ui``,
    ``steps``, ``workspace`` and its ``_fresh``/``_bind_transcript`` methods."""

    def sessions(self) -> list[SessionRecord]:
        """Stored sessions of this workspace, plus the current one (by id)."""
        if self.book is None:
            raise AgentError("sessions are off (no session directory)")
        recs = {r.id: r for r in self.book.list(str(self.workspace))}
        if self.record is not None:
            recs[self.record.id] = self.record
        return [recs[k] for k in sorted(recs)]

    def save(self, reason: str = "continued") -> SessionRecord | None:
        """Snapshot the live state to the disk KV cache and write the transcript.

        Returns the session record (None when the session is empty). A snapshot that
        cannot be written (budget, disk error) is skipped (``kv_key`` None, a notice).
        """
        if self.record is None:
            return None
        rec = self.record
        rec.messages = self.messages
        rec.thinking = self.conv.thinking
        rec.exact = self.exact
        disk = self.planner.disk
        if disk is not None and self.session.tokens:
            ids = [i for i, _ in self.tool_memory.entries()]
            entry = disk.save_live(self.session, reason, self.tool_memory, ids)
            if entry is None:
                self.ui.notice("KV snapshot not saved (over the disk budget?)", "warn")
            rec.kv_key = entry.key if entry else None
            rec.kv_tokens = entry.tokens if entry else 0
            rec.state = self.state
            rec.kv_digest = transcript_digest(self.messages)
        if self.book is not None:
            self.book.put(rec)
        return rec

    def new_session(self) -> None:
        """Save the current session (``evict`` snapshot) and start an empty one."""
        if self.record is not None and len(self.messages) > 1:
            self.save("evict")
        self.record = None
        self._fresh(self.conv.thinking)
        self.planner.reset(self.session)
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
        if self.book is None:
            raise AgentError("sessions are off (no session directory)")
        if self.record is not None and sid == self.record.id:
            return f"session {sid} is already the current one"
        rec = self.book.get(sid)
        if rec is None:
            raise AgentError(f"no session {sid}; /list shows the sessions")
        if rec.workspace != str(self.workspace):
            raise AgentError(f"session {sid} belongs to workspace {rec.workspace}")
        if self.record is not None and len(self.messages) > 1:
            self.save("evict")
        t0 = time.monotonic()
        self.record = rec
        self.conv = Conversation(
            messages=list(rec.messages), tools=self.toolbox.specs, thinking=rec.thinking
        )
        self.exact = rec.exact
        self.toolbox.permissions.reset()
        self.state = "dirty"
        n = self.planner.resume(self.session, rec.kv_key) if rec.kv_key else None
        if n is None:
            self.planner.reset(self.session)
            return (
                f"switched to session {sid} ({len(rec.messages)} messages); its KV snapshot "
                "is not on disk, the next message rebuilds it"
            )
        # A snapshot older than the transcript (no clean exit since): the live tokens
        # end somewhere before it, so continue by rendered-text prefix.
        self.state = rec.state if rec.snapshot_matches() else "dirty"
        if self.state == "turn_end":
            self._bind_transcript()
        self.steps.append(Step("restore", 0, n, n, time.monotonic() - t0))
        return (
            f"switched to session {sid}: restored {n} tokens from the disk KV cache in "
            f"{(time.monotonic() - t0) * 1e3:.0f} ms (no prefill)"
        )

    def close(self) -> None:
        """Save the session (``shutdown`` snapshot) and stop background jobs."""
        try:
            if self.record is not None and len(self.messages) > 1:
                self.save("shutdown")
        finally:
            self.toolbox.close()

    def _persist(self) -> None:
        """Write the transcript (not the KV state: that is saved at switch/save/quit)."""
        if self.book is None or self.record is None:
            return
        self.record.messages = self.messages
        self.record.thinking = self.conv.thinking
        self.record.exact = self.exact
        try:
            self.book.put(self.record)
        except OSError as e:
            self.ui.notice(f"could not write the session file: {e}", "warn")
