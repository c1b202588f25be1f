"""The steps of an agent turn on the live session (a mixin of `ds4mlx.agent.loop.Agent`).

Prepare (the planner decides what to prefill; compaction first when needed), prefill,
generate with the engine's one turn loop, close the turn into a transcript message
that renders exactly as the live state holds it, run its tool calls.
"""

from __future__ import annotations

import time

from ds4mlx.agent.events import Generated, Step
from ds4mlx.agent.tools import ToolOutcome
from ds4mlx.dsml import (
    Event,
    Message,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    render_assistant_turn,
)
from ds4mlx.dsml.tokens import THINK_END
from ds4mlx.engine import FINISH_CANCELLED, FINISH_STOP, TurnSpec, run_turn
from ds4mlx.kv.plan import Plan

# The turn loop's finish reasons as the agent's steps name them.
_AGENT_STOP = {FINISH_STOP: "eos", FINISH_CANCELLED: "interrupted"}

# Error kind of tool results for calls the user interrupted (ToolOutcome.error).
INTERRUPTED = "interrupted"


class LiveSteps:
    """Mixin: needs the `Agent` attributes ``session``, ``tok``, ``ctx``, ``conv``,
    ``messages``, ``planner``, ``policy``, ``sampling``, ``script``, ``toolbox``,
    ``tool_memory``, ``ui``, ``steps``, ``state``, ``exact``, ``chunk_size``, the
    flags ``_cancel``/``_phase`` and its ``render``/``_compact`` methods."""

    def _pending_from(self) -> int:
        """Index of the first message not yet in the live state (after the last assistant)."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == "assistant":
                return i + 1
        return 1

    def _prepare(self, *, compact: bool) -> str | None:
        """Bring the live state up to the transcript through the planner; compact first
        when the result would pass the soft limit (live plans) or not fit (any plan).

        Returns None when ready to generate, else a ``SendResult`` status.
        """
        full = self.render()
        t0 = time.monotonic()
        plan = self.planner.plan(
            self.session,
            prompt_tokens=self.tok.encode(full.text, content=full.content),
            rendered_text=full,
            conversation=self.conv,
        )
        if plan.decision in ("disk", "cold"):
            self.state = "dirty" if self.session.tokens else "empty"
        if plan.decision == "disk":
            n = plan.keep
            self.steps.append(Step("restore", 0, n, n, time.monotonic() - t0))
            self.ui.notice(f"reused {n} tokens from the disk KV cache")
        why = self.policy.check(plan.keep, len(plan.suffix_tokens), self.ctx)
        if compact and (why == "hard" or (why == "soft" and plan.keep)):
            return self._compact(why)
        if plan.decision in ("disk", "cold"):
            kind = "prompt"
        elif any(m.role == "tool" for m in self.messages[self._pending_from() :]):
            kind = "tool_results"
        else:
            kind = "user"
        return None if self._prefill_ids(plan.suffix_tokens, kind, plan) else "interrupted"

    def _rebuild(self) -> str | None:
        """Rebuild the live state for a replaced transcript (after compaction)."""
        return self._prepare(compact=False)

    def _prefill_ids(self, ids: list[int], kind: str, plan: Plan | None = None) -> bool:
        """Prefill ``ids`` onto the live state (with ``plan``'s disk checkpoints);
        False if interrupted (then the state is dirty unless nothing was fed)."""
        s = self.session
        before = len(s.tokens)
        self._phase = "model"
        t0 = time.monotonic()
        try:
            n = s.prefill(
                ids,
                chunk_size=self.chunk_size,
                progress=self.ui.prefill_progress,
                cancel=lambda: self._cancel,
                checkpoints=plan.checkpoints if plan else (),
                on_checkpoint=plan.on_checkpoint if plan else None,
            )
        finally:
            self.ui.prefill_done()
        dt = time.monotonic() - t0
        self.steps.append(Step(kind, before, n, len(ids), dt, self.tok.decode(ids)))
        pn, ps = self._last_prefill
        self._last_prefill = (pn + n, ps + dt)
        if n < len(ids):
            if n > 0 or not s.tokens:
                self.state = "dirty" if s.tokens else "empty"
            self.ui.notice("interrupted during prefill", "warn")
            return False
        self.state = "ready"
        return True

    def _next_script(self) -> list[int] | None:
        """The next scripted completion's ids (tests only), EOS-terminated, or None."""
        if not self.script:
            return None
        ids = self.tok.encode(self.script.popleft())
        if not ids or ids[-1] != self.tok.eos_id:
            ids.append(self.tok.eos_id)
        return ids

    def _generate(self, *, thinking: bool, tools: bool, max_tokens: int, kind: str) -> Generated:
        """Sample and feed one assistant turn with the engine's turn loop (the EOS is
        sampled but not fed)."""
        s = self.session
        start = len(s.tokens)
        self._phase = "model"
        self.ui.turn_start(kind)

        def show(ev: Event) -> None:
            if kind == "summary" and not isinstance(ev, ThinkingDelta | TextDelta):
                return  # tools are off while summarizing: calls are not shown or run
            self.ui.event(ev)

        spec = TurnSpec(
            self.sampling,
            max_tokens=max_tokens,
            cap_is_eos=self.cap_is_eos and kind == "answer",
            thinking=thinking,
            tools=tuple(self.conv.tools) if tools else (),
        )
        res = run_turn(
            s,
            self.tok,
            spec,
            emit=show,
            cancel=lambda: self._cancel,
            script=self._next_script(),
            tool_memory=self.tool_memory if tools else None,
        )
        stop = _AGENT_STOP.get(res.finish, res.finish)
        fed = len(s.tokens) - start
        step = Step(kind, start, fed, fed, res.decode_s, stop=stop)
        self.steps.append(step)
        if kind == "answer":
            self._last_gen = step
        self.ui.turn_end(step)
        raw = self.tok.decode(s.tokens[start:])
        return Generated(stop, res.decoded, raw, start, fed, res.decode_s, res.call_errors)

    def _close_turn(self, gen: Generated, thinking: bool) -> Message:
        """The transcript message for a generated turn; make the live state end on it.

        A turn that stopped inside its reasoning gets ``</think>`` fed, so that the live
        text reads ``reasoning</think>content`` as the renderer writes it.
        """
        s = self.session
        raw = gen.raw
        self.state = "turn_end"
        if thinking and THINK_END not in raw:
            if s.room() >= 1:
                self._phase = "model"
                s.prefill([self.tok.think_end_id])
                raw += THINK_END
            else:
                self.state = "dirty"
        if gen.stop == "eos":
            res = gen.result
            msg = Message(
                "assistant",
                content=res.content,
                reasoning=res.reasoning if thinking else None,
                tool_calls=list(res.tool_calls),
            )
            if render_assistant_turn(msg, thinking=thinking, eos=False) != raw:
                self.exact = False
            return msg
        # Interrupted or cut: keep the raw text as it is in the live state; a partial
        # tool call stays text and is never run.
        if thinking and THINK_END in raw:
            reasoning, content = raw.split(THINK_END, 1)
        elif thinking:
            reasoning, content = raw, ""
        else:
            reasoning, content = None, raw
        return Message("assistant", content=content, reasoning=reasoning)

    def _run_tools(self, calls: list[ToolCall], call_errors: dict[str, str]) -> bool:
        """Run ``calls`` in order, appending one tool message each; False if interrupted."""
        interrupted = False
        for call in calls:
            outcome: ToolOutcome | None = None
            interrupted = interrupted or self._cancel  # Ctrl+C between two calls
            try:
                if interrupted:
                    outcome = ToolOutcome(
                        False,
                        "error: not run: the user interrupted the agent before this call",
                        INTERRUPTED,
                    )
                elif call.id in call_errors:
                    outcome = ToolOutcome(
                        False,
                        f"error: malformed tool call ({call_errors[call.id]}); it was not run. "
                        "Call the tool again with well-formed DSML.",
                        "invalid_arguments",
                    )
                else:
                    self._phase = "tools"
                    self.ui.tool_start(call, self.toolbox.describe(call.name, call.arguments))
                    outcome = self.toolbox.run(call.name, call.arguments)
            except KeyboardInterrupt:
                interrupted = True
                outcome = ToolOutcome(
                    False,
                    "error: interrupted by the user while it ran; its outcome is unknown "
                    "(it may have run in part)",
                    INTERRUPTED,
                )
            finally:
                self._phase = "model"
                if outcome is None:  # an unexpected error escaped: still answer the call
                    outcome = ToolOutcome(False, "error: the agent failed to run this call")
                self.messages.append(Message("tool", outcome.text, tool_call_id=call.id))
            self.ui.tool_result(call, outcome)
        return not interrupted
