"""Permission model: workspace confinement for every tool, ask/always/deny, --yes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ds4mlx.agent.permissions import (
    ASKING_TOOLS,
    PathOutsideWorkspace,
    Permissions,
    resolve_in_workspace,
)
from ds4mlx.agent.tools import PATH_OUTSIDE_WORKSPACE, PERMISSION_DENIED, Toolbox


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "inside.txt").write_text("hello\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("TOP SECRET\n")
    os.symlink(outside / "secret.txt", root / "link_file")
    os.symlink(outside, root / "link_dir")
    os.symlink(tmp_path / "outside" / "not_there.txt", root / "dangling")
    os.symlink(root / "inside.txt", root / "good_link")
    return root


class Recorder:
    """An ask callback that answers from a script and records what it was asked."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, str]] = []

    def __call__(self, tool: str, summary: str) -> str:
        self.calls.append((tool, summary))
        return self.answers.pop(0) if self.answers else "deny"


# --- path confinement --------------------------------------------------------


def test_resolve_inside(ws: Path) -> None:
    assert resolve_in_workspace(ws, "inside.txt") == ws / "inside.txt"
    assert resolve_in_workspace(ws, "a/../inside.txt") == ws / "inside.txt"
    assert resolve_in_workspace(ws, str(ws / "inside.txt")) == ws / "inside.txt"
    assert resolve_in_workspace(ws, "new/dir/file.py") == ws / "new/dir/file.py"
    assert resolve_in_workspace(ws, ".") == ws
    assert resolve_in_workspace(ws, "good_link") == ws / "inside.txt"


@pytest.mark.parametrize(
    "path",
    [
        "../outside/secret.txt",
        "sub/../../outside",
        "/etc/passwd",
        "link_file",
        "link_dir/secret.txt",
        "link_dir",
        "dangling",  # a write through it would create a file outside
        "~/x",
    ],
)
def test_resolve_refuses_escapes(ws: Path, path: str) -> None:
    with pytest.raises(PathOutsideWorkspace):
        resolve_in_workspace(ws, path)


def test_resolve_invalid_path(ws: Path) -> None:
    with pytest.raises(PathOutsideWorkspace, match="cannot resolve"):
        resolve_in_workspace(ws, "a\0b")


def test_workspace_given_through_symlink(tmp_path: Path, ws: Path) -> None:
    alias = tmp_path / "alias"
    os.symlink(ws, alias)
    assert resolve_in_workspace(alias, "inside.txt") == ws / "inside.txt"
    tb = Toolbox(alias, Permissions(yes=True))
    assert tb.run("read", {"path": "inside.txt"}).text == "hello\n"


@pytest.mark.parametrize(
    ("tool", "args"),
    [
        ("read", {"path": "../outside/secret.txt"}),
        ("read", {"path": "link_file"}),
        ("read", {"path": "link_dir/secret.txt"}),
        ("write", {"path": "/tmp/ds4mlx-escape.txt", "content": "x"}),
        ("write", {"path": "dangling", "content": "x"}),
        ("write", {"path": "link_dir/new.txt", "content": "x"}),
        ("edit", {"path": "link_file", "old": "TOP", "new": "BOTTOM"}),
        ("list", {"path": ".."}),
        ("list", {"path": "link_dir"}),
        ("search", {"pattern": "SECRET", "path": "../outside"}),
        ("search", {"pattern": "SECRET", "path": "link_dir"}),
    ],
)
def test_every_tool_refuses_escapes(ws: Path, tool: str, args: dict) -> None:
    # yes=True: confinement holds even when everything else is allowed.
    tb = Toolbox(ws, Permissions(yes=True))
    out = tb.run(tool, args)
    assert not out.ok
    assert out.error == PATH_OUTSIDE_WORKSPACE
    assert out.text.startswith("error: path ")
    assert "outside the workspace" in out.text
    assert "SECRET" not in out.text
    assert (ws.parent / "outside" / "secret.txt").read_text() == "TOP SECRET\n"
    assert not (ws.parent / "outside" / "not_there.txt").exists()
    assert not (ws.parent / "outside" / "new.txt").exists()


def test_walks_do_not_follow_symlinks_out(ws: Path) -> None:
    tb = Toolbox(ws, Permissions(yes=True))
    out = tb.run("search", {"pattern": "SEC.ET"})
    assert out.ok and "SECRET" not in out.text and "no matches" in out.text
    out = tb.run("search", {"pattern": "SEC.ET", "glob": "**/*"})
    assert "SECRET" not in out.text
    out = tb.run("search", {"pattern": "SEC.ET", "glob": "link_dir/*.txt"})
    assert "SECRET" not in out.text
    out = tb.run("list", {"depth": 5})
    assert "link_dir/secret.txt" not in out.text  # symlinked dir shown, not descended
    assert "link_dir -> " in out.text
    out = tb.run("list", {"glob": "link_dir/*"})
    assert "secret" not in out.text
    out = tb.run("list", {"glob": "../outside/*"})
    assert not out.ok and "must be relative" in out.text


