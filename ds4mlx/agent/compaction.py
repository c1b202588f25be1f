"""Context compaction for the agent (docs/ARCHITECTURE.md §7): when, what to keep, how to rebuild.

The agent compacts before it appends new text to the live session:

- **soft**: the session would reach ``soft_fraction`` (85 %) of the context;
- **hard**: the new text (typically a tool result) plus a generation reserve would not
  fit in the context at all.

Compaction asks the live model for a summary of the durable task state (the request is
appended to the live session, so it costs only the instruction's prefill; no tools are
ever executed while summarizing), keeps a recent tail of messages verbatim, and
rebuilds the session from ``system + summary + tail``. When the live session has no
room left even for the summary request, a mechanical summary (the user's requests and
the tool calls made, from the transcript) is used instead.

This module holds the pure parts (thresholds, tail selection, texts, the rebuilt
message list); :mod:`ds4mlx.agent.loop` drives the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ds4mlx.dsml.conversation import Message

SUMMARY_HEADER = "[Context compacted. Summary of the conversation so far, written by you:]"
TAIL_NOTE = "[The most recent messages follow verbatim.]"
FIRST_REQUEST_CHARS = 2000
# Delimit the carried first request so a later compaction can take it over verbatim.
_REQUEST_OPEN = "\n<<<\n"
_REQUEST_CLOSE = "\n>>>"


@dataclass(frozen=True)
class CompactionPolicy:
    """When to compact and how much to keep.

    Attributes:
        soft_fraction: compact when the session would reach this share of the context
            (0 < x <= 1; default 0.85).
        tail_fraction: at most this share of the context is kept verbatim as the recent
            tail (0 < x < 1). The pending step (the last assistant turn with its tool
            results, or the new user message) is always kept, whatever its size.
        summary_tokens: most tokens the summary may take; None = ``ctx // 16`` clamped
            to 128..2048.
        reserve_tokens: room that must stay free after appending new text so the model
            can answer; None = ``ctx // 16`` clamped to 64..4096.

    Raises:
        ValueError: a fraction is out of range.
    """

    soft_fraction: float = 0.85
    tail_fraction: float = 0.25
    summary_tokens: int | None = None
    reserve_tokens: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.soft_fraction <= 1:
            raise ValueError(f"soft_fraction must be in (0, 1], got {self.soft_fraction}")
        if not 0 < self.tail_fraction < 1:
            raise ValueError(f"tail_fraction must be in (0, 1), got {self.tail_fraction}")

    def soft_limit(self, ctx: int) -> int:
        """Token count (int) at which soft compaction starts."""
        return int(ctx * self.soft_fraction)

    def summary_max(self, ctx: int) -> int:
        """Most tokens (int) the summary may take at context size ``ctx``."""
        if self.summary_tokens is not None:
            return self.summary_tokens
        return max(128, min(2048, ctx // 16))

    def reserve(self, ctx: int) -> int:
        """Tokens (int) kept free for the model's answer after appending new text."""
        if self.reserve_tokens is not None:
            return self.reserve_tokens
        return max(64, min(4096, ctx // 16))

    def tail_budget(self, ctx: int) -> int:
        """Most tokens (int) of older messages kept verbatim in the tail."""
        return int(ctx * self.tail_fraction)

    def check(self, used: int, adding: int, ctx: int) -> str | None:
        """Whether appending ``adding`` tokens to ``used`` live tokens needs compaction.

        Returns ``"hard"`` if the text plus the reserve does not fit in ``ctx``,
        ``"soft"`` if the session would reach the soft limit, else None.
        """
        after = used + adding
        if after + self.reserve(ctx) > ctx:
            return "hard"
        if after >= self.soft_limit(ctx):
            return "soft"
        return None


def summary_instruction(max_words: int) -> str:
    """The user-turn text asking the model for a compaction summary."""
    return (
        "[agent] The context window is nearly full, so the conversation will now be "
        "compacted: everything before the most recent messages is replaced by a summary "
        "you write now. Write that summary for yourself, so you can continue the task "
        "without the old messages: the user's goal and constraints, decisions made, files "
        "created or changed (with paths), commands run and what they showed, what is done, "
        "what is still open, and the next step. Do not call tools now; they will not run. "
        f"Plain text, at most {max_words} words."
    )


def tail_start(
    messages: list[Message],
    keep_from: int,
    count: Callable[[Message], int],
    budget: int,
) -> int:
    """Index of the first message of the verbatim tail.

    Args:
        messages: the transcript; ``messages[0]`` is the system message.
        keep_from: the tail starts at this index or earlier (the pending step).
        count: tokens a message takes when rendered (int).
        budget: most tokens of messages before ``keep_from`` that may be kept.

    The tail never starts on a ``tool`` message (results stay with the assistant turn
    that made the calls) nor on the system message, and grows backwards over whole
    messages while they fit in ``budget``.

    Raises:
        ValueError: ``keep_from`` is out of range.
    """
    if not 1 <= keep_from <= len(messages):
        raise ValueError(f"keep_from {keep_from} out of range 1..{len(messages)}")
    start = keep_from
    # The pending step itself must start on a legal boundary.
    while start > 1 and start < len(messages) and messages[start].role == "tool":
        start -= 1
    best = start
    used = 0
    i = start - 1
    while i >= 1:
        used += count(messages[i])
        if used > budget:
            break
        if messages[i].role != "tool":
            best = i
        i -= 1
    return best


def first_request(messages: list[Message]) -> str | None:
    """The user's first request (truncated to ``FIRST_REQUEST_CHARS``), or None.

    The first user message's text; after an earlier compaction, the request that its
    summary message carries.
    """
    for m in messages:
        if m.role == "user" and m.content:
            text = m.content
            if text.startswith(SUMMARY_HEADER):
                start = text.find(_REQUEST_OPEN)
                end = text.find(_REQUEST_CLOSE, start + len(_REQUEST_OPEN))
                if start < 0 or end < 0:
                    continue
                return text[start + len(_REQUEST_OPEN) : end]
            if len(text) > FIRST_REQUEST_CHARS:
                text = text[:FIRST_REQUEST_CHARS] + " […]"
            return text
    return None


def summary_message(summary: str, request: str | None) -> Message:
    """The user message that replaces the compacted part of the transcript."""
    parts = [SUMMARY_HEADER]
    if request:
        parts.append(f"The user's first request was:{_REQUEST_OPEN}{request}{_REQUEST_CLOSE}")
    parts.append(summary.strip() or "(no summary)")
    parts.append(TAIL_NOTE)
    return Message("user", "\n\n".join(parts))


def mechanical_summary(messages: list[Message], max_chars: int = 4000) -> str:
    """A summary built from the transcript alone (no model): requests and tool calls.

    Used when the live session has no room left for the summary request. Newest
    entries are kept when the text exceeds ``max_chars`` characters.
    """
    lines: list[str] = []
    results = {m.tool_call_id: m.content for m in messages if m.role == "tool"}
    for m in messages:
        if m.role == "user" and m.content and not m.content.startswith(SUMMARY_HEADER):
            lines.append(f"- user asked: {_clip(m.content, 300)}")
        elif m.role == "user" and m.content:
            lines.append(f"- earlier summary: {_clip(m.content, 1500)}")
        elif m.role == "assistant":
            if m.content.strip():
                lines.append(f"- you said: {_clip(m.content, 200)}")
            for c in m.tool_calls:
                res = results.get(c.id, "")
                status = "error" if res.startswith("error:") else "ok"
                first = res.splitlines()[0] if res else ""
                lines.append(
                    f"- you called {c.name} {_clip(str(c.arguments), 150)} -> {status}: {_clip(first, 120)}"
                )
    text = "(mechanical summary: the model was not asked)\n" + "\n".join(lines)
    if len(text) > max_chars:
        text = "(mechanical summary, oldest entries dropped)\n" + text[-max_chars:]
    return text


def rebuild(
    messages: list[Message], start: int, summary: str, request: str | None
) -> list[Message]:
    """``[system] + [summary message] + messages[start:]`` (the rebuilt transcript).

    ``messages[0]`` must be the system message; the tail is kept as the same objects
    (verbatim: reasoning, content, exact DSML of tool calls, results).
    """
    head = [messages[0]] if messages and messages[0].role == "system" else []
    return head + [summary_message(summary, request)] + list(messages[start:])


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"
