"""DeepSeek V4 network in MLX.

Semantics follow docs/ARCHITECTURE.md §2 (checked against DeepSeek's official
``inference/model.py``); the section names in the comments refer to that file.
Parameter names follow DeepSeek's official checkpoint naming (docs/WEIGHTS.md),
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

import mlx.core as mx
import mlx.nn as nn

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
from .moe import MLP, Experts, Gate, MoE  # noqa: F401  (re-exported)
from .rope import on_gpu, rope_inv_freq
from .sinkhorn import choose_sinkhorn, device_kind


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
            on_gpu(),
        )

    def __call__(self, x: mx.array, tokens: mx.array, c: LayerCache, ctx: Step) -> mx.array:
        # mHC weights are float32; the streams stay in the compute dtype. hc_pre returns the
        # block input already through attn_norm / ffn_norm (one compiled call).
        y, post, comb = self._hc_pre(
            x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.attn_norm.weight
        )
        y = self.attn(y, c, ctx)
        x = hc_post(y, x, post, comb)
        y, post, comb = self._hc_pre(
            x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.ffn_norm.weight
        )
        routed, shared = self.ffn(y, tokens)
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
        # Drafters' taps (plain attributes, not parameters): see `add_taps`.
        object.__setattr__(self, "taps", ())
        object.__setattr__(self, "tap_rows", 0)
        object.__setattr__(self, "tapped", {})

    def add_taps(self, layers, rows: int) -> None:
        """Keep layer outputs for drafters: after every call, ``tapped[i]`` holds the output
        streams ``(L, hc, dim)`` of layer ``i`` for each ``i`` in ``taps`` (the MTP head
        taps the last layer: the final hidden state of every fed row). ``rows``: how many
        of the latest fed rows a session keeps of them (``ds4mlx.engine.session``)."""
        object.__setattr__(self, "taps", tuple(sorted({*self.taps, *map(int, layers)})))
        object.__setattr__(self, "tap_rows", max(self.tap_rows, int(rows)))

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
        ctx = self.step_for(cache[0].offset, tokens.shape[0])
        x = self.embed_streams(tokens)
        tapped = {}
        for i, (layer, c) in enumerate(zip(self.layers, cache, strict=True)):
            x = layer(x, tokens, c, ctx)
            if i in self.taps:
                tapped[i] = x
            if probe is not None:
                probe(i, x, c)
        object.__setattr__(self, "tapped", tapped)
        return self.head_logits(x, last_only=last_only)

    # The three parts of a forward call, public so a pipeline split
    # (``ds4mlx.engine.pipeline``) runs them on different ranks with the same arithmetic.

    def step_for(self, offset: int, L: int) -> Step:
        """The per-call `Step` (positions, RoPE tables, masks) for ``L`` tokens at
        absolute position ``offset``."""
        a = self.args
        return Step(offset, L, a.window_size, self._inv_main, self._inv_comp, self.compute_dtype)

    def embed_streams(self, tokens: mx.array) -> mx.array:
        """int32 ``(L,)`` token ids -> the ``hc_mult`` residual streams ``(L, hc, dim)`` in
        the compute dtype (the embedding copied into every stream)."""
        h = self.embed(tokens).astype(self.compute_dtype)
        return mx.broadcast_to(h[:, None, :], (tokens.shape[0], self.args.hc_mult, h.shape[-1]))

    def head_logits(self, x: mx.array, *, last_only: bool = False, stage=None) -> mx.array:
        """Streams ``(L, hc, dim)`` after the last layer -> float32 logits ``(1, L, vocab)``
        (``(1, 1, vocab)`` with ``last_only``). ``stage``: the module whose
        ``hc_head_{fn,scale,base}`` and ``norm`` collapse the streams before this model's
        ``head`` (default: this model; an MTP block has its own)."""
        a = self.args
        st = self if stage is None else stage
        if last_only:
            x = x[-1:]
        y = hc_head_fn(a.hc_eps, a.norm_eps)(x, st.hc_head_fn, st.hc_head_scale, st.hc_head_base)
        logits = self.head(st.norm(y.astype(x.dtype)))
        return logits.astype(mx.float32)[None]
