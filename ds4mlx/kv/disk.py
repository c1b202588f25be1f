"""The disk KV cache as the server uses it: store + save policy + the live session.

`DiskCache` ties `ds4mlx.kv.store.DiskKVStore` (files, lookup, eviction) and
`ds4mlx.kv.policy` (when to save) to one engine's live ``Session``:

- `checkpoints` lists the token counts at which a prefill must pause for a ``cold`` or
  ``continued`` snapshot; the caches cannot be trimmed backwards, so a snapshot at
  ``n`` tokens is taken while the session holds exactly ``n`` (`save_live`).
- `save_live` writes the live state (``evict`` before an unrelated request replaces it,
  ``shutdown`` on clean exit, and the checkpoints), with the tool-memory entries whose
  exact DSML is inside its text.
- `lookup` finds and verifies the longest stored rendered-text prefix of a prompt whose
  tokens are the prompt's (falling back to shorter ones).
- `reload_tool_memory` puts the persisted tool-memory entries back at startup, so exact
  DSML replay survives a restart.

Every method runs on the inference thread (MLX arrays belong to the thread that made
them); with ``background=True`` (the server) only the serialization of a snapshot does,
and its file I/O runs on a `ds4mlx.kv.writer.SnapshotWriter` thread, so an ``evict`` save
does not delay the request that caused it. Disk errors never fail a request: they are
logged and the cache is skipped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from ds4mlx.kv import policy
from ds4mlx.kv.store import DiskKVStore, Loaded
from ds4mlx.kv.writer import SnapshotWriter

log = logging.getLogger("ds4mlx.kv")

__all__ = ["DiskCache"]


class DiskCache:
    """Disk snapshots of one engine's live session.

    Args:
        engine: the ``ds4mlx.engine.Engine`` (identity, context size, tokenizer).
        settings: ``ds4mlx.kv.policy.KVCacheSettings`` with ``disk_dir`` set.
        store: an open `DiskKVStore` of that directory to use (the agent opens its own),
            or None to open one from ``settings``.
        background: write snapshot files on a `ds4mlx.kv.writer.SnapshotWriter` thread
            (the server); False writes them before `save_live` returns (the agent, which
            records the key of what it saved).

    Attributes:
        store: the `DiskKVStore`.
        settings: the settings.
        tracker: the largest token count saved (or queued) for the current live session
            (``policy.SaveTracker``); reset by the caller when the live state is replaced.
        writer: the `SnapshotWriter`, or None (synchronous saves).

    Raises:
        ValueError: ``settings.disk_dir`` is None.
        OSError: the directory cannot be created.
    """

    def __init__(
        self,
        engine,
        settings: policy.KVCacheSettings,
        *,
        store: DiskKVStore | None = None,
        background: bool = False,
    ):
        if settings.disk_dir is None:
            raise ValueError("DiskCache needs settings.disk_dir")
        self.engine = engine
        self.settings = settings
        self.tracker = policy.SaveTracker()
        self.store = store or DiskKVStore(
            settings.disk_dir,
            budget_bytes=settings.budget_bytes,
            model_identity=engine.identity,
            ctx_size=engine.ctx_size,
            expert_bits=engine.quant.expert_bits,
            reject_different_quant=settings.reject_different_quant,
        )
        # A pipeline split (``ds4mlx.engine.pipeline``): the other ranks remove their
        # parts of every snapshot this store removes (they never evict on their own).
        self.store.on_remove = getattr(engine.model, "drop_part", None)
        self.writer = (
            SnapshotWriter(self.store.write, max_bytes=settings.write_queue_bytes)
            if background
            else None
        )

    # ---------------------------------------------------------------- save points

    def checkpoints(
        self,
        *,
        cached: int,
        prompt_tokens: Sequence[int],
        rendered_text: str | None,
        prompt_end: bool = False,
        stable_text: str | None = None,
        tracker: policy.SaveTracker | None = None,
    ) -> list[policy.SavePoint]:
        """Snapshots to take while prefilling ``prompt_tokens`` from ``cached`` tokens.

        ``prompt_tokens`` are the ids the session will hold after prefill (kept live
        tokens + suffix); ``prompt_end``: the prompt is not a live continuation, so its
        end is a ``prompt`` save point (`ds4mlx.kv.policy.prefill_save_points`). A point whose tokens end inside a UTF-8 character, or whose
        text is not a prefix of ``rendered_text``, could never be found by a text
        lookup: it moves back (at most 8 tokens) to a clean boundary, or is dropped. The
        point at the prompt's end stays: it is saved under ``rendered_text`` too.
        ``stable_text``: a prefix of the prompt that a retry in another shape shares (see
        ``ds4mlx.kv.plan``); the most tokens whose text lies within it get a ``cold``
        point. ``tracker``: the saves of the live state being prefilled (default
        ``self.tracker``; the prompt cache passes each live state's own).
        """
        tracker = self.tracker if tracker is None else tracker
        tok = self.engine.tokenizer
        points = policy.prefill_save_points(
            self.settings,
            cached=cached,
            prompt_tokens=prompt_tokens,
            last_saved=tracker.last_saved,
            user_token_id=tok.user_id,
            assistant_token_id=tok.assistant_id,
            prompt_end=prompt_end,
        )
        if stable_text:
            n = self._tokens_within(prompt_tokens, stable_text)
            if cached < n and n > tracker.last_saved and n not in {p.tokens for p in points}:
                points = sorted([*points, policy.SavePoint(n, "cold")], key=lambda p: p.tokens)
        out: list[policy.SavePoint] = []
        for p in points:
            n = p.tokens
            if n == len(prompt_tokens) and rendered_text is not None:
                # The prompt's end is saved with the rendered prompt as a lookup key of
                # its own (``save_live(keys=…)``): a replay renders the same text even
                # when the tokens decode to other bytes (reasoning kept by a live or
                # alias hit, re-tokenized turn boundaries).
                out.append(p)
                continue
            while n > max(cached, p.tokens - 8):
                text = tok.decode(prompt_tokens[:n])
                if not text.endswith("\ufffd") and (
                    rendered_text is None or rendered_text.startswith(text)
                ):
                    break
                n -= 1
            else:
                continue
            if n >= self.settings.min_tokens and (not out or out[-1].tokens < n):
                out.append(policy.SavePoint(n, p.reason))
        return out

    def _tokens_within(self, ids: Sequence[int], text: str) -> int:
        """The most leading tokens of ``ids`` whose decoded text is a prefix of ``text``
        (binary search: a few decodes)."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if text.startswith(self.engine.tokenizer.decode(list(ids[:mid]))):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def continued_due(self, n_tokens: int, tracker: policy.SaveTracker | None = None) -> bool:
        """Whether the live state at ``n_tokens`` (during generation) is an unsaved
        continued frontier (``tracker``: that state's saves, default ``self.tracker``)."""
        tracker = self.tracker if tracker is None else tracker
        step = self.settings.continued_step
        return (
            not tracker.scored
            and step > 0
            and n_tokens % step == 0
            and n_tokens >= self.settings.min_tokens
            and n_tokens > tracker.last_saved
        )

    def worth_saving(self, n_tokens: int, tracker: policy.SaveTracker | None = None) -> bool:
        """Whether an ``evict``/``shutdown`` save of ``n_tokens`` live tokens is due:
        long enough, and not already saved at exactly this length (``tracker``: that
        state's saves, default ``self.tracker``); never for a scored prompt."""
        tracker = self.tracker if tracker is None else tracker
        return (
            policy.should_save_live(self.settings, n_tokens)
            and not tracker.scored
            and tracker.last_saved != n_tokens
        )

    # ---------------------------------------------------------------- save / load

    def save_live(
        self,
        session,
        reason: str,
        tool_memory=None,
        tool_ids: Iterable[str] = (),
        *,
        keys: Sequence[str | tuple[str, Sequence[int]]] = (),
        tracker: policy.SaveTracker | None = None,
        salt: str = "",
    ):
        """Snapshot the live session (on the inference thread; the file I/O runs on the
        writer thread when the cache has one).

        Args:
            session: the live ``Session``.
            reason: ``cold``, ``continued``, ``prompt``, ``evict`` or ``shutdown``.
            tool_memory: the ``ToolMemory`` to take entries from, or None.
            tool_ids: ids whose DSML may be inside the live text; the store keeps those
                whose DSML really occurs in it.
            keys: more lookup texts standing for the same state (the visible keys of a
                thinking turn, `ds4mlx.kv.live.visible_keys`, without their trailing
                EOS; a prompt's rendering), each ``(text, marks)`` (where it spells
                special tokens as plain text, ``ds4mlx.kv.plan._alias``); recorded as
                aliases of the snapshot (no second payload).
            tracker: the saves of ``session``'s live state (default ``self.tracker``).
            salt: the state's cache salt (``""``: none; ``DiskKVStore.prepare_save``).
        Returns:
            The written ``Entry`` (synchronous cache), the queued
            ``ds4mlx.kv.store.PreparedSave`` (background writer: both have ``key`` and
            ``tokens``), or None when nothing was saved (empty or mid-character text,
            serialization failure — logged).
        """
        n = len(session.tokens)
        if n == 0 or session.logits is None:
            return None
        text = session.text
        if not text or text.endswith("\ufffd"):
            log.info("kv cache: not saving tokens=%d reason=%s: text ends mid-character", n, reason)
            return None
        tools: dict[str, str] = {}
        if tool_memory is not None:
            for tid in tool_ids:
                dsml = tool_memory.get(tid)
                if dsml is not None:
                    tools[tid] = dsml
        t0 = time.perf_counter()
        try:
            # A pipeline split's other ranks save their parts under the same key.
            state = session.snapshot(disk_key=self.store.key_of(text, salt))
            prepared = self.store.prepare_save(
                text=text,
                tokens=state.tokens,
                arrays=state.arrays,
                reason=reason,
                meta=state.meta,
                tool_memory=tools,
                aliases=keys,
                salt=salt,
            )
            if prepared is None:
                return None
            if self.writer is not None:
                self.writer.submit(prepared)
                entry = prepared
            else:
                entry = self.store.write(prepared)
        except Exception:  # a full disk or a bad directory must not fail the request
            log.exception("kv cache: save failed tokens=%d reason=%s", n, reason)
            return None
        if entry is not None:
            (self.tracker if tracker is None else tracker).saved(n)
            log.debug(
                "kv cache: %s save of %d tokens %s in %.1f ms",
                reason,
                n,
                "queued" if self.writer is not None else "written",
                (time.perf_counter() - t0) * 1e3,
            )
        return entry

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is on disk (no-op without a writer)."""
        return self.writer.flush(timeout) if self.writer is not None else True

    def close(self, timeout: float | None = 300.0) -> None:
        """Write what is queued and stop the writer thread (clean shutdown)."""
        if self.writer is not None and not self.writer.close(timeout):
            log.warning("kv cache: the writer did not drain in %.0f s; pending saves lost", timeout)

    def lookup(
        self, rendered_text: str, accept=None, limit: int = 0, salt: str = ""
    ) -> Loaded | None:
        """The verified snapshot with the longest text that is a prefix of
        ``rendered_text`` (same model identity and context size) and that ``accept``
        takes, or None: `DiskKVStore.lookup_and_load` (``accept``, ``limit``: the
        candidate check made before any KV array is read, the most candidates tried;
        ``salt``: the prompt's cache salt, only snapshots saved under it are found; the
        checks' time bound is the settings' ``lookup_ms``).

        Corrupt or foreign files are skipped (and reported by the store), never loaded.
        """
        if self.writer is not None:
            # A snapshot of a prefix of this prompt may still be queued (an exact replay
            # right after its prompt): let it reach the disk first, so the lookup sees it.
            data = rendered_text.encode("utf-8", "surrogatepass")
            self.writer.wait_for(lambda p: p.salt == salt and p.prefix_of(data), timeout=60)
        try:
            return self.store.lookup_and_load(
                rendered_text,
                accept=accept,
                limit=limit,
                salt=salt,
                budget_ms=self.settings.lookup_ms,
            )
        except Exception:
            log.exception("kv cache: lookup failed")
            return None

    def load_key(self, key: str) -> Loaded | None:
        """The verified snapshot stored under ``key``, or None (gone, corrupt, foreign)."""
        from ds4mlx.kv.store import KVStoreError

        entry = next((e for e in self.store.entries() if e.key == key), None)
        if entry is None:
            return None
        try:
            return self.store.load(entry)
        except (KVStoreError, OSError) as e:
            log.warning("kv cache: cannot load %s: %s", key[:12], e)
            return None

    def reload_tool_memory(self, tool_memory) -> int:
        """Load the tool-memory entries of every usable snapshot into ``tool_memory``,
        oldest snapshot first (so the newest entries are the most recently used).

        Returns the number of entries loaded. Unreadable files are skipped.
        """
        n = 0
        for _, tools in self.store.tool_maps():
            tool_memory.load(list(tools.items()))
            n += len(tools)
        return n
