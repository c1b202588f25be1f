"""Agent sessions on disk: transcripts plus the key of their disk-KV snapshot.

Each agent session is one JSON file ``<dir>/<id>.json`` holding its transcript (the
neutral conversation messages, tool calls with their exact sampled DSML), its mode,
and the key of the disk-KV snapshot (:class:`ds4mlx.kv.store.DiskKVStore`) that holds
its live state. ``/switch N`` restores that snapshot into the engine session instead
of prefilling the transcript again (docs/ARCHITECTURE.md §7).

Files are written to a temp file, fsynced and renamed, so a crash leaves the previous
version. Unreadable files are skipped by :meth:`SessionBook.list`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds4mlx.dsml.conversation import Message, ToolCall
from ds4mlx.fsutil import TEMP_RE, atomic_write, private_dir, remove_stale_temps, temp_name

FORMAT = "ds4mlx-agent-session"
VERSION = 1
_NAME_RE = re.compile(r"^(\d+)\.json$")


@dataclass
class SessionRecord:
    """One agent session as stored.

    Attributes:
        id: session number (int, >= 1), what ``/switch N`` takes.
        workspace: absolute workspace path the session ran in.
        title: first user message, shortened (for ``/list``).
        created, updated: Unix seconds (float).
        thinking: thinking mode for new turns.
        messages: the transcript (system message first).
        kv_key: key of the disk-KV snapshot of the live state, or None.
        kv_tokens: token count of that snapshot (int).
        state: the loop's live-state marker when the snapshot was taken
            (a ``ds4mlx.agent.live.LiveState`` value: ``"turn_end"`` or ``"dirty"``).
        kv_digest: :func:`transcript_digest` of the messages when the snapshot was
            taken; the transcript may have moved on since (it is written after every
            message, the snapshot only at switch/save/quit).
        exact: the transcript renders to exactly the live text.
    """

    id: int
    workspace: str
    title: str = ""
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    thinking: bool = True
    messages: list[Message] = field(default_factory=list)
    kv_key: str | None = None
    kv_tokens: int = 0
    state: str = "dirty"
    exact: bool = True
    kv_digest: str = ""

    def snapshot_matches(self) -> bool:
        """True if the KV snapshot was taken with exactly the current transcript."""
        return bool(self.kv_key) and self.kv_digest == transcript_digest(self.messages)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "id": self.id,
            "workspace": self.workspace,
            "title": self.title,
            "created": self.created,
            "updated": self.updated,
            "thinking": self.thinking,
            "kv_key": self.kv_key,
            "kv_tokens": self.kv_tokens,
            "state": self.state,
            "exact": self.exact,
            "kv_digest": self.kv_digest,
            "messages": [message_to_json(m) for m in self.messages],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SessionRecord:
        """Inverse of ``to_json``. Raises ``ValueError`` on a foreign or malformed dict."""
        if d.get("format") != FORMAT:
            raise ValueError("not an agent session file")
        try:
            return cls(
                id=int(d["id"]),
                workspace=str(d["workspace"]),
                title=str(d.get("title", "")),
                created=float(d.get("created", 0.0)),
                updated=float(d.get("updated", 0.0)),
                thinking=bool(d.get("thinking", True)),
                messages=[message_from_json(m) for m in d.get("messages", [])],
                kv_key=d.get("kv_key") or None,
                kv_tokens=int(d.get("kv_tokens", 0)),
                state=str(d.get("state", "dirty")),
                exact=bool(d.get("exact", True)),
                kv_digest=str(d.get("kv_digest", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed agent session: {e}") from e


def message_to_json(m: Message) -> dict[str, Any]:
    """A transcript message as a JSON-ready dict (fields at their defaults omitted)."""
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.reasoning is not None:
        d["reasoning"] = m.reasoning
    if m.tool_calls:
        d["tool_calls"] = [
            {"id": c.id, "name": c.name, "arguments": c.arguments, "dsml": c.dsml}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


def message_from_json(d: dict[str, Any]) -> Message:
    """Inverse of :func:`message_to_json`."""
    return Message(
        role=d["role"],
        content=d.get("content", ""),
        reasoning=d.get("reasoning"),
        tool_calls=[
            ToolCall(c["id"], c["name"], c.get("arguments", {}), c.get("dsml"))
            for c in d.get("tool_calls", [])
        ],
        tool_call_id=d.get("tool_call_id"),
    )


def transcript_digest(messages: list[Message]) -> str:
    """SHA-1 (hex) of the transcript's JSON form."""
    data = json.dumps([message_to_json(m) for m in messages], ensure_ascii=False, sort_keys=True)
    return hashlib.sha1(data.encode("utf-8", "surrogatepass")).hexdigest()


def title_of(text: str, n: int = 60) -> str:
    """A one-line title from a user message (at most ``n`` characters)."""
    line = " ".join(text.split())
    return line if len(line) <= n else line[: n - 1] + "…"


def _session_file(name: str) -> bool:
    """A name the session book writes (``<id>.json``, or a temp file of one)."""
    return bool(re.fullmatch(r"[0-9]+\.json", name) or TEMP_RE.match(name))


class SessionBook:
    """The agent session files in one directory.

    Args:
        dir: directory (created 0700 if missing, narrowed to it if wider: transcripts
            are private; session files are written 0600). Temp files of dead writers
            are removed (``ds4mlx.fsutil.stale_temp``).

    Raises:
        OSError: ``dir`` cannot be created.
    """

    def __init__(self, dir: str | os.PathLike) -> None:
        self.dir = private_dir(dir, ours=_session_file)
        remove_stale_temps(self.dir)

    def _path(self, sid: int) -> Path:
        return self.dir / f"{sid}.json"

    def ids(self) -> list[int]:
        """Ids of the session files present, ascending."""
        out = []
        for p in self.dir.iterdir():
            m = _NAME_RE.match(p.name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def new_id(self) -> int:
        """An id no file uses yet (one more than the largest)."""
        ids = self.ids()
        return (ids[-1] + 1) if ids else 1

    def get(self, sid: int) -> SessionRecord | None:
        """The session ``sid``, or None if missing or unreadable."""
        try:
            with open(self._path(sid), encoding="utf-8") as f:
                return SessionRecord.from_json(json.load(f))
        except (OSError, ValueError):
            return None

    def list(self, workspace: str | None = None) -> list[SessionRecord]:
        """Readable sessions (of ``workspace`` only, when given), by id."""
        out = []
        for sid in self.ids():
            rec = self.get(sid)
            if rec is not None and (workspace is None or rec.workspace == workspace):
                out.append(rec)
        return out

    def put(self, rec: SessionRecord) -> None:
        """Write ``rec`` atomically (temp file, fsync, rename)."""
        rec.updated = time.time()
        data = json.dumps(rec.to_json(), ensure_ascii=False).encode("utf-8", "surrogatepass")
        tmp = self.dir / temp_name(str(rec.id))
        atomic_write(self._path(rec.id), data, tmp=tmp)
