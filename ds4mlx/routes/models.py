"""Models, tokenizer utilities, health and the test-only script endpoint.

- ``GET /v1/models``, ``GET /v1/models/{id}`` (ids may contain ``/``; any id is found,
  as the chat routes serve any model name, with ``served_as``): each entry has
  both OpenAI (``object``, ``owned_by``, ``created``) and Anthropic (``type``,
  ``display_name``, ``created_at``) fields, so either SDK can read it
  (https://platform.openai.com/docs/api-reference/models,
  https://docs.anthropic.com/en/api/models).
- ``POST /v1/tokenize``: ``{"text"|"prompt": str}`` or ``{"messages": [...]}`` (OpenAI
  chat messages, rendered with the chat template) → ``{"tokens", "count",
  "max_model_len"}``. vLLM's ``add_special_tokens`` changes nothing: DeepSeek V4's
  tokenizer adds no special tokens (its config says ``add_bos_token: false``); a text
  prompt of ``/v1/completions`` gets its BOS from the route.
- ``POST /v1/detokenize``: ``{"tokens": [int]}`` → ``{"text", "prompt"}``.
- vLLM's spellings, which evaluation harnesses probe for a remote tokenizer (lm-eval's
  ``tokenizer_backend=remote``): ``POST /tokenize``, ``POST /detokenize`` (the same) and
  ``GET /tokenizer_info`` (``bos_token``, ``eos_token``, ``pad_token``,
  ``model_max_length``; no chat template: DeepSeek V4's prompt format is code, not a
  Jinja template).
- ``GET /health``: ``{"status": "ok", ...}`` (no API key needed; without it, the
  resident states' client keys are left out); 503 with
  ``"status": "stopping"`` once shutdown began (jobs are refused then, and the shutdown
  saves may still run while the socket answers).
- ``GET /`` (and ``HEAD /``): ``{"status": "ok", "service": "ds4mlx"}`` (no API key needed).
- ``POST /debug/script`` (only with ``--enable-scripted-decoding``): ``{"texts": [str]}``
  and/or ``{"tokens": [[int]]}`` queue continuations (texts first); each following job
  decodes the next one (docs/ARCHITECTURE.md §2). ``"greedy": true`` makes those jobs decode
  greedily once their script runs out; ``"reset": true`` drops what was queued
  (alone, or before queueing the texts/tokens of the same request).
"""

from __future__ import annotations

import datetime
from typing import Any

from pydantic import Field
from quart import Blueprint

from ds4mlx.dsml.tokens import BOS, EOS
from ds4mlx.jobs import Script
from ds4mlx.routes.access import check_auth
from ds4mlx.routes.body import OpenModel, offload, parse, parse_body, read_body, validate
from ds4mlx.routes.common import json_response, model_thinking, state
from ds4mlx.routes.errors import APIError
from ds4mlx.routes.pipeline import render, tokenize

bp = Blueprint("models", __name__)


def _model_entry(model_id: str) -> dict[str, Any]:
    st = state()
    created = int(st.started)
    thinking = model_thinking(model_id)
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "ds4mlx",
        "type": "model",
        "display_name": model_id,
        "created_at": datetime.datetime.fromtimestamp(created, datetime.UTC)
        .isoformat()
        .replace("+00:00", "Z"),
        "context_length": st.ctx_size,
        "max_model_len": st.ctx_size,
        "thinking": thinking,
    }


@bp.get("/v1/models")
async def list_models():
    ids = state().config.model_ids()
    data = [_model_entry(i) for i in ids]
    return json_response(
        {"object": "list", "data": data, "has_more": False, "first_id": ids[0], "last_id": ids[-1]}
    )


@bp.get("/v1/models/<path:model_id>")
async def get_model(model_id: str):
    """Any id: the chat routes serve the one model under any name (``model_thinking``),
    so a client that checks its model name first (e.g. ``claude-haiku-…``) finds it.
    ``served_as`` names the model that answers."""
    entry = _model_entry(model_id)
    entry["served_as"] = state().config.model_name
    return json_response(entry)


class TokenizeRequest(OpenModel):
    model: str = ""
    text: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None


class DetokenizeRequest(OpenModel):
    model: str = ""
    tokens: list[int]


@bp.post("/v1/tokenize")
@bp.post("/tokenize")
async def tokenize_route():
    """Tokenize raw text (special tokens recognized) or chat ``messages`` (rendered)."""
    toks = await offload(_tokens, await read_body())
    return json_response({"tokens": toks, "count": len(toks), "max_model_len": state().ctx_size})


