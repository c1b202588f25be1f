"""ds4mlx's MLX network against the transformers oracle (docs/ARCHITECTURE.md §2).

The oracle is a tiny float32 ``DeepseekV4ForCausalLM`` built by ``model_fixtures`` under
the fixture rules listed there, saved with ``save_pretrained`` and loaded by ds4mlx.
"""

from __future__ import annotations

from importlib.util import find_spec

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
if find_spec("torch") is None or find_spec("transformers") is None:
    # find_spec, not importorskip: torch and transformers are imported by the fixtures
    # that use them, so collecting the suite does not pay for them.
    pytest.skip("the oracle needs torch and transformers", allow_module_level=True)

from model_fixtures import REF_CONFIG, build_reference, prompt_tokens  # noqa: E402

from ds4mlx.model.loading import load_model  # noqa: E402

PROMPT_LEN = 600
GEN_LEN = 32
ATOL = 2e-4
# Seed chosen so no indexer score ties within 2e-5 at the top-k cut (float error is ~1e-7).
SEED = 4
MIN_INDEX_GAP = 2e-5


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """Reference model, its saved directory, prompt, logits and greedy continuation."""
    import torch

    ref = build_reference(seed=SEED)
    out = tmp_path_factory.mktemp("ref")
    ref.save_pretrained(out)
    toks = prompt_tokens(PROMPT_LEN, REF_CONFIG["vocab_size"], seed=0)

    # Record what the fixture rules require us to observe while the oracle runs.
    seen = {"clamp": 0, "routed": 0, "shared_over": 0, "index_gaps": [], "selecting": 0}
    limit = ref.config.swiglu_limit
    topk = ref.config.index_topk
    ratio = ref.config.compress_rates["compressed_sparse_attention"]
    hooks = []

    def expert_hook(mod, args, _out):
        hidden, idx, _w = args
        for e in idx.unique().tolist():
            tok = (idx == e).any(-1).nonzero().flatten()
            gate_up = hidden[tok] @ mod.gate_up_proj[e].T
            seen["clamp"] += int((gate_up.abs() > limit).sum())
            seen["routed"] += gate_up.numel()

    def shared_hook(mod, args, _out):
        x = args[0]
        seen["shared_over"] += int((mod.gate_proj(x).abs() > limit).sum())
        seen["shared_over"] += int((mod.up_proj(x).abs() > limit).sum())

    def scorer_hook(_mod, _args, scores):
        s = scores[0]  # (S, T) before causal masking; full-prompt call only
        if s.shape[0] != PROMPT_LEN:
            return
        for t in range(s.shape[0]):
            vis = (t + 1) // ratio
            if vis > topk:
                row = torch.sort(s[t, :vis], descending=True).values
                seen["index_gaps"].append(float(row[topk - 1] - row[topk]))
                seen["selecting"] += 1

    for layer in ref.model.layers:
        hooks.append(layer.mlp.experts.register_forward_hook(expert_hook))
        hooks.append(layer.mlp.shared_experts.register_forward_hook(shared_hook))
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            hooks.append(comp.indexer.scorer.register_forward_hook(scorer_hook))
    with torch.no_grad():
        logits = ref(torch.tensor(toks[None].astype(np.int64))).logits[0].float().numpy()
    for h in hooks:
        h.remove()
    with torch.no_grad():
        gen = ref.generate(
            torch.tensor(toks[None].astype(np.int64)),
            attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long),
            max_new_tokens=GEN_LEN,
            min_new_tokens=GEN_LEN,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, PROMPT_LEN:].tolist()
    return dict(ref=ref, dir=str(out), tokens=toks, logits=logits, greedy=gen, seen=seen)


@pytest.fixture(scope="module")
def mlx_model(oracle):
    model, args = load_model(oracle["dir"])
    return model, args


def _forward_np(model, toks, cache=None, **kw):
    return np.array(model(mx.array(np.asarray(toks, dtype=np.int32)[None]), cache, **kw)[0])


def test_fixture_is_discriminating(oracle):
    """The oracle must exercise what model_fixtures' fixture rules ask for."""
    cfg = oracle["ref"].config
    seen = oracle["seen"]
    assert cfg.hc_mult >= 3
    assert cfg.rope_parameters["compress"]["rope_type"] == "yarn"
    assert cfg.index_n_heads >= 8
    assert set(cfg.layer_types) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert set(cfg.mlp_layer_types) == {"hash_moe", "moe"}
    for layer in oracle["ref"].model.layers:
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):
            rows = gate.tid2eid
            assert all(len(set(r.tolist())) == rows.shape[1] for r in rows[:200])
        else:
            assert gate.e_score_correction_bias.abs().max() > 0
    # The SwiGLU clamp fires on a small but non-zero share of routed pre-activations.
    assert seen["clamp"] > 0 and seen["clamp"] < 0.5 * seen["routed"], seen["clamp"]
    # The shared expert exceeds the limit too, so clamping it (transformers' default)
    # would be visible.
    assert seen["shared_over"] > 0
    # The indexer really selects (more visible rows than top-k) and never ties at the cut.
    assert seen["selecting"] > 100
    assert min(seen["index_gaps"]) > MIN_INDEX_GAP, min(seen["index_gaps"])
    # Window, CSA blocks and HCA blocks are all crossed several times.
    assert PROMPT_LEN > 4 * cfg.sliding_window
    assert PROMPT_LEN // cfg.compress_rates["heavily_compressed_attention"] >= 4


