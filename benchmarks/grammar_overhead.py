"""Cost of grammar-constrained decoding (issue 24): mask ms/token and tok/s vs unconstrained.

Model: the tiny config in Flash's layout at Flash depth (43 layers, 20 Sinkhorn iterations, as
``benchmarks/decode_graph.py`` builds it), seeded random float32 weights, the real
DeepSeek V4 tokenizer (vocab 129280). The constrained turn samples a JSON array of
small objects (``{"cmd": string ≤ 8 chars, "n": integer ≤ 999}``, no ``maxItems``), so
it never ends and mixes structure with payload; the unconstrained turn samples the
same number of tokens (``ignore_eos``).

Method: ``--runs`` runs (3), each one unconstrained and one constrained turn of
``--tokens`` (200) tokens, interleaved; figures are medians over runs. Reported: tok/s
of each and their ratio, mask fill (llguidance bitmask) and apply (unpack + ``mx.where``)
ms/token, and the median time the loop waited on the mask per step.

    python benchmarks/grammar_overhead.py [--runs 3] [--tokens 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

from ds4mlx.blas import active_blas, ensure_openblas

ensure_openblas()

import mlx.core as mx  # noqa: E402

from ds4mlx.engine import Engine, SamplingParams, TurnSpec, run_turn  # noqa: E402
from ds4mlx.engine.grammar import json_grammar, ll_tokenizer  # noqa: E402
from ds4mlx.model.config import ModelArgs  # noqa: E402
from ds4mlx.model.tiny import random_model, tiny_config  # noqa: E402
from ds4mlx.tokenizer import Tokenizer  # noqa: E402

LAYERS = 43
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "cmd": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["cmd", "n"],
        "additionalProperties": False,
    },
}
PROMPT = "<｜begin▁of▁sentence｜><｜User｜>list commands as JSON<｜Assistant｜></think>"


class _Probe:
    """A grammar that keeps the `GrammarHooks` it makes, to read their `MaskStats`."""

    def __init__(self, grammar):
        self.grammar, self.made = grammar, None

    def hooks(self, inner):
        self.made = self.grammar.hooks(inner)
        return self.made


def _turn(engine, tokens: int, seed: int, grammar=None) -> float:
    s = engine.new_session()
    try:
        sp = SamplingParams(temperature=1.0, top_p=1.0, min_p=0.0, seed=seed)
        spec = TurnSpec(sp, max_tokens=tokens, ignore_eos=True, grammar=grammar)
        r = run_turn(s, engine.tokenizer, spec, prefill=engine.tokenizer.encode(PROMPT))
        assert r.completion_tokens == tokens, (r.finish, r.completion_tokens)
        return r.completion_tokens / r.decode_s
    finally:
        s.reset()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cfg = tiny_config(LAYERS, sinkhorn_iters=20)  # Flash's count, as its decode step pays
    model = random_model(cfg)
    tok = Tokenizer.load()
    with tempfile.TemporaryDirectory() as d:
        engine = Engine(model, ModelArgs.from_dict(cfg), tok, path=d, config=cfg, ctx_size=2048)
    grammar = json_grammar(SCHEMA, ll_tokenizer(tok, cfg["vocab_size"]))
    _turn(engine, 8, 0)  # warm-up (compiles, tokenizer, llguidance)
    free, constrained, fill, apply, wait = [], [], [], [], []
    for run in range(a.runs):
        free.append(_turn(engine, a.tokens, run))
        probe = _Probe(grammar)
        constrained.append(_turn(engine, a.tokens, run, probe))
        st = probe.made.stats
        fill.append(1e3 * st.fill_s / st.steps)
        apply.append(1e3 * st.apply_s / st.steps)
        wait.append(1e3 * statistics.median(st.waits))
    med = statistics.median
    out = {
        "layers": LAYERS,
        "tokens": a.tokens,
        "runs": a.runs,
        "device": str(mx.default_device()),
        "blas": active_blas(),
        "unconstrained_tok_s": med(free),
        "constrained_tok_s": med(constrained),
        "ratio": med(c / f for c, f in zip(constrained, free, strict=True)),
        "mask_fill_ms_per_token": med(fill),
        "mask_apply_ms_per_token": med(apply),
        "median_mask_wait_ms": med(wait),
    }
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
