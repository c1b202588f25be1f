"""The live ``Session``: token ids, per-layer KV caches, next-token logits, snapshots.

A ``Session`` is not thread-safe: all of its methods (and anything touching its MLX
arrays) must run on the inference thread. ``sample`` and ``decode`` are called by the
one turn loop (`ds4mlx.engine.turn`) only; ``prefill`` by the turn loop and by callers
that only extend the state (the agent's suffixes, benchmarks).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ds4mlx.engine.drafts import DraftView
from ds4mlx.engine.sampling import SamplingParams, sample_token, sampling_logprobs

# Prefill chunk (tokens per forward). Large enough to keep GEMMs efficient, small enough
# that the per-chunk activations stay modest and cancellation/progress stay responsive.
DEFAULT_CHUNK = 512

SNAPSHOT_FORMAT = "ds4mlx-session"
SNAPSHOT_VERSION = "1"
_LOGITS_KEY = "logits"


class ContextOverflowError(ValueError):
    """Feeding tokens would exceed the session's context size.

    Attributes:
        have: tokens already in the session.
        adding: tokens the caller tried to add.
        ctx_size: the limit.
    """

    def __init__(self, have: int, adding: int, ctx_size: int):
        self.have, self.adding, self.ctx_size = have, adding, ctx_size
        super().__init__(
            f"context overflow: {have} tokens in the session + {adding} new = "
            f"{have + adding} > context size {ctx_size}"
        )


class SnapshotError(ValueError):
    """A session snapshot is malformed or belongs to another model / cache layout."""


# --------------------------------------------------------------------------- snapshots


@dataclass
class SessionState:
    """A complete, detached copy of a session: enough to continue bit-identically.

    Attributes:
        tokens: the token ids fed to the model (list of int).
        arrays: ``"logits"`` (float32 ``(vocab,)``, absent when no token was fed) and every
            KV-cache tensor as ``"cache.{layer}.{name}"``; names and shapes are the layer
            caches' own ``.state``. The disk KV cache (``ds4mlx.kv.store``) stores them.
        meta: str → str (format, version, token count, layer count, model identity, …).
    """

    tokens: list[int]
    arrays: dict[str, mx.array]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held by ``arrays`` (int)."""
        return sum(a.nbytes for a in self.arrays.values())


