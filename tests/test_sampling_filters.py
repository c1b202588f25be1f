"""ds4mlx's own top-p / min-p / top-k filters keep the same tokens as mlx-lm's.

ds4mlx writes these filters itself so that no runtime path imports mlx-lm (whose
package init pulls in transformers); mlx-lm stays the reference they are checked against.
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from ds4mlx.engine.sampling import (  # noqa: E402
    SamplingParams,
    min_p_filter,
    sample_token,
    top_k_filter,
    top_p_filter,
)


def _logprobs(seed: int, vocab: int = 1000, scale: float = 3.0) -> mx.array:
    logits = mx.random.normal((1, vocab), key=mx.random.key(seed)) * scale
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_matches_mlx_lm(seed, top_p):
    from mlx_lm.sample_utils import apply_top_p

    lp = _logprobs(seed)
    assert mx.array_equal(top_p_filter(lp, top_p), apply_top_p(lp, top_p)).item()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_mlx_lm(seed, min_p):
    from mlx_lm.sample_utils import apply_min_p

    lp = _logprobs(seed)
    assert mx.array_equal(min_p_filter(lp, min_p), apply_min_p(lp, min_p)).item()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("top_k", [1, 2, 40, 999])
def test_top_k_matches_mlx_lm(seed, top_k):
    from mlx_lm.sample_utils import apply_top_k

    lp = _logprobs(seed)
    ours, theirs = top_k_filter(lp, top_k), apply_top_k(lp, top_k)
    assert mx.array_equal(mx.isinf(ours), mx.isinf(theirs)).item()
    assert int(mx.isfinite(ours).sum()) == top_k


def test_filters_bound_the_draw():
    """Every draw lands among the tokens the filters keep."""
    lp = _logprobs(7, vocab=200)[0]
    params = SamplingParams(temperature=1.5, top_p=0.8, top_k=5, min_p=0.05)
    kept = top_k_filter(min_p_filter(top_p_filter(lp[None], 0.8), 0.05), 5)[0]
    allowed = {i for i, v in enumerate(kept.tolist()) if v != float("-inf")}
    drawn = {int(sample_token(lp, params, mx.random.key(s))) for s in range(200)}
    assert drawn and drawn <= allowed


def test_draws_follow_the_tempered_distribution_of_unnormalised_logits():
    """`sample_token` draws from softmax(filtered logits / T) without normalising first:
    a large common offset (no log-probabilities here) changes neither the kept set nor
    the frequencies (chi-square), and top-p's mass stays finite."""
    import numpy as np
    from scipy.stats import chisquare

    base = mx.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=0.7, top_p=0.95)
    lp = np.array(mx.softmax(base / 0.7).tolist(), dtype=np.float64)
    kept = top_p_filter(base[None] - mx.logsumexp(base), 0.95)[0]
    allowed = [i for i, v in enumerate(kept.tolist()) if v != float("-inf")]
    assert len(allowed) < len(lp)  # the filter drops something at this mass
    expected = np.zeros(len(lp))
    expected[allowed] = lp[allowed] / lp[allowed].sum()
    n = 4000
    for offset in (0.0, 500.0):
        keys = mx.random.split(mx.random.key(3), n)
        draws = [int(sample_token(base + offset, params, keys[i])) for i in range(n)]
        hits = np.bincount(draws, minlength=len(lp)).astype(np.float64)
        assert set(np.nonzero(hits)[0]) <= set(allowed), offset
        assert chisquare(hits[allowed], expected[allowed] * n).pvalue > 1e-4, offset


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 0.0, 5e-5, 1e-3])
def test_a_vanishing_temperature_draws_the_argmax(temperature):
    """A temperature whose reciprocal overflows float32 (1e-40) scaled the logits to
    ±inf and drew among every positive logit where the engine was called directly (the
    routes alone mapped tiny temperatures to 0): below 1e-4 a request is greedy
    (`Session.sample_async` takes the argmax), and just above it the draw is the argmax."""
    logits = mx.array([1.0, 3.0, 2.0, 0.0, -1.0])
    params = SamplingParams(temperature=temperature)
    assert params.greedy == (temperature < 1e-4)
    if not params.greedy:
        draws = {int(sample_token(logits, params, mx.random.key(s))) for s in range(50)}
        assert draws == {1}


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-10])
def test_a_vanishing_top_p_keeps_the_top_token(top_p):
    """A top_p whose product with the mass underflows float32 (1e-300: inside every
    route's (0, 1]) indexed past the sorted row and drew noise; the top token stays."""
    logits = mx.array([1.0, 3.0, 2.0, -1.0])
    kept = top_p_filter(logits[None], top_p)[0].tolist()
    assert kept == [float("-inf"), 3.0, float("-inf"), float("-inf")]
    params = SamplingParams(temperature=1.0, top_p=top_p)
    assert {int(sample_token(logits, params, mx.random.key(s))) for s in range(20)} == {1}
