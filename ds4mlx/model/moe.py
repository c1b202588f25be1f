"""Mixture of experts of DeepSeek V4 (docs/ARCHITECTURE.md §2, "MoE"), one compiled call per layer.

Router, routed experts and shared expert are written as pure functions of arrays and
static descriptions of each (possibly quantized) linear, so that ``MoE`` can run the
whole block as one ``mx.compile``d call. Compiled, its elementwise chains fuse (fewer
graph nodes) and, as importantly at batch size 1, building the block's graph is one
call into MLX instead of some thirty Python-level operations.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import ModelArgs

Spec = tuple  # ("f",) or ("q", group_size, bits, mode, has_biases)


def linear_spec(m: nn.Module) -> Spec | None:
    """Static description of a bias-free (quantized) linear; None if not supported here."""
    if "bias" in m or getattr(m, "global_scale", None) is not None:
        return None
    if "scales" in m:
        return ("q", m.group_size, m.bits, m.mode, "biases" in m)
    return ("f",)


def linear_arrays(m: nn.Module) -> list[mx.array]:
    """The arrays of a linear described by ``linear_spec``: weight[, scales[, biases]]."""
    if "scales" in m:
        return [m["weight"], m["scales"]] + ([m["biases"]] if "biases" in m else [])
    return [m["weight"]]


def linear(x: mx.array, a: list[mx.array], spec: Spec) -> mx.array:
    if spec[0] == "f":
        return x @ a[0].T
    _, gs, bits, mode, has_b = spec
    return mx.quantized_matmul(
        x, a[0], a[1], a[2] if has_b else None, transpose=True, group_size=gs, bits=bits, mode=mode
    )


class SwitchLinear(nn.Module):
    """One bias-free linear per expert, stacked: ``weight`` ``(E, out, in)``.

    A weight holder: `experts` does the math (``_switch``). Written here rather than taken
    from mlx-lm, whose package ``__init__`` imports transformers (seconds per process).
    The weight starts as lazy zeros; the loader replaces it.
    """

    def __init__(self, in_dims: int, out_dims: int, n_experts: int):
        super().__init__()
        self.weight = mx.zeros((n_experts, out_dims, in_dims))

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
        """The `QuantizedSwitchLinear` of this weight (what ``nn.quantize`` calls)."""
        return QuantizedSwitchLinear(self.weight, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """MLX-quantized `SwitchLinear`: ``weight`` ``(E, out, in·bits/32)`` uint32, ``scales``
    ``(E, out, in/group_size)`` and, in ``"affine"`` mode, ``biases`` (same shape).

    Args:
        weight: the float ``(E, out, in)`` stack to quantize (lazy: a loader replaces the
            arrays before anything evaluates them).
        group_size, bits, mode: as ``mx.quantize``.
    """

    def __init__(self, weight: mx.array, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        packed = mx.quantize(weight, group_size=group_size, bits=bits, mode=mode)
        self.weight, self.scales = packed[0], packed[1]
        if len(packed) > 2 and packed[2] is not None:
            self.biases = packed[2]


def _switch(x: mx.array, a: list[mx.array], spec: Spec, lhs, rhs, sort: bool) -> mx.array:
    """A (quantized) `SwitchLinear` as ``gather_(q)mm`` with explicit ``lhs_indices``.

    Left to itself ``gather_(q)mm`` builds ``arange`` lhs indices and casts int32 expert
    ids to uint32 on every call: two graph nodes per expert matmul. The caller passes
    host-built lhs indices and uint32 ids instead.
    """
    if spec[0] == "f":
        return mx.gather_mm(
            x, a[0].swapaxes(-1, -2), lhs_indices=lhs, rhs_indices=rhs, sorted_indices=sort
        )
    _, gs, bits, mode, has_b = spec
    return mx.gather_qmm(
        x,
        a[0],
        a[1],
        a[2] if has_b else None,
        lhs_indices=lhs,
        rhs_indices=rhs,
        transpose=True,
        group_size=gs,
        bits=bits,
        mode=mode,
        sorted_indices=sort,
    )


@cache
def _lhs_indices(rows: int, cols: int) -> mx.array:
    """``arange(rows * cols).reshape(rows, cols)`` uint32, built once per shape on the host."""
    return mx.array(np.arange(rows * cols, dtype=np.uint32).reshape(rows, cols))


def _swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    """``silu(min(gate, L)) · clip(up, -L, L)`` (no clamp when ``limit`` is 0)."""
    if limit > 0:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
    return nn.silu(gate) * up


def route(x, weight, extra, topk: int, route_scale: float, score_func: str, hashed: bool):
    """Router: ``(weights (L, k) float32, expert ids (L, k))``.

    Top-k layers pass the bias as ``extra`` (it only steers selection; weights use the
    unbiased scores); hash layers pass the ``tid2eid`` rows of the tokens as ids.
    """
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


def experts(x, idx, weights, arrays: list[list[mx.array]], specs: list[Spec], limit: float):
    """``Σ_k weight_k · w2(swiglu(w1·x, w3·x))`` ``(L, dim)``; ``arrays``/``specs`` for
    ``w1, w2, w3`` (stacked ``(E, out, in)``)."""
    L, k = idx.shape
    (a1, a2, a3), (s1, s2, s3) = arrays, specs
    idx = idx.astype(mx.uint32)  # a no-op for top-k ids; hash ids are int32
    if idx.size >= 64:
        # Sort (token, slot) pairs by expert so gather_mm reads each expert once.
        flat = idx.reshape(-1)
        order = mx.argsort(flat)
        inv = mx.argsort(order)
        xs = x[order // k][:, None, :]
        ids = flat[order]
        lhs = _lhs_indices(L * k, 1)[:, 0]
        h = _swiglu(_switch(xs, a1, s1, lhs, ids, True), _switch(xs, a3, s3, lhs, ids, True), limit)
        out = _switch(h, a2, s2, lhs, ids, True)[:, 0][inv].reshape(L, k, -1)
    else:
        xe = x[:, None, None, :]
        lhs = _lhs_indices(L, 1)  # x batch is (L, 1)
        h = _swiglu(
            _switch(xe, a1, s1, lhs, idx, False), _switch(xe, a3, s3, lhs, idx, False), limit
        )
        out = _switch(h, a2, s2, _lhs_indices(L, k), idx, False)[:, :, 0]  # h batch (L, k)
    # Σ_k weight_k · out_k as one (1 x k) @ (k x dim) matmul per token.
    return (weights[:, None, :].astype(out.dtype) @ out).reshape(L, -1)


def mlp(x, arrays: list[list[mx.array]], specs: list[Spec]) -> mx.array:
    """Shared expert ``w2(silu(w1·x) · w3·x)``, not clamped."""
    (a1, a2, a3), (s1, s2, s3) = arrays, specs
    return linear(_swiglu(linear(x, a1, s1), linear(x, a3, s3), 0.0), a2, s2)


class Gate(nn.Module):
    """Router. ``weight`` ``(E, dim)``; ``bias`` ``(E,)`` for top-k layers; ``tid2eid``
    ``(vocab, k)`` int32 for hash layers."""

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

    def config(self) -> tuple:
        return (self.topk, self.route_scale, self.score_func, self.hashed)

    def extra(self, tokens: mx.array) -> mx.array:
        return self.tid2eid[tokens] if self.hashed else self.bias

    def __call__(self, x: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """Return ``(weights (L, k) float32, expert ids (L, k) int)``."""
        return route(x, self.weight, self.extra(tokens), *self.config())


class Experts(nn.Module):
    """Routed experts stacked per layer: ``w1``/``w3`` ``(E, inter, dim)``, ``w2`` ``(E, dim, inter)``.

    ``y = Σ_k weight_k · w2(silu(min(w1·x, L)) · clip(w3·x, -L, L))`` with
    ``L = swiglu_limit`` (no clamp when 0).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        E, dim, inter = args.n_routed_experts, args.dim, args.moe_inter_dim
        self.limit = float(args.swiglu_limit)
        self.w1 = SwitchLinear(dim, inter, E)
        self.w2 = SwitchLinear(inter, dim, E)
        self.w3 = SwitchLinear(dim, inter, E)

    def parts(self) -> tuple[list[list[mx.array]], list[Spec | None]]:
        ms = (self.w1, self.w2, self.w3)
        return [linear_arrays(m) for m in ms], [linear_spec(m) for m in ms]

    def __call__(self, x: mx.array, idx: mx.array, weights: mx.array) -> mx.array:
        arrays, specs = self.parts()
        return experts(x, idx, weights, arrays, specs, self.limit)


