"""Issue 19: client sessions, with what the real Claude Code sends.

Claude Code's request shapes and headers are captured at test time from the real CLI in
``tests/clients`` (``benchmarks/client_capture.py``: ``claude -p`` against a loopback
capture server; nothing it sends is stored in the repository), then:

- its traffic shape (``benchmarks/client_traffic.py``: a main conversation of tool loops,
  a title request after every turn, two sub-agents whose second request carries their
  late system message, the captured session and agent headers) is replayed against
  ``ds4mlx serve --demo`` with the default flags: no request after the first of each
  conversation is cold, and the main conversation's turns are live continuations or disk
  hits of at least 95 % of their prompt;
- with ``--sessions 2``, the main conversation (its session id) and a sub-agent (its
  agent id) interleave for 10 rounds, each round after the first a live continuation on
  its own state; the second sub-agent's id then takes the lowest-valued state, never the
  main conversation's, which is the most valuable.

Plan decisions come from the server's per-request log line (the replay) or ``--trace``.
"""

from __future__ import annotations

import re

import pytest
from kv_server_util import EOS, LOOKUP_TOOL, long_system, script, traced_server
from server_util import HTTP, benchmark_module, require_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def claude(tmp_path_factory) -> dict:
    """Claude Code's captured shapes and headers (`client_capture.capture_claude`)."""
    require_cli("claude")
    work = tmp_path_factory.mktemp("capture-claude")
    shapes = benchmark_module("client_capture").capture_claude(work)
    h = shapes["headers"]
    # What the real CLI sends: a session id on every request; each sub-agent its own id.
    session = h["main"]["x-claude-code-session-id"]
    assert h["title"]["x-claude-code-session-id"] == session
    ids = [s["x-claude-code-agent-id"] for s in h["subs"]]
    assert len(set(ids)) == 2 and all(s["x-claude-code-session-id"] == session for s in h["subs"])
    assert "x-claude-code-agent-id" not in h["main"]
    return shapes


def _decisions(log: str) -> list[str]:
    """The plan decision of each request, from the per-request log lines, in order."""
    return re.findall(r"^\S+ /v1/messages (\S+) ", log, flags=re.M)


def test_claude_code_traffic_with_default_flags_is_never_cold_after_the_first(claude, tmp_path):
    """Must-hold 1: the replay with default flags (no ``--sessions``): two sub-agents
    (turns 3 and 7), a title request after every turn, retry, recovery and replay."""
    traffic = benchmark_module("client_traffic")
    run = traffic.Run("defaults", [], tmp_path, 32768, headers=True)
    try:
        traffic.ClaudeTraffic(claude, run, 7, restart_at=None).run_all()
    finally:
        run.stop()
    log = (tmp_path / "serve.log").read_text()
    assert "4 resident" in log, log[:3000]  # the default: min(4, what memory holds)
    decisions = _decisions(log)
    rows = run.rows
    assert len(decisions) == len(rows), (decisions, rows)
    seen: set[str] = set()
    report = [(r.conv, r.kind, r.prompt, r.cached, d) for r, d in zip(rows, decisions, strict=True)]
    for r, d in zip(rows, decisions, strict=True):
        first = r.conv not in seen
        seen.add(r.conv)
        if first:
            continue
        assert r.cached > 0 and d != "cold", report
        if r.conv == "main" and r.kind != "retry":
            assert d in ("live-anthropic", "exact-token-prefix", "text-prefix", "disk"), report
            assert r.cached >= 0.95 * r.prompt, report
    assert {"main", "title1", "sub3", "sub7"} <= seen, seen


def test_captured_agent_ids_keep_their_states_and_a_third_takes_the_lowest(
    claude, tiny_model_dir, tmp_path_factory
):
    """Must-hold 4 with ``--sessions 2`` and the captured headers: the main conversation
    and a sub-agent interleave for 10 rounds, each on its own state, every round after
    the first a live continuation; the second sub-agent's id then takes the sub-agent's
    state (the lower-valued one), not the main conversation's."""
    h = claude["headers"]
    from ds4mlx.routes.common import helper_agent

    # The real sub-agents are conversations of their own, not helpers (side requests).
    assert not any(helper_agent(s) for s in h["subs"]) and not helper_agent(h["main"])
    convs = {
        "main": (h["main"], long_system(240, seed=141)),
        "sub": (h["subs"][0], long_system(30, seed=142)),
        "third": (h["subs"][1], long_system(30, seed=143)),
    }
    history: dict[str, list] = {name: [] for name in convs}

    with traced_server(tiny_model_dir, tmp_path_factory, extra=["--sessions", "2"]) as server:

        def turn(name: str, i: int) -> dict:
            headers, system = convs[name]
            history[name].append({"role": "user", "content": f"{name} round {i}"})
            script(server, f"Done {name} {i}." + EOS)
            body = {
                "model": "deepseek-chat",
                "max_tokens": 20,
                "system": system,
                "tools": [LOOKUP_TOOL],
                "messages": history[name],
            }
            r = HTTP.post(server.url + "/v1/messages", json=body, headers=headers, timeout=600)
            assert r.status_code == 200, r.text[:2000]
            history[name].append({"role": "assistant", "content": r.json()["content"]})
            return server.trace.last()

        states: dict[str, str] = {}
        for i in range(10):
            for name in ("main", "sub"):
                plan = turn(name, i)
                state = plan["detail"].split("state=")[1].split()[0]
                if i == 0:
                    states[name] = state
                    continue
                assert state == states[name], (name, i, plan)
                assert "via=live" in plan["detail"], (name, i, plan)
                assert plan["decision"] in ("exact-token-prefix", "text-prefix"), (name, i, plan)
                assert plan["cached"] > 0, plan
        assert states["main"] != states["sub"]
        health = {s["key"]: s for s in server.health()["states"]}
        main_key = "session:" + h["main"]["x-claude-code-session-id"]
        sub_key = "agent:" + h["subs"][0]["x-claude-code-agent-id"]
        assert health[main_key]["tokens"] > 2 * health[sub_key]["tokens"], health
        # A third agent: the sub-agent's state is the lowest-valued (fewer tokens, and the
        # main conversation ran one job before it), so it is the one replaced.
        plan = turn("third", 0)
        assert plan["decision"] == "cold", plan
        assert f"state={states['sub']} via=room" in plan["detail"], plan
        # The main conversation still continues its own state live.
        plan = turn("main", 10)
        assert f"state={states['main']} via=live" in plan["detail"], plan
        assert plan["decision"] in ("exact-token-prefix", "text-prefix"), plan
