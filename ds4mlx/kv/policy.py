"""When to write disk KV snapshots (docs/ARCHITECTURE.md §5): pure functions over token counts.

Five save reasons, after ds4's server plus one for requests that are not continuations:

* ``cold`` — a cold prefill (nothing reused) of a prompt of ``min_tokens`` ..
  ``cold_max_tokens`` tokens saves one stable prefix of it: the chat anchor (everything
  before the last ``<｜User｜>`` that precedes the first ``<｜Assistant｜>``: system prompt,
  tools and scaffolding that independent sessions share) when that is at least
  ``min_tokens`` long; otherwise the prompt trimmed by ``boundary_trim_tokens`` and aligned
  down to ``boundary_align_tokens``; when that falls below ``min_tokens``, the whole
  prompt (saved after prefill, before generation). Prompts longer than
  ``cold_max_tokens`` get no cold save: the ``continued`` frontiers crossed while
  prefilling them already leave restart points.
* ``continued`` — each absolute frontier ``k * step`` (``step`` =
  ``continued_interval_tokens`` rounded up to a multiple of ``boundary_align_tokens``;
  10240 with the defaults) that the live state reaches during prefill or generation,
  once per frontier, if ≥ ``min_tokens``.
* ``prompt`` — the end of a prompt that was not a live continuation (a cold, disk or
  prefix plan; see ``prompt_end_save_point``), if ≥ ``min_tokens``: saved after prefill,
  before generation, so a retry or an exact replay of that prompt, or a sub-agent forked
  from it, resumes there (docs/ARCHITECTURE.md §5).
* ``evict`` — the live state, before an unrelated request replaces it, if it holds at
  least ``min_tokens`` tokens.
* ``shutdown`` — the live state on clean exit, same condition.

Trimming and alignment exist because BPE may merge tokens across the end of a prompt
once more text is appended; a save a little behind the end survives that, and the
rendered-text lookup covers the rest. Aligned points also coincide with the prefill
chunk schedule, so the compressed rows a snapshot holds were finalized exactly as in a
cold prefill of the longer prompt.

DeepSeek V4 caches cannot be trimmed backwards (the compressed rows and compressor
frontier past a point cannot be undone), so a snapshot at ``n`` tokens must be taken
*when the live state holds exactly ``n`` tokens*. Every function here therefore returns
the token counts at which the prefill or decode loop must pause and call
``Session.snapshot()``: the prefill loop splits its chunks so that one ends exactly at
each returned point (``ds4mlx.engine.prefill_chunks``), snapshots, and continues.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_DISK_SPACE_MB = 4096  # when a budget cannot be derived from free space
# A budget derived from free space: a quarter of what is free, within these bounds (MiB).
BUDGET_FREE_FRACTION = 4
MIN_DERIVED_BUDGET_MB = 256
MAX_DERIVED_BUDGET_MB = 64 * 1024
DEFAULT_WRITE_QUEUE_MB = 1024
DEFAULT_MIN_TOKENS = 512
DEFAULT_COLD_MAX_TOKENS = 30000
DEFAULT_CONTINUED_INTERVAL_TOKENS = 10000
DEFAULT_BOUNDARY_TRIM_TOKENS = 32
DEFAULT_BOUNDARY_ALIGN_TOKENS = 2048
# A disk lookup stops trying shorter candidates after this much time went to checks (ms).
DEFAULT_LOOKUP_MS = 1000


@dataclass(frozen=True)
class KVCacheSettings:
    """Disk-cache settings; each field mirrors a ``ds4mlx serve`` flag.

    Attributes:
        disk_dir: ``--kv-disk-dir`` (default `default_disk_dir`); None disables the disk
            cache (``--kv-disk-dir none``).
        disk_space_mb: ``--kv-disk-space-mb``, byte budget of the directory in MiB
            (default `derived_budget_mb` of the directory).
        min_tokens: ``--kv-cache-min-tokens``, smallest snapshot (tokens).
        cold_max_tokens: ``--kv-cache-cold-max-tokens``, longest prompt that gets a
            cold save (tokens; 0 disables cold saves).
        continued_interval_tokens: ``--kv-cache-continued-interval-tokens``, distance
            between continued frontiers before alignment (tokens; 0 disables them).
        boundary_trim_tokens: ``--kv-cache-boundary-trim-tokens``, tail dropped from a
            cold save (tokens).
        boundary_align_tokens: ``--kv-cache-boundary-align-tokens``, alignment of cold
            saves and continued frontiers (tokens; 0 = none).
        reject_different_quant: ``--kv-cache-reject-different-quant`` (ds4's flag): load
            only snapshots written with the same routed-expert bits. The engine's model
            identity already includes the quantization, so this changes nothing there.
        prompt_end: ``prompt`` saves at the end of prompts that were not live
            continuations (off with ``--kv-cache-no-prompt-end``).
        write_queue_mb: ``--kv-write-queue-mb``, bound of the writer thread's queue of
            pending saves (MiB; the oldest pending save is dropped beyond it).
        sessions: ``--sessions``, live states kept resident in memory (1 = the one live
            session; ``ds4mlx.kv.resident``). Independent of the disk directory.
        lookup_ms: ``--kv-cache-lookup-ms``, the time bound of a disk lookup's candidate
            checks (milliseconds): after the first candidate, no further one is tried
            once this much went to checking (besides the bound of
            ``ds4mlx.kv.tier.MAX_CANDIDATES`` candidates).

    Raises:
        ValueError: negative values, ``min_tokens`` < 1, ``disk_space_mb`` < 1, or a
            nonzero ``cold_max_tokens`` below ``min_tokens``.
    """

    disk_dir: str | None = None
    disk_space_mb: int = DEFAULT_DISK_SPACE_MB
    min_tokens: int = DEFAULT_MIN_TOKENS
    cold_max_tokens: int = DEFAULT_COLD_MAX_TOKENS
    continued_interval_tokens: int = DEFAULT_CONTINUED_INTERVAL_TOKENS
    boundary_trim_tokens: int = DEFAULT_BOUNDARY_TRIM_TOKENS
    boundary_align_tokens: int = DEFAULT_BOUNDARY_ALIGN_TOKENS
    reject_different_quant: bool = False
    prompt_end: bool = True
    write_queue_mb: int = DEFAULT_WRITE_QUEUE_MB
    sessions: int = 1
    lookup_ms: int = DEFAULT_LOOKUP_MS

    def __post_init__(self) -> None:
        for name in (
            "cold_max_tokens",
            "continued_interval_tokens",
            "boundary_trim_tokens",
            "boundary_align_tokens",
            "lookup_ms",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")
        if self.disk_space_mb < 1:
            raise ValueError(f"disk_space_mb must be >= 1, got {self.disk_space_mb}")
        if self.sessions < 1:
            raise ValueError(f"sessions must be >= 1, got {self.sessions}")
        if self.write_queue_mb < 1:
            raise ValueError(f"write_queue_mb must be >= 1, got {self.write_queue_mb}")
        if 0 < self.cold_max_tokens < self.min_tokens:
            raise ValueError(
                f"cold_max_tokens ({self.cold_max_tokens}) is below min_tokens "
                f"({self.min_tokens}); use 0 to disable cold saves"
            )

    @property
    def enabled(self) -> bool:
        """Whether a disk directory is configured."""
        return self.disk_dir is not None

    @property
    def budget_bytes(self) -> int:
        """The byte budget (int bytes)."""
        return self.disk_space_mb * 1024 * 1024

    @property
    def write_queue_bytes(self) -> int:
        """Bound of the writer's pending saves (int bytes)."""
        return self.write_queue_mb * 1024 * 1024

    @property
    def continued_step(self) -> int:
        """Distance between continued frontiers (tokens): the interval rounded up to a
        multiple of the alignment; 0 when continued saves are off."""
        step = self.continued_interval_tokens
        align = self.boundary_align_tokens
        if step <= 0:
            return 0
        if align > 0:
            step = -(-step // align) * align
        return step

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KVCacheSettings:
        """Settings from a namespace parsed with :func:`add_arguments`' flags.

        ``--kv-disk-dir`` unset means `default_disk_dir`, ``none`` (any case) means no
        disk cache; ``--kv-disk-space-mb`` unset means `derived_budget_mb` of that
        directory.

        Raises:
            ValueError: a setting out of range.
        """
        disk_dir = args.kv_disk_dir
        if disk_dir is None:
            disk_dir = str(default_disk_dir())
        elif disk_dir.strip().lower() == "none":
            disk_dir = None
        budget = args.kv_disk_space_mb
        if budget is None:
            budget = derived_budget_mb(disk_dir) if disk_dir else DEFAULT_DISK_SPACE_MB
        try:
            return cls._from_flags(args, disk_dir, budget)
        except ValueError as e:  # worded with the flags the user typed, not field names
            text = re.sub(r"\b[a-z_]+\b", lambda m: _FLAG_OF.get(m.group(), m.group()), str(e))
            raise ValueError(text) from None

    @classmethod
    def _from_flags(
        cls, args: argparse.Namespace, disk_dir: str | None, budget: int
    ) -> KVCacheSettings:
        return cls(
            disk_dir=disk_dir,
            disk_space_mb=budget,
            min_tokens=args.kv_cache_min_tokens,
            cold_max_tokens=args.kv_cache_cold_max_tokens,
            continued_interval_tokens=args.kv_cache_continued_interval_tokens,
            boundary_trim_tokens=args.kv_cache_boundary_trim_tokens,
            boundary_align_tokens=args.kv_cache_boundary_align_tokens,
            reject_different_quant=args.kv_cache_reject_different_quant,
            prompt_end=not args.kv_cache_no_prompt_end,
            write_queue_mb=args.kv_write_queue_mb,
            sessions=args.sessions if args.sessions is not None else 1,
            lookup_ms=args.kv_cache_lookup_ms,
        )


# The flag of each field `KVCacheSettings.__post_init__` may name in an error.
_FLAG_OF = {
    "disk_space_mb": "--kv-disk-space-mb",
    "min_tokens": "--kv-cache-min-tokens",
    "cold_max_tokens": "--kv-cache-cold-max-tokens",
    "continued_interval_tokens": "--kv-cache-continued-interval-tokens",
    "boundary_trim_tokens": "--kv-cache-boundary-trim-tokens",
    "boundary_align_tokens": "--kv-cache-boundary-align-tokens",
    "write_queue_mb": "--kv-write-queue-mb",
    "lookup_ms": "--kv-cache-lookup-ms",
    "sessions": "--sessions",
}


def default_disk_dir() -> Path:
    """The server's disk-cache directory by default: ``$XDG_CACHE_HOME/ds4mlx/kv``, else
    ``~/.cache/ds4mlx/kv`` (the agent keeps its own, ``…/ds4mlx/agent-kv``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ds4mlx" / "kv"


def derived_budget_mb(disk_dir: str | os.PathLike) -> int:
    """A byte budget for ``disk_dir`` from the free space of its filesystem (MiB).

    A quarter of the free space (snapshots plus what they already use count as free:
    a restart must not shrink the budget below what is stored), within
    [`MIN_DERIVED_BUDGET_MB`, `MAX_DERIVED_BUDGET_MB`]; `DEFAULT_DISK_SPACE_MB` when the
    filesystem cannot be asked.
    """
    p = Path(disk_dir)
    while not p.exists() and p != p.parent:
        p = p.parent  # the directory is created later; ask the filesystem it will be on
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return DEFAULT_DISK_SPACE_MB
    used = 0
    d = Path(disk_dir)
    if d.is_dir():
        used = sum(f.stat().st_size for f in d.glob("*.safetensors") if f.is_file())
    mb = (free + used) // BUDGET_FREE_FRACTION // 2**20
    return int(min(MAX_DERIVED_BUDGET_MB, max(MIN_DERIVED_BUDGET_MB, mb)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--kv-disk-*`` / ``--kv-cache-*`` flags (defaults as in ds4)."""
    g = parser.add_argument_group("prompt cache (disk tier, resident states)")
    g.add_argument("--kv-disk-dir", metavar="DIR", default=None,
                   help=f"directory of disk KV snapshots; 'none' turns the disk cache off "
                        f"(default {default_disk_dir()})")  # fmt: skip
    g.add_argument("--kv-disk-space-mb", type=int, metavar="MB", default=None,
                   help="byte budget of the directory in MiB (default: a quarter of the free "
                        f"space, {MIN_DERIVED_BUDGET_MB} MiB to {MAX_DERIVED_BUDGET_MB // 1024} GiB)")  # fmt: skip
    g.add_argument("--kv-cache-min-tokens", type=int, metavar="N", default=DEFAULT_MIN_TOKENS,
                   help="smallest snapshot in tokens (default %(default)s)")  # fmt: skip
    g.add_argument("--kv-cache-cold-max-tokens", type=int, metavar="N",
                   default=DEFAULT_COLD_MAX_TOKENS,
                   help="longest first prompt that gets a cold save; 0 = never (default %(default)s)")  # fmt: skip
    g.add_argument("--kv-cache-continued-interval-tokens", type=int, metavar="N",
                   default=DEFAULT_CONTINUED_INTERVAL_TOKENS,
                   help="save each time the live state reaches a multiple of this, rounded up "
                        "to the alignment; 0 = never (default %(default)s)")  # fmt: skip
    g.add_argument("--kv-cache-boundary-trim-tokens", type=int, metavar="N",
                   default=DEFAULT_BOUNDARY_TRIM_TOKENS,
                   help="tokens dropped from the end of a cold save (default %(default)s)")  # fmt: skip
    g.add_argument("--kv-cache-boundary-align-tokens", type=int, metavar="N",
                   default=DEFAULT_BOUNDARY_ALIGN_TOKENS,
                   help="align cold saves and frontiers to this many tokens (default %(default)s)")  # fmt: skip
    g.add_argument("--kv-cache-reject-different-quant", action="store_true",
                   help="ds4's flag, accepted: snapshots are never loaded across "
                        "quantizations here (the model identity includes them)")  # fmt: skip
    g.add_argument("--kv-cache-no-prompt-end", action="store_true",
                   help="no snapshot at the end of prompts that were not live continuations")  # fmt: skip
    g.add_argument("--kv-write-queue-mb", type=int, metavar="MB", default=DEFAULT_WRITE_QUEUE_MB,
                   help="pending snapshot bytes the writer thread holds before it drops the "
                        "oldest pending save (default %(default)s)")  # fmt: skip
    g.add_argument("--kv-cache-lookup-ms", type=int, metavar="MS", default=DEFAULT_LOOKUP_MS,
                   help="a disk lookup tries shorter snapshots while the longer ones fail "
                        "verification, for at most this many milliseconds of checks (and "
                        "at most 8 candidates; default %(default)s)")  # fmt: skip
    g.add_argument("--sessions", type=int, metavar="N", default=None,
                   help="live KV states kept resident in memory (a conversation, each "
                        "sub-agent, side requests); a job runs on the best match, one at a "
                        "time (default: min(4, what memory holds after the weights))")  # fmt: skip


# --------------------------------------------------------------------------- points


def store_len(settings: KVCacheSettings, n_tokens: int) -> int:
    """The trimmed, aligned save length for a prompt of ``n_tokens`` (tokens).

    ``n - trim`` aligned down; ``n`` itself when that would fall below ``min_tokens``
    (or when ``n`` is not above ``min_tokens + trim``).
    """
    trim, align = settings.boundary_trim_tokens, settings.boundary_align_tokens
    if n_tokens > settings.min_tokens + trim:
        stable = n_tokens - trim
        if align > 0:
            stable -= stable % align
        if stable >= settings.min_tokens:
            return stable
    return n_tokens


def chat_anchor(
    settings: KVCacheSettings,
    prompt_tokens: Sequence[int],
    *,
    user_token_id: int,
    assistant_token_id: int,
) -> int | None:
    """Tokens before the last ``user_token_id`` preceding the first ``assistant_token_id``.

    That prefix (system prompt, tools, client scaffolding) is what independent sessions
    of one client share. None when absent or shorter than ``min_tokens``.
    """
    last_user = -1
    for i, t in enumerate(prompt_tokens):
        if t == assistant_token_id:
            break
        if t == user_token_id:
            last_user = i
    return last_user if last_user >= settings.min_tokens else None


def cold_save_point(
    settings: KVCacheSettings,
    prompt_tokens: Sequence[int] | int,
    *,
    user_token_id: int | None = None,
    assistant_token_id: int | None = None,
) -> int | None:
    """Where a cold prefill of ``prompt_tokens`` should snapshot (tokens), or None.

    Args:
        prompt_tokens: the prompt's token ids, or just its length (then no chat anchor).
        user_token_id, assistant_token_id: ``<｜User｜>`` / ``<｜Assistant｜>`` ids for
            the chat anchor (both needed).

    Returns:
        None when the prompt is shorter than ``min_tokens``, longer than
        ``cold_max_tokens`` or cold saves are off; else the chat anchor if usable, else
        :func:`store_len`. The result lies in ``[min_tokens, len(prompt)]``; when it
        equals the prompt length the snapshot is taken after prefill, before generation.
    """
    n = prompt_tokens if isinstance(prompt_tokens, int) else len(prompt_tokens)
    if settings.cold_max_tokens <= 0 or n < settings.min_tokens or n > settings.cold_max_tokens:
        return None
    if (
        not isinstance(prompt_tokens, int)
        and user_token_id is not None
        and assistant_token_id is not None
    ):
        anchor = chat_anchor(
            settings,
            prompt_tokens,
            user_token_id=user_token_id,
            assistant_token_id=assistant_token_id,
        )
        if anchor is not None:
            return anchor
    return store_len(settings, n)


def continued_save_points(
    settings: KVCacheSettings, prev_len: int, new_len: int, *, last_saved: int = 0
) -> list[int]:
    """Continued frontiers crossed when the live state grows from ``prev_len`` to
    ``new_len`` tokens: multiples of :attr:`KVCacheSettings.continued_step` in
    ``(max(prev_len, last_saved), new_len]`` that are ≥ ``min_tokens``, ascending.

    ``last_saved`` is the largest count already saved for this live session (see
    :class:`SaveTracker`), so a frontier is never written twice.
    """
    step = settings.continued_step
    if step <= 0 or new_len <= prev_len:
        return []
    lo = max(prev_len, last_saved, settings.min_tokens - 1)
    first = (lo // step + 1) * step
    return list(range(first, new_len + 1, step))


@dataclass(frozen=True)
class SavePoint:
    """Pause at ``tokens`` (live state length) and write a snapshot for ``reason``."""

    tokens: int
    reason: str


def prefill_save_points(
    settings: KVCacheSettings,
    *,
    cached: int,
    prompt_tokens: Sequence[int] | int,
    last_saved: int = 0,
    user_token_id: int | None = None,
    assistant_token_id: int | None = None,
    prompt_end: bool = False,
) -> list[SavePoint]:
    """Every snapshot to take while prefilling ``prompt_tokens`` from ``cached`` tokens.

    A cold point (only when ``cached == 0``, i.e. nothing was reused), the continued
    frontiers in ``(cached, len(prompt)]`` and, with ``prompt_end`` (the prompt is not a
    live continuation) and ``settings.prompt_end``, the prompt's end when it is ≥
    ``min_tokens`` and > ``last_saved``. A point reached for several reasons is reported
    once, as ``cold`` before ``continued`` before ``prompt``. Ascending by ``tokens``; all
    points are > ``cached`` and ≤ the prompt length.
    """
    n = prompt_tokens if isinstance(prompt_tokens, int) else len(prompt_tokens)
    points: dict[int, str] = {}
    if (
        prompt_end
        and settings.prompt_end
        and n >= settings.min_tokens
        and n > max(cached, last_saved)
    ):
        points[n] = "prompt"
    points.update(
        (p, "continued") for p in continued_save_points(settings, cached, n, last_saved=last_saved)
    )
    if cached == 0:
        cold = cold_save_point(
            settings,
            prompt_tokens,
            user_token_id=user_token_id,
            assistant_token_id=assistant_token_id,
        )
        if cold is not None:
            points[cold] = "cold"
    return [SavePoint(t, r) for t, r in sorted(points.items())]


def should_save_live(settings: KVCacheSettings, live_tokens: int) -> bool:
    """Whether the live state is worth an ``evict`` or ``shutdown`` save."""
    return settings.enabled and live_tokens >= settings.min_tokens


@dataclass
class SaveTracker:
    """The largest token count saved for the current live session.

    ``reset()`` when the live session is replaced by a cold start; ``loaded(n)`` after
    restoring an ``n``-token disk snapshot (its frontiers are on disk already);
    ``saved(n)`` after each successful save. Pass :attr:`last_saved` to the point
    functions. ``scored``: the state is a scored prompt (``ds4mlx.kv.cache.Prompt.whole``)
    that no lookup restores (scoring always prefills the whole prompt), so no ``evict``,
    ``shutdown`` or ``continued`` save is due for it (lm-eval replaces one with the next
    at every request).
    """

    last_saved: int = field(default=0)
    scored: bool = field(default=False)

    def reset(self) -> None:
        self.last_saved = 0
        self.scored = False

    def loaded(self, n_tokens: int) -> None:
        self.last_saved = n_tokens

    def saved(self, n_tokens: int) -> None:
        self.last_saved = max(self.last_saved, n_tokens)

    def continued(self, settings: KVCacheSettings, prev_len: int, new_len: int) -> list[int]:
        """:func:`continued_save_points` with this tracker's ``last_saved``."""
        return continued_save_points(settings, prev_len, new_len, last_saved=self.last_saved)
