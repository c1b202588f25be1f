"""Per-layer KV state in DeepSeek V4's compressed layout.

Each layer keeps (docs/ARCHITECTURE.md §3, docs/ARCHITECTURE.md §2 "Attention and window" / "Compressor"):

* a ring of ``window_size`` raw K=V rows; the row of absolute position ``p`` lives at
  slot ``p % window_size`` (never a full-length raw KV);
* for compressed layers, one compressed row per complete block of ``ratio`` tokens, plus
  the compressor frontier: the projected ``wkv``/``wgate`` (+``ape``) rows of the
  incomplete block, and for the overlapping ratio-4 compressor the first-half features of
  the previous complete block;
* for CSA layers, the same again for the Lightning Indexer's own compressor.

The network (``network.py``) reads and advances these buffers; this module only stores
them. Everything is derivable from ``state`` (a flat ``dict[str, mx.array]``), so a fresh
cache given ``state = old.state`` continues bit-identically.
"""

from __future__ import annotations

import mlx.core as mx

_GROW = 256  # rows; compressed-row buffers grow by max(_GROW, half the capacity)


def put_rows(a: mx.array, rows: mx.array, start: int) -> mx.array:
    """Return ``a`` with ``rows`` written at row ``start`` (functional: never mutates ``a``).

    In-place ``a[i:j] = b`` would also change every other holder of the same Python
    object (e.g. a snapshot dict taken from ``state``), so buffers are always rebound.
    """
    return mx.slice_update(a, rows, mx.array([start]), (0,))


class RowBuffer:
    """Append-only rows ``(n, width)`` with amortized growth (no per-token concatenate)."""

    def __init__(self, width: int):
        self.width = width
        self.n = 0
        self._buf: mx.array | None = None

    @property
    def rows(self) -> mx.array | None:
        """The ``n`` stored rows, or None before the first append."""
        if self._buf is None:
            return None
        return self._buf[: self.n]

    def append(self, new: mx.array) -> None:
        """Append rows of shape ``(k, width)``."""
        k = new.shape[0]
        if k == 0:
            if self._buf is None:
                self._buf = mx.zeros((0, self.width), dtype=new.dtype)
            return
        cap = 0 if self._buf is None else self._buf.shape[0]
        if self.n + k > cap:
            new_cap = max(self.n + k, cap + max(_GROW, cap // 2))
            extra = mx.zeros((new_cap - self.n, self.width), dtype=new.dtype)
            self._buf = extra if self.n == 0 else mx.concatenate([self._buf[: self.n], extra])
        self._buf = put_rows(self._buf, new, self.n)
        self.n += k

    def set(self, rows: mx.array) -> None:
        self._buf = rows
        self.n = rows.shape[0]

    @property
    def allocated_nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.nbytes


class CompressorState:
    """Frontier + output rows of one compressor (main or indexer).

    Attributes:
        rows: compressed rows ``(n_blocks, head_dim)``, already normed and roped.
        pend_kv / pend_score: ``(ratio, coff*head_dim)``; the first ``offset % ratio`` rows
            hold ``wkv(x)`` and ``wgate(x) + ape[slot]`` of the incomplete block.
        prev_kv / prev_score: ``(ratio, head_dim)`` (overlap only): the first-half
            features of the previous complete block; score ``-inf`` before block 0 ends so
            those slots get softmax weight 0.
    """

    def __init__(self, ratio: int, head_dim: int, overlap: bool):
        self.ratio = ratio
        self.head_dim = head_dim
        self.overlap = overlap
        self.rows = RowBuffer(head_dim)
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
            f"{prefix}.rows": rows
            if rows is not None
            else mx.zeros((0, self.head_dim), dtype=dtype),
            f"{prefix}.pend_kv": self.pend_kv,
            f"{prefix}.pend_score": self.pend_score,
        }
        if self.overlap:
            out[f"{prefix}.prev_kv"] = self.prev_kv
            out[f"{prefix}.prev_score"] = self.prev_score
        return out

    def set_state(self, prefix: str, state: dict[str, mx.array]) -> None:
        self.rows.set(state[f"{prefix}.rows"])
        self.pend_kv = state[f"{prefix}.pend_kv"]
        self.pend_score = state[f"{prefix}.pend_score"]
        if self.overlap:
            self.prev_kv = state[f"{prefix}.prev_kv"]
            self.prev_score = state[f"{prefix}.prev_score"]

    @property
    def allocated_nbytes(self) -> int:
        n = self.rows.allocated_nbytes
        for a in (self.pend_kv, self.pend_score, self.prev_kv, self.prev_score):
            if a is not None:
                n += a.nbytes
        return n


class LayerCache:
    """KV state of one DeepSeek V4 layer.

    Attributes:
        offset: number of tokens this layer has consumed (int).
        kind: ``"window"``, ``"csa"`` or ``"hca"``.
        window: ring ``(window_size, head_dim)`` of raw K=V rows (roped), or None before
            the first token.
        comp: main compressor state (compressed layers), else None.
        index: Lightning Indexer compressor state (CSA layers), else None.

    ``state`` keys (all ``mx.array``): ``offset`` (int64 ``(1,)``), ``window``, and for
    compressed layers ``comp.rows``, ``comp.pend_kv``, ``comp.pend_score`` (+
    ``comp.prev_kv``, ``comp.prev_score`` for CSA), and for CSA layers the same five under
    ``index.*``. Arrays are in the compute dtype (float32 on CPU).
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
        self.window: mx.array | None = None
        self.comp = (
            CompressorState(ratio, head_dim, overlap=kind == "csa") if kind != "window" else None
        )
        self.index = CompressorState(ratio, index_head_dim, overlap=True) if kind == "csa" else None
        self._dtype = mx.float32

    # -- ring --------------------------------------------------------------
    def ring_positions(self) -> mx.array:
        """Absolute position held by each ring slot before the next write (-1: empty)."""
        w, p = self.window_size, self.offset
        slots = mx.arange(w)
        pos = p - 1 - mx.remainder(p - 1 - slots, w)
        return mx.where(pos >= 0, pos, -1)

    def write_window(self, kv: mx.array) -> None:
        """Write the rows of positions ``offset … offset+L-1`` into the ring (last W only)."""
        w = self.window_size
        if self.window is None:
            self.window = mx.zeros((w, kv.shape[-1]), dtype=kv.dtype)
            self._dtype = kv.dtype
        n = kv.shape[0]
        if n >= w:
            # The last w rows fill the ring; position q goes to slot q % w.
            tail = kv[n - w :]
            start = (self.offset + n - w) % w
            self.window = mx.roll(tail, start, axis=0) if start else tail
            return
        start = self.offset % w
        first = min(n, w - start)
        self.window = put_rows(self.window, kv[:first], start)
        if first < n:
            self.window = put_rows(self.window, kv[first:], 0)

    # -- state -------------------------------------------------------------
    @property
    def state(self) -> dict[str, mx.array]:
        dt = self._dtype
        out = {
            "offset": mx.array([self.offset], dtype=mx.int64),
            "window": self.window
            if self.window is not None
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
        self.window = state["window"]
        self._dtype = self.window.dtype
        if self.comp is not None:
            self.comp.set_state("comp", state)
        if self.index is not None:
            self.index.set_state("index", state)

    @property
    def nbytes(self) -> int:
        """Bytes held by this layer's KV buffers (allocated capacity included)."""
        n = 0 if self.window is None else self.window.nbytes
        for c in (self.comp, self.index):
            if c is not None:
                n += c.allocated_nbytes
        return n

    @property
    def dtype(self):
        return self._dtype
