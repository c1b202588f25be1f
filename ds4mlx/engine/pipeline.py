"""Pipeline parallelism: the network's layers split across ranks of MLX distributed.

Run under MLX's own launcher (``mlx.launch --backend ring --hosts H1,H2 -- python -m
ds4mlx.cli …``); no home-made transport. Every rank holds a contiguous range of layers
(`split_layers`); rank 0 also holds the embedding, the head, the tokenizer, sampling and
every ``Session`` (so `engine.turn`, `kv/` and the routes are unchanged: rank 0's model is a
`PipelineModel` with the network's call signature).

One forward call on rank 0 (a prefill chunk or a decode step):

1. rank 0 sends a header (int32 ``(HEADER_LEN,)``: op, token count, cache-state id, a
   freed state id or -1, last-only flag) and the token ids (int32 ``(L,)``: hash-routed
   layers read ``tid2eid[token]``, and a split may put them past rank 0) to rank 1, then
   embeds the tokens, runs its layers and sends the residual streams (``(L, hc, dim)`` in
   the compute dtype). Header and ids go first so that rank 1 builds its part of the call
   while rank 0 computes, and starts computing the moment the streams land;
2. each rank passes header and ids on, runs its layers and passes the streams on; the
   last rank sends the streams (only the last row for a last-only call) back to rank 0,
   which is the next rank on the ring;
3. rank 0 applies the head. The logits are what one process computes: the same layers,
   the same order, the same dtype (rank 0 holds the head so sampling needs nothing
   more from the others; sending logits instead would cost ``vocab`` floats per row).

Everything rank 0 sends is a lazy graph node chained with ``mx.depends`` to the streams
it receives back, so a step that is built and then abandoned (pipelined decode,
``Session.abandon``) sends nothing and the followers' caches stay in step. DeepSeek V4
carries no state from one layer to the next besides each layer's own caches and the
residual streams passed in the call, so the split needs nothing else.

The followers (`follow`) keep one set of layer caches per rank-0 cache list (its
``state_id``); rank 0 reports cache lists it dropped in later headers so followers free
theirs.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .deadline import RANK_TIMEOUT_S, StepDeadline, ring_sockets, wait_for_bytes

OP_FORWARD, OP_SHUTDOWN, OP_SNAPSHOT, OP_RESTORE, OP_LOAD, OP_HOP = 1, 2, 3, 4, 5, 6
# Header fields: op, token count (hop: round trips), state id, freed state id (or -1),
# last-only flag or snapshot id or "loaded so far" flag or hop width, freed snapshot id
# (or -1), then two disk snapshot keys of `KEY_WORDS` each (zeros: none): the key a
# snapshot part is saved under or loaded from, and one key rank 0's store removed (the
# followers remove their parts).
KEY_WORDS = 5  # a key is 40 hex digits: 20 bytes, 5 int32 words
HEADER_LEN = 6 + 2 * KEY_WORDS


def _key_words(key: str | None) -> list[int]:
    """A 40-hex-digit key as `KEY_WORDS` int32 words (zeros for None)."""
    if key is None:
        return [0] * KEY_WORDS
    return np.frombuffer(bytes.fromhex(key), dtype="<i4").tolist()


def _words_key(words: list[int]) -> str | None:
    """The inverse of `_key_words`."""
    if not any(words):
        return None
    return np.asarray(words, dtype="<i4").tobytes().hex()


def read_header(words: list[int]) -> tuple[int, int, int, int, int, int, str | None, str | None]:
    """A follower's view of a header: ``(op, n, state_id, freed, arg, freed_snap, key,
    dropped)``, the fields of the layout above with both keys decoded (None: no key)."""
    op, n, state_id, freed, arg, freed_snap = words[:6]
    key = _words_key(words[6 : 6 + KEY_WORDS])
    return op, n, state_id, freed, arg, freed_snap, key, _words_key(words[6 + KEY_WORDS :])


def forget_freed(follower, freed: int, freed_snap: int, dropped: str | None) -> None:
    """What every follower does first with a header: remove the disk part rank 0's store
    dropped, and forget the state and the snapshot rank 0 freed (ids absent: nothing)."""
    if dropped is not None and follower.parts is not None:
        follower.parts.remove(dropped)
    follower.states.pop(freed, None)
    follower.snaps.pop(freed_snap, None)


class PipelineError(ValueError):
    """A split that cannot run: it does not cover the layers, or there are more ranks than
    layers. The message is one line for the user."""


def split_layers(n_layers: int, world: int, starts: list[int] | None = None) -> list[range]:
    """Contiguous layer ranges, one per rank.

    Args:
        n_layers: layers of the network.
        world: number of ranks (>= 1).
        starts: the first layer of each rank after rank 0 (``--pipeline-split 22`` for two
            ranks); None splits as evenly as possible, the remainder to the first ranks.
    Returns:
        ``world`` ranges covering ``range(n_layers)`` in order, each non-empty.
    Raises:
        PipelineError: more ranks than layers, or ``starts`` that are not increasing,
            in ``1 .. n_layers - 1``, or not ``world - 1`` of them.
    """
    if world < 1:
        raise PipelineError(f"pipeline needs at least 1 rank, got {world}")
    if world > n_layers:
        raise PipelineError(f"{world} ranks but the model has only {n_layers} layers")
    if starts is None:
        base, extra = divmod(n_layers, world)
        sizes = [base + (1 if r < extra else 0) for r in range(world)]
        starts = list(itertools.accumulate(sizes))[:-1]
    if len(starts) != world - 1:
        raise PipelineError(
            f"--pipeline-split names {len(starts)} start layer(s); {world} ranks need {world - 1}"
        )
    bounds = [0, *starts, n_layers]
    if any(b >= e for b, e in itertools.pairwise(bounds)):
        raise PipelineError(
            f"--pipeline-split {','.join(map(str, starts))} does not split layers 0..{n_layers - 1}"
            " into non-empty increasing ranges"
        )
    return [range(b, e) for b, e in itertools.pairwise(bounds)]


class _Absent:
    """Stands in for a layer another rank holds: its weights are never read on this rank
    (they stay lazy), and calling it is a bug."""

    def __call__(self, *a, **k):
        raise RuntimeError("this layer lives on another pipeline rank")


def keep_layers(model, layers: range) -> None:
    """Drop every layer of ``model`` outside ``layers`` so its lazy weights are never read
    here (each rank reads only its own layers from disk)."""
    for i in range(len(model.layers)):
        if i not in layers:
            model.layers[i] = _Absent()


class PipelineCache(list):
    """Rank 0's caches of one session state: its own layers' ``LayerCache`` objects, plus
    the ``state_id`` that names the followers' caches of the same state."""

    state_id: int


