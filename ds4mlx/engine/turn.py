"""The one turn loop: prefill a planned suffix, then sample → feed until the turn ends.

Every generation in ds4mlx runs here — the server's worker, the agent, ``ds4mlx
generate`` and ``ds4mlx bench`` — so the rules below hold everywhere:

- **Feeding rule.** Every sampled token is fed back into the session except the one
  that ends the turn (EOS, the token that completes a stop string, the last token
  allowed by ``max_tokens``, a token for which the context has no room). The live state
  therefore ends exactly where the next rendered turn begins (its suffix starts with
  ``<｜end▁of▁sentence｜>``). One exception: a ``cap_is_eos`` cap (``serve --demo``)
  stands in for an EOS the noise model never samples, so its last token is fed and the
  state ends as after a natural end of turn.
- **Protocol structure is sampled greedily** (``StreamDecoder.in_structure``: DSML
  markers, parameter headers, JSON punctuation); payload uses the request's sampling.
- **Forced tool calls** (``tool_required``): once the visible reply starts (at once in
  chat mode, after ``</think>`` in thinking mode) the tool-call block opener is fed as
  if sampled; it is part of the live state and of the call's sampled DSML.
- **Stop strings** apply to visible text only; the matcher holds back a possible
  prefix of a stop, so what was emitted never contains one.
- **Cancellation** is polled before every prefill chunk and every token; the session is
  left consistent (it holds what was fed).

- **Extension points** (`TurnHooks`): per-step polls (steering, cancel), a per-step
  logits mask, a draft→verify step, and one forced-feed call (`Turn.force_feed`: a
  block closer, ``</think>`` when a cut turn is closed) plug into the loop from
  outside; the loop class does not grow for them.

The engine knows no protocol: the loop emits the `ds4mlx.dsml` decoder events
(``ThinkingDelta``, ``TextDelta``, ``ToolCall*``, ``ParseError``) for chat turns, and the
neutral `RawText` / `TokenLogprob` defined here; callers map them to their own
vocabulary (``ds4mlx.server.worker`` to job events, the agent to its UI).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from ds4mlx.dsml import (
    DecodeResult,
    ParseError,
    StopMatcher,
    StreamDecoder,
    TextDelta,
    ThinkingDelta,
    ToolCall,
    ToolCallEnd,
    ToolCallStart,
    ToolSpec,
)
from ds4mlx.dsml.tokens import INVOKE_OPEN, TOOL_CALLS_OPEN, TOOL_CALLS_SEP
from ds4mlx.engine.hooks import TurnHooks, chain_hooks
from ds4mlx.engine.sampling import SamplingParams
from ds4mlx.engine.session import DEFAULT_CHUNK, Session
from ds4mlx.engine.single_call import SingleCall
from ds4mlx.engine.speculative import Drafting
from ds4mlx.engine.thinking_budget import ThinkingBudget

# Finish reasons of a turn (`TurnResult.finish`).
FINISH_STOP = "stop"  # EOS sampled (or a cap_is_eos cap reached)
FINISH_STOP_SEQUENCE = "stop_sequence"  # a stop string completed in the visible text
FINISH_LENGTH = "length"  # max_tokens sampled
FINISH_CONTEXT = "context"  # the context has no room for the last sampled token
FINISH_CANCELLED = "cancelled"  # cancel() returned True (prefill or decode)
FINISH_STEERED = "steered"  # a steer poll held at a boundary (ds4mlx.engine.steer)


@dataclass(frozen=True)
class TurnSpec:
    """What to generate (no JSON, no HTTP: callers build it from their requests).

    Attributes:
        sampling: `SamplingParams` for payload tokens.
        max_tokens: most tokens to sample (>= 0).
        parse: decode thinking / text / DSML tool calls (``StreamDecoder``); False for
            raw text (``/v1/completions``, ``generate --raw``, benchmarks).
        thinking: the prompt opened ``<think>`` (reasoning comes first).
        tools: the `ToolSpec`s offered (the decoder maps arguments by their schemas).
        id_prefix: prefix of new tool-call ids (``toolu_`` / ``call_``).
        stops: stop strings, matched in visible text.
        tool_required: force a tool call (see the module doc).
        tool_name: with ``tool_required``, the tool whose name is forced too, or None.
        calls: False for the client's ``tool_choice: none``: a tool-call block the model
            writes anyway is dropped (``StreamDecoder(calls=False)``: no call, no text;
            `TurnResult.dropped_calls` counts them).
        parallel_calls: False for a client that allows one call per turn: the turn ends
            after the first closed invoke, its block closed by forced feeds
            (`ds4mlx.engine.single_call`; `run_turn` chains it before the given hooks).
        logprobs: raw turns: top-N alternatives per token (`RawText.logprobs`), or None.
        top_logprobs: chat turns: top-N alternatives per token of the visible text (a
            `TokenLogprob` event before the text it completes; a token counts when its
            text starts inside what the client sees), or None. Reasoning, tool-call
            tokens (DSML markup and arguments alike) and a separator held back as part
            of the tool-call opener get none.
        greedy_after_script: argmax once a scripted continuation runs out (tests).
        cap_is_eos: reaching ``max_tokens`` ends the turn as ``stop`` and feeds the
            last token (``serve --demo``).
        ignore_eos: EOS is an ordinary token (benchmarks that need N decode steps).
        pipeline: build each decode step's graph while the previous one evaluates
            (`Session.begin_decode`); False feeds token by token, synchronously. Both
            leave exactly the same state.
        grammar: an ``ds4mlx.engine.grammar.Grammar`` the reply (after ``</think>``) must
            follow: its mask wraps the turn's hooks (`Grammar.hooks`), or None; it masks
            drafted positions too (each verify row after the accepted tokens before it).
        thinking_budget: with ``thinking``, the most reasoning tokens before
            ``</think>`` is fed (`ds4mlx.engine.thinking_budget`), or None (no cap).
        prompt_logprobs: score the prompt: each prefilled token's logprob with this
            many alternatives (a `PromptLogprobs` event after the prefill, before any
            sampled token), or None. The caller prefills the whole prompt (a token
            the session already held is not scored).
    """

    sampling: SamplingParams
    max_tokens: int
    parse: bool = True
    thinking: bool = False
    tools: Sequence[ToolSpec] = ()
    id_prefix: str = "toolu_"
    stops: Sequence[str] = ()
    tool_required: bool = False
    tool_name: str | None = None
    calls: bool = True
    parallel_calls: bool = True
    logprobs: int | None = None
    top_logprobs: int | None = None
    greedy_after_script: bool = False
    cap_is_eos: bool = False
    ignore_eos: bool = False
    pipeline: bool = True
    grammar: Any = None
    thinking_budget: int | None = None
    prompt_logprobs: int | None = None


class PrefillPlan(Protocol):
    """What to prefill before sampling (``ds4mlx.kv.plan.Plan`` satisfies it).

    ``suffix_tokens``: ids to append to the session as it is; ``checkpoints``: absolute
    token counts where the prefill pauses to call ``on_checkpoint(session, n)``.
    """

    suffix_tokens: list[int]
    checkpoints: list[int]
    on_checkpoint: Callable[[Session, int], Any] | None


@dataclass
class TokenLogprob:
    """Log-probability of one sampled token and its top alternatives (natural log).

    ``token``: id; ``logprob``: its log-softmax under the logits it was sampled from
    (float32, before temperature/filters); ``top``: ``(id, logprob)`` of the most likely
    tokens, most likely first.
    """

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class PromptLogprobs:
    """The scored prompt (`TurnSpec.prompt_logprobs`): one entry per prefilled token, in
    order: its `TokenLogprob` under the logits it was predicted from, or None for a
    first token nothing predicted (the session held no logits before it)."""

    entries: list[TokenLogprob | None]


@dataclass
class RawText:
    """Raw generated text (``parse=False``): complete UTF-8 only.

    ``tokens``: the ids this text completes (several when a character spans tokens);
    ``logprobs``: one `TokenLogprob` per id when ``TurnSpec.logprobs`` is set. With
    logprobs, a sampled EOS is listed too (it adds no text), as vLLM lists it: one entry
    per generated token, which lm-eval's scoring requests count on
    (``token_logprobs[ctxlen:-1]``).
    """

    text: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class TurnResult:
    """How a turn went.

    Attributes:
        finish: one of the ``FINISH_*`` names.
        stop_sequence: the stop string matched, or None.
        prefilled: suffix tokens fed by the prefill (less than planned when cancelled).
        prefill_s: seconds spent prefilling.
        completion_tokens: tokens sampled (fed or not).
        fed: generated tokens fed into the session.
        reasoning_tokens: tokens sampled before ``</think>`` (thinking turns).
        decoded: the decoder's `DecodeResult` (``parse`` turns), else None.
        tool_calls: calls whose DSML block closed, in order (a call cut by the end of
            the turn is left out: it is never presented as runnable).
        call_errors: id → why that call must not run (its DSML needed repair, or was
            cut by the end of the turn).
        dropped_calls: calls the model wrote under ``TurnSpec.calls`` False (never
            reported; the live state holds their tokens).
        reasoning: the reasoning text sampled.
        text: the visible text emitted (after stop strings).
        raw: the whole generated text, as sampled.
        decode_s: seconds from the first sampled token to the end.
        forced: tokens fed by `Turn.force_feed` after the loop ended (in ``fed`` and
            ``raw``, not in ``completion_tokens``).
        drafted: drafted tokens the loop checked (`ds4mlx.engine.speculative`).
        accepted: drafted tokens that matched the sampled ones.
        forwards: target forward passes of the decode (verifies and re-feeds
            included): ``fed / forwards`` is the tokens per target forward.
        grammar: how ``TurnSpec.grammar`` went (``ds4mlx.engine.grammar``): ``""`` (no
            grammar), ``unstarted`` (the reasoning never ended), ``complete`` (the
            reply is a sentence of the grammar), ``incomplete`` (a prefix of one: cut),
            ``violated`` (a scripted or forced token left it; no validity claimed).
    """

    finish: str
    stop_sequence: str | None = None
    prefilled: int = 0
    prefill_s: float = 0.0
    completion_tokens: int = 0
    fed: int = 0
    reasoning_tokens: int = 0
    decoded: DecodeResult | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    call_errors: dict[str, str] = field(default_factory=dict)
    dropped_calls: int = 0
    reasoning: str = ""
    text: str = ""
    raw: str = ""
    decode_s: float = 0.0
    forced: int = 0
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    grammar: str = ""


_NO_HOOKS = TurnHooks()


def _best(
    rows: mx.array, top_n: int, shift: list[float] | None = None
) -> list[list[tuple[int, float]]]:
    """The ``top_n`` best ``(id, value)`` pairs of each row ``(R, vocab)``, best first
    (``top_n`` <= 0: empty lists); ``shift``: a value per row subtracted from its pairs'
    (logits less their logsumexp are logprobs)."""
    if top_n <= 0:
        return [[] for _ in range(rows.shape[0])]
    idx = mx.argpartition(-rows, top_n - 1, axis=-1)[:, :top_n]
    vals = mx.take_along_axis(rows, idx, axis=-1)
    mx.eval(idx, vals)
    shift = shift or [0.0] * rows.shape[0]
    return [
        sorted(((int(i), float(v) - d) for i, v in zip(ids, vs, strict=True)), key=lambda p: -p[1])
        for ids, vs, d in zip(idx.tolist(), vals.tolist(), shift, strict=True)
    ]


def top_logprobs(logits: mx.array, top_n: int) -> tuple[mx.array, list[tuple[int, float]]]:
    """Log-softmax of float32 ``logits`` ``(vocab,)`` and its ``top_n`` best ``(id, logprob)``
    pairs, most likely first (``top_n`` 0: empty list)."""
    lps = logits.astype(mx.float32)
    lps = lps - mx.logsumexp(lps, keepdims=True)
    return lps, _best(lps[None], top_n)[0]


def score_rows(rows: mx.array, targets: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """The `TokenLogprob` of each of ``targets`` (ids) under the float32 logits row
    ``(k, vocab)`` that predicted it, with ``top_n`` alternatives (log-softmax over the
    vocabulary, natural log, as `top_logprobs`)."""
    if not targets:
        return []
    rows = rows.astype(mx.float32)
    # No log-softmax of the whole rows: a logprob is the logit less its row's logsumexp,
    # and the best logits are the best logprobs (``k × vocab`` floats spared: 1 GB at
    # 2,000 rows of Flash's vocabulary).
    lse = mx.logsumexp(rows, axis=-1, keepdims=True)
    picked = mx.take_along_axis(rows, mx.array(list(targets), dtype=mx.int32)[:, None], axis=-1)
    picked = (picked - lse)[:, 0]
    tops = _best(rows, top_n, lse[:, 0].tolist())
    return [
        TokenLogprob(int(t), float(v), top)
        for t, v, top in zip(targets, picked.tolist(), tops, strict=True)
    ]


def _forced_opener(spec: TurnSpec) -> str | None:
    """The DSML a forced tool choice feeds once the reply starts (``tool_choice``
    required or a named tool): the block opener up to the invoke's name, or None."""
    if not (spec.parse and spec.tool_required and spec.tools):
        return None
    text = f'{TOOL_CALLS_SEP}{TOOL_CALLS_OPEN}\n{INVOKE_OPEN} name="'
    return text + f'{spec.tool_name}">\n' if spec.tool_name else text


