"""``ds4mlx agent`` under pexpect: job notices at the idle prompt, steering while a turn
runs, read-only calls dispatched at their block's close (issues 21 and 23).

The model is the tiny float32 checkpoint with scripted decoding (``--script-file``): what
the terminal shows is known in advance while every token still runs the network.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pexpect
import pytest

from tests.agent_script import agent_args, agent_env, invoke, turn

pytestmark = pytest.mark.slow

TIMEOUT = 60


@pytest.fixture(scope="module")
def tiny(tiny_f32_dir) -> Path:
    return tiny_f32_dir


def _spawn(tiny: Path, tmp_path: Path, script: list[str], *extra: str) -> pexpect.spawn:
    child = pexpect.spawn(
        sys.executable,
        agent_args(tiny, tmp_path, script, *extra),
        env=agent_env(),
        encoding="utf-8",
        timeout=TIMEOUT,
        dimensions=(40, 120),
    )
    child.logfile_read = open(tmp_path / "terminal.log", "w")  # noqa: SIM115 (for failures)
    child.expect("type a message")
    child.expect("› ")
    return child


def _quit(child: pexpect.spawn, tmp_path: Path) -> None:
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, (tmp_path / "terminal.log").read_text()[-3000:]


def test_notice_shown_at_once_while_idle_and_sent_once_with_the_next_message(tiny, tmp_path):
    script = [
        turn("Start.", "", invoke("bash", command="sleep 2; echo done", background=True)),
        turn("Ok.", "It runs in the background."),
        turn("Seen.", "The job finished."),
        turn("Fine.", "Nothing new."),
    ]
    child = _spawn(tiny, tmp_path, script, "--yes")
    try:
        child.sendline("start it")
        child.expect("It runs in the background.")
        child.expect("› ")
        # Nothing is typed: the job's end shows at the prompt by itself, and no turn
        # starts (the next scripted answer is not generated).
        # 2.x s on an idle machine; a loaded one delays the start and the reaping.
        child.expect(r"(?<!: )job_1 exited 0 after \d+\.\d s", timeout=20)
        child.expect("› ")
        with pytest.raises(pexpect.TIMEOUT):
            child.expect("The job finished.", timeout=2)
        child.sendline("what happened?")
        child.expect("The job finished.")
        assert "job_1 exited" not in child.before  # shown once, not again at the send
        child.expect("› ")
        child.sendline("and now?")
        child.expect("Nothing new.")
        child.expect("› ")
        child.sendline("/history")
        child.expect(re.escape("[assistant] Nothing new."))
        history = child.before
        child.expect("› ")
        # Sent once, as a late result of its call, after the message that followed it.
        assert history.count("[tool result] job_1 exited 0") == 1
        assert history.index("what happened?") < history.index("job_1 exited 0")
        assert history.index("job_1 exited 0") < history.index("The job finished.")
        _quit(child, tmp_path)
    finally:
        child.close()


def test_steer_typed_during_a_block_skips_the_call_not_started(tiny, tmp_path):
    """``use Go instead⏎`` typed while the model writes its second call: the block ends
    the turn, the second call does not run (its file is absent) and is answered "not
    run", the first (a read, started at its close) keeps its result, the text follows."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.py").write_text("print('a')\n")
    script = [
        turn(
            "Read it, then write b.py.",
            "",
            invoke("read", path="a.py"),
            invoke("write", path="b.py", content="STEERME " + "pad " * 400),
        ),
        turn("Go then.", "Switching to Go."),
    ]
    child = _spawn(tiny, tmp_path, script, "--yes")
    try:
        child.sendline("write b.py")
        child.expect("STEERME")
        child.send("use Go instead\r")
        child.expect("queued for the next boundary: use Go instead")
        child.expect("Switching to Go.")
        child.expect("› ")
        assert not (ws / "b.py").exists()
        child.sendline("/history")
        child.expect(re.escape("[assistant] Switching to Go."))
        history = child.before
        child.expect("› ")
        assert "print('a')" in history
        assert "[tool result] not run: the user interrupted with new instructions" in history
        assert "[user] use Go instead" in history
        assert history.index("not run: the user") < history.index("[user] use Go instead")
        _quit(child, tmp_path)
    finally:
        child.close()


def test_steer_line_queued_before_a_permission_prompt_does_not_answer_it(tiny, tmp_path):
    """``a⏎`` (which would answer "always") typed while the model writes a ``write`` call:
    it steers (the call is not run, no question asked); the next ``write`` asks, and the
    question waits for a line typed after it appeared."""
    script = [
        turn("Write.", "", invoke("write", path="one.txt", content="STEERME " + "pad " * 400)),
        turn("Again.", "", invoke("write", path="two.txt", content="two\n")),
        turn("Done.", "Asked and answered."),
    ]
    child = _spawn(tiny, tmp_path, script)
    try:
        child.sendline("write files")
        child.expect("STEERME")
        child.send("a\r")
        child.expect("queued for the next boundary: a")
        child.expect("allow write")
        child.expect(r"\[o\]nce / \[a\]lways \(write, this session\) / \[d\]eny")
        # Nothing typed yet: the question stays (the queued "a" did not answer it).
        with pytest.raises(pexpect.TIMEOUT):
            child.expect("Asked and answered.", timeout=3)
        assert "allow write" not in child.before
        child.send("d\r")
        child.expect("Asked and answered.")
        child.expect("› ")
        ws = tmp_path / "ws"
        assert not (ws / "one.txt").exists() and not (ws / "two.txt").exists()
        child.sendline("/history")
        child.expect(re.escape("[assistant] Asked and answered."))
        history = child.before
        child.expect("› ")
        assert "not run: the user interrupted with new instructions" in history
        assert "[user] a" in history and "permission denied" in history
        _quit(child, tmp_path)
    finally:
        child.close()


def test_steer_escape_stops_at_once_and_sends_the_queue(tiny, tmp_path):
    """Esc while the model thinks: the turn stops at once (as Ctrl+C) and the line being
    typed is sent as the next message."""
    script = [
        turn("ponder " * 3000, "never shown"),
        turn("Go.", "Going with Go."),
    ]
    child = _spawn(tiny, tmp_path, script)
    try:
        child.sendline("think long")
        child.expect("ponder")
        child.expect("ponder")
        child.send("use Go\x1b")
        child.expect("interrupted")
        child.expect("Going with Go.")
        child.expect("› ")
        assert "never shown" not in child.before
        child.sendline("/history")
        child.expect(re.escape("[assistant] Going with Go."))
        history = child.before
        child.expect("› ")
        assert "[user] use Go" in history
        _quit(child, tmp_path)
    finally:
        child.close()


def test_a_command_typed_during_a_turn_runs_when_it_ends(tiny, tmp_path):
    """``/quit`` typed while the model writes is the agent's command, not the model's
    words: the turn ends as it would, then the agent saves and exits (it was sent to the
    model as a steering message, and the agent went on)."""
    script = [
        turn("Long.", "Long " + "words " * 400 + "END-OF-TURN."),
        turn("Never.", "never reached"),
    ]
    child = _spawn(tiny, tmp_path, script)
    try:
        child.sendline("write a lot")
        child.expect("words words")
        child.send("/quit\r")
        child.expect(re.escape("runs when the turn ends (Ctrl+C ends it now): /quit"))
        child.expect("END-OF-TURN.")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0, (tmp_path / "terminal.log").read_text()[-3000:]
        log = (tmp_path / "terminal.log").read_text()
        assert "never reached" not in log and "sent: /quit" not in log
    finally:
        child.close()
