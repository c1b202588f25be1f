"""``Engine``: the loaded model, its tokenizer, its identity and the live session."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ds4mlx.engine.session import Session
from ds4mlx.engine.speculative import Speculation

# Default context when the caller does not choose one: one figure for the engine and the
# loader's fit check.
from ds4mlx.model.fit import DEFAULT_CTX_CPU, DEFAULT_CTX_GPU, kv_bytes
from ds4mlx.model.identity import checkpoint_identity
from ds4mlx.tokenizer import Tokenizer


@dataclass(frozen=True)
class QuantInfo:
    """How a loaded model is stored: routed experts and everything else.

    Attributes:
        experts: formats of the routed-expert weights, sorted (``"q2"``, ``"q4"``:
            affine bits; ``"mxfp4"``; ``"f32"``/``"bf16"``/``"f16"``: unquantized).
        other: the same for every other quantizable layer.
    ``str()`` is the display form: ``"experts=q4 other=q8"``, or ``"f32"`` when both
    parts agree.
    """

    experts: tuple[str, ...]
    other: tuple[str, ...]

    @property
    def expert_bits(self) -> int | None:
        """Affine bits of the routed experts when they all share one, else None (mxfp4,
        unquantized or mixed experts)."""
        if len(self.experts) == 1 and self.experts[0][:1] == "q" and self.experts[0][1:].isdigit():
            return int(self.experts[0][1:])
        return None

    def __str__(self) -> str:
        exp = "+".join(self.experts) or "none"
        oth = "+".join(self.other) or "none"
        return exp if exp == oth else f"experts={exp} other={oth}"


def describe_quant(model) -> QuantInfo:
    """The `QuantInfo` of ``model``, derived from the loaded modules (``bits``/``mode``
    of quantized layers, else the dtype of the weights), so it describes what runs."""
    buckets: dict[str, set[str]] = {"experts": set(), "other": set()}
    for name, mod in model.named_modules():
        if name.startswith("mtp."):
            continue  # the drafter: not part of what the target state depends on
        routed = ".experts" in f".{name}" and "shared" not in name
        bucket = "experts" if routed else "other"
        bits = getattr(mod, "bits", None)
        if bits is not None and hasattr(mod, "scales"):
            mode = getattr(mod, "mode", "affine")
            buckets[bucket].add(f"q{bits}" if mode == "affine" else mode)
        elif hasattr(mod, "to_quantized") and isinstance(mod.get("weight"), mx.array):
            # Quantizable layers only: small float tables such as the router stay
            # unquantized in every checkpoint and would only add noise here.
            buckets[bucket].add(_dtype_name(mod["weight"].dtype))
    # Expert weights may be raw parameters of a container module rather than Linear
    # layers: fall back to parameter dtypes under "experts".
    if not buckets["experts"]:
        from mlx.utils import tree_flatten

        for name, p in tree_flatten(model.parameters()):
            if ".experts." in f".{name}" and "shared" not in name and p.ndim >= 2:
                if name.endswith(".scales"):
                    continue
                buckets["experts"].add(
                    _dtype_name(p.dtype) if p.dtype != mx.uint32 else "quantized"
                )
    return QuantInfo(tuple(sorted(buckets["experts"])), tuple(sorted(buckets["other"])))


def _dtype_name(dt) -> str:
    return {mx.float32: "f32", mx.bfloat16: "bf16", mx.float16: "f16"}.get(dt, str(dt))


def _model_identity(path: Path, config: dict, quant: str, layout: str = "") -> str:
    """Stable id of a checkpoint's content: config, the weights
    (``ds4mlx.model.identity.checkpoint_identity``: their digest and sampled bytes of
    every tensor), the quantization loaded and, when split across ranks, the split.
    ``"ds4-<32 hex>"`` (128 bits)."""
    h = hashlib.sha256()
    h.update(json.dumps(config, sort_keys=True).encode())
    h.update(checkpoint_identity(path).encode())
    h.update(quant.encode())
    if layout:
        h.update(layout.encode())
    return "ds4-" + h.hexdigest()[:32]


def default_ctx_size(max_positions: int | None) -> int:
    """The context size used when none is requested (see DEFAULT_CTX_*)."""
    cap = DEFAULT_CTX_GPU if mx.default_device() == mx.gpu else DEFAULT_CTX_CPU
    return min(max_positions, cap) if max_positions else cap


class Engine:
    """A loaded model and tokenizer, plus the single live session.

    Attributes:
        path: the checkpoint directory.
        model: the network (``ds4mlx.model.network.Model``).
        args: its ``ModelArgs``.
        config: the raw ``config.json`` dict.
        tokenizer: ``Tokenizer``.
        ctx_size: context size in tokens.
        identity: ``"ds4-<32 hex>"``, from the weights' content, config and
            quantization (``ds4mlx.model.identity``); keys disk KV files.
        quant: the `QuantInfo`; ``quant_desc`` its display form, e.g.
            ``"experts=q2 other=q8"``.
        session: the live ``Session``.
        speculation: the speculative-decoding setting and totals
            (``ds4mlx.engine.speculative.Speculation``; ``off`` unless the caller sets
            it).
    """

    def __init__(
        self, model, args, tokenizer: Tokenizer, *, path, config, ctx_size=None, layout=""
    ):
        self.path = Path(path)
        self.model = model
        self.args = args
        self.config = config
        self.tokenizer = tokenizer
        self.max_positions: int | None = max_positions_of(args, config)
        if ctx_size is None:
            ctx_size = default_ctx_size(self.max_positions)
        check_ctx_size(ctx_size, self.max_positions)
        self.ctx_size = int(ctx_size)
        self.quant = describe_quant(model)
        self.quant_desc = str(self.quant)
        # ``layout``: how the layers are split across ranks ("" for one process).
        self.layout = layout
        self.identity = _model_identity(self.path, config, self.quant_desc, layout)
        self._last_logits = _last_logits_fn(model)
        # Every row's logits ``(L, vocab)`` float32: scoring a prompt (`Session.prefill`).
        self._row_logits = lambda x, cache: model(x, cache)[0].astype(mx.float32)
        self.speculation = Speculation()
        self.session = Session(self)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        ctx_size: int | None = None,
        dtype=None,
        sessions: int = 1,
        speculative: str = "off",
    ) -> Engine:
        """Load the checkpoint directory ``path`` (config.json, *.safetensors, tokenizer).

        Args:
            path: checkpoint directory.
            ctx_size: context size in tokens; default ``default_ctx_size`` (the model's
                limit capped at 65536 on a GPU, 32768 on the CPU).
            dtype: compute dtype of unquantized weights; default bfloat16 on a GPU and
                float32 on the CPU, where MLX has no fast half-precision arithmetic.
            sessions: resident session states the caller keeps (``serve --sessions``),
                counted by the fit check.
            speculative: the ``--speculative`` mode; ``mtp`` and ``auto`` also load the
                checkpoint's MTP drafter when it has one (counted by the fit check);
                ``dspark`` and ``auto`` count its DSpark drafter (loaded by
                ``speculation_for``); the other modes never read them. Set
                ``speculation`` afterwards (``ds4mlx.engine.speculative.speculation_for``).
        Raises:
            ds4mlx.model.loading.LoadError: unreadable or unsupported checkpoint.
            ds4mlx.tokenizer.TokenizerError: unusable tokenizer.
            ValueError: ``ctx_size`` out of range.
        """
        from ds4mlx.model.loading import load_model

        path = Path(path)
        if dtype is None:
            dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
        # The fit check (weights + KV at this context vs device memory) runs before any
        # weight is read.
        model, args = load_model(
            str(path),
            dtype=dtype,
            ctx_size=ctx_size,
            sessions=sessions,
            mtp=speculative in ("mtp", "auto"),
            dspark=speculative in ("dspark", "auto"),
        )
        with open(path / "config.json") as f:
            config = json.load(f)
        return cls(model, args, Tokenizer.load(path), path=path, config=config, ctx_size=ctx_size)

    @property
    def distributed(self) -> dict[str, Any] | None:
        """How the model is split across ranks, as plain values (``/health``, the
        banner): ``{"mode": "pipeline", "ranks": 2, "layers": ["0-2", "2-4"]}`` (each
        rank's layer range, rank 0 first) or ``{"mode": "tensor", "ranks": 2}``; None
        for one process."""
        if not self.layout:
            return None
        mode, _, rest = self.layout.partition(":")
        if mode == "pipeline":
            layers = rest.split(",")
            return {"mode": mode, "ranks": len(layers), "layers": layers}
        return {"mode": mode, "ranks": int(rest)}

    def kv_bytes_at(self, n_tokens: int) -> int:
        """KV-cache bytes one session allocates at ``n_tokens`` tokens, in the compute
        dtype (``ds4mlx.model.fit.kv_bytes``: the fit check's figure)."""
        dtype_bytes = 2 if mx.default_device() == mx.gpu else 4
        return kv_bytes(self.args, n_tokens, dtype_bytes)

    def new_session(self) -> Session:
        """A further, independent session on the same weights (resident states of the
        prompt cache, tests, benchmarks). Call on the inference thread."""
        return Session(self)


def check_ctx_size(ctx_size: int, max_positions: int | None) -> None:
    """Raises ValueError (the message) for a context size below 1 or beyond the model's
    positions (``max_positions``, None: unbounded)."""
    if ctx_size < 1:
        raise ValueError(f"ctx_size must be >= 1, got {ctx_size}")
    if max_positions and ctx_size > max_positions:
        raise ValueError(f"ctx_size {ctx_size} exceeds the model's limit of {max_positions} tokens")


def max_positions_of(args, config: dict) -> int | None:
    """The model's positions from its ``ModelArgs`` (or None) or ``config.json``."""
    for obj in (args, config):
        for name in ("max_position_embeddings", "max_seq_len"):
            v = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
            if v:
                return int(v)
    return None


def _last_logits_fn(model) -> Callable[[mx.array, list], mx.array]:
    """``f(tokens (1, L) int32, cache) -> float32 (vocab,)`` logits after the last token.

    Uses the network's ``last_only`` switch when it has one, so a prefill chunk runs the
    vocab projection (129280 × 4096 for Flash) on one row instead of ``L``.
    """
    try:
        last_only = "last_only" in inspect.signature(model.__call__).parameters
    except (TypeError, ValueError):
        last_only = False
    if last_only:
        return lambda x, cache: model(x, cache, last_only=True)[0, -1].astype(mx.float32)
    return lambda x, cache: model(x, cache)[0, -1].astype(mx.float32)
