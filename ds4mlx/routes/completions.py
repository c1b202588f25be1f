"""OpenAI legacy Completions: ``POST /v1/completions`` (raw text, no chat template).

Reference: https://platform.openai.com/docs/api-reference/completions/create (prompt as
text or token ids, or a list of several: one choice each, at its index; ``logprobs``
top-N, ``echo``). ``echo`` with ``logprobs`` scores the prompt (every echoed token's
logprob but the first of a prompt with nothing before it: what evaluation harnesses such
as lm-eval's ``local-completions`` read, with ``max_tokens`` 1, or 0 for the prompt
alone). Streaming uses ``text_completion``
SSE frames ending with ``data: [DONE]``. One encoder (`CompletionEncoder`) serves the
stream and the JSON body alike. The prompt is raw: special-token spellings in it are
tokens (users write templates here), and no conversation is involved, so no tool
results and no live tool continuation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError
from quart import Blueprint, request

from ds4mlx.dsml.tokens import BOS
from ds4mlx.jobs import (
    GenRequest,
    JobDone,
    JobFailed,
    JobStarted,
    PromptLogprobs,
    RawText,
    TokenLogprob,
    TurnSpec,
)
from ds4mlx.routes import constraints
from ds4mlx.routes.body import offload, parse, read_body
from ds4mlx.routes.common import json_response, model_thinking, new_id, now, state
from ds4mlx.routes.errors import APIError, Wording, context_error, failed_to_api, openai_error
from ds4mlx.routes.openai import (
    SamplingFields,
    check_min_tokens,
    finish_of,
    sampling_wishes,
    shutdown_events,
    stops_of,
    usage_of,
)
from ds4mlx.routes.pipeline import (
    bound,
    check_end_ban,
    constrain,
    respond,
    sampling_params,
    stream,
    tokenize,
    turn_limit,
)
from ds4mlx.routes.sse import sse

bp = Blueprint("completions", __name__)

# Raw prompts have no tool results: only the field the context error names.
NAMES = Wording(param="prompt")
# Prompts one request may carry (lm-eval's ``batch_size``): each is its own job.
MAX_PROMPTS = 128


@dataclass
class _Choice:
    """One prompt of a request: its job, echo text and echoed ids."""

    gen: GenRequest
    echo_text: str
    echo_ids: list[int]


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions`` (unknown fields tolerated)."""

    model: str = ""
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 only with ``echo`` (the prompt scored, nothing generated; `_jobs`).
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    # Fill-in-the-middle: DeepSeek V4's prompt format defines no template for it (its
    # tokenizer keeps older models' FIM tokens, which V4's encoder never writes), so a
    # suffix is refused rather than dropped (`_job`).
    suffix: str | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_kind(cls, v: Any, handler) -> Any:
        """A list prompt holds one kind of item: pydantic's union names a mixed list's
        first item as "not a valid string", which may be a valid token-id prompt. Looked
        at only when the prompt fails (a valid one of 100k ids is not walked twice)."""
        try:
            return handler(v)
        except ValidationError:
            kinds = (
                {type(x) for x in v if isinstance(x, str | int | list)}
                if isinstance(v, list)
                else set()
            )
            if len(kinds) > 1:
                raise PydanticCustomError(
                    "mixed_prompt",
                    "a list prompt holds strings, token ids or lists of token ids, not a mix",
                ) from None
            raise


def _echo_logprobs(tok, ids: list[int], scored: PromptLogprobs) -> dict[str, Any]:
    """``logprobs`` entries of the echoed prompt tokens ``ids`` (the prompt's last
    ``len(ids)``: a text prompt's BOS is not echoed) from the scored prompt: a first
    token nothing predicted gets null, as OpenAI gives it."""
    entries = scored.entries[len(scored.entries) - len(ids) :]
    return _logprobs_obj(list(zip(ids, entries, strict=True)), tok, tok.detokenizer(), 0)[0]


def _token_text(tok, t: int) -> str:
    """A token's text in ``logprobs``: its text, or for a part of a UTF-8 character
    ``bytes:\\xNN…`` (OpenAI's spelling; the U+FFFD ``decode`` gives would make every
    such part the same key of ``top_logprobs``)."""
    raw = tok.token_bytes(t)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return tok.decode([t])


