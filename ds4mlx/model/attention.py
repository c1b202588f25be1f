"""Hybrid attention of DeepSeek V4: sliding window, compressor, Lightning Indexer.

Semantics: docs/ARCHITECTURE.md §2 ("Attention and window", "Compressor", "Indexer"). Shapes
use ``L`` = tokens in the call, ``H`` = ``n_heads``, ``D`` = ``head_dim``, ``W`` =
``window_size``, ``n`` = compressed rows so far. Batch size 1.

Two paths share the projections, rotations and compressors:

* **decode** (``L == 1``), the hot path, built for few graph nodes (docs/KERNELS.md): the
  new K=V row is written into the ring first, then the query attends to
  ``buffer[:W + n]`` (ring and compressed rows are one buffer, see ``cache.py``) in one
  ``mx.fast.scaled_dot_product_attention`` with a per-step mask, or, on a CSA layer
  with more than ``index_topk`` rows, to the ring plus the gathered top-k rows. Every
  compressed row that exists is visible to the newest token, so no row mask is needed.
* **prefill** (``L > 1``): exact causal attention in query blocks against the ring as
  it was before the call, the new rows and the visible compressed rows.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import rope
from .cache import CompressorState, LayerCache, put_rows
from .config import ModelArgs
from .moe import linear, linear_arrays, linear_spec
from .rope import apply_rope, norm_rope, rope_tables

# Query-block sizes bound the transient score tensors during long prefill chunks.
_Q_BLOCK = 256
_SCORE_BUDGET = 1 << 25  # elements per transient score / gather tensor


@cache
def _cpu_rms_norm(eps: float, weighted: bool):
    """Compiled RMSNorm for the CPU: ``x * rsqrt(mean(x²) + eps) [* w]``.

    On the CPU ``mx.fast.rms_norm`` is not a kernel: it expands into six or seven graph
    nodes (square, sum, scale, add, rsqrt, multiplies). Compiled, the same arithmetic is
    three nodes (square, sum, one fused elementwise).
    """

    def fn(x, w):
        r = mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
        return x * r * w if weighted else x * r

    return mx.compile(fn)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``mx.fast.rms_norm`` where it is one kernel (GPU), a compiled chain on the CPU."""
    if rope.on_gpu():
        return mx.fast.rms_norm(x, weight, eps)
    w = weight if weight is not None else mx.array(1.0, dtype=x.dtype)
    return _cpu_rms_norm(float(eps), weight is not None)(x, w)


class RMSNorm(nn.Module):
    """RMSNorm with a weight: ``x * rsqrt(mean(x²) + eps) * weight``.

    The weight is kept in float32; with a lower-precision input the norm runs in float32
    and casts back once (as DeepSeek's reference does).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dim,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return weighted_rms_norm(x, self.weight, self.eps)


def weighted_rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``RMSNorm`` as a function: in float32 when ``x`` is in a lower precision."""
    if x.dtype == weight.dtype:
        return rms_norm(x, weight, eps)
    return rms_norm(x.astype(mx.float32), weight.astype(mx.float32), eps).astype(x.dtype)


@cache
def _project_fn(specs: tuple, sizes: tuple, heads: int, eps: tuple, gpu: bool):
    """Compiled ``fn(x, q_norm_w, kv_norm_w, cos, sin, *linears) -> (qr, q, kv)``.

    The attention's input projections as one call: ``qr = q_norm(wq_a x)``, ``q`` =
    per-head RMSNorm of ``wq_b qr`` then RoPE ``(L, H, D)``, ``kv`` = ``kv_norm(wkv x)``
    then RoPE ``(L, D)``. ``eps``: of ``q_norm``, the per-head norm and ``kv_norm``.
    ``gpu`` only keys the cache (the norm forms differ by device).
    """
    del gpu
    qn_eps, head_eps, kvn_eps = eps

    def fn(x, qn_w, kvn_w, c, s, *flat):
        a = [list(flat[: sizes[0]]), list(flat[sizes[0] : sizes[0] + sizes[1]])]
        a.append(list(flat[sizes[0] + sizes[1] :]))
        L = x.shape[0]
        qr = weighted_rms_norm(linear(x, a[0], specs[0]), qn_w, qn_eps)
        q = linear(qr, a[1], specs[1]).reshape(L, heads, -1)
        q = norm_rope(q, None, head_eps, c[:, None], s[:, None])
        kv = norm_rope(linear(x, a[2], specs[2]), kvn_w, kvn_eps, c, s)
        return qr, q, kv

    return mx.compile(fn)


