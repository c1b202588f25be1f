"""Tensor parallelism: every layer split across the ranks of MLX distributed.

Run under MLX's own launcher like the pipeline split (`ds4mlx.engine.pipeline`, whose
launch, death signal, header layout, state ids and lost-peer handling this module reuses):
``mlx.launch --backend ring --hosts H1,H2 -- python -m ds4mlx.cli serve -m DIR
--distributed tensor``.

What each of ``w`` ranks holds of every layer (rank ``r``), sliced at load before any
weight is read (`shard_model`):

* attention: query heads ``r·H/w … (r+1)·H/w - 1`` (``wq_b`` rows, ``attn_sink``), the
  output groups that read exactly those heads (``wo_a`` rows) and ``wo_b``'s matching
  input columns; its output is a partial sum, completed by one ``all_sum``;
* MoE: every routed expert's and the shared expert's intermediate slice ``r·I/w …``
  (``w1``/``w3`` rows, ``w2`` columns); the routed and shared partial outputs are added
  and completed by one ``all_sum``;
* replicated: mHC, the norms, the embedding, the head, the router, ``wq_a``, the single
  shared K=V head (``wkv``), the compressors and the whole Lightning Indexer (its 64 query
  heads too: replicating them costs no collective, splitting them would add an
  ``all_sum`` of the ``(L, n)`` index scores per CSA layer before top-k). So every rank
  computes and holds the full KV cache.

Collectives per forward call: two ``all_sum`` of ``(L, dim)`` per layer, whatever its kind
(window, ratio-4 CSA, ratio-128 HCA), plus two small ones of the control plane: the int32
header and the token ids (``all_sum`` with zeros from the followers is a broadcast from
rank 0 that every backend has). All ranks run the same forward in lockstep; rank 0
samples and serves, the followers (`follow`) loop. The logits match one process to float
rounding (the partial sums are reduced in another order), not bitwise.

Everything rank 0 adds to a step is a lazy graph node, chained with ``mx.depends`` so the
collectives run in the same order on every rank; a decode step that is built and then
abandoned (pipelined decode) runs none of them.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .deadline import RANK_TIMEOUT_S, StepDeadline, ring_sockets, wait_for_bytes
from .pipeline import (
    HEADER_LEN,
    OP_FORWARD,
    OP_HOP,
    OP_LOAD,
    OP_RESTORE,
    OP_SHUTDOWN,
    OP_SNAPSHOT,
    PipelineError,
    PipelineModel,
    _Peers,
    forget_freed,
    keep_part,
    load_part,
    read_header,
    relay,
)

# The arrays of a (quantized) linear that carry its output rows / input columns.
_PARTS = ("weight", "scales", "biases")


def _slice(m: nn.Module, axis: int, rank: int, world: int, what: str) -> None:
    """Keep rank ``rank``'s ``1/world`` of ``m``'s arrays along ``axis`` (an output-rows
    axis, or -1 for input columns). A quantized input axis is sliced in packed words and
    scale groups alike, so it splits only at whole quantization groups.

    Raises:
        PipelineError: an axis that does not split evenly (``what`` names the tensor).
    """
    names = [name for name in _PARTS if name in m]
    for name in names:  # all checked first: a refused split leaves ``m`` as it was
        size = m[name].shape[axis]
        if size % world:
            raise PipelineError(
                f"--distributed tensor: {what}.{name} has {size} along the split axis, "
                f"not divisible by {world} ranks"
            )
    for name in names:
        a = m[name]
        step = a.shape[axis] // world
        index = [slice(None)] * a.ndim
        index[axis] = slice(rank * step, (rank + 1) * step)
        # A slice is a view of the whole tensor's buffer: copied out, the whole tensor
        # is freed once read (a view kept every rank holding the full weights) and the
        # input-column slices are contiguous for the matmuls.
        m[name] = mx.contiguous(a[tuple(index)])


class _SummedLinear(nn.Module):
    """A linear over this rank's input columns, completed across ranks by ``all_sum``."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(self.inner(x), group=self._group)


