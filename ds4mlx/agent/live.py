"""The agent's live conversation: what every part of the agent shares.

`Live` holds the transcript (``conv``), the live state's marker (`LiveState`), the
prompt cache the state lives in (``ds4mlx.kv.cache.PromptCache``) and the flags the
UI and Ctrl+C touch. The agent's parts — `ds4mlx.agent.steps.Steps` (a turn),
`ds4mlx.agent.compactor.Compactor` (compaction), `ds4mlx.agent.session_control.
SessionControl` (``/save``, ``/switch``, ``/new``) — each get the one `Live`, and
`ds4mlx.agent.loop.Agent` composes them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ds4mlx.agent.events import AgentUI, CompactionInfo, Step
from ds4mlx.dsml import Conversation, Message, Rendered, ToolMemory, render


class LiveState(enum.StrEnum):
    """Where the live tokens end (docs/ARCHITECTURE.md §7). A ``str`` enum: session
    files store the value."""

    EMPTY = "empty"  # no tokens
    DIRTY = "dirty"  # anywhere else than a turn boundary (cut prefill, reset, old snapshot)
    READY = "ready"  # the prompt is prefilled: a turn may be generated
    TURN_END = "turn_end"  # right after an assistant turn (its EOS sampled, not fed)


@dataclass(eq=False)
class Live:
    """The shared state of one agent.

    Attributes:
        engine: the ``ds4mlx.engine.Engine``.
        cache: the ``ds4mlx.kv.cache.PromptCache`` (one live state: the engine's
            session).
        tool_memory: the ``ToolMemory`` of sampled calls (exact DSML).
        ui: the `AgentUI`.
        conv: the transcript as a ``Conversation`` (system message first).
        state: the `LiveState` marker.
        exact: ``render(conv)`` reproduces the live text (see ``Agent``).
        steps: every `Step` done on the live session.
        compactions: every `CompactionInfo` of finished compactions.
        record: the current ``SessionRecord``, or None.
        cancel: Ctrl+C was pressed (polled by the turn loop).
        phase: ``idle``, ``model`` or ``tools`` (where SIGINT goes).
    """

    engine: Any
    cache: Any
    tool_memory: ToolMemory
    ui: AgentUI
    conv: Conversation
    state: LiveState = LiveState.EMPTY
    exact: bool = True
    steps: list[Step] = field(default_factory=list)
    compactions: list[CompactionInfo] = field(default_factory=list)
    record: Any = None
    cancel: bool = False
    phase: str = "idle"

    @property
    def session(self):
        return self.engine.session

    @property
    def tok(self):
        return self.engine.tokenizer

    @property
    def ctx(self) -> int:
        return self.engine.ctx_size

    @property
    def messages(self) -> list[Message]:
        return self.conv.messages

    def render(self) -> Rendered:
        """``render`` of the transcript with this agent's context and tool memory: the
        prompt text and its content spans (which its tokens and keys need)."""
        return render(self.conv, context_size=self.ctx, tool_memory=self.tool_memory)

    def settle(self) -> None:
        """The live tokens end on no known boundary: ``dirty``, or ``empty``."""
        self.state = LiveState.DIRTY if self.session.tokens else LiveState.EMPTY

    def bind_transcript(self) -> None:
        """Tell the prompt cache that the live state is this transcript (it ends with an
        assistant turn whose EOS was sampled but not fed)."""
        if self.messages and self.messages[-1].role == "assistant":
            self.cache.bind_transcript(self.render())

    def pending_from(self) -> int:
        """Index of the first message not yet in the live state (after the last
        assistant)."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == "assistant":
                return i + 1
        return 1