class GroupedLinear(nn.Module):
    """Grouped output projection ``wo_a`` (docs/ARCHITECTURE.md §2, "Attention and window").

    ``weight`` is ``(groups * rank, in_per_group)`` as in DeepSeek's checkpoint; group g
    owns rows ``g*rank … (g+1)*rank - 1`` and sees only its contiguous block of heads.
    Input ``(L, groups, in_per_group)`` -> output ``(L, groups, rank)``: one batched matmul.
    """

    def __init__(self, in_per_group: int, out_total: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = mx.zeros((out_total, in_per_group))

    def __call__(self, x: mx.array) -> mx.array:
        w = self.weight.reshape(self.groups, -1, self.weight.shape[-1])  # (G, R, in)
        return (x.swapaxes(0, 1) @ w.swapaxes(1, 2)).swapaxes(0, 1)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
        q = QuantizedGroupedLinear(self.groups, group_size, bits, mode)
        packed = mx.quantize(self.weight, group_size=group_size, bits=bits, mode=mode)
        q.weight, q.scales = packed[0], packed[1]
        if len(packed) > 2 and packed[2] is not None:
            q.biases = packed[2]
        return q


class QuantizedGroupedLinear(nn.Module):
    """MLX-quantized ``GroupedLinear`` (``weight/scales[/biases]`` rows as in the float one).

    All groups run as one ``mx.gather_qmm`` (group g's input against group g's rows), not
    one quantized matmul per group plus a stack.
    """

    def __init__(self, groups: int, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.groups, self.group_size, self.bits, self.mode = groups, group_size, bits, mode
        self.weight = mx.zeros((0,), dtype=mx.uint32)
        self.scales = mx.zeros((0,))

    def __call__(self, x: mx.array) -> mx.array:
        G = self.groups

        def per_group(a):
            return None if a is None else a.reshape(G, -1, a.shape[-1])

        out = mx.gather_qmm(
            x.swapaxes(0, 1),  # (G, L, in)
            per_group(self.weight),
            per_group(self.scales),
            per_group(self.get("biases")),
            rhs_indices=mx.array(np.arange(G, dtype=np.uint32)),
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        return out.swapaxes(0, 1)  # (L, G, rank)


# ----------------------------------------------------------------------------- compressor
class Compressor(nn.Module):
    """Gated pooling of ``ratio`` tokens into one KV row (docs/ARCHITECTURE.md §2, "Compressor").

    Parameters: ``wkv``, ``wgate`` (``dim -> coff*head_dim``), ``ape`` ``(ratio,
    coff*head_dim)``, ``norm`` (``head_dim``); ``coff`` = 2 with overlap (ratio-4 CSA and
    the indexer), else 1.
    """

    def __init__(self, args: ModelArgs, ratio: int, head_dim: int, overlap: bool):
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        coff = 2 if overlap else 1
        self.wkv = nn.Linear(args.dim, coff * head_dim, bias=False)
        self.wgate = nn.Linear(args.dim, coff * head_dim, bias=False)
        self.ape = mx.zeros((ratio, coff * head_dim))
        self.norm = RMSNorm(head_dim, args.norm_eps)

    def __call__(self, x: mx.array, st: CompressorState, p0: int, ctx) -> None:
        """Consume tokens at positions ``p0 … p0+L-1``; append every completed row to ``st``.

        Row k pools tokens ``k*r … k*r+r-1`` (plus, with overlap, the previous block's
        first-half features) and is roped at position ``k*r`` on its last rope channels.
        """
        r = self.ratio
        L = x.shape[0]
        st.ensure(x.dtype)
        kv = self.wkv(x)
        if L == 1:
            # Decode: write the token's slot of the pending block; pool when it completes.
            slot = p0 % r
            score = self.wgate(x) + self.ape[slot : slot + 1]
            st.pend_kv = put_rows(st.pend_kv, kv, slot)
            st.pend_score = put_rows(st.pend_score, score, slot)
            if slot == r - 1:
                self._pool(st.pend_kv[None], st.pend_score[None], st, p0 // r, ctx)
            return
        score = self.wgate(x) + self.ape[mx.array(ctx.positions_np % r)]
        self._chunk(kv, score, st, p0, ctx)

    def _chunk(self, kv: mx.array, score: mx.array, st: CompressorState, p0: int, ctx) -> None:
        r = self.ratio
        npend = p0 % r
        if npend:
            kv = mx.concatenate([st.pend_kv[:npend], kv])
            score = mx.concatenate([st.pend_score[:npend], score])
        total = kv.shape[0]
        nb = total // r
        if nb:
            bk = kv[: nb * r].reshape(nb, r, -1)
            bs = score[: nb * r].reshape(nb, r, -1)
            self._pool(bk, bs, st, p0 // r, ctx)
        rem = total - nb * r
        if rem:
            # The incomplete block's rows go to the front of the pending buffers.
            st.pend_kv = put_rows(st.pend_kv, kv[nb * r :], 0)
            st.pend_score = put_rows(st.pend_score, score[nb * r :], 0)

    def _pool(self, bk: mx.array, bs: mx.array, st: CompressorState, first: int, ctx) -> None:
        """Pool ``nb`` complete blocks ``bk``/``bs`` ``(nb, r, coff*d)`` into rows of ``st``."""
        d = self.head_dim
        nb = bk.shape[0]
        if self.overlap:
            # Slots 0..r-1: previous block's first-half features; r..2r-1: this block's
            # second half. Before block 0 the carried score is -inf (weight 0).
            prev_k, prev_s = st.prev_kv[None], st.prev_score[None]
            if nb > 1:
                prev_k = mx.concatenate([prev_k, bk[:-1, :, :d]])
                prev_s = mx.concatenate([prev_s, bs[:-1, :, :d]])
            st.prev_kv, st.prev_score = bk[-1, :, :d], bs[-1, :, :d]
            bk = mx.concatenate([prev_k, bk[:, :, d:]], axis=1)
            bs = mx.concatenate([prev_s, bs[:, :, d:]], axis=1)
        rows = (bk * mx.softmax(bs, axis=1, precise=True)).sum(axis=1)
        rows = self.norm(rows)
        c, s, _ = rope_tables(ctx.inv_comp, (first + np.arange(nb)) * self.ratio, d)
        # Pooling runs in float32 (score + ape); rows are stored in the compute dtype.
        st.rows.append(apply_rope(rows, c, s).astype(ctx.dtype))


@cache
def _neg_index_scores(scale: float):
    """Compiled ``fn(s, w) -> -Σ_h ReLU(s_h) · w_h · scale`` ``(B, N)``.

    ``s`` ``(B, Hi, N)`` are the ``q_h·k`` products, ``w`` ``(B, Hi)`` the raw weights.
    Negated so that ``argpartition`` picks the top scores directly; negating the weight is
    exact, so this is ``-score`` bit for bit.
    """

    def fn(s, w):
        return (mx.maximum(s, 0) * (w * -scale)[:, :, None]).sum(axis=1)

    return mx.compile(fn)


class Indexer(nn.Module):
    """Lightning Indexer of a CSA layer (docs/ARCHITECTURE.md §2, "Indexer (ratio-4 layers)").

    Parameters: ``wq_b`` (``q_lora_rank -> index_n_heads*index_head_dim``),
    ``weights_proj`` (``dim -> index_n_heads``), ``compressor`` (overlapping, at
    ``index_head_dim``).
    """

    def __init__(self, args: ModelArgs, ratio: int):
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.topk, self.ratio = args.index_topk, ratio
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.dim, self.n_heads, bias=False)
        self.compressor = Compressor(args, ratio, self.head_dim, overlap=True)

    def __call__(self, x, qr, st: CompressorState, p0: int, ctx) -> mx.array | None:
        """Top-k compressed-row indices ``(L, index_topk)`` int (unordered), or None.

        None means every visible row is selected (fewer rows than ``index_topk``), so
        the caller attends to all visible rows densely. In prefill, returned indices may
        point at rows not yet visible to a query; the caller masks those.
        """
        self.compressor(x, st, p0, ctx)
        n = st.rows.n
        if n <= self.topk:
            return None
        keys = st.rows.rows  # (N, Di)
        L = x.shape[0]
        c, s, _ = ctx.rope("compress", self.head_dim)
        q = apply_rope(
            self.wq_b(qr).reshape(L, self.n_heads, self.head_dim), c[:, None], s[:, None]
        )
        # Signed weights (no sigmoid / softmax): w = weights_proj(x) · Di^-0.5 · Hi^-0.5.
        w = self.weights_proj(x)
        scale = self.head_dim**-0.5 * self.n_heads**-0.5
        k = self.topk
        if L == 1:
            # Every existing row is complete, hence visible to the newest token.
            neg = _neg_index_scores(scale)(q @ keys.T, w)
            return mx.argpartition(neg, k - 1, axis=-1)[:, :k]
        visible = (ctx.positions + 1) // self.ratio
        block = max(1, min(L, _SCORE_BUDGET // (self.n_heads * n)))
        cols = mx.arange(n)
        out = []
        for b0 in range(0, L, block):
            b1 = min(L, b0 + block)
            neg = _neg_index_scores(scale)(q[b0:b1] @ keys.T, w[b0:b1])
            neg = mx.where(cols[None, :] < visible[b0:b1, None], neg, mx.inf)
            out.append(mx.argpartition(neg, k - 1, axis=-1)[:, :k])
        return out[0] if len(out) == 1 else mx.concatenate(out)


# ----------------------------------------------------------------------------- per step
class Step:
    """What every layer of one forward call shares, built once per call on the host.

    Positions, RoPE tables and masks depend only on the cache offset (the same in every
    layer), so they are numpy-built graph leaves here instead of per-layer ``arange`` /
    comparison nodes.

    Attributes:
        p0, L: first position and token count of the call.
        positions_np: int64 ``(L,)``; ``positions``: the same as an int32 ``mx.array``.
        inv_main, inv_comp: float32 numpy inverse frequencies (window-only layers:
            ``rope_theta``; compressed layers: ``compress_rope_theta`` with YaRN).
        dtype: the compute dtype.
    """

    def __init__(self, p0: int, L: int, window: int, inv_main, inv_comp, dtype):
        self.p0, self.L, self.window = p0, L, window
        self.positions_np = np.arange(p0, p0 + L, dtype=np.int64)
        self.positions = mx.array(self.positions_np.astype(np.int32))
        self.inv_main, self.inv_comp, self.dtype = inv_main, inv_comp, dtype
        self._tables: dict = {}
        self._masks: dict = {}

    def rope(self, kind: str, dim: int) -> tuple[mx.array, mx.array, mx.array]:
        """``(C, S, -S)`` ``(L, dim/2, 2)`` at this call's positions; ``kind`` is
        ``"main"`` or ``"compress"``."""
        key = (kind, dim)
        if key not in self._tables:
            inv = self.inv_main if kind == "main" else self.inv_comp
            self._tables[key] = rope_tables(inv, self.positions_np, dim)
        return self._tables[key]

    def ring_positions(self) -> mx.array:
        """Absolute position held by each ring slot before this call's writes (-1: empty)."""
        if "ring" not in self._masks:
            w, p = self.window, self.p0
            pos = p - 1 - np.mod(p - 1 - np.arange(w), w)
            self._masks["ring"] = mx.array(np.where(pos >= 0, pos, -1).astype(np.int32))
        return self._masks["ring"]

    def decode_mask(self, extra: int) -> mx.array | None:
        """Decode (``L == 1``) key mask ``(1, 1, 1, W + extra)`` bool over ring slots (after
        this token's write) then ``extra`` always-visible compressed rows; None when every
        key is visible."""
        if extra not in self._masks:
            w, p = self.window, self.p0
            ring_ok = p - np.mod(p - np.arange(w), w) >= 0  # slot holds a real position
            if ring_ok.all():
                self._masks[extra] = None
            else:
                ok = np.concatenate([ring_ok, np.ones(extra, dtype=bool)])
                self._masks[extra] = mx.array(ok[None, None, None, :])
        return self._masks[extra]


# ----------------------------------------------------------------------------- attention
class Attention(nn.Module):
    """Hybrid attention of one layer (docs/ARCHITECTURE.md §2, "Attention and window").

    Shared K=V MQA over a sliding window of ``window_size`` raw rows (including the current
    token) plus, on compressed layers, the compressed rows (HCA: all visible; CSA: the
    indexer's top-k), with a per-head sink logit in the softmax denominator.
    """

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.kind = args.layer_kind(layer_id)
        self.ratio = args.compress_ratios[layer_id]
        self.n_heads, self.head_dim, self.rope_dim = args.n_heads, args.head_dim, args.rope_head_dim
        self.window, self.eps, self.groups = args.window_size, args.norm_eps, args.o_groups
        self.attn_sink = mx.zeros((args.n_heads,))
        self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * args.head_dim, bias=False)
        self.wkv = nn.Linear(args.dim, args.head_dim, bias=False)
        self.kv_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.wo_a = GroupedLinear(
            args.n_heads * args.head_dim // args.o_groups,
            args.o_groups * args.o_lora_rank,
            args.o_groups,
        )
        self.wo_b = nn.Linear(args.o_groups * args.o_lora_rank, args.dim, bias=False)
        if self.kind != "window":
            self.compressor = Compressor(
                args, self.ratio, args.head_dim, overlap=self.kind == "csa"
            )
        if self.kind == "csa":
            self.indexer = Indexer(args, self.ratio)

    def __call__(self, x: mx.array, c: LayerCache, ctx: Step) -> mx.array:
        """``x`` ``(L, dim)`` (already ``attn_norm``-ed) -> ``(L, dim)``; advances ``c``."""
        L = x.shape[0]
        D = self.head_dim
        p0 = c.offset
        # Window-only layers: rope_theta, no YaRN; compressed layers: compress_rope_theta
        # with YaRN for every rotation in the layer.
        cos, sin, nsin = ctx.rope("main" if self.kind == "window" else "compress", D)

        qr, q, kv = self._project(x, cos, sin)

        sel = None
        if self.kind != "window":
            self.compressor(x, c.comp, p0, ctx)
            if self.kind == "csa":
                sel = self.indexer(x, qr, c.index, p0, ctx)
        if L == 1:
            c.write_window(kv)  # the window includes the current token: write, then read
            o = self._decode(q, c, sel, ctx)
        else:
            # Ring as it was before this call (slots hold older positions or -1).
            ring = c.window if p0 > 0 else None
            comp = c.kv.rows if self.kind != "window" else None
            c.write_window(kv)
            o = self._prefill(q, kv, ring, comp, sel, ctx)
        c.offset = p0 + L
        o = apply_rope(o, cos[:, None], nsin[:, None])  # de-rotate the rope channels
        o = self.wo_a(o.reshape(L, self.groups, -1)).reshape(L, -1)
        return self.wo_b(o)

    def _project(self, x: mx.array, cos: mx.array, sin: mx.array):
        """``(qr, q (L, H, D), kv (L, D))``: ``qr = q_norm(wq_a x)``; ``q`` = per-head RMSNorm
        (no weight) of ``wq_b qr``, roped; ``kv = kv_norm(wkv x)`` roped (one shared K=V
        head). One compiled call; norm and RoPE fused on the CPU (``rope.norm_rope``)."""
        lin = (self["wq_a"], self["wq_b"], self["wkv"])
        key = (*map(id, lin), rope.on_gpu())
        plan = self.__dict__.get("_proj")
        if plan is None or plan[0] != key:
            # Static once loaded (quantization swaps the modules, hence the key).
            specs = tuple(linear_spec(m) for m in lin)
            fn = None
            if all(sp is not None for sp in specs):
                sizes = tuple(len(linear_arrays(m)) for m in lin)
                eps = (self.q_norm.eps, self.eps, self.kv_norm.eps)
                fn = _project_fn(specs, sizes, self.n_heads, eps, key[-1])
            plan = (key, fn)
            object.__setattr__(self, "_proj", plan)
        if plan[1] is not None:
            flat = [a for m in lin for a in linear_arrays(m)]
            return plan[1](x, self.q_norm.weight, self.kv_norm.weight, cos, sin, *flat)
        L, H, D = x.shape[0], self.n_heads, self.head_dim
        qr = self.q_norm(self.wq_a(x))
        q = norm_rope(self.wq_b(qr).reshape(L, H, D), None, self.eps, cos[:, None], sin[:, None])
        kv = norm_rope(self.wkv(x), self.kv_norm.weight, self.kv_norm.eps, cos, sin)
        return qr, q, kv

    def _sdpa(self, q: mx.array, keys: mx.array, mask: mx.array | None) -> mx.array:
        """MQA with sinks: ``q`` ``(L, H, D)``, ``keys`` = values ``(N, D)`` -> ``(L, H, D)``."""
        o = mx.fast.scaled_dot_product_attention(
            q.swapaxes(0, 1)[None],
            keys[None, None],
            keys[None, None],
            scale=self.head_dim**-0.5,
            mask=mask,
            sinks=self.attn_sink.astype(q.dtype),
        )
        return o[0].swapaxes(0, 1)

    def _decode(self, q: mx.array, c: LayerCache, sel: mx.array | None, ctx: Step) -> mx.array:
        """One token: ring (this token included) + compressed rows, all in one SDPA."""
        if sel is None:
            return self._sdpa(q, c.kv.used, ctx.decode_mask(c.kv.n))
        # CSA with more rows than top-k: the ring plus the indexer's rows.
        keys = mx.concatenate([c.window, c.kv.rows[sel[0]]])
        return self._sdpa(q, keys, ctx.decode_mask(sel.shape[1]))

    def _prefill(self, q, kv, ring, comp, sel, ctx: Step) -> mx.array:
        """Causal softmax attention with sink, in query blocks. Returns ``(L, H, D)``."""
        L, H, D = q.shape
        W = self.window
        qpos = ctx.positions
        ring_pos = ctx.ring_positions() if ring is not None else None
        n_comp = 0 if comp is None else comp.shape[0]
        block = _Q_BLOCK
        if sel is not None:
            block = max(1, min(block, _SCORE_BUDGET // (sel.shape[1] * D)))
        elif n_comp:
            block = max(1, min(block, _SCORE_BUDGET // (H * n_comp)))
        outs = []
        for s in range(0, L, block):
            e = min(L, s + block)
            qp = qpos[s:e]
            lo = max(0, s - W + 1)
            keys, kpos = kv[lo:e], qpos[lo:e]
            if ring is not None and s < W - 1:
                keys = mx.concatenate([ring, keys])
                kpos = mx.concatenate([ring_pos, kpos])
            vis = (
                (kpos[None, :] <= qp[:, None])
                & (kpos[None, :] > qp[:, None] - W)
                & (kpos[None, :] >= 0)
            )
            visible = (qp + 1) // self.ratio if self.ratio else None
            if sel is None:
                # Window + every visible compressed row: one masked MQA with sinks.
                if n_comp:
                    keys = mx.concatenate([keys, comp])
                    ok = mx.arange(n_comp)[None, :] < visible[:, None]
                    vis = mx.concatenate([vis, ok], axis=1)
                outs.append(self._sdpa(q[s:e], keys, vis[None, None]))
            else:
                outs.append(self._gathered(q[s:e], keys, vis, comp, sel[s:e], visible))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)

    def _gathered(self, qb, keys, vis, comp, idx, visible) -> mx.array:
        """Prefill block on a CSA layer with more rows than top-k: each query attends to
        its window keys and its own gathered rows ``comp[idx]``."""
        B, H, D = qb.shape
        scale = D**-0.5
        sink = self.attn_sink.astype(mx.float32)[None, :, None]  # (1, H, 1)
        s_win = (qb.reshape(B * H, D) @ keys.T).reshape(B, H, -1) * scale
        ksel = comp[idx]  # (B, k, D)
        s_c = (qb @ ksel.swapaxes(1, 2)) * scale  # (B, H, k)
        ok = idx < visible[:, None]
        scores = mx.concatenate(
            [mx.where(vis[:, None, :], s_win, -mx.inf), mx.where(ok[:, None, :], s_c, -mx.inf)],
            axis=-1,
        )
        # The sink logit joins only the denominator.
        m = mx.maximum(scores.max(axis=-1, keepdims=True), sink)
        ex = mx.exp(scores - m)
        p = ex / (ex.sum(axis=-1, keepdims=True) + mx.exp(sink - m))
        nw = keys.shape[0]
        ob = (p[..., :nw].reshape(B * H, nw) @ keys).reshape(B, H, D)
        return ob + p[..., nw:] @ ksel