def _tokens(raw: bytes) -> list[int]:
    """The ids of a tokenize request's text or rendered messages (off the event loop)."""
    from ds4mlx.routes import openai

    req = parse(TokenizeRequest, raw)
    given = [n for n in ("text", "prompt", "messages") if getattr(req, n) is not None]
    if len(given) > 1:  # (one was used and the rest dropped without a word)
        raise APIError(400, f"give one of text, prompt or messages, not {given}", param=given[1])
    if req.messages is not None:
        chat = validate(openai.ChatRequest, req.model_dump())
        text = render(openai.conversation(chat))
    else:
        text = req.text if req.text is not None else req.prompt
        if text is None:
            raise APIError(400, "give text, prompt or messages", param="text")
    return tokenize(text)


@bp.get("/tokenizer_info")
async def tokenizer_info():
    """vLLM's tokenizer description (the fields a remote-tokenizer client reads)."""
    return json_response(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "model_max_length": state().ctx_size,
        }
    )


@bp.post("/v1/detokenize")
@bp.post("/detokenize")
async def detokenize_route():
    req = await parse_body(DetokenizeRequest)
    tok = state().tokenizer
    bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
    if bad:
        raise APIError(
            400,
            f"tokens: id {bad[0]} outside the vocabulary (0..{tok.vocab_size - 1})",
            param="tokens",
        )
    text = tok.decode(req.tokens)
    return json_response({"text": text, "prompt": text})  # ``prompt``: vLLM's name


@bp.get("/")
@bp.get("/api/hello")
async def root():
    """What answers at the base URL and at ``/api/hello``: clients probe them (Claude
    Code sends ``HEAD /`` when it starts and ``HEAD``/``GET /api/hello`` before it
    connects), so they are a 200, not a logged rejection. ``HEAD`` is answered like
    ``GET`` without the body. No API key needed, like ``/health``."""
    return json_response({"status": "ok", "service": "ds4mlx", "health": "/health"})


@bp.get("/health")
async def health():
    st = state()
    eng = st.worker.engine  # (its speculation report is plain values)
    stopping = st.worker.stopping
    cache = st.kv.summary()
    if check_auth() is not None and cache.get("states"):
        # /health answers without the API key (a supervisor's probe), but the states'
        # keys name other clients' conversations (a Claude Code session id, a
        # prompt_cache_key): only a caller with a key sees them.
        cache["states"] = [{k: v for k, v in s.items() if k != "key"} for s in cache["states"]]
    return json_response(
        {
            "status": "stopping" if stopping else "ok",
            "model": st.config.model_name,
            "ctx": st.ctx_size,
            "busy": st.worker.busy,
            "queued": st.worker.queued,
            "submitted": st.worker.jobs_submitted,
            "done": st.worker.jobs_done,
            # Speculative decoding: mode, draft_tokens, drafted, accepted,
            # tokens_per_forward (target forward passes of drafting turns).
            "speculative": None if eng is None else eng.speculation.report(),
            # The split across ranks (mode, ranks, each rank's layers), or None.
            "distributed": None if eng is None else eng.distributed,
            # The prompt cache's own summary (plain values): live_tokens, sessions,
            # states (--sessions N), kv_writer (the disk writer's counts, or None).
            **cache,
        },
        503 if stopping else 200,
    )


class ScriptRequest(OpenModel):
    texts: list[str] = Field(default_factory=list)
    tokens: list[list[int]] = Field(default_factory=list)
    greedy: bool = False
    reset: bool = False


@bp.post("/debug/script")
async def debug_script():
    """Queue scripted continuations (tests only; 404 unless the server enabled it; 403
    unless ``Host`` and ``Origin`` are loopback: ``ds4mlx.routes.access.check_debug``)."""
    st = state()
    if not st.config.scripted:
        raise APIError(404, "no route POST /debug/script", type="not_found_error", code="not_found")
    req = await parse_body(ScriptRequest)
    if not req.texts and not req.tokens and not req.reset:
        raise APIError(400, "give texts or tokens (or reset)", param="texts")
    vocab = st.tokenizer.vocab_size
    if any(not 0 <= t < vocab for ids in req.tokens for t in ids):
        raise APIError(400, f"tokens: ids must be in 0..{vocab - 1}", param="tokens")
    if req.reset:
        st.scripts.clear()
    if req.greedy or req.tokens:
        st.scripts.extend(Script(text=t, greedy=req.greedy) for t in req.texts)
        st.scripts.extend(Script(tokens=ids, greedy=req.greedy) for ids in req.tokens)
    else:
        st.scripts.extend(req.texts)
    return json_response({"queued": len(st.scripts)})