class MLP(nn.Module):
    """Shared expert ``w2(silu(w1·x) · w3·x)``; not clamped (docs/ARCHITECTURE.md §2, "MoE")."""

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)

    def parts(self) -> tuple[list[list[mx.array]], list[Spec | None]]:
        ms = (self.w1, self.w2, self.w3)
        return [linear_arrays(m) for m in ms], [linear_spec(m) for m in ms]

    def __call__(self, x: mx.array) -> mx.array:
        arrays, specs = self.parts()
        return mlp(x, arrays, specs)


@cache
def _moe_fn(gate_cfg: tuple, limit: float, specs: tuple, sizes: tuple):
    """Compiled ``fn(x, gate_weight, extra, *arrays) -> (routed,)`` or ``(routed, shared)``.

    ``specs`` / ``sizes``: per linear (w1, w2, w3 of the experts, then of the shared
    expert if any) its spec and how many of ``arrays`` it owns.
    """

    def fn(x, gate_w, extra, *flat):
        groups, pos = [], 0
        for n in sizes:
            groups.append(list(flat[pos : pos + n]))
            pos += n
        w, idx = route(x, gate_w, extra, *gate_cfg)
        routed = experts(x, idx, w, groups[:3], list(specs[:3]), limit)
        if len(groups) == 3:
            return (routed,)
        return routed, mlp(x, groups[3:], list(specs[3:]))

    return mx.compile(fn)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.gate = Gate(args, args.hash_layers[layer_id])
        self.experts = Experts(args)
        if args.n_shared_experts:
            self.shared_experts = MLP(args.dim, args.moe_inter_dim)

    def __call__(self, x: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array | None]:
        """``(routed, shared)`` outputs ``(L, dim)``; the caller adds them (fused into mHC)."""
        ex, sh = self["experts"], self.get("shared_experts")
        linears = (ex["w1"], ex["w2"], ex["w3"]) + (() if sh is None else (sh.w1, sh.w2, sh.w3))
        key = tuple(map(id, linears))
        if self.__dict__.get("_plan_key") != key:
            # Specs are static once the model is loaded (quantization swaps the modules,
            # hence the key); re-planned only when a linear module changes.
            specs = tuple(linear_spec(m) for m in linears)
            fn = None
            if all(sp is not None for sp in specs):  # else e.g. nvfp4 global scales
                sizes = tuple(len(linear_arrays(m)) for m in linears)
                fn = _moe_fn(self.gate.config(), ex.limit, specs, sizes)
            object.__setattr__(self, "_plan", fn)
            object.__setattr__(self, "_plan_key", key)
        fn = self.__dict__["_plan"]
        log = self.__dict__.get("routing_log")
        if log is not None:  # ``ds4mlx bench --shape flash``: which experts a call reads
            log.append(self.gate(x, tokens)[1])
        if fn is None:
            w, idx = self.gate(x, tokens)
            return self.experts(x, idx, w), (None if sh is None else sh(x))
        flat = [a for m in linears for a in linear_arrays(m)]
        gate = self["gate"]
        out = fn(x, gate["weight"], gate.extra(tokens), *flat)
        return out[0], (out[1] if len(out) > 1 else None)
