"""Context compaction (issue 6 item 4): small --ctx, real tiny engine, scripted turns."""

from __future__ import annotations

import pytest

from ds4mlx.agent import compaction as cmp
from ds4mlx.agent.loop import Agent
from ds4mlx.dsml import Message, ToolCall
from ds4mlx.engine import Engine
from tests.agent_script import EOS, RecordingUI, invoke, turn

CTX = 4096


@pytest.fixture(scope="module")
def engine(tiny_f32_dir) -> Engine:
    return Engine.load(tiny_f32_dir, ctx_size=CTX)


LONG = "Thanks. Now " + "please continue with more numbers and explain them, " * 40
SUMMARY = "Summary: the user wants number listings; seq ran twice and printed 1..2000."


@pytest.mark.slow
def test_hard_compaction_when_a_tool_result_does_not_fit(engine, workspace):
    ui = RecordingUI()
    script = [
        turn("List numbers.", "", invoke("bash", command="seq 1 2000")),
        turn("Again, differently.", "", invoke("bash", command="seq 5001 7000")),
        turn(None, SUMMARY),  # the compaction summary (chat mode, tools off)
        turn("Enough.", "Both listings are done."),
        turn("Next.", "Still here after compaction."),
    ]
    agent = Agent(engine, workspace, ui=ui, script=script, yes=True, tool_output_tokens=1000)
    try:
        res = agent.send("list the numbers")
        assert res.status == "done", (res, ui.notices)
        assert len(ui.compactions) == 2
        info = agent.compactions[0]
        assert info.reason == "hard" and info.by_model and info.summary == SUMMARY
        # Both counts take the whole transcript, the pending result too: the line shows
        # the first listing's ~1000 tokens saved (it showed "3013 -> 3010").
        assert info.after < info.before - 500, (info.before, info.after)
        # The pending step (the call and its result) is kept verbatim after the summary.
        msgs = agent.messages
        assert msgs[0].role == "system"
        assert msgs[1].role == "user" and msgs[1].content.startswith(cmp.SUMMARY_HEADER)
        assert SUMMARY in msgs[1].content and "list the numbers" in msgs[1].content
        second_call = msgs[2]
        assert second_call.role == "assistant" and second_call.tool_calls[0].arguments == {
            "command": "seq 5001 7000"
        }
        assert msgs[3].role == "tool" and "5001" in msgs[3].content and "7000" in msgs[3].content
        assert msgs[-1].content == "Both listings are done."
        # The first listing is gone from the live state; the kept tail is in it verbatim.
        live = agent.live_text()
        assert second_call.tool_calls[0].dsml in live
        assert f"<tool_result>{msgs[3].content}</tool_result>" in live
        assert "\n1999\n" not in live
        assert agent.consistent() and agent.state == "turn_end"
        assert len(agent.session.tokens) < agent.policy.soft_limit(CTX)
        # Tools were never run while summarizing: two bash runs only.
        assert [n for n, _ in ui.results] == ["bash", "bash"]
        # The session continues: the next message appends only its user turn.
        assert agent.send("anything else?").ok
        assert [s.kind for s in agent.steps[-2:]] == ["user", "answer"]
        assert agent.consistent()
    finally:
        agent.close()


@pytest.mark.slow
def test_soft_compaction_and_mechanical_fallback(engine, workspace):
    ui = RecordingUI()
    policy = cmp.CompactionPolicy(soft_fraction=0.75, tail_fraction=0.1)
    script = [
        turn("List.", "", invoke("bash", command="seq 1 1500")),
        turn("Listed.", "Done listing."),
        # The long next message takes the session past 75 %: soft compaction.
        turn(None, "Summary: a listing of 1..1500 was made."),
        turn("Ok.", "Answer after soft compaction."),
    ]
    agent = Agent(
        engine,
        workspace,
        ui=ui,
        script=script,
        yes=True,
        tool_output_tokens=900,
        policy=policy,
    )
    try:
        assert agent.send("make a listing").ok
        assert not agent.compactions
        assert agent.send(LONG).ok, ui.notices
        (info,) = agent.compactions
        assert info.reason == "soft" and info.by_model
        # The final answer and the new message are the verbatim tail after the summary.
        assert [m.role for m in agent.messages] == [
            "system",
            "user",
            "assistant",
            "user",
            "assistant",
        ]
        assert agent.messages[2].content == "Done listing."
        assert agent.messages[3].content == LONG
        assert agent.messages[-1].content == "Answer after soft compaction."
        assert agent.consistent()
        assert len(agent.session.tokens) < policy.soft_limit(CTX)
    finally:
        agent.close()

    # No room left for the summary request: the transcript is summarized mechanically.
    ui = RecordingUI()
    policy = cmp.CompactionPolicy(soft_fraction=0.75, tail_fraction=0.1, summary_tokens=CTX)
    script = [
        turn("List.", "", invoke("bash", command="seq 1 1500")),
        turn("Listed.", "Done listing."),
        turn("Ok.", "Answer after mechanical compaction."),
    ]
    agent = Agent(
        engine, workspace, ui=ui, script=script, yes=True, tool_output_tokens=900, policy=policy
    )
    try:
        assert agent.send("make a listing").ok
        assert agent.send(LONG).ok, ui.notices
        (info,) = agent.compactions
        assert not info.by_model and "mechanical" in info.summary
        assert "you called bash" in info.summary and "seq 1 1500" in info.summary
        assert agent.messages[-1].content == "Answer after mechanical compaction."
        assert agent.consistent()
    finally:
        agent.close()


