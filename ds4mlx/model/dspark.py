"""The DSpark drafter of DeepSeek V4 Flash 0731 (``mtp.*`` tensors), in MLX.

What is established from public code and what is inferred: docs/KERNELS.md, "DSpark".

The drafter proposes a block of ``n`` tokens (``n`` <= ``dspark_block_size``) to follow
the token ``t0`` that the target is about to be fed at position ``P``:

* **Context.** For every position the target was fed, the outputs of the target layers
  ``dspark_target_layer_ids`` (each averaged over its ``hc_mult`` streams) are concatenated
  in the listed order: ``(len(ids) * dim)`` features per position. ``mtp.0.main_proj`` then
  ``mtp.0.main_norm`` turn them into context rows; the last ``window_size`` of them
  (positions ``P - S … P - 1``) are ``main_x`` ``(S, dim)``, what every stage attends to.
* **Query block.** Tokens ``t0, noise, …, noise`` (``n`` rows, ``dspark_noise_token_id``)
  at positions ``P … P + n - 1``, embedded with the target's embedding into ``hc_mult``
  streams, run through the stages ``mtp.0 … mtp.{N-1}``. A stage is a V4 decoder block
  (mHC around attention and around the MoE, names as in ``layers.N``) of a window-only
  layer (``rope_theta``, no YaRN; score-routed, not hash-routed MoE) whose attention is a
  cross attention: queries from the block rows, one shared K=V head over the context rows
  (``wkv`` + ``kv_norm`` of ``main_x``, roped at their own positions) followed by the block's
  own K=V rows; no mask (the block sees itself whole, the context is all in the past), the
  sink in the softmax, output de-roped as in the target.
* **Head.** The last stage's ``hc_head_*`` collapses the streams, its ``norm`` normalizes
  and the target's ``head`` projects: base logits ``(n, vocab)``, row ``i`` for the draft
  at position ``P + i + 1``.
* **Markov correction.** Draft ``i`` is chosen from ``base[i] + markov_w2(markov_w1[prev])``
  where ``prev`` is ``t0`` for ``i = 0`` and draft ``i - 1`` after it
  (``mtp.{N-1}.markov_head.markov_w{1,2}``, rank ``dspark_markov_rank``).

The target layers' outputs come from the target's taps (`network.Model.add_taps`, kept
per session by ``ds4mlx.engine.drafts``, which follows the session's accepted tokens and
drops them on reset / restore); ``ds4mlx.engine.dspark`` turns them into context rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention import Attention, RMSNorm
from .config import ModelArgs
from .errors import LoadError
from .mhc import hc_head_fn
from .network import Block
from .rope import apply_rope, norm_rope, rope_tables
from .sinkhorn import choose_sinkhorn


@dataclass(frozen=True)
class DSparkConfig:
    """The drafter's ``config.json`` fields.

    Attributes:
        block_size: ``dspark_block_size``, the most tokens one proposal drafts.
        target_layers: ``dspark_target_layer_ids``, target layers whose outputs form the
            context (0-based, strictly increasing).
        markov_rank: ``dspark_markov_rank``.
        noise_token: ``dspark_noise_token_id``, the id filling the block after ``t0``.
        n_stages: decoder stages (``mtp.0 … mtp.{n_stages-1}``).
    """

    block_size: int
    target_layers: tuple[int, ...]
    markov_rank: int
    noise_token: int
    n_stages: int

    @classmethod
    def from_config(cls, cfg: dict, args: ModelArgs, n_stages: int) -> DSparkConfig | None:
        """The fields of ``cfg`` (None when it declares no DSpark drafter).

        Raises:
            LoadError: a field missing or out of range (named).
        """
        if cfg.get("dspark_block_size") in (None, 0):
            return None
        try:
            c = cls(
                int(cfg["dspark_block_size"]),
                tuple(int(i) for i in cfg["dspark_target_layer_ids"]),
                int(cfg["dspark_markov_rank"]),
                int(cfg["dspark_noise_token_id"]),
                int(n_stages),
            )
        except KeyError as e:
            raise LoadError(f"config.json declares dspark_block_size but not {e}") from e
        except (TypeError, ValueError) as e:
            raise LoadError(f"config.json: a dspark_* field is not an integer: {e}") from e
        layers = c.target_layers
        if c.block_size < 1 or c.markov_rank < 1 or c.n_stages < 1:
            raise LoadError(f"config.json: DSpark sizes must be positive: {c}")
        if not layers or list(layers) != sorted(set(layers)) or not 0 <= layers[0]:
            raise LoadError(f"dspark_target_layer_ids {list(layers)} must increase strictly")
        if layers[-1] >= args.n_layers:
            raise LoadError(
                f"dspark_target_layer_ids {list(layers)}: the model has {args.n_layers} layers"
            )
        if not 0 <= c.noise_token < args.vocab_size:
            raise LoadError(f"dspark_noise_token_id {c.noise_token} is outside the vocabulary")
        return c

    def to_config(self) -> dict:
        """The ``config.json`` fields (``num_nextn_predict_layers`` = stages)."""
        return {
            "dspark_block_size": self.block_size,
            "dspark_target_layer_ids": list(self.target_layers),
            "dspark_markov_rank": self.markov_rank,
            "dspark_noise_token_id": self.noise_token,
            "num_nextn_predict_layers": self.n_stages,
        }


class _Rows:
    """RoPE tables of one proposal: the context rows' positions and the block's."""

    def __init__(self, inv_freq, start: int, S: int, n: int, head_dim: int):
        self.ctx = rope_tables(inv_freq, np.arange(start, start + S), head_dim)
        self.block = rope_tables(inv_freq, np.arange(start + S, start + S + n), head_dim)


class ContextAttention(Attention):
    """A stage's attention: the V4 window-layer parameters, attending from the block rows
    to the context rows and the block itself (see the module doc)."""

    def __call__(self, x: mx.array, main_x: mx.array, rows: _Rows) -> mx.array:
        """``x`` ``(n, dim)`` block rows (``attn_norm``-ed), ``main_x`` ``(S, dim)`` ->
        ``(n, dim)``."""
        n = x.shape[0]
        cos, sin, nsin = rows.block
        _, q, kv = self._project(x, cos, sin)
        cc, cs, _ = rows.ctx
        ctx_kv = norm_rope(self.wkv(main_x), self.kv_norm.weight, self.kv_norm.eps, cc, cs)
        o = self._sdpa(q, mx.concatenate([ctx_kv.astype(kv.dtype), kv]), None)
        o = apply_rope(o, cos[:, None], nsin[:, None])
        o = self.wo_a(o.reshape(n, self.groups, -1)).reshape(n, -1)
        return self.wo_b(o)


class Markov(nn.Module):
    """``markov_w1`` ``(vocab, rank)`` embedding, ``markov_w2`` ``(vocab, rank)`` projection."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)

    def __call__(self, prev: mx.array) -> mx.array:
        """int ``(m,)`` previous tokens -> float32 logit corrections ``(m, vocab)``."""
        return self.markov_w2(self.markov_w1(prev)).astype(mx.float32)