def prefill_chunks(start: int, end: int, chunk_size: int, stops: Sequence[int] = ()) -> list[int]:
    """Chunk end positions for prefilling tokens ``[start, end)``.

    Chunks end at multiples of ``chunk_size`` (absolute positions, so the schedule is the
    same whether or not a prefix was reused), at every stop in ``(start, end]``, and at
    ``end``. Returns the ascending end positions.

    Raises:
        ValueError: ``chunk_size`` < 1 or ``end`` < ``start``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if end < start:
        raise ValueError(f"end ({end}) < start ({start})")
    ends = set(range((start // chunk_size + 1) * chunk_size, end, chunk_size))
    ends.update(s for s in stops if start < s <= end)
    if end > start:
        ends.add(end)
    return sorted(ends)


def _caches_from(caches: list, arrays: dict[str, mx.array]) -> list:
    """Fill fresh layer ``caches`` with a snapshot's ``cache.{layer}.{name}`` arrays
    (copied: the snapshot stays reusable). Raises ``SnapshotError`` on a foreign layout."""
    per_layer: list[dict[str, mx.array]] = [{} for _ in caches]
    for key, a in arrays.items():
        if key == _LOGITS_KEY:
            continue
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "cache" or not parts[1].isdigit():
            raise SnapshotError(f"unexpected array {key!r} in snapshot")
        layer = int(parts[1])
        if layer >= len(caches):
            raise SnapshotError(f"snapshot has layer {layer}; the model has {len(caches)}")
        per_layer[layer][parts[2]] = mx.array(a)
    try:
        for c, st in zip(caches, per_layer, strict=True):
            c.state = st
    except (KeyError, ValueError, TypeError) as e:
        raise SnapshotError(f"snapshot does not fit this model's caches: {e}") from e
    return caches


def _pipeline_part(
    engine, cache, state: SessionState, restore: bool = False, disk_key: str | None = None
) -> None:
    """A model split across ranks (`ds4mlx.engine.pipeline`): the other ranks keep (or
    restore) their layers' part of ``state``, in their memory and, under ``disk_key``, on
    their disks. Raises SnapshotError for a state whose part is not there on every rank."""
    model = engine.model
    if getattr(model, "snapshots", True) is True:
        return
    if not restore:
        model.snapshot_part(cache, state, disk_key)
        return
    try:
        model.restore_part(cache, state)
    except ValueError as e:
        raise SnapshotError(str(e)) from e


def _checked(engine, state: SessionState) -> tuple[list, mx.array | None]:
    """The caches and logits of ``state`` for ``engine``, checked (its model, its token
    count against the caches' offsets and the context size, the logits' shape).

    Raises:
        SnapshotError: a foreign or inconsistent ``state``.
        ContextOverflowError: it holds more tokens than the engine's context size.
    """
    ident, n = state.meta.get("identity"), len(state.tokens)
    if ident is not None and ident != engine.identity:
        raise SnapshotError(f"snapshot is for model {ident}, this engine is {engine.identity}")
    if n > engine.ctx_size:
        raise ContextOverflowError(0, n, engine.ctx_size)
    caches = _caches_from(engine.model.make_cache(), state.arrays)
    offsets = {getattr(c, "offset", n) for c in caches}
    if offsets != {n}:
        raise SnapshotError(f"snapshot holds {n} tokens but its caches are at {offsets}")
    logits = state.arrays.get(_LOGITS_KEY)
    if (logits is None) != (n == 0):
        raise SnapshotError("snapshot logits do not match its token count")
    vocab = engine.args.vocab_size
    if logits is not None and tuple(logits.shape) != (vocab,):
        raise SnapshotError(f"snapshot logits have shape {logits.shape}, expected ({vocab},)")
    return caches, logits


def _predicting(before: mx.array | None, rows: mx.array, chunk: list[int]):
    """``(rows, targets)`` of a chunk fed with every row's logits ``rows`` ``(L, vocab)``:
    row i predicts ``chunk[i + 1]``, its first token was predicted by the logits the
    session held before it (``before``; None: it goes unscored), its last row predicts
    what comes next."""
    if before is None:
        return rows[:-1], chunk[1:]
    return mx.concatenate([before[None], rows[:-1]]), chunk


def _eval_settled(engine, *arrays) -> None:
    """Evaluate ``arrays`` (None entries skipped), which cover everything launched, then
    `_settled`."""
    mx.eval(*(a for a in arrays if a is not None))
    _settled(engine)


def _settled(engine) -> None:
    """Everything launched is evaluated (or dropped, on reset): a model split across ranks
    stops bounding its wait on them (``--rank-timeout``, `ds4mlx.engine.deadline`)."""
    settled = getattr(engine.model, "settled", None)
    if settled is not None:
        settled()


@dataclass
class PendingStep:
    """A decode step built by `Session.begin_decode` and not yet committed: its lazy
    float32 logits ``(vocab,)`` and the caches' state captured before building."""

    logits: mx.array
    saved: list[Any]
    tapped: dict = field(default_factory=dict)  # the drafters' rows (`DraftView`)


# --------------------------------------------------------------------------- session


def split_key(session: Session, params: SamplingParams) -> mx.array:
    """A fresh subkey of ``session``'s sampling generator (seeded from ``params.seed``
    on first use): every random draw of a turn comes from this one stream."""
    if session._key is None:
        session.seed(params.seed)
    session._key, sub = mx.random.split(session._key)
    return sub


def draft_token(
    session: Session, logits: mx.array, params: SamplingParams
) -> tuple[mx.array, mx.array | None]:
    """One draft from a drafter's logits ``(vocab,)`` (lazy int32 scalar): the argmax for
    a greedy request, else a draw from the request's sampling distribution on
    ``session``'s generator, whose probabilities ``(vocab,)`` float32 come with it (the
    acceptance rule's q; None when greedy: all mass on the draft)."""
    if params.greedy:
        return mx.argmax(logits), None
    lp = sampling_logprobs(logits, params)
    return mx.random.categorical(lp, key=split_key(session, params)), mx.exp(lp)