@dataclass
class _Peers:
    group: object
    ranges: list[range]

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def world(self) -> int:
        return self.group.size()

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world


def _send_chain(arrays: list[mx.array], dst: int, group) -> mx.array:
    """Send ``arrays`` to ``dst`` in this order (each send depends on the previous one, so
    the receiver's ``recv`` calls see them in order); returns the last send node."""
    last: mx.array | None = None
    for a in arrays:
        last = mx.distributed.send(a if last is None else mx.depends(a, [last]), dst, group=group)
    return last


def relay(peers: _Peers, round_trips: int, shape: tuple, dtype) -> list[float]:
    """The hop: ``round_trips`` times an array ``shape`` of ``dtype`` goes rank 0 -> 1 ->
    … -> 0 with ``mx.distributed.send``/``recv``, as a forward call's streams do. Rank 0
    times each round trip (wall ms, list); every other rank passes the array on and gets
    an empty list. Raises MLX's ``RuntimeError`` when a peer is lost."""
    times: list[float] = []
    g = peers.group
    x = mx.zeros(shape, dtype)
    mx.eval(x)
    for _ in range(round_trips):
        if peers.rank == 0:
            t0 = time.perf_counter()
            sent = mx.distributed.send(x, peers.next, group=g)
            mx.eval(mx.depends(mx.distributed.recv(shape, dtype, peers.prev, group=g), [sent]))
            times.append(1e3 * (time.perf_counter() - t0))
        else:
            got = mx.distributed.recv(shape, dtype, peers.prev, group=g)
            mx.eval(mx.distributed.send(got, peers.next, group=g))
    return times


