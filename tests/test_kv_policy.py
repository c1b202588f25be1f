"""Disk-cache save policy (ds4mlx/kv/policy.py): pure functions over token counts.

The numeric cases follow ds4's own server tests for the same settings, so ds4mlx saves
at the same points as ds4 with the same flags.
"""

from __future__ import annotations

import argparse

import pytest

from ds4mlx.engine import prefill_chunks
from ds4mlx.kv.policy import (
    MAX_DERIVED_BUDGET_MB,
    MIN_DERIVED_BUDGET_MB,
    KVCacheSettings,
    SavePoint,
    SaveTracker,
    add_arguments,
    chat_anchor,
    cold_save_point,
    continued_save_points,
    default_disk_dir,
    derived_budget_mb,
    prefill_save_points,
    should_save_live,
    store_len,
)

D = KVCacheSettings()
USER, ASSISTANT = 9001, 9002


def test_defaults_match_ds4():
    assert (D.min_tokens, D.cold_max_tokens, D.continued_interval_tokens) == (512, 30000, 10000)
    assert (D.boundary_trim_tokens, D.boundary_align_tokens) == (32, 2048)
    assert D.disk_space_mb == 4096 and D.budget_bytes == 4096 * 2**20
    assert not D.enabled and not D.reject_different_quant
    assert D.continued_step == 10240  # 10000 rounded up to the 2048 alignment


def test_settings_validation():
    with pytest.raises(ValueError):
        KVCacheSettings(min_tokens=0)
    with pytest.raises(ValueError):
        KVCacheSettings(boundary_trim_tokens=-1)
    with pytest.raises(ValueError):
        KVCacheSettings(cold_max_tokens=100)  # below min_tokens
    with pytest.raises(ValueError):
        KVCacheSettings(disk_space_mb=0)
    KVCacheSettings(cold_max_tokens=0)  # 0 = cold saves off
    assert KVCacheSettings(continued_interval_tokens=0).continued_step == 0
    assert KVCacheSettings(boundary_align_tokens=0).continued_step == 10000


def test_flags_round_trip(tmp_path, monkeypatch):
    p = argparse.ArgumentParser()
    add_arguments(p)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    default = KVCacheSettings.from_args(p.parse_args([]))
    # On by default, in the user's cache directory, with a budget from the free space.
    assert default.disk_dir == str(tmp_path / "cache" / "ds4mlx" / "kv")
    assert default.disk_space_mb == derived_budget_mb(tmp_path / "cache" / "ds4mlx" / "kv")
    assert default == KVCacheSettings(default.disk_dir, default.disk_space_mb)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_disk_dir() == tmp_path / "home" / ".cache" / "ds4mlx" / "kv"
    off = KVCacheSettings.from_args(p.parse_args(["--kv-disk-dir", "none"]))
    assert not off.enabled and off == D
    s = KVCacheSettings.from_args(
        p.parse_args(
            "--kv-disk-dir /tmp/kv --kv-disk-space-mb 16 --kv-cache-min-tokens 64 "
            "--kv-cache-cold-max-tokens 1000 --kv-cache-continued-interval-tokens 300 "
            "--kv-cache-boundary-trim-tokens 4 --kv-cache-boundary-align-tokens 128 "
            "--kv-cache-reject-different-quant".split()
        )
    )
    assert s == KVCacheSettings("/tmp/kv", 16, 64, 1000, 300, 4, 128, True)
    assert s.enabled and s.budget_bytes == 16 * 2**20 and s.continued_step == 384
    s = KVCacheSettings.from_args(
        p.parse_args("--kv-cache-no-prompt-end --kv-write-queue-mb 8".split())
    )
    assert not s.prompt_end and s.write_queue_bytes == 8 * 2**20


def test_derived_budget_is_a_quarter_of_free_space_within_bounds(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    free = [100 * 2**30]
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(0, 0, free[0]))
    d = tmp_path / "not" / "yet"  # asks the filesystem the directory will be on
    assert derived_budget_mb(d) == 25 * 1024
    free[0] = 10 * 2**20
    assert derived_budget_mb(d) == MIN_DERIVED_BUDGET_MB
    free[0] = 10 * 2**40
    assert derived_budget_mb(d) == MAX_DERIVED_BUDGET_MB
    # What the cache already holds counts as free: a restart does not shrink the budget.
    d.mkdir(parents=True)
    (d / ("0" * 40 + ".safetensors")).write_bytes(b"x" * (4 * 2**20))
    free[0] = 1024 * 2**20
    assert derived_budget_mb(d) == (1024 + 4) // 4


