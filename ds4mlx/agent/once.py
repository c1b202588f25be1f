"""At most once: a tool call id runs at most once (docs/ARCHITECTURE.md §7).

The transcript is written before a round's calls run and after each result, so a crash
leaves the calls it cut without a result. Such a call is never run again: restoring the
session answers it "outcome unknown" (:func:`close_cut_calls`), as a Ctrl+C during a
call does (:data:`INTERRUPTED_TEXT`). When the model then repeats a ``write``/``edit``
of unknown outcome with the same arguments, :func:`repeats_unknown` says so and the
toolbox checks the file first (``Toolbox.already_applied``). ``bash`` is never
deduplicated: the same command twice is two runs.
"""

from __future__ import annotations

from ds4mlx.dsml import Message, ToolCall

#: Every result of a call whose effect is not known starts with this.
UNKNOWN = "error: outcome unknown:"
CUT_TEXT = (
    f"{UNKNOWN} the agent stopped while this call ran (or before it started) and it is "
    "not run again; check its effect before repeating it"
)
INTERRUPTED_TEXT = f"{UNKNOWN} interrupted by the user while it ran (it may have run in part)"
#: Tools whose repeat after an unknown outcome is reconciled against the file.
RECONCILED = ("write", "edit")


def answered(messages: list[Message]) -> set[str]:
    """Ids of the calls that have a result in ``messages``."""
    return {m.tool_call_id for m in messages if m.role == "tool" and m.tool_call_id}


def close_cut_calls(messages: list[Message]) -> int:
    """Answer the last assistant turn's calls that have no result "outcome unknown"
    (appended to ``messages``, which must end with that turn or its results); returns
    how many."""
    last = next((m for m in reversed(messages) if m.role == "assistant"), None)
    if last is None or messages[-1].role not in ("assistant", "tool"):
        return 0
    done = answered(messages)
    cut = [c for c in last.tool_calls if c.id not in done]
    messages.extend(Message("tool", CUT_TEXT, tool_call_id=c.id) for c in cut)
    return len(cut)


def repeats_unknown(call: ToolCall, messages: list[Message]) -> bool:
    """True if ``call`` is a ``write``/``edit`` with the same arguments as an earlier
    call of that tool whose result is "outcome unknown"."""
    if call.name not in RECONCILED:
        return False
    unknown = {
        m.tool_call_id for m in messages if m.role == "tool" and m.content.startswith(UNKNOWN)
    }
    return any(
        c.id in unknown
        and c.id != call.id
        and c.name == call.name
        and c.arguments == call.arguments
        for m in messages
        if m.role == "assistant"
        for c in m.tool_calls
    )
