"""The agent's tool runtime (issue 21): terminal rendering, redaction, streams and status,
diagnostics — on real subprocesses, compilers and files in temp workspaces."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4mlx.agent.diagnostics import ExitStatus, diagnose
from ds4mlx.agent.hooks import Hooks
from ds4mlx.agent.loop import Agent
from ds4mlx.agent.permissions import Permissions
from ds4mlx.agent.redact import Redactor, _screens, redact, screen_for
from ds4mlx.agent.terminal import TerminalText
from ds4mlx.agent.tools import EXIT_STATUS, FAILED, Toolbox
from ds4mlx.agent.tools.shell import clean_terminal_output
from tests.agent_script import RecordingUI, invoke, turn

# ------------------------------------------------------------------ terminal_output


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("Done\r", "Done"),  # EOF commits the line; \r only moves the cursor
        ("abc\r\r\n", "abc\n"),
        ("12345\rab\n", "ab345\n"),  # \r overwrites from column 0
        ("10%\r50%\r100%\n", "100%\n"),
        ("downloading 99%\r\x1b[Kdone\n", "done\n"),  # erase in line
        ("abc\bX\n", "abX\n"),  # BS steps back, the next character overwrites
        ("ding\x07dong\n", "dingdong\n"),  # BEL shows nothing
        ("\x1b[1;31mred\x1b[0m plain\n", "red plain\n"),
        ("\x1b]0;title\x07after\n", "after\n"),  # OSC ended by BEL
        ("\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\\n", "link\n"),  # OSC 8 ended by ST
        ("a\x1bP1;2|payload text\x1b\\b\n", "ab\n"),  # DCS payload gone
        ("a\x1b_apc payload\x1b\\b\n", "ab\n"),  # APC
        ("a\x1b^pm\x1b\\b\x1bXsos\x9cc\n", "abc\n"),  # PM, SOS (8-bit ST)
        ("a\x90c1 dcs\x9cb\n", "ab\n"),  # 8-bit DCS
        ("col\tumn\t\n", "col\tumn\t\n"),  # tabs kept as tabs (edit must match them)
        ("ünïcödé ✓\n", "ünïcödé ✓\n"),
    ],
)
def test_terminal_output_renders_like_a_terminal(raw: str, shown: str) -> None:
    assert clean_terminal_output(raw) == shown


def test_terminal_output_keeps_state_across_reads() -> None:
    t = TerminalText()
    # A CSI split in the middle of its parameters, then a carriage return.
    assert t.feed("12345\x1b[3") == ""
    assert t.pending == "12345"
    assert t.feed("1mX\rab\n") == "ab345X\n"
    # OSC and DCS payloads split across reads, ST split between ESC and backslash.
    assert t.feed("a\x1b]0;ti") == "" and t.pending == "a"
    assert t.feed("tle\x07b\x1bPpay") == "" and t.pending == "ab"
    assert t.feed("load\x1b") == ""
    assert t.feed("\\c\n") == "abc\n"
    # UTF-8 bytes split inside a character.
    data = "é€✓\n".encode()
    assert t.feed(data[:1]) == "" and t.feed(data[1:4]) == ""
    assert t.feed(data[4:], final=True) == "é€✓\n"
    # An unterminated sequence at the end of the stream is dropped, the line committed.
    assert t.feed("tail\x1b]0;never ends", final=True) == "tail"


def test_terminal_output_from_a_real_command_and_a_polled_job(tb: Toolbox, ws: Path) -> None:
    cmd = r"printf '\033[32mok\033[0m\nstep 1/3\rstep 2/3\rstep 3/3\n\033]0;t\007\033P+q\033\\end'"
    out = tb.run("bash", {"command": cmd})
    assert out.text.startswith("ok\nstep 3/3\nend\n[exit code 0")
    # A job's line split across two polls: the renderer keeps the cursor state.
    # It finishes the line only once the test saw its first part (a file, not a sleep).
    wait_go = "until [ -e go ]; do sleep 0.02; done"
    job = tb.run(
        "bash", {"command": rf"printf '12345'; {wait_go}; printf '\rab\n'", "background": True}
    ).job
    deadline = time.monotonic() + 60
    first = ""
    while not first.startswith("12345") and time.monotonic() < deadline:
        first = tb.run("bash_status", {"handle": job, "wait": 0.05}).text
    assert first.startswith("12345")
    (ws / "go").touch()
    second = tb.run("bash_status", {"handle": job, "wait": 60}).text
    assert second.startswith("ab345\n") and "finished: exit code 0" in second


# ------------------------------------------------------------------ redact

GH = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
AWS = "AKIA" + "IOSFODNN7EXAMPLE"
JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
    "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
)
SHA = "3f786850e387550fdab836ed7e6dc881de23001b"
INTEGRITY = (
    '"integrity": "sha512-Kq5sNclPz7QV2+lfQIuwmE3V2bHtTOdAHK1rSd9HXSpzE0qjW1XJD5ZBCmn0vPh'
    '4TAS3Y2UVbb/Y41GnNUAo5g=="'
)
PEM = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAx1\nq2w3e4r5t6y7\n-----END RSA PRIVATE KEY-----\n"
LEAKY = (
    f"export GITHUB_TOKEN={GH}\n"
    f"aws_access_key_id = {AWS}\n"
    f"auth: Bearer {JWT}\n"
    "DB_PASSWORD=hunter2-not-a-pattern\n"
    "KEYBOARD=us\n"
    f"commit {SHA}\n"
    f"  {INTEGRITY}\n"
    f"{PEM}"
    "url https://deploy:s3cretpass@git.example.com/repo.git\n"
    "the end\n"
)


def test_redact_fake_keys_and_keep_hashes() -> None:
    out = redact(LEAKY)
    for secret in (GH, AWS, JWT, "hunter2", "MIIEowIBAAKCAQEAx1", "q2w3e4r5t6y7", "s3cretpass"):
        assert secret not in out
    lines = out.splitlines()
    assert "export GITHUB_TOKEN=[redacted: GitHub Token]" in lines
    assert "aws_access_key_id = [redacted: AWS Access Key]" in lines
    assert "auth: Bearer [redacted: JSON Web Token]" in lines
    assert "DB_PASSWORD=[redacted: Secret Assignment]" in lines
    assert "[redacted: Private Key]" in lines  # the whole PEM block, one line
    assert "url https://deploy:[redacted: Basic Auth Credentials]" in lines
    # No entropy plugins: a git SHA and a lockfile hash are kept, as is a harmless name.
    assert f"commit {SHA}" in lines and f"  {INTEGRITY}" in lines
    assert "KEYBOARD=us" in lines and lines[-1] == "the end"


def test_redact_pem_block_split_across_reads() -> None:
    r = Redactor()
    assert r.feed("a\n-----BEGIN PRIVATE KEY-----\nAAAA\n") == "a\n[redacted: Private Key]\n"
    assert r.feed("BBBB\n-----END PRIVATE KEY-----\nok\n") == "ok\n"


# The plugins' regexes (the last entry, the assignment rule, starts with a look-behind
# that from_regex can only filter for).
_SCREENED = [(screen, rx) for screen, rx in _screens()[:-1] if screen is not None]


@pytest.mark.slow
@pytest.mark.parametrize("n", range(len(_SCREENED)))
@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_redact_screens_never_miss_a_match(n: int, data) -> None:
    """A regex's literal screen is a superset: every string the regex matches holds one
    of its literals (lower-cased for a case-insensitive regex)."""
    screen, rx = _SCREENED[n]
    s = data.draw(st.from_regex(rx, fullmatch=True))
    hay = s.encode("utf-8", "surrogatepass")
    hay = hay.lower() if rx.flags & re.IGNORECASE else hay
    assert any(lit in hay for lit in screen), (rx.pattern, s, screen)


def test_redact_screens_are_literals_of_the_patterns() -> None:
    assert screen_for(re.compile(r"(?:r|s)k_live_[0-9a-zA-Z]{24}")) == (b"rk_live_", b"sk_live_")
    assert screen_for(re.compile(r"x(?:ab|cd)?y[a-z]+QQ", re.I)) == (b"qq",)
    assert screen_for(re.compile(r"\d{8,10}:[0-9A-Z]{35}")) is None  # ":" alone: scan
    # A secret on a line the chunk's other lines dwarf is still found.
    big = "key = value and a class token\n" * 20000 + f"export GITHUB_TOKEN={GH}\n"
    assert redact(big).endswith("export GITHUB_TOKEN=[redacted: GitHub Token]\n")


def test_redact_command_output_but_not_read_and_refuse_marker_writes(tb: Toolbox, ws: Path) -> None:
    (ws / "creds.env").write_text(LEAKY)
    out = tb.run("bash", {"command": "cat creds.env; cat creds.env >&2"})
    assert out.ok and GH not in out.text and AWS not in out.text and "hunter2" not in out.text
    assert out.text.count("[redacted: GitHub Token]") == 2  # stdout and stderr
    assert SHA in out.text
    # A background job's output is redacted too.
    job = tb.run("bash", {"command": "cat creds.env", "background": True}).job
    polled = tb.run("bash_status", {"handle": job, "wait": 60}).text
    assert GH not in polled and "[redacted: GitHub Token]" in polled
    # read is exact: edit needs the real text.
    assert GH in tb.run("read", {"path": "creds.env"}).text
    # Writing the placeholder would destroy the secret: refused, the file unchanged.
    bad = out.text.split("\n[stderr]")[0]
    w = tb.run("write", {"path": "creds.env", "content": bad})
    assert not w.ok and w.error == FAILED and "redaction marker" in w.text
    e = tb.run(
        "edit",
        {
            "path": "creds.env",
            "old": f"export GITHUB_TOKEN={GH}",
            "new": "export GITHUB_TOKEN=[redacted: GitHub Token]",
        },
    )
    assert not e.ok and "redaction marker" in e.text
    assert (ws / "creds.env").read_text() == LEAKY
    # A file that already holds a marker can still be edited around it.
    (ws / "doc.md").write_text("shown as [redacted: GitHub Token] in output\n")
    e = tb.run("edit", {"path": "doc.md", "old": "shown as", "new": "appears as"})
    assert e.ok, e.text


# ------------------------------------------------------------------ diagnostic (streams, status)


def test_diagnostic_streams_apart_and_exit_status(tb: Toolbox) -> None:
    out = tb.run("bash", {"command": "echo out1; echo err1 >&2; echo out2; exit 3"})
    assert not out.ok and out.error == EXIT_STATUS
    assert out.text.startswith("out1\nout2\n[stderr]\nerr1\n[exit code 3")
    out = tb.run("bash", {"command": "kill -SEGV $$"})
    assert "[killed by signal SIGSEGV" in out.text
    # bash reports its killed child as 128+N; decoded.
    out = tb.run("bash", {"command": "sleep 30 & kill -SEGV $!; wait $!"})
    assert "[exit code 139 (its last command was killed by SIGSEGV)" in out.text
    out = tb.run("bash", {"command": "exit 200"})
    assert "[exit code 200 ·" in out.text  # not a signal number: plain


def test_diagnostic_exit_status_words() -> None:
    # Raw wait-status words as the kernel reports them (signal in the low 7 bits,
    # 0x80 the core flag; exit code in the second byte).
    assert ExitStatus.from_wait(signal.SIGSEGV | 0x80).describe() == (
        "killed by signal SIGSEGV (core dumped)"
    )
    assert ExitStatus.from_wait(signal.SIGKILL).returncode == -signal.SIGKILL
    st = ExitStatus.from_wait(2 << 8)
    assert st.code == 2 and not st.ok and st.describe() == "exit code 2"
    assert ExitStatus.from_wait(130 << 8).describe().endswith("killed by SIGINT)")


def test_diagnostic_failing_pytest(tb: Toolbox, ws: Path) -> None:
    (ws / "test_calc.py").write_text(
        "def double(x):\n    return x * 3\n\n"
        "def test_double():\n    assert double(2) == 4\n\n"
        "def test_ok():\n    assert True\n\n"
        "def test_raises():\n    raise KeyError('missing')\n"
    )
    cmd = f"{sys.executable} -m pytest -q -p no:cacheprovider test_calc.py"
    out = tb.run("bash", {"command": cmd})
    assert not out.ok
    lines = out.text.splitlines()
    assert lines[0] == "[diagnostic]"
    top = "\n".join(lines[:10])
    assert "pytest failed: test_calc.py::test_double - assert 6 == 4" in top
    assert "pytest failed: test_calc.py::test_raises - KeyError: 'missing'" in top
    assert "pytest: 2 failed, 1 passed" in top


def test_diagnostic_python_traceback_names_the_workspace_frame(tb: Toolbox, ws: Path) -> None:
    (ws / "app.py").write_text(
        "import json\n\ndef load(text):\n    return json.loads(text)\n\nload('{bad')\n"
    )
    out = tb.run("bash", {"command": f"{sys.executable} app.py"})
    assert not out.ok
    lines = out.text.splitlines()
    assert lines[0] == "[diagnostic]"
    assert lines[1].startswith("python: json.decoder.JSONDecodeError: Expecting property name")
    # The innermost frame in the workspace, not json's own modules.
    assert lines[2] == "  at app.py:4 in load"


def test_diagnostic_c_compiler_error(tb: Toolbox, ws: Path) -> None:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (CI installs gcc)")
    (ws / "bad.c").write_text("int main(void) {\n  return undefined_var;\n}\n")
    out = tb.run("bash", {"command": "cc -c bad.c -o bad.o"})
    assert not out.ok
    lines = out.text.splitlines()
    assert lines[0] == "[diagnostic]"
    assert lines[1].startswith("bad.c:2:10: error:") and "undefined_var" in lines[1]


def test_diagnostic_rust_compile_error_and_panic(tb: Toolbox, ws: Path) -> None:
    if shutil.which("rustc") is None:
        pytest.skip("no rustc (CI installs it)")
    (ws / "bad.rs").write_text('fn main() {\n    let x: i32 = "s";\n}\n')
    out = tb.run("bash", {"command": "rustc --edition 2021 bad.rs -o bad"})
    assert not out.ok
    lines = out.text.splitlines()
    assert lines[0] == "[diagnostic]"
    assert lines[1] == "rust error[E0308]: mismatched types at bad.rs:2:18"
    (ws / "boom.rs").write_text(
        'fn main() {\n    let v: Vec<i32> = Vec::new();\n    println!("{}", v[3]);\n}\n'
    )
    out = tb.run("bash", {"command": "rustc --edition 2021 boom.rs -o boom && ./boom"})
    assert not out.ok and "[exit code 101" in out.text
    lines = out.text.splitlines()
    assert lines[0] == "[diagnostic]"
    assert lines[1].startswith("rust panic in thread 'main' at boom.rs:3:")
    assert "index out of bounds" in lines[1]


def test_diagnostic_frame_is_short_and_absent_on_success(tb: Toolbox, ws: Path) -> None:
    many = "".join(f"f{i}.c:{i}:1: error: e{i}\n" for i in range(1, 40))
    frame = diagnose("", many, ws)
    assert len(frame) == 10 and frame[-1] == "… 31 more"
    assert diagnose("all fine\n", "", ws) == []
    out = tb.run("bash", {"command": "echo 'Traceback (most recent call last):'; echo 'X: y'"})
    assert out.ok and not out.text.startswith("[diagnostic]")  # exit 0: no frame


@pytest.mark.skipif(os.name != "posix", reason="POSIX process groups")
def test_diagnostic_background_job_failure(tb: Toolbox, ws: Path) -> None:
    (ws / "crash.py").write_text("def f():\n    raise RuntimeError('job broke')\n\nf()\n")
    job = tb.run("bash", {"command": f"{sys.executable} crash.py", "background": True}).job
    st = tb.run("bash_status", {"handle": job, "wait": 10})
    assert not st.ok and st.text.startswith("[diagnostic]\npython: RuntimeError: job broke")
    assert "  at crash.py:2 in f" in st.text


# ------------------------------------------------------------------ validation envelope


def test_validation_envelope_for_read(tb: Toolbox) -> None:
    out = tb.run("read", {"path": "x.txt", "limit": 0, "extra": True})
    assert not out.ok
    headline, line, params = out.text.split("\n")
    assert headline == "error: invalid arguments for read"
    env = json.loads(line)
    assert env["status"] == "validation_error" and env["tool_name"] == "read"
    assert env["error_count"] == 2
    assert [e["loc"] for e in env["errors"]] == [["limit"], ["extra"]]
    limit, extra = env["errors"]
    assert limit == {
        "loc": ["limit"],
        "input_value": 0,
        "error_type": "minimum",
        "message": "expected a number >= 1, got integer 0",
        "expected": "integer >= 1",
    }
    assert extra["input_value"] is True and extra["error_type"] == "additionalProperties"
    assert params.startswith("read parameters: path (string, non-empty, required)")
    unknown = json.loads(tb.run("raed", {}).text.split("\n")[1])
    assert unknown["status"] == "unknown_tool" and unknown["suggestion"] == "read"


# ------------------------------------------------------------------ hooks


@pytest.fixture(scope="module")
def engine(tiny_f32_dir):
    from ds4mlx.engine import Engine

    return Engine.load(tiny_f32_dir, ctx_size=4096)


def test_hooks_log_every_response(engine, workspace: Path, tmp_path: Path) -> None:
    log = tmp_path / "hooks.jsonl"
    hook = f"cat >> {log}; echo >> {log}"
    script = [
        turn("Look.", "Listing.", invoke("bash", command="echo hi")),
        turn("Seen.", "Done."),
    ]
    hooks = Hooks(before=hook, after=hook, timeout=5, cwd=workspace)
    agent = Agent(engine, workspace, ui=RecordingUI(), script=script, yes=True, hooks=hooks)
    try:
        assert agent.send("run it").ok
    finally:
        agent.close()
    records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    assert [r["event"] for r in records] == [
        "before_response",
        "after_response",
        "before_response",
        "after_response",
    ]
    assert [r["response_index"] for r in records] == [0, 0, 1, 1]
    assert all(r["user_text"] == "run it" and r["model"] == engine.path.name for r in records)
    first, last = records[1], records[3]
    assert first["tool_call"] is True and first["tool_calls"][0]["name"] == "bash"
    assert first["tool_calls"][0]["arguments"] == {"command": "echo hi"}
    assert last["tool_call"] is False and last["response_text"] == "Done."
    assert first["generated_tokens"] > 0 and last["interrupted"] is False
    assert records[0]["generated_tokens"] == 0 and "response_text" not in records[0]


def test_hooks_failing_or_slow_warn_and_the_turn_completes(
    engine, workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hooks = Hooks(
        before="echo 'bad \x1b]0;t\x07 thing' >&2; exit 3",
        after="sleep 30",
        timeout=1,
        cwd=workspace,
    )
    agent = Agent(engine, workspace, ui=RecordingUI(), script=[turn("T.", "Fine.")], hooks=hooks)
    try:
        res = agent.send("hello")
    finally:
        agent.close()
    assert res.ok and agent.messages[-1].content == "Fine."
    err = capsys.readouterr().err
    assert "warning: before_response hook exited with status 3: bad \\x1b]0;t\\x07 thing" in err
    assert "warning: after_response hook killed after 1 s (--hook-timeout)" in err


def test_hooks_bad_timeout_flag_is_one_line_exit_2(workspace: Path) -> None:
    import subprocess

    r = subprocess.run(
        [sys.executable, "-m", "ds4mlx.cli", "agent", "-m", str(workspace / "none")]
        + ["--workspace", str(workspace), "--hook-timeout", "0", "-p", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip() == "ds4mlx agent: --hook-timeout must be within 1..3600 s, got 0"


# ------------------------------------------------------------------ idempotent (at most once)


def test_idempotent_interrupted_write_then_same_call_is_written_once(
    engine, ws: Path, tmp_path: Path
) -> None:
    from ds4mlx.agent import once
    from ds4mlx.agent.sessions import SessionBook

    write = invoke("write", path="a.txt", content="hello\n")
    script = [turn("W.", "", write), turn("Again.", "", write), turn("Ok.", "Done.")]
    book = SessionBook(tmp_path / "sessions")
    ui = RecordingUI(answers={"write": "once"})
    agent = Agent(engine, ws, ui=ui, book=book, script=script)
    real = agent.toolbox.run
    saved_before: list = []

    def ctrl_c_after_the_write(name, arguments):
        saved_before.extend(book.get(agent.record.id).messages)
        real(name, arguments)  # the file is written ...
        agent.toolbox.run = real
        raise KeyboardInterrupt  # ... and Ctrl+C lands before its result is recorded

    agent.toolbox.run = ctrl_c_after_the_write
    try:
        assert agent.send("write it").status == "interrupted"
        # Saved before the call ran: the call, not yet its result.
        assert saved_before[-1].role == "assistant" and saved_before[-1].tool_calls
        cut = agent.messages[-1]
        assert cut.role == "tool" and cut.content.startswith(once.UNKNOWN)
        assert book.get(agent.record.id).messages[-1].content == cut.content  # saved after it
        st = (ws / "a.txt").stat()
        assert agent.send("go on").ok
    finally:
        agent.close()
    results = [m.content for m in agent.messages if m.role == "tool"]
    assert results[1] == "already applied: a.txt already holds this content; nothing was written"
    assert [t for t, _ in ui.asked] == ["write"]  # the repeat asked nothing ...
    after = (ws / "a.txt").stat()
    assert (after.st_ino, after.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)  # ... wrote nothing
    assert (ws / "a.txt").read_text() == "hello\n"


def test_idempotent_repeated_edit_of_unknown_outcome_reconciles(engine, ws: Path) -> None:
    (ws / "m.py").write_text("x = 1\n")
    edit = invoke("edit", path="m.py", old="x = 1", new="x = 2")
    script = [turn("E.", "", edit), turn("Again.", "", edit), turn("Ok.", "Done.")]
    ui = RecordingUI(answers={"edit": "once"})
    agent = Agent(engine, ws, ui=ui, script=script)
    real = agent.toolbox.run

    def ctrl_c_after_the_edit(name, arguments):
        real(name, arguments)
        agent.toolbox.run = real
        raise KeyboardInterrupt

    agent.toolbox.run = ctrl_c_after_the_edit
    try:
        agent.send("edit it")
        assert agent.send("go on").ok
    finally:
        agent.close()
    results = [m.content for m in agent.messages if m.role == "tool"]
    assert results[1].startswith("already applied: m.py")
    assert len(ui.asked) == 1 and (ws / "m.py").read_text() == "x = 2\n"


def test_idempotent_restored_session_with_unanswered_call_is_not_run(
    engine, ws: Path, tmp_path: Path
) -> None:
    from ds4mlx.agent import once
    from ds4mlx.agent.sessions import SessionBook, SessionRecord
    from ds4mlx.dsml import Message, ToolCall

    book = SessionBook(tmp_path / "sessions")
    agent = Agent(engine, ws, ui=RecordingUI(), book=book, yes=True, script=[turn("Ok.", "Fine.")])
    call = ToolCall("call_cut", "bash", {"command": "echo ran >> ran.txt"})
    crashed = SessionRecord(
        id=book.new_id(),
        workspace=str(agent.workspace),
        messages=[
            agent.messages[0],
            Message("user", "run it"),
            Message("assistant", "", reasoning="Run.", tool_calls=[call]),
        ],
    )
    book.put(crashed)  # what a crash while the call ran leaves on disk
    try:
        said = agent.switch(crashed.id)
        assert "1 tool call(s) cut by a crash answered 'outcome unknown', not rerun" in said
        assert agent.send("continue").ok
    finally:
        agent.close()
    assert not (ws / "ran.txt").exists()
    results = [m for m in book.get(crashed.id).messages if m.role == "tool"]
    assert [m.tool_call_id for m in results] == ["call_cut"]
    assert results[0].content == once.CUT_TEXT


# ------------------------------------------------------------------ notice (jobs and notices)


def test_notice_receipt_shows_handle_and_default_deadline(ws: Path) -> None:
    with Toolbox(ws, Permissions(yes=True), kill_grace=0.3, job_timeout=1.5) as box:
        out = box.run("bash", {"command": "sleep 30", "background": True})
        assert out.ok and out.job == "job_1"
        assert out.text.startswith("started background job job_1 (timeout 1.5 s)")
        assert "pid" not in out.text  # `kill PID` would orphan the rest of the group
        st = box.run("bash_status", {"handle": "job_1", "wait": 20})
        assert "job_1 timed out after 1.5 s" in st.text and st.error == "timeout"
    with Toolbox(ws, Permissions(yes=True)) as box:
        assert "(timeout 3600 s)" in box.run("bash", {"command": "true", "background": True}).text


def test_notice_yes_stopped_at_the_output_limit(ws: Path) -> None:
    with Toolbox(ws, Permissions(yes=True), kill_grace=0.3, job_output_limit=1 << 20) as box:
        assert box.run("bash", {"command": "yes", "background": True}).ok
        st = box.run("bash_status", {"handle": "job_1", "wait": 30})
        assert not st.ok and st.error == FAILED
        assert "[job_1 stopped: output limit (1 MiB) reached after" in st.text
        job = box.jobs.get("job_1")
        assert not job.running and job.output_limited


def _late_results(agent: Agent) -> list[str]:
    """The job notices of the transcript (the renderer heads them with their call)."""
    return [m.content for m in agent.messages if m.role == "tool" and m.content.startswith("job_")]


def test_notice_job_end_is_a_late_result_in_the_next_suffix(engine, ws: Path) -> None:
    from ds4mlx.dsml.tokens import EOS

    script = [
        turn("Start.", "", invoke("bash", command="sleep 2; echo done", background=True)),
        turn("Wait.", "", invoke("bash", command="sleep 3")),  # the job ends meanwhile
        turn("Seen.", "It finished."),
        turn("Ok.", "Nothing new."),
    ]
    ui = RecordingUI()
    agent = Agent(engine, ws, ui=ui, script=script, yes=True)
    try:
        assert agent.send("run it in the background").ok
        start = next(m for m in agent.messages if m.role == "assistant" and m.tool_calls)
        call_id = start.tool_calls[0].id
        [late] = _late_results(agent)
        # "after 2.0 s" on an idle machine; a loaded one delays the start and the reaping.
        took = re.match(r"job_1 exited 0 after (\d+\.\d) s", late)
        assert took and float(took[1]) >= 2.0 and late.endswith("\ndone"), late
        # It went out in the suffix after the round's results, inside <tool_result>: that
        # prefill is EOS + one user turn (results, then the notice) + the assistant opener;
        # the renderer heads it with the call it answers (dsml.render_late_result).
        suffix = [s for s in agent.steps if s.kind == "tool_results"][-1].text
        head = f'<tool_result>[result of {call_id} bash(command="sleep 2; echo done", '
        assert head + f"background=true)]\n{took[0]}" in suffix
        assert suffix.startswith(EOS + "<｜User｜><tool_result>")
        assert suffix.count("<｜User｜>") == 1 and suffix.endswith("<｜Assistant｜><think>")
        assert suffix.index("<tool_result>[result of") > suffix.index("<tool_result>")
        assert agent.consistent()
        assert agent.send("anything else?").ok
        assert len(_late_results(agent)) == 1  # never twice
    finally:
        agent.close()


def test_notice_of_a_job_of_another_session_waits_for_it(engine, ws: Path, tmp_path: Path) -> None:
    """A job started in session 1 ends while session 2 is current: its notice is not
    given to session 2, and reaches session 1 when it is current again (it was
    dropped, although the call's receipt promised the end would be told)."""
    from ds4mlx.agent.sessions import SessionBook

    book = SessionBook(tmp_path / "sessions")
    script = [
        turn("Start.", "Started.", invoke("bash", command="sleep 1; echo done", background=True)),
        turn("Ok.", "Started it."),
        turn("Two.", "Second session."),
        turn("Back.", "Session one heard of it."),
    ]
    agent = Agent(engine, ws, ui=RecordingUI(), book=book, script=script, yes=True)
    try:
        assert agent.send("start it").ok
        sid1 = agent.record.id
        agent.new_session()
        deadline = time.monotonic() + 60
        while not agent.turns.notices.collect() and not agent.turns.notices.pending:
            assert time.monotonic() < deadline, "the job never ended"
            time.sleep(0.1)
        assert agent.send("something else").ok
        assert _late_results(agent) == []  # not session 2's call
        agent.switch(sid1)
        assert agent.send("and the job?").ok
        [late] = _late_results(agent)
        assert late.startswith("job_1 exited 0") and late.endswith("done"), late
        assert agent.messages[-1].content == "Session one heard of it."
    finally:
        agent.close()


def test_notice_not_sent_after_bash_status_saw_the_end(engine, ws: Path) -> None:
    script = [
        turn("Start.", "", invoke("bash", command="sleep 3; echo hi", background=True)),
        turn("Poll.", "", invoke("bash_status", handle="job_1", wait=30)),
        turn("Seen.", "Done."),
    ]
    agent = Agent(engine, ws, ui=RecordingUI(), script=script, yes=True)
    try:
        assert agent.send("go").ok
    finally:
        agent.close()
    assert _late_results(agent) == []
    assert (
        "job_1 finished: exit code 0" in [m.content for m in agent.messages if m.role == "tool"][1]
    )


# ------------------------------------------------------------------ stdin (input prompts)


def test_a_foreground_command_is_said_to_run_once_it_starts(ws: Path) -> None:
    """Its output comes only with its result: the terminal says it runs once it started,
    after its permission (a user took a silent 15 s command for one that ignored Ctrl+C);
    a background job, whose call returns at once, and the file tools are not."""
    said: list[str] = []

    def ask(tool: str, summary: str) -> str:
        said.append("asked")
        return "once"

    perms = Permissions(ask=ask)
    with Toolbox(ws, perms, bash_timeout=60, on_running=lambda: said.append("running")) as box:
        assert box.run("bash", {"command": "echo hi"}).ok
        assert said == ["asked", "running"]
        assert box.run("bash", {"command": "sleep 0.1", "background": True}).ok
        assert box.run("list", {"path": "."}).ok
    assert said == ["asked", "running", "asked"]


def test_stdin_prompt_answered_or_given_eof(ws: Path) -> None:
    seen: list[tuple[str, str, bool]] = []

    def ask(command: str, prompt: str, hidden: bool) -> str | None:
        seen.append((command, prompt, hidden))
        if "Again?" in prompt:
            return "y" * 800
        return "y" if "Apply?" in prompt else "s3cret" if "pw:" in prompt else None

    with Toolbox(ws, Permissions(yes=True), bash_timeout=60, ask_input=ask) as box:
        out = box.run("bash", {"command": 'read -p "Apply? " a; echo got=$a'})
        assert out.ok and out.text.startswith("got=y"), out.text
        assert "[stdin: the user answered its input]" in out.text
        assert seen[0][1].endswith("Apply? ")  # the prompt a pipe would have hidden
        assert seen[0][2] is False
        # A secret (the command turned echo off): asked hidden, and answered.
        out = box.run("bash", {"command": 'read -s -p "pw: " z; echo; echo len=${#z}'})
        assert out.ok and "len=6" in out.text and "s3cret" not in out.text, out.text
        assert seen[1][1].endswith("pw: ") and seen[1][2] is True
        # 8 KB of answers on one terminal (now echoed to its master side): all read.
        many = 'for i in $(seq 10); do read -p "Again? " a; done; echo done ${#a}'
        out = box.run("bash", {"command": many})
        assert out.ok and "done 800" in out.text, out.text
        out = box.run("bash", {"command": "cat"})  # EOF chosen: cat ends, exit 0
        assert out.ok and "exit code 0" in out.text and "end of file" in out.text
    with Toolbox(ws, Permissions(yes=True), bash_timeout=60) as box:  # -p: nobody to ask
        out = box.run("bash", {"command": 'read -p "Apply? " a; echo got=$a'})
        assert out.text.startswith("got=\n") and "no terminal to ask" in out.text


def test_output_limit_crossed_by_the_first_read_stops_every_job(ws: Path, monkeypatch) -> None:
    """A job whose first read is already over the limit is stopped by a thread that
    starts while ``Job.__init__`` may still be building the job (a CI failure: the
    stop found no ``_timer`` yet, died, and the job ran on). Every job must end
    output-limited, and no thread may raise."""
    import threading

    from ds4mlx.agent.tools.background import Job

    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: errors.append(a.exc_value))
    jobs = [Job(f"j{i}", "yes", ws, kill_grace=0.3, output_limit=1, timeout=60) for i in range(12)]
    try:
        for job in jobs:
            assert job.wait(30) is not None, f"{job.handle} still running"
            assert job.output_limited and job.stopped
    finally:
        for job in jobs:
            job.stop(0.1)
    assert errors == []


def test_a_hook_whose_escaped_child_holds_stderr_does_not_hang(tmp_path: Path) -> None:
    """A hook that starts a process in a session of its own (outside the group its
    timeout kills) which keeps the hook's stderr open: the hook is still given up at its
    timeout, with a warning, and the agent goes on (it waited for that stderr forever)."""
    import threading

    pid_file = tmp_path / "escaped.pid"
    warnings: list[str] = []
    hooks = Hooks(
        before=f"setsid sleep 600 & echo $! > {pid_file}; exec sleep 600",
        timeout=1,
        cwd=tmp_path,
        warn=warnings.append,
    )
    done = threading.Event()
    t = threading.Thread(target=lambda: (hooks.fire("before_response", {}), done.set()))
    t.start()
    try:
        assert done.wait(120), "the hook never gave up"
        assert warnings == ["before_response hook killed after 1 s (--hook-timeout)"]
    finally:
        if pid_file.exists() and pid_file.read_text().strip():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        t.join(120)
