"""Steering the agent's loop (issue 23 item 2), driven from the UI's event callback: the
queue fills while the model writes a tool-call block (deterministic), the turn stops at
the block's close, the call not started is answered "not run", the text follows in the
same user turn, and only that suffix is prefilled.

Real engine (tiny float32 checkpoint, scripted decoding), real files.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ds4mlx.agent.loop import Agent
from ds4mlx.agent.steer import SteerQueue
from ds4mlx.agent.steps import STEERED_TEXT
from ds4mlx.dsml import ToolCallArgsDelta
from ds4mlx.dsml.tokens import EOS
from tests.agent_script import RecordingUI, invoke, turn


@pytest.fixture(scope="module")
def engine(tiny_f32_dir):
    from ds4mlx.engine import Engine

    return Engine.load(tiny_f32_dir, ctx_size=4096)


class _Typist(RecordingUI):
    """Queues ``line`` when ``marker`` streams in a call's arguments (after the first,
    dispatched call has finished)."""

    def __init__(self, steer: SteerQueue, marker: str, line: str) -> None:
        super().__init__()
        self.steer, self.marker, self.line = steer, marker, line
        self.agent: Agent | None = None
        self.typed = False
        self.args = ""

    def event(self, ev) -> None:
        super().event(ev)
        if isinstance(ev, ToolCallArgsDelta):
            self.args += ev.text
        if self.typed or self.marker not in self.args:
            return
        assert self.agent is not None
        first = self.calls_ended[0].call.id
        deadline = time.monotonic() + 20
        while not self.agent.turns.dispatcher.done(first) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.steer.push(self.line)
        self.typed = True


def test_steer_at_a_tool_boundary(engine, workspace: Path) -> None:
    (workspace / "a.py").write_text("print('a')\n")
    script = [
        turn(
            "Read it, then write b.py.",
            "",
            invoke("read", path="a.py"),
            invoke("write", path="b.py", content="STEERME " + "pad " * 60),
        ),
        turn("Go then.", "Switching to Go."),
    ]
    steer = SteerQueue()
    ui = _Typist(steer, "STEERME", "use Go instead")
    agent = Agent(engine, workspace, ui=ui, script=script, yes=True)
    ui.agent = agent
    agent.turns.steer_pending, agent.turns.steer_take = steer.pending, steer.take
    try:
        res = agent.send("write b.py")
        assert res.ok and ui.typed
        assert not (workspace / "b.py").exists()  # the second call never ran
        roles = [m.role for m in agent.messages]
        assert roles == ["system", "user", "assistant", "tool", "tool", "user", "assistant"]
        read, skipped = (m.content for m in agent.messages if m.role == "tool")
        assert "print('a')" in read  # started early: its real result
        assert skipped == STEERED_TEXT
        assert agent.messages[5].content == "use Go instead"
        # The block closed the turn (a tool boundary), so the block's calls were whole.
        first = next(s for s in agent.steps if s.kind == "answer")
        assert first.stop == "steered"
        # Append-only: what was prefilled is exactly the suffix, one user turn.
        step = [s for s in agent.steps if s.kind == "tool_results"][-1]
        assert step.tokens == step.planned
        assert step.text.startswith(EOS + "<｜User｜><tool_result>")
        assert step.text.count("<｜User｜>") == 1
        assert step.text.endswith("use Go instead<｜Assistant｜><think>")
        assert STEERED_TEXT in step.text
        assert agent.consistent()
    finally:
        agent.close()


def test_steer_in_text_stops_at_once(engine, workspace: Path) -> None:
    script = [
        turn("Think.", "STEERME " + "words " * 80),
        turn("Ok.", "Understood."),
    ]
    steer = SteerQueue()
    ui = RecordingUI()
    agent = Agent(engine, workspace, ui=ui, script=script)
    agent.turns.steer_pending, agent.turns.steer_take = steer.pending, steer.take
    ui.on_thinking = None

    seen: list[str] = []

    def text_seen(ev, _orig=ui.event) -> None:
        _orig(ev)
        if type(ev).__name__ == "TextDelta":
            seen.append(ev.text)
            if "STEERME" in "".join(seen) and not steer.pending() and len(seen) < 200:
                steer.push("stop, say something else")
                seen.extend([""] * 200)  # once

    ui.event = text_seen
    try:
        assert agent.send("talk").ok
        said = [m for m in agent.messages if m.role == "assistant"]
        assert len(said) == 2 and said[0].content.count("words") < 80  # cut at once
        assert agent.messages[-2].content == "stop, say something else"
        assert said[1].content == "Understood."
        assert agent.consistent()
    finally:
        agent.close()
