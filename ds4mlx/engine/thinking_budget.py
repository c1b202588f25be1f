"""A cap on the reasoning block (``TurnSpec.thinking_budget``).

Anthropic's ``thinking: {"type": "enabled", "budget_tokens": N}`` asks for at most N
reasoning tokens. DeepSeek V4 has no budget of its own: the model writes ``</think>``
when it is done. So once the reasoning holds N tokens, `ThinkingBudget` feeds
``</think>`` through the turn loop's forced-feed call
(`ds4mlx.engine.turn.Turn.force_feed`), as if sampled: the reply starts there, and the
live state ends exactly as a turn whose model closed its reasoning at that point, so a
replay of the turn (reasoning, ``</think>``, reply) continues it exactly.
"""

from __future__ import annotations

from ds4mlx.engine.hooks import Turn, TurnHooks


class ThinkingBudget(TurnHooks):
    """`TurnHooks` that close the reasoning block after ``budget`` reasoning tokens
    (module doc). Polled before each step; a tool-call block the model opened inside its
    reasoning (from its ``｜DSML｜`` token on) is left to close first: cut, it would be
    unparseable markup, and its close ends the reasoning anyway. One instance serves one
    turn.

    Args:
        budget: reasoning tokens (>= 1) after which ``</think>`` is fed.
    """

    def __init__(self, budget: int) -> None:
        if budget < 1:
            raise ValueError(f"a thinking budget is at least 1 token, got {budget}")
        self.budget = int(budget)
        self.closed = False

    def before_step(self, turn: Turn) -> str | None:
        if self.closed or not turn.in_thinking or turn.result.reasoning_tokens < self.budget:
            return None
        if turn.decoder is not None and turn.decoder.in_tool_block:
            return None
        self.closed = True
        turn.force_feed([turn.tok.think_end_id])
        return None
