"""Issue 12: ``benchmarks/client_traffic.py`` on a short session, with the real CLIs.

The benchmark captures Claude Code's and Codex's request shapes from the real CLIs (a
capture server on loopback) and replays the traffic against ``ds4mlx serve --demo``.
Here two main turns under the defaults (the first one's sub-agent comes at turn 3, so
none): the benchmark must keep running, the captured shapes must be what the replay
expects, and on Claude Code's real ~20k-token prompt the retry shape of issue 12 must be
served from the cache up to at least its system text and tools. Fails (not skips) under
CI when a CLI is missing.
"""

from __future__ import annotations

import json

import pytest
from server_util import benchmark_module, require_cli

pytestmark = pytest.mark.slow


def test_client_traffic_short_session(tmp_path):
    require_cli("claude")
    require_cli("codex")
    out = tmp_path / "figures.json"
    assert (
        benchmark_module("client_traffic").main(
            ["--turns", "2", "--configs", "b", "--json", str(out)]
        )
        == 0
    )
    figures = json.loads(out.read_text())["configs"]["b"]
    rows = [
        dict(zip(("client", "kind", "prompt", "cached", "conv"), r, strict=True))
        for r in figures["rows"]
    ]
    claude = [r for r in rows if r["client"] == "claude"]
    codex = [r for r in rows if r["client"] == "codex"]
    # Claude Code: cut first request, retry, answer, title; then request, answer, title.
    kinds = ["main", "retry", "main", "title", "main", "main", "title"]
    assert [r["kind"] for r in claude] == kinds, claude
    first, retry = claude[0], claude[1]
    assert first["cached"] == 0 and first["prompt"] > 15000, first  # the real prompt, cold
    # The retry moved the mid-conversation system text into the user turn: everything
    # up to there (system text and tools, most of the prompt) comes from the cache.
    assert retry["cached"] >= 0.8 * retry["prompt"], retry
    # Tool-result turns continue the live state: only their suffix is prefilled.
    for r in (claude[2], claude[5], codex[2], codex[5]):
        assert r["prompt"] - r["cached"] < 600, r
    # Codex's retry is the identical request: served whole from the prompt-end snapshot.
    assert codex[1]["kind"] == "retry" and codex[1]["cached"] >= codex[1]["prompt"] - 1, codex
    assert figures["ratio"] < 0.35, figures
