"""The steps of an agent turn on the live session (`Steps`, a part of
`ds4mlx.agent.loop.Agent`).

Prepare (a lease from the prompt cache: what to prefill, or that compaction is due),
then the engine's one turn loop prefills the lease's plan and generates; close the turn
into a transcript message that renders exactly as the live state holds it (a cut
reasoning block is closed by the loop's forced feed); run its tool calls.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ds4mlx.agent import once
from ds4mlx.agent.dispatch import Dispatcher
from ds4mlx.agent.events import Generated, Step
from ds4mlx.agent.hooks import AFTER, BEFORE, fire_response
from ds4mlx.agent.idle import JobNotices
from ds4mlx.agent.live import Live, LiveState
from ds4mlx.agent.permissions import QuestionInterrupted
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
from ds4mlx.engine import FINISH_CANCELLED, FINISH_STOP, Turn, TurnHooks, TurnSpec, run_turn
from ds4mlx.engine.grammar import GrammarError, ToolRule, json_grammar, ll_tokenizer, turn_grammar
from ds4mlx.engine.steer import FINISH_STEERED, Steering
from ds4mlx.kv.cache import Lease, Prompt
from ds4mlx.kv.plan import ContextFull

# The turn loop's finish reasons as the agent's steps name them.
_AGENT_STOP = {FINISH_STOP: "eos", FINISH_CANCELLED: "interrupted", FINISH_STEERED: "steered"}

# Error kind of tool results for calls the user interrupted (ToolOutcome.error).
INTERRUPTED = "interrupted"
INTERRUPTED_TEXT = "error: not run: the user interrupted the agent before this call"
# A call not started when the user's queued instructions were applied (steering).
STEERED_TEXT = "not run: the user interrupted with new instructions"


_GRAMMARS: dict[str, Any] = {}  # the tools' names and schemas -> their strict grammar


def strict_grammar(tools, tok) -> Any:
    """The grammar that makes every call to the agent's tools strict (names, parameter
    names and values per each schema; docs/STRUCTURED_OUTPUTS.md), cached per tool set;
    an MCP tool whose schema llguidance cannot compile is held to well-formed DSML only."""
    key = repr([(t.name, t.parameters) for t in tools])
    if key not in _GRAMMARS:
        rules = {}
        for t in tools:
            try:
                json_grammar(t.parameters)
                rules[t.name] = ToolRule(strict=True)
            except GrammarError:
                pass
        _GRAMMARS[key] = turn_grammar(list(tools), rules, tokenizer=ll_tokenizer(tok))
    return _GRAMMARS[key]


@dataclass
class Prepared:
    """What `Steps.prepare` found: the ``lease`` to generate on, the Step kind of its
    prefill (``prompt``, ``user``, ``tool_results``), and ``compact`` (``soft`` or
    ``hard``) when compaction must come first."""

    lease: Lease
    kind: str
    compact: str | None = None


class _Hooks(TurnHooks):
    """The agent's turn-loop hooks: close the prefill display and open the turn's; close
    a reasoning block the turn left open with ``</think>`` (one forced feed)."""

    def __init__(self, ui, kind: str, planned: int, close_thinking: bool):
        self.ui, self.kind, self.planned = ui, kind, planned
        self.close_thinking = close_thinking

    def after_prefill(self, turn: Turn) -> None:
        self.ui.prefill_done()
        if turn.result.prefilled >= self.planned:
            self.ui.turn_start(self.kind)

    def at_end(self, turn: Turn) -> None:
        if self.close_thinking and THINK_END not in turn.raw_text():
            turn.force_feed([turn.tok.think_end_id])


def _turn_hooks(ui, steer_pending, kind: str, planned: int, thinking: bool) -> TurnHooks:
    """The turn's hooks: the agent's own; an answer also polls the steer queue (the
    engine's one boundary rule, `ds4mlx.engine.steer.Steering`)."""
    hooks = _Hooks(ui, kind, planned, close_thinking=thinking)
    return Steering(steer_pending, hooks) if kind == "answer" else hooks


def closed_turn(lv, gen: Generated, thinking: bool) -> Message:
    """The transcript message for a generated turn; the live state ``lv`` ends on it.

    A turn that stopped inside its reasoning had ``</think>`` fed by the turn loop
    (`_Hooks.at_end`), so the live text reads ``reasoning</think>content`` as the
    renderer writes it; without room for it the state is ``dirty``.
    """
    raw = gen.raw
    lv.state = LiveState.TURN_END
    if thinking and THINK_END not in raw:
        lv.state = LiveState.DIRTY
    if gen.stop == "eos" or (gen.stop == "steered" and gen.result.tool_calls):
        # steered at a tool boundary: the turn is whole up to its block's close
        res = gen.result
        msg = Message(
            "assistant",
            content=res.content,
            reasoning=res.reasoning if thinking else None,
            tool_calls=list(res.tool_calls),
        )
        if render_assistant_turn(msg, thinking=thinking, eos=False) != raw:
            lv.exact = False
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


class Steps:
    """One assistant turn's steps on ``live`` (see the module doc).

    Args:
        live: the agent's `Live`.
        toolbox: the ``ds4mlx.agent.tools.Toolbox`` calls run through.
        sampling: ``ds4mlx.engine.SamplingParams`` of payload tokens.
        policy: the ``CompactionPolicy`` (when compaction is due).
        script: scripted completions (tests), consumed in order, or None.
        cap_is_eos: an answer's ``max_tokens`` ends it as an EOS would (``--demo``).
        chunk_size: prefill chunk (tokens).
        hooks: the ``ds4mlx.agent.hooks.Hooks`` fired around every response, or None.

    Attributes:
        responses: assistant responses generated (the hooks' ``response_index``).
        user_text: the user message the current responses answer (the hooks' payload).
    """

    def __init__(
        self,
        live: Live,
        toolbox,
        sampling,
        policy,
        script: deque[str] | None,
        cap_is_eos: bool,
        chunk_size: int,
        hooks=None,
    ):
        self.live = live
        self.hooks = hooks
        self.responses = 0
        self.user_text = ""
        self.toolbox = toolbox
        self.sampling = sampling
        self.policy = policy
        self.script = script
        self.cap_is_eos = cap_is_eos
        self.chunk_size = chunk_size
        self.last_gen: Step | None = None
        self.last_prefill = (0, 0.0)
        # Writes the transcript (`SessionControl.persist`): before a round, after each result.
        self.persist: Callable[[], None] = lambda: None
        # True while a steer is queued (`ds4mlx.agent.steer`): calls not started skip.
        self.steer_pending: Callable[[], bool] = lambda: False
        self.steer_take: Callable[[], str | None] = lambda: None  # the queued text, once
        # Read-only calls started at their block's close (`ds4mlx.agent.dispatch`).
        self.dispatcher = Dispatcher(toolbox)
        # Ended background jobs' late results (`ds4mlx.agent.idle.JobNotices`).
        self.notices = JobNotices(live, toolbox)

    def prepare(self, *, compact: bool) -> Prepared:
        """Put the transcript into the live state through the prompt cache (a lease:
        kept, restored from disk, or reset, with the suffix to prefill); say when
        compaction is due first (the result would pass the soft limit for a live plan,
        or not fit for any plan)."""
        lv = self.live
        full = lv.render()
        t0 = time.monotonic()
        prompt = Prompt(
            # Tokenized only if the plan needs the whole prompt: a later step that
            # continues its transcript tokenizes just the new suffix.
            lambda: lv.tok.encode(full.text, content=full.content),
            full,
            lv.conv,
            thinking=lv.conv.thinking,
            transcript=True,
        )
        lease = lv.cache.begin(prompt)
        plan = lease.plan
        if plan.decision in ("disk", "cold"):
            lv.settle()
        if plan.decision == "disk":
            n = plan.keep
            lv.steps.append(Step("restore", 0, n, n, time.monotonic() - t0))
            lv.ui.notice(f"reused {n} tokens from the disk KV cache")
        why = self.policy.check(plan.keep, len(plan.suffix_tokens), lv.ctx)
        due = why if compact and (why == "hard" or (why == "soft" and plan.keep)) else None
        if plan.decision in ("disk", "cold"):
            kind = "prompt"
        elif any(m.role == "tool" for m in lv.messages[lv.pending_from() :]):
            kind = "tool_results"
        else:
            kind = "user"
        return Prepared(lease, kind, due)

    def _script_ids(self, text: str | None) -> list[int] | None:
        """A scripted completion's ids (tests only), EOS-terminated, or None."""
        if text is None:
            return None
        tok = self.live.tok
        ids = tok.encode(text)
        if not ids or ids[-1] != tok.eos_id:
            ids.append(tok.eos_id)
        return ids

    def generate(
        self,
        lease: Lease,
        prefill_kind: str,
        *,
        thinking: bool,
        tools: bool,
        max_tokens: int,
        kind: str,
    ) -> Generated | None:
        """Prefill the lease's plan and sample one assistant turn with the engine's turn
        loop (the EOS is sampled but not fed); None when the prefill was interrupted
        (the state is then ``dirty`` unless nothing was fed)."""
        lv = self.live
        s = lease.session
        before = len(s.tokens)
        ids = list(lease.plan.suffix_tokens)
        lv.phase = "model"
        scripted = self.script.popleft() if self.script else None
        self.dispatcher.drop()  # a new turn: no early read from an earlier one

        def show(ev: Event) -> None:
            if kind == "summary" and not isinstance(ev, ThinkingDelta | TextDelta):
                return  # tools are off while summarizing: calls are not shown or run
            lv.ui.event(ev)
            if tools:
                self.dispatcher.event(ev)  # a read-only call starts at its close

        spec = TurnSpec(
            self.sampling,
            max_tokens=max_tokens,
            cap_is_eos=self.cap_is_eos and kind == "answer",
            thinking=thinking,
            tools=tuple(lv.conv.tools) if tools else (),
            grammar=strict_grammar(lv.conv.tools, lv.tok) if tools and lv.conv.tools else None,
        )
        res = run_turn(
            s,
            lv.tok,
            spec,
            prefill=lease.plan,
            emit=show,
            cancel=lambda: lv.cancel,
            progress=lv.ui.prefill_progress,
            script=self._script_ids(scripted),
            tool_memory=lv.tool_memory if tools else None,
            after_token=lease.after_token,
            chunk_size=self.chunk_size,
            hooks=_turn_hooks(lv.ui, self.steer_pending, kind, len(ids), thinking),
        )
        n = res.prefilled
        lv.steps.append(Step(prefill_kind, before, n, len(ids), res.prefill_s, lv.tok.decode(ids)))
        pn, ps = self.last_prefill
        self.last_prefill = (pn + n, ps + res.prefill_s)
        if n < len(ids):
            if scripted is not None:  # nothing was generated: the next turn's script
                self.script.appendleft(scripted)
            if n > 0 or not s.tokens:
                lv.settle()
            lv.ui.notice("interrupted during prefill", "warn")
            return None
        lv.state = LiveState.READY
        start = before + n
        stop = _AGENT_STOP.get(res.finish, res.finish)
        fed = res.fed - res.forced
        step = Step(kind, start, fed, fed, res.decode_s, stop=stop)
        lv.steps.append(step)
        if kind == "answer":
            self.last_gen = step
        lv.ui.turn_end(step)
        raw = lv.tok.decode(s.tokens[start:])
        return Generated(stop, res.decoded, raw, start, fed, res.decode_s, res.call_errors, res)

    def answer(self, compactor, max_tokens: int):
        """Prepare (compacting first when due, with ``compactor``) and generate one
        answer turn, closed into the transcript and bound in the prompt cache:
        ``(Generated, Message)``, or a ``SendResult`` status when it did not run."""
        lv = self.live
        steer = self.steer_take()
        if steer:  # after the round's results (calls not started: "not run"), one user turn
            lv.messages.append(Message("user", steer))
            lv.ui.notice(f"sent: {steer}")
        self.notices.add()
        held = len(lv.session.tokens)
        pending = compactor.pending_overflow()
        if pending is not None and pending + self.policy.reserve(lv.ctx) > lv.ctx:
            return "context"  # past the context alone: no summary of the rest can help
        # Past the context beside the live state: compact first, without a plan.
        prepared, due = None, "hard"
        if pending is None:
            try:
                prepared = self.prepare(compact=True)
                due = prepared.compact
            except ContextFull:
                # A refused plan may have replaced the live tokens already (a plan that
                # does not fit rebuilds): then they end on no known turn.
                if len(lv.session.tokens) != held:
                    lv.settle()
        if due is not None:
            if prepared is not None:
                prepared.lease.abandon()
            st, prepared = compactor.compact(due)
            if st is not None:
                return st
        thinking = lv.conv.thinking
        fire_response(self, BEFORE)
        gen = self.generate(
            prepared.lease,
            prepared.kind,
            thinking=thinking,
            tools=True,
            max_tokens=max_tokens,
            kind="answer",
        )
        if gen is None:
            return "interrupted"
        if gen.stop != "eos" and not (gen.stop == "steered" and gen.result.tool_calls):
            self.dispatcher.drop()  # a cut turn runs no calls: early results discarded
        msg = self.close_turn(gen, thinking)
        lv.messages.append(msg)
        fire_response(self, AFTER, gen, msg)
        self.responses += 1
        key = lv.render() if lv.state == LiveState.TURN_END else None
        prepared.lease.finish(gen.turn, transcript_key=key)
        if gen.stop == "steered":
            if not msg.tool_calls:  # stopped in its text: the queued text is the next turn
                return self.answer(compactor, max_tokens)
            # A tool boundary: the round runs (calls not started answer "not run"), then
            # the queued text follows in the same user turn.
            gen = dataclasses.replace(gen, stop="eos")
        return gen, msg

    def close_turn(self, gen: Generated, thinking: bool) -> Message:
        """The transcript message for a generated turn (`closed_turn`)."""
        return closed_turn(self.live, gen, thinking)

    def run_tools(self, calls: list[ToolCall], call_errors: dict[str, str]) -> bool:
        """Run ``calls`` in order, appending one tool message each; False if interrupted.

        At most once (:mod:`ds4mlx.agent.once`): the transcript is written before the
        round and after each result; a call id that has a result is not run again; a
        ``write``/``edit`` repeating one of unknown outcome is checked against the file.
        """
        lv = self.live
        interrupted = False
        self.persist()
        for call in calls:
            if call.id in once.answered(lv.messages):
                continue  # its result is in the transcript already
            outcome: ToolOutcome | None = None
            interrupted = interrupted or lv.cancel  # Ctrl+C between two calls
            try:
                started = self.dispatcher.started(call.id)
                outcome = not_run(call, call_errors, interrupted, self.steer_pending(), started)
                if outcome is None:
                    lv.phase = "tools"
                    lv.ui.tool_start(call, self.toolbox.describe(call.name, call.arguments))
                    if once.repeats_unknown(call, lv.messages):
                        outcome = self.toolbox.already_applied(call.name, call.arguments)
                    outcome = outcome or self.dispatcher.take(call.id)  # started early
                    outcome = outcome or self.toolbox.run(call.name, call.arguments)
            except QuestionInterrupted:  # at the permission question: nothing ran
                interrupted = True
                outcome = ToolOutcome(False, INTERRUPTED_TEXT, INTERRUPTED)
            except KeyboardInterrupt:
                interrupted = True
                outcome = ToolOutcome(False, once.INTERRUPTED_TEXT, INTERRUPTED)
            finally:
                lv.phase = "model"
                if outcome is None:  # an unexpected error escaped: still answer the call
                    outcome = ToolOutcome(False, "error: the agent failed to run this call")
                lv.messages.append(Message("tool", outcome.text, tool_call_id=call.id))
                self.persist()
                if outcome.job:
                    self.notices.job_calls[outcome.job] = call
            lv.ui.tool_result(call, outcome)
        self.dispatcher.drop()  # outcomes of calls that did not run
        return not interrupted


def not_run(
    call: ToolCall, call_errors: dict[str, str], interrupted: bool, steered: bool, started: bool
) -> ToolOutcome | None:
    """The result of a call that must not run now, or None to run it: after Ctrl+C (or
    with a steer queued) calls not started are answered so; a call ``started`` early
    (`Dispatcher`) keeps its real result; a malformed call is refused."""
    if (interrupted or steered) and not started:
        return ToolOutcome(
            False, STEERED_TEXT if not interrupted else INTERRUPTED_TEXT, INTERRUPTED
        )
    if call.id in call_errors:
        return ToolOutcome(
            False,
            f"error: malformed tool call ({call_errors[call.id]}); it was not run. "
            "Call the tool again with well-formed DSML.",
            "invalid_arguments",
        )
    return None
