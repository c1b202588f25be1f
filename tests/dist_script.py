"""Run under ``mlx.launch`` by tests/test_distributed.py: a pipeline split of a checkpoint.

``python tests/dist_script.py MODEL_DIR OUT.npz N_PROMPT CHUNK [SPLIT]``

``SPLIT`` ``tensor`` runs a tensor split (`ds4mlx.engine.tensor`) instead.
``… SPLIT reset-idle=T``: every rank's ``--rank-timeout`` is T seconds and rank 0 runs
`reset_then_idle` instead of the checks below.

Rank 0 feeds a seeded prompt of ``N_PROMPT`` ids in chunks of ``CHUNK`` through the
pipeline (full logits of every chunk), then 8 greedy decode steps, then a greedy
32-token turn through the one turn loop (pipelined decode) on a fresh session, three
times: from an in-memory snapshot taken after the prompt, then from the same state saved
to disk per rank (rank 0's store file plus each follower's part, in ``kv`` beside
``OUT.npz``) and loaded back; a load whose parts are missing must fail on rank 0 and
leave every rank in step; removing rank 0's file removes the parts. It saves everything
to ``OUT.npz`` and shuts the followers down. Other ranks follow.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np


def feeds(model, prompt: list[int], chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Feed ``prompt`` to ``model`` (a ``Model`` or a ``PipelineModel``: the same call) in
    chunks of ``chunk``, then 8 greedy decode steps. Returns float32 logits at every
    prompt position ``(len(prompt), vocab)`` and after each decode step ``(8, vocab)``."""
    cache = model.make_cache()
    chunks = []
    for s in range(0, len(prompt), chunk):
        logits = model(mx.array(prompt[s : s + chunk], dtype=mx.int32), cache)
        mx.eval(logits)
        chunks.append(np.array(logits[0]))
    steps, tok = [], int(np.argmax(chunks[-1][-1]))
    for _ in range(8):
        logits = model(mx.array([tok], dtype=mx.int32), cache, last_only=True)
        mx.eval(logits)
        steps.append(np.array(logits[0, -1]))
        tok = int(np.argmax(steps[-1]))
    return np.concatenate(chunks), np.stack(steps)


def main() -> int:
    model_dir, out, n_prompt, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    split = sys.argv[5] if len(sys.argv) > 5 else None
    idle = float(sys.argv[6].removeprefix("reset-idle=")) if len(sys.argv) > 6 else None
    timeout = {"rank_timeout": idle} if idle else {}
    from ds4mlx.blas import ensure_openblas

    ensure_openblas()
    from pathlib import Path

    from ds4mlx.engine.pipeline import PipelineModel, fill_launcher_stdin, follow, split_layers
    from ds4mlx.model.loading import load_model

    # As ``serve`` and ``bench`` do: otherwise mlx.launch's per-rank threads spin on the
    # ranks' empty stdin pipes (measured: 15 CPU-s of a 12 s test on 2 cores).
    fill_launcher_stdin()
    group = mx.distributed.init(strict=True, backend="ring")
    model, args = load_model(model_dir, dtype=mx.float32, check_memory=False)
    from ds4mlx.kv.parts import PartStore

    kv = Path(out).parent / "kv"
    engine = None
    if split == "tensor":
        from ds4mlx.engine import tensor

        engine = tensor.start(
            model, args, group, model_dir, parts=lambda r: PartStore(kv, r), **timeout
        )
        if engine is None:  # a follower, until rank 0 shut it down
            return 0
        pm = engine.model
    else:
        starts = [int(s) for s in split.split(",")] if split else None
        ranges = split_layers(args.n_layers, group.size(), starts)
        if group.rank() > 0:
            follow(model, group, ranges, PartStore(kv, group.rank()), **timeout)
            return 0
        pm = PipelineModel(model, group, ranges, **timeout)
    from ds4mlx.engine import Engine, SamplingParams, TurnSpec, run_turn
    from ds4mlx.model.loading import read_config
    from ds4mlx.tokenizer import Tokenizer

    prompt = np.random.default_rng(0).integers(0, args.vocab_size, n_prompt).tolist()
    if engine is None:
        engine = Engine(
            pm, args, Tokenizer.load(model_dir), path=model_dir, config=read_config(model_dir)
        )
    if idle:
        reset_then_idle(engine, prompt, idle, out)
        return 0
    if split != "tensor":
        write_step_graph(pm, Path(out).parent / "step.dot")
    prefill, decode = feeds(pm, prompt, chunk)
    spec = TurnSpec(SamplingParams(temperature=0.0), max_tokens=32, parse=False, ignore_eos=True)
    session = engine.new_session()
    session.prefill(prompt)
    snap = session.snapshot()  # the followers keep their parts in memory
    run_turn(session, engine.tokenizer, spec)
    first = session.tokens[n_prompt:]
    session.restore(snap)
    run_turn(session, engine.tokenizer, spec)
    assert session.tokens[n_prompt:] == first, "a restored snapshot continued differently"
    _disk_round_trip(engine, session, snap, kv, spec, first, n_prompt)
    pm.shutdown()
    np.savez(
        out,
        prefill=prefill,
        decode=decode,
        turn=np.array(session.tokens[n_prompt:], dtype=np.int64),
        layout=np.array(engine.layout),
        identity=np.array(engine.identity),
    )
    return 0