def test_prompt_end_point():
    on = KVCacheSettings(disk_dir="/x")
    pts = prefill_save_points(on, cached=3000, prompt_tokens=5000, prompt_end=True)
    assert pts == [SavePoint(5000, "prompt")]
    # A live continuation (prompt_end False) or the setting off: none.
    assert prefill_save_points(on, cached=3000, prompt_tokens=5000) == []
    off = KVCacheSettings(disk_dir="/x", prompt_end=False)
    assert prefill_save_points(off, cached=3000, prompt_tokens=5000, prompt_end=True) == []
    # Below min_tokens, already saved there, or nothing to prefill: none.
    assert prefill_save_points(on, cached=0, prompt_tokens=400, prompt_end=True) == []
    assert (
        prefill_save_points(on, cached=10, prompt_tokens=900, last_saved=900, prompt_end=True) == []
    )
    assert prefill_save_points(on, cached=900, prompt_tokens=900, prompt_end=True) == []
    # Cold: the stable point and the end (a frontier there keeps its own name).
    pts = prefill_save_points(on, cached=0, prompt_tokens=11011, prompt_end=True)
    assert pts == [SavePoint(10240, "cold"), SavePoint(11011, "prompt")]
    pts = prefill_save_points(on, cached=100, prompt_tokens=10240, prompt_end=True)
    assert pts == [SavePoint(10240, "continued")]


def test_store_len_trims_and_aligns():
    assert store_len(D, 11011) == 10240
    assert store_len(D, 1695) == 1695  # 1663 aligns to 0 < 512: keep the whole prompt
    assert store_len(D, 544) == 544  # not above min + trim
    assert store_len(D, 2048 + 32) == 2048
    assert store_len(D, 2048 + 31) == 2079
    s = KVCacheSettings(boundary_trim_tokens=0, boundary_align_tokens=1000)
    assert store_len(s, 3500) == 3000
    s = KVCacheSettings(boundary_trim_tokens=0, boundary_align_tokens=0)
    assert store_len(s, 3500) == 3500


def test_chat_anchor_last_user_before_first_assistant():
    s = KVCacheSettings(min_tokens=4)
    codex = [1, 2, USER, 3, 4, USER, 5, ASSISTANT]  # environment item, then the task
    assert chat_anchor(s, codex, user_token_id=USER, assistant_token_id=ASSISTANT) == 5
    claude = [1, 2, 3, 4, USER, 5, ASSISTANT]
    assert chat_anchor(s, claude, user_token_id=USER, assistant_token_id=ASSISTANT) == 4
    multi = [1, 2, USER, 3, ASSISTANT, 4, USER, 5, ASSISTANT]  # later turns do not count
    s2 = KVCacheSettings(min_tokens=2)
    assert chat_anchor(s2, multi, user_token_id=USER, assistant_token_id=ASSISTANT) == 2
    s3 = KVCacheSettings(min_tokens=3)
    assert chat_anchor(s3, multi, user_token_id=USER, assistant_token_id=ASSISTANT) is None


def test_cold_save_point():
    assert cold_save_point(D, 511) is None
    assert cold_save_point(D, 512) == 512
    assert cold_save_point(D, 11011) == 10240
    assert cold_save_point(D, 30000) == 28672
    assert cold_save_point(D, 30001) is None  # continued frontiers cover long prompts
    assert cold_save_point(KVCacheSettings(cold_max_tokens=0), 5000) is None
    # With marker ids, the chat anchor wins when it is long enough.
    prompt = [7] * 3000 + [USER] + [8] * 3000 + [ASSISTANT]
    ids = {"user_token_id": USER, "assistant_token_id": ASSISTANT}
    assert cold_save_point(D, prompt, **ids) == 3000
    assert cold_save_point(D, prompt) == store_len(D, len(prompt)) == 4096
    short_anchor = [7] * 100 + [USER] + [8] * 3000 + [ASSISTANT]
    assert cold_save_point(D, short_anchor, **ids) == 2048


