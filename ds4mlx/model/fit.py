"""Will this checkpoint run here? Weights + KV + working memory vs device memory.

Checked before any weight is read (only ``config.json`` and the safetensors headers), so a
checkpoint that cannot fit is refused in a second instead of swapping a Mac to a halt:

* **weights** — every tensor the loader keeps, at the size it will have in memory (a bf16
  float tensor loaded for float32 compute doubles; routed experts stored per expert need
  one layer's worth of extra room while they are stacked);
* **KV** — per layer the raw window ring, the compressed rows of ``ctx`` tokens (CSA rows
  and their indexer rows, HCA rows) and the compressor frontier, in the compute dtype,
  times the number of resident session states;
* **working memory** — one prefill chunk's activations (hyper-connection streams, query
  heads, attention score blocks, expert activations) and the logits.

The device budget is Metal's recommended working set on a Mac (what the GPU may keep
resident without paging), else physical RAM (or a lower cgroup limit). ``memory_limit`` /
``DS4MLX_MEMORY_LIMIT`` override it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace

from .checkpoint import TensorInfo, scan
from .config import ModelArgs
from .errors import FitError
from .names import KEEP_F32, PER_EXPERT, official_name
from .units import format_bytes, parse_size

MEMORY_ENV = "DS4MLX_MEMORY_LIMIT"
PREFILL_CHUNK = 512  # tokens per prefill forward (the engine's default chunk)
SCORE_BUDGET = 1 << 25  # elements of one transient attention-score block (network.py)
# The default context when none is asked for: the model's limit capped per device.
DEFAULT_CTX_GPU = 65536
DEFAULT_CTX_CPU = 32768


# Tensors a tensor split (``--distributed tensor``) slices across the ranks.
_TENSOR_SPLIT = re.compile(
    r"^layers\.\d+\.(attn\.(wq_b|wo_a|wo_b|attn_sink)|ffn\.(experts|shared_experts)\.)"
)
_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class RankPart:
    """What one rank of a split model holds (``--distributed``), for its own fit check.

    Attributes:
        rank: the rank; ``world``: the number of ranks.
        layers: the layers it holds (a pipeline rank's range, every layer in tensor mode).
        ends: whether it holds the embedding, the head and the final norms (rank 0 of a
            pipeline split; every rank of a tensor split).
        split: the share of every head- and expert-split tensor it holds is ``1/split``
            (the rank count in tensor mode, else 1).
    """

    rank: int
    world: int
    layers: range
    ends: bool
    split: int = 1

    def share(self, name: str) -> float:
        """The fraction of tensor ``name`` (official naming) this rank holds."""
        m = _LAYER.match(name)
        if m is None:
            return 1.0 if self.ends else 0.0
        if int(m.group(1)) not in self.layers:
            return 0.0
        return 1 / self.split if _TENSOR_SPLIT.match(name) else 1.0

    def describe(self) -> str:
        first, last = self.layers.start, self.layers.stop - 1
        return f"rank {self.rank} of {self.world} (layers {first}-{last})"


@dataclass
class FitReport:
    """Memory estimate of one checkpoint at one context size, in bytes.

    Attributes:
        weights: parameters as held in memory after loading.
        kv_per_session: KV cache of one session state at ``ctx_size`` tokens.
        sessions: resident session states.
        working: transient memory of one prefill chunk and the logits.
        available: what the device can use (see ``source``).
        source: where ``available`` comes from ("Metal recommended working set", "RAM",
            "cgroup memory limit", "memory limit override").
        ctx_size: context size in tokens.
        suggestions: flags that would make it fit (empty when it fits).
    """

    weights: int
    kv_per_session: int
    sessions: int
    working: int
    available: int
    source: str
    ctx_size: int
    suggestions: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.weights + self.kv_per_session * self.sessions + self.working

    @property
    def fits(self) -> bool:
        return self.total <= self.available

    def describe(self) -> str:
        """One line: ``weights … + KV … (S sessions × … at ctx N) + working … = total of
        available (source)``: the KV term is the total of every resident state, so the
        terms add up to the total."""
        many = "s" if self.sessions != 1 else ""
        return (
            f"weights {format_bytes(self.weights)} + "
            f"KV {format_bytes(self.kv_per_session * self.sessions)} ({self.sessions} "
            f"session{many} × {format_bytes(self.kv_per_session)} at ctx {self.ctx_size}) "
            f"+ working {format_bytes(self.working)} = {format_bytes(self.total)} of "
            f"{format_bytes(self.available)} ({self.source})"
        )


def device_memory() -> tuple[int, str]:
    """``(bytes, source)`` the device can use for weights and activations.

    On Apple silicon with Metal: ``max_recommended_working_set_size`` (wired GPU memory
    beyond it pages). Elsewhere: physical RAM, or the cgroup limit when that is lower.
    """
    import mlx.core as mx

    if mx.metal.is_available():
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        size = info.get("max_recommended_working_set_size") or info.get("memory_size")
        if size:
            return int(size), "Metal recommended working set"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit() and int(limit) < ram:
            return int(limit), "cgroup memory limit"
    except OSError:
        pass
    return int(ram), "RAM"


def memory_budget(memory_limit: int | str | None = None) -> tuple[int, str]:
    """The memory the fit check compares against: ``memory_limit``, else ``$DS4MLX_MEMORY_LIMIT``,
    else ``device_memory()``.

    Raises:
        ValueError: an unparsable limit.
    """
    if memory_limit is None and os.environ.get(MEMORY_ENV):
        try:
            return parse_size(os.environ[MEMORY_ENV]), "memory limit override"
        except ValueError as e:  # said as the variable's, not as the model's fault
            raise ValueError(f"${MEMORY_ENV}: {e}") from None
    if memory_limit is not None:
        return parse_size(memory_limit), "memory limit override"
    return device_memory()


def default_ctx(args: ModelArgs, gpu: bool) -> int:
    """Context used when none is requested: the model's limit capped per device."""
    cap = DEFAULT_CTX_GPU if gpu else DEFAULT_CTX_CPU
    return min(args.max_position_embeddings, cap) if args.max_position_embeddings else cap


def kv_bytes(args: ModelArgs, ctx: int, dtype_bytes: int, layers: range | None = None) -> int:
    """KV cache bytes of one session at ``ctx`` tokens (allocated capacity, compute dtype),
    of ``layers`` only when given (a pipeline rank's).

    Compressed-row buffers grow by half their size, so up to 1.5× the rows are allocated.
    """
    total = 0
    for i in range(args.n_layers) if layers is None else layers:
        total += args.window_size * args.head_dim  # raw window ring
        r = args.compress_ratios[i]
        if not r:
            continue
        coff = 2 if args.layer_kind(i) == "csa" else 1
        rows = ctx // r
        cap = max(rows + rows // 2, rows + 256) if rows else 0
        # Rows + frontier (pending kv/score of one block, previous block with overlap).
        total += (
            cap * args.head_dim + 2 * r * coff * args.head_dim + (coff - 1) * 2 * r * args.head_dim
        )
        if coff == 2:  # the Lightning Indexer keeps its own compressed rows and frontier
            d = args.index_head_dim
            total += cap * d + 4 * r * d + 2 * r * d
    return total * dtype_bytes


def working_bytes(args: ModelArgs, dtype_bytes: int, chunk: int = PREFILL_CHUNK) -> int:
    """Transient bytes of one prefill forward of ``chunk`` tokens plus the logits.

    Counts the live tensors of the largest step: hyper-connection streams (float32, a few
    copies), query heads, one attention-score block (the network caps it at
    ``SCORE_BUDGET`` elements; scores, exponentials and probabilities coexist), the routed
    experts' gathered inputs and activations, and the float32 logits of the last row.
    """
    f32 = 4
    streams = 4 * chunk * args.hc_mult * args.dim * f32
    queries = 3 * chunk * args.n_heads * args.head_dim * dtype_bytes
    scores = 3 * min(SCORE_BUDGET, chunk * args.n_heads * (args.window_size + chunk)) * f32
    k = args.n_activated_experts
    experts = chunk * k * (args.dim + 3 * args.moe_inter_dim) * dtype_bytes
    logits = 2 * args.vocab_size * f32
    return streams + queries + scores + experts + logits


def loaded_weight_bytes(
    tensors: dict[str, TensorInfo],
    dtype_bytes: int,
    mtp: bool = False,
    part: RankPart | None = None,
) -> tuple[int, int]:
    """``(bytes held after loading, extra bytes while stacking one per-expert tensor)``,
    of what ``part`` holds when given (one rank of a split model).

    Float tensors take the compute dtype (float32 for the precision-critical small ones);
    packed and integer tensors keep their size. ``mtp.*`` tensors count only with ``mtp``
    (the drafter, MTP or DSpark, is loaded).
    """
    held = 0
    stacks: dict[tuple[str, str], int] = {}
    for t in tensors.values():
        name = official_name(t.name, mtp)
        share = 1.0 if name is None or part is None else part.share(name)
        if name is None or not share:
            continue
        if t.is_float:
            size = t.numel * (4 if KEEP_F32.search(name) else dtype_bytes)
        else:
            size = t.nbytes
        size = int(size * share)
        held += size
        if m := PER_EXPERT.match(name):
            key = (m.group(1), m.group(3) + m.group(4))
            stacks[key] = stacks.get(key, 0) + size
    return held, max(stacks.values(), default=0)


def _expert_bytes(tensors: dict[str, TensorInfo]) -> int:
    total = 0
    for t in tensors.values():
        name = official_name(t.name)
        if name and ".ffn.experts." in name:
            total += t.nbytes
    return total


def _max_ctx(args, fixed: int, available: int, sessions: int, dtype_bytes: int, ctx: int) -> int:
    """Largest context ≤ ``ctx`` whose KV still fits next to ``fixed`` bytes (0 if none)."""
    if fixed + sessions * kv_bytes(args, 1, dtype_bytes) > available:
        return 0
    lo, hi = 1, ctx
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fixed + sessions * kv_bytes(args, mid, dtype_bytes) <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _suggestions(report: FitReport, args, tensors, dtype_bytes: int) -> list[str]:
    """Flags that would make it fit: a smaller ``--ctx``, fewer sessions, lower expert bits."""
    out = []
    fixed = report.weights + report.working
    best = _max_ctx(args, fixed, report.available, report.sessions, dtype_bytes, report.ctx_size)
    if best >= 1024:
        out.append(f"--ctx {best // 1024 * 1024} (the largest context that fits)")
    if report.sessions > 1:
        one = _max_ctx(args, fixed, report.available, 1, dtype_bytes, report.ctx_size)
        if one >= 1024:
            out.append(f"1 resident session at --ctx {min(one, report.ctx_size) // 1024 * 1024}")
    # Re-converting the routed experts: bits + 32/64 per weight (bf16 scale and bias per 64).
    params = routed_expert_params(args)
    rest = report.total - _expert_bytes(tensors)
    for bits in (4, 3, 2):
        size = rest + params * (bits + 0.5) / 8
        if size <= report.available:
            out.append(
                f"a lower-bit conversion: ds4mlx convert SRC DST --expert-bits {bits} "
                f"(≈ {format_bytes(size)} in all at this context)"
            )
            break
    else:
        out.append("even 2-bit routed experts do not fit: this machine needs more memory")
    return out


def check_fit(
    path: str,
    ctx_size: int | None = None,
    sessions: int = 1,
    memory_limit: int | str | None = None,
    *,
    dtype_bytes: int | None = None,
    gpu: bool | None = None,
    mtp: bool = False,
    part: RankPart | None = None,
) -> FitReport:
    """Estimate the memory of running ``path`` and refuse when it exceeds the budget.

    Reads ``config.json`` and the safetensors headers only.

    Args:
        path: checkpoint directory.
        ctx_size: context in tokens (default: ``default_ctx``).
        sessions: session states kept resident (each has its own KV).
        memory_limit: bytes or a size string overriding the device budget (else
            ``$DS4MLX_MEMORY_LIMIT``, else ``device_memory()``).
        dtype_bytes: bytes per element of the compute dtype (default: 2 on a GPU, 4 on the
            CPU, as the engine chooses).
        gpu: whether MLX runs on a GPU (default: ``mx.default_device()``).
        mtp: the drafter's ``mtp.*`` weights (MTP blocks or DSpark stages,
            ``ModelArgs.drafter``) are loaded too (counted).
        part: what this rank holds of a split model (its weights and its layers' KV are
            counted, against this machine's budget), or None for the whole model.

    Returns:
        the ``FitReport`` (when it fits).

    Raises:
        FitError: it does not fit; the message has the numbers and the flags that would help.
        ValueError: a bad config or memory limit.
    """
    from .checkpoint import read_config

    if gpu is None:
        import mlx.core as mx

        gpu = mx.default_device() == mx.gpu
    if dtype_bytes is None:
        dtype_bytes = 2 if gpu else 4
    args = ModelArgs.from_dict(read_config(path))
    ctx = int(ctx_size) if ctx_size else default_ctx(args, gpu)
    tensors = scan(path)
    held, stacking = loaded_weight_bytes(tensors, dtype_bytes, mtp, part)
    available, source = memory_budget(memory_limit)
    report = FitReport(
        weights=held,
        kv_per_session=kv_bytes(args, ctx, dtype_bytes, None if part is None else part.layers),
        sessions=max(1, int(sessions)),
        working=working_bytes(args, dtype_bytes) + stacking,
        available=available,
        source=source,
        ctx_size=ctx,
    )
    if not report.fits and part is not None:
        raise FitError(f"{part.describe()} of {path} does not fit: {report.describe()}", report)
    if not report.fits:
        report.suggestions = _suggestions(report, args, tensors, dtype_bytes)
        hint = "; ".join(report.suggestions)
        raise FitError(
            f"{path} does not fit: {report.describe()}. Would fit with: {hint}. "
            f"(Override the budget with --memory-limit or {MEMORY_ENV}.)",
            report,
        )
    return report


DEFAULT_SESSIONS = 4  # resident states by default, when memory holds them


def routed_expert_params(args: ModelArgs) -> int:
    """Routed-expert weights of the network (three matrices per expert and layer)."""
    return args.n_layers * args.n_routed_experts * 3 * args.dim * args.moe_inter_dim


# ``ds4mlx convert`` builds of DeepSeek V4 Flash users pick from (docs/WEIGHTS.md, "Picking
# bits for a Mac"): (flags, routed-expert bits per weight, bytes of everything else). The
# sizes are computed from the format arithmetic, not measured on a converted checkpoint.
FLASH_BUILDS = (
    ("--expert-mode mxfp4 --bits mxfp8", 4.25, 8.5e9),
    ("--expert-bits 4 --bits 8", 4.5, 7.8e9),
    ("--expert-bits 3 --bits mxfp8", 3.5, 8.5e9),
    ("--expert-bits 2 --bits mxfp8", 2.5, 8.5e9),
    ("--expert-bits 2 --group-size 128 --bits mxfp8", 2.25, 8.5e9),
    ("--expert-bits 2 --group-size 128 --bits 4", 2.25, 4.1e9),
)


def flash_builds(
    available: int, source: str, ctx_size: int = DEFAULT_CTX_GPU, dtype_bytes: int = 2
) -> list[tuple[str, FitReport]]:
    """The fit check's arithmetic for each ``FLASH_BUILDS`` entry before anything is
    downloaded: ``(flags, report)`` with weights from the build's bits, KV and working
    memory of DeepSeek V4 Flash (43 layers) at ``ctx_size`` in a ``dtype_bytes`` compute
    dtype (2: bf16 on a Mac), one session, against ``available`` bytes."""
    from .synth import flash_args

    args = flash_args(43)
    experts = routed_expert_params(args)
    out = []
    for flags, bits, rest in FLASH_BUILDS:
        report = FitReport(
            weights=int(experts * bits / 8 + rest),
            kv_per_session=kv_bytes(args, ctx_size, dtype_bytes),
            sessions=1,
            working=working_bytes(args, dtype_bytes),
            available=available,
            source=source,
            ctx_size=ctx_size,
        )
        out.append((flags, report))
    return out


def sessions_that_fit(
    path: str,
    ctx_size: int | None = None,
    memory_limit: int | str | None = None,
    *,
    cap: int = DEFAULT_SESSIONS,
    dtype_bytes: int | None = None,
    gpu: bool | None = None,
    mtp: bool = False,
    part: RankPart | None = None,
) -> tuple[int, FitReport]:
    """``ds4mlx serve``'s default ``--sessions``: how many resident states (each with its
    KV at ``ctx_size``) the memory budget holds after the weights and working memory,
    at most ``cap`` and at least 1; with the report of that many. ``mtp``: the
    drafter's ``mtp.*`` weights are loaded too; ``part``: only what one rank of a split
    model holds (``check_fit``).

    Raises:
        FitError: not even one state fits (the message has the numbers).
        ValueError: a bad config or memory limit.
    """
    one = check_fit(
        path, ctx_size, 1, memory_limit, dtype_bytes=dtype_bytes, gpu=gpu, mtp=mtp, part=part
    )
    spare = one.available - one.total
    n = max(1, min(cap, 1 + spare // max(1, one.kv_per_session)))
    return n, replace(one, sessions=n)
