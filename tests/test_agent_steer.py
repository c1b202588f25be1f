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
        child.expect(r"job_1: job_1 exited 0 after 2\.\d s", timeout=20)
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
        assert history.count("[tool result] [result of ") == 1
        assert history.index("what happened?") < history.index("[result of ")
        assert history.index("[result of ") < history.index("The job finished.")
        _quit(child, tmp_path)
    finally:
        child.close()
