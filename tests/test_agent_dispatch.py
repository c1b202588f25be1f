"""Read-only calls started at their DSML block's close (issue 23 item 5, agent part).

Real engine (tiny float32 checkpoint, scripted decoding), real files: the first call's
``list`` runs while the model is still writing the second call; a file created after it
finished is missing from its result only because it ran early.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ds4mlx.agent.loop import Agent
from ds4mlx.dsml import ToolCallStart
from tests.agent_script import RecordingUI, invoke, turn


@pytest.fixture(scope="module")
def engine(tiny_f32_dir):
    from ds4mlx.engine import Engine

    return Engine.load(tiny_f32_dir, ctx_size=4096)


class _LateFile(RecordingUI):
    """At the second call's start, waits for the first (dispatched) call to finish,
    then creates ``late.txt`` in the workspace."""

    def __init__(self, ws: Path) -> None:
        super().__init__()
        self.ws = ws
        self.agent: Agent | None = None
        self.first_done_early: bool | None = None

    def event(self, ev) -> None:
        super().event(ev)
        if isinstance(ev, ToolCallStart) and ev.index == 1:
            assert self.agent is not None
            first = next(e.call.id for e in self.calls_ended)
            disp = self.agent.turns.dispatcher
            deadline = time.monotonic() + 20
            while disp.enabled and not disp.done(first) and time.monotonic() < deadline:
                time.sleep(0.01)
            self.first_done_early = disp.done(first)
            (self.ws / "late.txt").write_text("late\n")


def _two_lists() -> list[str]:
    return [
        turn(
            "Look twice.",
            "",
            invoke("list", path="."),
            invoke("search", pattern="late", path="."),
        ),
        turn("Seen.", "Done."),
    ]


@pytest.mark.parametrize("enabled", [True, False])
def test_dispatch_read_only_call_runs_at_its_close(engine, workspace: Path, enabled) -> None:
    (workspace / "a.txt").write_text("a\n")
    ui = _LateFile(workspace)
    agent = Agent(engine, workspace, ui=ui, script=_two_lists())
    ui.agent = agent
    agent.turns.dispatcher.enabled = enabled
    try:
        assert agent.send("look").ok
        results = [m.content for m in agent.messages if m.role == "tool"]
        # In call order, in one suffix (EOS + one user turn + the opener).
        assert len(results) == 2
        suffix = [s for s in agent.steps if s.kind == "tool_results"][-1].text
        assert suffix.count("<｜User｜>") == 1 and suffix.count("<tool_result>") == 2
        assert suffix.index("a.txt") < suffix.index("late.txt:1")
        assert agent.consistent()
        assert ui.first_done_early is enabled
        # Dispatched: the first call ran before late.txt existed; the second after.
        assert ("late.txt" in results[0]) is not enabled
        assert "late.txt:1" in results[1]
    finally:
        agent.close()


def test_dispatch_results_dropped_when_the_turn_is_cut(engine, workspace: Path) -> None:
    (workspace / "a.txt").write_text("a\n")
    long_call = invoke("write", path="b.txt", content="pad " * 400)
    script = [turn("Read, then write.", "", invoke("read", path="a.txt"), long_call)]
    ui = RecordingUI()
    agent = Agent(engine, workspace, ui=ui, script=script, max_tokens=150, yes=True)
    try:
        res = agent.send("go")
        assert res.status == "length"
        # The read closed (and was dispatched), the turn was cut: nothing ran or was added.
        assert [e.call.name for e in ui.calls_ended if e.closed] == ["read"]
        assert [m for m in agent.messages if m.role == "tool"] == []
        assert ui.results == [] and not (workspace / "b.txt").exists()
        assert agent.turns.dispatcher.take(ui.calls_ended[0].call.id) is None
        assert agent.consistent()
    finally:
        agent.close()


def test_dispatch_reads_after_a_write_wait_for_it(engine, workspace: Path) -> None:
    """A read after a write in the same turn reads what the write wrote (not started
    at its close: only the turn's leading read-only calls are)."""
    script = [
        turn(
            "Write, then read it back.",
            "",
            invoke("write", path="n.txt", content="fresh\n"),
            invoke("read", path="n.txt"),
        ),
        turn("Read.", "Done."),
    ]
    agent = Agent(engine, workspace, ui=RecordingUI(), script=script, yes=True)
    try:
        assert agent.send("write and read").ok
        wrote, read = (m.content for m in agent.messages if m.role == "tool")
        assert "fresh" in read and "not found" not in read
    finally:
        agent.close()
