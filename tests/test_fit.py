"""The fit check (ds4mlx.model.fit): weights + KV + working memory vs device memory,
refused before any weight is read."""

from __future__ import annotations

import re

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from ds4mlx.cli import main  # noqa: E402
from ds4mlx.model import fit  # noqa: E402
from ds4mlx.model.checkpoint import scan  # noqa: E402
from ds4mlx.model.config import ModelArgs  # noqa: E402
from ds4mlx.model.errors import FitError  # noqa: E402
from ds4mlx.model.loading import load_model, read_config  # noqa: E402
from ds4mlx.model.units import format_bytes, parse_size  # noqa: E402


@pytest.fixture(scope="module")
def tiny_q(tiny_checkpoint):
    return str(tiny_checkpoint(seed=0))


@pytest.fixture(autouse=True)
def _no_env_limit(monkeypatch):
    monkeypatch.delenv(fit.MEMORY_ENV, raising=False)


def test_parse_size():
    assert parse_size("256MB") == 256_000_000
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("5g") == 5_000_000_000
    assert parse_size(1e9) == 10**9
    assert parse_size("123") == 123
    for bad in ("", "12 parsecs", "-5GB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_bytes(81.2e9) == "81.2 GB"


def test_report_counts_the_weights_as_stored(tiny_q):
    rep = fit.check_fit(tiny_q, ctx_size=4096, memory_limit="1TB", dtype_bytes=4, gpu=False)
    on_disk = sum(t.nbytes for t in scan(tiny_q).values())
    assert rep.weights == on_disk  # own layout at float32: loading adds nothing
    assert rep.fits and rep.source == "memory limit override"
    assert rep.kv_per_session > 0 and rep.working > 0
    kv = fit.format_bytes(rep.kv_per_session)
    assert f"KV {kv} (1 session × {kv} at ctx 4096)" in rep.describe()


def test_kv_estimate_bounds_the_real_cache(tiny_q):
    """The estimate is an upper bound of what a prefill really allocates, and grows with ctx."""
    model, args = load_model(tiny_q)
    cache = model.make_cache()
    n = 700
    toks = np.random.default_rng(0).integers(2, 1000, size=n).astype(np.int32)
    mx.eval(model(mx.array(toks[None]), cache))
    real = sum(c.nbytes for c in cache)
    est = fit.kv_bytes(args, n, 4)
    assert real <= est <= 3 * real + 2e6, (real, est)
    assert fit.kv_bytes(args, 2 * n, 4) > est


def test_refuses_before_reading_any_weight(tiny_q, monkeypatch):
    """Must hold 4: too large for the (overridden) memory → FitError with the numbers."""
    import ds4mlx.model.loading as loading

    def no_read(*_a, **_k):
        raise AssertionError("a weight was read before the fit check")

    monkeypatch.setattr(loading.mx, "load", no_read)
    weights = sum(t.nbytes for t in scan(tiny_q).values())
    args = ModelArgs.from_dict(read_config(tiny_q))
    room = weights + fit.working_bytes(args, 4) + fit.kv_bytes(args, 8192, 4)
    with pytest.raises(FitError) as ei:
        load_model(tiny_q, ctx_size=1_000_000, memory_limit=room)
    msg = str(ei.value)
    rep = ei.value.report
    assert not rep.fits and rep.total > rep.available == room
    assert format_bytes(rep.weights) in msg and format_bytes(room) in msg
    assert "ctx 1000000" in msg and "memory limit override" in msg
    # The largest context that fits is offered and really fits.
    m = re.search(r"--ctx (\d+)", msg)
    assert m, msg
    ok = int(m.group(1))
    assert 8192 <= ok < 1_000_000
    assert fit.check_fit(tiny_q, ctx_size=ok, memory_limit=room, dtype_bytes=4, gpu=False).fits
    # Several resident sessions multiply the KV.
    with pytest.raises(FitError, match="4 sessions ×"):
        load_model(tiny_q, ctx_size=ok, sessions=4, memory_limit=room)


def test_weights_alone_too_big_suggests_lower_bits(tiny_q, monkeypatch):
    monkeypatch.setenv(fit.MEMORY_ENV, "2MB")  # the environment override
    with pytest.raises(FitError) as ei:
        load_model(tiny_q, ctx_size=1024)
    msg = str(ei.value)
    assert "2 MB" in msg and ("--expert-bits" in msg or "more memory" in msg)
    assert "DS4MLX_MEMORY_LIMIT" in msg


def test_generate_cli_refuses_with_memory_limit(tiny_q, capsys, monkeypatch):
    # ``--memory-limit`` reaches the loader through the variable (`_apply_memory_limit`):
    # set under monkeypatch, so it is gone after the test whatever it asserts (a failed
    # assertion once left it behind for every later test of the worker).
    monkeypatch.setenv(fit.MEMORY_ENV, "3MB")
    rc = main(["generate", "-m", tiny_q, "-p", "hi", "-n", "2", "--memory-limit", "3MB"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not fit" in err and "3 MB" in err


def test_device_memory_is_real():
    size, source = fit.device_memory()
    assert size > 2**30 and source in (
        "RAM",
        "cgroup memory limit",
        "Metal recommended working set",
    )


def test_default_sessions_are_what_memory_holds_at_most_four(tiny_q):
    """Issue 19: ``serve``'s default ``--sessions`` is min(4, the states whose KV the
    budget holds after the weights and working memory), at least 1; not even one is the
    fit check's refusal with its numbers."""
    args = ModelArgs.from_dict(read_config(tiny_q))
    weights = fit.check_fit(tiny_q, 4096, memory_limit=1 << 40, dtype_bytes=4, gpu=False)
    base = weights.weights + weights.working
    kv = fit.kv_bytes(args, 4096, 4)
    for states, want in ((1, 1), (2, 2), (3, 3), (4, 4), (9, 4)):
        n, rep = fit.sessions_that_fit(
            tiny_q, 4096, base + states * kv + kv // 2, dtype_bytes=4, gpu=False
        )
        assert (n, rep.sessions) == (want, want) and rep.fits
    with pytest.raises(FitError, match="ctx 4096"):
        fit.sessions_that_fit(tiny_q, 4096, base + kv // 2, dtype_bytes=4, gpu=False)


def test_serve_refuses_sessions_memory_cannot_hold_with_the_numbers(tiny_q, capsys, monkeypatch):
    """Issue 19: ``serve --sessions 0`` and more states than the memory budget holds are
    refused before loading, with the fit check's numbers and how many would fit."""
    from server_util import free_port

    args = ModelArgs.from_dict(read_config(tiny_q))
    one = fit.check_fit(tiny_q, 4096, memory_limit=1 << 40)
    kv = fit.kv_bytes(args, 4096, 2 if mx.default_device() == mx.gpu else 4)
    room = one.weights + one.working + 3 * kv + kv // 2  # three states fit, not four
    limit = ["--memory-limit", str(room), "--ctx", "4096", "--port", str(free_port())]
    monkeypatch.setenv(fit.MEMORY_ENV, str(room))  # `main` sets it: gone after the test
    assert main(["serve", "-m", tiny_q, "--sessions", "4", *limit]) == 2
    err = capsys.readouterr().err
    assert "--sessions 4 does not fit" in err and "(4 sessions × " in err, err
    assert "Memory holds 3" in err and "--sessions 3" in err, err
    assert main(["serve", "-m", tiny_q, "--sessions", "0", *limit]) == 2
    err = capsys.readouterr().err
    assert "--sessions 0: at least one resident state is needed; memory holds 3" in err, err
    # The KV term is the three states' total, not one state's (issue: it read as a total).
    per = fit.format_bytes(kv)
    assert f"KV {fit.format_bytes(3 * kv)} (3 sessions × {per} at ctx 4096)" in err, err
    assert "(memory limit override)" in err, err
