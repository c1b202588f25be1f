"""What a session keeps for drafters that read the target's hidden states.

A drafter such as the checkpoint's MTP head (`ds4mlx.engine.mtp`) reads the target's
output streams of given layers (`ds4mlx.model.network.Model.add_taps`: the MTP head taps
the last layer) at the positions it drafts from. Every forward of a session — prefill
chunks, decode steps, verify steps that keep all their rows, the re-feed of a settled
verify — hands its tapped rows here, so ``rows`` has the final hidden state of every fed
row back to ``Model.tap_rows`` positions before the newest. A verify's rejected rows never
get here (`ds4mlx.engine.session.VerifyStep.settle` re-feeds the kept tokens), so what is
kept follows the session's tokens exactly.

``state`` is the drafters' own per-session state (the MTP head's KV cache); both are
dropped whenever the session's tokens are replaced (reset, restore). Drafting quality may
drop for a while after that; what the session outputs never depends on it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


class DraftView:
    """Tapped rows of one session (see the module doc).

    Attributes:
        chunks: ``(start position, {layer: streams (n, hc, dim)})`` per forward, oldest
            first; only while the model has taps.
        state: drafter name -> that drafter's per-session state.
    """

    def __init__(self, model):
        self.model = model
        self.chunks: list[tuple[int, dict[int, mx.array]]] = []
        self.state: dict[str, Any] = {}

    def clear(self) -> None:
        """Forget the rows and every drafter's state (the tokens were replaced)."""
        self.chunks, self.state = [], {}

    def add(self, start: int, tapped: dict[int, mx.array] | None = None) -> None:
        """Keep the rows of the forward just fed at position ``start`` (``tapped``: its
        `Model.tapped`, default the model's latest); drop chunks older than the newest
        ``Model.tap_rows`` positions."""
        keep = getattr(self.model, "tap_rows", 0)
        if not keep:
            return
        tapped = self.model.tapped if tapped is None else tapped
        if not tapped:
            return
        self.chunks.append((start, dict(tapped)))
        end = start + next(iter(tapped.values())).shape[0]
        while self.chunks and self._end(self.chunks[0]) <= end - keep:
            self.chunks.pop(0)

    @staticmethod
    def _end(chunk) -> int:
        start, rows = chunk
        return start + next(iter(rows.values())).shape[0]

    @property
    def first(self) -> int | None:
        """The oldest position with rows held, or None."""
        return self.chunks[0][0] if self.chunks else None

    def rows(self, layer: int, start: int, end: int) -> mx.array | None:
        """Streams ``(end - start, hc, dim)`` of ``layer`` at positions ``[start, end)``,
        or None when some of them are not held."""
        parts, pos = [], start
        for c0, tapped in self.chunks:
            a = tapped.get(layer)
            c1 = c0 + (a.shape[0] if a is not None else 0)
            if a is None or c1 <= pos or c0 > pos:
                continue
            take = a[pos - c0 : min(c1, end) - c0]
            parts.append(take)
            pos += take.shape[0]
            if pos >= end:
                break
        if pos < end or not parts:
            return None
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)
