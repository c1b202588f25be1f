"""The agent's terminal UI with ``rich`` (docs/ARCHITECTURE.md §7).

:class:`RichUI` implements :class:`~ds4mlx.agent.loop.AgentUI`: thinking streams
dimmed, answer text plain, tool calls are shown as they form (name, then the JSON
arguments as they are sampled), tool results as a few lines under the call, a
transient progress bar during long prefills, a status line after each message
(context used, tokens/s, KV bytes), and permission questions (once / always / deny).

On a non-terminal console (``-p`` output piped to a file) rich drops colours and the
progress bar; the text is the transcript.

Nothing untrusted reaches the terminal raw: every piece of text is built with
:func:`_text`, which writes control characters as ``\\xNN`` escapes (shown in reverse
video, :mod:`ds4mlx.sanitize`), and :class:`SafeConsole` escapes whatever still
holds one at the last step before output, where only rich's own styling and cursor
codes remain raw. A permission question whose text holds control characters says so
in red.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType
from rich.control import Control, ControlType
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from ds4mlx.agent.loop import AgentUI, CompactionInfo, Status, Step, describe_messages
from ds4mlx.agent.sessions import SessionRecord
from ds4mlx.agent.tools import ToolOutcome
from ds4mlx.dsml import (
    Event,
    ParseError,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from ds4mlx.sanitize import escape_controls, has_controls, split_controls

# Prefills shorter than this finish before a bar would be readable.
PROGRESS_MIN_TOKENS = 256
RESULT_PREVIEW_LINES = 6

_ANSWERS = {
    "o": "once",
    "once": "once",
    "y": "once",
    "yes": "once",
    "a": "always",
    "always": "always",
    "d": "deny",
    "deny": "deny",
    "n": "deny",
    "no": "deny",
}


ESCAPE_STYLE = "reverse"
CONTROL_WARNING = (
    "⚠ contains control characters (shown as \\xNN / \\uNNNN escapes, in reverse video)"
)


# A request taller than this many lines is named again in the question below it, which
# says how many lines it has: its start may have scrolled off the screen.
ASK_LINES = 20
MARKER_STYLE = "dim italic"


def _request_text(summary: str) -> tuple[Text, int]:
    """The permission box's body for ``summary`` (a command, a diff) and its line count.

    Runs of two or more blank (whitespace-only) lines collapse into one marker line
    ("⋯ N blank lines ⋯"): a command padded with newlines can no longer push its
    first lines, the dangerous ones, off the screen above the question. Every other
    line is shown, escaped (`_text`)."""
    lines = summary.split("\n")
    out = Text()
    i = 0
    while i < len(lines):
        j = i
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j - i >= 2:
            out.append(f"⋯ {j - i} blank lines ⋯", MARKER_STYLE)
            i = j
        else:
            out.append_text(_text(lines[i]))
            i += 1
        if i < len(lines):
            out.append("\n")
    return out, len(lines)


def _text(text: str, style: str | None = None) -> Text:
    """A rich ``Text`` of untrusted ``text``: control characters as styled escapes."""
    out = Text(style=style or "")
    for piece, escaped in split_controls(text):
        out.append(piece, ESCAPE_STYLE if escaped else None)
    return out


def _typed() -> str:
    """What the user typed so far at ``input()``'s prompt (readline's buffer; "" when
    readline is not in use)."""
    rl = sys.modules.get("readline")
    try:
        return rl.get_line_buffer() if rl is not None else ""
    except Exception:  # an editline build without it
        return ""


class SafeConsole(Console):
    """A rich ``Console`` whose printed text never carries a raw control character.

    Every text segment rendered for output passes through
    :func:`~ds4mlx.sanitize.escape_controls`; only rich's own control segments
    (cursor moves of the progress bar) and the styles it renders pass raw. This is the
    last step before the terminal, so a renderable built from a plain ``str`` (a table
    cell, a rule title, an error message) cannot bypass the sanitizer; text built with
    :func:`_text` is escaped before layout, so its width is right.
    """

    def print(self, *objects: Any, markup: bool | None = None, **kwargs: Any) -> None:
        """rich's ``print``, with every plain ``str`` taken as text (`_text`: escaped,
        no markup) unless the caller asks for markup (``markup=True``, for its own
        escaped text): an error message quoting a file (``[link=…]`` in an MCP server
        name) cannot become a hyperlink or a style, and a control that rich would drop
        before `render` (BEL, backspace) still shows as its escape."""
        if markup is not True:
            objects = tuple(_text(o) if isinstance(o, str) else o for o in objects)
        super().print(*objects, markup=markup, **kwargs)

    def render(
        self, renderable: RenderableType, options: ConsoleOptions | None = None
    ) -> Iterable[Segment]:
        for seg in super().render(renderable, options):
            if seg.control is None and has_controls(seg.text):
                yield Segment(escape_controls(seg.text), seg.style)
            else:
                yield seg


class RichUI(AgentUI):
    """The agent UI on a ``rich`` console.

    Args:
        console: where everything is written (default: stdout); a :class:`SafeConsole`.
        can_ask: permission questions may be asked (a terminal is attached); when
            False, asking tools are denied with a notice (use ``--yes``).
        show_thinking: stream the reasoning (dimmed); when False only a marker shows.
    """

    def __init__(
        self,
        console: SafeConsole | None = None,
        *,
        can_ask: bool = True,
        show_thinking: bool = True,
    ) -> None:
        if console is not None and not isinstance(console, SafeConsole):
            raise TypeError("RichUI needs a SafeConsole (a plain Console prints controls raw)")
        self.console = console or SafeConsole(highlight=False)
        self.can_ask = can_ask
        self.show_thinking = show_thinking
        self._progress: Progress | None = None
        self._task = None
        self._mode: str | None = None
        self._line_start = True
        self._pending_call_end = False
        self._prompt_lock = threading.Lock()
        self._prompt: str | None = None  # shown while read_line waits
        # The steering key reader (`ds4mlx.agent.steer.KeyReader`) while a turn runs.
        self.keys = None

    # ---- plain output helpers

    def _out(self, text: str, style: str | None = None) -> None:
        if not text:
            return
        self.console.print(_text(text, style), end="", soft_wrap=True, highlight=False)
        self._line_start = text.endswith("\n")

    def _newline(self) -> None:
        if not self._line_start:
            self.console.print()
            self._line_start = True

    def line(self, text: str, style: str | None = None) -> None:
        """Print one line of plain (unmarked-up) text."""
        self._newline()
        self.console.print(_text(text, style), soft_wrap=True)
        self._line_start = True

    # ---- AgentUI

    def ask(self, tool: str, summary: str) -> str:
        self.prefill_done()
        self._newline()
        if not self.can_ask:
            self.line(f"{tool} denied: no terminal to ask (start with --yes to allow)", "yellow")
            return "deny"
        body, n_lines = _request_text(summary)
        if has_controls(summary):
            # A command or path that hides text from the terminal (a cursor move over the
            # panel, a line erase) is shown escaped; say why it looks odd.
            body = Text.assemble(Text(CONTROL_WARNING, "bold red"), "\n", body)
        self.console.print(
            Panel(body, title=f"allow {tool}?", title_align="left", border_style="yellow")
        )
        # "always" is the tool's until /new, not this request's (it read as the latter).
        answers = f"[o]nce / [a]lways ({escape_controls(tool)}, this session) / [d]eny › "
        question = "allow? " + answers
        if body.plain.count("\n") + 1 > ASK_LINES:
            question = (
                f"allow {escape_controls(tool)} (the {n_lines} lines above: read them from "
                f"the box's top)? {answers}"
            )
        while True:
            try:
                ans = self._answer(question)
            except EOFError:
                return "deny"
            decision = _ANSWERS.get(ans.strip().lower())
            if decision is not None:
                return decision

    def ask_input(self, command: str, prompt: str, hidden: bool = False) -> str | None:
        """A foreground command waits for input: show what it printed last (escaped)
        and read the answer: a line answers it, Ctrl+D (EOF) sends end of file, Ctrl+C
        (KeyboardInterrupt, raised by the agent's handler while tools run) stops it.
        ``hidden``: the command turned its terminal's echo off (a password): what is
        typed is not shown either."""
        self.prefill_done()
        self._newline()
        tail = prompt.rsplit("\n", 1)[-1] if prompt.strip() else ""
        self.line(
            "the command waits for input: type a line to answer it, Ctrl+D for end of "
            "file, Ctrl+C to stop it",
            "yellow",
        )
        try:
            return self._answer(escape_controls(tail) or "input › ", hidden=hidden)
        except EOFError:
            self.console.print()
            return None

    def _answer(self, prompt: str, hidden: bool = False) -> str:
        """A line answering a question on screen: from the steering key reader while a
        turn runs (the next line typed, never one queued before), else ``input()``.
        ``hidden``: not echoed (a password)."""
        if self.keys is None:
            return self.console.input(Text(prompt), markup=False, password=hidden)

        def show() -> None:
            self.console.print(Text(prompt), end="")
            self.console.file.flush()

        return self.keys.read_line(show, hidden=hidden)

    def prefill_progress(self, done: int, total: int) -> None:
        if total < PROGRESS_MIN_TOKENS or not self.console.is_interactive:
            return
        if self._progress is None:
            self._newline()
            self._progress = Progress(
                TextColumn("[dim]prefill"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} tokens"),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task("prefill", total=total)
        self._progress.update(self._task, completed=done, total=total)

    def prefill_done(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            self._task = None

    def turn_start(self, kind: str) -> None:
        self._mode = None
        if kind == "summary":
            self.line("summarizing the conversation for compaction…", "yellow")

    def event(self, ev: Event) -> None:
        if isinstance(ev, ThinkingDelta):
            if self._mode != "think":
                self._newline()
                self._mode = "think"
                if not self.show_thinking:
                    self._out("thinking…", "dim italic")
            if self.show_thinking:
                self._out(ev.text, "dim italic")
        elif isinstance(ev, TextDelta):
            if self._mode == "think":
                self._newline()
                self.console.print()
            self._mode = "text"
            self._out(ev.text)
        elif isinstance(ev, ToolCallStart):
            self._newline()
            self._mode = "call"
            self._out(f"⏺ {ev.name} ", "bold cyan")
        elif isinstance(ev, ToolCallArgsDelta):
            self._out(ev.text, "cyan")
        elif isinstance(ev, ToolCallEnd):
            if ev.error:
                self._out(f"  (malformed: {ev.error})", "yellow")
            self._newline()
        elif isinstance(ev, ParseError):
            self.line(f"[parse] {ev.message}", "yellow")

    def turn_end(self, step: Step) -> None:
        self._newline()
        if step.stop == "length":
            self.line("(turn token limit reached)", "yellow")
        elif step.stop == "context":
            self.line("(context full)", "yellow")

    def tool_start(self, call: ToolCall, description: str) -> None:
        pass  # the call was shown while it formed

    def tool_result(self, call: ToolCall, outcome: ToolOutcome) -> None:
        lines = outcome.text.splitlines() or [""]
        shown = lines[:RESULT_PREVIEW_LINES]
        if len(lines) > RESULT_PREVIEW_LINES:
            shown.append(f"… ({len(lines) - RESULT_PREVIEW_LINES} more lines)")
        style = "dim" if outcome.ok else "red"
        mark = "⎿ " if outcome.ok else "⎿ ✗ "
        self._newline()
        for i, ln in enumerate(shown):
            self.line(("  " + mark if i == 0 else "    ") + ln, style)

    def notice(self, text: str, level: str = "info") -> None:
        style = {"info": "dim", "warn": "yellow", "error": "bold red"}.get(level, "dim")
        self.line(text, style)

    def compaction(self, info: CompactionInfo) -> None:
        if info.phase == "start":
            self._newline()
            self.console.rule(
                f"[yellow]compacting context ({info.reason}: {info.before} tokens)", style="yellow"
            )
            return
        self.line(compaction_line(info), "yellow")

    def status(self, status: Status) -> None:
        self._newline()
        self.line(status_line(status), "dim")

    # ---- REPL helpers

    def read_line(self, prompt: str = "› ", guard=None) -> str:
        """One line from the user (``EOFError`` on Ctrl+D, ``KeyboardInterrupt`` on Ctrl+C).

        ``guard``: a context manager entered around the blocking read only, after the
        prompt is printed (the agent's SIGINT handler raises only inside it, so a Ctrl+C
        never lands inside rich's rendering).
        """
        self.prefill_done()
        with self._prompt_lock:
            self._newline()
            self.console.print(f"[bold green]{escape(prompt)}[/]", end="", markup=True)
            self.console.file.flush()
            self._prompt = prompt
        try:
            with guard if guard is not None else contextlib.nullcontext():
                return input()
        finally:
            with self._prompt_lock:
                self._prompt = None

    def interject(self, text: str, level: str = "info") -> None:
        """Show a notice while :meth:`read_line` waits (from another thread): the line
        is written over the prompt, then the prompt and what was typed so far again."""
        with self._prompt_lock:
            if self._prompt is None:
                self.notice(text, level)
                return
            self.console.control(Control.move_to_column(0), Control((ControlType.ERASE_IN_LINE, 2)))
            self._line_start = True
            self.notice(text, level)
            self.console.print(f"[bold green]{escape(self._prompt)}[/]", end="", markup=True)
            self.console.print(_text(_typed()), end="", soft_wrap=True)
            self.console.file.flush()

    def show_sessions(self, records: list[SessionRecord], current: int | None) -> None:
        if not records:
            self.line("no sessions yet", "dim")
            return
        self.console.print(sessions_table(records, current))

    def show_history(self, messages) -> None:
        rows = history_rows(messages)
        for text, style in rows:
            self.line(text, style)
        if not rows:
            self.line("(no messages yet)", "dim")


def status_line(status: Status) -> str:
    """The status line after a turn: context used, prefill and decode speed, KV bytes."""
    pct = 100.0 * status.used / status.ctx if status.ctx else 0.0
    parts = [f"ctx {status.used}/{status.ctx} ({pct:.0f}%)"]
    if status.prefilled:
        parts.append(f"prefill {status.prefilled} tok ({status.prefill_tok_s:.0f} tok/s)")
    if status.generated:
        parts.append(f"gen {status.generated} tok ({status.tok_s:.1f} tok/s)")
    parts.append(f"KV {status.kv_bytes / 2**20:.1f} MiB")
    if status.session is not None:
        parts.append(f"session {status.session}")
    parts.append("thinking" if status.thinking else "no thinking")
    return " · ".join(parts)


def compaction_line(info: CompactionInfo) -> str:
    """What a finished compaction did, in one line."""
    how = "model" if info.by_model else "mechanical"
    return (
        f"compacted: {info.dropped} messages replaced by a {how} summary "
        f"({len(info.summary)} chars), {info.kept} kept verbatim; "
        f"{info.before} → {info.after} tokens"
    )


def sessions_table(records: list[SessionRecord], current: int | None) -> Table:
    """``/list``: one row per saved session, the current one starred."""
    table = Table(box=None, show_header=True, header_style="bold", pad_edge=False)
    for col in ("", "#", "title", "messages", "snapshot", "updated"):
        table.add_column(col)
    for r in records:
        snap = f"{r.kv_tokens} tokens" if r.kv_key else "-"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.updated))
        table.add_row(
            "*" if r.id == current else "",
            str(r.id),
            _text(r.title or "(empty)"),
            str(sum(1 for m in r.messages if m.role != "system")),
            snap,
            when,
        )
    return table


_HISTORY_STYLES = {
    "thinking": "dim italic",
    "tool call": "cyan",
    "tool result": "dim",
    "user": "bold green",
}


def history_rows(messages) -> list[tuple[str, str]]:
    """``/history``: ``(line, style)`` per message part, long texts cut at 600 chars."""
    rows = []
    for label, text in describe_messages(messages):
        body = text if len(text) <= 600 else text[:600] + f"… ({len(text)} chars)"
        rows.append((f"[{label}] {body}", _HISTORY_STYLES.get(label, "")))
    return rows