class PipelineModel:
    # Each follower keeps its part of a snapshot in memory and, for a disk save, writes
    # it to its own disk under the same key (`ds4mlx.kv.parts`).
    snapshots = "parts"

    """Rank 0's model in a pipeline split: the `Model` call signature
    (``model(tokens, cache, last_only=…)``, ``make_cache()``, ``args``, ``layers``) over its
    own layers plus the other ranks'. See the module docstring for one call's traffic.

    Attributes:
        model: the full ``Model`` (other ranks' layers replaced by stand-ins).
        ranges: layer range per rank.
    """

    def __init__(self, model, group, ranges: list[range], rank_timeout: float = RANK_TIMEOUT_S):
        self.model = model
        self.args = model.args
        self.ranges = ranges
        self._control_plane(group, ranges, rank_timeout)
        keep_layers(model, ranges[0])

    def _control_plane(self, group, ranges: list[range], rank_timeout: float) -> None:
        self._peers = p = _Peers(group, ranges)
        who = "rank 1" if p.world == 2 else f"rank {p.next} or rank {p.prev}"
        # Bounds every wait on the followers (``--rank-timeout``, `ds4mlx.engine.deadline`).
        self.deadline = StepDeadline(rank_timeout, who)
        self._ids = itertools.count(1)
        # State ids whose rank-0 cache list was garbage-collected; a finalizer may run on
        # any thread, so the list is guarded.
        self._freed: list[int] = []
        self._freed_snaps: list[int] = []
        # Disk snapshot keys rank 0's store removed (its writer thread reports them).
        self._dropped: list[str] = []
        self._snap_ids = itertools.count(1)
        self._lock = threading.Lock()
        # Set once a peer is known to be gone: nothing more is sent to it.
        self.lost: str | None = None

    @property
    def world(self) -> int:
        """Ranks of the split."""
        return self._peers.world

    def __getattr__(self, name):
        # Everything else (compute_dtype, sinkhorn_impl, named_modules, …) is the model's.
        return getattr(self.model, name)

    def make_cache(self) -> PipelineCache:
        """Fresh caches for rank 0's layers, under a new state id."""
        full = self.model.make_cache()
        cache = PipelineCache(full[i] for i in self.ranges[0])
        cache.state_id = next(self._ids)
        weakref.finalize(cache, self._free, cache.state_id)
        return cache

    def _free(self, state_id: int) -> None:
        with self._lock:
            self._freed.append(state_id)

    def __call__(self, tokens: mx.array, cache: PipelineCache, *, last_only: bool = False):
        """Float32 logits ``(1, L, vocab)`` (``(1, 1, vocab)`` with ``last_only``) for int32
        ``tokens`` ``(1, L)`` or ``(L,)``, fed after ``cache``; the followers' caches of the
        same state advance with it when the result is evaluated."""
        if tokens.ndim == 2:
            tokens = tokens[0]
        tokens = tokens.astype(mx.int32)
        m, p = self.model, self._peers
        n = tokens.shape[0]
        ctx = m.step_for(cache[0].offset, n)
        x = m.embed_streams(tokens)
        if p.world > 1:
            # Header and ids go out before this rank's layers run (the streams depend on
            # their sends), so the next rank builds its part of the call meanwhile and
            # starts computing the moment the streams land: its graph building is then
            # off the step's critical path.
            header = self._header(OP_FORWARD, n, cache.state_id, int(last_only))
            x = mx.depends(x, [_send_chain([header, tokens], p.next, p.group)])
        for i, c in zip(self.ranges[0], cache, strict=True):
            x = m.layers[i](x, tokens, c, ctx)
        if p.world == 1:
            return m.head_logits(x, last_only=last_only)
        sent = mx.distributed.send(x, p.next, group=p.group)
        rows = 1 if last_only else n
        back = mx.distributed.recv((rows, *x.shape[1:]), x.dtype, p.prev, group=p.group)
        back = mx.depends(back, [sent])
        return m.head_logits(back, last_only=False)

    def _header(self, op: int, n: int, state_id: int, arg: int, key: str | None = None) -> mx.array:
        """The int32 header of one call, carrying one freed state id, one freed snapshot
        id (or -1) and one removed disk key so the followers drop what rank 0 no longer
        holds. Every call builds one, so it arms the deadline: the followers must answer
        within ``--rank-timeout``."""
        self.deadline.arm()
        with self._lock:
            freed = self._freed.pop() if self._freed else -1
            freed_snap = self._freed_snaps.pop() if self._freed_snaps else -1
            dropped = self._dropped.pop() if self._dropped else None
        words = [op, n, state_id, freed, arg, freed_snap, *_key_words(key), *_key_words(dropped)]
        return mx.array(words, dtype=mx.int32)

    def snapshot_part(self, cache: PipelineCache, state, disk_key: str | None = None) -> None:
        """Have every follower keep a copy of its layers' caches of ``cache``'s state, named
        by a new snapshot id recorded in ``state.meta["pipeline_part"]``; freed when
        ``state`` (a ``SessionState``) is garbage-collected. With ``disk_key`` (the key
        rank 0's disk store saves ``state`` under) each follower also writes its copy to
        its own disk from its own writer thread. Call on the inference thread."""
        snap_id = next(self._snap_ids)
        n = len(state.tokens)
        header = self._header(OP_SNAPSHOT, n, cache.state_id, snap_id, disk_key)
        self._control(header)
        state.meta["pipeline_part"] = str(snap_id)
        weakref.finalize(state, self._free_snap, snap_id)

    def restore_part(self, cache: PipelineCache, state) -> None:
        """Have every follower set its caches of ``cache``'s state from its part of
        ``state``: read from its disk when ``state.meta["disk_key"]`` names the snapshot
        file it came from, else the in-memory copy kept by `snapshot_part`.

        Raises:
            ValueError: ``state`` has no part here (a snapshot of another process), or
                some rank has no usable part on disk; every follower then leaves its
                caches of the session as they were (the new state id is never used).
        """
        p = self._peers
        key = state.meta.get("disk_key")
        if key is not None:
            header = self._header(OP_LOAD, len(state.tokens), cache.state_id, 1, key)
            sent = mx.distributed.send(header, p.next, group=p.group)
            ok = mx.depends(mx.distributed.recv((1,), mx.int32, p.prev, group=p.group), [sent])
            self._order(ok)
            if not int(ok.item()):
                raise ValueError(f"a pipeline rank has no usable part of snapshot {key[:12]}")
            return
        part = state.meta.get("pipeline_part")
        if part is None or not part.isdigit():
            raise ValueError("this snapshot has no part on the other pipeline ranks")
        self._control(self._header(OP_RESTORE, 0, cache.state_id, int(part)))

    def _control(self, header: mx.array) -> None:
        """Send a control call's ``header`` round the ring (each follower passes it on)
        and settle."""
        self._order(mx.distributed.send(header, self._peers.next, group=self._peers.group))

    def hop(self, round_trips: int, width: int) -> list[float]:
        """Time ``round_trips`` hops of one token's residual streams ``(1, hc, width)`` (the
        compute dtype) rank 0 -> 1 -> … -> 0, with the send/recv a forward call uses
        (`relay`): wall ms of each round trip. Call on the inference thread."""
        self._control(self._header(OP_HOP, round_trips, 0, width))
        shape = (1, self.args.hc_mult, width)
        times = relay(self._peers, round_trips, shape, self.model.compute_dtype)
        self.settled()
        return times

    def _order(self, *arrays: mx.array) -> None:
        """Evaluate a control call (``arrays``) and settle the deadline."""
        mx.eval(*arrays)
        self.settled()

    def settled(self) -> None:
        """Everything launched has been evaluated (`ds4mlx.engine.session` says so after
        it waited for its logits and caches): nothing is waited on the followers."""
        self.deadline.settle()

    def drop_part(self, key: str) -> None:
        """Rank 0's disk store removed snapshot ``key``: the next header tells the
        followers to remove their parts. Any thread (the store's writer evicts)."""
        with self._lock:
            self._dropped.append(key)

    def _free_snap(self, snap_id: int) -> None:
        with self._lock:
            self._freed_snaps.append(snap_id)

    def lost_peer(self, exc: BaseException) -> str | None:
        """The line to print when ``exc`` (raised by a forward call) means a rank is gone,
        else None. MLX's ring raises ``RuntimeError("[ring] … connection … lost")`` from
        ``recv``/``send`` as soon as the peer's socket closes."""
        line = self.deadline.lost(exc)
        if line is not None:
            self.lost = line
        return line

    def peer_closed(self) -> str | None:
        """The lost-peer line when a rank has gone without a call failing (it died while
        the server idled: `StepDeadline.closed`), else None; nothing is sent to a lost rank
        afterwards. Rank 0 asks before its shutdown snapshots: a rank-0 file whose parts
        were never written would count as usable on the next start."""
        if self.lost is None:
            self.lost = self.deadline.closed()
        return self.lost

    def shutdown(self) -> None:
        """Tell the followers to exit (each passes it on before it returns). Never waits
        on a lost rank (they exit with the launcher instead)."""
        p = self._peers
        if p.world == 1 or self.lost is not None:
            return
        try:
            self._control(self._header(OP_SHUTDOWN, 0, 0, 0))
        except RuntimeError as e:
            self.lost_peer(e)


