"""Pipeline parallelism over MLX distributed: two ring ranks on 127.0.0.1 against one
process (`ds4mlx.engine.pipeline`).

The ranks run ``tests/dist_script.py`` under ``mlx.launch``. The launcher exits 0 even
when a rank fails, so each run is judged by the file rank 0 writes and the launcher's
own per-rank warnings; the launcher runs in its own process group, killed at the end.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.engine.pipeline import PipelineError, split_layers
from tests.dist_util import CHUNK, N_PROMPT, _launch, _launched, kill_group, under_launcher


def _reference(model_dir: Path) -> dict[str, np.ndarray]:
    """The same feeds in one process: full prefill logits per chunk, 8 greedy decode
    steps, and a greedy 32-token turn."""
    from dist_script import feeds

    from ds4mlx.engine import Engine, SamplingParams, TurnSpec, run_turn
    from ds4mlx.model.loading import load_model, read_config
    from ds4mlx.tokenizer import Tokenizer

    model, args = load_model(str(model_dir), dtype=mx.float32, check_memory=False)
    prompt = np.random.default_rng(0).integers(0, args.vocab_size, N_PROMPT).tolist()
    prefill, decode = feeds(model, prompt, CHUNK)
    engine = Engine(
        model, args, Tokenizer.load(model_dir), path=model_dir, config=read_config(model_dir)
    )
    session = engine.new_session()
    spec = TurnSpec(SamplingParams(temperature=0.0), max_tokens=32, parse=False, ignore_eos=True)
    run_turn(session, engine.tokenizer, spec, prefill=prompt)
    return {
        "prefill": prefill,
        "decode": decode,
        "turn": np.array(session.tokens[N_PROMPT:], dtype=np.int64),
        "identity": np.array(engine.identity),
    }


def assert_layers_wait_for_the_header(dot: str) -> None:
    """Rank 0's decode step (``dot``, `mx.export_to_dot` of its logits) sends the header
    and the ids before its layers compute: every matrix product of the step (its layers'
    and the head's) has a ``Send`` among its inputs' ancestors, and the first send
    depends on none. So the next rank has the call while rank 0's layers run."""
    labels = dict(re.findall(r'\{ (\d+) \[label ="([^"]+)"', dot))
    parents: dict[str, set[str]] = {}
    for a, b in re.findall(r'^"?(\w+)"? -> "?(\w+)"?$', dot, re.M):
        parents.setdefault(b, set()).add(a)

    def ancestors(node: str) -> set[str]:
        seen, todo = set(), [node]
        while todo:
            for q in parents.get(todo.pop(), ()):
                if q not in seen:
                    seen.add(q)
                    todo.append(q)
        return seen

    sends = [n for n, op in labels.items() if op == "Send"]
    products = [n for n, op in labels.items() if "Matmul" in op or op == "GatherMM"]
    assert len(sends) == 3 and products
    before = {n: {labels.get(a) for a in ancestors(n)} for n in sends}
    assert any(
        "Send" not in ops and not ops & {labels[p] for p in products} for ops in before.values()
    )
    late = [labels[n] for n in products if "Send" not in {labels.get(a) for a in ancestors(n)}]
    assert not late, f"{len(late)} matrix products run before the header is sent: {late[:3]}"


@pytest.fixture(scope="module")
def reference(tiny_f32_dir):
    return _reference(tiny_f32_dir)


@pytest.mark.slow
@pytest.mark.parametrize("split", [None, "1"], ids=["even-2+2", "split-1+3"])
def test_pipeline_two_ranks_match_one_process_bitwise(tiny_f32_dir, reference, tmp_path, split):
    """A prompt crossing the sliding window (16 in the tiny config), the ratio-4 and the
    ratio-128 compression boundaries, fed in the same chunks: logits at every prefill
    position and over 8 decode steps are bitwise equal, and the greedy turn through the
    one turn loop (pipelined decode) is the same. The 1+3 split puts a hash-routed layer
    on rank 1, which needs the token ids."""
    out = tmp_path / "out.npz"
    _launch(tiny_f32_dir, out, split)
    got = np.load(out)
    assert got["prefill"].shape == reference["prefill"].shape
    assert np.array_equal(got["prefill"], reference["prefill"])
    assert np.array_equal(got["decode"], reference["decode"])
    assert got["turn"].tolist() == reference["turn"].tolist()
    assert len(got["turn"]) >= 31  # the last sampled token is not fed
    assert_layers_wait_for_the_header((tmp_path / "step.dot").read_text())
    # dist_script saved a snapshot on both ranks, then removed rank 0's file.
    assert sorted(p.name for p in (tmp_path / "kv").glob("*.safetensors")) == []


@pytest.mark.slow
def test_tensor_two_ranks_match_one_process(tiny_f32_dir, reference, tmp_path):
    """``--distributed tensor`` on two ranks (heads, output groups and every expert's
    intermediate dim split; partial sums completed by ``all_sum``): over the same prompt
    and chunks as the pipeline test, the logits at every prefill position and over 8
    decode steps are within 1e-4 of one process relative to the logits' scale (the
    partial sums are reduced in another order, so not bitwise; max |diff| was 5.2e-6
    over logits of magnitude ~6), the greedy 32-token turn is the same (a snapshot
    restored in memory, and one saved to disk on both ranks and loaded back, continue
    identically; a load missing a rank's copy fails alike on both: checked by the
    script), and the split enters the model identity."""
    out = tmp_path / "out.npz"
    _launch(tiny_f32_dir, out, "tensor")
    got = np.load(out)
    for key in ("prefill", "decode"):
        ref = reference[key]
        assert got[key].shape == ref.shape
        diff = np.abs(got[key] - ref).max()
        assert diff <= 1e-4 * np.abs(ref).max(), (key, diff)
    assert got["turn"].tolist() == reference["turn"].tolist()
    assert len(got["turn"]) >= 31
    assert str(got["layout"]) == "tensor:2"
    assert str(got["identity"]) != str(reference["identity"])
    # Saved to disk on both ranks and restored (checked by the script), then removed.
    assert sorted(p.name for p in (tmp_path / "kv").glob("*.safetensors")) == []


_FIGURE = r"(\d+(?:\.\d+)?)"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_bench_under_two_ranks_prints_the_hop_collectives_and_the_goal_check(tiny_f32_dir, mode):
    """``ds4mlx bench --distributed MODE --compare`` on two ranks: rank 0 alone prints the
    table (rank 1 follows), then the hop at the model's width and at Flash's (positive
    medians), the collectives of one decode step counted in its graph (tensor mode: 2
    ``all_sum`` per layer of every kind plus the 2 of the control plane; pipeline mode:
    rank 0's 3 sends, header, ids and streams, and 1 receive), and per frontier both runs'
    medians over ``--prefill-repeats`` interleaved rounds (each timing both runs' prefill
    of the interval and decode) and the two goal lines. No figure is judged: the box's
    speed is not a test."""

    from ds4mlx.model.config import ModelArgs
    from ds4mlx.model.loading import read_config

    args = ModelArgs.from_dict(read_config(str(tiny_f32_dir)))
    argv = [sys.executable, "-m", "ds4mlx.cli", "bench", "-m", str(tiny_f32_dir)]
    argv += ["--frontiers", "40,80", "--decode-tokens", "4", "--distributed", mode, "--compare"]
    argv += ["--prefill-repeats", "2"]
    log = _launched(argv)
    assert log.count("frontier,prefill_tokens") == 1, log[-3000:]  # rank 0's table only
    hops = re.findall(r"hop: \(1, 4, (\d+)\) float32 .* rank 0 -> 1 -> 0: " + _FIGURE, log)
    assert [int(w) for w, _ in hops] == [args.dim, 4096], log[-3000:]
    assert all(float(ms) > 0 for _, ms in hops)
    (line,) = [x for x in log.splitlines() if x.startswith("collectives per decode step")]
    if mode == "tensor":
        kinds = [args.layer_kind(i) for i in range(args.n_layers)]
        for kind, label in (("window", "window"), ("csa", "CSA"), ("hca", "HCA")):
            assert f"{label} layer: 2 all_sum (x{kinds.count(kind)})" in line, line
        assert line.endswith(f"total {2 * args.n_layers + 2} all_sum"), line
    else:
        assert line.endswith("total 1 recv, 3 send"), line
    for f in (40, 80):
        rates = re.findall(
            rf"{f} tokens, medians of 2 interleaved rounds: 2 ranks prefill {_FIGURE} tok/s, "
            rf"decode {_FIGURE} ms per token; 1 rank prefill {_FIGURE} tok/s, decode "
            rf"{_FIGURE} ms per token \(per round, ms: 2 ranks [\d. ]+; 1 rank [\d. ]+\)",
            log,
        )
        assert len(rates) == 1 and all(float(v) > 0 for v in rates[0]), log[-3000:]
        decode = re.findall(
            rf"{f} tokens: 2-rank decode per token {_FIGURE} ms <= 1-rank {_FIGURE} ms \+ 1.5 "
            rf"hops {_FIGURE} ms: (holds|misses)",
            log,
        )
        assert len(decode) == 1 and all(float(v) > 0 for v in decode[0][:3]), log[-3000:]
        prefill = re.findall(
            rf"{f} tokens: prefill {_FIGURE} tok/s >= 0.8x 1-rank {_FIGURE} tok/s: "
            rf"(holds|misses)",
            log,
        )
        assert len(prefill) == 1, log[-3000:]


def test_the_goal_check_compares_each_frontier_with_the_one_rank_run():
    """`distributed_report`: decode per token within the 1-rank time plus 1.5 hops
    holds, beyond it misses; prefill at 0.8x the 1-rank rate holds, below it misses;
    without the 1-rank rounds it says how to get them."""
    from dataclasses import replace

    from ds4mlx.bench import DistributedFigures, Hop, PairedFrontier, distributed_report

    hop = Hop((1, 4, 64), "float32", 1024, 2.0, 20)  # 1.5 hops: 3 ms
    figs = DistributedFigures("tensor", 2, hop, hop, {"all_sum": 10}, [("window", {"all_sum": 2})])
    # 1 rank: prefill 1000 tok/s, 10 ms per decoded token.
    cases = [
        (PairedFrontier(64, [800.0, 1.0, 900.0], [1000.0] * 3, [13.0, 99.0, 1.0], [10.0] * 3),
         ["13.00 ms <= 1-rank 10.00 ms + 1.5 hops 3.00 ms: holds",
          "prefill 800.0 tok/s >= 0.8x 1-rank 1000.0 tok/s: holds"]),
        (PairedFrontier(64, [799.0] * 3, [1000.0] * 3, [13.5] * 3, [10.0] * 3),
         [": misses", ": misses"]),
    ]  # fmt: skip
    for paired, wanted in cases:
        lines = distributed_report(replace(figs, paired=[paired]))
        assert lines[2] == (
            "collectives per decode step (tensor, rank 0): window layer: 2 all_sum (x1); "
            "total 10 all_sum"
        )
        assert lines[-3].startswith("     64 tokens, medians of 3 interleaved rounds: 2 ranks")
        assert lines[-3].endswith(
            f"(per round, ms: 2 ranks {' '.join(f'{v:.2f}' for v in paired.split_decode_ms)};"
            " 1 rank 10.00 10.00 10.00)"
        )
        assert lines[-2].endswith(wanted[0]) and lines[-1].endswith(wanted[1]), lines
    assert distributed_report(figs)[-1] == "no 1-rank figures: rerun with --compare"


@pytest.mark.slow
@pytest.mark.parametrize("split", ["2", "tensor"], ids=["pipeline", "tensor"])
def test_a_reset_settles_the_rank_timeout(tiny_f32_dir, tmp_path, split):
    """``--rank-timeout 3``: a decode step built (the deadline armed) and abandoned, then
    the session reset as after a failed job, then idle for longer than the timeout and
    its grace: no rank counts the others as lost, and the next turn runs (the script
    writes its tokens only then)."""
    out = tmp_path / "out.npz"
    log = _launch(tiny_f32_dir, out, split, extra=("reset-idle=3",))
    assert " lost" not in log, log[-3000:]
    assert len(np.load(out)["turn"]) == 3  # 4 samples, the last one not fed


class _Ranks:
    """A process group's shape only (`shard_model` reads nothing else before refusing)."""

    def __init__(self, size: int):
        self._size = size

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self._size


def test_tensor_split_refuses_heads_that_do_not_divide(tiny_f32_dir):
    """The tiny model's 4 query heads in 2 output groups do not split across 3 ranks:
    one line before any weight is read."""
    from ds4mlx.engine.tensor import shard_model
    from ds4mlx.model.loading import load_model

    model, _ = load_model(str(tiny_f32_dir), dtype=mx.float32, check_memory=False)
    with pytest.raises(PipelineError, match="4 query heads in 2 output groups .* 3 ranks"):
        shard_model(model, _Ranks(3))


def test_tensor_slices_of_a_quantized_linear_add_up_to_the_whole():
    """A quantized linear split at whole quantization groups: the input-column slices'
    outputs add up to the whole output (``wo_b``, ``w2``), the output-row slices stack to it
    (``wq_b``, ``w1``/``w3``); a split inside a group is refused."""
    import copy

    import mlx.nn as nn

    from ds4mlx.engine.tensor import _slice

    mx.random.seed(0)
    whole = nn.QuantizedLinear(128, 16, bias=False, group_size=32, bits=4)
    x = mx.random.normal((3, 128))
    want = whole(x)
    cols, rows = [], []
    for r in range(2):
        part = copy.deepcopy(whole)
        _slice(part, -1, r, 2, "wo_b")
        cols.append(part(x[:, r * 64 : (r + 1) * 64]))
        part = copy.deepcopy(whole)
        _slice(part, 0, r, 2, "wq_b")
        rows.append(part(x))
    assert mx.allclose(cols[0] + cols[1], want, rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(mx.concatenate(rows, axis=-1), want).item()
    with pytest.raises(PipelineError, match="w2.weight has 16 along the split axis"):
        _slice(copy.deepcopy(whole), -1, 0, 3, "w2")
    one_group = nn.QuantizedLinear(64, 16, bias=False, group_size=64, bits=4)
    with pytest.raises(PipelineError, match="w2.scales has 1 along the split axis"):
        _slice(one_group, -1, 0, 2, "w2")
    assert one_group.weight.shape == (16, 8)  # left whole


def test_a_tensor_slice_of_a_loaded_weight_frees_the_rest(tmp_path):
    """`_slice` of a weight read from a checkpoint (lazy, as `shard_model` gets it): once
    read, the rank holds its half only, rows or input columns (a slice left a view of
    the whole buffer, so every rank held the full weights)."""
    import mlx.nn as nn

    from ds4mlx.engine.tensor import _slice

    f = str(tmp_path / "w.safetensors")
    mx.save_safetensors(f, {"weight": mx.random.normal((1024, 1024))})  # 4 MiB
    for axis in (0, -1):
        mx.clear_cache()
        before = mx.get_active_memory()
        lin = nn.Linear(1024, 1024, bias=False)
        lin.weight = mx.load(f)["weight"]
        _slice(lin, axis, 1, 2, "w")
        mx.eval(lin.parameters())
        assert mx.get_active_memory() - before <= (1 << 21) + (1 << 16), axis
        del lin


def test_rank_deadline_shuts_the_ring_sockets_then_exits_unless_settled(tmp_path, monkeypatch):
    """`StepDeadline`: a connection of the launch's addresses (``$MLX_HOSTFILE``) is a
    ring socket; armed and not re-armed for the timeout, the deadline shuts it down (a
    blocked read ends at once) and then exits with code 1; a settled or re-armed one
    does nothing. A deadline also makes the ring sockets blocking with a short timeout
    (MLX's socket thread then sleeps in its reads). Other sockets are left alone."""
    import contextlib
    import json
    import threading
    import time

    from ds4mlx.engine.deadline import StepDeadline, ring_sockets

    listener = socket.create_server(("127.0.0.1", 0))
    other = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    ring = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    stray = socket.create_connection(other.getsockname())
    for s in (ring, accepted, stray):
        s.setblocking(False)  # as MLX's ring leaves its sockets
    try:
        assert ring.fileno() in ring_sockets() and accepted.fileno() in ring_sockets()
        assert stray.fileno() not in ring_sockets()

        codes: list[int] = []
        quiet = StepDeadline(0.3, "rank 1", grace_s=0.1, exit=codes.append)
        quiet.arm()
        quiet.settle()
        busy = StepDeadline(0.6, "rank 1", grace_s=0.1, exit=codes.append)
        for _ in range(6):  # re-armed more often than the timeout: alive
            busy.arm()
            time.sleep(0.2)
        busy.settle()
        assert codes == [] and quiet.expired is None and busy.expired is None

        # The deadline made the ring sockets wait asleep, a bounded time per read
        # (`sleep_in_waits`); the stray socket is as it was.
        assert os.get_blocking(ring.fileno()) and os.get_blocking(accepted.fileno())
        assert not os.get_blocking(stray.fileno())

        def read() -> None:  # as MLX's socket thread reads: again after each timeout
            while True:
                with contextlib.suppress(BlockingIOError):
                    got.append(ring.recv(16))
                    return

        got: list[bytes] = []
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        lost = StepDeadline(0.3, "rank 1", grace_s=0.2, exit=codes.append)
        lost.arm()
        reader.join(10)
        assert got == [b""]  # the blocked read ended: the peer looks gone
        assert lost.expired == "no answer within 0.3 s (--rank-timeout)"
        end = time.monotonic() + 10
        while not codes and time.monotonic() < end:
            time.sleep(0.05)
        assert codes == [1]
        stray.sendall(b"x")  # not a ring socket: still open
    finally:
        for s in (listener, other, ring, accepted, stray):
            s.close()


# Two ring ranks: rank 1 enters an all_sum that rank 0 joins only WAIT s later, and
# reports the CPU seconds its process spent in that wait.
_WAITING_RANK = """
import resource, sys, time
import mlx.core as mx
from ds4mlx.engine.deadline import StepDeadline
from ds4mlx.engine.pipeline import fill_launcher_stdin

WAIT = 3.0
fill_launcher_stdin()  # else mlx.launch's per-rank threads spin beside the ranks
g = mx.distributed.init(strict=True, backend="ring")
StepDeadline(60, "the other rank")  # as on every rank of a split
mx.eval(mx.distributed.all_sum(mx.zeros((16,)), group=g))  # both ranks here


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


if g.rank() == 0:
    time.sleep(WAIT)  # busy elsewhere while rank 1 waits in its all_sum
t, c = time.monotonic(), cpu()
mx.eval(mx.distributed.all_sum(mx.ones((16,)), group=g))
mine = [time.monotonic() - t, cpu() - c] if g.rank() == 1 else [0.0, 0.0]
wall, spent = mx.distributed.all_sum(mx.array(mine), group=g).tolist()
if g.rank() == 0:
    with open(sys.argv[1], "w") as f:
        f.write(f"{wall} {spent}")
"""


@pytest.mark.slow
def test_a_rank_waiting_on_its_peer_sleeps(tmp_path):
    """MLX's ring busy-polls its sockets, so a rank waiting in a collective spun a core
    (on one host, the one its peer computes on). Once a `StepDeadline` exists (every
    rank of a split has one) the wait sleeps: 3 s in an ``all_sum`` cost rank 1 well
    under 0.3 s of CPU (spinning, a whole core's share of the box)."""
    out = tmp_path / "wait.txt"
    _launched([sys.executable, "-c", _WAITING_RANK, str(out)], timeout=120)
    wall, spent = (float(v) for v in out.read_text().split())
    assert wall > 2.0, (wall, spent)  # rank 1 did wait for rank 0
    # Measured: 0.005 s asleep; spinning, 0.32 s on a 2-core box at load 13 (more when idle).
    assert spent < 0.05, (wall, spent)


def test_rank_timeout_must_be_positive():
    from ds4mlx.engine.deadline import StepDeadline

    with pytest.raises(ValueError, match="--rank-timeout must be > 0"):
        StepDeadline(0)


def test_rank_parts_add_up_to_the_whole_model(tiny_f32_dir):
    """The per-rank fit check counts each pipeline rank's layers' weights and KV (rank 0
    also the embedding and head): the ranks add up to the whole model. A tensor rank
    holds every layer's KV and replicated tensors but only its share of the split ones."""
    from ds4mlx.engine.rankfit import pipeline_parts, tensor_parts
    from ds4mlx.model.fit import check_fit

    def fit(part=None):
        return check_fit(str(tiny_f32_dir), 8192, 2, "1TB", gpu=False, part=part)

    whole = fit()
    ranks = [fit(part) for part in pipeline_parts(split_layers(4, 2, [1]))]
    assert sum(r.weights for r in ranks) == whole.weights
    assert sum(r.kv_per_session for r in ranks) == whole.kv_per_session
    assert ranks[0].weights > ranks[1].weights  # the embedding and head
    tensor = [fit(part) for part in tensor_parts(4, 2)]
    assert tensor[0].kv_per_session == whole.kv_per_session
    assert whole.weights / 2 < tensor[0].weights < whole.weights


@pytest.mark.slow
def test_a_rank_that_does_not_fit_its_memory_stops_every_rank(tiny_f32_dir):
    """``--pipeline-split 1`` with 4 resident states at a long context: rank 1 (three
    layers' KV) does not fit a memory limit that rank 0 (embedding, head, one window
    layer) fits. Rank 0 says so in one line naming rank 1 before serving, and both ranks
    refuse to start (non-zero exits)."""
    from server_util import Server

    from ds4mlx.engine.rankfit import pipeline_parts
    from ds4mlx.model.fit import check_fit

    ctx, sessions = 65536, 4
    need = [
        check_fit(str(tiny_f32_dir), ctx, sessions, "1TB", gpu=False, part=part).total
        for part in pipeline_parts(split_layers(4, 2, [1]))
    ]
    assert need[1] > need[0]
    limit = (need[0] + need[1]) // 2
    extra = ["--distributed", "pipeline", "--pipeline-split", "1", "--sessions", str(sessions)]
    server = Server(tiny_f32_dir, ctx=ctx, extra=[*extra, "--memory-limit", str(limit)])
    under_launcher(server)
    try:
        with pytest.raises(RuntimeError, match="server exited") as e:
            server.start(timeout=300)
    finally:
        kill_group(server.proc)
        server.kill()
    log = str(e.value)
    lines = [ln for ln in _said(log) if "rank 1 of 2 (layers 1-3) does not fit" in ln]
    assert len(lines) == 1 and lines[0].startswith("ds4mlx serve: cannot load model"), log
    assert "url " not in log  # never served
    # Rank 0 exits first (rank 1 waits for it); the launcher then stops rank 1, which
    # ignores SIGTERM and exits on its own once rank 0 is gone.
    assert "rank 0 exited with code 2" in log, log
    assert "rank 1 does not fit its memory (rank 0 says why)" in log, log


def test_split_layers_even_and_explicit():
    assert split_layers(43, 2) == [range(0, 22), range(22, 43)]
    assert split_layers(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert split_layers(43, 2, [10]) == [range(0, 10), range(10, 43)]


@pytest.mark.parametrize(
    "n, world, starts, words",
    [
        (4, 5, None, "only 4 layers"),
        (4, 2, [0], "non-empty"),
        (4, 2, [4], "non-empty"),
        (4, 3, [2, 2], "non-empty"),
        (4, 2, [1, 2], "names 2 start"),
    ],
)
def test_split_layers_refuses_bad_splits(n, world, starts, words):
    with pytest.raises(PipelineError, match=words):
        split_layers(n, world, starts)


def test_part_store_round_trip_checks_and_removal(tmp_path):
    """A rank's part: written by its writer thread, read back bit-exactly for the same
    key and token count only; a flipped byte, another token count or a missing file is a
    miss (None); rank 0's scan never lists parts and ``kv rm --all`` removes them."""
    from ds4mlx.kv.parts import PartStore
    from ds4mlx.kv.store import clear_dir, scan_dir

    key = "ab" * 20
    arrays = {"cache.2.kv": mx.arange(12, dtype=mx.float32).reshape(3, 4)}
    parts = PartStore(tmp_path, 1)
    parts.save(key, arrays, tokens=3)
    got = parts.load(key, 3)  # waits for the queued write
    assert got is not None and np.array_equal(
        np.array(got["cache.2.kv"]), np.arange(12).reshape(3, 4)
    )
    assert parts.load(key, 4) is None
    assert parts.load("cd" * 20, 3) is None
    assert scan_dir(tmp_path).entries == [] and scan_dir(tmp_path).bad == []
    path = parts.path(key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert parts.load(key, 3) is None
    parts.remove(key)
    assert not path.exists()
    parts.save(key, arrays, tokens=3)
    parts.close()
    assert path.exists()
    clear_dir(tmp_path)
    assert not path.exists()


def test_speculation_is_refused_on_a_split_model(tiny_f32_dir):
    """A verify writes rejected rows into every rank's caches, which the followers cannot
    rewind: drafting is refused under a split (at start, with one line)."""
    from ds4mlx.engine import Engine
    from ds4mlx.engine.speculative import speculation_for
    from ds4mlx.model.loading import load_model, read_config
    from ds4mlx.tokenizer import Tokenizer

    model, args = load_model(str(tiny_f32_dir), dtype=mx.float32, check_memory=False)
    config = read_config(str(tiny_f32_dir))
    tok = Tokenizer.load(tiny_f32_dir)
    split = Engine(model, args, tok, path=tiny_f32_dir, config=config, layout="pipeline:0-2,2-4")
    plain = Engine(model, args, tok, path=tiny_f32_dir, config=config)
    assert split.identity != plain.identity  # nothing saved under one is used by the other
    with pytest.raises(ValueError, match="not supported with --distributed"):
        speculation_for(split, "lookup")
    assert speculation_for(split, "off") is not None
    assert speculation_for(plain, "lookup") is not None


@pytest.mark.parametrize(
    "mode, split, speculative, words",
    [
        (None, "2", "off", "needs --distributed pipeline"),
        ("tensor", "2", "off", "needs --distributed pipeline, not tensor"),
        ("pipeline", "abc", "off", "give the first layer"),
        ("pipeline", "", "off", "give the first layer"),
        ("pipeline", "2,", "off", "give the first layer"),
        ("pipeline", None, "lookup", "--speculative lookup is not supported"),
    ],
)
def test_distributed_flags_are_refused_without_the_model(mode, split, speculative, words):
    """The split flags need no model: every rank refuses them alike before it joins the
    ring (`distributed_split`), drafting under a split included."""
    from ds4mlx.engine.pipeline import distributed_split

    with pytest.raises(PipelineError, match=re.escape(words)):
        distributed_split(mode, split, speculative)
    assert distributed_split("pipeline", "1,3") == [1, 3]


def test_a_closed_ring_socket_is_seen_without_reading():
    """`closed_socket` tells an open socket (None, its bytes left unread) from one its
    peer closed; `wait_closed` returns once the peer has closed it, and False after its
    timeout while it stays open."""
    from ds4mlx.engine.deadline import closed_socket, wait_closed

    a, b = socket.socketpair()
    try:
        b.sendall(b"x")
        assert closed_socket(a.fileno()) is None
        assert a.recv(1) == b"x"  # peeked, not read
        assert not wait_closed([a.fileno()], 0.05)
        b.close()
        assert closed_socket(a.fileno()) == "its connection was closed"
        assert wait_closed([a.fileno()], 5)
    finally:
        a.close()
        b.close()


def _said(log: str) -> list[str]:
    """The ``ds4mlx serve:`` lines of a launcher log, from where each starts: the launcher
    prints its own ``[WARN] Node ... exited`` line to stdout and a rank's stderr is merged
    into the same stream unsynchronized, so a rank's line may follow the launcher's on one
    physical line (seen in CI)."""
    return re.findall(r"ds4mlx serve: [^\n]*", log)


def _busy_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, code, line",
    [
        (["--tokens", "0"], 2, "--tokens must be >= 1"),
        (["--draft-tokens", "3"], 2, "--draft-tokens needs --speculative"),
        (["--ctx", "99999999"], 2, "exceeds the model's limit"),
        (["--speculative", "lookup"], 2, "--speculative lookup is not supported"),
        (["--port", "BUSY"], 1, "Address already in use"),
        (["--sessions", "4", "--memory-limit", "60MB"], 2, "rank 0 of 2 (layers 0-1) does not"),
    ],
    ids=["tokens", "draft", "ctx", "lookup", "port", "sessions"],
)
def test_every_rank_refuses_a_bad_serve_flag_alike(tiny_f32_dir, flags, code, line):
    """A flag ``serve`` refuses without the weights (or, ``--sessions``, with the per-rank
    fit check rather than the whole model's): every rank exits with the same code, none
    killed by the launcher (-15) nor told that a peer was lost, and no ``[ring]`` line;
    rank 0's line says why. (Before, the followers skipped rank 0's checks and lost it,
    a rank slower to refuse was killed, ``--ctx`` and ``--speculative`` were refused
    after the weights loaded, and ``--sessions`` by the whole model's fit.) Malformed
    splits are refused the same way (`distributed_split`, above)."""
    from server_util import free_port

    from tests.dist_util import _launched

    held, port = _busy_port()
    argv = [sys.executable, "-m", "ds4mlx.cli", "serve", "-m", str(tiny_f32_dir)]
    argv += ["--distributed", "pipeline", "--kv-disk-dir", "none", "--port", str(free_port())]
    argv += [str(port) if f == "BUSY" else f for f in flags]
    try:
        log = _launched(argv, 300, clean=False)
    finally:
        held.close()
    codes = dict(re.findall(r"rank (\d) exited with code (-?\d+)", log))
    assert codes == {"0": str(code), "1": str(code)}, log[-3000:]
    assert "[ring]" not in log and " lost" not in log, log[-3000:]
    assert len([ln for ln in _said(log) if line in ln]) == 1, log[-3000:]  # rank 0's alone


@pytest.mark.slow
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_launch_of_two_ranks_without_distributed_is_refused(tiny_f32_dir, command):
    """``mlx.launch`` of two ranks without ``--distributed``: each rank would run alone
    (two servers; on one host the second lost the port). Every rank refuses alike,
    before loading, and rank 0 says what to give."""
    from server_util import free_port

    from tests.dist_util import _launched

    argv = [sys.executable, "-m", "ds4mlx.cli", command, "-m", str(tiny_f32_dir)]
    if command == "serve":
        argv += ["--kv-disk-dir", "none", "--port", str(free_port())]
    else:
        argv += ["--prompt", "hi", "--max-tokens", "2"]
    log = _launched(argv, 300, clean=False)
    codes = dict(re.findall(r"rank (\d) exited with code (-?\d+)", log))
    assert codes == {"0": "2", "1": "2"}, log[-3000:]
    said = [ln for ln in re.findall(r"ds4mlx \w+: [^\n]*", log) if "mlx.launch" in ln]
    assert len(said) == 1, log[-3000:]  # rank 0 alone says it
    assert "with 2 ranks: give --distributed pipeline or" in said[0], log[-3000:]
    assert "url " not in log and "[ring]" not in log, log[-3000:]


def test_a_part_removed_while_its_write_is_queued_is_not_left_behind(tmp_path):
    """Rank 0 may evict a snapshot right after ordering its save (the shutdown saves under
    a small ``--kv-disk-space-mb``): the follower's removal comes while its writer thread
    still has the part queued. The removal waits for that write, so no orphan part is
    left (it was written after the removal before)."""
    from ds4mlx.kv.parts import PartStore

    parts = PartStore(tmp_path, 1)
    arrays = {"cache.2.kv": mx.zeros((256, 256), dtype=mx.float32)}
    keys = [f"{i:02x}" * 20 for i in range(8)]
    for key in keys:
        parts.save(key, arrays, tokens=3)
        parts.remove(key)
    parts.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_default_sessions_of_a_split_count_each_ranks_part(tiny_f32_dir, tmp_path, monkeypatch):
    """``serve --distributed`` without ``--sessions``: the default is what each rank's
    part leaves room for (the fewest over the ranks), not what the whole model leaves on
    one machine (it gave a split fewer resident states than its ranks hold)."""
    import argparse
    import json

    from ds4mlx.engine.rankfit import pipeline_parts
    from ds4mlx.kv.policy import KVCacheSettings
    from ds4mlx.model.fit import check_fit
    from ds4mlx.server.cli import _default_sessions

    ctx = 65536
    whole = check_fit(str(tiny_f32_dir), ctx, 1, "1TB", gpu=False)
    ranks = [
        check_fit(str(tiny_f32_dir), ctx, 1, "1TB", gpu=False, part=part)
        for part in pipeline_parts(split_layers(4, 2))
    ]
    # Room for the whole model and 1 state, and for each rank's part and at least 2.
    limit = whole.total + whole.kv_per_session // 2
    assert all(r.total + 2 * r.kv_per_session <= limit for r in ranks)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:1"], ["127.0.0.1:2"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    monkeypatch.setenv("DS4MLX_MEMORY_LIMIT", str(limit))
    args = argparse.Namespace(sessions=None, speculative="off", ctx=ctx, distributed=None)
    kv = KVCacheSettings(disk_dir=None)
    assert _default_sessions(kv, args, str(tiny_f32_dir))[0].sessions == 1
    args.distributed = "pipeline"
    assert _default_sessions(kv, args, str(tiny_f32_dir))[0].sessions >= 2
