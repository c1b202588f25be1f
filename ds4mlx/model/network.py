"""DeepSeek V4 network in MLX.

Semantics follow docs/ARCHITECTURE.md §2 (checked against DeepSeek's official
``inference/model.py``); the section names in the comments below refer to that file.
Parameter names follow DeepSeek's official checkpoint naming (docs/ARCHITECTURE.md §2, layout b),
except that routed experts are stacked per layer (``ffn.experts.w1.weight`` has shape
``(n_routed_experts, moe_inter_dim, dim)``) so ``mx.gather_mm`` / ``mx.gather_qmm`` can run
them; ``loading.py`` stacks per-expert checkpoints.

Shapes below use ``L`` = tokens in the call, ``H`` = ``n_heads``, ``D`` = ``head_dim``,
``hc`` = ``hc_mult``. The batch size is 1 (one live session); compute is float32 on the CPU.
"""

from __future__ import annotations

import math
from functools import cache
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchLinear

from .cache import CompressorState, LayerCache
from .config import ModelArgs

# Query-block sizes bound the transient score tensors during long prefill chunks.
_Q_BLOCK = 256
_SCORE_BUDGET = 1 << 25  # elements per transient score / gather tensor


# ----------------------------------------------------------------------------- rope
def rope_inv_freq(
    dim: int,
    base: float,
    factor: float = 1.0,
    original_seq_len: int = 0,
    beta_fast: float = 32,
    beta_slow: float = 1,
) -> mx.array:
    """Inverse frequencies ``(dim // 2,)`` float32 for interleaved RoPE on ``dim`` channels.

    With ``original_seq_len > 0`` applies YaRN's frequency ramp only (no mscale), as
    DeepSeek's ``precompute_freqs_cis``: frequencies below the ``beta`` correction range
    are divided by ``factor``, those above are kept, with a linear ramp in between.
    """
    idx = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(base), idx).astype(np.float32)
    inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if original_seq_len > 0:

        def corr_dim(rot):
            return dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(
            np.float32
        )
        keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (unchanged), 0: interpolate
        interp = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
        inv = (interp * (1 - keep) + inv * keep).astype(np.float32)
    return mx.array(inv)


