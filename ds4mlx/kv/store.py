"""Disk KV cache store (docs/ARCHITECTURE.md §5).

One snapshot per file, named ``<key>.safetensors``. The key is the SHA-1 (hex) of the
model identity, the context size and the rendered text the snapshot's tokens decode to
(`text_key`: ``identity NUL ctx NUL text``, UTF-8): two checkpoints (or two context
sizes) sharing a directory never name the same file, so neither overwrites nor finds the
other's snapshots, and a lookup hashes only candidates of its own identity. The identity
is the engine's (``ds4mlx.engine.Engine.identity``: a digest of the weights' content).
Files of format version 1 (keys of the text alone) are removed when a store opens the
directory. The container is plain safetensors (written with ``mx.save_safetensors``, read with ``mx.load`` and, for
cheap header scans, the ``safetensors`` package):

* **metadata** (str -> str, the safetensors header): only small fixed-size fields, so a
  directory scan reads a few hundred bytes per file —

  ``format`` = ``"ds4mlx-kv"``, ``version`` = ``"2"``, ``model_identity``,
  ``expert_bits`` (``""`` when unknown), ``ctx_size``, ``tokens`` (count),
  ``text_bytes``, ``hits`` (at creation, always ``"0"``), ``created`` and ``last_used``
  (Unix seconds, ``repr(float)``), ``reason`` (``cold|continued|prompt|evict|shutdown``),
  ``tool_count``, ``session_meta`` (JSON of the engine's ``SessionState.meta``) and
  ``digest`` (``crc32:<hex>`` over every tensor; safetensors itself has no checksum and
  a bit-flipped KV tensor would silently corrupt generations).

* **tensors**: ``ds4mlx.text`` (uint8, the rendered text's UTF-8 bytes),
  ``ds4mlx.tokens`` (int32 token ids), ``ds4mlx.tool_memory`` (uint8, UTF-8 JSON object
  ``{tool id: exact DSML}``) and every session array as ``session.<name>``.
  The text and the tool map live in tensors rather than metadata because they grow with
  the conversation (100s of KB): as tensors they are stored byte-exact with no JSON
  escaping (prompts are full of quotes and newlines), a scan or ``kv ls`` never has to
  parse them out of the JSON header, and the header stays far below the 100 MB cap
  safetensors readers put on it.

Hit counts and last-used times change on every hit; rewriting a multi-hundred-MB file
for that is out of the question, and patching a JSON header in place is not crash-safe.
They live in a sidecar ``index.json`` (``{"version": 1, "entries": {key: {"created",
"hits", "last_used", "aliases"}}}``) replaced atomically on every hit. A sidecar record
counts only while its ``created`` equals the file's, so a stale record never applies to a
re-created file; a lost or corrupt sidecar only resets statistics and loses aliases.
An alias is ``[key, text bytes, marks]`` (its `text_key`): another lookup text of the
snapshot (a thinking turn's visible key, a prompt's rendering) and where that text spells special
tokens as plain text (character offsets; the same bytes with other marks are other
tokens, ``ds4mlx.kv.plan._same_key``); aliases of older builds, without marks, are
ignored. The snapshot files are never modified after their rename into place.

A save has two halves: :meth:`DiskKVStore.prepare_save` serializes the whole file into
memory (the only MLX work, on the thread that owns the arrays) and
:meth:`DiskKVStore.write` puts those bytes on disk (no MLX, any thread; the server runs it
on ``ds4mlx.kv.writer.SnapshotWriter``'s thread). Writes go to a temp file in the same
directory (``ds4mlx.fsutil.temp_name``: pid and process start tag; same filesystem, so
the rename is atomic), are fsynced, renamed over the final name, and the directory is
fsynced. A reader therefore sees either no file or a complete one; a killed writer
leaves only a temp file, which the next :class:`DiskKVStore` opened after the writer's
death removes (``ds4mlx.fsutil.stale_temp``, also under a container's PID 1). Room for a
new file is made *before* it is written (its exact size is known from the prepared
bytes), so the directory stays within budget even if the writer dies between the rename
and the eviction pass that follows it.

Files are created 0600 in a 0700 directory (``ds4mlx.fsutil.private_dir`` narrows an
existing one): they hold whole prompts.

**A full disk.** The budget is a share of the free space measured at start; other
programs may fill the filesystem since. A write failing with ``ENOSPC`` evicts the
lowest-valued snapshots (the order below) until the free space holds the new file (with
a little slack for its last block), then retries once; if nothing could be evicted, the
file would not fit even with every snapshot gone (nothing is evicted then), or the retry
fails too, the save is dropped (logged; ``SnapshotWriter.status()["failed"]``, shown by
``/health``) and serving goes on.

Eviction score (lower is evicted first; ties: least recently used first)::

    decayed_hits = hits * 2 ** (-(now - last_used) / HIT_HALF_LIFE_S)   (0 below 0.01)
    score        = (1 + decayed_hits) * tokens / size_bytes

``tokens / size_bytes`` is the prefill a hit saves per byte of disk; each hit
multiplies that value, but hits lose half their weight every ``HIT_HALF_LIFE_S``
(6 hours) without use, so an entry that was popular yesterday does not crowd out
today's. Unreadable files score ``-inf`` (evicted before anything else); the file being
written is never evicted.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import math
import os
import re
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from safetensors import safe_open

from ds4mlx.fsutil import (
    TEMP_RE,
    atomic_write,
    fsync_dir,
    private_dir,
    remove_stale_temps,
    stale_temp,
    temp_name,
    write_durable,
)

log = logging.getLogger("ds4mlx.kv")

FORMAT = "ds4mlx-kv"
VERSION = 2  # 2: keys include the model identity and context size
SUFFIX = ".safetensors"
INDEX_NAME = "index.json"
REASONS = ("cold", "continued", "prompt", "evict", "shutdown")
HIT_HALF_LIFE_S = 6 * 3600.0
MIN_EFFECTIVE_HITS = 0.01

TEXT_KEY = "ds4mlx.text"
TOKENS_KEY = "ds4mlx.tokens"
TOOLS_KEY = "ds4mlx.tool_memory"
SESSION_PREFIX = "session."

_FILE_RE = re.compile(r"^([0-9a-f]{40})\.safetensors$")
# A pipeline rank's part of a snapshot (``ds4mlx.kv.parts``): never scanned or evicted
# here, only removed with the rest by `clear_dir`.
_PART_RE = re.compile(r"^([0-9a-f]{40})\.rank[0-9]+\.safetensors$")


# Bad files logged one by one per scan; the rest in one line (a directory of 20,000 stray
# files wrote 20,000 warnings at start).
MAX_BAD_REPORTS = 20


def _sig(st: os.stat_result) -> tuple[int, int, int]:
    """The stat signature a file's cached reading is kept under: inode, mtime, size."""
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def cache_file(name: str) -> bool:
    """Whether ``name`` is one the disk KV cache writes (a snapshot, a pipeline rank's
    part, the hit index, a temp file): a directory of only these is the cache's own."""
    return bool(
        _FILE_RE.match(name) or _PART_RE.match(name) or name == INDEX_NAME or TEMP_RE.match(name)
    )


_REQUIRED_META = (
    "format",
    "version",
    "model_identity",
    "expert_bits",
    "ctx_size",
    "tokens",
    "text_bytes",
    "created",
    "reason",
    "digest",
)


class KVStoreError(Exception):
    """A snapshot file cannot be used (corrupt, truncated, foreign, vanished)."""


class OutdatedSnapshot(KVStoreError):
    """A snapshot of an older format version (never loaded; removed when a store opens
    its directory)."""


