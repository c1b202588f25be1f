"""Run under ``mlx.launch`` by tests/test_distributed.py: a pipeline split of a checkpoint.

``python tests/dist_script.py MODEL_DIR OUT.npz N_PROMPT CHUNK [SPLIT]``

``SPLIT`` ``tensor`` runs a tensor split (`ds4mlx.engine.tensor`) instead.

Rank 0 feeds a seeded prompt of ``N_PROMPT`` ids in chunks of ``CHUNK`` through the
pipeline (full logits of every chunk), then 8 greedy decode steps, then a greedy
32-token turn through the one turn loop (pipelined decode) on a fresh session, twice:
the second time from a snapshot taken after the prompt; it saves
everything to ``OUT.npz`` and shuts the followers down. Other ranks follow.
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
    from ds4mlx.blas import ensure_openblas

    ensure_openblas()
    from ds4mlx.engine.pipeline import PipelineModel, follow, split_layers
    from ds4mlx.model.loading import load_model

    group = mx.distributed.init(strict=True, backend="ring")
    model, args = load_model(model_dir, dtype=mx.float32, check_memory=False)
    engine = None
    if split == "tensor":
        from ds4mlx.engine import tensor

        engine = tensor.start(model, args, group, model_dir)
        if engine is None:  # a follower, until rank 0 shut it down
            return 0
        pm = engine.model
    else:
        starts = [int(s) for s in split.split(",")] if split else None
        ranges = split_layers(args.n_layers, group.size(), starts)
        if group.rank() > 0:
            follow(model, group, ranges)
            return 0
        pm = PipelineModel(model, group, ranges)
    from ds4mlx.engine import Engine, SamplingParams, TurnSpec, run_turn
    from ds4mlx.model.loading import read_config
    from ds4mlx.tokenizer import Tokenizer

    prompt = np.random.default_rng(0).integers(0, args.vocab_size, n_prompt).tolist()
    prefill, decode = feeds(pm, prompt, chunk)
    if engine is None:
        engine = Engine(
            pm, args, Tokenizer.load(model_dir), path=model_dir, config=read_config(model_dir)
        )
    spec = TurnSpec(SamplingParams(temperature=0.0), max_tokens=32, parse=False, ignore_eos=True)
    session = engine.new_session()
    session.prefill(prompt)
    snap = session.snapshot()  # the followers keep their parts in memory
    run_turn(session, engine.tokenizer, spec)
    first = session.tokens[n_prompt:]
    session.restore(snap)
    run_turn(session, engine.tokenizer, spec)
    assert session.tokens[n_prompt:] == first, "a restored snapshot continued differently"
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


if __name__ == "__main__":
    sys.exit(main())
