"""The engine: model + tokenizer (`Engine`), the live `Session`, and the one turn loop.

One loaded model, one live ``Session``; every request is a job that runs on it, one at
a time, on one thread (MLX streams are per thread: load the engine on the thread that
runs it). The engine never sees JSON, HTTP or the prompt cache's policy: a caller
passes in what to prefill (a plan) and what to generate (`TurnSpec`).

Typical use::

    engine = Engine.load("/models/ds4-flash")
    ids = engine.tokenizer.encode(prompt)
    result = run_turn(engine.session, engine.tokenizer,
                      TurnSpec(SamplingParams(temperature=0), max_tokens=64, parse=False),
                      prefill=ids, emit=print)

Modules: `core` (``Engine``), `session` (``Session``, snapshots, prefill chunking),
`sampling`, `turn` (the turn loop and its events).
"""

from ds4mlx.engine.core import (
    DEFAULT_CTX_CPU,
    DEFAULT_CTX_GPU,
    Engine,
    QuantInfo,
    default_ctx_size,
    describe_quant,
)
from ds4mlx.engine.hooks import TurnHooks, chain_hooks
from ds4mlx.engine.sampling import SamplingParams
from ds4mlx.engine.session import (
    DEFAULT_CHUNK,
    ContextOverflowError,
    Session,
    SessionState,
    SnapshotError,
    prefill_chunks,
)
from ds4mlx.engine.steer import Steering, close_reasoning
from ds4mlx.engine.turn import (
    FINISH_CANCELLED,
    FINISH_CONTEXT,
    FINISH_LENGTH,
    FINISH_STEERED,
    FINISH_STOP,
    FINISH_STOP_SEQUENCE,
    PromptLogprobs,
    RawText,
    TokenLogprob,
    Turn,
    TurnResult,
    TurnSpec,
    run_turn,
)

__all__ = [
    "DEFAULT_CHUNK",
    "DEFAULT_CTX_CPU",
    "DEFAULT_CTX_GPU",
    "FINISH_CANCELLED",
    "FINISH_CONTEXT",
    "FINISH_LENGTH",
    "FINISH_STEERED",
    "FINISH_STOP",
    "FINISH_STOP_SEQUENCE",
    "ContextOverflowError",
    "Engine",
    "QuantInfo",
    "PromptLogprobs",
    "RawText",
    "SamplingParams",
    "Session",
    "SessionState",
    "SnapshotError",
    "Steering",
    "TokenLogprob",
    "Turn",
    "TurnHooks",
    "TurnResult",
    "TurnSpec",
    "chain_hooks",
    "close_reasoning",
    "default_ctx_size",
    "describe_quant",
    "prefill_chunks",
    "run_turn",
]