@dataclass(frozen=True)
class Entry:
    """One snapshot file as its header describes it.

    Attributes:
        key: `text_key` of the rendered text (the file name stem).
        path: the file.
        tokens: token count (int tokens).
        text_bytes: length of the rendered text (int bytes, UTF-8).
        model_identity: the engine identity the snapshot was written for.
        expert_bits: routed-expert quantization bits, or None when not recorded.
        ctx_size: context size the snapshot was written for (int tokens).
        hits: disk hits so far (from the sidecar index).
        created: creation time (float Unix seconds).
        last_used: last hit, or ``created`` (float Unix seconds).
        reason: ``cold``, ``continued``, ``evict`` or ``shutdown``.
        size: file size (int bytes).
        tool_count: tool-memory entries stored with it.
        head: the text's first line (at most 200 characters), for listings.
        via_alias: set by `DiskKVStore.lookup` when the prompt matched one of the
            snapshot's aliases: the length of that alias text (int bytes); 0 otherwise.
        alias_marks: with ``via_alias``, that alias's marks: where its text spells
            special tokens as plain text (character offsets, ascending).
        salt: the cache salt it was saved under (``""``: none; header field ``salt``,
            absent when empty): only a lookup with the same salt finds it.
    """

    key: str
    path: Path
    tokens: int
    text_bytes: int
    model_identity: str
    expert_bits: int | None
    ctx_size: int
    hits: int
    created: float
    last_used: float
    reason: str
    size: int
    tool_count: int = 0
    head: str = ""
    via_alias: int = 0
    alias_marks: tuple[int, ...] = ()
    salt: str = ""


@dataclass(frozen=True)
class BadFile:
    """A file in the cache directory that is never loaded, and why (``reason``)."""

    path: Path
    reason: str
    size: int


@dataclass
class ScanResult:
    """Directory contents: readable snapshots and unusable files."""

    entries: list[Entry] = field(default_factory=list)
    bad: list[BadFile] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """Bytes used by snapshot-named files, good or bad (int bytes)."""
        return sum(e.size for e in self.entries) + sum(b.size for b in self.bad)


@dataclass
class Loaded:
    """A verified snapshot, ready for ``Session.restore``.

    Attributes:
        entry: the file's :class:`Entry` (hits already counted).
        text: the rendered text the tokens decode to (str).
        tokens: token ids (list of int).
        arrays: the session arrays under their original names (``mx.array``, evaluated).
        meta: the engine's ``SessionState.meta`` as saved.
        tool_memory: tool id -> exact sampled DSML.
        tried: lookup candidates tried before it was taken, itself included (1 unless
            `DiskKVStore.lookup_and_load` fell back from longer ones).
        check_ms: milliseconds the lookup spent finding and checking candidates before
            this one's KV arrays were read (float).
    """

    entry: Entry
    text: str
    tokens: list[int]
    arrays: dict[str, mx.array]
    meta: dict[str, str]
    tool_memory: dict[str, str]
    tried: int = 1
    check_ms: float = 0.0

    def suffix(self, rendered_prompt: str) -> str:
        """The part of ``rendered_prompt`` after this snapshot's text.

        Raises:
            ValueError: the text is not a byte prefix of ``rendered_prompt``.
        """
        data = _utf8(rendered_prompt)
        mine = _utf8(self.text)
        if not data.startswith(mine):
            raise ValueError("snapshot text is not a prefix of the prompt")
        return data[len(mine) :].decode("utf-8", "surrogatepass")


@dataclass(frozen=True)
class PreparedSave:
    """A snapshot serialized in memory, ready for `DiskKVStore.write` on any thread.

    Attributes:
        key: `text_key` of ``text_bytes`` (the file name stem).
        text_bytes: the lookup text, UTF-8.
        tokens: token count (int tokens).
        reason: the save reason (one of `REASONS`).
        created: creation time written in the header (float Unix seconds).
        tools: the tool-memory entries stored in it (id -> exact DSML).
        data: the complete safetensors file (bytes-like; ``len`` is its size in bytes).
        aliases: more lookup texts that stand for the same state, each ``(UTF-8 text,
            marks)`` (see `DiskKVStore.prepare_save`), recorded in the sidecar index once
            the file is in place.
        salt: the cache salt it is keyed under (``""``: none).
    """

    key: str
    text_bytes: bytes
    tokens: int
    reason: str
    created: float
    tools: dict[str, str]
    data: memoryview | bytes = field(repr=False)
    aliases: tuple[tuple[bytes, tuple[int, ...]], ...] = ()
    salt: str = ""

    def prefix_of(self, prompt: bytes) -> bool:
        """Whether its text or one of its aliases is a prefix of ``prompt`` (UTF-8)."""
        texts = (self.text_bytes, *(a for a, _ in self.aliases))
        return any(prompt.startswith(t) for t in texts)

    @property
    def nbytes(self) -> int:
        """Size of the file to write (int bytes)."""
        return len(self.data)


# --------------------------------------------------------------------------- helpers


def _utf8(text: str) -> bytes:
    # Rendered prompts come from client JSON, where a lone surrogate ("\ud800") is legal;
    # surrogatepass keeps such text hashable and round-trippable instead of raising.
    return text.encode("utf-8", "surrogatepass")


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _alias(alias: str | tuple[str, Sequence[int]]) -> tuple[bytes, tuple[int, ...]]:
    """An alias argument as stored: ``(UTF-8 text, marks)``; a bare str has no marks."""
    text, marks = (alias, ()) if isinstance(alias, str) else alias
    return _utf8(text), tuple(int(o) for o in marks)


def _namespace(model_identity: str, ctx_size: int, salt: str = "") -> bytes:
    # A salted key puts ``salt:<salt> NUL`` before the text; a rendered prompt starts with
    # the BOS marker, never with that, so no unsalted text hashes like a salted one.
    ns = f"{model_identity}\0{int(ctx_size)}\0" + (f"salt:{salt}\0" if salt else "")
    return ns.encode("utf-8", "surrogatepass")


def text_key(text: str | bytes, model_identity: str, ctx_size: int, salt: str = "") -> str:
    """The cache key of ``text`` (str, or its UTF-8 bytes) for one model identity,
    context size and cache salt (``""``: none): SHA-1 hex of ``identity NUL ctx NUL
    text``, with ``salt:<salt> NUL`` before the text when salted (file names, aliases)."""
    data = text if isinstance(text, bytes) else _utf8(text)
    return _sha1(_namespace(model_identity, ctx_size, salt) + data)


def _digest(tensors: Mapping[str, mx.array]) -> str:
    """``crc32:<8 hex>`` over names, dtypes, shapes and bytes of ``tensors`` in name order.

    CRC-32 (zlib, several GB/s) rather than a cryptographic hash: it guards against
    corruption, and a cryptographic hash would add no protection against someone who can
    write the cache directory (there is no secret), only seconds per GB on every load.
    """
    crc = 0
    for name in sorted(tensors):
        a = tensors[name]
        crc = zlib.crc32(f"{name}\0{a.dtype}\0{tuple(a.shape)}\0".encode(), crc)
        if a.size:
            crc = zlib.crc32(memoryview(mx.contiguous(a)), crc)
    return f"crc32:{crc:08x}"


def _json_utf8(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass"
    )


def _bytes_array(data: bytes) -> mx.array:
    return mx.array(np.frombuffer(data, dtype=np.uint8)) if data else mx.zeros((0,), mx.uint8)


def _array_bytes(a: mx.array) -> bytes:
    return bytes(memoryview(mx.contiguous(a))) if a.size else b""


def _tools_in_text(
    tool_memory: Mapping[str, str] | Iterable[tuple[str, str]] | None, text: str
) -> dict[str, str]:
    """The entries of ``tool_memory`` whose DSML occurs in ``text`` (one substring search
    per distinct DSML block)."""
    pairs = tool_memory.items() if isinstance(tool_memory, Mapping) else (tool_memory or ())
    tools: dict[str, str] = {}
    present: dict[str, bool] = {}
    for tid, dsml in pairs:
        ok = present.get(dsml)
        if ok is None:
            ok = present[dsml] = bool(dsml) and dsml in text
        if ok:
            tools[tid] = dsml
    return tools