# --- ask / always / deny -----------------------------------------------------


def test_reads_are_free_and_asking_tools_ask() -> None:
    rec = Recorder("once", "deny")
    perms = Permissions(rec)
    for tool in ("read", "list", "search", "more", "bash_status", "bash_stop"):
        assert perms.request(tool, "x")
    assert rec.calls == []
    assert perms.request("write", "write a.txt")
    assert not perms.request("write", "write a.txt")
    assert rec.calls == [("write", "write a.txt"), ("write", "write a.txt")]
    assert ASKING_TOOLS == {"write", "edit", "bash"}


def test_always_is_per_tool_and_per_session() -> None:
    rec = Recorder("always", "once")
    perms = Permissions(rec)
    assert perms.request("bash", "ls")
    assert perms.request("bash", "rm x")  # not asked again
    assert perms.always == {"bash"}
    assert not perms.needs_ask("bash") and perms.needs_ask("edit")
    assert perms.request("edit", "e")  # a different tool still asks
    assert [t for t, _ in rec.calls] == ["bash", "edit"]
    perms.reset()
    assert perms.needs_ask("bash")


def test_yes_allows_everything_and_no_callback_denies() -> None:
    assert Permissions(yes=True).request("bash", "rm -rf build")
    assert not Permissions().request("bash", "ls")
    assert Permissions().request("read", "x")
    assert not Permissions(lambda t, s: "sure").request("write", "x")  # unknown answer = deny


def test_denied_tools_have_no_effect(ws: Path) -> None:
    rec = Recorder()  # denies everything
    tb = Toolbox(ws, Permissions(rec))
    cases = [
        ("write", {"path": "new.txt", "content": "x"}),
        ("edit", {"path": "inside.txt", "old": "hello", "new": "bye"}),
        ("bash", {"command": "touch ran.txt"}),
        ("bash", {"command": "touch ran.txt", "background": True}),
    ]
    for tool, args in cases:
        out = tb.run(tool, args)
        assert not out.ok and out.error == PERMISSION_DENIED
        assert out.text.startswith("error: permission denied")
        assert "Do not retry" in out.text
        if tool == "bash":  # the model is told which command was refused
            assert "touch ran.txt" in out.text, out.text
    assert not (ws / "new.txt").exists()
    assert (ws / "inside.txt").read_text() == "hello\n"
    assert not (ws / "ran.txt").exists()
    assert tb.jobs.jobs == []
    # The user saw what each call would do.
    tools = [t for t, _ in rec.calls]
    assert tools == ["write", "edit", "bash", "bash"]
    assert "new.txt" in rec.calls[0][1]
    assert "-hello" in rec.calls[1][1] and "+bye" in rec.calls[1][1]  # a diff
    assert "touch ran.txt" in rec.calls[2][1]
    assert "background" in rec.calls[3][1]
    # Reads never asked.
    assert tb.run("read", {"path": "inside.txt"}).ok
    assert len(rec.calls) == 4
    long_cmd = "echo first\n" + "echo x; " * 100
    out = tb.run("bash", {"command": long_cmd})
    assert "foreground: echo first ⏎ echo x;" in out.text and "…" in out.text, out.text
    assert len(out.text) < 500


def test_failing_calls_do_not_ask(ws: Path) -> None:
    rec = Recorder("always")
    tb = Toolbox(ws, Permissions(rec))
    assert tb.run("edit", {"path": "inside.txt", "old": "absent", "new": "x"}).error == "not_found"
    assert tb.run("edit", {"path": "../x", "old": "a", "new": "b"}).error == PATH_OUTSIDE_WORKSPACE
    assert tb.run("write", {"path": 3}).error == "invalid_arguments"
    assert rec.calls == []


def test_always_answer_applies_to_later_calls(ws: Path) -> None:
    rec = Recorder("always")
    tb = Toolbox(ws, Permissions(rec))
    assert tb.run("write", {"path": "a.txt", "content": "1"}).ok
    assert tb.run("write", {"path": "b.txt", "content": "2"}).ok
    assert len(rec.calls) == 1
    assert tb.run("bash", {"command": "true"}).error == PERMISSION_DENIED  # asked, denied


def test_ask_exceptions_propagate(ws: Path) -> None:
    def ask(tool: str, summary: str) -> str:
        raise KeyboardInterrupt

    tb = Toolbox(ws, Permissions(ask))
    with pytest.raises(KeyboardInterrupt):
        tb.run("write", {"path": "a.txt", "content": "1"})
    assert not (ws / "a.txt").exists()


def test_ask_errors_propagate_unchanged(ws: Path) -> None:
    def ask(tool: str, summary: str) -> str:
        raise EOFError("stdin closed")

    tb = Toolbox(ws, Permissions(ask))
    with pytest.raises(EOFError, match="stdin closed"):
        tb.run("bash", {"command": "touch x"})
    assert not (ws / "x").exists()