def _decoder(spec: TurnSpec) -> StreamDecoder | None:
    """The turn's DSML decoder, or None for a raw turn (``parse`` off: completions)."""
    if not spec.parse:
        return None
    return StreamDecoder(
        spec.thinking, list(spec.tools), id_prefix=spec.id_prefix, calls=spec.calls
    )


class Turn:
    """One running turn (see `run_turn`), as `TurnHooks` receive it: read-only except
    through `force_feed` (``s``: the `Session`, ``tok``, ``spec``, ``result``: the
    `TurnResult` so far, ``in_thinking``: inside the reasoning block, `raw_text`)."""

    def __init__(
        self, session: Session, tokenizer, spec: TurnSpec, emit, cancel, tool_memory, hooks=None
    ):
        self.s, self.tok, self.spec = session, tokenizer, spec
        self.hooks: TurnHooks = hooks or _NO_HOOKS
        self.drafting = Drafting.for_turn(session, self.hooks)
        self.ended = False
        self.emit = emit
        self.cancel = cancel or (lambda: False)
        self.tool_memory = tool_memory
        self.decoder = _decoder(spec)
        self.stopper = StopMatcher(spec.stops)
        self.detok = tokenizer.detokenizer()
        self.result = TurnResult(FINISH_LENGTH)
        self.in_thinking = spec.thinking and spec.parse
        self.raw: list[str] = []
        self.visible: list[str] = []
        self.reasoning: list[str] = []
        self.pending_ids: list[int] = []
        self.pending_lp: list[TokenLogprob] = []
        # Chat logprobs: (offset of the token's text in the reply after </think>, entry); a
        # token whose text starts past what was shown (DSML markup, a held-back separator,
        # text after a stop string) never gets an entry: the visible text is a prefix.
        self.lp_queue: collections.deque[tuple[int, TokenLogprob]] = collections.deque()
        self.reply_chars = 0
        self.shown = 0
        self.open_errors: list[str] = []
        self.in_call = False
        self.forced: collections.deque[int] = collections.deque()
        self.force_text = _forced_opener(spec)
        if not self.in_thinking:
            self._open_forced()

    # ---- events

    def raw_text(self) -> str:
        """The text generated so far (as sampled, forced feeds included)."""
        return "".join(self.raw)

    @property
    def in_structure(self) -> bool:
        """The next token is tool-call structure (`StreamDecoder.in_structure`): it is
        sampled greedily and no penalty moves it, so no sampling wish breaks a call."""
        return self.decoder is not None and self.decoder.in_structure

    def force_feed(self, ids: Sequence[int]) -> int:
        """The one forced-feed call: ``ids`` go into the session as if sampled, through
        the detokenizer and decoder (their events are emitted).

        While the loop runs they are the next steps' tokens (sampling skipped; counted
        as completion tokens, as the forced tool-call opener is). Once the turn ended
        (`TurnHooks.at_end`) they are fed at once, as far as the context has room, and
        counted in ``result.fed`` and ``result.forced``. Returns how many were fed or
        queued.
        """
        ids = list(ids)
        if not self.ended:
            self.forced.extend(ids)
            return len(ids)
        ids = ids[: max(0, self.s.room())]
        if ids:
            self.s.prefill(ids)
            for t in ids:
                self._text_of(t, None)
            self.result.fed += len(ids)
            self.result.forced += len(ids)
        return len(ids)

    def _open_forced(self) -> None:
        if self.force_text is not None:
            self.force_feed(self.tok.encode(self.force_text))
            self.force_text = None

    def _emit_text(self, text: str) -> None:
        self.visible.append(text)
        self.shown += len(text)
        # Logprobs cover the tokens whose text the client sees: a token's entry goes out
        # (before the text it completes) once the visible text reaches its first char.
        while self.lp_queue and self.lp_queue[0][0] < self.shown:
            self.emit(self.lp_queue.popleft()[1])
        self.emit(TextDelta(text))

    def _track_call(self, ev: Any) -> None:
        """A call whose DSML needed any repair is marked not runnable (`call_errors`)."""
        if isinstance(ev, ToolCallStart):
            self.in_call = True
            self.open_errors.clear()
        elif isinstance(ev, ParseError) and self.in_call:
            self.open_errors.append(ev.message)
        elif isinstance(ev, ToolCallEnd):
            self.in_call = False
            errs = ([ev.error] if ev.error else []) + [e for e in self.open_errors if e != ev.error]
            if errs:
                self.result.call_errors[ev.call.id] = "; ".join(errs)
            if ev.closed:  # a call cut by the end of the turn is never runnable
                self.result.tool_calls.append(ev.call)
            if ev.call.dsml and self.tool_memory is not None:
                self.tool_memory.put(ev.call.id, ev.call.dsml)

    def _out(self, events: list[Any]) -> bool:
        """Forward decoder events through the stop matcher; True once a stop matched."""
        for ev in events:
            if isinstance(ev, TextDelta):
                text, hit = self.stopper.feed(ev.text)
                if text:
                    self._emit_text(text)
                if hit:
                    return True
                continue
            held = self.stopper.flush()
            if held:
                self._emit_text(held)
            if isinstance(ev, ThinkingDelta):
                self.reasoning.append(ev.text)
            self._track_call(ev)
            self.emit(ev)
        return False

    def _stop_matched(self) -> None:
        self.result.finish = FINISH_STOP_SEQUENCE
        self.result.stop_sequence = self.stopper.matched

    # ---- one token

    def _text_of(self, t: int, lp: TokenLogprob | None) -> bool:
        """Emit the text token ``t`` completes; True when it completed a stop string."""
        piece = self.detok.add(t)
        self.raw.append(piece)
        if self.decoder is not None:
            if lp is not None:  # held until the visible text reaches this token
                self.lp_queue.append((self.reply_chars, lp))
                self.reply_chars += len(piece)
            return self._out(self.decoder.feed(piece))
        self.pending_ids.append(t)
        if lp is not None:
            self.pending_lp.append(lp)
        if not piece:
            return False
        text, hit = self.stopper.feed(piece)
        if text or hit:
            self.emit(RawText(text, self.pending_ids, self.pending_lp))
            self.pending_ids, self.pending_lp = [], []
        return hit

    def logprob_for(self, logits: mx.array | None = None) -> Callable[[int], TokenLogprob] | None:
        """``f(token) -> TokenLogprob`` under ``logits`` (default: the session's), when
        the spec asks for logprobs of this token."""
        spec = self.spec
        n = spec.top_logprobs if spec.parse else spec.logprobs
        if n is None or (spec.parse and self.in_thinking):
            return None
        lps, top = top_logprobs(self.s.logits if logits is None else logits, n)
        return lambda t: TokenLogprob(t, float(lps[t].item()), top)

    def _sample(self, greedy_after_script: bool) -> tuple[mx.array, Callable | None]:
        """The next token as a lazy array (forced, scripted or sampled, its evaluation
        launched) and ``f(token) -> TokenLogprob`` under the current logits if asked."""
        lp_fn = self.logprob_for()
        if self.forced:
            return mx.array(self.forced.popleft(), dtype=mx.uint32), lp_fn
        greedy = greedy_after_script or self.in_structure
        masked = self.hooks.mask(self, self.s.logits) if self.s.logits is not None else None
        return self.s.sample_async(self.spec.sampling, greedy=greedy, logits=masked), lp_fn

    def _ends_turn(self, n: int) -> str | None:
        """The finish reason if the ``n``-th sampled token ends the turn, else None.

        Only ``FINISH_STOP`` (a ``cap_is_eos`` cap) ends a turn with its token fed: the
        cap stands in for an EOS, so the state must end as after a natural end of turn;
        and only where an EOS could come (`TurnHooks.may_end`: a cap inside a strict
        tool call is a cut, not an end).
        """
        spec = self.spec
        if n >= spec.max_tokens:
            eos = spec.cap_is_eos and self.s.room() >= 1 and self.hooks.may_end(self)
            return FINISH_STOP if eos else FINISH_LENGTH
        if self.s.room() < 1:
            return FINISH_CONTEXT
        return None

    def poll(self) -> str | None:
        """The finish reason polled before each sampled token (cancel, `before_step`,
        ``max_tokens``), or None."""
        if self.cancel():
            return FINISH_CANCELLED
        stop = self.hooks.before_step(self)
        if stop is not None or self.result.completion_tokens < self.spec.max_tokens:
            return stop
        return FINISH_LENGTH

    def handle(self, t: int, lp: TokenLogprob | None) -> tuple[str | None, bool]:
        """Account for the next sampled token ``t`` (events, stops, DSML state):
        ``(finish reason or None, feed it?)``. The caller feeds it."""
        spec, r = self.spec, self.result
        self.hooks.on_token(self, t)
        r.completion_tokens += 1
        if self.in_thinking:
            r.reasoning_tokens += 1
            if t == self.tok.think_end_id:
                self.in_thinking = False
                self._open_forced()
        if t == self.tok.eos_id and not spec.ignore_eos:
            if self.decoder is None and lp is not None:  # listed (`RawText`)
                self.pending_ids.append(t)
                self.pending_lp.append(lp)
            return FINISH_STOP, False
        if self._text_of(t, lp):
            self._stop_matched()
            return FINISH_STOP_SEQUENCE, False
        if self.in_thinking and self.decoder is not None and self.decoder.tool_block_closed:
            # A complete tool-call block opened before </think> is the turn's calls: the
            # reasoning ended where it began, and a forced call is already there.
            self.in_thinking = False
            self.force_text = None
        end = self._ends_turn(r.completion_tokens)
        return end, end in (None, FINISH_STOP)

    # ---- the loop

    def generate(self, after_token) -> None:
        """Sample and feed until the turn ends. Pipelined (``spec.pipeline``): the forward
        pass of token N is built while token N is being sampled and launched
        (``mx.async_eval``) once the token is known not to end the turn, and the next
        graph is built while it evaluates; a step whose token ends the turn is abandoned
        unevaluated (feeding rule). On MLX's CPU backend ``async_eval`` returns only when
        little work remains, so the overlap shows on a GPU."""
        spec, s, r = self.spec, self.s, self.result
        t0 = time.monotonic()
        t_first = None
        after = after_token or (lambda _s: None)
        while (end := self.poll()) is None:
            t_arr, lp_fn = self._sample(spec.greedy_after_script)
            drafting = self.drafting is not None and self.drafting.ready(self)
            step = s.begin_decode(t_arr) if spec.pipeline and not drafting else None
            fed = False
            try:
                t = int(t_arr.item())
                t_first = t_first or time.monotonic()
                end, fed = self.handle(t, lp_fn(t) if lp_fn else None)
                if fed and step is not None:
                    s.commit(step, t)
            finally:
                if step is not None and not fed:
                    s.abandon(step)
            if fed and drafting:  # feeds t, maybe with verified drafts after it
                end = self.drafting.feed(self, t, end, after)
            elif fed:
                if step is None:
                    s.decode(t)
                r.fed += 1
                r.forwards += 1
                after(s)
            if end is not None:
                break
        r.finish = end
        s.sync()
        self.ended = True
        self.hooks.at_end(self)
        self._flush()
        r.decode_s = time.monotonic() - (t_first or t0)

    def _flush(self) -> None:
        """Flush what the detokenizer, decoder and stop matcher still hold."""
        r = self.result
        if r.finish == FINISH_STOP_SEQUENCE:
            return
        tail = self.detok.flush()
        self.raw.append(tail)
        if self.decoder is not None:
            evs = (self.decoder.feed(tail) if tail else []) + self.decoder.finish()
            if self._out(evs):
                self._stop_matched()
            held = self.stopper.flush()
            if held:
                self._emit_text(held)
            return
        text, hit = self.stopper.feed(tail) if tail else ("", False)
        text += self.stopper.flush() if not hit else ""
        if text or self.pending_ids:
            self.emit(RawText(text, self.pending_ids, self.pending_lp))
        if hit:
            self._stop_matched()

    def finish(self) -> TurnResult:
        r = self.result
        r.raw = "".join(self.raw)
        r.text = "".join(self.visible)
        r.reasoning = "".join(self.reasoning)
        if self.decoder is not None:
            r.decoded = self.decoder.result
            r.dropped_calls = self.decoder.dropped_calls
        if not self.spec.thinking:
            r.reasoning_tokens = 0
        return r