def rope_cos_sin(inv_freq: mx.array, positions: mx.array) -> tuple[mx.array, mx.array]:
    """``cos, sin`` of shape ``(len(positions), dim // 2)`` float32."""
    ang = positions.astype(mx.float32)[:, None] * inv_freq[None, :]
    return mx.cos(ang), mx.sin(ang)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate the last ``2 * cos.shape[-1]`` channels of ``x`` as interleaved pairs.

    Layout is ``[nope | rope]`` per head and pairs are (2i, 2i+1) (docs/ARCHITECTURE.md §2,
    "Attention and window"). ``cos``/``sin`` must broadcast against ``x[..., :rd/2]``;
    pass ``-sin`` for the conjugate (de-)rotation.
    """
    half = cos.shape[-1]
    rd = 2 * half
    nope, rope = x[..., :-rd], x[..., -rd:]
    pairs = rope.reshape(*rope.shape[:-1], half, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    rot = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rope.shape)
    # Rotation in float32 (cos/sin are float32), result back in the input dtype.
    return mx.concatenate([nope, rot.astype(x.dtype)], axis=-1)


# ----------------------------------------------------------------------------- basic layers
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
        if x.dtype == self.weight.dtype:
            return mx.fast.rms_norm(x, self.weight, self.eps)
        return mx.fast.rms_norm(
            x.astype(mx.float32), self.weight.astype(mx.float32), self.eps
        ).astype(x.dtype)


class GroupedLinear(nn.Module):
    """Grouped output projection ``wo_a`` (docs/ARCHITECTURE.md §2, "Attention and window").

    ``weight`` is ``(groups * rank, in_per_group)`` as in DeepSeek's checkpoint; group g
    owns rows ``g*rank … (g+1)*rank - 1`` and sees only its contiguous block of heads.
    Input ``(L, groups, in_per_group)`` -> output ``(L, groups, rank)``.
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
    """MLX-quantized ``GroupedLinear`` (``weight/scales[/biases]`` rows as in the float one)."""

    def __init__(self, groups: int, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.groups, self.group_size, self.bits, self.mode = groups, group_size, bits, mode
        self.weight = mx.zeros((0,), dtype=mx.uint32)
        self.scales = mx.zeros((0,))

    def __call__(self, x: mx.array) -> mx.array:
        rows = self.weight.shape[0] // self.groups
        biases = self.get("biases")
        outs = []
        for g in range(self.groups):
            sl = slice(g * rows, (g + 1) * rows)
            outs.append(
                mx.quantized_matmul(
                    x[:, g],
                    self.weight[sl],
                    self.scales[sl],
                    None if biases is None else biases[sl],
                    transpose=True,
                    group_size=self.group_size,
                    bits=self.bits,
                    mode=self.mode,
                )
            )
        return mx.stack(outs, axis=1)


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

    def __call__(self, x: mx.array, st: CompressorState, p0: int, inv_freq: mx.array) -> None:
        """Consume tokens at positions ``p0 … p0+L-1`` and append every completed row to ``st``.

        Row k pools tokens ``k*r … k*r+r-1`` (plus, with overlap, the previous block's
        first-half features) and is roped at position ``k*r`` on its last rope channels.
        """
        r, d = self.ratio, self.head_dim
        L = x.shape[0]
        st.ensure(x.dtype)
        kv = self.wkv(x)
        score = self.wgate(x) + self.ape[mx.remainder(mx.arange(p0, p0 + L), r)]
        npend = p0 % r
        if npend:
            kv = mx.concatenate([st.pend_kv[:npend], kv])
            score = mx.concatenate([st.pend_score[:npend], score])
        total = npend + L
        nb = total // r
        rem = total - nb * r
        if nb:
            bk = kv[: nb * r].reshape(nb, r, -1)
            bs = score[: nb * r].reshape(nb, r, -1)
            if self.overlap:
                # Slots 0..r-1: previous block's first-half features; r..2r-1: this block's
                # second half. Before block 0 the carried score is -inf (weight 0).
                prev_k = mx.concatenate([st.prev_kv[None], bk[:-1, :, :d]])
                prev_s = mx.concatenate([st.prev_score[None], bs[:-1, :, :d]])
                st.prev_kv, st.prev_score = bk[-1, :, :d], bs[-1, :, :d]
                bk = mx.concatenate([prev_k, bk[:, :, d:]], axis=1)
                bs = mx.concatenate([prev_s, bs[:, :, d:]], axis=1)
            rows = (bk * mx.softmax(bs, axis=1, precise=True)).sum(axis=1)
            rows = self.norm(rows)
            pos = (p0 // r + mx.arange(nb)) * r
            cos, sin = rope_cos_sin(inv_freq, pos)
            # Pooling runs in float32 (score + ape); rows are stored in the compute dtype.
            st.rows.append(apply_rope(rows, cos, sin).astype(x.dtype))
        if rem:
            pad = r - rem
            tail_k, tail_s = kv[nb * r :], score[nb * r :]
            if pad:
                tail_k = mx.concatenate([tail_k, mx.zeros((pad, tail_k.shape[1]), tail_k.dtype)])
                tail_s = mx.concatenate([tail_s, mx.zeros((pad, tail_s.shape[1]), tail_s.dtype)])
            st.pend_kv, st.pend_score = tail_k, tail_s


class Indexer(nn.Module):
    """Lightning Indexer of a CSA layer (docs/ARCHITECTURE.md §2, "Indexer (ratio-4 layers)").

    Parameters: ``wq_b`` (``q_lora_rank -> index_n_heads*index_head_dim``),
    ``weights_proj`` (``dim -> index_n_heads``), ``compressor`` (overlapping, at
    ``index_head_dim``).
    """

    def __init__(self, args: ModelArgs, ratio: int):
        super().__init__()
        self.n_heads, self.head_dim, self.topk, self.ratio = (
            args.index_n_heads,
            args.index_head_dim,
            args.index_topk,
            ratio,
        )
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.dim, self.n_heads, bias=False)
        self.compressor = Compressor(args, ratio, self.head_dim, overlap=True)

    def __call__(
        self, x, qr, st: CompressorState, p0: int, qpos, cos, sin, inv_freq
    ) -> mx.array | None:
        """Top-k compressed-row indices ``(L, index_topk)`` int (unordered), or None.

        None means every visible row is selected (fewer rows than ``index_topk``), so
        the caller attends to all visible rows densely. Returned indices may point at rows
        not yet visible to a query; the caller masks those.
        """
        self.compressor(x, st, p0, inv_freq)
        n = st.rows.n
        if n <= self.topk:
            return None
        keys = st.rows.rows  # (N, Di)
        L = x.shape[0]
        q = self.wq_b(qr).reshape(L, self.n_heads, self.head_dim)
        q = apply_rope(q, cos[:, None], sin[:, None])
        # Signed weights (no sigmoid / softmax): w = weights_proj(x) · Di^-0.5 · Hi^-0.5.
        w = self.weights_proj(x) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        visible = (qpos + 1) // self.ratio  # rows < visible are complete for the query
        block = max(1, min(L, _SCORE_BUDGET // (self.n_heads * n)))
        out = []
        cols = mx.arange(n)
        for s in range(0, L, block):
            e = min(L, s + block)
            sc = mx.maximum(q[s:e] @ keys.T, 0)  # (B, Hi, N) ReLU(q_h · k_s)
            sc = (sc * w[s:e, :, None]).sum(axis=1)  # (B, N)
            sc = mx.where(cols[None, :] < visible[s:e, None], sc, -mx.inf)
            out.append(mx.argpartition(-sc, self.topk - 1, axis=-1)[:, : self.topk])
        return out[0] if len(out) == 1 else mx.concatenate(out)


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
        self.o_lora_rank = args.o_lora_rank
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

    def __call__(self, x: mx.array, c: LayerCache, ctx: SimpleNamespace) -> mx.array:
        """``x`` ``(L, dim)`` (already ``attn_norm``-ed) -> ``(L, dim)``; advances ``c``."""
        L = x.shape[0]
        H, D = self.n_heads, self.head_dim
        p0 = c.offset
        # Window-only layers: rope_theta, no YaRN; compressed layers: compress_rope_theta
        # with YaRN for every rotation in the layer.
        cos, sin, inv = ctx.main if self.kind == "window" else ctx.compress

        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).reshape(L, H, D)
        q = mx.fast.rms_norm(q, None, self.eps)  # per-head RMSNorm without weight
        q = apply_rope(q, cos[:, None], sin[:, None])
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)  # (L, D), one shared K=V head

        # Window keys: the ring as it was before this call plus the new rows. Ring slots
        # hold older positions or -1 (empty); masking by position keeps exactly the W
        # most recent tokens including the query itself.
        if c.window is not None and p0 > 0:
            ring, ring_pos = c.window, c.ring_positions()
        else:
            ring, ring_pos = None, None

        comp_rows, sel = None, None
        if self.kind != "window":
            self.compressor(x, c.comp, p0, inv)
            comp_rows = c.comp.rows.rows
            if self.kind == "csa":
                sel = self.indexer(x, qr, c.index, p0, ctx.positions, cos, sin, inv)

        c.write_window(kv)
        c.offset = p0 + L

        o = self._attend(q, kv, ring, ring_pos, comp_rows, sel, ctx.positions)
        o = apply_rope(o, cos[:, None], -sin[:, None])  # de-rotate the rope channels
        o = self.wo_a(o.reshape(L, self.groups, -1)).reshape(L, -1)
        return self.wo_b(o)

    def _attend(self, q, kv, ring, ring_pos, comp, sel, qpos) -> mx.array:
        """Softmax attention with sink, in query blocks. Returns ``(L, H, D)``."""
        L, H, D = q.shape
        W = self.window
        scale = D**-0.5
        sink = self.attn_sink.astype(mx.float32)[None, :, None]  # (1, H, 1)
        n_comp = 0 if comp is None else comp.shape[0]
        gathered = sel is not None
        block = _Q_BLOCK
        if gathered:
            block = max(1, min(block, _SCORE_BUDGET // (sel.shape[1] * D)))
        elif n_comp:
            block = max(1, min(block, _SCORE_BUDGET // (H * n_comp)))
        new_pos = qpos
        outs = []
        for s in range(0, L, block):
            e = min(L, s + block)
            qb, qp = q[s:e], qpos[s:e]
            B = e - s
            lo = max(0, s - W + 1)
            keys, kpos = kv[lo:e], new_pos[lo:e]
            if ring is not None and s < W - 1:
                keys = mx.concatenate([ring, keys])
                kpos = mx.concatenate([ring_pos, kpos])
            vis = (
                (kpos[None, :] <= qp[:, None])
                & (kpos[None, :] > qp[:, None] - W)
                & (kpos[None, :] >= 0)
            )
            visible = (qp + 1) // self.ratio if self.ratio else None
            if not gathered:
                # Window + every visible compressed row: one masked MQA with sinks, which
                # mx.fast's attention supports directly (checked equal to the formula below).
                if n_comp:
                    keys = mx.concatenate([keys, comp])
                    ok = mx.arange(n_comp)[None, :] < visible[:, None]
                    vis = mx.concatenate([vis, ok], axis=1)
                ob = mx.fast.scaled_dot_product_attention(
                    qb.swapaxes(0, 1)[None],
                    keys[None, None],
                    keys[None, None],
                    scale=scale,
                    mask=vis[None, None],
                    sinks=self.attn_sink.astype(qb.dtype),
                )
                outs.append(ob[0].swapaxes(0, 1))
                continue
            qf = qb.reshape(B * H, D)
            s_win = (qf @ keys.T).reshape(B, H, -1) * scale
            parts = [mx.where(vis[:, None, :], s_win, -mx.inf)]
            # CSA with more rows than top-k: attend to the indexer's rows, gathered per query.
            idx = sel[s:e]  # (B, k)
            ksel = comp[idx]  # (B, k, D)
            s_c = (qb @ ksel.swapaxes(1, 2)) * scale  # (B, H, k)
            ok = idx < visible[:, None]
            parts.append(mx.where(ok[:, None, :], s_c, -mx.inf))
            scores = mx.concatenate(parts, axis=-1)
            # The sink logit joins only the denominator.
            m = mx.maximum(scores.max(axis=-1, keepdims=True), sink)
            ex = mx.exp(scores - m)
            p = ex / (ex.sum(axis=-1, keepdims=True) + mx.exp(sink - m))
            nw = keys.shape[0]
            ob = (p[..., :nw].reshape(B * H, nw) @ keys).reshape(B, H, D)
            outs.append(ob + p[..., nw:] @ ksel)
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)


# ----------------------------------------------------------------------------- MoE
class Gate(nn.Module):
    """Router (docs/ARCHITECTURE.md §2, "MoE"). ``weight`` ``(E, dim)``; ``bias`` ``(E,)`` for top-k
    layers; ``tid2eid`` ``(vocab, k)`` int32 for hash layers."""

    def __init__(self, args: ModelArgs, hashed: bool):
        super().__init__()
        self.hashed = hashed
        self.topk, self.route_scale, self.score_func = (
            args.n_activated_experts,
            args.route_scale,
            args.score_func,
        )
        self.weight = mx.zeros((args.n_routed_experts, args.dim))
        if hashed:
            self.tid2eid = mx.zeros((args.vocab_size, args.n_activated_experts), dtype=mx.int32)
        else:
            self.bias = mx.zeros((args.n_routed_experts,))

    def __call__(self, x: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """Return ``(weights (L, k) float32, expert ids (L, k) int)``."""
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        if self.score_func == "softmax":
            scores = mx.softmax(logits, axis=-1, precise=True)
        elif self.score_func == "sigmoid":
            scores = mx.sigmoid(logits)
        else:  # sqrtsoftplus
            scores = mx.sqrt(nn.softplus(logits))
        if self.hashed:
            idx = self.tid2eid[tokens]
        else:
            # The bias only steers selection; weights use the unbiased scores.
            idx = mx.argpartition(-(scores + self.bias), self.topk - 1, axis=-1)[:, : self.topk]
        w = mx.take_along_axis(scores, idx, axis=-1)
        if self.score_func != "softmax":
            w = w / w.sum(axis=-1, keepdims=True)
        return w * self.route_scale, idx


class Experts(nn.Module):
    """Routed experts stacked per layer: ``w1``/``w3`` ``(E, inter, dim)``, ``w2`` ``(E, dim, inter)``.

    ``y = Σ_k weight_k · w2(silu(min(w1·x, L)) · clip(w3·x, -L, L))`` with
    ``L = swiglu_limit`` (no clamp when 0).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        E, dim, inter = args.n_routed_experts, args.dim, args.moe_inter_dim
        self.limit = args.swiglu_limit
        self.w1 = SwitchLinear(dim, inter, E, bias=False)
        self.w2 = SwitchLinear(inter, dim, E, bias=False)
        self.w3 = SwitchLinear(dim, inter, E, bias=False)

    def __call__(self, x: mx.array, idx: mx.array, weights: mx.array) -> mx.array:
        L, k = idx.shape
        if idx.size >= 64:
            # Sort (token, slot) pairs by expert so gather_mm reads each expert once.
            flat = idx.reshape(-1)
            order = mx.argsort(flat)
            inv = mx.argsort(order)
            xs = x[order // k][:, None, :]
            ids = flat[order]
            h = self._act(
                self.w1(xs, ids, sorted_indices=True), self.w3(xs, ids, sorted_indices=True)
            )
            out = self.w2(h, ids, sorted_indices=True)[:, 0][inv].reshape(L, k, -1)
        else:
            xe = x[:, None, None, :]
            h = self._act(self.w1(xe, idx), self.w3(xe, idx))
            out = self.w2(h, idx)[:, :, 0]
        return (out * weights[..., None].astype(out.dtype)).sum(axis=1)

    def _act(self, gate: mx.array, up: mx.array) -> mx.array:
        if self.limit > 0:
            gate = mx.minimum(gate, self.limit)
            up = mx.clip(up, -self.limit, self.limit)
        return nn.silu(gate) * up


class MLP(nn.Module):
    """Shared expert ``w2(silu(w1·x) · w3·x)``; not clamped (docs/ARCHITECTURE.md §2, "MoE")."""

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(nn.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.gate = Gate(args, args.hash_layers[layer_id])
        self.experts = Experts(args)
        if args.n_shared_experts:
            self.shared_experts = MLP(args.dim, args.moe_inter_dim)

    def __call__(self, x: mx.array, tokens: mx.array) -> mx.array:
        w, idx = self.gate(x, tokens)
        y = self.experts(x, idx, w)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


# ----------------------------------------------------------------------------- mHC
@cache
def _hc_pre_fn(hc: int, iters: int, hc_eps: float, norm_eps: float):
    """Compiled mHC weight computation (docs/ARCHITECTURE.md §2, "Hyper-connections")."""

    def fn(x, hc_fn, scale, base):
        L = x.shape[0]
        flat = x.reshape(L, -1)
        mixes = (flat @ hc_fn.T) * mx.rsqrt(mx.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
        pre = mx.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
        post = 2 * mx.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
        comb = mixes[:, 2 * hc :].reshape(L, hc, hc) * scale[2] + base[2 * hc :].reshape(hc, hc)
        comb = mx.softmax(comb, axis=-1, precise=True) + hc_eps
        comb = comb / (comb.sum(axis=-2, keepdims=True) + hc_eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + hc_eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + hc_eps)
        y = (pre[:, :, None] * x).sum(axis=1)
        return y, post, comb

    return mx.compile(fn)


def hc_post(f: mx.array, residual: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """Stream k = post_k · f + Σ_j comb[j, k] · residual_j (comb transposed). ``(L, hc, dim)``."""
    return post[:, :, None] * f[:, None, :] + comb.swapaxes(-1, -2) @ residual


class Block(nn.Module):
    """One decoder layer: mHC around attention and around the MoE."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.attn = Attention(args, layer_id)
        self.ffn = MoE(args, layer_id)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        mix = (2 + args.hc_mult) * args.hc_mult
        self.hc_attn_fn = mx.zeros((mix, args.hc_mult * args.dim))
        self.hc_ffn_fn = mx.zeros((mix, args.hc_mult * args.dim))
        self.hc_attn_base = mx.zeros((mix,))
        self.hc_ffn_base = mx.zeros((mix,))
        self.hc_attn_scale = mx.ones((3,))
        self.hc_ffn_scale = mx.ones((3,))
        self._hc_pre = _hc_pre_fn(args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.norm_eps)

    def __call__(self, x: mx.array, tokens: mx.array, c: LayerCache, ctx) -> mx.array:
        dt = x.dtype  # mHC weights are float32; the streams stay in the compute dtype
        y, post, comb = self._hc_pre(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        y = self.attn(self.attn_norm(y.astype(dt)), c, ctx)
        x = hc_post(y, x, post, comb).astype(dt)
        y, post, comb = self._hc_pre(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        y = self.ffn(self.ffn_norm(y.astype(dt)), tokens)
        return hc_post(y, x, post, comb).astype(dt)


# ----------------------------------------------------------------------------- model
class Model(nn.Module):
    """DeepSeek V4 causal LM.

    Call ``model(tokens, cache)``: ``tokens`` int32 ``(1, L)`` (or ``(L,)``), ``cache``
    from ``make_cache()`` (None: a throw-away cache, i.e. a full forward from position 0).
    Positions continue from the cache offset, so chunked prefill and token-by-token decode
    equal one full forward. Returns float32 logits ``(1, L, vocab)``, or ``(1, 1, vocab)``
    for the last position only with ``last_only=True``.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = [Block(args, i) for i in range(args.n_layers)]
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.hc_head_fn = mx.zeros((args.hc_mult, args.hc_mult * args.dim))
        self.hc_head_base = mx.zeros((args.hc_mult,))
        self.hc_head_scale = mx.ones((1,))
        a = args
        self._inv_main = rope_inv_freq(a.rope_head_dim, a.rope_theta)
        self._inv_comp = rope_inv_freq(
            a.rope_head_dim,
            a.compress_rope_theta,
            a.rope_factor,
            a.original_seq_len,
            a.beta_fast,
            a.beta_slow,
        )
        self.compute_dtype = mx.float32

    def make_cache(self) -> list[LayerCache]:
        """One empty ``LayerCache`` per layer (see ``cache.py`` for the state keys)."""
        a = self.args
        return [
            LayerCache(
                a.layer_kind(i), a.window_size, a.head_dim, a.compress_ratios[i], a.index_head_dim
            )
            for i in range(a.n_layers)
        ]

    def __call__(
        self, tokens: mx.array, cache: list[LayerCache] | None = None, *, last_only: bool = False
    ) -> mx.array:
        if tokens.ndim == 2:
            if tokens.shape[0] != 1:
                raise ValueError(f"batch size must be 1, got tokens of shape {tokens.shape}")
            tokens = tokens[0]
        if cache is None:
            cache = self.make_cache()
        if len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} layers, model has {len(self.layers)}")
        L = tokens.shape[0]
        p0 = cache[0].offset
        positions = mx.arange(p0, p0 + L)
        ctx = SimpleNamespace(
            positions=positions,
            main=(*rope_cos_sin(self._inv_main, positions), self._inv_main),
            compress=(*rope_cos_sin(self._inv_comp, positions), self._inv_comp),
        )
        h = self.embed(tokens).astype(self.compute_dtype)
        x = mx.broadcast_to(h[:, None, :], (L, self.args.hc_mult, h.shape[-1]))
        for layer, c in zip(self.layers, cache, strict=True):
            x = layer(x, tokens, c, ctx)
        if last_only:
            x = x[-1:]
        logits = self.head(self.norm(self._hc_head(x)))
        return logits.astype(mx.float32)[None]

    def _hc_head(self, x: mx.array) -> mx.array:
        """Collapse the hc streams: pre = sigmoid(mixes·scale + base) + eps, no Sinkhorn."""
        a = self.args
        flat = x.reshape(x.shape[0], -1)
        mixes = (flat @ self.hc_head_fn.T) * mx.rsqrt(
            mx.mean(flat * flat, axis=-1, keepdims=True) + a.norm_eps
        )
        pre = mx.sigmoid(mixes * self.hc_head_scale + self.hc_head_base) + a.hc_eps
        return (pre[:, :, None] * x).sum(axis=1)