class _SummedMoE(nn.Module):
    """The MoE over this rank's intermediate slices: routed plus shared partial outputs,
    completed by one ``all_sum``. Returns ``(sum (L, dim), None)`` as `MoE` does without
    a shared expert."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self._group = group

    def __call__(self, x: mx.array, tokens: mx.array):
        routed, shared = self.inner(x, tokens)
        part = routed if shared is None else routed + shared
        return mx.distributed.all_sum(part, group=self._group), None


def shard_model(model, group) -> None:
    """Slice every layer of ``model`` (lazy weights, nothing read yet) to this rank's part
    (module docstring), wrap the two partial outputs per layer in an ``all_sum``, and read
    the slices. Raises PipelineError when heads, output groups or an intermediate dim do
    not split evenly across the ranks."""
    r, w = group.rank(), group.size()
    a = model.args
    if a.n_heads % w or a.o_groups % w:
        raise PipelineError(
            f"--distributed tensor: {a.n_heads} query heads in {a.o_groups} output groups "
            f"do not split across {w} ranks"
        )
    for i, layer in enumerate(model.layers):
        at = layer.attn
        _slice(at["wq_b"], 0, r, w, f"layers.{i}.attn.wq_b")
        at.attn_sink = at.attn_sink[r * a.n_heads // w : (r + 1) * a.n_heads // w]
        _slice(at["wo_a"], 0, r, w, f"layers.{i}.attn.wo_a")
        at["wo_a"].groups //= w
        _slice(at["wo_b"], -1, r, w, f"layers.{i}.attn.wo_b")
        at.wo_b = _SummedLinear(at["wo_b"], group)
        at.n_heads //= w
        at.groups //= w
        ffn = layer.ffn
        parts = [("experts", ffn["experts"])]
        if "shared_experts" in ffn:
            parts.append(("shared_experts", ffn["shared_experts"]))
        for name, mlp in parts:
            # Stacked experts are (E, out, in): rows are axis 1; a plain linear's axis 0.
            rows = 1 if name == "experts" else 0
            _slice(mlp["w1"], rows, r, w, f"layers.{i}.ffn.{name}.w1")
            _slice(mlp["w3"], rows, r, w, f"layers.{i}.ffn.{name}.w3")
            _slice(mlp["w2"], -1, r, w, f"layers.{i}.ffn.{name}.w2")
        layer.ffn = _SummedMoE(ffn, group)
    # Read now: each rank keeps only its slices (the full tensors are never held at once
    # beyond the one being sliced).
    mx.eval(model.parameters())


class TensorModel(PipelineModel):
    """Rank 0's model in a tensor split: the `Model` call signature over sharded layers,
    in lockstep with the followers (module docstring). Caches, state ids, in-memory
    snapshot parts, the lost-peer line and shutdown work as in `PipelineModel`; only the
    control plane differs (``all_sum`` broadcasts instead of a send round the ring).

    Attributes:
        model: the sharded ``Model``; ``ranges``: one range of every layer (each rank
            holds every layer).
    """

    # Every follower holds the whole KV: it keeps its copy of a snapshot in memory and,
    # for a disk save, writes it to its own disk under the same key (`ds4mlx.kv.parts`).
    snapshots = "parts"

    def __init__(self, model, group, rank_timeout: float = RANK_TIMEOUT_S):
        self.model = model
        self.args = model.args
        self.ranges = [range(model.args.n_layers)]
        self._control_plane(group, self.ranges * group.size(), rank_timeout)

    def _control(self, header: mx.array) -> None:
        self._order(mx.distributed.all_sum(header, group=self._peers.group))

    def __call__(self, tokens: mx.array, cache, *, last_only: bool = False):
        """Float32 logits ``(1, L, vocab)`` (``(1, 1, vocab)`` with ``last_only``) for int32
        ``tokens`` ``(1, L)`` or ``(L,)``, fed after ``cache``; every rank runs the same
        layers on its slices when the result is evaluated."""
        if tokens.ndim == 2:
            tokens = tokens[0]
        m, g = self.model, self._peers.group
        n = tokens.shape[0]
        header = mx.distributed.all_sum(
            self._header(OP_FORWARD, n, cache.state_id, int(last_only)), group=g
        )
        # The ids go out after the header (the followers read the count from it), and
        # every layer depends on them, so each rank runs its collectives in one order.
        tokens = mx.distributed.all_sum(mx.depends(tokens.astype(mx.int32), [header]), group=g)
        return m(tokens, list(cache), last_only=last_only)

    def snapshot_part(self, cache, state, disk_key: str | None = None) -> None:
        """Have every follower keep a copy of its caches of ``cache``'s state (a full
        copy: each rank holds the whole KV), named in ``state.meta["pipeline_part"]``;
        with ``disk_key`` each also writes it to its own disk under that key."""
        import weakref

        snap_id = next(self._snap_ids)
        n = len(state.tokens)
        self._control(self._header(OP_SNAPSHOT, n, cache.state_id, snap_id, disk_key))
        state.meta["pipeline_part"] = str(snap_id)
        weakref.finalize(state, self._free_snap, snap_id)

    def restore_part(self, cache, state) -> None:
        """Have every follower set its caches of ``cache``'s state from its copy of
        ``state``: read from its disk when ``state.meta["disk_key"]`` names the file it
        came from (one more ``all_sum`` counts the ranks without a usable copy; then no
        rank uses its copy), else the in-memory copy.

        Raises:
            ValueError: ``state`` has no copy on some rank.
        """
        key = state.meta.get("disk_key")
        if key is not None:
            g = self._peers.group
            header = self._header(OP_LOAD, len(state.tokens), cache.state_id, 0, key)
            header = mx.distributed.all_sum(header, group=g)
            missing = mx.distributed.all_sum(
                mx.depends(mx.zeros((1,), mx.int32), [header]), group=g
            )
            self._order(missing)
            if int(missing.item()):
                raise ValueError(f"a tensor rank has no usable copy of snapshot {key[:12]}")
            return
        part = state.meta.get("pipeline_part")
        if part is None or not part.isdigit():
            raise ValueError("this snapshot has no part on the other tensor ranks")
        self._control(self._header(OP_RESTORE, 0, cache.state_id, int(part)))

    def shutdown(self) -> None:
        """Tell the followers to exit; never waits on a lost rank."""
        if self.lost is not None:
            return
        try:
            self._control(self._header(OP_SHUTDOWN, 0, 0, 0))
        except RuntimeError as e:
            self.lost_peer(e)


def follow(model, group, rank_timeout: float = RANK_TIMEOUT_S, parts=None) -> None:
    """The loop of a rank > 0: the same forward as rank 0 on this rank's slices for every
    call, and copies of its caches for rank 0's snapshots (in memory, and on disk through
    ``parts``, a ``ds4mlx.kv.parts.PartStore`` or None), until rank 0 sends the shutdown
    header. A lost peer raises `PeerLost` (``rank 0 lost: …``), also when a call's
    collectives stop for ``rank_timeout`` seconds (`ds4mlx.engine.deadline`; waiting for the next
    call is not bounded)."""
    follower = _Follower(model, group, parts)
    deadline = StepDeadline(rank_timeout, "rank 0" if group.size() == 2 else "a peer rank")
    fds = ring_sockets()
    try:
        with deadline.naming_the_lost_peer():
            while True:
                # Between calls: no spinning while rank 0 works. A call has begun once its
                # first bytes came (the header's all_sum needs rank 0 more than once).
                if wait_for_bytes(fds):
                    deadline.arm()
                header = mx.distributed.all_sum(mx.zeros((HEADER_LEN,), mx.int32), group=group)
                words = [int(v) for v in header.tolist()]
                deadline.arm()
                if not follower.call(words):
                    return
                deadline.settle()
    finally:
        if parts is not None:
            parts.close()


class _Follower:
    """A rank > 0 of a tensor split: its caches per rank-0 session state and its copies of
    rank 0's snapshots."""

    def __init__(self, model, group, parts):
        self.model, self.group, self.parts = model, group, parts
        self.layers = range(model.args.n_layers)
        self.states: dict[int, list] = {}
        self.snaps: dict[int, list[dict]] = {}

    def call(self, words: list[int]) -> bool:
        """Run the call a header (``words``) orders; False for the shutdown."""
        op, n, state_id, freed, arg, freed_snap, key, dropped = read_header(words)
        forget_freed(self, freed, freed_snap, dropped)
        if op == OP_SHUTDOWN:
            return False
        if op == OP_SNAPSHOT:
            # A state never fed (rank 0 snapshots a fresh session too) has fresh caches.
            cache = self.states.setdefault(state_id, self.model.make_cache())
            self.snaps[arg] = keep_part(cache, self.layers, self.parts, key, n)
        elif op == OP_LOAD:
            self._load(state_id, key, n)
        elif op == OP_RESTORE:
            cache = self.model.make_cache()
            for c, st in zip(cache, self.snaps[arg], strict=True):
                c.state = {k: mx.array(v) for k, v in st.items()}
            mx.eval([a for c in cache for a in c.arrays()])
            self.states[state_id] = cache
        elif op == OP_FORWARD:
            self._forward(state_id, n)
        elif op == OP_HOP:  # the hop is timed with the pipeline's send/recv
            shape = (1, self.model.args.hc_mult, arg)
            relay(_Peers(self.group, []), n, shape, self.model.compute_dtype)
        return True

    def _load(self, state_id: int, key: str | None, n: int) -> None:
        """Load this rank's copy of disk snapshot ``key`` (``n`` tokens) as the caches of
        ``state_id``, used only when no rank misses its copy (counted by one ``all_sum``),
        so every rank falls back alike."""
        cache = self.model.make_cache()
        ok = load_part(cache, self.layers, self.parts, key, n)
        flag = mx.array([0 if ok else 1], dtype=mx.int32)
        if not int(mx.distributed.all_sum(flag, group=self.group).item()):  # ok everywhere
            self.states[state_id] = cache

    def _forward(self, state_id: int, n: int) -> None:
        model = self.model
        tokens = mx.distributed.all_sum(mx.zeros((n,), mx.int32), group=self.group)
        cache = self.states.setdefault(state_id, model.make_cache())
        ctx = model.step_for(cache[0].offset, n)
        x = model.embed_streams(tokens)
        for layer, c in zip(model.layers, cache, strict=True):
            x = layer(x, tokens, c, ctx)
        mx.eval(x, [a for c in cache for a in c.arrays()])


def start(
    model, args, group, path, ctx_size=None, rank_timeout: float = RANK_TIMEOUT_S, parts=None
):
    """Shard ``model`` for this rank; rank 0 gets its `Engine` (layout ``tensor:W`` in the
    model identity), any other rank follows until shutdown and gets None.
    ``rank_timeout``: ``--rank-timeout`` seconds; ``parts``: for a rank > 0, ``parts(rank)``
    makes its store of snapshot copies, or None when the disk cache is off."""
    from ds4mlx.engine.core import Engine
    from ds4mlx.model.loading import read_config
    from ds4mlx.tokenizer import Tokenizer

    shard_model(model, group)
    if group.rank() > 0:
        follow(model, group, rank_timeout, None if parts is None else parts(group.rank()))
        return None
    return Engine(
        TensorModel(model, group, rank_timeout),
        args,
        Tokenizer.load(path),
        path=path,
        config=read_config(str(path)),
        ctx_size=ctx_size,
        layout=f"tensor:{group.size()}",
    )
