"""Per-layer KV state in DeepSeek V4's compressed layout, in preallocated buffers.

Each layer keeps (docs/ARCHITECTURE.md §2 "Attention and window" / "Compressor"):

* a ring of ``window_size`` raw K=V rows; the row of absolute position ``p`` lives at
  slot ``p % window_size`` (never a full-length raw KV);
* for compressed layers, one compressed row per complete block of ``ratio`` tokens, plus
  the compressor frontier: the projected ``wkv``/``wgate`` (+``ape``) rows of the
  incomplete block, and for the overlapping ratio-4 compressor the first-half features of
  the previous complete block;
* for CSA layers, the same again for the Lightning Indexer's own compressor.

Layout for speed (docs/KERNELS.md): the ring and the compressed rows of a layer share one
buffer ``(window_size + capacity, head_dim)`` — ring in rows ``[0, W)``, compressed rows
from ``W`` on — so a decode step attends to ``buffer[:W + n]`` (a view) instead of
concatenating window and compressed keys, and every write is a ``slice_update`` into
preallocated rows (capacity grows by ``max(_GROW, capacity / 8)`` rows: at most 12.5 %
spare, which matters at long context — Flash's CSA rows are 256 MB per layer at 1M
tokens — while a 1M-token context still regrows only a few dozen times). Writes are
functional (the buffer is rebound, never mutated in place), so arrays handed out by
``state`` or captured by ``capture()`` never change afterwards.

The network (``network.py``) reads and advances these buffers; this module only stores
them. Everything is derivable from ``state`` (a flat ``dict[str, mx.array]``), so a fresh
cache given ``state = old.state`` continues bit-identically.
"""

from __future__ import annotations

import mlx.core as mx

_GROW = 256  # rows; compressed-row buffers grow by max(_GROW, an eighth of the capacity)


def put_rows(a: mx.array, rows: mx.array, start: int) -> mx.array:
    """Return ``a`` with ``rows`` written at row ``start`` (functional: never mutates ``a``).

    In-place ``a[i:j] = b`` would also change every other holder of the same Python
    object (e.g. a snapshot dict taken from ``state``), so buffers are always rebound.
    MLX still updates in place when nothing else holds the old buffer (donation).
    """
    return mx.slice_update(a, rows, mx.array([start]), (0,))