def _parse_meta(meta: Mapping[str, str]) -> dict:
    """Validate the header fields; return them typed. Raises KVStoreError."""
    if meta.get("format") != FORMAT:
        raise KVStoreError("not a ds4mlx KV snapshot (no format=ds4mlx-kv in the header)")
    missing = [k for k in _REQUIRED_META if k not in meta]
    if missing:
        raise KVStoreError(f"header lacks {', '.join(missing)}")
    try:
        version = int(meta["version"])
    except ValueError as e:
        raise KVStoreError(f"bad version {meta['version']!r}") from e
    if version < VERSION:
        raise OutdatedSnapshot(f"format version {version} (keys without the model identity)")
    if version != VERSION:
        raise KVStoreError(f"format version {version}, this build reads {VERSION}")
    try:
        out = {
            "model_identity": meta["model_identity"],
            "expert_bits": int(meta["expert_bits"]) if meta["expert_bits"] else None,
            "ctx_size": int(meta["ctx_size"]),
            "tokens": int(meta["tokens"]),
            "text_bytes": int(meta["text_bytes"]),
            "hits": int(meta.get("hits", "0")),
            "created": float(meta["created"]),
            "last_used": float(meta.get("last_used", meta["created"])),
            "reason": meta["reason"],
            "tool_count": int(meta.get("tool_count", "0")),
            "digest": meta["digest"],
            "salt": meta.get("salt", ""),
        }
    except ValueError as e:
        raise KVStoreError(f"malformed header field: {e}") from e
    if out["tokens"] <= 0 or out["text_bytes"] <= 0 or out["ctx_size"] <= 0:
        raise KVStoreError("header has non-positive tokens, text_bytes or ctx_size")
    if not math.isfinite(out["created"]):
        raise KVStoreError("header has a non-finite creation time")
    return out


def _head(text_bytes: bytes) -> str:
    line = text_bytes[:800].decode("utf-8", "replace").split("\n", 1)[0]
    return line[:200]


