"""``ds4mlx bench``: prefill/decode throughput and KV bytes at context frontiers.

docs/ARCHITECTURE.md §8. The prompt is prefilled incrementally, frontier by frontier; each row
measures only its own interval (prefill of the tokens between the previous frontier and
this one, timed ``prefill_repeats`` times from the same state and reported as the median)
and a decode run at that frontier, taken on a snapshot that is restored afterwards so the
next interval starts from the exact prefill state.

The roofline column relates decode speed to memory bandwidth: a decoded token must read
every active weight once (non-expert weights, the shared expert, ``top-k`` of the routed
experts, one embedding row), so ``bandwidth / active_bytes`` bounds decode tokens/s.
Bandwidth is measured here as an MLX array copy (bytes read + bytes written per second).

Graph columns (docs/KERNELS.md): at each frontier one decode step is counted
(primitives and non-view primitives of the logits + every cache array) and a few steps
are timed split into Python graph build and evaluation, on a copy of the frontier's
state (the timed decode loop itself is unchanged).

``run_flash_shape`` measures real Flash layer dimensions without a checkpoint: a random
model with quantized experts generated directly (``model/synth.py``), timed layer by
layer in prefill and decode.
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

from ds4mlx.engine import DEFAULT_CHUNK, Engine, SamplingParams, TurnSpec, run_turn
from ds4mlx.model.graph import decode_step_primitives, time_decode, time_verify

# Tensors read one row per token: the token embedding and the hash-routing table.
_ROW_LOOKUP = re.compile(r"\.(embed|embed_tokens|tid2eid)(\.|$)")
# Rows of the verify-cost columns: what ``--draft-tokens 5`` verifies (t0 + 5 drafts).
VERIFY_ROWS = 6
# Timed prefills per frontier (``--prefill-repeats``); the row reports their median.
DEFAULT_PREFILL_REPEATS = 3


@dataclass
class BenchRow:
    """One frontier. Times in seconds, rates in tokens/s, sizes in bytes."""

    frontier: int
    prefill_tokens: int
    prefill_s: float  # the median of `prefill_repeats` timed prefills of the interval
    prefill_tok_s: float
    decode_tokens: int
    decode_s: float
    decode_tok_s: float
    kv_bytes: int
    roofline_tok_s: float
    roofline_fraction: float
    kv_used_bytes: int = 0
    decode_primitives: int = 0
    decode_non_view: int = 0
    build_ms: float = float("nan")
    eval_ms: float = float("nan")
    decode_sync_tok_s: float = float("nan")
    verify_primitives: int = 0
    verify_non_view: int = 0
    verify_ms: float = float("nan")
    verify_ratio: float = float("nan")
    prefill_repeats: int = 1


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
    prefill_repeats: int = DEFAULT_PREFILL_REPEATS,
    log: Callable[[str], object] | None = None,
) -> BenchResult:
    """Measure prefill/decode throughput at each frontier on a fresh session.

    Args:
        engine: a loaded engine; its live session is left untouched.
        frontiers: increasing context sizes in tokens.
        decode_tokens: tokens decoded (greedy) at each frontier.
        chunk_size: prefill chunk size.
        seed: seeds the random prompt (ids of ordinary vocabulary tokens).
        prefill_repeats: each frontier's interval is prefilled this many times from the
            previous frontier's state (restored between repeats); the row reports the
            median time (`timed_prefill`).
        log: called with progress lines.
    Raises:
        ValueError: frontiers not increasing, too large for ``engine.ctx_size``, or
            ``prefill_repeats`` < 1.
    """
    if prefill_repeats < 1:
        raise ValueError(f"prefill_repeats must be at least 1, got {prefill_repeats}")
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
    prompt = bench_prompt(frontiers[-1], seed)

    _warm_up(engine, prompt[: min(chunk_size, frontiers[0])])

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
        t_pre = timed_prefill(s, chunk, chunk_size, prefill_repeats)
        kv = s.kv_bytes()

        snap = s.snapshot()
        tok = int(mx.argmax(s.logits).item())
        graph = graph_figures(engine.model, snap, tok, steps=min(decode_tokens, 8))
        # The shared turn loop, pipelined then synchronous, from the same frontier; the
        # last sampled token is not fed (feeding rule), hence decode_tokens + 1 samples.
        rates = []
        for pipeline in (True, False):
            res = run_turn(s, engine.tokenizer, _decode_spec(decode_tokens + 1, pipeline))
            rates.append((res.fed, res.decode_s))
            s.restore(snap)
        del snap
        fed, t_dec = rates[0]
        dec_tps = fed / t_dec if t_dec > 0 else float("nan")
        sync_tps = rates[1][0] / rates[1][1] if rates[1][1] > 0 else float("nan")
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
            decode_sync_tok_s=sync_tps,
            prefill_repeats=prefill_repeats,
            **graph,
        )
        rows.append(row)
        say(
            f"{f:>7} tokens: prefill {row.prefill_tok_s:8.1f} tok/s (median of "
            f"{prefill_repeats}), decode "
            f"{row.decode_tok_s:7.2f} tok/s pipelined / {sync_tps:.2f} synchronous "
            f"({100 * row.roofline_fraction:.2f}% of roofline), "
            f"KV {kv / 1e6:.2f} MB ({row.kv_used_bytes / 1e6:.2f} MB used); step graph "
            f"{row.decode_primitives} primitives, {row.decode_non_view} non-view; build "
            f"{row.build_ms:.2f} ms + eval {row.eval_ms:.2f} ms; verify {VERIFY_ROWS} rows "
            f"{row.verify_ms:.2f} ms = {row.verify_ratio:.2f} decode steps, "
            f"{row.verify_primitives} primitives, {row.verify_non_view} non-view"
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


def bench_prompt(n: int, seed: int) -> list[int]:
    """The bench's random prompt: ``n`` ids of ordinary vocabulary tokens (below the added
    special tokens at 128000+), seeded by ``seed``."""
    rng = np.random.default_rng(seed)
    return rng.integers(1000, 100000, size=n).tolist()


def _warm_up(engine: Engine, tokens: Sequence[int]) -> None:
    """A short turn on a throwaway session: first calls build kernels / compiled graphs."""
    run_turn(engine.new_session(), engine.tokenizer, _decode_spec(2), prefill=list(tokens))


def timed_prefill(session, tokens: Sequence[int], chunk_size: int, repeats: int) -> float:
    """Median seconds of ``repeats`` prefills of ``tokens`` into ``session``, each from the
    state it had on entry (a snapshot restored between repeats); the session is left with
    ``tokens`` prefilled once. On a shared box one timed prefill is a noisy sample (the
    other processes' load moves it by 2x or more), so the bench reports a median."""
    base = session.snapshot() if repeats > 1 else None
    times = []
    for i in range(repeats):
        if i:
            session.restore(base)
        t0 = time.perf_counter()
        session.prefill(tokens, chunk_size=chunk_size)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _decode_spec(max_tokens: int, pipeline: bool = True) -> TurnSpec:
    """Greedy raw decoding of exactly ``max_tokens`` samples (EOS is an ordinary token)."""
    return TurnSpec(
        SamplingParams(temperature=0),
        max_tokens,
        parse=False,
        ignore_eos=True,
        pipeline=pipeline,
    )


def caches_from_snapshot(model, snap) -> list:
    """Fresh per-layer caches holding a session snapshot's cache arrays (``cache.I.name``)."""
    caches = model.make_cache()
    per_layer: list[dict] = [{} for _ in caches]
    for key, a in snap.arrays.items():
        parts = key.split(".", 2)
        if len(parts) == 3 and parts[0] == "cache" and parts[1].isdigit():
            per_layer[int(parts[1])][parts[2]] = a
    for c, st in zip(caches, per_layer, strict=True):
        c.state = st
    return caches


def graph_figures(model, snap, token: int, *, steps: int = 8) -> dict:
    """Graph size of one decode step and the build / evaluation split of ``steps`` steps;
    the verify cost of speculative decoding.

    Runs on caches rebuilt from ``snap`` (the session is not touched). Returns the
    ``BenchRow`` fields ``decode_primitives``, ``decode_non_view``, ``build_ms``,
    ``eval_ms`` (medians per step), ``kv_used_bytes`` (KV bytes in use, without the
    spare rows that ``kv_bytes`` includes), and for one forward over ``VERIFY_ROWS`` rows
    from the decode state: ``verify_primitives``, ``verify_non_view``, ``verify_ms`` and
    ``verify_ratio`` (its time ÷ one decode step's, medians of ``steps`` interleaved
    pairs, ``ds4mlx.model.graph.time_verify``).
    """
    caches = caches_from_snapshot(model, snap)
    used = sum(getattr(c, "used_nbytes", c.nbytes) for c in caches)
    rows = np.random.default_rng(token).integers(1000, 100000, VERIFY_ROWS).tolist()
    r = decode_step_primitives(model, caches, token)
    v = decode_step_primitives(model, caches, rows)
    t = time_decode(model, caches, [token] * max(1, steps))
    feed = [token, *rows] * (max(1, steps) + 2)
    tv = time_verify(model, caches_from_snapshot(model, snap), feed[: steps + 1 + VERIFY_ROWS],
                     VERIFY_ROWS)  # fmt: skip
    ver, dec = float(np.median(tv["verify_ms"])), float(np.median(tv["decode_ms"]))
    return {
        "kv_used_bytes": int(used),
        "decode_primitives": r["primitives"],
        "decode_non_view": r["non_view"],
        "build_ms": float(np.median(t["build_ms"])),
        "eval_ms": float(np.median(t["eval_ms"])),
        "verify_primitives": v["primitives"],
        "verify_non_view": v["non_view"],
        "verify_ms": ver,
        "verify_ratio": ver / dec if dec > 0 else float("nan"),
    }


def to_csv(rows: Sequence) -> str:
    """CSV text with a header row (columns = the dataclass fields of the rows:
    ``BenchRow`` or ``LayerCost``)."""
    buf = io.StringIO()
    cls = type(rows[0]) if rows else BenchRow
    w = csv.DictWriter(buf, fieldnames=[f.name for f in fields(cls)], lineterminator="\n")
    w.writeheader()
    for r in rows:
        d = asdict(r)
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in d.items()})
    return buf.getvalue()