def test_continued_frontiers():
    assert continued_save_points(D, 0, 10239) == []
    assert continued_save_points(D, 10239, 10240) == [10240]
    assert continued_save_points(D, 10240, 10241) == []
    assert continued_save_points(D, 0, 31000) == [10240, 20480, 30720]
    assert continued_save_points(D, 0, 31000, last_saved=10240) == [20480, 30720]
    assert continued_save_points(D, 24576, 30720, last_saved=24576) == [30720]
    assert continued_save_points(D, 10240, 18432, last_saved=10240) == []
    s = KVCacheSettings(boundary_align_tokens=0)
    assert continued_save_points(s, 20480, 29999, last_saved=20480) == []
    assert continued_save_points(s, 29999, 30000, last_saved=20480) == [30000]
    small = KVCacheSettings(min_tokens=600, continued_interval_tokens=256, boundary_align_tokens=0)
    assert continued_save_points(small, 0, 1100) == [768, 1024]  # 256, 512 < min_tokens
    assert continued_save_points(KVCacheSettings(continued_interval_tokens=0), 0, 10**6) == []
    assert continued_save_points(D, 500, 400) == []


def test_prefill_save_points_merge_cold_and_continued():
    pts = prefill_save_points(D, cached=0, prompt_tokens=25000)
    assert pts == [
        SavePoint(10240, "continued"),
        SavePoint(20480, "continued"),
        SavePoint(24576, "cold"),
    ]
    # A cold point on a frontier is written once, as cold.
    assert prefill_save_points(D, cached=0, prompt_tokens=10240 + 40) == [SavePoint(10240, "cold")]
    # Reused prefix: no cold save, only frontiers beyond what is cached.
    assert prefill_save_points(D, cached=12000, prompt_tokens=25000) == [
        SavePoint(20480, "continued")
    ]
    assert prefill_save_points(D, cached=0, prompt_tokens=100) == []
    assert prefill_save_points(D, cached=0, prompt_tokens=1695) == [SavePoint(1695, "cold")]
    prompt = [7] * 3000 + [USER] + [8] * 9000 + [ASSISTANT]
    pts = prefill_save_points(
        D, cached=0, prompt_tokens=prompt, user_token_id=USER, assistant_token_id=ASSISTANT
    )
    assert pts == [SavePoint(3000, "cold"), SavePoint(10240, "continued")]
    for p in pts:
        assert 0 < p.tokens <= len(prompt)


def test_prefill_chunks_stop_at_save_points():
    assert prefill_chunks(0, 5000, 2048) == [2048, 4096, 5000]
    assert prefill_chunks(0, 5000, 2048, [3000, 4096, 6000]) == [2048, 3000, 4096, 5000]
    # Absolute alignment: a reused prefix does not shift the chunk schedule.
    assert prefill_chunks(1500, 5000, 2048, [1500, 2500]) == [2048, 2500, 4096, 5000]
    assert prefill_chunks(7, 7, 2048) == []
    with pytest.raises(ValueError):
        prefill_chunks(0, 10, 0)
    with pytest.raises(ValueError):
        prefill_chunks(10, 0, 4)


def test_live_saves_and_tracker():
    on = KVCacheSettings(disk_dir="/tmp/x")
    assert should_save_live(on, 512) and not should_save_live(on, 511)
    assert not should_save_live(D, 10**6)  # no directory, no saves
    t = SaveTracker()
    assert t.continued(D, 0, 20480) == [10240, 20480]
    t.saved(20480)
    assert t.continued(D, 20480, 30720) == [30720]
    t.saved(10240)
    assert t.last_saved == 20480
    t.loaded(30720)  # a disk snapshot already holds this frontier
    assert t.continued(D, 30720, 30721) == []
    t.reset()
    assert t.continued(D, 0, 10240) == [10240]


def test_a_disk_budget_without_a_disk_cache_is_said(tiny_model_dir, caplog):
    """``--kv-disk-dir none --kv-disk-space-mb N``: the budget has no effect, and serve says
    so at start (it was accepted silently)."""
    import logging

    from ds4mlx.cli import build_parser
    from ds4mlx.server.cli import _kv_settings

    def settings(*flags: str):
        argv = ["serve", "-m", str(tiny_model_dir), "--sessions", "1", *flags]
        with caplog.at_level(logging.WARNING, logger="ds4mlx.server"):
            return _kv_settings(build_parser().parse_args(argv), str(tiny_model_dir))[0]

    assert settings("--kv-disk-dir", "none").disk_dir is None
    assert "has no effect" not in caplog.text
    assert settings("--kv-disk-dir", "none", "--kv-disk-space-mb", "100").disk_dir is None
    assert "--kv-disk-space-mb 100 has no effect: --kv-disk-dir none" in caplog.text
