"""DeepSeek V4 network in MLX.

Semantics follow docs/NETWORK.md (checked against DeepSeek's official
``inference/model.py``); the section names in the comments refer to that file.
Parameter names follow DeepSeek's official checkpoint naming (DESIGN.md §2, layout b),
except that routed experts are stacked per layer (``ffn.experts.w1.weight`` has shape
``(n_routed_experts, moe_inter_dim, dim)``) so ``mx.gather_mm`` / ``mx.gather_qmm`` can run
them; ``loading.py`` stacks per-expert checkpoints.

The decode step is built for a small graph (docs/KERNELS.md): attention and mHC live in
``attention.py`` / ``mhc.py``; here the MoE keeps its elementwise chains in compiled
functions and sums the top-k expert outputs with one matmul.

Shapes below use ``L`` = tokens in the call and ``hc`` = ``hc_mult``. The batch size is 1
(one live session); compute is float32 on the CPU.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchLinear

from .attention import (  # noqa: F401  (re-exported: tests and loading use these names)
    Attention,
    Compressor,
    GroupedLinear,
    Indexer,
    QuantizedGroupedLinear,
    RMSNorm,
    Step,
)
from .cache import LayerCache
from .config import ModelArgs
from .mhc import hc_head_fn, hc_post, hc_post2, hc_pre_fn
from .rope import rope_inv_freq
from .sinkhorn import choose_sinkhorn, device_kind


# ----------------------------------------------------------------------------- MoE
@cache
def _gate_fn(topk: int, route_scale: float, score_func: str, hashed: bool):
    """Compiled router ``fn(x, weight, bias_or_ids) -> (weights (L, k) f32, ids (L, k))``.

    Top-k layers pass the bias (it only steers selection; weights use the unbiased
    scores); hash layers pass the ``tid2eid`` rows of the tokens as ids.
    """

    def fn(x, weight, extra):
        logits = x.astype(mx.float32) @ weight.astype(mx.float32).T
        if score_func == "softmax":
            scores = mx.softmax(logits, axis=-1, precise=True)
        elif score_func == "sigmoid":
            scores = mx.sigmoid(logits)
        else:  # sqrtsoftplus
            scores = mx.sqrt(nn.softplus(logits))
        if hashed:
            idx = extra
        else:
            idx = mx.argpartition(-(scores + extra), topk - 1, axis=-1)[:, :topk]
        w = mx.take_along_axis(scores, idx, axis=-1)
        if score_func != "softmax":
            w = w / w.sum(axis=-1, keepdims=True)
        return w * route_scale, idx

    return mx.compile(fn)


class Gate(nn.Module):
    """Router (docs/NETWORK.md, "MoE"). ``weight`` ``(E, dim)``; ``bias`` ``(E,)`` for top-k
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
        fn = _gate_fn(self.topk, self.route_scale, self.score_func, self.hashed)
        return fn(x, self.weight, self.tid2eid[tokens] if self.hashed else self.bias)


@cache
def _swiglu_fn(limit: float):
    """Compiled ``silu(min(gate, L)) · clip(up, -L, L)`` (no clamp when ``limit`` is 0)."""

    def fn(gate, up):
        if limit > 0:
            gate = mx.minimum(gate, limit)
            up = mx.clip(up, -limit, limit)
        return nn.silu(gate) * up

    return mx.compile(fn)


@cache
def _lhs_indices(rows: int, cols: int) -> mx.array:
    """``arange(rows * cols).reshape(rows, cols)`` uint32, built once per shape on the host."""
    return mx.array(np.arange(rows * cols, dtype=np.uint32).reshape(rows, cols))


