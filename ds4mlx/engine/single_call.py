"""At most one tool call per turn (``TurnSpec.parallel_calls`` False).

The client asked for no parallel calls (chat and Responses ``parallel_tool_calls:
false``, Anthropic ``tool_choice.disable_parallel_tool_use``). Dropping the extra calls
after the fact would leave their DSML in the live state, where no rendering of the
turn has them, and no tool binding could continue it. Instead the turn ends after the
first closed invoke: `SingleCall` feeds the block closer (``</｜DSML｜tool_calls>``) and
EOS through the turn loop's forced-feed call (`ds4mlx.engine.turn.Turn.force_feed`), as
if sampled. EOS ends the turn unfed (the feeding rule), so the live state ends exactly
where a one-call turn the model closed itself would: the binding of that one call and
its tool-result continuation are exact.
"""

from __future__ import annotations

from ds4mlx.dsml.tokens import INVOKE_CLOSE, TOOL_CALLS_CLOSE
from ds4mlx.engine.hooks import Turn, TurnHooks

_WS = " \t\r\n"


def block_closer(generated: str) -> str:
    """The text that closes the tool-call block after the first invoke of ``generated``
    (the turn's text so far, which ends inside or after ``</｜DSML｜invoke>``'s token).

    The canonical form is ``</｜DSML｜invoke>\\n</｜DSML｜tool_calls>``; the token that
    completed the invoke may already hold the newline (``>\\n``) or the start of the
    closer, which are not repeated.
    """
    tail = generated[generated.rfind(INVOKE_CLOSE) + len(INVOKE_CLOSE) :]
    rest = tail.lstrip(_WS)
    if rest and TOOL_CALLS_CLOSE.startswith(rest):
        return TOOL_CALLS_CLOSE[len(rest) :]
    return ("" if tail and not rest else "\n") + TOOL_CALLS_CLOSE


class SingleCall(TurnHooks):
    """`TurnHooks` that end a parsed turn after its first closed invoke (module doc).

    Polled before each step: once the decoder saw one ``</｜DSML｜invoke>`` and the block
    is still open, the closer's tokens and EOS are queued as the next steps' tokens.
    A block the model closes itself, or a call cut by the end of the turn, is left as it
    is. One instance serves one turn.
    """

    def __init__(self) -> None:
        self.closing = False

    def before_step(self, turn: Turn) -> str | None:
        dec = turn.decoder
        if self.closing or dec is None or dec.tool_block_closed or dec.invokes_closed < 1:
            return None
        self.closing = True
        closer = turn.tok.encode(block_closer(turn.raw_text()))
        turn.force_feed([*closer, turn.tok.eos_id])
        return None