def follow(
    model, group, ranges: list[range], parts=None, rank_timeout: float = RANK_TIMEOUT_S
) -> None:
    """The loop of a rank > 0: run this rank's layers for every forward call rank 0 makes
    and keep, save, load or restore its parts of snapshots, until rank 0 sends the
    shutdown header. ``parts``: this rank's disk store of snapshot parts
    (``ds4mlx.kv.parts.PartStore``: ``save``, ``load``, ``remove``, ``close``), or None
    when the disk cache is off. Returns normally on shutdown, after the queued part
    writes are on disk; a lost peer raises `PeerLost` (``rank 0 lost: …``), also when a
    call's traffic stops for ``rank_timeout`` seconds (`ds4mlx.engine.deadline`; waiting
    for the next call is not bounded: the server may idle)."""
    follower = _Follower(model, group, ranges, parts, rank_timeout)
    try:
        with follower.deadline.naming_the_lost_peer():
            follower.run()
    finally:
        if parts is not None:
            parts.close()


class _Follower:
    """A rank > 0: its layers' caches per rank-0 session state, and its parts of rank 0's
    snapshots (in memory, and on disk through ``parts``)."""

    def __init__(self, model, group, ranges: list[range], parts=None, rank_timeout=RANK_TIMEOUT_S):
        self.model, self.group, self.parts = model, group, parts
        self.p = _Peers(group, ranges)
        near = {self.p.prev, self.p.next}
        self.deadline = StepDeadline(rank_timeout, " or ".join(f"rank {r}" for r in sorted(near)))
        self.mine = ranges[self.p.rank]
        self.last = self.p.rank == self.p.world - 1
        keep_layers(model, self.mine)
        self.states: dict[int, list] = {}
        self.snaps: dict[int, list[dict]] = {}
        self.fds = ring_sockets()

    def _fresh(self) -> list:
        full = self.model.make_cache()
        return [full[i] for i in self.mine]

    def run(self) -> None:
        while True:
            # Rank 0 may compute for long: no spinning meanwhile. A call has begun once its
            # first bytes came (rank 0 may stop halfway through sending its header).
            if wait_for_bytes(self.fds):
                self.deadline.arm()
            header = mx.distributed.recv((HEADER_LEN,), mx.int32, self.p.prev, group=self.group)
            words = [int(v) for v in header.tolist()]
            self.deadline.arm()
            if not self._call(header, words):
                return
            self.deadline.settle()

    def _call(self, header: mx.array, words: list[int]) -> bool:
        """Run the call ``header`` (``words``) orders; False for the shutdown."""
        p = self.p
        op, n, state_id, freed, arg, freed_snap, key, dropped = read_header(words)
        if op not in (OP_FORWARD, OP_LOAD) and not self.last:
            # Control calls go round the ring; the last rank does not send them back.
            mx.eval(mx.distributed.send(header, p.next, group=self.group))
        forget_freed(self, freed, freed_snap, dropped)
        if op == OP_SHUTDOWN:
            return False
        if op == OP_SNAPSHOT:
            self._snapshot(state_id, arg, key, n)
        elif op == OP_LOAD:
            self._load(words, state_id, key, n, bool(arg))
        elif op == OP_RESTORE:
            cache = self._fresh()
            for c, st in zip(cache, self.snaps[arg], strict=True):
                c.state = {k: mx.array(v) for k, v in st.items()}
            mx.eval([a for c in cache for a in c.arrays()])
            self.states[state_id] = cache
        elif op == OP_HOP:
            relay(p, n, (1, self.model.args.hc_mult, arg), self.model.compute_dtype)
        else:
            self._forward(header, n, state_id, bool(arg))
        return True

    def _snapshot(self, state_id: int, snap_id: int, key: str | None, n: int) -> None:
        """Keep a copy of this rank's caches of ``state_id`` as ``snap_id``; with ``key``,
        also save it as this rank's part of disk snapshot ``key`` (``n`` tokens)."""
        # A state never fed (rank 0 snapshots a fresh session too) has fresh caches.
        cache = self.states.setdefault(state_id, self._fresh())
        self.snaps[snap_id] = keep_part(cache, self.mine, self.parts, key, n)

    def _load(self, words: list[int], state_id: int, key: str | None, n: int, ok: bool) -> None:
        """Set this rank's caches of ``state_id`` from its part of disk snapshot ``key``
        (``n`` tokens), then pass on whether every rank so far has its part (``ok`` is
        the previous ranks' answer); the last rank answers rank 0 with one int32. A
        rank without its part leaves its caches alone, so all ranks fall back alike."""
        cache = self._fresh()
        ok = ok and load_part(cache, self.mine, self.parts, key, n)
        if ok:
            self.states[state_id] = cache
        if self.last:
            answer = mx.array([int(ok)], dtype=mx.int32)
        else:
            answer = mx.array([*words[:4], int(ok), *words[5:]], dtype=mx.int32)
        mx.eval(mx.distributed.send(answer, self.p.next, group=self.group))

    def _forward(self, header: mx.array, n: int, state_id: int, last_only: bool) -> None:
        p, group = self.p, self.group
        tokens = mx.distributed.recv((n,), mx.int32, p.prev, group=group)
        # Receives run in graph order, not call order: the ids must arrive before the
        # streams are asked for, or the streams' bytes would be read as ids.
        mx.eval(tokens)
        if not self.last:
            # Passed on before this rank's layers run, as rank 0 does (`PipelineModel`).
            mx.eval(_send_chain([header, tokens], p.next, group))
        # The streams come once the previous ranks' layers ran. The step is built now and
        # its evaluation waits for them asleep in the receive (`sleep_in_waits`).
        shape = (n, self.model.args.hc_mult, self.model.args.dim)
        x = mx.distributed.recv(shape, self.model.compute_dtype, p.prev, group=group)
        if state_id not in self.states:
            self.states[state_id] = self._fresh()
        cache = self.states[state_id]
        ctx = self.model.step_for(cache[0].offset, n)
        for i, c in zip(self.mine, cache, strict=True):
            x = self.model.layers[i](x, tokens, c, ctx)
        arrays = [a for c in cache for a in c.arrays()]
        out = x[-1:] if last_only and self.last else x
        mx.eval(mx.distributed.send(out, p.next, group=group), arrays)


