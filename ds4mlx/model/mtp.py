"""The checkpoint's multi-token-prediction (MTP) head: a drafter for speculative decoding.

DeepSeek V4 checkpoints with ``num_nextn_predict_layers: N`` carry ``N`` MTP blocks under
``mtp.I.*`` (Flash: one). What each block is (docs/KERNELS.md "The MTP drafter" says what
is established from public code and what is inferred):

* a full decoder layer (``Block``: mHC around attention and around the MoE, its own
  ``attn.*``, ``ffn.*``, ``{attn,ffn}_norm``, ``hc_{attn,ffn}_{fn,base,scale}``), built as
  layer ``n_layers + I`` of the config: its attention schedule is the config's extra
  ``compress_ratios`` entry (Flash: 0, a window-only layer) and it is not hash-routed;
* an input stage: ``enorm`` on the embedding of the *next* token, ``hnorm`` on each of the
  target's ``hc`` final residual streams (the last layer's output, before the target's own
  ``hc_head``), ``x = e_proj(enorm(e))`` broadcast over the streams ``+ h_proj(hnorm(h))``;
* an output stage of its own: ``hc_head_{fn,base,scale}`` collapse the streams and ``norm``
  normalizes them before the target's ``head``. ``embed`` and ``head`` are the target's.

So the block at position ``i`` reads the target's streams after token ``t_i`` and the
embedding of ``t_{i+1}`` and predicts ``t_{i+2}``. ``ds4mlx.engine.mtp`` runs it as a
drafter with its own KV cache.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn

from .attention import RMSNorm, Step
from .cache import LayerCache
from .config import ModelArgs
from .network import Block, Model
from .sinkhorn import choose_sinkhorn


def block_args(args: ModelArgs, depth: int) -> ModelArgs:
    """The one-layer ``ModelArgs`` of MTP block ``depth``: its attention schedule is the
    config's ``compress_ratios`` entry ``n_layers + depth`` (0 when the config has none),
    and it is not hash-routed (layer ids past ``num_hash_layers``)."""
    ratios = args.mtp_compress_ratios
    ratio = ratios[depth] if depth < len(ratios) else 0
    return replace(args, n_layers=1, compress_ratios=(ratio,), hash_layers=(False,), extra={})


class MTPBlock(Block):
    """One MTP block (see the module doc). Parameters as in DeepSeek's official names
    under ``mtp.I.``: a ``Block``'s plus ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``,
    ``norm`` and ``hc_head_{fn,base,scale}``."""

    def __init__(self, args: ModelArgs, depth: int, sinkhorn=None):
        one = block_args(args, depth)
        super().__init__(one, 0, sinkhorn)
        self.block_args = one
        dim, hc = args.dim, args.hc_mult
        self.e_proj = nn.Linear(dim, dim, bias=False)
        self.h_proj = nn.Linear(dim, dim, bias=False)
        self.enorm = RMSNorm(dim, args.norm_eps)
        self.hnorm = RMSNorm(dim, args.norm_eps)
        self.norm = RMSNorm(dim, args.norm_eps)
        self.hc_head_fn = mx.zeros((hc, hc * dim))
        self.hc_head_base = mx.zeros((hc,))
        self.hc_head_scale = mx.ones((1,))

    def make_cache(self) -> LayerCache:
        """An empty KV cache for this block (its own: window ring, compressed rows if any)."""
        a = self.block_args
        return LayerCache(
            a.layer_kind(0), a.window_size, a.head_dim, a.compress_ratios[0], a.index_head_dim
        )

    def forward(
        self, target: Model, h: mx.array, tokens: mx.array, cache: LayerCache, ctx: Step
    ) -> tuple[mx.array, mx.array]:
        """One call over ``L`` rows.

        Args:
            target: the model whose ``embed`` / ``head`` the block shares.
            h: ``(L, hc, dim)`` residual streams in the compute dtype: the target's final
                streams (or, when chaining drafts, this block's own output streams).
            tokens: int32 ``(L,)``: row ``i``'s next token (whose embedding it reads).
            cache: this block's `LayerCache` (advanced by ``L`` rows).
            ctx: `Model.step_for` at the cache's offset.
        Returns:
            ``(logits, streams)``: float32 ``(vocab,)`` logits of the token after the last
            row's ``tokens[-1]``, and the block's output streams ``(L, hc, dim)``.
        """
        e = self.enorm(target.embed(tokens).astype(h.dtype))
        x = self.e_proj(e)[:, None, :] + self.h_proj(self.hnorm(h))
        x = self(x, tokens, cache, ctx)
        return target.head_logits(x, last_only=True, stage=self)[0, -1], x


def attach_mtp(model: Model) -> list[MTPBlock]:
    """Give ``model`` its ``args.n_mtp_layers`` MTP blocks as ``model.mtp`` (parameters
    ``mtp.I.*``, zero-initialized until weights are loaded) and tap its last layer's output
    streams for them (`Model.taps`). Returns the blocks."""
    a = model.args
    impl = choose_sinkhorn(model.sinkhorn_impl)
    blocks = [MTPBlock(a, i, impl) for i in range(a.n_mtp_layers)]
    model.mtp = blocks
    model.add_taps([a.n_layers - 1], rows=a.window_size)
    return blocks
