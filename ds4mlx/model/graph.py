"""Graph size of one decode step: how many MLX primitives a token costs to launch.

On a GPU every non-view primitive of the lazily built graph is (at least) one kernel
launch, so at Flash depth the decode step is judged by its node count before its FLOPs
(docs/KERNELS.md). The count here is the one the project reports everywhere:

* build one decode step (one token through the model, cache advanced) without evaluating,
* export the graph of the logits **and every cache array** with ``mx.export_to_dot``,
* every DOT node with a ``label ="Name"`` is one primitive; the view-like ones in
  ``VIEW_OPS`` (no data movement on a GPU, or folded into their consumer) are counted apart.

Counting never evaluates anything: the caches' Python-side state is captured before the
build and put back afterwards, so the session continues exactly as if it had not run.
"""

from __future__ import annotations

import io
import re
import time
from collections import Counter
from collections.abc import Iterable, Sequence

import mlx.core as mx

# Primitives that only re-describe memory (or copy it in a way a GPU folds into the
# consumer): not counted as launches.
VIEW_OPS = frozenset(
    {
        "Broadcast",
        "ExpandDims",
        "Reshape",
        "Squeeze",
        "Slice",
        "Transpose",
        "Flatten",
        "Unflatten",
        "AsStrided",
        "StopGradient",
        "Copy",
    }
)

_LABEL = re.compile(r'\[label ="([^"]+)"')


def count_primitives(outputs: Iterable[mx.array]) -> dict:
    """Count the primitives of the unevaluated graph behind ``outputs``.

    Args:
        outputs: arrays (evaluated inputs are leaves and cost nothing).

    Returns:
        ``{"primitives": int, "non_view": int, "by_op": dict[str, int]}``; ``by_op``
        counts every primitive name (view ones included), most frequent first.
    """
    buf = io.StringIO()
    mx.export_to_dot(buf, *list(outputs))
    ops = Counter(_LABEL.findall(buf.getvalue()))
    total = sum(ops.values())
    views = sum(n for op, n in ops.items() if op in VIEW_OPS)
    return {"primitives": total, "non_view": total - views, "by_op": dict(ops.most_common())}


def _cache_arrays(cache) -> list[mx.array]:
    """Every cache array as ``state`` lists them (the counting rule)."""
    return [a for c in cache for a in _state_arrays(c)]


def _state_arrays(c) -> list[mx.array]:
    st = c.state
    return list(st.values()) if isinstance(st, dict) else list(_flat(st))


def cache_buffers(cache) -> list[mx.array]:
    """The arrays to evaluate after a step: ``arrays()`` where the cache has it (ds4mlx),
    else ``state`` (mlx-lm)."""
    out: list[mx.array] = []
    for c in cache:
        out += c.arrays() if hasattr(c, "arrays") else _state_arrays(c)
    return out


def _flat(x):
    if isinstance(x, mx.array):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)


def time_decode(model, cache, tokens: Sequence[int]) -> dict:
    """Decode ``tokens`` one by one, synchronously; per-step wall times in ms.

    Each step is built (``model(token, cache)``) and then evaluated together with every
    cache buffer, so no write stays pending across steps.

    Returns:
        ``{"step_ms": [...], "build_ms": [...], "eval_ms": [...]}`` (one entry per token).
    """
    out: dict[str, list[float]] = {"step_ms": [], "build_ms": [], "eval_ms": []}
    for t in tokens:
        t0 = time.perf_counter()
        logits = model(mx.array([[int(t)]], dtype=mx.int32), cache)
        t1 = time.perf_counter()
        mx.eval(logits, cache_buffers(cache))
        t2 = time.perf_counter()
        out["build_ms"].append(1e3 * (t1 - t0))
        out["eval_ms"].append(1e3 * (t2 - t1))
        out["step_ms"].append(1e3 * (t2 - t0))
    return out


def time_verify(model, cache, tokens: Sequence[int], rows: int, warmup: int = 2) -> dict:
    """Interleaved decode steps and speculative verifies, synchronously; wall times in ms.

    Step ``i`` decodes ``tokens[i]`` (the cache advances one token), then runs one forward
    over the ``rows`` tokens ``tokens[i : i + rows]`` from that decode state (a verify of
    ``rows - 1`` drafts) and rewinds it (``capture`` / ``rewind``), so both kinds of step
    see the same states. The first ``warmup`` pairs are not reported.

    Returns:
        ``{"decode_ms": [...], "verify_ms": [...]}`` (one entry per reported pair;
        ``len(tokens) - rows + 1 - warmup`` of them).
    """
    out: dict[str, list[float]] = {"decode_ms": [], "verify_ms": []}
    for i in range(len(tokens) - rows + 1):
        t0 = time.perf_counter()
        mx.eval(model(mx.array([[int(tokens[i])]], dtype=mx.int32), cache), cache_buffers(cache))
        t1 = time.perf_counter()
        saved = [c.capture() for c in cache]
        x = mx.array([[int(t) for t in tokens[i : i + rows]]], dtype=mx.int32)
        t2 = time.perf_counter()
        mx.eval(model(x, cache), cache_buffers(cache))
        t3 = time.perf_counter()
        for c, sv in zip(cache, saved, strict=True):
            c.rewind(sv)
        if i >= warmup:
            out["decode_ms"].append(1e3 * (t1 - t0))
            out["verify_ms"].append(1e3 * (t3 - t2))
    return out


def decode_step_primitives(model, cache, token: int | Sequence[int] = 0) -> dict:
    """Primitives of one decode step of ``model`` on ``cache`` (left unchanged); with a
    list of ids, of one forward over those rows (a speculative verify).

    Args:
        model: anything called as ``model(tokens (1, 1) int32, cache) -> logits``
            whose ``cache`` is a list of objects with a ``state`` dict property (ds4mlx's
            ``LayerCache``; mlx-lm's caches work as well).
        cache: the per-layer caches, typically after a prefill (already evaluated).
            Caches with ``capture()`` / ``rewind(captured)`` (ds4mlx's) are left exactly as
            they were; others (mlx-lm's update arrays in place) keep the evaluated step,
            i.e. advance by one token.
        token: the token id fed, or the ids of a multi-row step.

    Returns:
        ``count_primitives`` of the logits plus every cache array after the step, plus
        ``build_ms`` (float: Python time to build the step's graph).
    """
    mx.eval(_cache_arrays(cache))  # only the step itself must be in the graph
    rewindable = all(hasattr(c, "capture") and hasattr(c, "rewind") for c in cache)
    saved = [c.capture() for c in cache] if rewindable else None
    t0 = time.perf_counter()
    rows = [token] if isinstance(token, int) else [int(t) for t in token]
    logits = model(mx.array([rows], dtype=mx.int32), cache)
    build_ms = 1e3 * (time.perf_counter() - t0)
    arrays = [logits, *_cache_arrays(cache)]
    out = count_primitives(arrays)
    if saved is not None:
        for c, s in zip(cache, saved, strict=True):
            c.rewind(s)
    else:
        # Caches that update arrays in place (mlx-lm's) cannot be put back: keep the step.
        mx.eval(arrays, cache_buffers(cache))
    out["build_ms"] = build_ms
    return out