class RowBuffer:
    """Rows ``(lead + n, width)``: ``lead`` fixed rows (a ring), then ``n`` appended rows.

    The buffer is allocated on the first write; appends grow its capacity geometrically
    (no per-token concatenate). ``lead`` is 0 for a plain append-only buffer.
    """

    def __init__(self, width: int, lead: int = 0):
        self.width = width
        self.lead = lead
        self.n = 0
        self.buf: mx.array | None = None

    def _ensure(self, dtype) -> None:
        if self.buf is None:
            self.buf = mx.zeros((self.lead, self.width), dtype=dtype)

    @property
    def head(self) -> mx.array | None:
        """The ``lead`` ring rows ``(lead, width)``, or None before the first write."""
        return None if self.buf is None else self.buf[: self.lead]

    @property
    def rows(self) -> mx.array | None:
        """The ``n`` appended rows ``(n, width)`` (possibly 0), or None before any write."""
        return None if self.buf is None else self.buf[self.lead : self.lead + self.n]

    @property
    def used(self) -> mx.array | None:
        """Ring plus appended rows ``(lead + n, width)`` (a view), or None."""
        return None if self.buf is None else self.buf[: self.lead + self.n]

    def put(self, rows: mx.array, start: int) -> None:
        """Write ``rows`` at absolute row ``start`` (inside the ring or the used rows)."""
        self._ensure(rows.dtype)
        self.buf = put_rows(self.buf, rows, start)

    def append(self, new: mx.array) -> None:
        """Append rows ``(k, width)``."""
        self._ensure(new.dtype)
        k = new.shape[0]
        if k == 0:
            return
        end = self.lead + self.n
        if end + k > self.buf.shape[0]:
            cap = self.buf.shape[0] - self.lead
            extra = max(self.n + k, cap + max(_GROW, cap // 8)) - self.n
            pad = mx.zeros((extra, self.width), dtype=self.buf.dtype)
            self.buf = mx.concatenate([self.buf[:end], pad])
        self.buf = put_rows(self.buf, new, end)
        self.n += k

    def set(self, head: mx.array | None, rows: mx.array | None) -> None:
        """Replace the contents: ring rows ``head`` (``(lead, width)``) and appended ``rows``."""
        parts = [a for a in (head, rows) if a is not None]
        self.buf = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        self.n = 0 if rows is None else rows.shape[0]

    def capture(self) -> tuple:
        return (self.buf, self.n)

    def rewind(self, saved: tuple) -> None:
        self.buf, self.n = saved

    @property
    def allocated_nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.nbytes

    @property
    def used_nbytes(self) -> int:
        if self.buf is None:
            return 0
        return (self.lead + self.n) * self.width * self.buf.itemsize


class CompressorState:
    """Frontier + output rows of one compressor (main or indexer).

    Attributes:
        rows: ``RowBuffer`` of compressed rows ``(n_blocks, head_dim)``, already normed and
            roped. The main compressor's rows live in the layer's shared K=V buffer (after
            the ring); the indexer owns its buffer.
        pend_kv / pend_score: ``(ratio, coff*head_dim)``; the first ``offset % ratio`` rows
            hold ``wkv(x)`` and ``wgate(x) + ape[slot]`` of the incomplete block (later
            rows are stale).
        prev_kv / prev_score: ``(ratio, head_dim)`` (overlap only): the first-half
            features of the previous complete block; score ``-inf`` before block 0 ends so
            those slots get softmax weight 0.
    """

    _FRONTIER = ("pend_kv", "pend_score", "prev_kv", "prev_score")

    def __init__(self, ratio: int, head_dim: int, overlap: bool, rows: RowBuffer | None = None):
        self.ratio = ratio
        self.head_dim = head_dim
        self.overlap = overlap
        self.owns_rows = rows is None
        self.rows = RowBuffer(head_dim) if rows is None else rows
        self.pend_kv: mx.array | None = None
        self.pend_score: mx.array | None = None
        self.prev_kv: mx.array | None = None
        self.prev_score: mx.array | None = None

    def ensure(self, dtype) -> None:
        if self.pend_kv is not None:
            return
        coff = 2 if self.overlap else 1
        self.pend_kv = mx.zeros((self.ratio, coff * self.head_dim), dtype=dtype)
        self.pend_score = mx.zeros((self.ratio, coff * self.head_dim), dtype=dtype)
        if self.overlap:
            self.prev_kv = mx.zeros((self.ratio, self.head_dim), dtype=dtype)
            self.prev_score = mx.full((self.ratio, self.head_dim), -mx.inf, dtype=dtype)

    def get_state(self, prefix: str, dtype) -> dict[str, mx.array]:
        self.ensure(dtype)
        rows = self.rows.rows
        out = {
            f"{prefix}.rows": rows if rows is not None else mx.zeros((0, self.head_dim), dtype),
            f"{prefix}.pend_kv": self.pend_kv,
            f"{prefix}.pend_score": self.pend_score,
        }
        if self.overlap:
            out[f"{prefix}.prev_kv"] = self.prev_kv
            out[f"{prefix}.prev_score"] = self.prev_score
        return out

    def set_state(self, prefix: str, state: dict[str, mx.array]) -> None:
        if self.owns_rows:
            self.rows.set(None, state[f"{prefix}.rows"])
        self.pend_kv = state[f"{prefix}.pend_kv"]
        self.pend_score = state[f"{prefix}.pend_score"]
        if self.overlap:
            self.prev_kv = state[f"{prefix}.prev_kv"]
            self.prev_score = state[f"{prefix}.prev_score"]

    def capture(self) -> tuple:
        rows = self.rows.capture() if self.owns_rows else None
        return (rows, *(getattr(self, k) for k in self._FRONTIER))

    def rewind(self, saved: tuple) -> None:
        if self.owns_rows:
            self.rows.rewind(saved[0])
        for k, v in zip(self._FRONTIER, saved[1:], strict=True):
            setattr(self, k, v)

    def frontier_nbytes(self) -> int:
        return sum(a.nbytes for a in (getattr(self, k) for k in self._FRONTIER) if a is not None)


class LayerCache:
    """KV state of one DeepSeek V4 layer.

    Attributes:
        offset: number of tokens this layer has consumed (int).
        kind: ``"window"``, ``"csa"`` or ``"hca"``.
        kv: ``RowBuffer`` with the ring ``(window_size, head_dim)`` of raw K=V rows (roped)
            in its lead rows and, on compressed layers, the compressed rows after it.
        comp: main compressor state (compressed layers; its rows are ``kv``'s), else None.
        index: Lightning Indexer compressor state (CSA layers), else None.

    ``state`` keys (all ``mx.array``): ``offset`` (int64 ``(1,)``), ``window``
    ``(window_size, head_dim)``, and for compressed layers ``comp.rows`` ``(n, head_dim)``,
    ``comp.pend_kv``, ``comp.pend_score`` (+ ``comp.prev_kv``, ``comp.prev_score`` for
    CSA), and for CSA layers the same five under ``index.*``. Arrays are in the compute
    dtype (float32 on CPU). ``window`` and ``comp.rows`` are views of the shared buffer.
    """

    def __init__(
        self,
        kind: str,
        window_size: int,
        head_dim: int,
        ratio: int = 0,
        index_head_dim: int = 0,
    ):
        self.kind = kind
        self.window_size = window_size
        self.head_dim = head_dim
        self.ratio = ratio
        self.offset = 0
        self.kv = RowBuffer(head_dim, lead=window_size)
        self.comp = (
            CompressorState(ratio, head_dim, overlap=kind == "csa", rows=self.kv)
            if kind != "window"
            else None
        )
        self.index = CompressorState(ratio, index_head_dim, overlap=True) if kind == "csa" else None
        self._dtype = mx.float32

    # -- ring --------------------------------------------------------------
    @property
    def window(self) -> mx.array | None:
        """The ring ``(window_size, head_dim)``, or None before the first token."""
        return self.kv.head

    def write_window(self, kv: mx.array) -> None:
        """Write the rows of positions ``offset … offset+L-1`` into the ring (last W only)."""
        w = self.window_size
        if self.kv.buf is None:
            self._dtype = kv.dtype
        n = kv.shape[0]
        if n >= w:
            # The last w rows fill the ring; position q goes to slot q % w.
            tail = kv[n - w :]
            start = (self.offset + n - w) % w
            self.kv.put(mx.roll(tail, start, axis=0) if start else tail, 0)
            return
        start = self.offset % w
        first = min(n, w - start)
        self.kv.put(kv[:first], start)
        if first < n:
            self.kv.put(kv[first:], 0)

    # -- state -------------------------------------------------------------
    @property
    def state(self) -> dict[str, mx.array]:
        dt = self._dtype
        window = self.kv.head
        out = {
            "offset": mx.array([self.offset], dtype=mx.int64),
            "window": window
            if window is not None
            else mx.zeros((self.window_size, self.head_dim), dt),
        }
        if self.comp is not None:
            out.update(self.comp.get_state("comp", dt))
        if self.index is not None:
            out.update(self.index.get_state("index", dt))
        return out

    @state.setter
    def state(self, state: dict[str, mx.array]) -> None:
        self.offset = int(state["offset"].reshape(-1)[0].item())
        window = state["window"]
        if tuple(window.shape) != (self.window_size, self.head_dim):
            raise ValueError(f"window of shape {window.shape} for a {self.window_size}-row ring")
        self._dtype = window.dtype
        self.kv.set(window, state["comp.rows"] if self.comp is not None else None)
        if self.comp is not None:
            self.comp.set_state("comp", state)
        if self.index is not None:
            self.index.set_state("index", state)

    def arrays(self) -> list[mx.array]:
        """Every array this cache holds (whole buffers, no views): what to ``mx.eval``
        after a step so no write stays pending. Cheaper than ``state.values()``."""
        out = [] if self.kv.buf is None else [self.kv.buf]
        for c in (self.comp, self.index):
            if c is not None:
                out += [a for a in (getattr(c, k) for k in c._FRONTIER) if a is not None]
        if self.index is not None and self.index.rows.buf is not None:
            out.append(self.index.rows.buf)
        return out

    def capture(self) -> tuple:
        """The Python-side state (array references, counters), for ``rewind``.

        Building a forward only rebinds these attributes (writes are functional), so a
        captured tuple puts the cache back exactly as long as nothing was evaluated with
        buffer donation in between.
        """
        return (
            self.offset,
            self._dtype,
            self.kv.capture(),
            None if self.comp is None else self.comp.capture(),
            None if self.index is None else self.index.capture(),
        )

    def rewind(self, saved: tuple) -> None:
        """Put back what ``capture()`` returned."""
        self.offset, self._dtype, kv, comp, index = saved
        self.kv.rewind(kv)
        if self.comp is not None:
            self.comp.rewind(comp)
        if self.index is not None:
            self.index.rewind(index)

    @property
    def nbytes(self) -> int:
        """Bytes allocated by this layer's KV buffers (spare preallocated rows included)."""
        n = self.kv.allocated_nbytes
        for c in (self.comp, self.index):
            if c is not None:
                n += c.frontier_nbytes()
        if self.index is not None:
            n += self.index.rows.allocated_nbytes
        return n

    @property
    def used_nbytes(self) -> int:
        """Bytes of KV state in use (``nbytes`` without the spare preallocated rows)."""
        n = self.kv.used_nbytes
        for c in (self.comp, self.index):
            if c is not None:
                n += c.frontier_nbytes()
        if self.index is not None:
            n += self.index.rows.used_nbytes
        return n

    @property
    def dtype(self):
        return self._dtype