def _switch(layer: nn.Module, x: mx.array, lhs: mx.array, rhs: mx.array, sort: bool) -> mx.array:
    """mlx-lm's (Quantized)SwitchLinear (no bias) with explicit ``lhs_indices``.

    Left to itself ``gather_(q)mm`` builds ``arange`` lhs indices and casts int32 expert
    ids to uint32 on every call: two graph nodes per expert matmul. The caller passes
    host-built lhs indices and uint32 ids instead.
    """
    if "scales" in layer:
        return mx.gather_qmm(
            x,
            layer["weight"],
            layer["scales"],
            layer.get("biases"),
            lhs_indices=lhs,
            rhs_indices=rhs,
            transpose=True,
            group_size=layer.group_size,
            bits=layer.bits,
            mode=layer.mode,
            global_scale=getattr(layer, "global_scale", None),
            sorted_indices=sort,
        )
    return mx.gather_mm(
        x, layer["weight"].swapaxes(-1, -2), lhs_indices=lhs, rhs_indices=rhs, sorted_indices=sort
    )


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
        act = _swiglu_fn(float(self.limit))
        idx = idx.astype(mx.uint32)  # a no-op for top-k ids; hash ids are int32
        if idx.size >= 64:
            # Sort (token, slot) pairs by expert so gather_mm reads each expert once.
            flat = idx.reshape(-1)
            order = mx.argsort(flat)
            inv = mx.argsort(order)
            xs = x[order // k][:, None, :]
            ids = flat[order]
            lhs = _lhs_indices(L * k, 1)[:, 0]
            h = act(_switch(self.w1, xs, lhs, ids, True), _switch(self.w3, xs, lhs, ids, True))
            out = _switch(self.w2, h, lhs, ids, True)[:, 0][inv].reshape(L, k, -1)
        else:
            xe = x[:, None, None, :]
            lhs = _lhs_indices(L, 1)  # x batch is (L, 1)
            h = act(_switch(self.w1, xe, lhs, idx, False), _switch(self.w3, xe, lhs, idx, False))
            lhs = _lhs_indices(L, k)  # h batch is (L, k)
            out = _switch(self.w2, h, lhs, idx, False)[:, :, 0]
        # Σ_k weight_k · out_k as one (1 x k) @ (k x dim) matmul per token.
        return (weights[:, None, :].astype(out.dtype) @ out).reshape(L, -1)


class MLP(nn.Module):
    """Shared expert ``w2(silu(w1·x) · w3·x)``; not clamped (docs/NETWORK.md, "MoE")."""

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(_swiglu_fn(0.0)(self.w1(x), self.w3(x)))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.gate = Gate(args, args.hash_layers[layer_id])
        self.experts = Experts(args)
        if args.n_shared_experts:
            self.shared_experts = MLP(args.dim, args.moe_inter_dim)

    def __call__(self, x: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array | None]:
        """``(routed, shared)`` outputs ``(L, dim)``; the caller adds them (fused into mHC)."""
        w, idx = self.gate(x, tokens)
        shared = self.shared_experts(x) if "shared_experts" in self else None
        return self.experts(x, idx, w), shared


# ----------------------------------------------------------------------------- block
class Block(nn.Module):
    """One decoder layer: mHC around attention and around the MoE."""

    def __init__(self, args: ModelArgs, layer_id: int, sinkhorn=None):
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
        self._hc_pre = hc_pre_fn(
            args.hc_mult,
            args.hc_sinkhorn_iters,
            args.hc_eps,
            args.norm_eps,
            sinkhorn or choose_sinkhorn(),
        )

    def __call__(self, x: mx.array, tokens: mx.array, c: LayerCache, ctx: Step) -> mx.array:
        dt = x.dtype  # mHC weights are float32; the streams stay in the compute dtype
        y, post, comb = self._hc_pre(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        y = self.attn(self.attn_norm(y.astype(dt)), c, ctx)
        x = hc_post(y, x, post, comb)
        y, post, comb = self._hc_pre(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        routed, shared = self.ffn(self.ffn_norm(y.astype(dt)), tokens)
        if shared is None:
            return hc_post(routed, x, post, comb)
        return hc_post2(routed, shared, x, post, comb)


# ----------------------------------------------------------------------------- model
class Model(nn.Module):
    """DeepSeek V4 causal LM.

    Call ``model(tokens, cache)``: ``tokens`` int32 ``(1, L)`` (or ``(L,)``), ``cache``
    from ``make_cache()`` (None: a throw-away cache, i.e. a full forward from position 0).
    Positions continue from the cache offset, so chunked prefill and token-by-token decode
    equal one full forward. Returns float32 logits ``(1, L, vocab)``, or ``(1, 1, vocab)``
    for the last position only with ``last_only=True``.

    The Sinkhorn implementation is chosen by the default device when the model is built
    (``sinkhorn.choose_sinkhorn``): one custom kernel on Metal / CUDA, the MLX loop on the
    CPU; ``sinkhorn_impl`` says which.
    """

    def __init__(self, args: ModelArgs, sinkhorn: str | None = None):
        super().__init__()
        self.args = args

        self.sinkhorn_impl = sinkhorn or device_kind()
        impl = choose_sinkhorn(self.sinkhorn_impl)
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = [Block(args, i, impl) for i in range(args.n_layers)]
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.hc_head_fn = mx.zeros((args.hc_mult, args.hc_mult * args.dim))
        self.hc_head_base = mx.zeros((args.hc_mult,))
        self.hc_head_scale = mx.ones((1,))
        a = args
        # numpy (host) inverse frequencies: RoPE tables are built per call on the host.
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
        self,
        tokens: mx.array,
        cache: list[LayerCache] | None = None,
        *,
        last_only: bool = False,
        probe=None,
    ) -> mx.array:
        """``probe(i, x, cache_i)``, when given, is called after layer ``i`` with its output
        streams (benchmarks evaluate there to time layers one by one)."""
        if tokens.ndim == 2:
            if tokens.shape[0] != 1:
                raise ValueError(f"batch size must be 1, got tokens of shape {tokens.shape}")
            tokens = tokens[0]
        if cache is None:
            cache = self.make_cache()
        if len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} layers, model has {len(self.layers)}")
        L = tokens.shape[0]
        a = self.args
        ctx = Step(
            cache[0].offset, L, a.window_size, self._inv_main, self._inv_comp, self.compute_dtype
        )
        h = self.embed(tokens).astype(self.compute_dtype)
        x = mx.broadcast_to(h[:, None, :], (L, a.hc_mult, h.shape[-1]))
        for i, (layer, c) in enumerate(zip(self.layers, cache, strict=True)):
            x = layer(x, tokens, c, ctx)
            if probe is not None:
                probe(i, x, c)
        if last_only:
            x = x[-1:]
        y = hc_head_fn(a.hc_eps, a.norm_eps)(
            x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base
        )
        logits = self.head(self.norm(y.astype(x.dtype)))
        return logits.astype(mx.float32)[None]
