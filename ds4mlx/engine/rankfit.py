"""The fit check of a split model (``--distributed``), one rank at a time.

The whole-model check (`ds4mlx.model.fit.check_fit`) would refuse exactly the models a
split is for, so each rank checks what it holds (`ds4mlx.model.fit.RankPart`: its layers'
weights and their KV at ``--ctx`` for every resident state, rank 0 also the embedding and
head) against its own machine's memory, before any weight is read. The ranks then share
the outcome with one ``all_sum``, so rank 0 can say in one line which rank does not fit,
and every rank refuses to start.
"""

from __future__ import annotations

import logging

import mlx.core as mx

from ds4mlx.model.fit import RankPart

from .deadline import RANK_TIMEOUT_S, ring_sockets, wait_closed

log = logging.getLogger("ds4mlx.engine")


def pipeline_parts(ranges: list[range]) -> list[RankPart]:
    """What each rank of a pipeline split holds: its layer range; rank 0 the ends too."""
    world = len(ranges)
    return [RankPart(r, world, layers, ends=r == 0) for r, layers in enumerate(ranges)]


def tensor_parts(n_layers: int, world: int) -> list[RankPart]:
    """What each rank of a tensor split holds: every layer, its share of the split ones."""
    return [RankPart(r, world, range(n_layers), ends=True, split=world) for r in range(world)]


def _outlived(timeout_s: float) -> None:
    """Wait until a neighbour on the ring has exited (its socket closes), at most
    ``timeout_s`` seconds: rank 0 goes first, then each rank after it."""
    wait_closed(ring_sockets(), timeout_s)


def share_refusal(code: int, rank_timeout: float = RANK_TIMEOUT_S) -> tuple[int, int] | None:
    """Every rank's refusal to start (``code``: its exit code, 0: none), shared with one
    ``all_sum`` before anything else is sent (a collective: every rank of the launch
    calls it; it joins the ring). Returns None when no rank refused, else ``(the first
    refusing rank, its code)``. Then a rank > 0 returns only once its neighbour has
    exited (at most ``rank_timeout``), so rank 0 says why first and ``mlx.launch``, which
    stops the other ranks once one has failed, stops none of them by a signal."""
    group = mx.distributed.init()
    rows = [0] * group.size()
    rows[group.rank()] = code
    if group.size() > 1:
        rows = mx.distributed.all_sum(mx.array(rows, dtype=mx.int32), group=group).tolist()
    refused = [(r, c) for r, c in enumerate(rows) if c]
    if not refused:
        return None
    if group.rank() > 0:
        _outlived(rank_timeout)
    return refused[0]


def check_ranks_fit(
    path: str,
    group,
    parts: list[RankPart],
    ctx_size: int | None,
    sessions: int,
    rank_timeout: float = RANK_TIMEOUT_S,
) -> str | None:
    """Check this rank's part of ``path`` (``parts[group.rank()]``) against this machine's
    memory and learn every other rank's outcome (a collective: every rank calls it).
    ``sessions``: rank 0's resident states; the followers keep as many sets of caches,
    so rank 0's number is shared first and theirs is ignored. A refused rank > 0 returns
    only once its previous neighbour has exited (so rank 0, which says why, exits first:
    ``mlx.launch`` kills the other ranks once one has failed), or after ``rank_timeout``.

    Returns:
        None when every rank fits, else the line to refuse with: on rank 0 it names the
        first rank that does not fit, with its numbers (every rank that does not fit also
        logs its own report).
    Raises:
        ValueError: a bad config or memory limit (``check_fit``'s).
    """
    from ds4mlx.model.errors import FitError
    from ds4mlx.model.fit import check_fit
    from ds4mlx.model.units import format_bytes

    rank = group.rank()
    mine = mx.array([sessions if rank == 0 else 0], dtype=mx.int32)
    sessions = int(mx.distributed.all_sum(mine, group=group).item())
    rows = [[0, 0] for _ in parts]
    try:
        check_fit(path, ctx_size, sessions, part=parts[rank])
    except FitError as e:
        log.error("%s", e)
        rows[rank] = [e.report.total, e.report.available]
    # float32: a row has one contributor, so its bytes come through to 7 digits.
    shared = mx.distributed.all_sum(mx.array(rows, dtype=mx.float32), group=group).tolist()
    short = [(r, need, have) for r, (need, have) in enumerate(shared) if need]
    if not short:
        return None
    r, need, have = short[0]
    if rank > 0:
        _outlived(rank_timeout)
        return f"rank {r} does not fit its memory (rank 0 says why)"
    hint = "give it fewer layers (--pipeline-split) or " if parts[r].split == 1 else ""
    return (
        f"{parts[r].describe()} does not fit its memory: its weights, KV at --ctx and "
        f"working memory need {format_bytes(int(need))} of {format_bytes(int(have))}; "
        f"{hint}use more ranks, a smaller --ctx or fewer --sessions"
    )
