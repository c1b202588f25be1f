"""Model hyperparameters for DeepSeek V4, read from either config flavour.

Two spellings of the same network exist:

* transformers' ``DeepseekV4Config`` (what ``save_pretrained`` writes): ``hidden_size``,
  ``layer_types`` + ``compress_rates``, ``mlp_layer_types``, nested
  ``rope_parameters = {"main": {...}, "compress": {...}}``, ``partial_rotary_factor``.
* DeepSeek's official configs: the HF-style ``config.json`` published with the weights
  (``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``) and
  the ``inference/config.json`` of the reference code (``dim``, ``n_layers``,
  ``window_size``, ``rope_factor``, ``original_seq_len`` ...).

The per-layer attention schedule always comes from the config; nothing here assumes the
43-layer Flash layout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Model generations this network implements. DeepSeek ships V4 Flash, its updates and V4
# Pro under one model_type; other generations (V3, a future V4.1 ...) differ in structure.
SUPPORTED_MODEL_TYPES = ("deepseek_v4",)

# transformers' layer-type labels (configuration_deepseek_v4.py).
SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"


@dataclass
class ModelArgs:
    """DeepSeek V4 hyperparameters (field names follow DeepSeek's ``inference/model.py``).

    Attributes:
        compress_ratios: per layer, 0 (sliding window only), ``csa_ratio`` (CSA: overlapping
            compressor + Lightning Indexer) or any other positive ratio (HCA). Length
            ``n_layers``; the MTP entries of official configs go to ``mtp_compress_ratios``.
        n_mtp_layers: MTP blocks the checkpoint declares (``num_nextn_predict_layers``).
        mtp_compress_ratios: the attention schedule of the MTP blocks (the official
            ``compress_ratios`` entries past ``n_layers``; Flash: ``(0,)``); empty when the
            config has none (then 0: window-only).
        hash_layers: per layer, True when the MoE is hash-routed (``tid2eid``).
        original_seq_len: YaRN's original context; 0 disables YaRN. YaRN applies only to
            compressed layers (docs/ARCHITECTURE.md §2, "Attention and window").
        quantization: mlx-lm style quantization dict from ``config.json`` (``group_size``,
            ``bits``, optional ``mode`` and per-module overrides keyed by parameter path),
            or None for an unquantized checkpoint.
    """

    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = ()
    csa_ratio: int = 4
    hash_layers: tuple[bool, ...] = ()
    n_routed_experts: int = 256
    n_activated_experts: int = 6
    n_shared_experts: int = 1
    moe_inter_dim: int = 2048
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    n_mtp_layers: int = 0
    mtp_compress_ratios: tuple[int, ...] = ()
    quantization: dict[str, Any] | None = None
    model_type: str = "deepseek_v4"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.compress_ratios = tuple(int(r) for r in self.compress_ratios)
        self.hash_layers = tuple(bool(h) for h in self.hash_layers)
        self.mtp_compress_ratios = tuple(int(r) for r in self.mtp_compress_ratios)
        if len(self.compress_ratios) != self.n_layers:
            raise ValueError(
                f"compress_ratios has {len(self.compress_ratios)} entries for {self.n_layers} layers"
            )
        if len(self.hash_layers) != self.n_layers:
            raise ValueError(
                f"hash_layers has {len(self.hash_layers)} entries for {self.n_layers} layers"
            )
        if self.n_shared_experts not in (0, 1):
            raise ValueError(f"n_shared_experts={self.n_shared_experts}: only 0 or 1 is supported")
        if (self.n_heads * self.head_dim) % self.o_groups:
            raise ValueError("n_heads * head_dim must be divisible by o_groups")
        if self.rope_head_dim % 2 or self.rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(f"rope_head_dim={self.rope_head_dim} must be even and fit every head")

    # -- per-layer helpers -------------------------------------------------
    @property
    def drafter(self) -> str | None:
        """What the checkpoint's ``mtp.*`` tensors are: ``"dspark"`` when the config
        declares ``dspark_block_size`` (Flash 0731: ``num_nextn_predict_layers`` then
        counts DSpark stages, not MTP blocks), ``"mtp"`` when it declares MTP blocks,
        else None."""
        if self.extra.get("dspark_block_size"):
            return "dspark"
        return "mtp" if self.n_mtp_layers > 0 else None

    def layer_kind(self, i: int) -> str:
        """``"window"``, ``"csa"`` or ``"hca"`` for layer ``i`` (from ``compress_ratios``)."""
        r = self.compress_ratios[i]
        if r == 0:
            return "window"
        return "csa" if r == self.csa_ratio else "hca"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that ``from_dict`` reads back (official-style keys)."""
        d = asdict(self)
        d.pop("extra")
        d["compress_ratios"] = list(self.compress_ratios)
        d["hash_layers"] = list(self.hash_layers)
        d["mtp_compress_ratios"] = list(self.mtp_compress_ratios)
        if d["quantization"] is None:
            d.pop("quantization")
        return d

    # -- parsing -----------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Build from a ``config.json`` dict in any supported flavour.

        Accepts transformers ``DeepseekV4Config`` keys, DeepSeek's HF-style keys and
        the official ``inference/config.json`` keys (and this class's own ``to_dict``).

        Raises:
            ValueError: an unsupported ``model_type`` (the message names the supported
                ones), no attention schedule, or inconsistent dimensions.
        """
        check_model_type(cfg)

        def get(*names, default=None):
            return _get(cfg, *names, default=default)

        n_layers = int(get("n_layers", "num_hidden_layers", default=43))
        head_dim = int(get("head_dim", default=512))
        ratios, csa_ratio = _attention_schedule(cfg, n_layers)
        hash_layers = _hash_schedule(cfg, n_layers)

        # Rotary dims.
        rope_head_dim = get("rope_head_dim", "qk_rope_head_dim")
        if rope_head_dim is None:
            prf = get("partial_rotary_factor")
            rope_head_dim = int(head_dim * prf) if prf is not None else 64
        rope_head_dim = int(rope_head_dim)
        rope = _rope(cfg)

        mtp = int(get("n_mtp_layers", "num_nextn_predict_layers", default=0))
        mtp_ratios = cfg.get("mtp_compress_ratios")
        if mtp_ratios is None and cfg.get("layer_types") is None:
            mtp_ratios = (cfg.get("compress_ratios") or [])[n_layers : n_layers + mtp]
        known = {f for f in cls.__dataclass_fields__}
        return cls(
            vocab_size=int(get("vocab_size", default=129280)),
            dim=int(get("dim", "hidden_size", default=4096)),
            n_layers=n_layers,
            n_heads=int(get("n_heads", "num_attention_heads", default=64)),
            head_dim=head_dim,
            rope_head_dim=rope_head_dim,
            q_lora_rank=int(get("q_lora_rank", default=1024)),
            o_groups=int(get("o_groups", default=8)),
            o_lora_rank=int(get("o_lora_rank", default=1024)),
            window_size=int(get("window_size", "sliding_window", default=128)),
            compress_ratios=tuple(ratios),
            csa_ratio=csa_ratio,
            hash_layers=tuple(hash_layers),
            n_routed_experts=int(get("n_routed_experts", default=256)),
            n_activated_experts=int(get("n_activated_experts", "num_experts_per_tok", default=6)),
            n_shared_experts=int(get("n_shared_experts", default=1)),
            moe_inter_dim=int(get("moe_inter_dim", "moe_intermediate_size", default=2048)),
            score_func=str(get("score_func", "scoring_func", default="sqrtsoftplus")),
            route_scale=float(get("route_scale", "routed_scaling_factor", default=1.0)),
            swiglu_limit=float(get("swiglu_limit", default=0.0)),
            norm_eps=float(get("norm_eps", "rms_norm_eps", default=1e-6)),
            **rope,
            index_n_heads=int(get("index_n_heads", default=64)),
            index_head_dim=int(get("index_head_dim", default=128)),
            index_topk=int(get("index_topk", default=512)),
            hc_mult=int(get("hc_mult", default=4)),
            hc_sinkhorn_iters=int(get("hc_sinkhorn_iters", default=20)),
            hc_eps=float(get("hc_eps", default=1e-6)),
            bos_token_id=cfg.get("bos_token_id", 0),
            eos_token_id=cfg.get("eos_token_id", 1),
            max_position_embeddings=int(
                get("max_position_embeddings", "max_seq_len", default=1048576)
            ),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            n_mtp_layers=mtp,
            mtp_compress_ratios=tuple(int(r) for r in mtp_ratios or ()),
            quantization=cfg.get("quantization"),
            model_type=str(cfg.get("model_type", "deepseek_v4")),
            extra={k: v for k, v in cfg.items() if k not in known},
        )


def _get(cfg: dict[str, Any], *names: str, default=None):
    """The first of ``names`` present (and not null) in ``cfg``, else ``default``."""
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return default


def _attention_schedule(cfg: dict[str, Any], n_layers: int) -> tuple[list[int], int]:
    """``(compress ratio per layer, CSA ratio)``: transformers ``layer_types`` win, else the
    official ``compress_ratios`` (whose extra MTP entries are dropped).

    Raises:
        ValueError: no schedule, an unknown layer type, equal CSA/HCA rates, wrong length.
    """
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        rates = {CSA: 4, HCA: 128}
        rates.update(cfg.get("compress_rates") or {})
        for legacy, key in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if cfg.get(legacy) is not None:
                rates[key] = int(cfg[legacy])
        csa_ratio = int(rates[CSA])
        if int(rates[HCA]) == csa_ratio:
            raise ValueError("CSA and HCA compress rates must differ")
        table = {SLIDING: 0, CSA: csa_ratio, HCA: int(rates[HCA])}
        try:
            ratios = [table[t] for t in layer_types[:n_layers]]
        except KeyError as e:
            raise ValueError(f"unknown layer type {e.args[0]!r} in layer_types") from None
    elif cfg.get("compress_ratios") is not None:
        ratios = [int(r) for r in cfg["compress_ratios"][:n_layers]]
        csa_ratio = int(cfg.get("csa_ratio", 4))
    else:
        raise ValueError(
            "config has neither layer_types nor compress_ratios (no attention schedule)"
        )
    if len(ratios) != n_layers:
        raise ValueError(f"attention schedule has {len(ratios)} entries for {n_layers} layers")
    return ratios, csa_ratio


def _hash_schedule(cfg: dict[str, Any], n_layers: int) -> list[bool]:
    """Per layer, whether its MoE is hash-routed."""
    if cfg.get("hash_layers") is not None:
        return [bool(h) for h in cfg["hash_layers"]]
    if cfg.get("mlp_layer_types") is not None:
        return [t == "hash_moe" for t in cfg["mlp_layer_types"][:n_layers]]
    n_hash = int(_get(cfg, "n_hash_layers", "num_hash_layers", default=0))
    return [i < n_hash for i in range(n_layers)]


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """RoPE / YaRN fields of ``ModelArgs``.

    transformers nests ``{"main", "compress"}`` under ``rope_parameters``; DeepSeek's HF
    config has ``rope_scaling``; the inference config has flat ``rope_factor`` /
    ``original_seq_len`` keys. YaRN's attention factor / mscale is deliberately ignored:
    DeepSeek V4 applies the frequency ramp only.
    """
    rope_theta = float(_get(cfg, "rope_theta", default=10000.0))
    compress_theta = float(_get(cfg, "compress_rope_theta", default=160000.0))
    yarn: dict[str, Any] = {}
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict):
        rope_theta = float(rp["main"].get("rope_theta", rope_theta))
        comp = rp.get("compress") or {}
        compress_theta = float(comp.get("rope_theta", compress_theta))
        if comp.get("rope_type", comp.get("type")) == "yarn":
            yarn = comp
    else:
        rs = cfg.get("rope_scaling") or (rp if isinstance(rp, dict) else None) or {}
        if rs.get("rope_type", rs.get("type")) == "yarn":
            yarn = rs
    out = {"rope_theta": rope_theta, "compress_rope_theta": compress_theta}
    if yarn:
        out.update(
            rope_factor=float(yarn.get("factor", 1.0)),
            original_seq_len=int(yarn.get("original_max_position_embeddings", 0)),
            beta_fast=float(yarn.get("beta_fast") or 32),
            beta_slow=float(yarn.get("beta_slow") or 1),
        )
    elif "original_seq_len" in cfg:
        out.update(
            rope_factor=float(_get(cfg, "rope_factor", default=1.0)),
            original_seq_len=int(cfg["original_seq_len"]),
            beta_fast=float(_get(cfg, "beta_fast", default=32)),
            beta_slow=float(_get(cfg, "beta_slow", default=1)),
        )
    else:
        out.update(rope_factor=1.0, original_seq_len=0, beta_fast=32.0, beta_slow=1.0)
    return out


def check_model_type(cfg: dict[str, Any]) -> None:
    """Refuse a ``config.json`` of another model generation.

    A config without ``model_type`` is taken as DeepSeek V4 (DeepSeek's own
    ``inference/config.json`` has none).

    Raises:
        ValueError: naming the model type found and the supported ones.
    """
    mt = cfg.get("model_type", SUPPORTED_MODEL_TYPES[0])
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {mt!r} is not supported: ds4mlx runs DeepSeek V4 checkpoints "
            f"(model_type {', '.join(map(repr, SUPPORTED_MODEL_TYPES))}: V4 Flash, its updates "
            "and V4 Pro); other generations have a different network"
        )
