"""ds4mlx.dsml: DeepSeek V4 prompt rendering and DSML tool-call parsing (docs/ARCHITECTURE.md §4).

Stdlib only. The public API:

- `Conversation`, `Message`, `ToolCall`, `ToolSpec`: the neutral conversation model.
- `render` (text + content spans: `Rendered`), `render_prompt`, `render_segments`, `render_tool_results_suffix`, `render_late_result`, `render_pending_status`, `background_names`,
  `render_assistant_turn`, `render_tool_calls`, `render_invoke`, `canonical_invoke`,
  `render_tools_section`, `think_max_active`: rendering (byte-identical to
  DeepSeek's ``encoding_dsv4.py``).
- `StreamDecoder`, `decode_text` and the events `ThinkingDelta`, `TextDelta`,
  `ToolCallStart`, `ToolCallArgsDelta`, `ToolCallEnd`, `ParseError`; `DecodeResult`.
- `ToolMemory`, `new_tool_id`, `StopMatcher`; special tokens in `ds4mlx.dsml.tokens`.
"""

from .conversation import JSON_OBJECT, ROLES, Conversation, Message, Role, ToolCall, ToolSpec
from .decoder import (
    DecodeResult,
    Event,
    ParseError,
    StreamDecoder,
    TextDelta,
    ThinkingDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    decode_text,
)
from .ids import new_tool_id
from .marked import Rendered
from .render import (
    Segment,
    background_names,
    canonical_invoke,
    render,
    render_assistant_turn,
    render_invoke,
    render_late_result,
    render_pending_status,
    render_prompt,
    render_segments,
    render_tool_calls,
    render_tool_results_suffix,
    render_tools_section,
    reply_thinking,
    think_max_active,
)
from .stops import StopMatcher
from .tokens import THINK_MAX_MIN_CONTEXT
from .tool_memory import ToolMemory

__all__ = [
    "JSON_OBJECT",
    "ROLES",
    "Rendered",
    "render",
    "THINK_MAX_MIN_CONTEXT",
    "Conversation",
    "DecodeResult",
    "Event",
    "Message",
    "ParseError",
    "Role",
    "Segment",
    "StopMatcher",
    "StreamDecoder",
    "TextDelta",
    "ThinkingDelta",
    "ToolCall",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "ToolMemory",
    "ToolSpec",
    "canonical_invoke",
    "decode_text",
    "new_tool_id",
    "render_assistant_turn",
    "render_invoke",
    "render_prompt",
    "render_segments",
    "render_tool_calls",
    "background_names",
    "render_late_result",
    "render_pending_status",
    "render_tool_results_suffix",
    "render_tools_section",
    "reply_thinking",
    "think_max_active",
]