class Stage(Block):
    """One DSpark stage: a V4 block with `ContextAttention`; the first stage also holds
    ``main_proj`` / ``main_norm``, the last ``hc_head_*``, ``norm`` and the Markov head."""

    def __init__(self, args: ModelArgs, cfg: DSparkConfig, index: int, sinkhorn):
        super().__init__(args, 0, sinkhorn)
        self.attn = ContextAttention(args, 0)
        if index == 0:
            width = len(cfg.target_layers) * args.dim
            self.main_proj = nn.Linear(width, args.dim, bias=False)
            self.main_norm = RMSNorm(args.dim, args.norm_eps)
        if index == cfg.n_stages - 1:
            self.hc_head_fn = mx.zeros((args.hc_mult, args.hc_mult * args.dim))
            self.hc_head_base = mx.zeros((args.hc_mult,))
            self.hc_head_scale = mx.ones((1,))
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.markov_head = Markov(args.vocab_size, cfg.markov_rank)


class DSpark(nn.Module):
    """The drafter (see the module doc). Parameters are named as in the checkpoint
    (``mtp.S.…``); the embedding and head are the target's (`attach`)."""

    def __init__(self, args: ModelArgs, cfg: DSparkConfig):
        super().__init__()
        self.cfg = cfg
        sargs = dataclasses.replace(args, n_layers=1, compress_ratios=(0,), hash_layers=(False,))
        self.args = sargs
        impl = choose_sinkhorn()
        self.mtp = [Stage(sargs, cfg, i, impl) for i in range(cfg.n_stages)]
        # Not a child module: the target's parameters are not the drafter's.
        object.__setattr__(self, "_target", None)

    # ---- context features

    def attach(self, target) -> None:
        """Share ``target``'s (a ``network.Model``) embedding and head, and have it tap the
        context layers' outputs for the last ``window_size`` positions."""
        object.__setattr__(self, "_target", target)
        target.add_taps(self.cfg.target_layers, rows=self.args.window_size)

    def context(self, outs: list[mx.array]) -> mx.array:
        """Context rows ``(m, dim)`` of ``m`` positions from the target layers' output
        streams ``(m, hc, dim)`` there (one per ``target_layers`` entry, in order)."""
        first = self.mtp[0]
        feats = mx.concatenate([o.mean(axis=1) for o in outs], axis=-1)
        return first.main_norm(first.main_proj(feats))

    # ---- proposal

    def base_logits(self, main_x: mx.array, start: int, t0: int, n: int) -> mx.array:
        """Float32 ``(n, vocab)`` base logits of a block ``t0, noise …`` that follows the
        context rows ``main_x`` ``(S, dim)`` of positions ``start … start + S - 1``."""
        target, a, last = self._target, self.args, self.mtp[-1]
        tokens = mx.array([t0] + [self.cfg.noise_token] * (n - 1), dtype=mx.int32)
        step = _Rows(target._inv_main, start, main_x.shape[0], n, a.head_dim)
        x = target.embed_streams(tokens)
        for stage in self.mtp:
            x = stage(x, tokens, main_x, step)
        y = hc_head_fn(a.hc_eps, a.norm_eps)(
            x, last.hc_head_fn, last.hc_head_scale, last.hc_head_base
        )
        return target.head(last.norm(y.astype(x.dtype))).astype(mx.float32)

    def markov(self, prev: mx.array) -> mx.array:
        """Logit corrections ``(m, vocab)`` after the previous tokens ``prev`` ``(m,)``."""
        return self.mtp[-1].markov_head(prev)
