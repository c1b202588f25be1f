"""Pipeline parallelism: the network's layers split across ranks of MLX distributed.

Run under MLX's own launcher (``mlx.launch --backend ring --hosts H1,H2 -- python -m
ds4mlx.cli …``); no home-made transport. Every rank holds a contiguous range of layers
(`split_layers`); rank 0 also holds the embedding, the head, the tokenizer, sampling and
every ``Session`` (so `engine.turn`, `kv/` and the routes are unchanged: rank 0's model is a
`PipelineModel` with the network's call signature).

One forward call on rank 0 (a prefill chunk or a decode step):

1. rank 0 embeds the tokens and runs its layers;
2. it sends a header (int32 ``(HEADER_LEN,)``: op, token count, cache-state id, a freed
   state id or -1, last-only flag), the token ids (int32 ``(L,)``: hash-routed layers
   read ``tid2eid[token]``, and a split may put them past rank 0) and the residual
   streams (``(L, hc, dim)`` in the compute dtype) to rank 1;
3. each rank runs its layers and passes header, ids and streams on; the last rank sends
   the streams (only the last row for a last-only call) back to rank 0, which is the next
   rank on the ring;
4. rank 0 applies the head. The logits are what one process computes: the same layers,
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
import threading
import weakref
from dataclasses import dataclass

import mlx.core as mx

HEADER_LEN = 6
OP_FORWARD, OP_SHUTDOWN, OP_SNAPSHOT, OP_RESTORE = 1, 2, 3, 4
# Header fields: op, token count, state id, freed state id (or -1), last-only flag or
# snapshot id, freed snapshot id (or -1).


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


class PipelineModel:
    # In-memory snapshots only: each follower keeps its part; disk files would hold rank
    # 0's layers alone (the server runs with the disk tier off).
    snapshots = "memory"

    """Rank 0's model in a pipeline split: the `Model` call signature
    (``model(tokens, cache, last_only=…)``, ``make_cache()``, ``args``, ``layers``) over its
    own layers plus the other ranks'. See the module docstring for one call's traffic.

    Attributes:
        model: the full ``Model`` (other ranks' layers replaced by stand-ins).
        ranges: layer range per rank.
    """

    def __init__(self, model, group, ranges: list[range]):
        self.model = model
        self.args = model.args
        self.ranges = ranges
        self._peers = _Peers(group, ranges)
        self._ids = itertools.count(1)
        # State ids whose rank-0 cache list was garbage-collected; a finalizer may run on
        # any thread, so the list is guarded.
        self._freed: list[int] = []
        self._freed_snaps: list[int] = []
        self._snap_ids = itertools.count(1)
        self._lock = threading.Lock()
        # Set once a peer is known to be gone: nothing more is sent to it.
        self.lost: str | None = None
        keep_layers(model, ranges[0])

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
        for i, c in zip(self.ranges[0], cache, strict=True):
            x = m.layers[i](x, tokens, c, ctx)
        if p.world == 1:
            return m.head_logits(x, last_only=last_only)
        header = self._header(OP_FORWARD, n, cache.state_id, int(last_only))
        sent = _send_chain([header, tokens, x], p.next, p.group)
        rows = 1 if last_only else n
        back = mx.distributed.recv((rows, *x.shape[1:]), x.dtype, p.prev, group=p.group)
        back = mx.depends(back, [sent])
        return m.head_logits(back, last_only=False)

    def _header(self, op: int, n: int, state_id: int, arg: int) -> mx.array:
        """The int32 header of one call, carrying one freed state id and one freed
        snapshot id (or -1) so the followers drop what rank 0 no longer holds."""
        with self._lock:
            freed = self._freed.pop() if self._freed else -1
            freed_snap = self._freed_snaps.pop() if self._freed_snaps else -1
        return mx.array([op, n, state_id, freed, arg, freed_snap], dtype=mx.int32)

    def snapshot_part(self, cache: PipelineCache, state) -> None:
        """Have every follower keep a copy of its layers' caches of ``cache``'s state, named
        by a new snapshot id recorded in ``state.meta["pipeline_part"]``; freed when
        ``state`` (a ``SessionState``) is garbage-collected. Call on the inference thread."""
        snap_id = next(self._snap_ids)
        header = self._header(OP_SNAPSHOT, 0, cache.state_id, snap_id)
        mx.eval(mx.distributed.send(header, self._peers.next, group=self._peers.group))
        state.meta["pipeline_part"] = str(snap_id)
        weakref.finalize(state, self._free_snap, snap_id)

    def restore_part(self, cache: PipelineCache, state) -> None:
        """Have every follower set its caches of ``cache``'s state from the part kept for
        ``state`` (`snapshot_part`). Raises ValueError when ``state`` has no part here
        (a snapshot from disk or another process)."""
        part = state.meta.get("pipeline_part")
        if part is None or not part.isdigit():
            raise ValueError("this snapshot has no part on the other pipeline ranks")
        header = self._header(OP_RESTORE, 0, cache.state_id, int(part))
        mx.eval(mx.distributed.send(header, self._peers.next, group=self._peers.group))

    def _free_snap(self, snap_id: int) -> None:
        with self._lock:
            self._freed_snaps.append(snap_id)

    def lost_peer(self, exc: BaseException) -> str | None:
        """The line to print when ``exc`` (raised by a forward call) means a rank is gone,
        else None. MLX's ring raises ``RuntimeError("[ring] … connection … lost")`` from
        ``recv``/``send`` as soon as the peer's socket closes."""
        text = str(exc)
        if not isinstance(exc, RuntimeError) or "[ring]" not in text:
            return None
        p = self._peers
        who = "rank 1" if p.world == 2 else f"rank {p.next} or rank {p.prev}"
        self.lost = f"{who} lost: {text}"
        return self.lost

    def shutdown(self) -> None:
        """Tell the followers to exit (each passes it on before it returns). Never waits
        on a lost rank (they exit with the launcher instead)."""
        p = self._peers
        if p.world == 1 or self.lost is not None:
            return
        header = mx.array([OP_SHUTDOWN, 0, 0, -1, 0, -1], dtype=mx.int32)
        try:
            mx.eval(mx.distributed.send(header, p.next, group=p.group))
        except RuntimeError as e:
            self.lost_peer(e)


def follow(model, group, ranges: list[range]) -> None:
    """The loop of a rank > 0: run this rank's layers for every forward call rank 0 makes
    and keep or restore its parts of snapshots, until rank 0 sends the shutdown header.
    Returns normally on shutdown; a lost peer raises MLX's ``RuntimeError`` from ``recv``."""
    _Follower(model, group, ranges).run()


class _Follower:
    """A rank > 0: its layers' caches per rank-0 session state, and its parts of rank 0's
    in-memory snapshots."""

    def __init__(self, model, group, ranges: list[range]):
        self.model, self.group = model, group
        self.p = _Peers(group, ranges)
        self.mine = ranges[self.p.rank]
        self.last = self.p.rank == self.p.world - 1
        keep_layers(model, self.mine)
        self.states: dict[int, list] = {}
        self.snaps: dict[int, list[dict]] = {}

    def _fresh(self) -> list:
        full = self.model.make_cache()
        return [full[i] for i in self.mine]

    def run(self) -> None:
        p = self.p
        while True:
            header = mx.distributed.recv((HEADER_LEN,), mx.int32, p.prev, group=self.group)
            op, n, state_id, freed, arg, freed_snap = (int(v) for v in header.tolist())
            if op != OP_FORWARD and not self.last:
                # Control calls go round the ring; the last rank does not send them back.
                mx.eval(mx.distributed.send(header, p.next, group=self.group))
            if op == OP_SHUTDOWN:
                return
            self.states.pop(freed, None)
            self.snaps.pop(freed_snap, None)
            if op == OP_SNAPSHOT:
                copy = [{k: mx.array(v) for k, v in c.state.items()} for c in self.states[state_id]]
                mx.eval(copy)
                self.snaps[arg] = copy
            elif op == OP_RESTORE:
                cache = self._fresh()
                for c, st in zip(cache, self.snaps[arg], strict=True):
                    c.state = {k: mx.array(v) for k, v in st.items()}
                mx.eval([a for c in cache for a in c.arrays()])
                self.states[state_id] = cache
            else:
                self._forward(header, n, state_id, bool(arg))

    def _forward(self, header: mx.array, n: int, state_id: int, last_only: bool) -> None:
        p, group = self.p, self.group
        tokens = mx.distributed.recv((n,), mx.int32, p.prev, group=group)
        # Receives run in graph order, not call order: the ids must arrive before the
        # streams are asked for, or the streams' bytes would be read as ids.
        mx.eval(tokens)
        shape = (n, self.model.args.hc_mult, self.model.args.dim)
        x = mx.distributed.recv(shape, self.model.compute_dtype, p.prev, group=group)
        if state_id not in self.states:
            self.states[state_id] = self._fresh()
        cache = self.states[state_id]
        ctx = self.model.step_for(cache[0].offset, n)
        for i, c in zip(self.mine, cache, strict=True):
            x = self.model.layers[i](x, tokens, c, ctx)
        arrays = [a for c in cache for a in c.arrays()]
        if self.last:
            out = x[-1:] if last_only else x
            mx.eval(mx.distributed.send(out, p.next, group=group), arrays)
        else:
            mx.eval(_send_chain([header, tokens, x], p.next, group), arrays)


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


def follower_rank() -> int:
    """This process's rank under ``mlx.launch`` (0 when not launched by it)."""
    return mx.distributed.init().rank()


def load_distributed(
    path,
    *,
    ctx_size=None,
    sessions: int = 1,
    split: list[int] | None = None,
    mode: str = "pipeline",
    start=None,
):
    """Load ``path`` as one rank of a pipeline split under ``mlx.launch``; with ``start``
    (``mode`` names it in messages), ``start(model, args, group, path, ctx_size)`` builds
    this rank from the loaded model instead (a tensor split: `ds4mlx.engine.distributed`).

    Rank 0 gets an `Engine` whose model is a `PipelineModel` (its identity includes the
    split, so nothing saved under another split is reused); every other rank runs
    `follow` until rank 0 shuts the pipeline down and then gets None.

    Raises:
        PipelineError: not launched with more than one rank, or a bad split.
        ds4mlx.model.loading.LoadError: unreadable checkpoint.
    """
    from ds4mlx.engine.core import Engine
    from ds4mlx.model.loading import load_model, read_config
    from ds4mlx.tokenizer import Tokenizer

    group = mx.distributed.init()
    if group.size() < 2:
        raise PipelineError(
            f"--distributed {mode} needs at least 2 ranks: start it with "
            "mlx.launch --backend ring --hosts HOST1,HOST2 -- python -m ds4mlx.cli …"
        )
    if start is not None and split is not None:
        raise PipelineError(f"--pipeline-split needs --distributed pipeline, not {mode}")
    set_parent_death_signal()
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    # The whole-model fit check would refuse exactly the models a split is for; each
    # rank reads only its own layers' weights (the others stay lazy and are dropped).
    model, args = load_model(str(path), dtype=dtype, check_memory=False)
    if start is not None:
        return start(model, args, group, path, ctx_size)
    ranges = split_layers(args.n_layers, group.size(), split)
    if group.rank() > 0:
        follow(model, group, ranges)
        return None
    layout = "pipeline:" + ",".join(f"{r.start}-{r.stop}" for r in ranges)
    return Engine(
        PipelineModel(model, group, ranges),
        args,
        Tokenizer.load(path),
        path=path,
        config=read_config(str(path)),
        ctx_size=ctx_size,
        layout=layout,
    )