def keep_part(cache: list, layers: range, parts, key: str | None, n: int) -> list[dict]:
    """A follower's evaluated copy of its caches ``cache`` (of ``layers``) for a snapshot;
    with ``key`` and a part store ``parts`` (`ds4mlx.kv.parts.PartStore`) also saved as
    this rank's part of disk snapshot ``key`` holding ``n`` tokens."""
    copy = [{k: mx.array(v) for k, v in c.state.items()} for c in cache]
    mx.eval(copy)
    if key is not None and parts is not None:
        arrays = {
            f"cache.{layer}.{name}": a
            for layer, st in zip(layers, copy, strict=True)
            for name, a in st.items()
        }
        parts.save(key, arrays, n)
    return copy


def load_part(cache: list, layers: range, parts, key: str | None, n: int) -> bool:
    """Set fresh caches ``cache`` (of ``layers``) from this rank's part of disk snapshot
    ``key`` holding ``n`` tokens, evaluated; False (``cache`` then unusable) when there
    is no part store, no such part, or one that does not fit these caches."""
    arrays = parts.load(key, n) if key is not None and parts is not None else None
    if arrays is None:
        return False
    try:
        for layer, c in zip(layers, cache, strict=True):
            prefix = f"cache.{layer}."
            c.state = {k[len(prefix) :]: a for k, a in arrays.items() if k.startswith(prefix)}
    except (KeyError, ValueError, TypeError):
        return False
    if not all(getattr(c, "offset", n) == n for c in cache):
        return False
    mx.eval([a for c in cache for a in c.arrays()])
    return True


