"""``ds4mlx bench``: prefill/decode throughput and KV bytes at context frontiers.

docs/ARCHITECTURE.md §8. The prompt is prefilled incrementally, frontier by frontier; each row
measures only its own interval (prefill of the tokens between the previous frontier and
this one) and a decode run at that frontier, taken on a snapshot that is restored
afterwards so the next interval starts from the exact prefill state.

The roofline column relates decode speed to memory bandwidth: a decoded token must read
every active weight once (non-expert weights, the shared expert, ``top-k`` of the routed
experts, one embedding row), so ``bandwidth / active_bytes`` bounds decode tokens/s.
Bandwidth is measured here as an MLX array copy (bytes read + bytes written per second).
"""

from __future__ import annotations

import csv
import io
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ds4mlx.engine import DEFAULT_CHUNK, Engine, SamplingParams

# Tensors read one row per token: the token embedding and the hash-routing table.
_ROW_LOOKUP = re.compile(r"\.(embed|embed_tokens|tid2eid)(\.|$)")


@dataclass
class BenchRow:
    """One frontier. Times in seconds, rates in tokens/s, sizes in bytes."""

    frontier: int
    prefill_tokens: int
    prefill_s: float
    prefill_tok_s: float
    decode_tokens: int
    decode_s: float
    decode_tok_s: float
    kv_bytes: int
    roofline_tok_s: float
    roofline_fraction: float


@dataclass
class BenchResult:
    """All rows plus the figures they were computed from."""

    rows: list[BenchRow]
    active_weight_bytes: int
    total_weight_bytes: int
    copy_bandwidth: float  # bytes/s, read + write
    quant_desc: str
    chunk_size: int


