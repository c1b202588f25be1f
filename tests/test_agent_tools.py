"""Agent tools on real files in temp workspaces and real subprocesses."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from server_util import pid_alive

from ds4mlx.agent.permissions import Permissions
from ds4mlx.agent.shaping import OutputStore, approx_tokens
from ds4mlx.agent.tools import (
    EXIT_STATUS,
    INVALID_ARGUMENTS,
    NOT_FOUND,
    TIMEOUT,
    TOOL_SPECS,
    UNKNOWN_TOOL,
    Toolbox,
    clean_terminal_output,
)
from ds4mlx.agent.tools.background import JobManager
from ds4mlx.dsml.conversation import ToolSpec


def _text(p: Path) -> str:
    """``p``'s text, or "" while it does not exist."""
    try:
        return p.read_text()
    except FileNotFoundError:
        return ""


def _wait_dead(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.02)
    return False


# --- definitions -------------------------------------------------------------


def test_specs_are_valid_tool_specs(tb: Toolbox) -> None:
    names = [s.name for s in tb.specs]
    assert names == [
        "read",
        "more",
        "write",
        "edit",
        "list",
        "search",
        "bash",
        "bash_status",
        "bash_stop",
    ]
    for spec in TOOL_SPECS:
        assert isinstance(spec, ToolSpec)
        assert spec.description
        Draft202012Validator.check_schema(spec.parameters)
        assert spec.parameters["type"] == "object"
        assert set(spec.parameters["required"]) <= set(spec.parameters["properties"])


# --- read / write / edit -----------------------------------------------------


def test_write_then_read(tb: Toolbox, ws: Path) -> None:
    out = tb.run("write", {"path": "pkg/sub/mod.py", "content": "a = 1\nb = 2\n"})
    assert out.ok and "created pkg/sub/mod.py" in out.text
    assert (ws / "pkg/sub/mod.py").read_text() == "a = 1\nb = 2\n"
    out = tb.run("write", {"path": "pkg/sub/mod.py", "content": "c = 3\n"})
    assert out.ok and "overwrote" in out.text
    assert tb.run("read", {"path": "pkg/sub/mod.py"}).text == "c = 3\n"
    assert tb.run("read", {"path": str(ws / "pkg/sub/mod.py")}).text == "c = 3\n"


def test_read_offset_limit(tb: Toolbox, ws: Path) -> None:
    (ws / "f.txt").write_text("".join(f"l{i}\n" for i in range(1, 11)))
    out = tb.run("read", {"path": "f.txt", "offset": 3, "limit": 2})
    assert out.ok
    assert out.text == "l3\nl4\n[f.txt: lines 3–4 of 10; call read with offset=5 for more]"
    out = tb.run("read", {"path": "f.txt", "offset": 9})
    assert out.text == "l9\nl10\n[f.txt: lines 9–10 of 10]"
    out = tb.run("read", {"path": "f.txt", "offset": 11})
    assert not out.ok and "past the end" in out.text and "10 lines" in out.text


def test_read_cuts_a_huge_line_and_counts_on(tb: Toolbox, ws: Path) -> None:
    """A file whose one line is 20 MB (a minified bundle, a hostile repository's bait)
    was read whole into memory and handed on whole: the line is shown cut at
    `MAX_LINE_CHARS` characters with a note, and the lines after it are counted and read
    as usual; a long line of wide characters under the limit is not cut."""
    from ds4mlx.agent.tools.files import MAX_LINE_CHARS

    note = f"… [line cut at {MAX_LINE_CHARS} characters]"
    (ws / "big.js").write_bytes(b"var a=" + b"1," * 10_000_000 + b"0;\nend\n")
    out = tb.run("read", {"path": "big.js", "limit": 1})
    assert out.ok and out.text.startswith("var a=1,1,")
    assert out.text.split("\n")[0].endswith(note) and len(out.text.split("\n")[0]) == (
        MAX_LINE_CHARS + len(note)
    )
    assert "lines 1–1 of 2" in out.text
    assert tb.run("read", {"path": "big.js", "offset": 2}).text.startswith("end\n")
    wide = "字" * (MAX_LINE_CHARS - 1) + "\n"  # 3 bytes each: past the limit in bytes only
    (ws / "wide.txt").write_text(wide, encoding="utf-8")
    assert tb.run("read", {"path": "wide.txt"}).text == wide
    (ws / "wide16.txt").write_text("\ufeff" + "é" * (MAX_LINE_CHARS + 5), encoding="utf-16-le")
    assert note in tb.run("read", {"path": "wide16.txt"}).text


