"""``ds4mlx agent`` in a real terminal (pexpect) and in ``-p`` mode (issue 6 item 3).

The model is the tiny float32 checkpoint with scripted decoding (``--script-file``), so
what the terminal shows is known in advance while every token still runs the network.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest
from server_util import DEMO_ENV, pid_alive

from tests.agent_script import agent_args, agent_env, invoke, turn

pytestmark = pytest.mark.slow

TIMEOUT = 60
_ANSI = r"(?:\x1b\[[0-9;?]*[A-Za-z])*"
NOTICE = re.escape("(Ctrl+C: /quit or Ctrl+D to exit)")  # Ctrl+C at the idle prompt


def loose(text: str) -> str:
    """A regex for ``text`` as rich streams it: style codes may sit between characters
    (each streamed token is styled on its own)."""
    return _ANSI.join(re.escape(ch) for ch in text)


@pytest.fixture(scope="module")
def tiny(tiny_f32_dir) -> Path:
    return tiny_f32_dir


_env = agent_env
_args = agent_args


def test_terminal_session(tiny, tmp_path):
    script = [
        turn(
            "The user wants a file; I will write it.",
            "Writing hello.txt now.",
            invoke("write", path="hello.txt", content="hi there\n"),
        ),
        turn("It is written.", "Created hello.txt for you."),
        turn("ponder " * 3000, "never shown"),
        turn("Second.", "This is the second session."),
        turn("Back.", "Back in the first session."),
    ]
    child = pexpect.spawn(
        sys.executable,
        _args(tiny, tmp_path, script),
        env=_env(),
        encoding="utf-8",
        timeout=TIMEOUT,
        dimensions=(40, 120),
    )
    child.logfile_read = open(tmp_path / "terminal.log", "w")  # noqa: SIM115 (for failures)
    try:
        child.expect("type a message")
        child.expect("› ")
        child.sendline("please create hello.txt")
        # Streamed output, then the tool call as it forms and the permission question.
        child.expect(loose("The user wants a file"))
        child.expect("Writing hello.txt now.")
        child.expect("write")
        child.expect("allow write")
        child.expect(r"\[o\]nce / \[a\]lways \(write, this session\) / \[d\]eny")
        child.sendline("o")
        child.expect("created hello.txt")
        child.expect("Created hello.txt for you.")
        child.expect(r"ctx \d+/8192")
        child.expect("› ")
        assert (tmp_path / "ws" / "hello.txt").read_text() == "hi there\n"

        # A long generation, interrupted with Ctrl+C: back at the prompt.
        child.sendline("think for a very long time")
        child.expect(loose("ponder ponder ponder ponder"))
        child.sendintr()
        child.expect("interrupted")
        child.expect("› ")

        # A second session, then /list and /switch back to the first.
        child.sendline("/new")
        child.expect("new session")
        child.expect("› ")
        child.sendline("second session please")
        child.expect("This is the second session.")
        child.expect("› ")
        child.sendline("/list")
        child.expect("please create hello.txt")
        child.expect("second session please")
        child.expect("› ")
        child.sendline("/switch 1")
        child.expect("restored \\d+ tokens from the disk KV cache")
        child.expect("no prefill")
        child.expect("› ")
        child.sendline("/history")
        child.expect("Created hello.txt for you.")
        child.expect("› ")
        child.sendline("are you back?")
        child.expect("Back in the first session.")
        child.expect("› ")
        child.sendline("/ctx")
        child.expect("live state: turn_end")
        child.expect("› ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, (tmp_path / "terminal.log").read_text()[-3000:]
    sessions = sorted(p.name for p in (tmp_path / "kv" / "agent-sessions").glob("*.json"))
    assert sessions == ["1.json", "2.json"]


def test_print_mode_transcript_and_exit_codes(tiny, tmp_path):
    script = [
        turn("Check the workspace.", "Looking.", invoke("list", path=".")),
        turn("Write.", "", invoke("write", path="out.txt", content="done\n")),
        turn("Finished.", "Wrote out.txt."),
    ]
    r = subprocess.run(
        [sys.executable, *_args(tiny, tmp_path, script, "-p", "make out.txt", "--yes")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, r.stderr
    # Issue 13 item 12: the transcript is on stderr, stdout holds only the answer.
    out = r.stderr
    for piece in ("› make out.txt", "Check the workspace.", "⏺ list", "⏺ write", "Wrote out.txt."):
        assert piece in out, out
    assert out.index("Check the workspace.") < out.index("⏺ write") < out.index("Wrote out.txt.")
    assert r.stdout == "Wrote out.txt.\n", r.stdout
    assert (tmp_path / "ws" / "out.txt").read_text() == "done\n"

    # Without --yes and without a terminal the write is denied; the model is told and
    # answers; a turn cut by --max-tokens is a normal end: exit 0, a note on stderr.
    script = [
        turn("Write.", "", invoke("write", path="no.txt", content="x")),
        turn("Denied.", "I was not allowed to write."),
        turn("long " * 200, "x"),
    ]
    r = subprocess.run(
        [sys.executable, *_args(tiny, tmp_path, script, "-p", "write no.txt")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr
    assert "permission denied" in r.stderr and "I was not allowed to write." in r.stderr
    assert r.stdout == "I was not allowed to write.\n"
    assert not (tmp_path / "ws" / "no.txt").exists()
    r = subprocess.run(
        [
            sys.executable,
            *_args(tiny, tmp_path, script[2:], "-p", "go", "--max-tokens", "20"),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "note: the answer was cut at the per-turn token limit (length)" in r.stderr, r.stderr
    assert "stopped:" not in r.stderr, r.stderr


def test_demo_print_mode_ends_at_the_cap_like_the_server(tiny, tmp_path):
    """Issue 13 item 12: ``agent --demo -p`` treats the demo cap as the end of the turn
    (exit 0, as ``serve --demo`` does), and stdout carries only the answer."""
    cache = tmp_path / "cache"
    (cache / "ds4mlx").mkdir(parents=True)
    (cache / "ds4mlx" / "demo").symlink_to(tiny)  # stands in for the demo model
    ws = tmp_path / "ws"
    ws.mkdir()
    sf = tmp_path / "script.json"
    sf.write_text(json.dumps(["word " * 400]))  # --demo runs without thinking
    args = [
        "-m", "ds4mlx.cli", "agent", "--demo", "--ctx", "4096", "--workspace", str(ws),
        "--kv-disk-dir", str(tmp_path / "kv"), "--script-file", str(sf), "-p", "say words",
    ]  # fmt: skip
    env = {**_env(), **DEMO_ENV, "XDG_CACHE_HOME": str(cache)}
    r = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert r.returncode == 0, (r.stdout[-500:], r.stderr[-2000:])
    assert r.stdout.startswith("word word") and r.stdout.endswith("\n"), r.stdout[:300]
    assert "ds4mlx agent ·" not in r.stdout and "› say words" not in r.stdout
    assert "ds4mlx agent ·" in r.stderr and "› say words" in r.stderr
    # The user's own limit ends with "length": a normal end (exit 0) with a note.
    r = subprocess.run(
        [sys.executable, *args, "--max-tokens", "20"],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.returncode == 0 and "(length)" in r.stderr, (r.stdout, r.stderr[-2000:])


def _spawn(tiny: Path, tmp: Path, script: list[str], *extra: str) -> pexpect.spawn:
    # Decoded with replacement: the terminal's Ctrl+C flushes the pty's pending output
    # (ISIG without NOFLSH), so a test that sends it may read a character cut in two
    # ("›" seen torn to its last two bytes), which is the terminal's doing, not the
    # agent's. `test_terminal_session` decodes strictly.
    child = pexpect.spawn(
        sys.executable,
        _args(tiny, tmp, script, *extra),
        env=_env(),
        encoding="utf-8",
        codec_errors="replace",
        timeout=TIMEOUT,
        dimensions=(40, 120),
    )
    child.logfile_read = open(tmp / "terminal.log", "w")  # noqa: SIM115 (for failures)
    return child


@contextlib.contextmanager
def _at_the_prompt(tiny: Path, tmp: Path, script: list[str] | None = None, *extra: str):
    """An agent at its idle prompt, whose script's last turn answers "Still here." (the
    default script has only that one). After the block a line still gets that answer
    (none was lost to a late interrupt), and ``/quit`` exits 0 with no traceback (late
    copies must not raise in the exit handlers either)."""
    child = _spawn(tiny, tmp, script or [turn("Ok.", "Still here.")], *extra)
    try:
        child.expect("type a message")
        child.expect("› ")
        yield child
        child.sendline("hello?")
        child.expect("Still here.")
        child.expect("› ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    log = (tmp / "terminal.log").read_text()
    assert child.exitstatus == 0, log[-3000:]
    assert "Traceback" not in log and "SystemError" not in log, log[-3000:]


def test_ctrl_c_at_prompt_with_background_job(tiny, tmp_path):
    """Ctrl+C at the prompt while a background job runs: a notice, not a crash."""
    script = [
        turn("Start it.", "Started.", invoke("bash", command="sleep 300; echo done",
                                              background=True)),
        turn("Done.", "All done."),
        turn("Ok.", "Still here."),
    ]  # fmt: skip
    with _at_the_prompt(tiny, tmp_path, script, "--yes") as child:
        child.sendline("start a background job")
        child.expect("All done.")
        child.expect("› ")
        child.sendintr()
        child.expect(NOTICE)
        child.expect("› ")
        # A burst: the terminal's SIGINT plus forwarded copies (as `timeout CMD` sends
        # its child and its process group); a copy may land while the notice prints.
        # No notice is awaited: the terminal's Ctrl+C flushes the pty's pending output
        # (ISIG without NOFLSH), so the burst tears what was printed meanwhile (a torn
        # "›" was seen); surviving it is the check, with the line answered after it.
        for i in range(40):
            child.sendintr()
            time.sleep(0.001 * (i % 7))
            os.kill(child.pid, signal.SIGINT)
            time.sleep(0.002 * (i % 5))
            os.kill(child.pid, signal.SIGINT)
        _quiet(child, 1.0)  # every copy answered: none is left to cancel the next line


def _quiet(child: pexpect.spawn, seconds: float) -> None:
    """Read whatever the child prints until it has been quiet for ``seconds``."""
    while True:
        try:
            child.read_nonblocking(1 << 20, timeout=seconds)
        except pexpect.TIMEOUT:
            return


def test_double_interrupt_at_the_prompt_20_times(tiny, tmp_path):
    """Issue 13 item 13: two SIGINTs back to back at the idle prompt, 20 times: a notice
    each time, never a crash (the second used to raise inside the first's
    ``KeyboardInterrupt()``: ``SystemError … returned a result with an exception set``)."""
    with _at_the_prompt(tiny, tmp_path) as child:
        for i in range(20):
            child.sendintr()  # the terminal's Ctrl+C …
            if i % 2:
                time.sleep(0.0005 * (i % 4))
            os.kill(child.pid, signal.SIGINT)  # … and a forwarded copy
            child.expect(NOTICE)
            child.expect("› ")
            _quiet(child, 0.2)  # a second notice, maybe
            assert child.isalive(), (tmp_path / "terminal.log").read_text()[-3000:]
        _quiet(child, 1.0)


def test_ctrl_c_taken_by_another_thread_interrupts_the_prompt(tiny, tmp_path):
    """A SIGINT the kernel hands to a thread other than the main one is answered at once
    and never cancels the line typed after it. It used to stay tripped while the main
    thread slept in the prompt's ``select``, then raised when the next line arrived: the
    user's line was lost behind a late notice (seen in CI under a SIGINT burst)."""
    with _at_the_prompt(tiny, tmp_path) as child:
        for _ in range(3):
            _signal_other_thread(child.pid, signal.SIGINT)
            child.expect(NOTICE)  # before any input: the read was interrupted
            child.expect("› ")
        _quiet(child, 0.5)
    log = (tmp_path / "terminal.log").read_text()
    assert log.count("(Ctrl+C: /quit") == 3, log[-3000:]