def _logprobs_obj(
    pairs: list[tuple[int, TokenLogprob | None]], tok, detok, offset: int
) -> tuple[dict[str, Any], int]:
    """``logprobs`` entries of ``(id, TokenLogprob or None)`` pairs (None: null logprob
    and alternatives), and the text offset after them. ``text_offset``: where each
    token's text starts in the text, counted by ``detok`` (a `Detokenizer` that went
    through the tokens before, at ``offset``): a part of a character starts where that
    character does. ``top_logprobs`` keeps each text's most likely token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, e in pairs:
        tokens.append(_token_text(tok, t))
        offsets.append(offset)
        offset += len(detok.add(t))
        token_lps.append(None if e is None else e.logprob)
        top: dict[str, float] | None = None
        if e is not None:
            top = {}
            for i, v in e.top:  # most likely first
                top.setdefault(_token_text(tok, i), v)
        tops.append(top)
    obj = {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return obj, offset


class CompletionEncoder:
    """Job events → ``text_completion`` frames, and (fed everything) the response body.

    ``echo``: the prompt text sent first ("" without ``echo``); ``echo_ids``: its token
    ids, scored (their entries come with the job's `PromptLogprobs`, and the echo waits
    for it) when ``logprobs`` is set; ``logprobs``: the request's top-N, or None.
    """

    def __init__(
        self,
        meta: dict[str, Any],
        *,
        echo: str,
        echo_ids: list[int],
        logprobs: int | None,
        include_usage: bool,
        tokenizer=None,
        index: int = 0,
    ):
        self.meta = meta
        self.index = index  # the prompt's place in the request
        self.tokenizer = tokenizer  # the ids of logprobs → texts (needed with logprobs)
        self.echo = echo
        self.echo_ids = echo_ids
        self.scored = bool(echo) and logprobs is not None
        self.echo_logprobs: dict[str, Any] | None = None
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.offset = len(echo)
        self.detok = tokenizer.detokenizer() if tokenizer is not None else None
        self.text: list[str] = []
        self.lp: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def _chunk(self, text: str, lp=None, finish=None) -> dict[str, Any]:
        choice = {"text": text, "index": self.index, "logprobs": lp, "finish_reason": finish}
        return {**self.meta, "choices": [choice]}

    def frame(self, ev: dict[str, Any] | str) -> bytes:
        return sse(ev)

    def opening(self) -> list[Any]:
        return [self._chunk(self.echo)] if self.echo and not self.scored else []

    def idle(self) -> None:
        return None

    def started(self, e: JobStarted) -> list[Any]:
        return []

    def feed(self, e: Any) -> list[Any]:
        if isinstance(e, PromptLogprobs) and self.scored:
            self.echo_logprobs = _echo_logprobs(self.tokenizer, self.echo_ids, e)
            return [self._chunk(self.echo, self.echo_logprobs)]
        if not isinstance(e, RawText):
            return []
        self.text.append(e.text)
        lp = None
        if self.logprobs is not None:
            pairs = [(x.token, x) for x in e.logprobs]
            lp, self.offset = _logprobs_obj(pairs, self.tokenizer, self.detok, self.offset)
            for k, v in lp.items():
                self.lp[k] += v
        return [self._chunk(e.text, lp)]

    def done(self, e: JobDone) -> list[Any]:
        if e.finish == "cancelled":  # it ended "stop", as if the text were whole
            return shutdown_events()
        self.finish = finish_of(e, False)
        self.usage = usage_of(e)
        out = [self._chunk("", None, self.finish)]
        if self.include_usage:
            out.append({**self.meta, "choices": [], "usage": self.usage})
        return [*out, "[DONE]"]

    def failed(self, e: JobFailed) -> list[Any]:
        return [openai_error(failed_to_api(e, NAMES)), "[DONE]"]

    def result(self) -> dict[str, Any]:
        lp = None
        if self.logprobs is not None:
            head = self.echo_logprobs
            lp = {k: head[k] + v for k, v in self.lp.items()} if head else self.lp
        text = self.echo + "".join(self.text)
        choice = {"text": text, "index": self.index, "logprobs": lp, "finish_reason": self.finish}
        return {**self.meta, "choices": [choice], "usage": self.usage}


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one text or token-id list, or a list of several (each
    answered by its own choice, at its index).

    Raises:
        APIError: 400 for more than `MAX_PROMPTS` (an empty one is `_prompt`'s 400).
    """
    p = req.prompt
    if not (isinstance(p, list) and p and isinstance(p[0], list | str)):
        return [p]
    if len(p) > MAX_PROMPTS:
        raise APIError(
            400,
            f"prompt: {len(p)} prompts in one request; at most {MAX_PROMPTS} (they run one "
            "after another: send the rest in further requests)",
            param="prompt",
        )
    return list(p)


def _prompt(
    p: str | list[int], tok, param: str = "prompt", room: int = 1
) -> tuple[str | None, list[int], str, list[int]]:
    """``(prompt text or None, prompt ids, echo text, echoed ids)`` of one prompt (call
    off the event loop: a text prompt is bounded (`bound`), then tokenized). ``param``:
    the prompt's field path in errors (``prompt.1`` for the second of several);
    ``room``: tokens the job needs after it (0: scored, nothing generated).

    A text prompt gets BOS prepended unless it starts with it; token-id prompts are
    used as given.

    Raises:
        APIError: 400 for an empty prompt, an id outside the vocabulary, or a prompt the
            context cannot hold (before anything is queued: with several prompts, a bad
            last one must not cost the others' generation).
    """
    if isinstance(p, str):
        text = p if p.startswith(BOS) else BOS + p
        bound(text, param, room)
        toks = tokenize(text)
        return text, toks, p, toks if p.startswith(BOS) else toks[1:]
    toks = list(p)
    bad = [t for t in toks if not 0 <= t < tok.vocab_size]
    if bad:
        raise APIError(
            400,
            f"{param}: token id {bad[0]} outside the vocabulary (0..{tok.vocab_size - 1})",
            param=param,
        )
    if not toks:
        raise APIError(400, f"{param}: empty", param=param)
    ctx = state().ctx_size
    if len(toks) + room > ctx:  # the worker's own rule
        raise context_error(len(toks), ctx, param)
    return None, toks, tok.decode(toks), toks


