"""The prompt cache's disk tier: snapshots of live states (save points, evict and
shutdown saves, restores), on the inference thread.

`DiskTier` is composed into `ds4mlx.kv.plan.Planner` and `ds4mlx.kv.cache.PromptCache`
(no shared attributes);
every call names the live state (`ds4mlx.kv.resident.Resident`) it works on, whose own
save tracker and tool ids it reads and updates. The files, lookup and eviction are
`ds4mlx.kv.disk.DiskCache`'s.
"""

from __future__ import annotations

import logging
import time

from ds4mlx.dsml import Rendered
from ds4mlx.kv.plan import _NOT_CONTINUATIONS, Plan, _alias, _same_key, _same_markers, replaced
from ds4mlx.kv.resident import Resident

log = logging.getLogger("ds4mlx.kv")

__all__ = ["MAX_CANDIDATES", "DiskTier"]

# The most disk snapshots a lookup checks, longest first, before it gives up (cold). A
# check reads only a candidate's text and token tensors.
MAX_CANDIDATES = 8
# The most loaded snapshots a restore may refuse (each then marked bad) before the
# request runs cold: each costs a whole load.
MAX_RESTORE_TRIES = 3


class DiskTier:
    """Disk snapshots of the live states of one engine.

    Args:
        engine: the ``ds4mlx.engine.Engine`` (its tokenizer).
        disk: the `ds4mlx.kv.disk.DiskCache`.
        tool_memory: the ``ds4mlx.dsml.ToolMemory`` whose entries a snapshot carries, or
            None.
    """

    def __init__(self, engine, disk, tool_memory=None):
        self.engine = engine
        self.disk = disk
        self.tool_memory = tool_memory

    def save(self, r: Resident, reason: str, keys=()):
        """Snapshot state ``r`` now (``reason``: ``evict``, ``shutdown``, ``continued``…)
        with the tool ids it holds; ``keys``: more lookup texts (disk aliases). Returns
        what `DiskCache.save_live` returns (an entry with ``key``/``tokens``, or None)."""
        return self.disk.save_live(
            r.session,
            reason,
            self.tool_memory,
            r.live_tool_ids,
            keys=keys,
            tracker=r.tracker,
            salt=r.salt,
        )

    def with_checkpoints(
        self, plan: Plan, r: Resident, rendered: Rendered | None, stable_text: str | None
    ) -> Plan:
        """Attach the disk-save checkpoints of ``plan`` (cold point, continued frontiers,
        the prompt's end when it is not a live continuation).

        ``rendered`` (the prompt, or None to skip the check) must start with a
        checkpoint's text for that checkpoint to be kept: a snapshot no lookup can find
        is not worth its disk space. A snapshot at the prompt's end is indexed by
        ``rendered`` as well (an alias, with its marks), which a retry or replay renders
        again. ``stable_text``: the prefix a retry in another shape shares (a ``cold``
        point there).
        """
        text = rendered.text if rendered is not None else None
        prompt_ids = list(r.session.tokens[: plan.keep]) + list(plan.suffix_tokens)
        points = self.disk.checkpoints(
            cached=plan.cached,
            prompt_tokens=prompt_ids,
            rendered_text=text,
            # A retry, replay or sub-agent of a prompt that did not continue the live
            # state cannot continue it either: its end is saved for them.
            prompt_end=plan.decision in _NOT_CONTINUATIONS,
            stable_text=stable_text,
            tracker=r.tracker,
        )
        if points:
            reasons = {p.tokens: p.reason for p in points}
            plan.checkpoints = [p.tokens for p in points]
            plan.extra["checkpoint_reasons"] = reasons
            end = plan.prompt_tokens
            keys = (_alias(self.engine.tokenizer, rendered),) if text else ()

            def save(session, n: int) -> None:
                self.save(r, reasons.get(n, "continued"), keys if n == end else ())

            plan.on_checkpoint = save
        return plan

    def evict(self, r: Resident) -> None:
        """Save state ``r`` (``evict``) before something unrelated replaces it."""
        if self.disk.worth_saving(len(r.session.tokens), r.tracker):
            self.save(r, "evict", r.live_keys)

    def after_token(self, r: Resident) -> None:
        """After each generated token is fed: a ``continued`` save when state ``r``
        reaches an unsaved frontier."""
        if self.disk.continued_due(len(r.session.tokens), r.tracker):
            self.save(r, "continued")

    def restore(
        self, r: Resident, rendered: Rendered, salt: str = ""
    ) -> tuple[int, str, int] | None:
        """Rule 6: restore into ``r`` the longest stored rendered-text prefix of
        ``rendered`` whose markers match, trying from the longest down, up to
        `MAX_CANDIDATES` or the settings' ``lookup_ms`` of checks, whichever comes
        first; ``(tokens restored, log detail, characters of the prompt it covers)`` or
        None (no hit: ``r`` is unchanged). Only snapshots saved under the prompt's cache
        ``salt`` are candidates; on a hit ``r`` takes that salt.

        Each candidate is checked from its small text and token tensors before any KV
        array is read; a rejected one is logged and the next is tried. Loads first, then
        saves the state (evict) it replaces: saving first could evict, within the byte
        budget, the very snapshot about to be loaded. A loaded snapshot the session
        refuses (verified by digest, but not this model's state) is marked bad in the
        store and the lookup runs again: a shorter valid prefix still serves, up to
        `MAX_RESTORE_TRIES` refusals.
        """
        from ds4mlx.engine import SessionState, SnapshotError

        t0 = time.perf_counter()
        tok = self.engine.tokenizer

        def accept(entry, text: str, tokens) -> str | None:
            # The same bytes must be the same tokens. The snapshot's own text is what its
            # tokens decode to: checked against them. An alias is a rendering whose text
            # is not the tokens' (a visible key leaves out the reasoning the state holds,
            # by design): checked by the marks stored with it.
            end = len(text)
            if entry.via_alias:
                same = _same_key(tok, entry.alias_marks, rendered, end)
            else:
                same = _same_markers(tok, tokens(), rendered, end)
            return None if same else "matches as text, not as tokens"

        for attempt in range(MAX_RESTORE_TRIES):
            loaded = self.disk.lookup(rendered.text, accept, MAX_CANDIDATES, salt)
            if loaded is None:
                return None
            if attempt == 0:
                self.evict(r)
            state = SessionState(loaded.tokens, loaded.arrays, _from_disk(loaded))
            try:
                r.session.restore(state)  # a refusal leaves the session as it was
                break
            except (SnapshotError, ValueError) as e:
                # Verified by digest but not this model's state: never offered again.
                log.warning("kv cache: cannot restore %s: %s", loaded.entry.path.name, e)
                self.disk.store.mark_failed(loaded.entry, f"cannot restore: {e}")
        else:
            return None
        end = len(loaded.text)
        replaced(r)
        r.salt = salt
        self._loaded(r, loaded)
        n = len(loaded.tokens)
        ms = (time.perf_counter() - t0) * 1e3
        e = loaded.entry
        detail = (
            f"ids=0 key={e.key[:12]} reason={e.reason} tried={loaded.tried} "
            f"checked={loaded.check_ms:.0f}ms load={ms:.0f}ms"
        )
        return n, detail, end

    def resume(self, r: Resident, key: str) -> int | None:
        """Restore into ``r`` the snapshot stored under ``key`` (the agent's ``/switch``),
        after an ``evict`` save of what ``r`` holds; the caller has emptied ``r``'s
        bindings. Returns the tokens restored, or None when the snapshot is gone or
        unusable (``r`` is then empty)."""
        from ds4mlx.engine import SessionState, SnapshotError

        loaded = self.disk.load_key(key)
        self.evict(r)
        r.session.reset()
        replaced(r)
        if loaded is None:
            return None
        try:
            r.session.restore(SessionState(loaded.tokens, loaded.arrays, _from_disk(loaded)))
        except (SnapshotError, ValueError) as e:
            log.warning("kv cache: cannot restore %s: %s", key[:12], e)
            return None
        self._loaded(r, loaded)
        return len(loaded.tokens)

    def _loaded(self, r: Resident, loaded) -> None:
        """Bookkeeping after a snapshot was restored into ``r``."""
        r.tracker.loaded(len(loaded.tokens))
        if self.tool_memory is not None and loaded.tool_memory:
            self.tool_memory.load(loaded.tool_memory.items())
        r.live_tool_ids.update(dict.fromkeys(loaded.tool_memory))


def _from_disk(loaded) -> dict[str, str]:
    """A loaded snapshot's session meta plus ``disk_key``, its file's key: a pipeline
    split's other ranks load their parts of it by that key (``ds4mlx.kv.parts``)."""
    return {**loaded.meta, "disk_key": loaded.entry.key}
