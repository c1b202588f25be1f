"""The checkpoint's MTP head as a drafter (``--speculative mtp`` / ``auto``).

The block (`ds4mlx.model.mtp.MTPBlock`) at position ``i`` reads the target's final
streams after token ``t_i`` and the embedding of ``t_{i+1}``, and predicts ``t_{i+2}``.
Its own KV cache (one window-only layer on Flash) holds one row per target position,
always computed from the target's streams and the tokens the session kept, so it
follows accepted tokens only:

1. **catch up**: the rows from the cache's frontier to the newest position ``L - 1``
   (the last of them paired with ``t0``, the token the loop is about to feed), read from
   the session's `ds4mlx.engine.drafts.DraftView`, in one forward; its last row gives
   draft ``d1``;
2. **chain**: drafts ``d2 … dk`` feed the block its own output streams and the previous
   draft, one row each (one block reused, as for a checkpoint with one MTP layer);
3. **rewind** the cache to the end of step 1: chained rows never stay. ``t0`` is always
   fed by the loop, so the row paired with it stays.

When the frontier is missing (a new or restored session, a long pause by the back-off)
the cache is rebuilt from the newest ``window`` held positions: a window-only layer
attends to nothing older, so that is exact for Flash's block. The cache runs in its own
position frame (row 0 at the first rebuilt position): attention with RoPE on queries,
keys and the de-rotated output depends on relative positions only.

Greedy turns draft the block's argmax; sampled turns draw from its distribution under
the turn's sampling settings and hand that distribution to the acceptance rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ds4mlx.engine.sampling import SamplingParams
from ds4mlx.engine.session import draft_token
from ds4mlx.model.cache import LayerCache


@dataclass
class _State:
    """One session's MTP cache: rows for target positions ``base … base + n - 1``;
    ``last`` is the token the newest row was paired with (``t_{base+n}``)."""

    cache: LayerCache
    base: int
    n: int = 0
    last: int = -1


class MTPDrafter:
    """Drafts with ``model.mtp[0]`` (see the module doc). ``propose`` is what
    `ds4mlx.engine.speculative.Drafting` calls."""

    name = "mtp"

    def __init__(self, model):
        self.model = model
        self.block = model.mtp[0]
        self.layer = model.args.n_layers - 1  # the tap: the final streams
        self.window = self.block.block_args.window_size
        self.ratio = self.block.block_args.compress_ratios[0]

    def _state(self, session, L: int) -> _State | None:
        """The session's state, valid for catching up to position ``L - 1``; rebuilt
        (from the newest ``window`` held positions) when it is not; None when the
        session holds no tapped row for ``L - 1``."""
        view = session.draft
        st = view.state.get(self.name)
        if st is not None:
            f = st.base + st.n
            if f < L and st.last == session.tokens[f] and f >= L - self.window:
                if view.rows(self.layer, f, L) is not None:
                    return st
        first = view.first
        if first is None or view.rows(self.layer, L - 1, L) is None:
            return None
        start = max(first, L - self.window)
        if self.ratio:  # keep compression blocks aligned with the target's positions
            start += -start % self.ratio
        if start >= L or view.rows(self.layer, start, L) is None:
            start = L - 1
        st = _State(self.block.make_cache(), base=start)
        view.state[self.name] = st
        return st

    def propose(
        self, session, t0: int, limit: int, sampling: SamplingParams
    ) -> tuple[list[int], list[mx.array | None]]:
        """Up to ``limit`` drafts to follow ``t0`` (the sampled token about to be fed
        after ``session.tokens``) and, per draft, the drafter's distribution ``(vocab,)``
        (probabilities; None when greedy: all mass on the draft). Empty when the session
        holds no hidden state to draft from."""
        L = len(session.tokens)
        st = self._state(session, L) if L and limit >= 1 else None
        if st is None:
            return [], []
        f = st.base + st.n
        h = session.draft.rows(self.layer, f, L)
        nxt = mx.array([*session.tokens[f + 1 : L], int(t0)], dtype=mx.int32)
        cache, model = st.cache, self.model
        logits, x = self.block.forward(model, h, nxt, cache, model.step_for(cache.offset, L - f))
        st.n, st.last = st.n + (L - f), int(t0)
        mx.eval(logits, x, cache.arrays())
        kept = cache.capture()
        drafts, qs = [], []
        try:
            while True:
                tok, q = draft_token(session, logits, sampling)
                d = int(tok.item())
                drafts.append(d)
                qs.append(q)
                if len(drafts) == limit:
                    break
                tok = mx.array([d], dtype=mx.int32)
                ctx = model.step_for(cache.offset, 1)
                logits, x = self.block.forward(model, x[-1:], tok, cache, ctx)
        finally:
            cache.rewind(kept)
        return drafts, ([] if sampling.greedy else qs)


def drafted_continuation(engine, prompt: list[int], n: int) -> list[int]:
    """``n`` tokens that the MTP head drafts right, for tests and benchmarks: the target's
    greedy first token after ``prompt``, then each time the head's greedy draft after the
    tokens so far (fed one at a time on a new session of ``engine``, whose MTP blocks
    must be loaded). Scripted as the target's choices, every verify accepts the head's
    first draft; its chained drafts are whatever the head makes of them."""
    drafter = MTPDrafter(engine.model)
    s = engine.new_session()
    s.prefill(prompt)
    out = [int(mx.argmax(s.logits).item())]
    while len(out) < n:
        (d,), _ = drafter.propose(s, out[-1], 1, SamplingParams(temperature=0))
        s.decode(out[-1])
        out.append(d)
    return out