def weight_bytes(model, args) -> tuple[int, int]:
    """``(active, total)`` bytes of weights, where active is what one decoded token reads.

    Routed expert tensors (``…experts.…``, not the shared expert) count ``k / E`` of their
    bytes (``n_activated_experts`` of ``n_routed_experts``); row-lookup tables (the
    embedding, hash-routing ``tid2eid``) count one row; MTP layers count nothing (not
    used by plain decoding). Quantized tensors count their packed weights, scales and
    biases as stored.
    """
    n_exp = getattr(args, "n_routed_experts", 0) or 0
    k = getattr(args, "n_activated_experts", 0) or 0
    active = 0.0
    total = 0
    for name, p in tree_flatten(model.parameters()):
        nb = p.nbytes
        total += nb
        path = f".{name}"
        if path.startswith(".mtp"):
            continue
        if ".experts." in path and "shared" not in path and n_exp:
            active += nb * k / n_exp
        elif _ROW_LOOKUP.search(path) and p.ndim >= 1 and p.shape[0]:
            active += nb / p.shape[0]
        else:
            active += nb
    return int(active), total


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best-of-``repeats`` bandwidth of copying an ``nbytes`` float32 MLX array.

    Returns bytes/s counting both the bytes read and the bytes written (STREAM "copy").
    """
    a = mx.random.uniform(shape=(nbytes // 4,))
    mx.eval(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        b = a + 0  # one read and one write of every element
        mx.eval(b)
        best = min(best, time.perf_counter() - t0)
        del b
    return 2 * a.nbytes / best


def run_bench(
    engine: Engine,
    frontiers: Sequence[int] = (512, 1024, 2048),
    *,
    decode_tokens: int = 32,
    chunk_size: int = DEFAULT_CHUNK,
    seed: int = 0,
    log: Callable[[str], object] | None = None,
) -> BenchResult:
    """Measure prefill/decode throughput at each frontier on a fresh session.

    Args:
        engine: a loaded engine; its live session is left untouched.
        frontiers: increasing context sizes in tokens.
        decode_tokens: tokens decoded (greedy) at each frontier.
        chunk_size: prefill chunk size.
        seed: seeds the random prompt (ids of ordinary vocabulary tokens).
        log: called with progress lines.
    Raises:
        ValueError: frontiers not increasing, or too large for ``engine.ctx_size``.
    """
    frontiers = [int(f) for f in frontiers]
    if not frontiers or any(b <= a for a, b in zip(frontiers, frontiers[1:], strict=False)):
        raise ValueError(f"frontiers must be increasing, got {frontiers}")
    if frontiers[0] < 1:
        raise ValueError("frontiers must be positive")
    if frontiers[-1] + decode_tokens + 1 > engine.ctx_size:
        raise ValueError(
            f"frontier {frontiers[-1]} + {decode_tokens} decode tokens exceed the context "
            f"size {engine.ctx_size}"
        )
    say = log or (lambda _s: None)
    # Ordinary vocabulary only: ids below the added special tokens (128000+).
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1000, 100000, size=frontiers[-1]).tolist()
    greedy = SamplingParams(temperature=0)

    # Warm-up on a throwaway session: first calls build kernels / compiled graphs.
    warm = engine.new_session()
    warm.prefill(prompt[: min(chunk_size, frontiers[0])], chunk_size=chunk_size)
    for _ in range(2):
        warm.decode(warm.sample(greedy))
    del warm

    active, total = weight_bytes(engine.model, engine.args)
    bw = copy_bandwidth()
    roof = bw / active if active else float("nan")
    say(
        f"weights: {total / 1e6:.2f} MB total, {active / 1e6:.2f} MB active per token; "
        f"copy bandwidth {bw / 1e9:.1f} GB/s -> roofline {roof:.0f} tok/s"
    )

    s = engine.new_session()
    rows: list[BenchRow] = []
    prev = 0
    for f in frontiers:
        chunk = prompt[prev:f]
        t0 = time.perf_counter()
        s.prefill(chunk, chunk_size=chunk_size)
        t_pre = time.perf_counter() - t0
        kv = s.kv_bytes()

        snap = s.snapshot()
        tok = s.sample(greedy)
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            s.decode(tok)
            tok = s.sample(greedy)
        t_dec = time.perf_counter() - t0
        s.restore(snap)
        del snap

        dec_tps = decode_tokens / t_dec if t_dec > 0 else float("nan")
        row = BenchRow(
            frontier=f,
            prefill_tokens=len(chunk),
            prefill_s=t_pre,
            prefill_tok_s=len(chunk) / t_pre if t_pre > 0 else float("nan"),
            decode_tokens=decode_tokens,
            decode_s=t_dec,
            decode_tok_s=dec_tps,
            kv_bytes=kv,
            roofline_tok_s=roof,
            roofline_fraction=dec_tps / roof if roof else float("nan"),
        )
        rows.append(row)
        say(
            f"{f:>7} tokens: prefill {row.prefill_tok_s:8.1f} tok/s, decode "
            f"{row.decode_tok_s:7.2f} tok/s ({100 * row.roofline_fraction:.2f}% of roofline), "
            f"KV {kv / 1e6:.2f} MB"
        )
        prev = f
    return BenchResult(
        rows=rows,
        active_weight_bytes=active,
        total_weight_bytes=total,
        copy_bandwidth=bw,
        quant_desc=engine.quant_desc,
        chunk_size=chunk_size,
    )


def to_csv(rows: Sequence[BenchRow]) -> str:
    """CSV text with a header row (columns = ``BenchRow`` fields)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=[f.name for f in fields(BenchRow)], lineterminator="\n")
    w.writeheader()
    for r in rows:
        d = asdict(r)
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in d.items()})
    return buf.getvalue()


def plot(result: BenchResult, path: str) -> None:
    """Write a PNG: tokens/s (prefill, decode, roofline) and KV bytes against context.

    Raises:
        ImportError: matplotlib is not installed (it is optional).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("--plot needs matplotlib (pip install matplotlib)") from e
    xs = [r.frontier for r in result.rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(xs, [r.prefill_tok_s for r in result.rows], "o-", label="prefill")
    a1.plot(xs, [r.decode_tok_s for r in result.rows], "s-", label="decode")
    a1.axhline(result.rows[0].roofline_tok_s, ls="--", c="gray", label="decode roofline")
    a1.set_xlabel("context (tokens)")
    a1.set_ylabel("tokens/s")
    a1.set_yscale("log")
    a1.legend()
    a2.plot(xs, [r.kv_bytes / 1e6 for r in result.rows], "o-")
    a2.set_xlabel("context (tokens)")
    a2.set_ylabel("KV cache (MB)")
    fig.suptitle(f"ds4mlx bench ({result.quant_desc}, chunk {result.chunk_size})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
