"""The agent loop on the real tiny float32 engine, with scripted decoding (issue 6).

Every tool runs for real in a temp workspace; the live session is measured: after the
first prompt each tool round prefills only its tool-result suffix.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ds4mlx.agent.loop import Agent
from ds4mlx.agent.sessions import SessionBook
from ds4mlx.dsml import render_prompt
from ds4mlx.engine import Engine
from ds4mlx.kv.store import DiskKVStore
from tests.agent_script import EOS, RecordingUI, invoke, turn

CTX = 8192


@pytest.fixture(scope="module")
def engine(tiny_f32_dir) -> Engine:
    return Engine.load(tiny_f32_dir, ctx_size=CTX)


def make_store(engine, path: Path) -> DiskKVStore:
    return DiskKVStore(
        path, budget_bytes=1 << 30, model_identity=engine.identity, ctx_size=CTX, expert_bits=None
    )


def tool_texts(agent: Agent) -> list[str]:
    return [m.content for m in agent.messages if m.role == "tool"]


def assert_suffix_only(agent: Agent, engine: Engine) -> list:
    """Each tool round appended only its suffix, onto the untouched live state."""
    tok = engine.tokenizer
    steps = agent.steps
    rounds = [i for i, s in enumerate(steps) if s.kind == "tool_results"]
    assert rounds
    # Only the first message rendered a prompt; nothing was ever re-prefilled.
    first = next(i for i, s in enumerate(steps) if s.kind == "answer")
    assert {s.kind for s in steps[:first]} <= {"prompt", "restore"}
    assert all(s.kind in ("answer", "tool_results") for s in steps[first:])
    for i in rounds:
        s = steps[i]
        prev = steps[i - 1]
        assert prev.kind == "answer" and prev.stop == "eos"
        # The live state continued where the sampled turn ended (+1 token only if a
        # turn ended inside its reasoning and got </think> fed: not in these scripts).
        assert s.before == prev.before + prev.tokens
        assert s.text.startswith(EOS + "<｜User｜><tool_result>")
        assert s.text.endswith("</tool_result><｜Assistant｜><think>")
        assert "<｜begin▁of▁sentence｜>" not in s.text and agent.system_prompt not in s.text
        assert s.tokens == s.planned == len(tok.encode(s.text))
        # ... and the next turn was sampled right after it.
        assert steps[i + 1].kind == "answer" and steps[i + 1].before == s.before + s.tokens
    return [steps[i] for i in rounds]


@pytest.mark.slow
def test_every_tool_in_a_workspace_with_suffix_only_prefill(engine, workspace):
    ui = RecordingUI({"write": "once", "edit": "once", "bash": "always"})
    script = [
        turn(
            "The user wants a file. I will write it and read it back.",
            "Creating notes.txt.",
            invoke("write", path="notes.txt", content="alpha\nbeta\ngamma\n"),
            invoke("read", path="notes.txt"),
        ),
        turn(
            "Replace beta, then look around.",
            "",
            invoke("edit", path="notes.txt", old="beta", new="BETA"),
            invoke("list", path="."),
            invoke("search", pattern="BE.A"),
        ),
        turn(
            "Make a long file and read it; the output will be cut.",
            "",
            invoke("bash", command="seq 1 600 > big.txt && echo made"),
            invoke("read", path="big.txt"),
        ),
        turn(
            "Read the cut part; start a background job.",
            "",
            invoke("more", handle="out_1"),
            invoke("bash", command="echo started; sleep 30", background=True),
        ),
        turn(
            "Poll and stop it.",
            "",
            invoke("bash_status", handle="job_1", wait=0.5),
            invoke("bash_stop", handle="job_1"),
        ),
        turn("All done.", "notes.txt now says alpha, BETA, gamma."),
    ]
    agent = Agent(engine, workspace, ui=ui, script=script, tool_output_tokens=128)
    try:
        res = agent.send("Create notes.txt, change beta to BETA, and try every tool.")
    finally:
        agent.close()
    assert res.status == "done" and res.turns == 6, (res, ui.notices)
    # Effects on the workspace.
    assert (workspace / "notes.txt").read_text() == "alpha\nBETA\ngamma\n"
    assert (workspace / "big.txt").read_text().splitlines()[-1] == "600"
    # Every tool ran, in order, successfully.
    names = [n for n, _ in ui.results]
    assert names == [
        "write", "read", "edit", "list", "search", "bash", "read", "more", "bash",
        "bash_status", "bash_stop",
    ]  # fmt: skip
    outs = {i: o for i, (_, o) in enumerate(ui.results)}
    assert all(o.ok for o in outs.values()), [(n, o.text) for n, o in ui.results if not o.ok]
    assert outs[1].text == "alpha\nbeta\ngamma\n"
    assert "notes.txt" in outs[3].text
    assert "notes.txt:2: BETA" in outs[4].text
    assert "made" in outs[5].text
    assert outs[6].handle == "out_1" and 'handle="out_1"' in outs[6].text
    assert any(str(n) in outs[7].text for n in range(40, 500))  # the cut middle
    assert outs[8].job == "job_1" and "job_1" in outs[8].text
    assert "running" in outs[9].text and "started" in outs[9].text
    # bash_stop ended the 30 s sleep (nothing waited for it).
    assert "job_1 stopped by bash_stop" in outs[10].text
    assert not agent.toolbox.jobs.get("job_1").running
    # Permissions were asked through the UI; "always" for bash was remembered.
    assert [t for t, _ in ui.asked] == ["write", "edit", "bash"]
    # The live session: only the suffixes were prefilled, and it renders exactly.
    rounds = assert_suffix_only(agent, engine)
    assert len(rounds) == 5
    assert agent.consistent() and agent.exact and agent.state == "turn_end"
    tok = engine.tokenizer
    assert tok.decode(agent.session.tokens) + EOS == render_prompt(
        agent.conv, context_size=CTX, tool_memory=agent.tool_memory
    )
    prompt_tokens = sum(s.tokens for s in agent.steps if s.kind == "prompt")
    for r in rounds:
        assert r.tokens < prompt_tokens / 4  # a suffix, not the transcript
    # Sampled DSML remembered by id, exactly as it sits in the live text.
    live = agent.live_text()
    calls = [c for m in agent.messages for c in m.tool_calls]
    assert len(calls) == 11
    for c in calls:
        assert agent.tool_memory.get(c.id) == c.dsml and c.dsml in live


@pytest.mark.slow
def test_errors_come_back_as_results_and_the_loop_continues(engine, workspace):
    ui = RecordingUI({"write": "deny", "bash": "once"})
    script = [
        turn(
            "Try some bad calls.",
            "",
            invoke("read", offset=3),  # schema-invalid: path missing
            invoke("frobnicate", x="1"),  # unknown tool
            invoke("read", path="../../etc/passwd"),  # escapes the workspace
            invoke("write", path="x.txt", content="no"),  # permission denied
            invoke("bash", command="sleep 5", timeout=0.3),  # times out
        ),
        # A malformed call: invalid JSON in a non-string parameter.
        turn(
            "One more.",
            "",
            '<｜DSML｜invoke name="read">\n'
            '<｜DSML｜parameter name="path" string="true">a</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="limit" string="false">{nope</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>",
        ),
        turn("They all failed, as expected.", "I could not do that."),
    ]
    agent = Agent(engine, workspace, ui=ui, script=script, bash_timeout=10)
    try:
        res = agent.send("do risky things")
    finally:
        agent.close()
    assert res.status == "done" and res.turns == 3
    kinds = [o.error for _, o in ui.results]
    assert kinds[:5] == [
        "invalid_arguments",
        "unknown_tool",
        "path_outside_workspace",
        "permission_denied",
        "timeout",
    ]
    assert kinds[5] == "invalid_arguments" and "malformed" in ui.results[5][1].text
    texts = tool_texts(agent)
    assert len(texts) == 6 and all(t.startswith("error:") for t in texts)
    assert "path" in texts[0] and "frobnicate" in texts[1] and "outside" in texts[2]
    assert "still running" in texts[4] or "unknown" in texts[4]
    assert not (workspace / "x.txt").exists()
    assert [t for t, _ in ui.asked] == ["write", "bash"]
    assert_suffix_only(agent, engine)
    assert agent.consistent()


def test_ctrl_c_at_the_permission_question_answers_the_call_not_run(engine, workspace):
    """Ctrl+C while the question is on screen: the call did not run, and its result
    says so (it said "outcome unknown … it may have run in part", which sends the model
    checking for partial effects of a write that never started)."""

    class Interrupting(RecordingUI):
        def ask(self, tool: str, summary: str) -> str:
            super().ask(tool, summary)
            raise KeyboardInterrupt

    ui = Interrupting()
    script = [
        turn("Write it.", "", invoke("write", path="g.txt", content="g\n")),
        turn("Ok.", "Not written, then."),
    ]
    agent = Agent(engine, workspace, ui=ui, script=script)
    try:
        res = agent.send("write g")
        assert res.status == "interrupted"
        assert [t for t, _ in ui.asked] == ["write"] and not (workspace / "g.txt").exists()
        (text,) = tool_texts(agent)
        assert text.startswith("error: not run: the user interrupted"), text
        assert "may have run" not in text
        assert agent.send("go on").status == "done" and agent.consistent()
    finally:
        agent.close()


def test_interrupts_leave_the_session_consistent(engine, workspace):
    ui = RecordingUI()
    script = [
        turn("ponder " * 400, "never reached"),
        turn("Short.", "Answer after the interrupt."),
        turn("Fine.", "Third answer."),
    ]
    agent = Agent(engine, workspace, ui=ui, script=script, chunk_size=64)
    ui.on_thinking = lambda n: agent.interrupt() if n == 12 else None
    res = agent.send("think forever")
    assert res.status == "interrupted"
    # The partial turn was closed with </think>: live text == transcript rendering.
    last = agent.messages[-1]
    assert last.role == "assistant" and last.reasoning.startswith("ponder ponder")
    assert last.content == "" and not last.tool_calls
    assert agent.state == "turn_end" and agent.consistent()
    n_answer = ui.turns[-1].tokens
    assert 10 <= n_answer < 40  # stopped within a token or so of the interrupt
    ui.on_thinking = None
    res = agent.send("go on")
    assert res.status == "done" and agent.consistent()
    assert agent.steps[-2].kind == "user"  # only the new user turn was prefilled
    # Interrupt a prefill: the next message continues by rendered-text prefix.
    ui.on_prefill = lambda done, total: agent.interrupt() if done >= 64 else None
    res = agent.send("word " * 300)
    assert res.status == "interrupted" and agent.state == "dirty"
    before = len(agent.session.tokens)
    ui.on_prefill = None
    res = agent.send("and this")
    assert res.status == "done", ui.notices
    step = next(s for s in reversed(agent.steps) if s.kind == "user")
    assert step.before == before  # the partly prefilled tokens were kept
    assert agent.consistent()


def test_sessions_switch_restores_without_prefill(engine, workspace, tmp_path):
    store = make_store(engine, tmp_path / "kv")
    book = SessionBook(tmp_path / "kv" / "agent-sessions")
    script = [
        turn("One.", "First session answer."),
        turn("Two.", "Second session answer."),
        turn("Back.", "First session again."),
    ]
    agent = Agent(engine, workspace, ui=RecordingUI(), store=store, book=book, script=script)
    try:
        assert agent.send("first").ok
        first_tokens = list(agent.session.tokens)
        sid1 = agent.record.id
        agent.new_session()
        assert agent.session.tokens == [] and agent.state == "empty"
        assert agent.send("second").ok
        # The shared system+tools prefix came from the disk cache, not a prefill.
        kinds = [s.kind for s in agent.steps[-3:]]
        assert kinds == ["restore", "prompt", "answer"], kinds
        assert agent.steps[-2].text == "<｜User｜>second<｜Assistant｜><think>"
        sid2 = agent.record.id
        assert [r.id for r in agent.sessions()] == [sid1, sid2]
        n_steps = len(agent.steps)
        msg = agent.switch(sid1)
        assert "no prefill" in msg
        assert [s.kind for s in agent.steps[n_steps:]] == ["restore"]
        assert agent.session.tokens == first_tokens
        assert agent.state == "turn_end" and agent.consistent()
        assert agent.send("again").ok
        assert [s.kind for s in agent.steps[n_steps + 1 :]] == ["user", "answer"]
        assert agent.messages[-1].content == "First session again."
        assert agent.switch(sid2).startswith("switched to session")
        assert agent.messages[-1].content == "Second session answer."
    finally:
        agent.close()
    # A new agent (a restart) sees both sessions on disk.
    again = Agent(engine, workspace, store=store, book=book)
    assert {r.id for r in again.sessions()} == {sid1, sid2}
    again.switch(sid1)
    assert again.messages[-1].content == "First session again." and again.consistent()


def test_nothink_switches_the_opener_and_keeps_the_live_state(engine, workspace):
    script = [turn("Thinking first.", "Answer one."), turn(None, "Chat answer.")]
    agent = Agent(engine, workspace, ui=RecordingUI(), script=script)
    assert agent.send("one").ok and agent.exact
    agent.set_thinking(False)
    assert agent.send("two").ok
    step = agent.steps[-2]
    assert step.kind == "user" and step.text == EOS + "<｜User｜>two<｜Assistant｜></think>"
    last = agent.messages[-1]
    assert last.reasoning is None and last.content == "Chat answer."
    # The renderer has one mode per conversation: the earlier thinking turn would now
    # render without its reasoning, so the transcript is flagged as inexact.
    assert not agent.exact and not agent.consistent()
    assert agent.live_text().endswith("</think>Chat answer.")


def test_stale_snapshot_after_a_crash_continues_by_text_prefix(engine, workspace, tmp_path):
    store = make_store(engine, tmp_path / "kv")
    book = SessionBook(tmp_path / "kv" / "agent-sessions")
    script = [turn("A.", "One."), turn("B.", "Two."), turn("C.", "Three.")]
    agent = Agent(engine, workspace, store=store, book=book, script=script)
    assert agent.send("first").ok
    rec = agent.save()
    saved = rec.kv_tokens
    assert agent.send("second").ok  # transcript written, no new snapshot; then "crash"
    sid = agent.record.id
    agent.toolbox.close()
    again = Agent(engine, workspace, store=store, book=book, script=script[2:])
    again.switch(sid)
    assert len(again.session.tokens) == saved and again.state == "dirty"
    assert again.send("third").ok
    step = next(s for s in again.steps if s.kind == "user")
    assert step.before == saved  # only the text after the snapshot was prefilled
    assert step.text.startswith(EOS + "<｜User｜>second")
    assert again.consistent() and again.messages[-1].content == "Three."