def set_parent_death_signal() -> None:
    """Linux: this process gets SIGTERM when its parent exits. ``mlx.launch`` neither
    stops its ranks when it is itself terminated nor reports their failures, so a rank
    must not outlive it. Elsewhere (macOS) a no-op."""
    import ctypes
    import ctypes.util
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


def fill_launcher_stdin() -> None:
    """Linux: fill this rank's stdin pipe, so that ``mlx.launch`` stops spinning on it.

    ``mlx.launch`` gives each rank a stdin pipe and one I/O thread per rank that
    ``select()``s it for writing (to forward the launcher's own stdin). An empty pipe is
    always writable, so each thread loops without sleeping: on one 2-core host the
    launcher took a whole core beside two idle co-located ranks (0.6 of one during a
    bench). A full pipe is not writable,
    and ranks never read stdin. ``/proc/self/fd/0`` opened for writing is a new write end
    of the same pipe (Linux only; on macOS ``/dev/fd/0`` duplicates the read end), with
    its own non-blocking flag. Remote ranks sit behind ``ssh``, which drains the
    launcher's pipe itself: nothing to do there. A no-op when stdin is not a pipe.
    """
    import stat
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        if not stat.S_ISFIFO(os.fstat(0).st_mode):
            return
        fd = os.open("/proc/self/fd/0", os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        block = bytes(65536)
        while True:
            os.write(fd, block)
    except OSError:  # BlockingIOError once full, or the pipe is gone
        pass
    finally:
        os.close(fd)


# How long a rank > 0 outlives its launcher: rank 0 (stopped by the same launcher's
# going) may still be ordering shutdown snapshot parts and the shutdown.
FOLLOWER_GRACE_S = 5.0


def follow_parent(grace_s: float = FOLLOWER_GRACE_S) -> None:
    """A rank > 0 exits on rank 0's order, not on a signal: SIGINT (Ctrl-C reaches the
    whole process group) and SIGTERM are ignored, so a part rank 0 orders during its
    graceful shutdown is still written; a daemon thread ends the process (exit code 1)
    ``grace_s`` seconds after its parent (``mlx.launch``) is gone, should rank 0 never
    order the shutdown. A rank 0 that dies is seen at once: ``recv`` raises."""
    import signal
    import time

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="ds4mlx-parent-watch", daemon=True).start()


