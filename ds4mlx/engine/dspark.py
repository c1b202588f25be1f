"""The DSpark drafter in the draft→verify step (`ds4mlx.engine.speculative`).

The network (context features, stages, Markov head) is ``ds4mlx.model.dspark``; here the
block's drafts are chosen: greedily (argmax of base + Markov logits, one after the
other) for a greedy request, else drawn from the request's sampling distribution of
those logits, whose probabilities go to the acceptance rule as ``q``.

The context rows are projected from the target layers' outputs that the session holds
(``session.draft``, `ds4mlx.engine.drafts`): each position once, kept in the session's
drafter state (``draft.state["dspark"]``, dropped with the rows on reset / restore), not
once per proposal. A session's tokens only grow between those, so rows once projected
stay right.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ds4mlx.engine.session import Session, draft_token
from ds4mlx.model.dspark import DSpark
from ds4mlx.model.dspark_loading import load_dspark
from ds4mlx.model.errors import LoadError
from ds4mlx.sampling import SamplingParams


class DSparkDrafter:
    """``propose(session, t0, limit, sampling)`` over a loaded `DSpark` network."""

    name = "dspark"

    def __init__(self, net: DSpark):
        self.net = net
        self.window = net.args.window_size

    @property
    def block_size(self) -> int:
        return self.net.cfg.block_size

    def context(self, session: Session) -> tuple[int, mx.array] | None:
        """``(start, rows (S, dim))``: the context rows of positions ``start …
        len(session.tokens) - 1`` (at most ``window`` of them, evaluated); None when the
        session holds no target outputs for its newest position."""
        view, L = session.draft, len(session.tokens)
        first = view.first
        if first is None or not L:
            return None
        lo = max(first, L - self.window)
        start, rows = view.state.get(self.name) or (lo, None)
        end = start + (0 if rows is None else rows.shape[0])
        if rows is None or not start <= lo <= end <= L:
            start, end, rows = lo, lo, None
        if end < L:
            outs = [view.rows(i, end, L) for i in self.net.cfg.target_layers]
            if any(o is None for o in outs):
                return None
            new = self.net.context(outs)
            rows = new if rows is None else mx.concatenate([rows, new])
        rows = rows[lo - start :]
        mx.eval(rows)
        view.state[self.name] = (lo, rows)
        return lo, rows

    def propose(
        self, session: Session, t0: int, limit: int, sampling: SamplingParams
    ) -> tuple[list[int], Sequence[mx.array]]:
        """Up to ``min(limit, block_size)`` drafts to follow ``t0`` (about to be fed after
        ``session.tokens``), and their drafting distributions ``(vocab,)`` (empty for a
        greedy request: the drafts are deterministic). No drafts when the session holds
        no target outputs yet (e.g. just restored from a snapshot)."""
        n = min(limit, self.block_size)
        got = self.context(session) if n >= 1 else None
        if got is None:
            return [], []
        base = self.net.base_logits(got[1], got[0], int(t0), n)
        prev = mx.array([int(t0)], dtype=mx.int32)
        drafts, qs = [], []
        for i in range(n):
            logits = base[i] + self.net.markov(prev)[0]
            tok, q = draft_token(session, logits, sampling)
            if q is not None:
                qs.append(q)
            drafts.append(tok)
            prev = tok.reshape(1).astype(mx.int32)
        mx.eval(drafts, qs)
        return [int(d.item()) for d in drafts], qs


def dspark_drafter(engine: Any, mode: str) -> DSparkDrafter | None:
    """The checkpoint's DSpark drafter for ``--speculative mode`` (loaded and attached to
    the target), or None: ``mode`` neither ``dspark`` nor ``auto``, or ``auto`` on a
    checkpoint without one, or whose ``mtp.*`` tensors are all gone (then the target
    reports no layer outputs).

    Raises:
        ValueError: ``dspark`` on a checkpoint without a DSpark drafter, or a malformed
            drafter (the message names the field or tensor).
    """
    model = engine.model
    if mode not in ("dspark", "auto"):
        return None
    try:
        net = load_dspark(
            str(engine.path), engine.args, model, engine.config, required=mode == "dspark"
        )
    except LoadError as e:
        raise ValueError(f"--speculative {mode}: {e}") from e
    if net is None and mode == "dspark":
        other = (
            "it has MTP blocks: use --speculative mtp (or auto)"
            if engine.args.drafter == "mtp"
            else "use lookup or off"
        )
        raise ValueError(
            f"--speculative dspark: {engine.path} has no DSpark drafter (no dspark_block_size "
            f"in config.json); {other}"
        )
    return None if net is None else DSparkDrafter(net)