def test_a_message_past_the_context_compacts_or_is_refused_and_the_session_goes_on(
    engine, workspace
):
    """A user message that, with the conversation, passes the whole context compacts the
    conversation first; one that cannot fit even then is taken back (said, with its size)
    and the conversation goes on. It stayed in the transcript and every later message
    failed the same way (only /new got out)."""
    ui = RecordingUI()
    script = [
        turn("List.", "", invoke("bash", command="seq 1 2000")),
        turn("Listed.", "Done listing."),
        turn(None, SUMMARY),
        turn("Ok.", "Answered after compaction."),
        turn("Fine.", "Still here."),
    ]
    agent = Agent(engine, workspace, ui=ui, script=script, yes=True, tool_output_tokens=1000)
    tok = engine.tokenizer
    try:
        assert agent.send("make a listing").ok
        used = len(agent.session.tokens)
        # Too long beside the conversation, short enough once it is summarized.
        medium = "alpha beta " * ((CTX - used) // 2 + 50)
        assert used + len(tok.encode_plain(medium)) > CTX
        res = agent.send(medium)
        assert res.ok, (res, ui.notices)
        (info,) = agent.compactions
        assert info.reason == "hard" and info.by_model
        assert agent.messages[-2].content == medium
        assert agent.messages[-1].content == "Answered after compaction."
        assert len(agent.session.tokens) < agent.policy.soft_limit(CTX)
        before = [(m.role, m.content) for m in agent.messages]
        # Longer than the context itself: no compaction can fit it.
        huge = "word " * (CTX + 500)
        res = agent.send(huge)
        assert res.status == "context"
        n = len(tok.encode_plain(huge))
        assert f"not sent: your message is {n} tokens" in res.message
        assert res.message in [text for _, text in ui.notices]
        assert [(m.role, m.content) for m in agent.messages] == before
        assert agent.consistent()
        # The next message is answered as if the refused one was never typed.
        res = agent.send("and now?")
        assert res.ok, (res, ui.notices)
        assert agent.messages[-1].content == "Still here."
        assert all(m.content != huge for m in agent.messages)
    finally:
        agent.close()


# ---------------------------------------------------------------- pure functions


def test_policy_thresholds():
    p = cmp.CompactionPolicy()
    assert p.soft_limit(1000) == 850
    assert p.reserve(4096) == 256 and p.reserve(100) == 64 and p.reserve(1 << 20) == 4096
    assert p.check(100, 10, 1000) is None
    assert p.check(800, 60, 1000) == "soft"
    assert p.check(800, 150, 1000) == "hard"
    with pytest.raises(ValueError):
        cmp.CompactionPolicy(soft_fraction=0)


def _msgs() -> list[Message]:
    c1 = ToolCall("toolu_1", "read", {"path": "a"})
    c2 = ToolCall("toolu_2", "read", {"path": "b"})
    return [
        Message("system", "sys"),
        Message("user", "task"),
        Message("assistant", "", reasoning="r", tool_calls=[c1]),
        Message("tool", "A" * 40, tool_call_id="toolu_1"),
        Message("assistant", "", reasoning="r", tool_calls=[c2]),
        Message("tool", "B" * 40, tool_call_id="toolu_2"),
    ]


def test_tail_start_never_splits_results_from_their_call():
    msgs = _msgs()

    def count(m):
        return len(m.content) + 1

    # The pending step starts at the last assistant turn; nothing older fits.
    assert cmp.tail_start(msgs, 4, count, budget=10) == 4
    # Room for the older result but not its call: the result alone is not kept.
    assert cmp.tail_start(msgs, 4, count, budget=41) == 4
    assert cmp.tail_start(msgs, 4, count, budget=42) == 2
    # A pending step given at a tool message moves back to its assistant turn.
    assert cmp.tail_start(msgs, 5, count, budget=0) == 4
    assert cmp.tail_start(msgs, 4, count, budget=10**6) == 1  # never the system message


def test_rebuild_and_mechanical_summary():
    msgs = _msgs()
    new = cmp.rebuild(msgs, 4, "did stuff", cmp.first_request(msgs))
    assert new[0] is msgs[0] and new[2:] == msgs[4:] and new[2] is msgs[4]
    assert new[1].role == "user" and "did stuff" in new[1].content and "task" in new[1].content
    text = cmp.mechanical_summary(msgs)
    assert "user asked: task" in text and "you called read" in text and "-> ok" in text
    assert EOS not in text
