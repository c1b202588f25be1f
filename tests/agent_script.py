"""Helpers for the agent tests: scripted DSML turns and a recording UI.

Scripted decoding (``serve --enable-scripted-decoding``): the engine still runs the forward pass for every
scripted token, so the KV state and token counts the tests measure are real.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ds4mlx.agent.loop import AgentUI, CompactionInfo, Status, Step
from ds4mlx.dsml import ToolCallEnd, ToolCallStart

EOS = "<｜end▁of▁sentence｜>"


def invoke(name: str, **params: Any) -> str:
    """One DSML invoke block; str values as ``string="true"``, others as JSON."""
    lines = [f'<｜DSML｜invoke name="{name}">']
    for k, v in params.items():
        if isinstance(v, str):
            lines.append(f'<｜DSML｜parameter name="{k}" string="true">{v}</｜DSML｜parameter>')
        else:
            lines.append(
                f'<｜DSML｜parameter name="{k}" string="false">{json.dumps(v)}</｜DSML｜parameter>'
            )
    lines.append("</｜DSML｜invoke>")
    return "\n".join(lines)


def turn(thinking: str | None, text: str, *calls: str) -> str:
    """A scripted assistant turn: ``thinking</think>text`` + tool calls + EOS.

    ``thinking=None`` is a chat-mode turn (no ``</think>``; compaction summaries).
    """
    out = "" if thinking is None else f"{thinking}</think>"
    out += text
    if calls:
        out += "\n\n<｜DSML｜tool_calls>\n" + "\n".join(calls) + "\n</｜DSML｜tool_calls>"
    return out + EOS


class RecordingUI(AgentUI):
    """Records what the loop reports; answers permission questions from ``answers``.

    ``answers``: tool name -> "once" | "always" | "deny" (default "deny").
    ``on_thinking``: called with the count of thinking deltas so far (to interrupt).
    ``on_prefill``: called as ``(done, total)`` (to interrupt a prefill).
    """

    def __init__(self, answers: dict[str, str] | None = None) -> None:
        self.answers = answers or {}
        self.asked: list[tuple[str, str]] = []
        self.events: list[Any] = []
        self.results: list[tuple[str, Any]] = []
        self.notices: list[tuple[str, str]] = []
        self.compactions: list[CompactionInfo] = []
        self.statuses: list[Status] = []
        self.turns: list[Step] = []
        self.thinking_deltas = 0
        self.on_thinking = None
        self.on_prefill = None

    def ask(self, tool: str, summary: str) -> str:
        self.asked.append((tool, summary))
        return self.answers.get(tool, "deny")

    def prefill_progress(self, done: int, total: int) -> None:
        if self.on_prefill is not None:
            self.on_prefill(done, total)

    def event(self, ev) -> None:
        self.events.append(ev)
        if type(ev).__name__ == "ThinkingDelta":
            self.thinking_deltas += 1
            if self.on_thinking is not None:
                self.on_thinking(self.thinking_deltas)

    def turn_end(self, step: Step) -> None:
        self.turns.append(step)

    def tool_result(self, call, outcome) -> None:
        self.results.append((call.name, outcome))

    def notice(self, text: str, level: str = "info") -> None:
        self.notices.append((level, text))

    def compaction(self, info: CompactionInfo) -> None:
        self.compactions.append(info)

    def status(self, status: Status) -> None:
        self.statuses.append(status)

    @property
    def calls_seen(self) -> list[str]:
        return [e.name for e in self.events if isinstance(e, ToolCallStart)]

    @property
    def calls_ended(self) -> list[ToolCallEnd]:
        return [e for e in self.events if isinstance(e, ToolCallEnd)]


def agent_env(columns: int = 120, **extra: str) -> dict[str, str]:
    """The environment of an agent subprocess under test: plain text (no colours to match
    through), a fixed terminal size, unbuffered output; ``extra`` added."""
    env = dict(os.environ)
    env.update(NO_COLOR="1", TERM="xterm", COLUMNS=str(columns), LINES="40", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def agent_args(tiny: Path, tmp: Path, script: list[str], *extra: str) -> list[str]:
    """``python`` arguments of ``ds4mlx agent`` on checkpoint ``tiny`` with workspace
    ``tmp/ws``, its KV cache in ``tmp/kv`` and ``script`` as its scripted decoding."""
    ws = tmp / "ws"
    ws.mkdir(exist_ok=True)
    sf = tmp / "script.json"
    sf.write_text(json.dumps(script))
    return [
        "-m", "ds4mlx.cli", "agent", "-m", str(tiny), "--ctx", "8192",
        "--workspace", str(ws), "--kv-disk-dir", str(tmp / "kv"), "--script-file", str(sf),
        *extra,
    ]  # fmt: skip