def _jobs(raw: bytes, path: str) -> tuple[CompletionRequest, list[_Choice]]:
    """The typed request and one job per prompt, with its echo text and echoed ids (off
    the event loop). The raw prompts are tokenized here (echo needs their ids): the
    jobs carry them. A constraint is compiled once for them all."""
    req = parse(CompletionRequest, raw)
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            400,
            "max_tokens: 0 generates nothing; it is allowed only with echo (to score "
            "the prompt with logprobs)",
            param="max_tokens",
        )
    if req.suffix:
        raise APIError(
            400,
            "suffix: fill-in-the-middle is not supported (DeepSeek V4's prompt format "
            "defines no template for it); send the text before the gap as the prompt",
            param="suffix",
        )
    wishes = sampling_wishes(req)
    max_tokens = req.max_tokens if req.max_tokens is not None else 16
    check_min_tokens(req, max_tokens)
    tok = state().tokenizer
    given = _prompts(req)
    many = len(given) > 1
    room = 0 if max_tokens == 0 else 1  # scored alone (echo): it may fill the context
    prompts = [
        _prompt(p, tok, f"prompt.{i}" if many else "prompt", room) for i, p in enumerate(given)
    ]
    if req.stream and len(prompts) > 1:
        raise APIError(
            400, "stream: several prompts cannot be streamed; send one per request", param="stream"
        )
    model_thinking(req.model)  # logs a model name the server does not list
    limit, cap_is_eos = turn_limit(max_tokens) if max_tokens else (0, False)
    turn = TurnSpec(
        sampling=sampling_params(False, req),
        max_tokens=limit,
        parse=False,
        thinking=False,
        id_prefix="",
        stops=tuple(stops_of(req.stop)),
        logprobs=req.logprobs,
        cap_is_eos=cap_is_eos,
        # Echoed with logprobs: the prompt is scored (the whole prompt is prefilled).
        prompt_logprobs=req.logprobs if req.echo else None,
    )
    choices = [
        _Choice(
            GenRequest(path=path, turn=turn, prompt=text, prompt_tokens=toks, **wishes),
            echo_text,
            echo_ids,
        )
        for text, toks, echo_text, echo_ids in prompts
    ]
    # A constrained reply the demo cap cuts is incomplete, never a natural end: the cap
    # stands in for EOS only where the grammar accepts one (no reasoning here).
    constraint = constraints.read(constraints.completion_constraint, req)
    check_end_ban(choices[0].gen, constraint is not None)

    def put(grammar) -> None:  # one compile; each turn keeps its own matcher
        for c in choices:
            c.gen.set_grammar(grammar)

    constrain(None, constraint, put)
    return req, choices


@bp.post("/v1/completions")
async def completions():
    """OpenAI legacy Completions: raw text continuation (no chat template).

    ``echo`` prepends the prompt text; ``logprobs`` (0–20) returns the sampled tokens'
    logprobs with that many alternatives. With ``echo`` the prompt's tokens are scored
    too (the whole prompt is prefilled, no cached prefix reused); the first token of a
    token-id prompt has nothing before it and gets null, as OpenAI gives it. Several
    prompts (lm-eval's ``batch_size``) run one after another, one choice each, usage
    summed; they are not streamed.
    """
    req, choices = await offload(_jobs, await read_body(), request.path)
    st = state()
    meta = {
        "id": new_id("cmpl-"),
        "object": "text_completion",
        "created": now(),
        "model": req.model or st.config.model_name,
    }
    encs = [
        CompletionEncoder(
            meta,
            echo=c.echo_text if req.echo else "",
            echo_ids=c.echo_ids,
            logprobs=req.logprobs,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            tokenizer=st.tokenizer,
            index=i,
        )
        for i, c in enumerate(choices)
    ]
    if req.stream:
        return await stream(st.submit(choices[0].gen), encs[0], NAMES)
    # One prompt queued at a time: another client's request waits for one prompt's
    # turn, not for the whole list (128 queued at once held every other client for the
    # whole list). `respond` cancels its job if the client goes away.
    bodies = [
        await respond(st.submit(c.gen), enc, NAMES) for c, enc in zip(choices, encs, strict=True)
    ]
    return json_response(_merged(bodies))


def _merged(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One response of several prompts' bodies: their choices in order, usage summed."""
    if len(bodies) == 1:
        return bodies[0]
    usage = {
        k: sum(b["usage"][k] for b in bodies)
        for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    for part in ("prompt_tokens_details", "completion_tokens_details"):
        keys = bodies[0]["usage"][part]
        usage[part] = {k: sum(b["usage"][part][k] for b in bodies) for k in keys}
    return {**bodies[0], "choices": [b["choices"][0] for b in bodies], "usage": usage}