def plot(result: BenchResult, path: str) -> None:
    """Write a plot (its format by ``path``'s extension: PNG, SVG, PDF, …): tokens/s
    (prefill, decode, roofline) and KV bytes against context.

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


# ----------------------------------------------------------------------------- Flash shape
@dataclass
class LayerCost:
    """Wall time of one layer (or of embedding + head: ``layer`` -1) at Flash shape.

    ``context`` is the frontier the row was measured at; ``prefill_ms`` covers the prompt
    interval that ends there; ``decode_ms`` is the median per token. Layer
    times include building that layer's graph; layer 0 includes the embedding lookup.
    """

    context: int
    layer: int
    kind: str
    hash_routed: bool
    weight_bytes: int
    active_bytes: int
    prefill_ms: float
    prefill_ms_per_token: float
    decode_ms: float


@dataclass
class FlashShapeResult:
    rows: list[LayerCost]
    prompt_tokens: int
    decode_tokens: int
    expert_bits: int
    other_bits: int | None
    build_s: float
    peak_rss_bytes: int
    includes_embedding_and_head: bool = True
    routing: dict | None = None  # `expert_reads` of a decode step and a verify


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (bytes)."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _timed_forward(model, tokens: mx.array, cache, *, last_only: bool) -> list[float]:
    """Seconds per layer, then embedding + head last: evaluation after every layer."""
    marks: list[float] = []

    def probe(_i, x, c):
        mx.eval(x, c.arrays())
        marks.append(time.perf_counter())

    t0 = time.perf_counter()
    mx.eval(model(tokens, cache, last_only=last_only, probe=probe))
    end = time.perf_counter()
    starts = [t0, *marks]
    return [b - a for a, b in zip(starts, marks, strict=False)] + [end - marks[-1]]


def expert_reads(model, cache, tokens: Sequence[int]) -> dict:
    """Routed experts one forward over ``tokens`` reads from ``cache``'s state (rewound
    afterwards): ``{"experts": unique experts summed over layers, "bytes": their weight
    bytes (packed weights + scales as stored)}``."""
    saved = [c.capture() for c in cache]
    logs = []
    for layer in model.layers:
        logs.append([])
        object.__setattr__(layer.ffn, "routing_log", logs[-1])
    try:
        mx.eval(model(mx.array([list(tokens)], dtype=mx.int32), cache), *[g[0] for g in logs])
    finally:
        for layer in model.layers:
            del layer.ffn.__dict__["routing_log"]
        for c, sv in zip(cache, saved, strict=True):
            c.rewind(sv)
    n = nbytes = 0
    for layer, log in zip(model.layers, logs, strict=True):
        unique = len(np.unique(np.array(log[0])))
        ex = layer.ffn.experts
        per = sum(p.nbytes for _, p in tree_flatten(ex.parameters())) / ex.w1["weight"].shape[0]
        n += unique
        nbytes += int(unique * per)
    return {"experts": n, "bytes": nbytes}


def _flash_rows(model, first: int, point: int, pre, n: int, dec_med) -> list[LayerCost]:
    """``LayerCost`` rows of one frontier: per-layer times ``pre`` (prefill of ``n``
    tokens, seconds) and ``dec_med`` (median decode step), then embedding + head (-1)."""
    args = model.args
    rows = []
    for i, layer in enumerate(model.layers):
        active, total = weight_bytes(layer, args)
        rows.append(
            LayerCost(point, first + i, args.layer_kind(i), args.hash_layers[i], total, active,
                      1e3 * pre[i], 1e3 * pre[i] / n, 1e3 * float(dec_med[i]))
        )  # fmt: skip
    # The embedding is read one row per token; head and final norm entirely.
    emb = sum(p.nbytes for _, p in tree_flatten(model.embed.parameters()))
    head_total = emb + sum(
        p.nbytes for m in (model.head, model.norm) for _, p in tree_flatten(m.parameters())
    )
    head_active = head_total - emb + emb // args.vocab_size
    rows.append(
        LayerCost(point, -1, "embed+head", False, head_total, head_active, 1e3 * pre[-1],
                  1e3 * pre[-1] / n, 1e3 * float(dec_med[-1]))
    )  # fmt: skip
    return rows


def run_flash_shape(
    layers: int = 2,
    *,
    first: int = 0,
    expert_bits: int = 2,
    other_bits: int | None = 8,
    prompt_tokens: int = 32,
    decode_tokens: int = 3,
    seed: int = 0,
    frontiers: Sequence[int] | None = None,
    log: Callable[[str], object] | None = None,
    progress: Callable[[int, int], object] | None = None,
) -> FlashShapeResult:
    """Per-layer prefill and decode cost at real Flash dimensions (random weights).

    Builds ``synth.flash_model`` (Flash's layers ``first …``; experts quantized at ``expert_bits``, generated directly
    as packed words + scales; the rest at ``other_bits``; embedding and head included),
    then for each context frontier (``frontiers``, increasing; default one, ``prompt_tokens``)
    prefills the random tokens up to it and decodes ``decode_tokens`` more, timing every
    layer separately: one row per layer and frontier (``context``), prefill times covering
    that frontier's interval only. ``progress(done, total)`` follows the weight build.

    Raises:
        ValueError: frontiers not increasing or not positive.
    """
    from ds4mlx.model.synth import flash_model

    say = log or (lambda _s: None)
    points = [int(f) for f in (frontiers or [prompt_tokens])]
    if points[0] < 1 or any(b <= a for a, b in zip(points, points[1:], strict=False)):
        raise ValueError(f"frontiers must be positive and increasing, got {points}")
    t0 = time.perf_counter()
    model = flash_model(
        layers, first=first, expert_bits=expert_bits, other_bits=other_bits, seed=seed,
        progress=progress,
    )  # fmt: skip
    build_s = time.perf_counter() - t0
    say(f"built a {layers}-layer Flash-shape model in {build_s:.1f} s")
    rng = np.random.default_rng(seed)
    tokens = mx.array(rng.integers(1000, 100000, points[-1]), dtype=mx.int32)[None]
    cache = model.make_cache()
    rows, done = [], 0
    for point in points:
        pre = _timed_forward(model, tokens[:, done:point], cache, last_only=True)
        n, done = point - done, point
        say(f"prefill to {point} tokens ({n} new): {sum(pre):.2f} s")
        dec = []
        for t in rng.integers(1000, 100000, decode_tokens).tolist():
            step = _timed_forward(model, mx.array([[t]], dtype=mx.int32), cache, last_only=False)
            dec.append(step)
            say(f"decode step at {point}: {sum(step):.2f} s")
        # The decoded tokens stay in the cache, so a later frontier's context is larger by
        # decode_tokens per earlier frontier: a few tokens, kept for simplicity.
        rows += _flash_rows(model, first, point, pre, n, np.median(np.array(dec), axis=0))
    # What a speculative verify costs at these dimensions: the experts its rows read.
    feed = rng.integers(1000, 100000, VERIFY_ROWS).tolist()
    routing = {
        "decode": expert_reads(model, cache, feed[:1]),
        "verify": expert_reads(model, cache, feed),
        "rows": VERIFY_ROWS,
        "layers": len(model.layers),
    }
    say(
        f"routed experts read (all {len(model.layers)} layers): decode "
        f"{routing['decode']['experts']} ({routing['decode']['bytes'] / 1e6:.1f} MB), verify "
        f"of {VERIFY_ROWS} rows {routing['verify']['experts']} "
        f"({routing['verify']['bytes'] / 1e6:.1f} MB): "
        f"{routing['verify']['bytes'] / max(routing['decode']['bytes'], 1):.2f}x"
    )
    return FlashShapeResult(
        rows=rows,
        prompt_tokens=points[-1],
        decode_tokens=decode_tokens,
        expert_bits=expert_bits,
        other_bits=other_bits,
        build_s=build_s,
        peak_rss_bytes=peak_rss_bytes(),
        routing=routing,
    )


# ----------------------------------------------------------------------------- distributed
# Flash's residual width: the hop of the goal is one token's streams at it
# ((1, 4, 4096) float32, 64 KiB).
FLASH_DIM = 4096
HOP_ROUND_TRIPS = 20


@dataclass
class Hop:
    """One token's residual streams ``shape`` (``dtype``, ``nbytes``) sent rank 0 -> 1 ->
    … -> 0 with the pipeline's send/recv: the median of ``round_trips`` round trips, ms."""

    shape: tuple
    dtype: str
    nbytes: int
    median_ms: float
    round_trips: int