def test_read_errors(tb: Toolbox, ws: Path) -> None:
    (ws / "d").mkdir()
    (ws / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    (ws / "empty").write_text("")
    out = tb.run("read", {"path": "missing.txt"})
    assert not out.ok and out.error == NOT_FOUND and "missing.txt" in out.text
    out = tb.run("read", {"path": "d"})
    assert not out.ok and "directory" in out.text and "list" in out.text
    out = tb.run("read", {"path": "blob.bin"})
    assert not out.ok and "binary" in out.text and "300 bytes" in out.text
    out = tb.run("read", {"path": "empty"})
    assert out.ok and "empty" in out.text


def test_read_keeps_crlf_and_replaces_bad_utf8(tb: Toolbox, ws: Path) -> None:
    (ws / "win.txt").write_bytes(b"a\r\nb\r\n")
    assert tb.run("read", {"path": "win.txt"}).text == "a\r\nb\r\n"
    (ws / "latin.txt").write_bytes(b"caf\xe9\n")
    body, note = tb.run("read", {"path": "latin.txt"}).text.split("\n", 1)
    assert body == "caf\ufffd" and note.startswith("[latin.txt is not valid UTF-8")


def test_edit(tb: Toolbox, ws: Path) -> None:
    f = ws / "m.py"
    f.write_text("def f():\n    return 1\n\ndef g():\n    return 1\n")
    out = tb.run(
        "edit", {"path": "m.py", "old": "def f():\n    return 1", "new": "def f():\n    return 2"}
    )
    assert out.ok and "line(s) 1" in out.text
    assert f.read_text() == "def f():\n    return 2\n\ndef g():\n    return 1\n"

    out = tb.run("edit", {"path": "m.py", "old": "return", "new": "yield"})
    assert not out.ok and "occurs 2 times" in out.text and "lines 2, 5" in out.text
    assert "replace_all" in out.text
    assert f.read_text().count("return") == 2

    out = tb.run("edit", {"path": "m.py", "old": "return", "new": "yield", "replace_all": True})
    assert out.ok and "replaced 2" in out.text
    assert f.read_text().count("yield") == 2

    out = tb.run("edit", {"path": "m.py", "old": "not there", "new": "x"})
    assert not out.ok and out.error == NOT_FOUND and "not found" in out.text

    out = tb.run("edit", {"path": "m.py", "old": "yield", "new": "yield", "replace_all": True})
    assert not out.ok and "identical" in out.text

    out = tb.run("edit", {"path": "nope.py", "old": "a", "new": "b"})
    assert not out.ok and out.error == NOT_FOUND


def test_edit_crlf_file_with_lf_old_text(tb: Toolbox, ws: Path) -> None:
    f = ws / "w.txt"
    f.write_bytes(b"one\r\ntwo\r\nthree\r\n")
    out = tb.run("edit", {"path": "w.txt", "old": "one\ntwo", "new": "1\n2"})
    assert out.ok
    assert f.read_bytes() == b"1\r\n2\r\nthree\r\n"


# --- list / search -----------------------------------------------------------


def _tree(ws: Path) -> None:
    (ws / "src/pkg").mkdir(parents=True)
    (ws / "src/pkg/a.py").write_text("import os\nVALUE = 42\n")
    (ws / "src/b.py").write_text("value = 'x'\n")
    (ws / "src/notes.md").write_text("The VALUE is documented here.\n")
    (ws / "top.txt").write_text("no match\n")
    (ws / "data.bin").write_bytes(b"VALUE\x00\x00binary")
    (ws / ".git").mkdir()
    (ws / ".git/config").write_text("VALUE = 1\n")


def test_list(tb: Toolbox, ws: Path) -> None:
    _tree(ws)
    out = tb.run("list", {})
    assert out.ok
    assert out.text.splitlines() == [
        "data.bin",
        "src/",
        "src/b.py",
        "src/notes.md",
        "src/pkg/",
        "top.txt",
    ]
    out = tb.run("list", {"depth": 3})
    assert "src/pkg/a.py" in out.text.splitlines()
    out = tb.run("list", {"path": "src", "depth": 1})
    assert out.text.splitlines() == ["src/b.py", "src/notes.md", "src/pkg/"]
    out = tb.run("list", {"glob": "*.py"})
    assert out.text.splitlines() == ["src/b.py", "src/pkg/a.py"]
    out = tb.run("list", {"path": "src", "glob": "pkg/*"})
    assert out.text.splitlines() == ["src/pkg/a.py"]
    out = tb.run("list", {"glob": "*.rs"})
    assert out.ok and "no paths" in out.text
    out = tb.run("list", {"path": "nowhere"})
    assert not out.ok and out.error == NOT_FOUND
    assert ".git" not in tb.run("list", {"glob": "**/*"}).text


def test_search(tb: Toolbox, ws: Path) -> None:
    _tree(ws)
    out = tb.run("search", {"pattern": r"VALUE\b"})
    assert out.ok
    lines = out.text.splitlines()
    assert lines[:2] == [
        "src/notes.md:1: The VALUE is documented here.",
        "src/pkg/a.py:2: VALUE = 42",
    ]
    assert "[2 matching lines in 2 files; skipped 1 binary]" == lines[-1]
    assert ".git" not in out.text

    out = tb.run("search", {"pattern": "value", "ignore_case": True, "glob": "*.py"})
    assert [ln.split(":")[0] for ln in out.text.splitlines()[:-1]] == ["src/b.py", "src/pkg/a.py"]

    out = tb.run("search", {"pattern": "import", "path": "src/pkg/a.py"})
    assert out.text.splitlines()[0] == "src/pkg/a.py:1: import os"

    out = tb.run("search", {"pattern": "nothing-like-this"})
    assert out.ok and "no matches" in out.text

    out = tb.run("search", {"pattern": "(unclosed"})
    assert not out.ok and out.error == INVALID_ARGUMENTS and "regular expression" in out.text


def test_search_max_results(tb: Toolbox, ws: Path) -> None:
    (ws / "many.txt").write_text("hit\n" * 50)
    out = tb.run("search", {"pattern": "hit", "max_results": 5})
    assert out.text.count("many.txt:") == 5
    assert "stopped at max_results=5" in out.text


def test_search_skips_symlinks_that_loop_or_leave(tb: Toolbox, ws: Path, tmp_path: Path) -> None:
    # Walking and globbing apply the same rule: a symlink that loops or points out
    # of the workspace is skipped; it does not fail the whole search.
    _tree(ws)
    (ws / "loop").symlink_to("loop")
    (tmp_path / "outside.txt").write_text("VALUE outside\n")
    (ws / "out.txt").symlink_to(tmp_path / "outside.txt")
    for args in ({}, {"glob": "*"}):
        out = tb.run("search", {"pattern": r"VALUE\b", **args})
        assert out.ok, out.text
        assert "src/pkg/a.py:2: VALUE = 42" in out.text and "outside" not in out.text


# --- bash --------------------------------------------------------------------


def test_bash_runs_in_workspace_with_exit_codes(tb: Toolbox, ws: Path) -> None:
    out = tb.run("bash", {"command": "pwd; echo out; echo err >&2; touch made.txt"})
    assert out.ok and out.error is None
    assert out.text.splitlines()[:4] == [str(ws), "out", "[stderr]", "err"]
    assert re.search(r"\[exit code 0 · [\d.]+ s\]$", out.text)
    assert (ws / "made.txt").exists()

    out = tb.run("bash", {"command": "echo failing; exit 7"})
    assert not out.ok and out.error == EXIT_STATUS
    assert "failing" in out.text and "[exit code 7" in out.text

    out = tb.run("bash", {"command": "true"})
    assert out.ok and "(no output)" in out.text

    out = tb.run("bash", {"command": "kill -TERM $$"})
    assert not out.ok and "killed by signal SIGTERM" in out.text


def test_bash_timeout_kills_process_group(tb: Toolbox, ws: Path) -> None:
    out = tb.run(
        "bash",
        {"command": "echo started; sleep 3600 & echo $! > child.pid; wait", "timeout": 0.5},
    )
    # Waiting for the hour-long sleep would hang here (pytest-timeout dumps the stacks).
    assert not out.ok and out.error == TIMEOUT
    assert out.text.startswith("error: timed out after 0.5 s; outcome unknown")
    assert "partial effects" in out.text and "not retried" in out.text
    assert "started" in out.text  # partial output kept
    child = int((ws / "child.pid").read_text())
    assert _wait_dead(child), "the command's child survived the timeout"


def test_bash_stops_leftover_processes(tb: Toolbox, ws: Path) -> None:
    out = tb.run("bash", {"command": "sleep 3600 & echo $! > child.pid; echo done"})
    # Waiting for the hour-long sleep would hang here (pytest-timeout dumps the stacks).
    assert out.ok and "done" in out.text and "left running were stopped" in out.text
    assert _wait_dead(int((ws / "child.pid").read_text()))


def test_bash_waits_for_slow_readers_of_an_exited_command(
    tb: Toolbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a loaded machine the pipe readers get the CPU late. Once the command's whole
    group is gone its output must still be read in full, and nothing called "left
    running" (a fixed 0.5 s drain returned "(no output)" and that claim)."""
    from ds4mlx.agent.tools import background

    read = background._Pipe._read

    def late_read(self: background._Pipe) -> None:
        time.sleep(3 * background._DRAIN_S)  # the reader thread is not scheduled yet
        read(self)

    monkeypatch.setattr(background._Pipe, "_read", late_read)
    out = tb.run("bash", {"command": "echo done; echo oops >&2"})
    assert out.ok and out.text.startswith("done\n[stderr]\noops\n")
    assert "left running" not in out.text


def test_status_of_a_job_that_just_ended_has_all_its_output(
    tb: Toolbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll that finds the job ended says so with its whole output, even while the pipe
    readers lag (the output was read before the state: a job that had just exited was
    reported finished, and seen, without its last output)."""
    from ds4mlx.agent.tools import background

    read = background._Pipe._read

    def late_read(self: background._Pipe) -> None:
        time.sleep(3 * background._DRAIN_S)  # the reader thread is not scheduled yet
        read(self)

    monkeypatch.setattr(background._Pipe, "_read", late_read)
    handle = tb.run("bash", {"command": "echo done", "background": True}).job
    job = tb.jobs.get(handle)
    deadline = time.monotonic() + 60
    while job.running and time.monotonic() < deadline:
        time.sleep(0.02)
    st = tb.run("bash_status", {"handle": handle})
    assert st.text.startswith("done\n") and "finished: exit code 0" in st.text, st.text


def test_a_command_that_exits_as_a_wait_gives_up_is_not_timed_out(
    tb: Toolbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The foreground loop waits for the command in short steps. A command that exited
    right after one step gave up was seen ended with no exit code, and reported timed
    out (and "partial effects"). The first wait that sees the exit is made to give up."""
    from ds4mlx.agent.tools.background import Job

    wait, late = Job.wait, []

    def wait_that_gives_up_once(self: Job, timeout: float | None = None) -> int | None:
        code = wait(self, timeout)
        if code is not None and not late:
            late.append(code)
            return None  # the exit came just after this wait's timeout
        return code

    monkeypatch.setattr(Job, "wait", wait_that_gives_up_once)
    out = tb.run("bash", {"command": "echo done"})
    assert late == [0]
    assert out.ok and out.error is None and out.text.startswith("done\n[exit code 0"), out.text


def test_bash_cleans_terminal_output(tb: Toolbox) -> None:
    out = tb.run("bash", {"command": r"printf '\033[31mred\033[0m\n10%%\r50%%\r100%%\n'"})
    assert out.text.startswith("red\n100%\n")
    assert clean_terminal_output("a\r\nb\rc\n\x1b]0;title\x07x") == "a\nc\nx"


def test_background_job_poll_and_finish(tb: Toolbox, ws: Path) -> None:
    # It goes on past "one" only once the test touched "go" (a file, not a sleep: it is
    # still running at the polls before, however slow the machine).
    command = "echo one; until [ -e go ]; do sleep 0.05; done; echo two; sleep 0.3; echo three"
    out = tb.run("bash", {"command": command, "background": True})
    assert out.ok and out.job == "job_1" and 'handle="job_1"' in out.text
    seen = ""
    deadline = time.monotonic() + 60
    while "three" not in seen and time.monotonic() < deadline:
        st = tb.run("bash_status", {"handle": "job_1", "wait": 0.2})
        assert st.ok
        seen += st.text
        if "one" in seen:
            (ws / "go").touch()
    assert seen.count("one") == 1 and seen.count("two") == 1  # each line reported once
    assert "job_1 still running" in seen
    st = tb.run("bash_status", {"handle": "job_1", "wait": 60})
    assert "finished: exit code 0" in st.text


def test_background_job_wait_and_exit_code(tb: Toolbox) -> None:
    tb.run("bash", {"command": "echo bye; exit 4", "background": True})
    st = tb.run("bash_status", {"handle": "job_1", "wait": 60})
    assert "bye" in st.text and "finished: exit code 4" in st.text
    assert not st.ok and st.error == EXIT_STATUS
    # A later poll reports no new output, same status.
    st = tb.run("bash_status", {"handle": "job_1"})
    assert st.text.startswith("(no new output)") and "exit code 4" in st.text


def test_background_job_stop(tb: Toolbox, ws: Path) -> None:
    out = tb.run(
        "bash",
        # "up" goes out before child.pid exists: a stop that lands right after the pid
        # file is written must still find it in the output.
        {"command": "sleep 60 & echo up; echo $! > child.pid; wait", "background": True},
    )
    deadline = time.monotonic() + 60
    # Written, not only created: the shell opens (truncates) the file before the echo.
    while not _text(ws / "child.pid").endswith("\n") and time.monotonic() < deadline:
        time.sleep(0.02)
    job = tb.jobs.get(out.job)
    st = tb.run("bash_stop", {"handle": out.job})
    assert st.ok and "stopped by bash_stop" in st.text and "up" in st.text
    assert not job.running
    assert _wait_dead(int((ws / "child.pid").read_text()))
    again = tb.run("bash_stop", {"handle": out.job})
    assert again.ok and "already ended" in again.text


def test_background_job_timeout(tb: Toolbox) -> None:
    out = tb.run("bash", {"command": "echo hi; sleep 60", "background": True, "timeout": 0.3})
    st = tb.run("bash_status", {"handle": out.job, "wait": 60})
    assert not st.ok and st.error == TIMEOUT
    assert "timed out after 0.3 s" in st.text and "outcome unknown" in st.text and "hi" in st.text


def test_unknown_job_handle(tb: Toolbox) -> None:
    for tool in ("bash_status", "bash_stop"):
        out = tb.run(tool, {"handle": "job_9"})
        assert not out.ok and out.error == NOT_FOUND and "job_9" in out.text


def test_close_stops_jobs(ws: Path) -> None:
    tb = Toolbox(ws, Permissions(yes=True), kill_grace=0.3)
    tb.run("bash", {"command": "sleep 60", "background": True})
    job = tb.jobs.get("job_1")
    tb.close()
    assert not job.running


def test_job_buffer_is_bounded(ws: Path) -> None:
    jobs = JobManager(buffer_bytes=64 * 1024)
    job = jobs.start("head -c 3000000 /dev/zero | tr '\\0' 'x'; echo; echo END", ws)
    assert job.wait(10) == 0
    text = job.read_new().stdout
    assert len(text) < 70 * 1024
    assert re.search(r"\[… \d+ bytes of output dropped …\]", text)
    assert text.startswith("xxx") and text.rstrip().endswith("END")


# --- validation, unknown tools ------------------------------------------------


def _envelope(text: str) -> dict:
    headline, line, params = text.split("\n", 2)
    assert headline.startswith("error: ")
    return {"headline": headline, "params": params, **json.loads(line)}


def test_schema_errors_are_structured(tb: Toolbox) -> None:
    out = tb.run("read", {"path": 12, "limit": "ten", "colour": "red"})
    assert not out.ok and out.error == INVALID_ARGUMENTS
    env = _envelope(out.text)
    assert env["headline"] == "error: invalid arguments for read"
    assert env["status"] == "validation_error" and env["tool_name"] == "read"
    assert env["error_count"] == 3
    by_loc = {tuple(e["loc"]): e for e in env["errors"]}
    assert by_loc[("path",)]["message"] == "expected string, got integer 12"
    assert by_loc[("limit",)]["input_value"] == "ten"
    assert by_loc[("limit",)]["expected"] == "integer >= 1"
    assert by_loc[("colour",)]["error_type"] == "additionalProperties"
    assert "allowed fields: path, offset, limit" in by_loc[("colour",)]["message"]
    assert env["params"].startswith("read parameters: path (string, non-empty, required)")

    env = _envelope(tb.run("edit", {"path": "a"}).text)
    assert [(e["loc"], e["error_type"]) for e in env["errors"]] == [
        (["old"], "required"),
        (["new"], "required"),
    ]

    env = _envelope(tb.run("bash", {"command": "true", "timeout": -1}).text)
    assert env["errors"][0]["message"] == "expected a number > 0, got integer -1"

    env = _envelope(tb.run("write", ["a", "b"]).text)
    assert env["errors"] == [
        {
            "loc": [],
            "input_value": ["a", "b"],
            "error_type": "type",
            "message": "expected object, got array",
            "expected": "object",
        }
    ]

    env = _envelope(tb.run("read", {"path": ""}).text)
    assert env["errors"][0]["message"].startswith("expected a non-empty string")


def test_integral_floats_accepted_as_integers(tb: Toolbox, ws: Path) -> None:
    (ws / "f.txt").write_text("a\nb\nc\n")
    out = tb.run("read", {"path": "f.txt", "offset": 2.0, "limit": 1.0})
    assert out.ok and out.text.startswith("b\n")


def test_unknown_tool(tb: Toolbox) -> None:
    out = tb.run("grep", {"pattern": "x"})
    assert not out.ok and out.error == UNKNOWN_TOOL
    headline, line = out.text.split("\n")
    assert headline.startswith("error: unknown tool 'grep'.")
    assert "read, more, write, edit, list, search, bash, bash_status, bash_stop" in headline
    env = json.loads(line)
    assert env["status"] == "unknown_tool" and env["tool_name"] == "grep"
    assert env["available_tools"][0] == "read"
    out = tb.run("reed", {})
    assert "Did you mean 'read'?" in out.text and '"suggestion": "read"' in out.text


# --- shaping and more ----------------------------------------------------------


def test_truncation_keeps_head_and_tail_and_more_returns_the_rest(ws: Path) -> None:
    tb = Toolbox(ws, Permissions(yes=True), output_token_budget=300)
    out = tb.run("bash", {"command": "seq 1 5000"})
    assert out.ok and out.handle
    assert approx_tokens(out.text) <= 300
    lines = out.text.splitlines()
    assert lines[0] == "1"
    assert lines[-1].startswith("[exit code 0")
    assert lines[-2] == "5000"
    marker = next(ln for ln in lines if ln.startswith("[… "))
    m = re.match(
        r"\[… (\d+) lines \(\d+ chars\) cut: lines (\d+)–(\d+) of 5000; call more with handle=\"(out_\d+)\"",
        marker,
    )
    assert m, marker
    n_cut, first, last, handle = int(m[1]), int(m[2]), int(m[3]), m[4]
    assert handle == out.handle and last - first + 1 == n_cut
    head = [int(x) for x in lines[: lines.index(marker)]]
    assert head == list(range(1, first))

    got: list[str] = []
    for _ in range(200):
        chunk = tb.run("more", {"handle": handle})
        assert chunk.ok and approx_tokens(chunk.text) <= 300
        body = chunk.text.splitlines()
        assert body[-1].startswith("[")
        got.extend(body[:-1])
        if "end of the cut part" in body[-1]:
            break
    assert [int(x) for x in got] == list(range(first, last + 1))
    end = tb.run("more", {"handle": handle})
    assert end.ok and "end of the cut part" in end.text

    # Jump to a line and read on to the very end.
    chunk = tb.run("more", {"handle": handle, "line": 4990})
    assert chunk.text.splitlines()[:11] == [str(i) for i in range(4990, 5001)]
    assert "end of output" in chunk.text

    bad = tb.run("more", {"handle": "out_999"})
    assert not bad.ok and bad.error == NOT_FOUND and handle in bad.text
    assert not tb.run("more", {"handle": handle, "line": 9999}).ok


def test_read_of_big_file_is_shaped(ws: Path) -> None:
    tb = Toolbox(ws, Permissions(yes=True), output_token_budget=200)
    (ws / "big.txt").write_text("".join(f"row {i}\n" for i in range(1, 1001)))
    out = tb.run("read", {"path": "big.txt", "limit": 500})
    assert out.handle and out.text.startswith("row 1\n")
    assert out.text.endswith(
        "row 500\n[big.txt: lines 1–500 of 1000; call read with offset=501 for more]"
    )


def test_single_huge_line_is_cut_by_characters() -> None:
    store = OutputStore(100)
    text = "".join(chr(ord("a") + i % 26) for i in range(10_000))
    shaped = store.shape(text)
    assert shaped.handle and approx_tokens(shaped.text) <= 100
    assert shaped.text.startswith(text[:50]) and shaped.text.endswith(text[-50:])
    pieces = []
    while True:
        chunk = store.more(shaped.handle)
        body, footer = chunk.rsplit("\n[", 1)
        if body.startswith("[end"):
            break
        pieces.append(body)
        assert approx_tokens(chunk) <= 100
        if "end of the cut part" in footer:
            break
    head = shaped.text.split("\n[…")[0]
    tail = shaped.text.rsplit("]\n", 1)[1]
    assert head + "".join(pieces) + tail == text


def test_custom_token_counter_is_respected(ws: Path) -> None:
    def words(text: str) -> int:
        return len(text.split())

    tb = Toolbox(ws, Permissions(yes=True), output_token_budget=100, count_tokens=words)
    out = tb.run("bash", {"command": "seq 1 1000"})
    assert out.handle and words(out.text) <= 100
    assert out.text.startswith("1\n2\n") and "\n1000\n[exit code 0" in out.text


def test_small_outputs_are_untouched() -> None:
    store = OutputStore(100)
    assert store.shape("hello\n").text == "hello\n"
    assert store.shape("hello\n").handle is None
    with pytest.raises(ValueError):
        OutputStore(10)


def test_output_store_is_bounded() -> None:
    store = OutputStore(64, max_outputs=3)
    handles = [store.shape("x\n" * 1000).handle for _ in range(5)]
    assert store.handles == handles[2:]
    with pytest.raises(KeyError):
        store.more(handles[0])


def test_ctrl_c_stops_a_foreground_command(tb: Toolbox, ws: Path) -> None:
    import signal
    import threading

    # Python's own Ctrl+C handler, as in `ds4mlx agent`: a pytest-xdist worker ignores
    # SIGINT (its controller owns Ctrl+C), and the signal would never reach the tool.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        # Without the interrupt the command runs its 60 s and returns: no raise.
        with pytest.raises(KeyboardInterrupt):
            tb.run("bash", {"command": "sleep 60 & echo $! > child.pid; wait"})
        timer.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert _wait_dead(int((ws / "child.pid").read_text()))


def test_stop_escalates_to_sigkill(tb: Toolbox, ws: Path) -> None:
    out = tb.run(
        "bash",
        {
            "command": "trap '' TERM; echo ready; while true; do sleep 0.05; done",
            "background": True,
        },
    )
    # SIGTERM is ignored only once the trap is set: stop after "ready", not after a sleep.
    seen, deadline = "", time.monotonic() + 60
    while "ready" not in seen and time.monotonic() < deadline:
        seen += tb.run("bash_status", {"handle": out.job, "wait": 0.05}).text
    st = tb.run("bash_stop", {"handle": out.job})
    assert st.ok and "stopped by bash_stop" in st.text
    assert not tb.jobs.get(out.job).running


def test_write_refuses_non_regular_files(tb: Toolbox, ws: Path) -> None:
    os.mkfifo(ws / "pipe")
    out = tb.run("write", {"path": "pipe", "content": "x"})
    assert not out.ok and "not a regular file" in out.text
    assert not tb.run("read", {"path": "pipe"}).ok
    assert not tb.run("write", {"path": ".", "content": "x"}).ok


def test_describe(tb: Toolbox) -> None:
    assert tb.describe("read", {"path": "a.py", "offset": 3}) == "read path=a.py offset=3"
    text = tb.describe("write", {"path": "a", "content": "x\n" * 100})
    assert "⏎" in text and len(text) < 100


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("ab\n é"), max_size=3000),
    budget=st.integers(64, 200),
)
def test_shape_then_more_reconstructs_the_output(text: str, budget: int) -> None:
    store = OutputStore(budget)
    shaped = store.shape(text)
    assert approx_tokens(shaped.text) <= budget
    if shaped.handle is None:
        assert shaped.text == text
        return
    item = store._items[shaped.handle]  # where the cut is, to check the pieces
    head_end, tail_start = item.cursor, item.tail_start
    assert shaped.text.startswith(text[:head_end])
    assert shaped.text.endswith(text[tail_start:])
    assert 0 < tail_start - head_end
    pieces = []
    for _ in range(len(text) + 2):
        before = item.cursor
        chunk = store.more(shaped.handle)
        assert approx_tokens(chunk) <= budget
        if chunk.startswith("[end of the cut part"):
            break
        assert item.cursor > before  # always progresses
        piece = text[before : item.cursor]
        assert chunk.startswith(piece) and chunk[len(piece) :].lstrip("\n").startswith("[lines ")
        pieces.append(piece)
    assert "".join(pieces) == text[head_end:tail_start]


def test_bash_spec_states_the_real_default_timeout(ws: Path) -> None:
    tb = Toolbox(ws, Permissions(), bash_timeout=42)
    bash = next(s for s in tb.specs if s.name == "bash")
    assert "Foreground default: 42;" in bash.parameters["properties"]["timeout"]["description"]
    bash.parameters["properties"].clear()  # callers get copies
    assert tb.specs[6].parameters["properties"]


def test_names_that_are_not_utf8_reach_the_model_escaped(ws: Path) -> None:
    """A file name of non-UTF-8 bytes (a Latin-1 ``café``) made ``list`` and ``search``
    raise in the tokenizer (``os.listdir`` gives it lone surrogates), which stopped the
    turn: every result's text is valid Unicode, the bytes shown as ``\\xNN``, and a
    tool's MCP-style lone surrogate too."""
    from ds4mlx.agent.permissions import Permissions
    from ds4mlx.agent.tools import Toolbox
    from ds4mlx.tokenizer import Tokenizer

    tok = Tokenizer.load()
    (ws / "caf\udce9.txt").write_bytes(b"hello\n")
    with Toolbox(ws, Permissions(yes=True), count_tokens=lambda s: len(tok.encode_plain(s))) as box:
        for name, args in (("list", {"path": "."}), ("search", {"pattern": "hello"})):
            out = box.run(name, args)
            assert out.ok and "caf\\xe9.txt" in out.text, out.text
            out.text.encode("utf-8")  # no lone surrogate left
