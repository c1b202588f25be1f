"""Steering: the one boundary rule of the turn loop (`Steering`, a `TurnHooks`).

A caller (the agent's key reader, the server's Responses WebSocket) queues new user input
while a turn runs and sets a flag; `Steering` polls it before every step and ends the
turn at the next *safe boundary* with finish ``steered`` (`FINISH_STEERED`):

- in reasoning or visible text: at once, before the next token is sampled. A turn that
  stopped inside its reasoning is closed with ``</think>`` (one forced feed,
  `close_reasoning`), exactly as a cancelled turn is, so the live text reads
  ``reasoning</think>content`` as the renderer writes that turn;
- inside a tool-call block (from the ``｜DSML｜`` token of its opener on,
  ``StreamDecoder.in_tool_block``): at the block's close ``</｜DSML｜tool_calls>`` (a tool
  boundary). The closing token is fed, so the live state ends where it would after the
  EOS that normally follows; the block's calls are complete and runnable.

Either way the live state ends where the next rendered turn begins (its suffix starts
with ``<｜end▁of▁sentence｜>``): the caller appends the steering input as a user turn,
append-only, nothing re-prefilled. A block that ``max_tokens``, the context or a cancel
cuts before its close stays text and is never run (the loop's own rule: only closed calls
reach ``TurnResult.tool_calls``). Cancel still wins over steer: it is polled first and
stops at the next token wherever the turn is.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ds4mlx.engine.turn import FINISH_CANCELLED, FINISH_STEERED, Turn, TurnHooks

__all__ = ["FINISH_STEERED", "Steering", "close_reasoning"]


def _reasoning_open(turn: Turn) -> bool:
    """The turn is inside its reasoning, and no ``</think>`` was forced after it."""
    return turn.in_thinking and turn.tok.think_end_id not in turn.s.tokens[-1:]


def close_reasoning(turn: Turn) -> bool:
    """Feed ``</think>`` when ``turn`` ended inside its reasoning (call from
    `TurnHooks.at_end`); True if it was fed. Idempotent: a turn whose reasoning was
    closed (sampled or already forced) is left alone; without room nothing is fed."""
    if not _reasoning_open(turn):
        return False
    return turn.force_feed([turn.tok.think_end_id]) == 1


class Steering(TurnHooks):
    """The boundary rule as turn-loop hooks, around the caller's own ``inner`` hooks.

    Args:
        poll: ``() -> bool``, True once steering input is queued; called on the
            inference thread before every step (the flag may be set from any thread,
            e.g. a ``threading.Event.is_set``).
        inner: the caller's `TurnHooks` (prefill display, masks, drafts), or None;
            each hook runs ``inner``'s first.
        close_cancelled: also close the reasoning of a cancelled turn (the server
            worker: a cancelled response ends at a turn boundary the next request can
            continue; the agent closes its own).

    Attributes:
        cut_in_block: set at the end: the turn ended with a tool-call block open in
            its visible reply (a cancel, ``max_tokens`` or the context cut it): the
            live state holds a half-written block that no rendering of the visible
            reply reproduces. (A block cut inside the reasoning became reasoning text
            when ``</think>`` closed it.)
        at_boundary: set at the end: the live state ends where a rendered turn ends (no
            visible block cut, the reasoning closed): a steered turn always; a cancelled
            one when ``close_cancelled`` closed it there. A prompt cache may then bind
            the turn as it binds an end of turn.
    """

    def __init__(
        self,
        poll: Callable[[], bool],
        inner: TurnHooks | None = None,
        *,
        close_cancelled: bool = False,
    ):
        self.poll = poll
        self.inner = inner or TurnHooks()
        self.close_cancelled = close_cancelled
        self.cut_in_block = False
        self.at_boundary = False

    def after_prefill(self, turn: Turn) -> None:
        self.inner.after_prefill(turn)

    def before_step(self, turn: Turn) -> str | None:
        stop = self.inner.before_step(turn)
        if stop is not None or not self.poll():
            return stop
        dec = turn.decoder
        if dec is not None and dec.in_tool_block:
            return None  # a tool boundary comes at the block's close
        return FINISH_STEERED

    def on_token(self, turn: Turn, token: int) -> None:
        self.inner.on_token(turn, token)

    def mask(self, turn: Turn, logits: mx.array) -> mx.array | None:
        return self.inner.mask(turn, logits)

    def draft(self, turn: Turn):
        return self.inner.draft(turn)

    def admit(self, turn: Turn, drafts) -> int:
        return self.inner.admit(turn, drafts)

    def at_end(self, turn: Turn) -> None:
        self.inner.at_end(turn)
        finish = turn.result.finish
        if finish == FINISH_STEERED or (finish == FINISH_CANCELLED and self.close_cancelled):
            close_reasoning(turn)
        dec = turn.decoder
        self.cut_in_block = dec is not None and dec.in_tool_block
        self.at_boundary = not self.cut_in_block and not _reasoning_open(turn)