class VerifyStep:
    """Draft verification (`ds4mlx.engine.speculative`): ``tokens`` fed tentatively from
    the live state in one forward pass, every row's logits kept; then `settle`.

    Attributes:
        logits: float32 ``(len(tokens), vocab)``; row ``i`` predicts the token after
            ``tokens[i]``.
        forwards: target forward passes this step ran (1, or 2 once `settle` re-fed).

    Undoing rejected rows: the forward wrote ring slots, compressed rows and compressor
    / indexer frontiers for every row, so `settle` with fewer tokens rewinds every cache
    to its capture and feeds the kept ones again in one forward (exact within the
    chunked-vs-full prefill tolerance); keeping all rows keeps the forward as it is.
    While unsettled, ``session.tentative`` is set and `Session.snapshot` refuses.

    Raises (constructor): ContextOverflowError when ``tokens`` do not fit; on a model
    error the session is reset, as after a failed prefill.
    """

    def __init__(self, session: Session, tokens: Sequence[int]):
        self.s, self.tokens = session, [int(t) for t in tokens]
        session._check_room(len(self.tokens))
        self.saved = [c.capture() for c in session._cache]
        self.forwards = 1
        x = mx.array(self.tokens, dtype=mx.int32)[None]
        try:
            self.logits = session.engine.model(x, session._cache)[0].astype(mx.float32)
            mx.eval(self.logits, session._cache_arrays())
        except BaseException:
            session.reset()
            raise
        self.tapped = dict(getattr(session.engine.model, "tapped", {}))
        session.tentative = self

    def settle(self, kept: Sequence[int]) -> None:
        """Keep ``kept``: a prefix of the verified tokens, possibly with its last token
        replaced (the target's correction of a rejected draft). The session then holds
        exactly what feeding ``kept`` one token at a time would leave (within tolerance).
        """
        s, kept = self.s, [int(t) for t in kept]
        s.tentative = None
        if kept == self.tokens:
            s.draft.add(len(s.tokens), self.tapped)
            s.tokens.extend(kept)
            s.logits = self.logits[-1]
            return
        for c, saved in zip(s._cache, self.saved, strict=True):
            c.rewind(saved)
        if kept:
            self.forwards += 1
            s._forward(kept)