def write_step_graph(pm, path) -> None:
    """Write the graph of one decode step of rank 0's ``PipelineModel`` ``pm`` (built on
    fresh caches, never evaluated: nothing is sent) as DOT (``mx.export_to_dot``) to
    ``path``."""
    import io

    buf = io.StringIO()
    mx.export_to_dot(buf, pm(mx.array([1], dtype=mx.int32), pm.make_cache(), last_only=True))
    pm.settled()  # built, never launched
    path.write_text(buf.getvalue())


def reset_then_idle(engine, prompt: list[int], timeout: float, out: str) -> None:
    """What the server's worker does after a job failed mid-turn, then idle time: a
    decode step is built (which arms the ``--rank-timeout`` deadline) and abandoned, the
    session is reset (the worker's clean-up), and nothing happens for longer than the
    timeout and its grace. A deadline still armed would end this process (exit 1) before
    the next turn runs and writes its tokens to ``out``."""
    import time

    from ds4mlx.engine import SamplingParams, TurnSpec, run_turn
    from ds4mlx.engine.deadline import GRACE_S

    prompt = prompt[:32]  # short: a slow first chunk must not outlast the timeout
    session = engine.new_session()
    session.prefill(prompt)
    session.abandon(session.begin_decode(mx.argmax(session.logits)))
    session.reset()
    time.sleep(timeout + GRACE_S + 3)
    spec = TurnSpec(SamplingParams(temperature=0.0), max_tokens=4, parse=False, ignore_eos=True)
    run_turn(session, engine.tokenizer, spec, prefill=prompt)
    engine.model.shutdown()
    np.savez(out, turn=np.array(session.tokens[len(prompt) :], dtype=np.int64))


def _disk_round_trip(engine, session, snap, kv, spec, first, n_prompt) -> None:
    """Save ``snap``'s state to disk on every rank, restore it, continue as ``first``."""
    from ds4mlx.engine import SessionState, SnapshotError, run_turn
    from ds4mlx.kv.store import DiskKVStore

    store = DiskKVStore(
        kv, budget_bytes=1 << 30, model_identity=engine.identity, ctx_size=4096, expert_bits=None
    )
    session.restore(snap)
    text = engine.tokenizer.decode(session.tokens)
    key = store.key_of(text)
    state = session.snapshot(disk_key=key)
    store.write(
        store.prepare_save(
            text=text, tokens=state.tokens, arrays=state.arrays, reason="prompt", meta=state.meta
        )
    )
    (entry,) = store.entries()
    loaded = store.load(entry)
    missing = {**loaded.meta, "disk_key": "0" * 39 + "1"}
    try:
        session.restore(SessionState(loaded.tokens, loaded.arrays, missing))
    except SnapshotError:
        pass
    else:
        raise AssertionError("a snapshot without its parts was restored")
    session.restore(SessionState(loaded.tokens, loaded.arrays, {**loaded.meta, "disk_key": key}))
    run_turn(session, engine.tokenizer, spec)
    assert session.tokens[n_prompt:] == first, "a disk snapshot continued differently"
    # Rank 0 removes its file: the next header (here the shutdown) removes the parts.
    store.on_remove = engine.model.drop_part
    assert store.remove(key)


if __name__ == "__main__":
    sys.exit(main())
