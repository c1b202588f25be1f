"""The file tools never lose a user's bytes: a change made while permission is asked,
a non-UTF-8 file, CRLF line endings, a repeated edit of unknown outcome, a write that
fails half-way; and ``search`` in a real repository (.gitignore, a pattern that
backtracks without end)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ds4mlx.agent.permissions import Permissions
from ds4mlx.agent.tools import Toolbox
from ds4mlx.agent.tools import search as search_mod

# --- a change made while the permission prompt is open ------------------------


@pytest.mark.parametrize(
    "tool, args",
    [
        ("edit", {"path": "f.txt", "old": "beta", "new": "BETA"}),
        ("write", {"path": "f.txt", "content": "new text\n"}),
        ("write", {"path": "g.txt", "content": "new file\n"}),
    ],
)
def test_a_file_saved_while_permission_is_asked_is_never_overwritten(
    ws: Path, tool: str, args: dict
) -> None:
    f = ws / "f.txt"
    f.write_text("alpha\nbeta\ngamma\n")
    target = ws / args["path"]

    def ask(name: str, summary: str) -> str:
        # The user's editor saves the file while the question is on screen.
        target.write_text("alpha\nbeta\ngamma\nUSER-SAVED-THIS\n")
        return "once"

    with Toolbox(ws, Permissions(ask=ask), kill_grace=0.3, bash_timeout=10) as box:
        out = box.run(tool, args)
    assert not out.ok and "changed on disk" in out.text and "nothing was written" in out.text
    assert target.read_text() == "alpha\nbeta\ngamma\nUSER-SAVED-THIS\n"


# --- encodings and line endings -------------------------------------------------


def test_a_non_utf8_file_is_flagged_on_read_and_never_rewritten_with_u_fffd(
    tb: Toolbox, ws: Path
) -> None:
    f = ws / "lat.txt"
    f.write_bytes(b"caf\xe9 cr\xe8me\nplain\n")
    out = tb.run("read", {"path": "lat.txt"})
    assert out.ok and "caf\ufffd cr\ufffdme\nplain\n" in out.text
    assert "lat.txt is not valid UTF-8" in out.text and "bash" in out.text
    # Writing back what read showed would destroy the two bytes.
    out = tb.run("write", {"path": "lat.txt", "content": "caf\ufffd cr\ufffdme\nplain\n"})
    assert not out.ok and "U+FFFD" in out.text
    assert f.read_bytes() == b"caf\xe9 cr\xe8me\nplain\n"
    # New text without U+FFFD may replace it (converting the file is the user's choice).
    asked: list[str] = []
    perms = Permissions(ask=lambda tool, summary: asked.append(summary) or "once")
    with Toolbox(ws, perms, kill_grace=0.3, bash_timeout=10) as box:
        assert box.run("write", {"path": "lat.txt", "content": "café\n"}).ok
    assert "not UTF-8 text" in asked[0]
    assert f.read_bytes() == "café\n".encode()


def test_an_edit_in_a_crlf_file_keeps_crlf_in_every_new_line(tb: Toolbox, ws: Path) -> None:
    f = ws / "crlf.txt"
    f.write_bytes(b"line1\r\nline2\r\nline3\r\n")
    assert tb.run("edit", {"path": "crlf.txt", "old": "line2", "new": "line2\nadded"}).ok
    assert f.read_bytes() == b"line1\r\nline2\r\nadded\r\nline3\r\n"
    # A file of mixed endings is left to what the model wrote.
    m = ws / "mixed.txt"
    m.write_bytes(b"a\r\nb\nc\n")
    assert tb.run("edit", {"path": "mixed.txt", "old": "b", "new": "b\nx"}).ok
    assert m.read_bytes() == b"a\r\nb\nx\nc\n"


def test_overwriting_a_crlf_file_keeps_crlf_and_shows_the_real_diff(ws: Path) -> None:
    f = ws / "w.txt"
    f.write_bytes(b"one\r\ntwo\r\n")
    asked: list[str] = []
    perms = Permissions(ask=lambda tool, summary: asked.append(summary) or "once")
    with Toolbox(ws, perms, kill_grace=0.3, bash_timeout=10) as box:
        assert box.run("write", {"path": "w.txt", "content": "one\nthree\n"}).ok
    assert f.read_bytes() == b"one\r\nthree\r\n"
    diff = asked[0]
    assert "-two" in diff and "+three" in diff and "-one" not in diff


# --- repeats of unknown outcome -------------------------------------------------


def test_an_edit_that_keeps_old_inside_new_is_seen_as_applied(tb: Toolbox, ws: Path) -> None:
    f = ws / "m.py"
    f.write_text("import os\n\nprint(os.name)\n")
    args = {"path": "m.py", "old": "import os\n", "new": "import os\nimport sys\n"}
    assert tb.already_applied("edit", args) is None  # not applied yet: run it
    assert tb.run("edit", args).ok
    again = tb.already_applied("edit", args)
    assert again is not None and again.ok and "already applied" in again.text
    assert f.read_text() == "import os\nimport sys\n\nprint(os.name)\n"
    # An old left outside any new means not applied (here: a second place).
    f.write_text("import os\nimport sys\n\nimport os\n")
    assert tb.already_applied("edit", args) is None


# --- a write that fails half-way --------------------------------------------------


def test_a_write_that_fails_half_way_leaves_the_old_file_whole(ws: Path) -> None:
    f = ws / "big.txt"
    old = "".join(f"line {i}\n" for i in range(3000))  # ~30 KB
    f.write_text(old)
    f.chmod(0o640)
    # A file size limit stands in for a full disk: the grown file cannot be written.
    script = textwrap.dedent(
        f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (40000, 40000))
        from pathlib import Path
        from ds4mlx.agent.permissions import Permissions
        from ds4mlx.agent.tools import Toolbox
        with Toolbox(Path({str(ws)!r}), Permissions(yes=True)) as box:
            out = box.run("edit", {{"path": "big.txt", "old": "line 0\\n",
                                    "new": "line 0\\n" + "x" * 40000 + "\\n"}})
            print(out.ok, out.text)
            out = box.run("write", {{"path": "big.txt", "content": "y" * 50000}})
            print(out.ok, out.text)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and len(lines) == 2, run.stdout + run.stderr
    assert all(line.startswith("False") for line in lines), lines
    assert f.read_text() == old and (f.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in ws.iterdir()) == ["big.txt"]  # no temp file left


def test_an_edit_keeps_the_mode_and_a_symlink(tb: Toolbox, ws: Path) -> None:
    f = ws / "run.sh"
    f.write_text("echo a\n")
    f.chmod(0o755)
    (ws / "link.sh").symlink_to("run.sh")
    assert tb.run("edit", {"path": "link.sh", "old": "echo a", "new": "echo b"}).ok
    assert (ws / "link.sh").is_symlink() and f.read_text() == "echo b\n"
    assert (f.stat().st_mode & 0o777) == 0o755


def test_write_names_the_directory_problem(tb: Toolbox, ws: Path) -> None:
    out = tb.run("write", {"path": "newdir/", "content": "x"})
    assert not out.ok and "names a directory" in out.text
    assert not (ws / "newdir").exists()
    (ws / "real.txt").write_text("r\n")
    out = tb.run("write", {"path": "real.txt/c.txt", "content": "x"})
    assert not out.ok and "real.txt is not a directory" in out.text


def test_an_ambiguous_edit_names_the_first_lines_of_many_matches(tb: Toolbox, ws: Path) -> None:
    (ws / "many.txt").write_text("foo\nbar\n" * 5000)
    out = tb.run("edit", {"path": "many.txt", "old": "foo", "new": "baz"})
    assert not out.ok and "occurs 5000 times" in out.text
    assert "lines 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, …" in out.text


# --- search in a real repository -----------------------------------------------


def test_search_skips_what_gitignore_ignores(tb: Toolbox, ws: Path) -> None:
    (ws / ".gitignore").write_text("node_modules/\n*.log\n!keep.log\n")
    (ws / "src").mkdir()
    (ws / "src/a.py").write_text("# TODO real\n")
    (ws / "src/.gitignore").write_text("gen_*.py\n")
    (ws / "src/gen_x.py").write_text("# TODO generated\n")
    (ws / "node_modules/pkg").mkdir(parents=True)
    for i in range(300):
        (ws / f"node_modules/pkg/f{i}.js").write_text("// TODO vendored\n")
    (ws / "debug.log").write_text("TODO log\n")
    (ws / "keep.log").write_text("TODO kept\n")
    out = tb.run("search", {"pattern": "TODO"})
    assert out.ok
    assert out.text.splitlines()[:2] == ["keep.log:1: TODO kept", "src/a.py:1: # TODO real"]
    assert "vendored" not in out.text and "generated" not in out.text and "TODO log" not in out.text
    assert "3 paths .gitignore ignores (include_ignored=true)" in out.text
    every = tb.run("search", {"pattern": "TODO", "include_ignored": True, "max_results": 1000})
    assert "generated" in every.text and "TODO log" in every.text
    assert every.text.count("vendored") == 300
    # A glob walks the same rules; an ignored directory named as path is searched whole.
    globbed = tb.run("search", {"pattern": "TODO", "glob": "*.py"})
    assert "src/a.py" in globbed.text and "gen_x" not in globbed.text
    named = tb.run("search", {"pattern": "TODO", "path": "node_modules", "max_results": 1000})
    assert named.text.count("vendored") == 300


def test_a_file_name_cannot_forge_a_search_hit(tb: Toolbox, ws: Path) -> None:
    (ws / "evil\nfake.py:99: injected line").write_text("zzz\n")
    out = tb.run("search", {"pattern": "zzz"})
    assert out.text.splitlines()[0] == "evil\\nfake.py:99: injected line:1: zzz"
    assert "\nfake.py" not in out.text


def test_a_pattern_that_backtracks_without_end_stops_the_search(
    tb: Toolbox, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(search_mod, "SEARCH_TIME_S", 0.5)
    (ws / "a.txt").write_text("a match\n")
    (ws / "b.txt").write_text("a" * 60 + "!\n")
    out = tb.run("search", {"pattern": "(a|aa)+$|match"})
    assert out.ok and "a.txt:1: a match" in out.text
    assert "stopped after the 0.5 s limit" in out.text


@pytest.mark.parametrize(
    "tool, args",
    [
        ("edit", {"path": "sub/conf.txt", "old": "a=1", "new": "a=2"}),
        ("write", {"path": "sub/conf.txt", "content": "a=3\n"}),
        ("write", {"path": "sub/new.txt", "content": "new\n"}),
    ],
)
def test_a_directory_swapped_for_a_symlink_while_asked_is_never_written_through(
    ws: Path, tmp_path: Path, tool: str, args: dict
) -> None:
    """The path was checked inside the workspace when the change was proposed; if a
    directory on it becomes a symlink out of the workspace while the question is open,
    the change is refused, not written outside."""
    (ws / "sub").mkdir()
    (ws / "sub/conf.txt").write_text("a=1\n")
    outside = tmp_path / "home"
    outside.mkdir()
    (outside / "conf.txt").write_text("a=1\n")

    def ask(name: str, summary: str) -> str:
        (ws / "sub").rename(ws / "sub.moved")
        (ws / "sub").symlink_to(outside)
        return "once"

    with Toolbox(ws, Permissions(ask=ask), kill_grace=0.3, bash_timeout=10) as box:
        out = box.run(tool, args)
    assert not out.ok and "a directory on its path was moved or replaced" in out.text
    assert "nothing was written" in out.text
    assert (outside / "conf.txt").read_text() == "a=1\n"
    assert sorted(p.name for p in outside.iterdir()) == ["conf.txt"]
    assert (ws / "sub.moved/conf.txt").read_text() == "a=1\n"


@pytest.mark.parametrize("encoding, bom", [("utf-16-le", b"\xff\xfe"), ("utf-16-be", b"\xfe\xff")])
def test_utf16_files_are_text_and_keep_their_encoding(
    tb: Toolbox, ws: Path, encoding: str, bom: bytes
) -> None:
    """A Windows file in UTF-16 (PowerShell writes them) is read, searched, edited and
    overwritten as text, in its own encoding, byte-order mark and CRLF line endings."""
    f = ws / "setup.ps1"
    f.write_bytes(bom + "Write-Host 'héllo'\r\n$port = 8080\r\n".encode(encoding))
    read = tb.run("read", {"path": "setup.ps1"})
    assert read.ok and "Write-Host 'héllo'\r\n$port = 8080\r\n" in read.text
    assert "binary" not in read.text and "is UTF-16 text" in read.text
    hit = tb.run("search", {"pattern": r"\$port"})
    assert "setup.ps1:2: $port = 8080" in hit.text
    assert tb.run("edit", {"path": "setup.ps1", "old": "8080", "new": "9090"}).ok
    assert f.read_bytes() == bom + "Write-Host 'héllo'\r\n$port = 9090\r\n".encode(encoding)
    # The model's content drops the invisible mark and writes LF: both are the file's again.
    assert tb.run("write", {"path": "setup.ps1", "content": "$port = 1\n$host = 'x'\n"}).ok
    assert f.read_bytes() == bom + "$port = 1\r\n$host = 'x'\r\n".encode(encoding)
    again = tb.run("edit", {"path": "setup.ps1", "old": "$port = 2", "new": "$port = 1"})
    assert not again.ok  # old is not in the file: a normal not-found, not "binary"
    assert "not found" in again.text


def test_a_utf32_file_stays_binary(tb: Toolbox, ws: Path) -> None:
    (ws / "w.txt").write_bytes("hi\n".encode("utf-32"))
    out = tb.run("read", {"path": "w.txt"})
    assert not out.ok and "binary file" in out.text


def test_a_hit_deep_in_a_long_line_is_shown_around_the_match(tb: Toolbox, ws: Path) -> None:
    width = search_mod.MAX_MATCH_LINE_CHARS
    (ws / "app.min.js").write_text("x=1;" * 2000 + "apiKeyLookup();" + "y=2;" * 2000 + "\n")
    (ws / "short.js").write_text("apiKeyLookup();\n")
    out = tb.run("search", {"pattern": "apiKeyLookup"})
    long_hit, short_hit = out.text.splitlines()[:2]
    prefix, shown = long_hit.split(": ", 1)
    assert prefix == "app.min.js:1" and "apiKeyLookup();" in shown
    assert shown.startswith("…") and shown.endswith("…")
    assert shown.index("apiKeyLookup") == 1 + width // 4  # a little context before it
    assert len(shown) == width + 2
    assert short_hit == "short.js:1: apiKeyLookup();"
    # A hit near either end of a long line is shown from that end.
    (ws / "app.min.js").write_text("apiKeyLookup();" + "y=2;" * 2000 + "\n")
    assert tb.run("search", {"pattern": "apiKey", "path": "app.min.js"}).text.startswith(
        "app.min.js:1: apiKeyLookup();y=2;"
    )


def test_dropping_the_final_newline_shows_in_the_diff(ws: Path) -> None:
    (ws / "n.txt").write_text("a\nb\n")
    asked: list[str] = []
    perms = Permissions(ask=lambda tool, summary: asked.append(summary) or "once")
    with Toolbox(ws, perms, kill_grace=0.3, bash_timeout=10) as box:
        assert box.run("write", {"path": "n.txt", "content": "a\nb"}).ok
    assert "-b\n+b\n\\ No newline at end of file" in asked[0]
    assert (ws / "n.txt").read_bytes() == b"a\nb"