class Session:
    """The live inference state: token ids, per-layer KV caches, next-token logits.

    Attributes:
        engine: the owning ``Engine``.
        tokens: ids fed to the model so far (list of int; do not mutate).
        logits: float32 ``(vocab,)`` logits for the next token, or None before any token.
    """

    def __init__(self, engine):
        self.engine = engine
        self.tokens: list[int] = []
        self.logits: mx.array | None = None
        self._cache = engine.model.make_cache()
        self._script: deque[int] | None = None
        self._key: mx.array | None = None
        self.tentative: VerifyStep | None = None  # unverified rows in the caches
        self.draft = DraftView(engine.model)  # what drafters keep (`ds4mlx.engine.drafts`)

    # ---- bookkeeping

    @property
    def ctx_size(self) -> int:
        """The context size in tokens (the engine's)."""
        return self.engine.ctx_size

    def room(self) -> int:
        """Tokens that can still be fed before the context is full."""
        return self.ctx_size - len(self.tokens)

    def kv_bytes(self) -> int:
        """Bytes of KV-cache state held now (all layers: window, compressed rows, indexer
        rows, compressor frontiers)."""
        return int(sum(c.nbytes for c in self._cache))

    @property
    def text(self) -> str:
        """The text ``tokens`` decode to (computed on each access)."""
        return self.engine.tokenizer.decode(self.tokens)

    def reset(self) -> None:
        """Drop all state: no tokens, empty caches, no logits, no script, unseeded."""
        self.tokens = []
        self.logits = None
        self._cache = self.engine.model.make_cache()
        self._script = None
        self._key = None
        self.draft.clear()
        _settled(self.engine)  # nothing launched before is waited for any more

    def _check_room(self, n: int) -> None:
        if len(self.tokens) + n > self.ctx_size:
            raise ContextOverflowError(len(self.tokens), n, self.ctx_size)

    def _cache_arrays(self) -> list[mx.array]:
        # Whole buffers (no view nodes): what to evaluate so no cache write stays pending.
        return [a for c in self._cache for a in c.arrays()]

    # ---- forward

    def _forward(self, tokens: list[int], *, rows: bool = False) -> mx.array:
        """Feed ``tokens``; return float32 logits ``(vocab,)`` after the last one, or with
        ``rows`` ``(len(tokens), vocab)``: the logits after each of them (the vocab
        projection then runs on every row; ``logits`` still ends as the last row)."""
        x = mx.array(tokens, dtype=mx.int32)[None]
        try:
            if rows:
                every = self.engine._row_logits(x, self._cache)
                logits = every[-1]
            else:
                every = logits = self.engine._last_logits(x, self._cache)
            # Evaluate the cache too: its frontier state is not always on the logits'
            # graph, and a lazy graph would otherwise grow across calls.
            _eval_settled(self.engine, every, logits, self._cache_arrays())
        except BaseException:
            # The caches may hold part of this chunk: the only consistent state left is
            # the empty one. (KeyboardInterrupt included: callers keep the session.)
            self.reset()
            raise
        self.draft.add(len(self.tokens))
        self.tokens.extend(tokens)
        self.logits = logits
        return every

    def prefill(
        self,
        tokens: Iterable[int],
        *,
        chunk_size: int = DEFAULT_CHUNK,
        progress: Callable[[int, int], Any] | None = None,
        cancel: Callable[[], bool] | None = None,
        checkpoints: Sequence[int] = (),
        on_checkpoint: Callable[[Session, int], Any] | None = None,
        on_rows: Callable[[mx.array, list[int]], Any] | None = None,
    ) -> int:
        """Append ``tokens`` to the session in forward passes of at most ``chunk_size``.

        Chunks end at absolute multiples of ``chunk_size`` (`prefill_chunks`), so a prompt
        continued from a reused prefix is fed in the same chunks as a cold prefill of the
        whole prompt, and at every checkpoint: after the chunk that ends at checkpoint
        ``n`` (an absolute token count), ``on_checkpoint(self, n)`` runs while the session
        holds exactly ``n`` tokens (snapshots cannot be trimmed backwards afterwards).
        Only the logits after the last token of each chunk are computed (the vocab
        projection runs on one row); ``logits`` ends as the next-token logits.

        Args:
            tokens: ids to feed (int).
            chunk_size: tokens per forward pass (>= 1).
            progress: ``progress(done, total)`` (token counts of this call) before the
                first chunk and after each chunk.
            cancel: polled before each chunk; True stops the prefill. The session then
                holds the chunks fed so far, consistently.
            checkpoints: absolute token counts where a chunk must end.
            on_checkpoint: called at each checkpoint reached.
            on_rows: scoring a prompt: after each chunk, ``on_rows(rows, targets)``,
                the float32 logits ``(k, vocab)`` each of the chunk's ``k`` tokens was
                predicted from (`_predicting`). The vocab projection then runs on every
                row (265 MB per 512-row chunk at Flash's 129,280).
        Returns:
            The number of tokens fed (``len(tokens)`` unless cancelled).
        Raises:
            ContextOverflowError: the tokens do not fit; nothing is fed.
            ValueError: ``chunk_size`` < 1.
        On any error raised by the model itself the session is reset (its caches may
        hold part of a chunk) and the error propagates.
        """
        tokens = [int(t) for t in tokens]
        self._check_room(len(tokens))
        start, total = len(self.tokens), len(tokens)
        marks = set(checkpoints)
        if progress is not None:
            progress(0, total)
        done = 0
        for end in prefill_chunks(start, start + total, chunk_size, checkpoints):
            if cancel is not None and cancel():
                break
            chunk, before = tokens[done : end - start], self.logits
            rows = self._forward(chunk, rows=on_rows is not None)
            if on_rows is not None:
                on_rows(*_predicting(before, rows, chunk))
            done = end - start
            if progress is not None:
                progress(done, total)
            if end in marks and on_checkpoint is not None:
                on_checkpoint(self, end)
        return done

    def decode(self, token: int) -> mx.array:
        """Feed one token; return (and store in ``logits``) the next-token logits.

        Raises:
            ContextOverflowError: the context is full.
        """
        self._check_room(1)
        return self._forward([int(token)])

    # ---- sampling

    def seed(self, seed: int | None) -> None:
        """(Re)seed the session's sampling generator; None draws a fresh random seed.

        Call at the start of each request whose ``SamplingParams.seed`` is set
        (``generate`` does): the same seed then reproduces the same tokens.
        """
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self._key = mx.random.key(seed)

    def set_script(self, tokens: Iterable[int] | None) -> None:
        """Scripted decoding (tests only): ``sample`` returns these ids, in order.

        The forward pass still runs for every token the caller feeds, so KV state,
        logits and usage stay real. When the script is exhausted normal sampling
        resumes. None clears the script.
        """
        self._script = None if tokens is None else deque(int(t) for t in tokens)

    @property
    def script_remaining(self) -> int:
        """Scripted tokens not yet returned by ``sample`` (0 when no script is set)."""
        return len(self._script) if self._script else 0

    def sample(self, params: SamplingParams, *, greedy: bool = False) -> int:
        """Pick the next token (int) from ``logits`` (does not feed it; see ``decode``):
        the next scripted one when a script is set, argmax when ``params`` is greedy or
        ``greedy`` (protocol structure, docs/ARCHITECTURE.md §4). Raises RuntimeError
        before any token was fed."""
        return int(self.sample_async(params, greedy=greedy).item())

    def sample_async(
        self, params: SamplingParams, *, greedy: bool = False, logits: mx.array | None = None
    ) -> mx.array:
        """`sample` without waiting: a uint32 scalar array whose evaluation is launched
        (``mx.async_eval``) in its own call, so reading it later waits for the sampling
        only, not for a forward built on top of it meanwhile. ``logits``: ``(vocab,)``
        to sample from instead of the session's (a masked copy of them). Raises like
        `sample`."""
        if self._script:
            tok = self._script.popleft()
            if not self._script:
                self._script = None
            return mx.array(tok, dtype=mx.uint32)
        if self.logits is None:
            raise RuntimeError("no logits to sample from: feed a prompt first")
        logits = self.logits if logits is None else logits
        if greedy or params.greedy:
            t = mx.argmax(logits)
        else:
            t = sample_token(logits, params, split_key(self, params))
        mx.async_eval(t)
        return t

    # ---- pipelined decode (docs/ARCHITECTURE.md §3: the feeding rule)

    def begin_decode(self, token: mx.array) -> PendingStep | None:
        """Build — do not evaluate — the forward pass that feeds ``token`` (a lazy scalar
        from `sample_async`), so the graph is built while the token is still being
        sampled. Then `commit` it once the token is known not to end the turn, or
        `abandon` it. Returns None when the context has no room for it.

        The caches' Python-side state is captured first: building only rebinds arrays
        and counters (writes are functional), and nothing is evaluated before `commit`,
        so `abandon` puts them back exactly.
        """
        if self.room() < 1:
            return None
        saved = [c.capture() for c in self._cache]
        x = token.reshape(1, 1).astype(mx.int32)
        try:
            logits = self.engine._last_logits(x, self._cache)
        except BaseException:
            self.reset()
            raise
        return PendingStep(logits, saved, dict(getattr(self.engine.model, "tapped", {})))

    def commit(self, step: PendingStep, token: int) -> None:
        """Feed the built step: ``token`` joins the session and its forward pass (logits
        and every cache array) starts evaluating (``mx.async_eval``)."""
        self.draft.add(len(self.tokens), step.tapped)
        self.tokens.append(int(token))
        self.logits = step.logits
        mx.async_eval(step.logits, *self._cache_arrays())

    def abandon(self, step: PendingStep) -> None:
        """Undo a built, uncommitted step: the caches are as before `begin_decode`."""
        for c, saved in zip(self._cache, step.saved, strict=True):
            c.rewind(saved)

    def sync(self) -> None:
        """Wait for every launched evaluation (logits and caches)."""
        _eval_settled(self.engine, self.logits, *self._cache_arrays())

    # ---- snapshots

    def snapshot(self, disk_key: str | None = None) -> SessionState:
        """A detached, evaluated copy of tokens, logits and every cache tensor. ``disk_key``:
        the disk key it is saved under (a pipeline split's ranks save their parts there).
        Raises RuntimeError while a `VerifyStep` is unsettled."""
        if self.tentative is not None:
            raise RuntimeError("snapshot while unverified draft rows are in the caches")
        arrays: dict[str, mx.array] = {}
        if self.logits is not None:
            arrays[_LOGITS_KEY] = mx.array(self.logits)
        for i, c in enumerate(self._cache):
            for name, a in c.state.items():
                arrays[f"cache.{i}.{name}"] = mx.array(a)
        mx.eval(arrays)
        meta = {
            "format": SNAPSHOT_FORMAT,
            "version": SNAPSHOT_VERSION,
            "identity": self.engine.identity,
            "quant": self.engine.quant_desc,
            "n_tokens": str(len(self.tokens)),
            "n_layers": str(len(self._cache)),
        }
        state = SessionState(tokens=list(self.tokens), arrays=arrays, meta=meta)
        _pipeline_part(self.engine, self._cache, state, disk_key=disk_key)
        return state

    def restore(self, state: SessionState) -> None:
        """Replace this session's state with a copy of ``state``.

        Any script and the sampling generator are kept as they are.

        Raises:
            SnapshotError: a foreign, inconsistent or partless (split model) ``state``;
                the session is unchanged.
            ContextOverflowError: it holds more tokens than this context size.
        """
        caches, logits = _checked(self.engine, state)
        _pipeline_part(self.engine, caches, state, restore=True)
        self.draft.clear()
        self._cache = caches
        self.tokens = list(state.tokens)
        self.logits = None if logits is None else mx.array(logits)
        mx.eval(self._cache_arrays(), *([self.logits] if self.logits is not None else []))