def test_sigint_burst_while_exiting_is_ignored(tiny, tmp_path):
    """SIGINTs that arrive after /quit (saving, interpreter exit) change nothing."""
    child = _spawn(tiny, tmp_path, [turn("Ok.", "Hi.")])
    try:
        child.expect("› ")
        child.sendline("hi")
        child.expect("Hi.")
        child.expect("› ")
        child.sendline("/quit")
        child.expect("/quit\r\n")  # echoed on Enter: the line was read
        for _ in range(200):
            if not child.isalive():
                break
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGINT)
            time.sleep(0.002)
        child.expect(pexpect.EOF)
    finally:
        child.close()
    log = (tmp_path / "terminal.log").read_text()
    assert child.exitstatus == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def _blocked_on(pid: int) -> str:
    """Each thread of ``pid``: name, state and kernel wait channel (from ``/proc``)."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        with contextlib.suppress(OSError):
            comm = (task / "comm").read_text().strip()
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            out.append(f"{task.name} {comm} {state} {(task / 'wchan').read_text()}")
    return "; ".join(out) or "no /proc entry"


def _signal_other_thread(pid: int, sig: int) -> None:
    """Deliver ``sig`` to a thread of ``pid`` other than its main thread (``tgkill``).

    The kernel may hand a process-directed signal to any thread that does not block it;
    CPython then runs the Python handler only when the main thread next checks, which a
    main thread blocked in readline's ``select`` never does by itself.
    """
    # Deterministic: wait until the main thread blocks in the prompt's select/poll.
    deadline = time.monotonic() + TIMEOUT
    while "poll" not in Path(f"/proc/{pid}/wchan").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    tids = sorted(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir() if int(t.name) != pid)
    assert tids, "the agent runs no other thread"
    assert ctypes.CDLL(None, use_errno=True).tgkill(pid, tids[0], sig) == 0


@pytest.mark.parametrize("via", ["process", "other thread"])
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_sigterm_sighup_stop_jobs_and_save(tiny, tmp_path, signame, via):
    """SIGTERM/SIGHUP work like /quit: background jobs stopped, session saved with KV;
    also when the kernel hands the signal to a thread other than the main one."""
    script = [
        turn("Start it.", "Started.", invoke("bash", command="echo $$ > job.pid; sleep 311",
                                              background=True)),
        turn("Done.", "All done."),
    ]  # fmt: skip
    child = _spawn(tiny, tmp_path, script, "--yes")
    try:
        child.expect("type a message")
        child.expect("› ")
        child.sendline("start a background job")
        child.expect(r"started background job job_1 \(timeout 3600 s\)")
        child.expect("All done.")
        pid = int((tmp_path / "ws" / "job.pid").read_text())
        child.expect("› ")
        assert pid_alive(pid)
        if via == "process":
            child.kill(getattr(signal, signame))
        else:
            _signal_other_thread(child.pid, getattr(signal, signame))
        try:
            child.expect(pexpect.EOF)
        except pexpect.TIMEOUT:
            # Say where each agent thread waits.
            raise AssertionError(f"no exit after {signame}: {_blocked_on(child.pid)}") from None
    finally:
        child.close()
    log = (tmp_path / "terminal.log").read_text()
    assert child.exitstatus == 128 + getattr(signal, signame), log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert not pid_alive(pid), "background job left running"
    rec = json.loads((tmp_path / "kv" / "agent-sessions" / "1.json").read_text())
    assert rec["kv_key"], rec


def test_stdin_prompt_reaches_the_user(tiny, tmp_path):
    """A foreground command's input prompt is shown; a typed line answers it, Ctrl+D
    sends end of file."""
    script = [
        turn("Ask.", "", invoke("bash", command='read -p "Apply? " a; echo got=$a')),
        turn("Cat.", "", invoke("bash", command="cat")),
        turn("Done.", "Both ran."),
    ]  # fmt: skip
    child = _spawn(tiny, tmp_path, script, "--yes")
    try:
        child.expect("type a message")
        child.expect("› ")
        child.sendline("run them")
        child.expect("the command waits for input")
        child.expect(re.escape("Apply? "))
        child.sendline("y")
        child.expect("got=y")
        child.expect("the command waits for input")
        child.expect("input › ")  # the answer is open once the prompt shows
        child.sendeof()
        child.expect("Both ran.")
        child.expect("› ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    rec = json.loads((tmp_path / "kv" / "agent-sessions" / "1.json").read_text())
    results = [m["content"] for m in rec["messages"] if m["role"] == "tool"]
    assert results[0].startswith("got=y"), results
    assert "exit code 0" in results[1] and "end of file" in results[1], results