def parse_split(text: str | None) -> list[int] | None:
    """``--pipeline-split`` ``"22"`` or ``"11,22,33"`` -> first layers of ranks 1.. (None
    when not given). Raises PipelineError on anything but comma-separated integers."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise PipelineError(
            f"--pipeline-split {text!r}: give the first layer of each rank after 0, e.g. 22"
        ) from None


def distributed_split(mode: str | None, text: str | None, speculative: str = "off"):
    """The ``--pipeline-split`` of the flags ``--distributed mode --pipeline-split text
    --speculative speculative``, parsed (None: even, or no split). They need no model,
    so every rank checks them alike before it joins the ring.

    Raises:
        PipelineError: a split without ``--distributed pipeline`` (none, or tensor), one
            that is not comma-separated integers, drafting under ``--distributed``, or
            no ``--distributed`` in a launch of several ranks (each would run alone:
            two servers, two benchmarks).
    """
    from .speculative import refused_under_split

    world = launched_ranks()
    if mode is None and text is None and world > 1:
        raise PipelineError(
            f"launched by mlx.launch with {world} ranks: give --distributed pipeline or "
            "--distributed tensor (without it every rank would run on its own)"
        )
    if text is not None and mode != "pipeline":
        raise PipelineError(
            "--pipeline-split needs --distributed pipeline"
            + (f", not {mode}" if mode is not None else "")
        )
    if mode is not None and (refused := refused_under_split(speculative)):
        raise PipelineError(refused)
    return parse_split(text)


def launched_rank() -> int:
    """This process's rank as ``mlx.launch`` set it (``MLX_RANK``; 0 when not launched),
    read without joining the ring."""
    try:
        return int(os.environ.get("MLX_RANK", "0"))
    except ValueError:
        return 0


def launched_ranks() -> int:
    """The rank count of the ``mlx.launch`` that started this process, 1 when it was not
    launched (a stray ``MLX_RANK`` outside a launch included): several ranks either run
    split or all refuse alike (`distributed_split`)."""
    return (launched_world() or 1) if "MLX_RANK" in os.environ else 1


def launched_world() -> int | None:
    """The launch's rank count from ``mlx.launch``'s host file (``MLX_HOSTFILE``, one
    entry per rank), read without joining the ring; None when there is none."""
    import json

    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            return len(json.load(f)) or None
    except (KeyError, OSError, ValueError, TypeError):
        return None


def load_distributed(
    path,
    *,
    ctx_size=None,
    sessions: int = 1,
    split: list[int] | None = None,
    mode: str = "pipeline",
    start=None,
    parts=None,
    rank_timeout: float = RANK_TIMEOUT_S,
):
    """Load ``path`` as one rank of a pipeline split under ``mlx.launch``; with ``start``
    (``mode`` names it in messages), ``start(model, args, group, path, ctx_size)`` builds
    this rank from the loaded model instead (a tensor split: `ds4mlx.engine.distributed`).

    Rank 0 gets an `Engine` whose model is a `PipelineModel` (its identity includes the
    split, so nothing saved under another split is reused); every other rank runs
    `follow` until rank 0 shuts the pipeline down and then gets None. ``parts``: for a
    rank > 0, ``parts(rank)`` makes its store of snapshot parts (`follow`), or None when
    the disk cache is off. ``rank_timeout``: ``--rank-timeout`` seconds
    (`ds4mlx.engine.deadline`).

    Raises:
        PipelineError: not launched with more than one rank, a bad split, or a rank
            whose part does not fit its memory (`ds4mlx.engine.rankfit`).
        ds4mlx.model.loading.LoadError: unreadable checkpoint.
    """
    from ds4mlx.engine.core import Engine
    from ds4mlx.model.config import ModelArgs
    from ds4mlx.model.loading import load_model, read_config
    from ds4mlx.tokenizer import Tokenizer

    from .rankfit import check_ranks_fit, pipeline_parts, tensor_parts

    group = mx.distributed.init()
    if group.size() < 2:
        raise PipelineError(
            f"--distributed {mode} needs at least 2 ranks: start it with "
            "mlx.launch --backend ring --hosts HOST1,HOST2 -- python -m ds4mlx.cli …"
        )
    if start is not None and split is not None:
        raise PipelineError(f"--pipeline-split needs --distributed pipeline, not {mode}")
    if group.rank() == 0:
        set_parent_death_signal()  # SIGTERM: rank 0's graceful shutdown
    else:
        follow_parent()
    fill_launcher_stdin()
    n_layers = ModelArgs.from_dict(read_config(str(path))).n_layers
    ranges = split_layers(n_layers, group.size(), split) if start is None else None
    # The whole-model fit check would refuse exactly the models a split is for: each
    # rank checks its own part, and reads only its own layers' weights (the others stay
    # lazy and are dropped).
    held = pipeline_parts(ranges) if ranges else tensor_parts(n_layers, group.size())
    refused = check_ranks_fit(str(path), group, held, ctx_size, sessions, rank_timeout)
    if refused is not None:
        raise PipelineError(refused)
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    model, args = load_model(str(path), dtype=dtype, check_memory=False)
    if start is not None:
        return start(model, args, group, path, ctx_size, rank_timeout=rank_timeout, parts=parts)
    if group.rank() > 0:
        follow(model, group, ranges, None if parts is None else parts(group.rank()), rank_timeout)
        return None
    layout = "pipeline:" + ",".join(f"{r.start}-{r.stop}" for r in ranges)
    return Engine(
        PipelineModel(model, group, ranges, rank_timeout),
        args,
        Tokenizer.load(path),
        path=path,
        config=read_config(str(path)),
        ctx_size=ctx_size,
        layout=layout,
    )