def test_prefill_logits_match_oracle(oracle, mlx_model):
    model, _ = mlx_model
    ours = _forward_np(model, oracle["tokens"])
    ref = oracle["logits"]
    assert ours.shape == ref.shape
    err = np.abs(ours - ref).max(axis=-1)
    assert err.max() < ATOL, (
        f"max abs diff {err.max():.2e} first bad position {int(np.argmax(err > ATOL))}"
    )
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_last_only_matches_full(oracle, mlx_model):
    model, _ = mlx_model
    toks = oracle["tokens"][:200]
    full = _forward_np(model, toks)
    last = _forward_np(model, toks, last_only=True)
    assert last.shape == (1, full.shape[-1])
    np.testing.assert_allclose(last[0], full[-1], atol=1e-5)


def test_greedy_continuation_matches_oracle(oracle, mlx_model):
    model, _ = mlx_model
    cache = model.make_cache()
    logits = _forward_np(model, oracle["tokens"], cache, last_only=True)[-1]
    out = []
    for _ in range(GEN_LEN):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = _forward_np(model, [tok], cache)[-1]
    assert out == oracle["greedy"]


@pytest.mark.parametrize(
    "chunks",
    [[1, 15, 16, 100, 3, 365, 100], [128, 128, 128, 216], [31, 569]],
    ids=["ragged", "aligned128", "two"],
)
def test_chunked_prefill_equals_full(oracle, mlx_model, chunks):
    model, _ = mlx_model
    toks = oracle["tokens"]
    assert sum(chunks) == len(toks)
    cache = model.make_cache()
    parts, p = [], 0
    for n in chunks:
        parts.append(_forward_np(model, toks[p : p + n], cache))
        p += n
    ours = np.concatenate(parts)
    assert cache[0].offset == len(toks)
    np.testing.assert_allclose(ours, oracle["logits"], atol=ATOL)


def test_token_by_token_decode_equals_full(oracle, mlx_model):
    """Decode crosses window, CSA (4) and HCA (32) boundaries one token at a time."""
    model, _ = mlx_model
    toks = oracle["tokens"]
    start = 540  # 540..599 crosses HCA boundaries at 544 and 576
    cache = model.make_cache()
    _forward_np(model, toks[:start], cache)
    rows = [_forward_np(model, [int(t)], cache)[0] for t in toks[start:]]
    np.testing.assert_allclose(np.stack(rows), oracle["logits"][start:], atol=ATOL)


def test_state_round_trip_is_bit_identical(oracle, mlx_model):
    model, args = mlx_model
    toks = oracle["tokens"]
    cache = model.make_cache()
    _forward_np(model, toks[:301], cache)  # mid-block for every ratio
    snap = [dict(c.state) for c in cache]
    frozen = [{k: np.array(v) for k, v in s.items()} for s in snap]

    fresh = model.make_cache()
    for c, s in zip(fresh, snap, strict=True):
        c.state = s
    assert [c.offset for c in fresh] == [301] * args.n_layers

    a = np.concatenate(
        [_forward_np(model, toks[301:350], cache)]
        + [_forward_np(model, [int(t)], cache) for t in toks[350:360]]
    )
    b = np.concatenate(
        [_forward_np(model, toks[301:350], fresh)]
        + [_forward_np(model, [int(t)], fresh) for t in toks[350:360]]
    )
    assert np.array_equal(a, b)
    # Continuing must not have changed the arrays of the snapshot we took.
    for s, f in zip(snap, frozen, strict=True):
        for k in f:
            assert np.array_equal(np.array(s[k]), f[k]), k


def test_kv_layout_is_compressed(oracle, mlx_model):
    """Per layer: a W-row ring, one row per complete block, never a full-length raw KV."""
    model, args = mlx_model
    cache = model.make_cache()
    _forward_np(model, oracle["tokens"], cache)
    n = len(oracle["tokens"])
    for i, c in enumerate(cache):
        st = c.state
        assert st["window"].shape == (args.window_size, args.head_dim)
        r = args.compress_ratios[i]
        if r:
            assert st["comp.rows"].shape == (n // r, args.head_dim)
            assert st["comp.pend_kv"].shape[0] == r
        if args.layer_kind(i) == "csa":
            assert st["index.rows"].shape == (n // r, args.index_head_dim)
        else:
            assert not any(k.startswith("index.") for k in st)
        assert c.nbytes > 0
    assert cache[0].nbytes == args.window_size * args.head_dim * 4