@dataclass
class PairedFrontier:
    """One frontier of `paired_rounds`: per run, split then single, each round's prefill
    rate of the interval (tokens/s) and decode time per token (ms, pipelined), each
    round having timed both runs back to back; the goal check reads their medians."""

    frontier: int
    split_prefill_tok_s: list[float]
    single_prefill_tok_s: list[float]
    split_decode_ms: list[float]
    single_decode_ms: list[float]

    @property
    def rounds(self) -> int:
        return len(self.split_decode_ms)

    @staticmethod
    def median(values: list[float]) -> float:
        return float(np.median(values))


def paired_rounds(
    split: Engine,
    single: Engine,
    frontiers: Sequence[int],
    *,
    decode_tokens: int,
    chunk_size: int,
    seed: int,
    rounds: int,
) -> list[PairedFrontier]:
    """Time a split engine against the unsplit one in interleaved rounds, per frontier.

    Each engine prefills the bench prompt (`bench_prompt`) frontier by frontier on a
    fresh session. At each frontier, every round restores both sessions to the previous
    frontier's state, times the prefill of the interval and then ``decode_tokens`` greedy
    pipelined decode steps, once per engine, the engine going first alternating from
    round to round. Why: on a shared box (here the hypervisor took up to half of the
    CPU, ``top``'s ``st``) the machine's speed drifts by 2x within minutes, so two runs
    timed one after the other compare two machines; timed in alternation both see the
    same drift, and the medians of the rounds compare the code. Runs on rank 0's
    inference thread while the split's followers follow.

    Raises:
        ValueError: ``rounds`` < 1.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    frontiers = [int(f) for f in frontiers]
    prompt = bench_prompt(frontiers[-1], seed)
    engines = (split, single)
    for e in engines:
        _warm_up(e, prompt[: min(chunk_size, frontiers[0])])
    sessions = [e.new_session() for e in engines]
    out: list[PairedFrontier] = []
    prev = 0
    for f in frontiers:
        bases = [s.snapshot() for s in sessions]
        prefill: list[list[float]] = [[], []]
        decode: list[list[float]] = [[], []]
        ends: list = [None, None]
        for r in range(rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                s = sessions[i]
                s.restore(bases[i])
                t = timed_prefill(s, prompt[prev:f], chunk_size, 1)
                prefill[i].append((f - prev) / t if t > 0 else float("nan"))
                ends[i] = s.snapshot()
                res = run_turn(s, engines[i].tokenizer, _decode_spec(decode_tokens + 1))
                decode[i].append(1e3 * res.decode_s / res.fed if res.fed else float("nan"))
        for s, end in zip(sessions, ends, strict=True):
            s.restore(end)  # the next frontier starts from this one's prefill
        out.append(PairedFrontier(f, prefill[0], prefill[1], decode[0], decode[1]))
        prev = f
    return out


@dataclass
class DistributedFigures:
    """What a split adds to the bench (docs/DISTRIBUTED.md, "Benchmark").

    Attributes:
        mode: ``"pipeline"`` or ``"tensor"``; ``world``: ranks.
        hop: at the model's width (what a decode step sends); ``hop_flash``: at Flash's.
        step: collective calls in one decode step on rank 0 (``{"all_sum": 10}``; the
            pipeline's ``send``/``recv`` included).
        layers: tensor mode, per layer: ``(kind, {"all_sum": 2})`` (the layer's own
            collectives, counted in its graph); empty in pipeline mode.
        paired: with ``--compare``, per frontier the split and the unsplit checkpoint in
            rank 0's process timed in interleaved rounds (`paired_rounds`), or None.
    """

    mode: str
    world: int
    hop: Hop
    hop_flash: Hop
    step: dict[str, int]
    layers: list[tuple[str, dict[str, int]]]
    paired: list[PairedFrontier] | None = None


def collective_calls(by_op: dict[str, int]) -> dict[str, int]:
    """The collective calls among ``count_primitives``' ``by_op``: MLX labels an
    ``all_sum`` node ``"Sum AllReduce"``, ``all_gather`` ``"AllGather"``, a ``send``
    ``"Send"``, a ``recv`` ``"Recv"``."""
    out: dict[str, int] = {}
    for op, n in by_op.items():
        if op.endswith("AllReduce"):
            name = f"all_{op.split()[0].lower()}"
        elif op in ("AllGather", "Send", "Recv"):
            name = {"AllGather": "all_gather", "Send": "send", "Recv": "recv"}[op]
        else:
            continue
        out[name] = out.get(name, 0) + n
    return dict(sorted(out.items()))


def step_collectives(model, per_layer: bool) -> tuple[dict, list]:
    """Collectives of one decode step of a split model (rank 0's ``PipelineModel`` or
    ``TensorModel``), counted in the graphs of a step built on fresh caches and never
    evaluated (nothing is sent): ``(step, layers)`` as in `DistributedFigures`. With
    ``per_layer`` (tensor mode) each layer's own collectives: the step is built once more
    on the sharded network alone, its streams' graph counted after every layer."""
    from collections import Counter

    from ds4mlx.model.graph import count_primitives, decode_step_primitives

    step = collective_calls(decode_step_primitives(model, model.make_cache(), 1)["by_op"])
    model.settled()  # the step was built (the deadline armed), never launched
    if not per_layer:
        return step, []
    net = model.model
    outs: list[mx.array] = []
    net(mx.array([[1]], dtype=mx.int32), net.make_cache(), probe=lambda _i, x, _c: outs.append(x))
    layers, before = [], Counter()
    for i, x in enumerate(outs):
        upto = Counter(collective_calls(count_primitives([x])["by_op"]))
        layers.append((model.args.layer_kind(i), dict(upto - before)))
        before = upto
    return step, layers


def _hop(model, width: int, round_trips: int) -> Hop:
    shape = (1, model.args.hc_mult, width)
    dtype = model.compute_dtype
    ms = model.hop(round_trips, width)
    nbytes = int(np.prod(shape)) * dtype.size
    return Hop(shape, str(dtype).removeprefix("mlx.core."), nbytes, float(np.median(ms)),
               round_trips)  # fmt: skip


def distributed_figures(engine: Engine, round_trips: int = HOP_ROUND_TRIPS) -> DistributedFigures:
    """The hop (at the model's width and at Flash's) and the collectives per decode step
    of ``engine``'s split (its ``layout``, ``"pipeline:…"`` or ``"tensor:W"``). Runs on
    rank 0 while the followers follow; call on the inference thread."""
    model = engine.model
    mode = engine.layout.split(":", 1)[0]
    step, layers = step_collectives(model, per_layer=mode == "tensor")
    return DistributedFigures(
        mode=mode,
        world=model.world,
        hop=_hop(model, engine.args.dim, round_trips),
        hop_flash=_hop(model, FLASH_DIM, round_trips),
        step=step,
        layers=layers,
    )


def _calls(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in counts.items()) or "none"


def distributed_report(figs: DistributedFigures) -> list[str]:
    """The lines a split bench prints after its table: the hop, the collectives per
    decode step (per layer kind in tensor mode), and with the interleaved rounds against
    the unsplit run (``figs.paired``) both runs' medians per frontier and the goal check
    (decode per token within the 1-rank time plus 1.5 hops; prefill at least 0.8x the
    1-rank rate)."""
    w = figs.world
    lines = []
    for h in (figs.hop, figs.hop_flash):
        lines.append(
            f"hop: {h.shape} {h.dtype} ({h.nbytes / 1024:g} KiB) rank 0 -> 1 -> 0: "
            f"{h.median_ms:.3f} ms (median of {h.round_trips} round trips)"
        )
    kinds: dict[str, list[dict]] = {}
    for kind, counts in figs.layers:
        kinds.setdefault(kind, []).append(counts)
    per_kind = [
        f"{kind.upper() if kind != 'window' else 'window'} layer: "
        f"{_calls(calls[0]) if all(c == calls[0] for c in calls) else 'varies'} (x{len(calls)})"
        for kind, calls in kinds.items()
    ]
    lines.append(
        f"collectives per decode step ({figs.mode}, rank 0): "
        + "; ".join([*per_kind, f"total {_calls(figs.step)}"])
    )
    if figs.paired is None:
        lines.append("no 1-rank figures: rerun with --compare")
        return lines
    hop15 = 1.5 * figs.hop.median_ms

    def each(values: list[float]) -> str:
        return " ".join(f"{v:.2f}" for v in values)

    for p in figs.paired:
        x, y = p.median(p.split_decode_ms), p.median(p.single_decode_ms)
        a, b = p.median(p.split_prefill_tok_s), p.median(p.single_prefill_tok_s)
        lines += [
            f"{p.frontier:>7} tokens, medians of {p.rounds} interleaved rounds: {w} ranks "
            f"prefill {a:.1f} tok/s, decode {x:.2f} ms per token; 1 rank prefill {b:.1f} "
            f"tok/s, decode {y:.2f} ms per token (per round, ms: {w} ranks "
            f"{each(p.split_decode_ms)}; 1 rank {each(p.single_decode_ms)})",
            f"{p.frontier:>7} tokens: {w}-rank decode per token {x:.2f} ms <= 1-rank {y:.2f} ms"
            f" + 1.5 hops {hop15:.2f} ms: {'holds' if x <= y + hop15 else 'misses'}",
            f"{p.frontier:>7} tokens: prefill {a:.1f} tok/s >= 0.8x 1-rank {b:.1f} tok/s: "
            f"{'holds' if a >= 0.8 * b else 'misses'}",
        ]
    return lines