def run_turn(
    session: Session,
    tokenizer,
    spec: TurnSpec,
    *,
    prefill: PrefillPlan | Sequence[int] | None = None,
    emit: Callable[[Any], Any] | None = None,
    cancel: Callable[[], bool] | None = None,
    progress: Callable[[int, int], Any] | None = None,
    tool_memory=None,
    after_token: Callable[[Session], Any] | None = None,
    script: Sequence[int] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    hooks: TurnHooks | Sequence[TurnHooks] | None = None,
) -> TurnResult:
    """Prefill ``prefill`` onto ``session``, then generate one turn per ``spec``.

    Args:
        session: the live `Session` (already holding the kept prefix).
        tokenizer: the engine's ``ds4mlx.tokenizer.Tokenizer``.
        spec: what to generate.
        prefill: a `PrefillPlan` (suffix + disk checkpoints), plain token ids, or None.
        emit: receives every event (decoder events, `RawText`, `TokenLogprob`) on this
            thread, in order.
        cancel: polled before each prefill chunk and each token.
        progress: ``progress(done, total)`` in prefill tokens.
        tool_memory: a ``ds4mlx.dsml.ToolMemory``; each closed call's sampled DSML is put
            there by id.
        after_token: ``f(session)`` after each generated token is fed (disk saves).
        script: scripted decoding (tests only): ``sample`` returns these ids first; the
            forward pass still runs for every fed token.
        chunk_size: prefill tokens per forward pass.
        hooks: the loop's extension points (`TurnHooks`, or several: `chain_hooks`), or
            None; with ``spec.parallel_calls`` False `ds4mlx.engine.single_call.SingleCall`
            runs first, then a ``spec.thinking_budget``'s
            `ds4mlx.engine.thinking_budget.ThinkingBudget`.
    Returns:
        The `TurnResult`; ``finish`` is ``cancelled`` when a prefill was cut short (then
        nothing was sampled, and no hook but ``after_prefill`` ran) or when ``cancel``
        held before the first token (then ``TurnHooks.at_end`` ran: a cut turn is
        closed the same way wherever it was cut).
    Raises:
        ds4mlx.engine.ContextOverflowError: the prefill does not fit; nothing was fed.
        RuntimeError: the session has no logits after the prefill (empty prompt).
    """
    emit = emit or (lambda _ev: None)
    single = SingleCall() if spec.parse and not spec.parallel_calls else None
    budget = None
    if spec.parse and spec.thinking and spec.thinking_budget is not None:
        budget = ThinkingBudget(spec.thinking_budget)
    hooks = chain_hooks(single, budget, hooks)
    if spec.grammar is not None:  # its mask around the caller's hooks
        hooks = spec.grammar.hooks(hooks or _NO_HOOKS)
    turn = Turn(session, tokenizer, spec, emit, cancel, tool_memory, hooks)
    if prefill is not None:
        suffix = list(getattr(prefill, "suffix_tokens", prefill))
        scored: list[TokenLogprob] = []
        on_rows = None
        if spec.prompt_logprobs is not None:
            n = spec.prompt_logprobs

            def on_rows(rows: mx.array, targets: list[int]) -> None:
                scored.extend(score_rows(rows, targets, n))

        t0 = time.monotonic()
        try:
            turn.result.prefilled = session.prefill(
                suffix,
                chunk_size=chunk_size,
                progress=progress,
                cancel=cancel,
                checkpoints=getattr(prefill, "checkpoints", ()),
                on_checkpoint=getattr(prefill, "on_checkpoint", None),
                on_rows=on_rows,
            )
        finally:
            turn.result.prefill_s = time.monotonic() - t0
            turn.hooks.after_prefill(turn)
        if turn.result.prefilled < len(suffix):
            turn.result.finish = FINISH_CANCELLED
            return turn.finish()
        if on_rows is not None:  # a first token with no logits before it is unscored
            emit(PromptLogprobs([None] * (len(suffix) - len(scored)) + scored))
    if session.logits is None:
        raise RuntimeError("no logits to sample from: the prompt is empty")
    if spec.sampling.seed is not None:
        session.seed(spec.sampling.seed)
    session.set_script(script)
    try:
        turn.generate(after_token)
    finally:
        session.set_script(None)
    return turn.finish()