def read_entry(path: str | os.PathLike, *, verify_key: bool = True) -> Entry:
    """Read and check one snapshot's header (no tensors but the text are read).

    Checks: safetensors layout covers the file exactly (catches truncation and
    appended bytes), ``format``/``version``, header field types, tensor names, dtypes and
    shapes against the header counts and, with ``verify_key``, that the stored text
    hashes to the file name. Hit statistics come from the header (the sidecar is
    applied by :func:`scan_dir`).

    Raises:
        KVStoreError: the file is not a usable snapshot.
        FileNotFoundError: the file vanished (another process removed it).
    """
    path = Path(path)
    m = _FILE_RE.match(path.name)
    if not m:
        raise KVStoreError("file name is not <40 hex>.safetensors")
    key = m.group(1)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise
    except OSError as e:  # a symlink loop, a link into a directory it may not read
        raise KVStoreError(f"cannot stat it: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the reader for ever
        raise KVStoreError("not a regular file")
    size = st.st_size
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            hdr = _parse_meta(meta)
            names = set(f.keys())
            for need in (TEXT_KEY, TOKENS_KEY, TOOLS_KEY):
                if need not in names:
                    raise KVStoreError(f"tensor {need} missing")
            text_slice = f.get_slice(TEXT_KEY)
            tok_slice = f.get_slice(TOKENS_KEY)
            if text_slice.get_dtype() != "U8" or text_slice.get_shape() != [hdr["text_bytes"]]:
                raise KVStoreError("text tensor does not match the header's text_bytes")
            if tok_slice.get_dtype() != "I32" or tok_slice.get_shape() != [hdr["tokens"]]:
                raise KVStoreError("token tensor does not match the header's token count")
            text = (
                f.get_tensor(TEXT_KEY).tobytes()
                if verify_key
                else text_slice[: min(800, hdr["text_bytes"])].tobytes()
            )
    except FileNotFoundError:
        raise
    except KVStoreError:
        raise
    except Exception as e:  # safetensors raises its own error types for bad layouts
        raise KVStoreError(f"unreadable safetensors: {e}") from e
    if verify_key and text_key(text, hdr["model_identity"], hdr["ctx_size"], hdr["salt"]) != key:
        raise KVStoreError("identity, context and text do not hash to the file name")
    return Entry(
        key=key,
        path=path,
        tokens=hdr["tokens"],
        text_bytes=hdr["text_bytes"],
        model_identity=hdr["model_identity"],
        expert_bits=hdr["expert_bits"],
        ctx_size=hdr["ctx_size"],
        hits=hdr["hits"],
        created=hdr["created"],
        last_used=hdr["last_used"],
        reason=hdr["reason"],
        size=size,
        tool_count=hdr["tool_count"],
        head=_head(text),
        salt=hdr["salt"],
    )


def read_index(dir: str | os.PathLike) -> dict[str, dict]:
    """The sidecar records ``{key: {"created", "hits", "last_used", "aliases"}}`` ({} if
    none); ``aliases`` is a list of ``[key, text bytes, marks]`` (possibly empty;
    an alias without marks, from an older build, is dropped: nothing says which of its
    special-token spellings were plain text)."""
    p = Path(dir) / INDEX_NAME
    try:
        data = json.loads(p.read_text("utf-8"))
        entries = data["entries"] if data.get("version") == 1 else {}
        return {
            k: {
                "created": float(v["created"]),
                "hits": int(v["hits"]),
                "last_used": float(v["last_used"]),
                "aliases": [
                    [str(a[0]), int(a[1]), [int(o) for o in a[2]]]
                    for a in v.get("aliases", [])
                    if len(a) == 3
                ],
            }
            for k, v in entries.items()
        }
    except FileNotFoundError:
        return {}
    except Exception as e:  # any damage (an infinite count, a nesting past recursion)
        # only loses statistics: the next update rewrites the file whole.
        log.warning("kv cache: ignoring unreadable hit index %s: %s", p, e)
        return {}


def _apply_index(e: Entry, index: Mapping[str, dict]) -> Entry:
    rec = index.get(e.key)
    if rec is None or rec["created"] != e.created:
        return e
    return replace(e, hits=rec["hits"], last_used=max(rec["last_used"], e.created))


def _list_dir(dir: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(dir) as it:
            return list(it)
    except FileNotFoundError:
        return []


def scan_dir(dir: str | os.PathLike, *, verify_key: bool = True) -> ScanResult:
    """Every ``<key>.safetensors`` in ``dir``: readable entries and bad files.

    Safe while another process adds or removes files: a file that vanishes mid-scan is
    simply not listed. Does not modify the directory.
    """
    dir = Path(dir)
    index = read_index(dir)
    out = ScanResult()
    for de in _list_dir(dir):
        if not _FILE_RE.match(de.name):
            continue
        try:
            out.entries.append(_apply_index(read_entry(de.path, verify_key=verify_key), index))
        except FileNotFoundError:
            continue
        except KVStoreError as e:
            try:
                size = de.stat().st_size
            except FileNotFoundError:
                continue
            except OSError:
                size = 0
            out.bad.append(BadFile(Path(de.path), str(e), size))
    out.entries.sort(key=lambda e: e.last_used, reverse=True)
    return out


def match_keys(dir: str | os.PathLike, prefix: str) -> list[Path]:
    """Snapshot files in ``dir`` whose key starts with ``prefix`` (case-insensitive)."""
    prefix = prefix.lower()
    return sorted(
        Path(de.path)
        for de in _list_dir(Path(dir))
        if _FILE_RE.match(de.name) and de.name.startswith(prefix)
    )


def files_of_keys(dir: str | os.PathLike, prefix: str) -> dict[str, list[Path]]:
    """The files in ``dir`` of each snapshot key starting with ``prefix``
    (case-insensitive): its snapshot file and the pipeline ranks' parts
    (``ds4mlx.kv.parts``), which a rank > 0's directory may hold alone."""
    prefix = prefix.lower()
    keys: dict[str, list[Path]] = {}
    for de in _list_dir(Path(dir)):
        m = _FILE_RE.match(de.name) or _PART_RE.match(de.name)
        if m is not None and de.name.startswith(prefix):
            keys.setdefault(m.group(1), []).append(Path(de.path))
    return {k: sorted(v) for k, v in sorted(keys.items())}


def clear_dir(dir: str | os.PathLike) -> tuple[int, int]:
    """Remove every snapshot file, every pipeline rank's part file, the hit index and
    dead writers' temp files from ``dir``; returns how many snapshot files and how many
    part files were removed. Files of other names are left alone, and so is an
    ``index.json`` that is not the cache's (not a regular file, or neither in its
    format nor beside snapshots: a project's own file of that name)."""
    n = parts = 0
    for de in _list_dir(Path(dir)):
        snap = _FILE_RE.match(de.name) is not None
        part = _PART_RE.match(de.name) is not None
        if snap or part or stale_temp(de.name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(de.path)
                n += snap
                parts += part
    index = Path(dir) / INDEX_NAME
    if index.is_file() and not index.is_symlink() and (n or parts or _index_format(index)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(index)
    return n, parts


def _index_format(path: Path) -> bool:
    """Whether ``path`` holds the hit index's JSON shape (``version`` and ``entries``)."""
    try:
        data = json.loads(path.read_text("utf-8"))
    except Exception:
        return False
    return isinstance(data, dict) and "version" in data and isinstance(data.get("entries"), dict)


def with_hits(entry: Entry, dir: str | os.PathLike | None = None) -> Entry:
    """``entry`` with hit count and last-used time from the sidecar index of ``dir``
    (default: the entry's directory)."""
    return _apply_index(entry, read_index(dir if dir is not None else entry.path.parent))


def eviction_score(entry: Entry, now: float) -> float:
    """Keep-value of ``entry`` at ``now`` (Unix seconds); lower is evicted first.

    ``(1 + hits * 2**(-(now - last_used) / HIT_HALF_LIFE_S)) * tokens / size``, with the
    decayed hits floored to 0 below ``MIN_EFFECTIVE_HITS``.
    """
    hits = float(entry.hits)
    elapsed = now - entry.last_used
    if elapsed > 0:
        hits *= 2.0 ** (-elapsed / HIT_HALF_LIFE_S)
    if hits < MIN_EFFECTIVE_HITS:
        hits = 0.0
    return (1.0 + hits) * entry.tokens / max(entry.size, 1)


def load_file(path: str | os.PathLike) -> Loaded:
    """Read and fully verify one snapshot file (no identity checks, no hit counting).

    Verifies the header, the digest of every tensor, that the text hashes to the file
    name and that the token count and tool map are consistent. Every array is evaluated
    before returning, so the file may be removed afterwards.

    Raises:
        KVStoreError: corrupt, truncated or foreign file.
        FileNotFoundError: the file vanished.
    """
    path = Path(path)
    entry = read_entry(path, verify_key=False)
    try:
        tensors, meta = mx.load(str(path), format="safetensors", return_metadata=True)
        mx.eval(list(tensors.values()))
    except FileNotFoundError:
        raise
    except Exception as e:
        raise KVStoreError(f"unreadable safetensors: {e}") from e
    # Re-parse the header that came with these tensors: the file may have been replaced
    # (same key, new snapshot) between read_entry() and mx.load().
    hdr = _parse_meta(meta)
    if _digest(tensors) != hdr["digest"]:
        raise KVStoreError("digest mismatch: tensor data is corrupt")
    text_b = _array_bytes(tensors.pop(TEXT_KEY))
    if len(text_b) != hdr["text_bytes"] or (
        text_key(text_b, hdr["model_identity"], hdr["ctx_size"], hdr["salt"]) != entry.key
    ):
        raise KVStoreError("identity, context and text do not hash to the file name")
    tokens = tensors.pop(TOKENS_KEY)
    if tokens.dtype != mx.int32 or tokens.shape != (hdr["tokens"],):
        raise KVStoreError("token tensor does not match the header")
    try:
        tools = json.loads(_array_bytes(tensors.pop(TOOLS_KEY)).decode("utf-8", "surrogatepass"))
        session_meta = json.loads(meta.get("session_meta", "{}"))
        if not isinstance(tools, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in tools.items()
        ):
            raise ValueError("tool memory is not a str -> str object")
        if not isinstance(session_meta, dict):
            raise ValueError("session_meta is not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise KVStoreError(f"bad tool memory or session meta: {e}") from e
    arrays = {}
    for name, a in tensors.items():
        if not name.startswith(SESSION_PREFIX):
            raise KVStoreError(f"unexpected tensor {name}")
        arrays[name[len(SESSION_PREFIX) :]] = a
    entry = replace(
        entry,
        tokens=hdr["tokens"],
        created=hdr["created"],
        last_used=max(entry.last_used, hdr["created"]),
        model_identity=hdr["model_identity"],
        expert_bits=hdr["expert_bits"],
        ctx_size=hdr["ctx_size"],
        reason=hdr["reason"],
    )
    return Loaded(
        entry=entry,
        text=text_b.decode("utf-8", "surrogatepass"),
        tokens=tokens.tolist(),
        arrays=arrays,
        meta={str(k): str(v) for k, v in session_meta.items()},
        tool_memory=tools,
    )


# --------------------------------------------------------------------------- the store


class DiskKVStore:
    """The disk KV cache of one model in one directory.

    Args:
        dir: cache directory (created if missing).
        budget_bytes: byte budget for all snapshot files in ``dir`` (int bytes, > 0).
        model_identity: the engine's identity; lookups return only snapshots written
            with the same string. If it encodes the routed-expert quantization, snapshots
            are never shared across quantizations whatever ``reject_different_quant``
            says.
        ctx_size: context size (int tokens); lookups require the same value.
        expert_bits: routed-expert quantization bits, recorded in the header (None if
            not applicable).
        reject_different_quant: also require the same ``expert_bits`` on lookup.
        read_only: never modify the directory (no temp cleanup, no hit statistics);
            for inspection from another process.
        clock: current time in Unix seconds (tests inject one).

    Opening makes the directory private (0700), removes temp files left by dead writers
    and snapshots of an older format version, and evicts down to the budget. All
    methods are safe to call from one thread while other processes add or remove files
    in ``dir`` (a file that vanishes is a miss; a new one is picked up by the next
    call).

    Raises:
        ValueError: bad arguments.
        OSError: ``dir`` cannot be created.
    """

    def __init__(
        self,
        dir: str | os.PathLike,
        *,
        budget_bytes: int,
        model_identity: str,
        ctx_size: int,
        expert_bits: int | None,
        reject_different_quant: bool = False,
        read_only: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        if ctx_size <= 0:
            raise ValueError(f"ctx_size must be positive, got {ctx_size}")
        self.dir = Path(dir)
        self.budget_bytes = int(budget_bytes)
        self.model_identity = model_identity
        self.ctx_size = int(ctx_size)
        self.expert_bits = expert_bits
        self.reject_different_quant = reject_different_quant
        self.read_only = read_only
        self._clock = clock
        # Called with the key of every snapshot file this store removes (from the thread
        # that removes it: a pipeline split's rank 0 passes it on to the other ranks).
        self.on_remove: Callable[[str], None] | None = None
        self._lock = threading.RLock()
        self._write_lock = threading.Lock()
        # name -> (stat signature, Entry | BadFile); re-read only when a file changes.
        self._cache: dict[str, tuple[tuple, Entry | BadFile]] = {}
        self._index: dict[str, dict] = {}
        self._index_sig: tuple | None = None
        self._reported: set[tuple[str, tuple]] = set()
        # key -> (stat signature, reason) of a file that failed verification on load
        self._failed: dict[str, tuple[tuple, str]] = {}
        self._ns_hash = hashlib.sha1(_namespace(model_identity, ctx_size))
        if not read_only:
            private_dir(self.dir, ours=cache_file)
            for name in remove_stale_temps(self.dir):
                log.info("kv cache: removed stale temp file %s", self.dir / name)
            self._drop_outdated()
            self.evict()  # the budget may have been lowered since the last run
            scan = self.scan()
            usable = len(self.entries())
            # Of this model at another --ctx: named, as a changed --ctx makes them unusable.
            ctxs = sorted(
                {e.ctx_size for e in scan.entries if e.model_identity == model_identity}
                - {ctx_size}
            )
            log.info(
                "kv cache: %s: %d snapshots (%d usable; %d of other models or contexts%s, "
                "never loaded), %d bad, %.1f of %.1f MiB",
                self.dir, len(scan.entries), usable, len(scan.entries) - usable,
                f": this model at ctx {', '.join(map(str, ctxs))}" if ctxs else "",
                len(scan.bad), scan.total_bytes / 2**20, self.budget_bytes / 2**20,
            )  # fmt: skip
            if not os.access(self.dir, os.W_OK):  # a read-only mount, another owner
                log.warning(
                    "kv cache: %s is not writable: its snapshots are read, no new one is "
                    "saved (each save will log its failure)",
                    self.dir,
                )
            self._check_budget_room(scan.total_bytes)

    def _check_budget_room(self, stored: int) -> None:
        """Warn when the budget is more than the directory's filesystem can hold: its
        ``stored`` snapshot bytes plus the free space. Saves then meet a full disk before
        the budget (each evicts and retries, `write`), and every other writer on that
        disk meets it too."""
        free, block = self._free_space()
        room = stored + free
        if block and self.budget_bytes > room:
            log.warning(
                "kv cache: budget %.0f MiB is more than %s can hold (%.0f MiB: its snapshots "
                "and the free space): the disk fills up before the budget does "
                "(--kv-disk-space-mb)",
                self.budget_bytes / 2**20, self.dir, room / 2**20,
            )  # fmt: skip

    def _free_space(self) -> tuple[int, int]:
        """``(free, block)``: the bytes an unprivileged writer may still use on the
        directory's filesystem and its block size; ``(0, 0)`` when it cannot be asked."""
        try:
            st = os.statvfs(self.dir)
        except OSError:
            return 0, 0
        return st.f_bavail * st.f_frsize, st.f_frsize

    # ---------------------------------------------------------------- directory state

    def key_of(self, text: str | bytes, salt: str = "") -> str:
        """`text_key` of ``text`` for this store's identity and context size, under the
        cache salt ``salt`` (``""``: none)."""
        h = self._ns_hash.copy()
        if salt:
            h.update(f"salt:{salt}\0".encode("utf-8", "surrogatepass"))
        h.update(text if isinstance(text, bytes) else _utf8(text))
        return h.hexdigest()

    def _drop_outdated(self) -> None:
        """Remove the snapshots of an older format version (no identity in their key)."""
        for de in _list_dir(self.dir):
            # Regular files only: a FIFO under a snapshot name would block the open.
            if not _FILE_RE.match(de.name) or not os.path.isfile(de.path):
                continue
            try:
                with safe_open(de.path, framework="numpy") as f:
                    _parse_meta(f.metadata() or {})
            except OutdatedSnapshot as e:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(de.path)
                    log.info("kv cache: removed %s: %s", de.name, e)
            except Exception:  # other bad files are the scan's (reported, evicted first)
                continue

    def _refresh_index(self) -> None:
        p = self.dir / INDEX_NAME
        try:
            st = p.stat()
            sig = _sig(st)
        except FileNotFoundError:
            sig = None
        if sig != self._index_sig:
            self._index = read_index(self.dir) if sig else {}
            self._index_sig = sig

    def scan(self) -> ScanResult:
        """Current directory contents (entries of every identity, and bad files).

        Headers are re-read only for files that are new or changed since the last call.
        Bad files are logged once each (warning).
        """
        with self._lock:
            self._refresh_index()
            out = ScanResult()
            seen = set()
            unreported = 0  # bad files met for the first time in this scan
            for de in _list_dir(self.dir):
                if not _FILE_RE.match(de.name):
                    continue
                got = self._scan_one(de)
                if got is None:  # vanished
                    continue
                sig, item = got
                seen.add(de.name)
                if isinstance(item, BadFile):
                    if (item.path.name, sig) not in self._reported:
                        self._reported.add((item.path.name, sig))
                        unreported += 1
                        if unreported <= MAX_BAD_REPORTS:
                            log.warning(
                                "kv cache: skipping bad file %s: %s", item.path, item.reason
                            )
                    out.bad.append(item)
                else:
                    out.entries.append(item)
            for name in list(self._cache):
                if name not in seen:
                    del self._cache[name]
            if unreported > MAX_BAD_REPORTS:
                log.warning(
                    "kv cache: skipping %d more bad files in %s (ds4mlx kv ls --verify lists "
                    "them; ds4mlx kv rm removes them)", unreported - MAX_BAD_REPORTS, self.dir,
                )  # fmt: skip
            return out

    def _scan_one(self, de: os.DirEntry) -> tuple[tuple, Entry | BadFile] | None:
        """``(stat signature, Entry or BadFile)`` of one snapshot-named file (its header
        re-read only when the signature changed; a load failure recorded for it makes it
        bad), or None when it vanished."""
        try:
            st = de.stat()
            sig: tuple = _sig(st)
        except FileNotFoundError:
            return None
        except OSError as e:  # a symlink loop: read_entry names it a bad file
            sig = ("unstatable", e.errno)
        cached = self._cache.get(de.name)
        if cached is None or cached[0] != sig:
            try:
                item: Entry | BadFile = read_entry(de.path)
            except FileNotFoundError:
                return None
            except KVStoreError as e:
                item = BadFile(Path(de.path), str(e), sig[2] if len(sig) == 3 else 0)
            self._cache[de.name] = (sig, item)
        else:
            item = cached[1]
        if isinstance(item, Entry):
            failed = self._failed.get(item.key)
            if failed is not None and failed[0] == sig:
                return sig, BadFile(item.path, f"failed on load: {failed[1]}", item.size)
            item = _apply_index(item, self._index)
        return sig, item

    def _compatible(self, e: Entry) -> bool:
        return (
            e.model_identity == self.model_identity
            and e.ctx_size == self.ctx_size
            and (not self.reject_different_quant or e.expert_bits == self.expert_bits)
        )

    def entries(self) -> list[Entry]:
        """Readable snapshots this store may load (same identity, context, quant rule)."""
        return [e for e in self.scan().entries if self._compatible(e)]

    # ---------------------------------------------------------------- lookup and load

    def lookup(
        self, rendered_prompt: str, *, exclude: Iterable[str] = (), salt: str = ""
    ) -> Entry | None:
        """The snapshot with the longest text that is a byte prefix of ``rendered_prompt``.

        Only compatible snapshots (same model identity and context size, and same expert
        bits when ``reject_different_quant``) are considered; keys in ``exclude`` are
        skipped. A snapshot's aliases (sidecar index: the visible keys of a thinking turn,
        a prompt's rendering) count as texts of it; a match through one sets
        ``via_alias`` and ``alias_marks`` (the caller checks those). The comparison is
        on UTF-8 bytes via the SHA-1 key (the candidate's text itself is checked again
        by :meth:`load`). Ties in length prefer more tokens. Only snapshots saved under
        the cache salt ``salt`` are candidates (their keys hash it too). Returns None on
        a miss.
        """
        data = _utf8(rendered_prompt)
        excluded = set(exclude)
        cands: list[tuple[int, int, str, Entry]] = []
        for e in self.entries():
            if e.key in excluded or e.salt != salt:
                continue
            cands.append((e.text_bytes, e.tokens, e.key, e))
            rec = self._index.get(e.key)
            if rec is not None and rec["created"] == e.created:
                cands += [
                    (n, e.tokens, h, replace(e, via_alias=n, alias_marks=tuple(m)))
                    for h, n, m in rec["aliases"]
                ]
        cands = [c for c in cands if c[0] <= len(data)]
        cands.sort(key=lambda c: (c[0], c[1]), reverse=True)
        hashes: dict[int, str] = {}
        for n, _, key, e in cands:
            h = hashes.get(n)
            if h is None:
                h = hashes[n] = self.key_of(data[:n], salt)
            if h == key:
                return e
        return None

    def load(self, entry: Entry, *, count_hit: bool = True) -> Loaded:
        """Read and verify ``entry``; count a hit (hits + 1, last_used = now).

        Raises:
            KVStoreError: the file is incompatible (another model identity, context size
                or, with ``reject_different_quant``, expert bits), vanished, or corrupt.
                A corrupt file is logged and reported as bad from then on (until it
                changes); it is not deleted.
        """
        with self._lock:
            try:
                st = entry.path.stat()
                sig = _sig(st)
            except FileNotFoundError as e:
                raise KVStoreError(f"{entry.path} vanished") from e
            if not self._compatible(entry):
                log.warning(
                    "kv cache: not loading %s: model %s ctx %d, this is %s ctx %d",
                    entry.path.name, entry.model_identity, entry.ctx_size,
                    self.model_identity, self.ctx_size,
                )  # fmt: skip
                raise KVStoreError(f"{entry.path} is for another model, context or quantization")
            try:
                loaded = load_file(entry.path)
            except FileNotFoundError as e:
                raise KVStoreError(f"{entry.path} vanished") from e
            except KVStoreError as e:
                self._failed[entry.key] = (sig, str(e))
                log.warning("kv cache: not loading %s: %s", entry.path, e)
                raise
            if not self._compatible(loaded.entry):  # replaced since the scan: not ours now
                raise KVStoreError(f"{entry.path} is for another model, context or quantization")
            self._refresh_index()
            e2 = replace(_apply_index(loaded.entry, self._index), size=st.st_size)
            if count_hit and not self.read_only:
                e2 = replace(e2, hits=e2.hits + 1, last_used=max(self._clock(), e2.created))
                self._record_hit(e2)
            loaded.entry = e2
            return loaded

    def mark_failed(self, entry: Entry, reason: str) -> None:
        """Report ``entry`` as a bad file from now on, until its file changes: it loaded
        but its state could not be used (a restore refused it). Lookups skip it and the
        next save of its prompt replaces it, as for a file that failed to load."""
        with self._lock:
            try:
                st = entry.path.stat()
            except OSError:
                return
            self._failed[entry.key] = (_sig(st), reason)

    def read_tokens(self, entry: Entry) -> list[int]:
        """The token ids of ``entry``, reading only its small token tensor (no KV array).
        Not verified: `load` checks the digest of everything.

        Raises:
            KVStoreError: the file is unreadable or vanished.
        """
        try:
            with safe_open(str(entry.path), framework="numpy") as f:
                return f.get_tensor(TOKENS_KEY).astype("int64").tolist()
        except Exception as e:  # vanished, truncated, replaced: not this candidate
            raise KVStoreError(f"tokens of {entry.path.name} unreadable: {e}") from e

    def lookup_and_load(
        self,
        rendered_prompt: str,
        *,
        accept: Callable[[Entry, str, Callable[[], list[int]]], str | None] | None = None,
        limit: int = 0,
        salt: str = "",
        budget_ms: float | None = None,
    ) -> Loaded | None:
        """:meth:`lookup` then :meth:`load`, falling back to shorter prefixes when a
        candidate is rejected or fails to load. Returns None when nothing usable matches.

        Args:
            rendered_prompt: the prompt's rendered text.
            accept: ``accept(entry, text, tokens)`` checks a candidate before any KV
                array is read: ``text`` is the prompt prefix it matched (its own text or
                the alias), ``tokens()`` reads its token ids (`read_tokens`). Returns
                None to take it, or why not (logged; the next candidate is tried).
            limit: the most candidates tried (0: no limit).
            salt: the cache salt (`lookup`).
            budget_ms: no candidate after the first starts once this many milliseconds
                went to checking (None: no time bound). With ``limit`` it bounds what a
                prompt whose snapshots all fail verification costs before it goes cold.

        The loaded snapshot's ``tried`` counts the candidates tried, itself included, and
        ``check_ms`` the milliseconds spent. Giving up logs one line with both bounds.
        """
        failed: list[str] = []
        data = _utf8(rendered_prompt)
        t0 = time.monotonic()
        while True:
            ms = (time.monotonic() - t0) * 1e3
            if failed and (
                (limit and len(failed) >= limit) or (budget_ms is not None and ms >= budget_ms)
            ):
                bound = f"{limit} candidates" if limit else "no candidate limit"
                if budget_ms is not None:
                    bound += f" or {budget_ms:g} ms"
                log.info(
                    "kv cache: none of %d snapshot candidates verifies in %.0f ms "
                    "(bound: %s); not tried further",
                    len(failed),
                    ms,
                    bound,
                )
                return None
            e = self.lookup(rendered_prompt, exclude=failed, salt=salt)
            if e is None:
                return None
            read: list[list[int]] = []

            def tokens(e=e, read=read) -> list[int]:
                if not read:
                    read.append(self.read_tokens(e))
                return read[0]

            text = data[: e.via_alias or e.text_bytes].decode("utf-8", "surrogatepass")
            try:
                why = accept(e, text, tokens) if accept is not None else None
                check_ms = (time.monotonic() - t0) * 1e3
                if why is None:
                    loaded = self.load(e)
                    if read and loaded.tokens != read[0]:  # replaced since its tokens were read
                        why = "changed while it was checked"
            except KVStoreError:
                failed.append(e.key)
                continue
            if why is not None:
                log.info("kv cache: %s (%d tokens) %s; not used", e.key[:12], e.tokens, why)
                failed.append(e.key)
                continue
            if e.via_alias:
                # The alias hashed to a prefix of the prompt: that prefix is its text.
                loaded.text = text
                # How it matched (the hit count is the loaded entry's).
                loaded.entry = replace(
                    loaded.entry, via_alias=e.via_alias, alias_marks=e.alias_marks
                )
            loaded.tried = len(failed) + 1
            loaded.check_ms = check_ms
            return loaded

    def tool_maps(self, *, newest_first: bool = False) -> Iterator[tuple[Entry, dict[str, str]]]:
        """Yield ``(entry, {tool id: exact DSML})`` for each compatible snapshot with tools.

        Reads only the small tool-map tensor of each file (not the KV payload).
        Vanished or corrupt files are skipped (their load reports them). Order is by
        creation time, oldest first unless ``newest_first``.
        """
        for e in sorted(self.entries(), key=lambda e: e.created, reverse=newest_first):
            if not e.tool_count:
                continue
            try:
                with safe_open(str(e.path), framework="numpy") as f:
                    raw = f.get_tensor(TOOLS_KEY).tobytes()
                tools = json.loads(raw.decode("utf-8", "surrogatepass"))
            except Exception as exc:  # vanished or corrupt: not this file
                log.debug("kv cache: tool map of %s unreadable: %s", e.path, exc)
                continue
            if isinstance(tools, dict):
                yield e, {k: v for k, v in tools.items() if isinstance(v, str)}

    # ---------------------------------------------------------------- saving

    def save(
        self,
        *,
        text: str,
        tokens: Sequence[int],
        arrays: Mapping[str, mx.array],
        reason: str,
        meta: Mapping[str, str] | None = None,
        tool_memory: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
        aliases: Sequence[str | tuple[str, Sequence[int]]] = (),
    ) -> Entry | None:
        """Write a snapshot atomically now: :meth:`prepare_save` then :meth:`write`.

        Arguments, return value and errors as those two methods'. A caller that must not
        wait for the disk (the server's inference thread) calls :meth:`prepare_save` and
        hands the result to a writer thread (``ds4mlx.kv.writer.SnapshotWriter``).
        """
        prepared = self.prepare_save(
            text=text, tokens=tokens, arrays=arrays, reason=reason, meta=meta,
            tool_memory=tool_memory, aliases=aliases,
        )  # fmt: skip
        return self.write(prepared) if prepared is not None else None

    def prepare_save(
        self,
        *,
        text: str,
        tokens: Sequence[int],
        arrays: Mapping[str, mx.array],
        reason: str,
        meta: Mapping[str, str] | None = None,
        tool_memory: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
        aliases: Sequence[str | tuple[str, Sequence[int]]] = (),
        salt: str = "",
    ) -> PreparedSave | None:
        """Serialize a snapshot into memory (the whole safetensors file, as bytes).

        The only part of a save that touches MLX: call it on the thread that owns
        ``arrays`` (MLX arrays belong to the thread that made them). The result holds no
        MLX object, so :meth:`write` may run on any thread.

        Args:
            text: the rendered text ``tokens`` decode to, or a visible key standing for
                them (the lookup key; non-empty).
            tokens: token ids (non-empty, each in int32 range).
            arrays: session arrays (``SessionState.arrays``); copied into the bytes, so
                later mutation does not matter.
            reason: one of `REASONS`.
            meta: ``SessionState.meta`` (str -> str), returned by :meth:`load`.
            tool_memory: tool id -> exact DSML (mapping or pairs); only entries whose
                DSML occurs in ``text`` are stored (one substring search per distinct
                DSML block, so pass the conversation's ids rather than a huge map).
            aliases: more lookup texts that stand for the same state (a thinking turn's
                visible keys without their EOS, a prompt's rendering), each ``(text,
                marks)``: where the text spells special tokens as plain text (character
                offsets; a bare ``str`` has none). A prompt starting with one restores it
                and tokenizes only what follows, once the caller has checked the marks.
                Empty aliases and ``text`` itself are dropped.
            salt: the cache salt (``""``: none): part of the key and of its aliases'
                keys, stored in the header, so only a lookup with it finds the snapshot.

        Returns:
            The `PreparedSave`, or None when serializing failed (logged).

        Raises:
            ValueError: bad arguments (empty text or tokens, unknown reason, reserved or
                non-str names); also when the store is read-only.
        """
        if self.read_only:
            raise ValueError("store is read-only")
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
        if not isinstance(text, str) or not text:
            raise ValueError("text must be a non-empty str")
        if len(tokens) == 0:
            raise ValueError("tokens must be non-empty")
        meta = dict(meta or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise ValueError("meta must be str -> str")
        text_b = _utf8(text)
        tools = _tools_in_text(tool_memory, text)
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
            raise ValueError("tokens must be a flat sequence of ids in int32 range")
        tensors: dict[str, mx.array] = {
            TEXT_KEY: _bytes_array(text_b),
            TOKENS_KEY: mx.array(ids.astype(np.int32)),
            TOOLS_KEY: _bytes_array(_json_utf8(tools)),
        }
        for name, a in arrays.items():
            if not isinstance(name, str) or not isinstance(a, mx.array):
                raise ValueError(f"arrays must be str -> mx.array (bad entry {name!r})")
            tensors[SESSION_PREFIX + name] = mx.contiguous(a)
        now = self._clock()
        header = {
            "format": FORMAT,
            "version": str(VERSION),
            "model_identity": self.model_identity,
            "expert_bits": "" if self.expert_bits is None else str(int(self.expert_bits)),
            "ctx_size": str(self.ctx_size),
            "tokens": str(len(tokens)),
            "text_bytes": str(len(text_b)),
            "hits": "0",
            "created": repr(now),
            "last_used": repr(now),
            "reason": reason,
            "tool_count": str(len(tools)),
            "session_meta": json.dumps(meta, ensure_ascii=False, sort_keys=True),
        }
        if salt:  # unsalted headers stay as they were
            header["salt"] = salt
        try:
            mx.eval(list(tensors.values()))
            header["digest"] = _digest(tensors)
            buf = io.BytesIO()
            mx.save_safetensors(buf, tensors, header)
        except (OSError, RuntimeError) as e:  # MLX reports failures as RuntimeError
            log.warning("kv cache: save failed tokens=%d reason=%s: %s", len(tokens), reason, e)
            return None
        return PreparedSave(
            key=self.key_of(text_b, salt),
            text_bytes=text_b,
            tokens=len(tokens),
            reason=reason,
            created=now,
            tools=tools,
            data=buf.getbuffer(),
            aliases=tuple(a for a in map(_alias, aliases) if a[0] and a[0] != text_b),
            salt=salt,
        )

    def write(self, p: PreparedSave) -> Entry | None:
        """Put a prepared snapshot on disk: room first, temp file, fsync, rename.

        No MLX call: safe on any thread. The store's lock is held to make room and to
        publish the file, not while the bytes go to disk: lookups and loads of the
        inference thread do not wait for a write (a temp name matches no snapshot).

        A write failing with ``ENOSPC`` (the filesystem filled up below the budget)
        evicts the lowest-valued snapshots until the new file fits, and is retried once.

        Returns:
            The new (or identical existing) `Entry`, or None when the snapshot alone
            would exceed the budget or the write failed (logged; the directory is left
            as it was apart from evictions).
        """
        size = len(p.data)
        final = self.dir / f"{p.key}{SUFFIX}"
        with self._write_lock:  # one writer at a time: room made is room used
            with self._lock:
                if size > self.budget_bytes:
                    log.warning(
                        "kv cache: not saving tokens=%d reason=%s: %d bytes exceed the budget %d",
                        p.tokens, p.reason, size, self.budget_bytes,
                    )  # fmt: skip
                    return None
                same = self._existing_same(final, p.key, p.tokens, p.tools)
                if same is not None:
                    log.info(
                        "kv cache: tokens=%d reason=%s already stored as %s",
                        p.tokens, p.reason, p.key,
                    )  # fmt: skip
                    self._add_aliases(same, p.aliases)
                    return same
                # Make room first, so the directory stays within budget even if we are
                # killed between the rename and the eviction pass that follows it.
                self._evict(self.budget_bytes - size, protect=p.key)
            t0 = time.perf_counter()
            tmp = self._write_tmp(p)
            if tmp is None:
                return None
            with self._lock:
                try:
                    os.replace(tmp, final)
                    st_size = final.stat().st_size
                except OSError as e:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    log.warning("kv cache: save failed tokens=%d: %s", p.tokens, e)
                    return None
                entry = Entry(
                    key=p.key,
                    path=final,
                    tokens=p.tokens,
                    text_bytes=len(p.text_bytes),
                    model_identity=self.model_identity,
                    expert_bits=self.expert_bits,
                    ctx_size=self.ctx_size,
                    hits=0,
                    created=p.created,
                    last_used=p.created,
                    reason=p.reason,
                    size=st_size,
                    tool_count=len(p.tools),
                    head=_head(p.text_bytes),
                    salt=p.salt,
                )
                self._failed.pop(p.key, None)
                # After the rename: an alias never names a file that is not there. A lost
                # sidecar only loses the aliases (a shorter disk hit), never correctness.
                self._add_aliases(entry, p.aliases)
                self._evict(self.budget_bytes, protect=p.key)
        # The rename made durable outside the lock: lookups never wait on this fsync.
        fsync_dir(self.dir)
        log.info(
            "kv cache: stored tokens=%d reason=%s key=%s size=%.2f MiB save=%.1f ms",
            p.tokens, p.reason, p.key, size / 2**20, (time.perf_counter() - t0) * 1e3,
        )  # fmt: skip
        return entry

    def _write_tmp(self, p: PreparedSave) -> Path | None:
        """Write ``p``'s bytes to a fresh temp file and fsync them; returns its path, or
        None (logged, no file left) on failure. On ``ENOSPC``: evict, retry once. A
        directory removed while the server runs is made again (once per save): else
        every later save, the shutdown ones included, would fail."""
        for attempt in (1, 2):
            tmp = self.dir / temp_name(p.key)
            try:
                # Durable before the rename publishes the name (ds4mlx.fsutil).
                write_durable(tmp, p.data)
                return tmp
            except FileNotFoundError as e:
                if attempt == 2 or self.dir.exists():
                    log.warning(
                        "kv cache: save failed tokens=%d reason=%s: %s", p.tokens, p.reason, e
                    )
                    return None
                log.warning("kv cache: %s vanished; making it again", self.dir)
                try:
                    private_dir(self.dir, ours=cache_file)
                except OSError as e2:
                    log.warning("kv cache: cannot make %s: %s", self.dir, e2)
                    return None
            except OSError as e:
                # A first full-disk failure is followed by evictions and a retry: said as
                # such (a "save failed" line there read as a loss the retry then undid).
                full = e.errno == errno.ENOSPC and attempt == 1
                log.warning(
                    "kv cache: %s tokens=%d reason=%s: %s",
                    "disk full at a save" if full else "save failed", p.tokens, p.reason, e,
                )  # fmt: skip
                if not full or not self._free_on_full_disk(p):
                    return None
        return None

    def _free_on_full_disk(self, p: PreparedSave) -> bool:
        """Evict the lowest-valued snapshots (never ``p``'s own key) until ``p`` fits: the
        filesystem is full below the budget. True when the save should be retried (room
        was made, or another program freed some meanwhile); False when ``p`` would not
        fit even with every snapshot gone (then none is evicted)."""
        with self._lock:
            total = self.scan().total_bytes
            free, block = self._free_space()
            if block and free + total < p.nbytes:
                log.warning(
                    "kv cache: disk full: a %.2f MiB save does not fit even without the "
                    "%.2f MiB of snapshots; nothing evicted, not saved",
                    p.nbytes / 2**20, total / 2**20,
                )  # fmt: skip
                return False
            # What the save lacks, not its whole size: the failed write left no file, so
            # the free space counts. Slack for the file's last block and metadata. (Asked
            # for ``p``'s whole size, a snapshot a few bytes smaller than ``p`` (its
            # header's timestamps) did not cover it, and a second one went.)
            need = p.nbytes + max(2 * block, p.nbytes // 100) - free
            if need <= 0:
                return True
            gone = self._evict(total - need, protect=p.key)
        freed = sum(g.size for g in gone)
        log.warning(
            "kv cache: disk full: evicted %d snapshots (%.2f MiB) for a %.2f MiB save%s",
            len(gone), freed / 2**20, p.nbytes / 2**20, ", retrying" if gone else "",
        )  # fmt: skip
        return bool(gone)

    def _existing_same(
        self, final: Path, key: str, n_tokens: int, tools: Mapping[str, str]
    ) -> Entry | None:
        """An existing valid compatible file with the same text, token count and a tool
        map holding ``tools``: rewriting it would only cost I/O and reset its hits."""
        try:
            e = read_entry(final)
        except (FileNotFoundError, KVStoreError):
            return None
        if not self._compatible(e) or e.tokens != n_tokens:
            return None
        failed = self._failed.get(key)
        if failed is not None:  # its header reads but its tensors failed to load:
            try:  # replaced by this save unless another process already rewrote it
                st = final.stat()
            except OSError:
                return None
            if failed[0] == _sig(st):
                return None
        if tools:
            try:
                with safe_open(str(final), framework="numpy") as f:
                    stored = json.loads(f.get_tensor(TOOLS_KEY).tobytes().decode("utf-8"))
            except Exception:
                return None
            if any(stored.get(k) != v for k, v in tools.items()):
                return None
        self._refresh_index()
        return _apply_index(e, self._index)

    # ---------------------------------------------------------------- statistics

    def _record_hit(self, e: Entry) -> None:
        self._update_index(e.key, e.created, hits=e.hits, last_used=e.last_used)

    def _add_aliases(self, e: Entry, aliases: Sequence[tuple[bytes, tuple[int, ...]]]) -> None:
        """Record ``aliases`` (``(UTF-8 lookup text, marks)``) of the snapshot ``e`` in the
        sidecar."""
        if not aliases:
            return
        self._refresh_index()
        rec = self._index.get(e.key)
        have = rec["aliases"] if rec is not None and rec["created"] == e.created else []
        new = [[self.key_of(a, e.salt), len(a), list(m)] for a, m in aliases]
        merged = have + [a for a in new if a not in have]
        if merged != have:
            self._update_index(e.key, e.created, aliases=merged)

    def _update_index(self, key: str, created: float, **fields) -> None:
        """Set ``fields`` of ``key``'s sidecar record (a record of an older file of that
        name starts over) and drop the records of files that are gone."""
        self._refresh_index()
        index = dict(self._index)
        rec = index.get(key)
        if rec is None or rec["created"] != created:
            rec = {"created": created, "hits": 0, "last_used": created, "aliases": []}
        index[key] = {**rec, **fields}
        live = {m.group(1) for de in _list_dir(self.dir) if (m := _FILE_RE.match(de.name))}
        index = {k: v for k, v in index.items() if k in live}
        self._write_index(index)

    def _write_index(self, index: Mapping[str, dict]) -> None:
        data = json.dumps({"version": 1, "entries": index}, sort_keys=True).encode()
        try:
            # Not synced: it is written under the store lock, on the hit path too, and
            # a crash that loses it loses only statistics (`read_index` starts over).
            index_tmp = self.dir / temp_name("index")
            atomic_write(self.dir / INDEX_NAME, data, tmp=index_tmp, sync=False)
        except OSError as e:
            log.warning("kv cache: could not write hit index: %s", e)
            return
        self._index = dict(index)
        with contextlib.suppress(FileNotFoundError):
            st = (self.dir / INDEX_NAME).stat()
            self._index_sig = _sig(st)

    # ---------------------------------------------------------------- eviction

    def _unlink(self, path: Path) -> bool:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        self._cache.pop(path.name, None)
        m = _FILE_RE.match(path.name)
        if m is not None and self.on_remove is not None:
            self.on_remove(m.group(1))
        return True

    def _evict(self, target_bytes: int, *, protect: str | None) -> list[Entry | BadFile]:
        """Delete files, lowest score first, until the directory holds ≤ target bytes."""
        scan = self.scan()
        total = scan.total_bytes
        now = self._clock()
        ranked: list[tuple[float, float, Entry | BadFile]] = [
            (-math.inf, 0.0, b) for b in scan.bad
        ] + [(eviction_score(e, now), e.last_used, e) for e in scan.entries if e.key != protect]
        ranked.sort(key=lambda t: (t[0], t[1]))
        gone: list[Entry | BadFile] = []
        for _, _, item in ranked:
            if total <= target_bytes:
                break
            if self._unlink(item.path):
                log.info(
                    "kv cache: evicted %s (%s, %d bytes)",
                    item.path.name,
                    item.reason
                    if isinstance(item, BadFile)
                    else f"tokens={item.tokens} hits={item.hits}",
                    item.size,
                )
                gone.append(item)
            total -= item.size
        return gone

    def evict(self) -> list[Entry | BadFile]:
        """Evict down to the budget now (e.g. after the budget was lowered)."""
        with self._lock:
            return self._evict(self.budget_bytes, protect=None)

    def remove(self, key: str) -> bool:
        """Delete the snapshot ``key`` (full SHA-1 hex). True if a file was removed."""
        with self._lock:
            return self._unlink(self.dir / f"{key}{SUFFIX}")
