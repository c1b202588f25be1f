"""The job vocabulary shared by routes and the worker: requests, events, sampling defaults.

A leaf module: it imports nothing of ``ds4mlx.server`` or ``ds4mlx.routes``, so routes
can depend on it without pulling in the app, and the worker can produce its events
without knowing any protocol.

A route builds a `GenRequest`, submits it (`ds4mlx.server.worker.Worker.submit`) and
reads the `Job`'s events on the event loop; the worker emits them from its thread.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

# Sampling defaults of docs/ARCHITECTURE.md (also what thinking mode always uses).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.05


# --------------------------------------------------------------------------- events


@dataclass
class JobStarted:
    """The job left the queue: its prompt is planned and about to be prefilled.

    ``prompt_tokens``: tokens of the prompt as the session holds it;
    ``cached_tokens``: those already in the live state (not prefilled);
    ``decision``: the `ds4mlx.kv.plan.Plan` decision name.
    """

    prompt_tokens: int
    cached_tokens: int
    decision: str


@dataclass
class PrefillProgress:
    """Prefill progress: ``done`` of ``total`` suffix tokens fed (routes send keepalives)."""

    done: int
    total: int


@dataclass
class RawText:
    """Raw generated text for ``/v1/completions`` (no thinking/DSML parsing).

    ``tokens`` are the ids this text completes (may be several when a UTF-8 character
    spans tokens); ``logprobs`` per token: ``(token_text, logprob, top: dict[str, float])``
    when the request asked for logprobs, else empty.
    """

    text: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[str, float, dict[str, float]]] = field(default_factory=list)


@dataclass
class TokenLogprob:
    """Chat ``logprobs``: one token sampled in the visible reply (not in thinking).

    ``token``: its text (U+FFFD for part of a UTF-8 character); ``bytes``: its raw
    bytes; ``top``: the ``top_logprobs`` most likely tokens as ``(text, logprob, bytes)``.
    Emitted just before the events of the text that token completes.
    """

    token: str
    logprob: float
    bytes: bytes
    top: list[tuple[str, float, bytes]] = field(default_factory=list)


@dataclass
class ToolCallDone:
    """A complete tool call the model sampled (id, name, JSON arguments, exact DSML)."""

    id: str
    name: str
    arguments: dict[str, Any]
    dsml: str | None


@dataclass
class JobDone:
    """The job ended.

    Attributes:
        finish: ``"stop"`` (EOS), ``"stop_sequence"``, ``"length"`` (max_tokens or a full
            context), ``"cancelled"``.
        stop_sequence: the matched stop string, or None.
        prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens: usage (int).
        tool_calls: the calls sampled, in order.
        reasoning: the hidden reasoning text sampled (for carriers), or "".
        prefill_s, decode_s: seconds spent; prefill/decode rates derive from them.
        decision: the plan decision (also in `JobStarted`).
        text: the visible text sent to the client (after stop sequences), for the
            thinking live-continuation key.
    """

    finish: str
    stop_sequence: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    tool_calls: list[ToolCallDone] = field(default_factory=list)
    reasoning: str = ""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decision: str = ""
    text: str = ""


@dataclass
class JobFailed:
    """The job failed on the worker. ``status``: HTTP status to report (500 for faults).

    ``fields``: extra members of the protocol's error object, e.g. ``n_prompt_tokens``
    and ``n_ctx`` for ``kind == "context_length_exceeded"``.
    """

    message: str
    status: int = 500
    kind: str = "api_error"
    fields: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- jobs


@dataclass
class GenRequest:
    """What a route asks the worker to generate (no JSON, no HTTP).

    Attributes:
        path: the endpoint, for the log line (e.g. ``"/v1/messages"``).
        prompt_tokens: the whole prompt's token ids (tokenized by the route).
        prompt_text: the rendered prompt: a ``ds4mlx.dsml.Rendered`` for chat protocols
            (its content spans tokenize as plain text), a ``str`` for raw text prompts,
            or None for token-id prompts.
        sampling: ``ds4mlx.engine.SamplingParams``.
        max_tokens: output token limit (already clamped to >= 1).
        stops: stop strings (visible text only).
        parse: True for chat protocols (thinking/text/DSML through ``StreamDecoder``);
            False for raw completions.
        thinking: the prompt opened ``<think>``.
        tools: ``ToolSpec`` list offered (the decoder maps arguments by their schemas).
        id_prefix: prefix of new tool-call ids (``toolu_`` / ``call_``).
        logprobs: top-N logprobs per token for completions, or None.
        conversation: the ``Conversation`` (for the prefill planner; issue 5), or None.
        protocol: the route's ``ds4mlx.kv.live.CallerNames`` (its live-tools decision,
            its id words for the log line, its unknown-id wording), handed to the planner;
            None for a route without tool results (neutral names).
        tool_required: the client forced a tool call (``tool_choice`` required / any /
            a named tool): the worker opens the DSML tool-call block itself as soon as
            the visible reply starts.
        tool_name: with ``tool_required``, the tool it must call (its name is forced
            too), or None for any tool.
        top_logprobs: chat ``logprobs``: None (off) or how many alternatives per token
            (0..20); the worker attaches `TokenLogprob`s to the events it emits.
        cap_is_eos: ``max_tokens`` is ``--demo``'s cap (see
            ``ds4mlx.routes.pipeline.demo_cap_ends_turn``): reaching it ends the job as
            ``"stop"`` (the noise model never samples EOS), not ``"length"``.
    """

    path: str
    prompt_tokens: list[int]
    prompt_text: Any
    sampling: Any
    max_tokens: int
    stops: list[str] = field(default_factory=list)
    parse: bool = True
    thinking: bool = True
    tools: list[Any] = field(default_factory=list)
    id_prefix: str = "toolu_"
    logprobs: int | None = None
    conversation: Any = None
    protocol: Any = None
    tool_required: bool = False
    tool_name: str | None = None
    top_logprobs: int | None = None
    cap_is_eos: bool = False


@dataclass
class Script:
    """A scripted continuation for one job (``--enable-scripted-decoding``, tests only).

    ``text`` is tokenized as a whole, or ``tokens`` (ids) are used as given (e.g. a
    non-canonical split that re-tokenizes differently on replay). ``greedy``: once the
    script runs out, decode greedily instead of with the request's sampling.
    """

    text: str = ""
    tokens: list[int] | None = None
    greedy: bool = False


_job_ids = itertools.count(1)


class Job:
    """One queued generation: a `GenRequest` plus its event channel and cancel flag.

    Created on the event loop (`Worker.submit`); the worker calls `emit` from its
    thread, the route consumes `events` on the loop.
    """

    def __init__(self, request: GenRequest, loop: asyncio.AbstractEventLoop):
        self.id = next(_job_ids)
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.submitted = time.monotonic()
        self.done = False

    def emit(self, event: Any) -> None:
        """Hand ``event`` to the route (thread-safe; dropped once the loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # event loop closed during shutdown
            pass

    def cancelled(self) -> bool:
        return self.cancel.is_set()

    async def events(self, keepalive_s: float | None = None) -> AsyncIterator[Any]:
        """Yield worker events until `JobDone`/`JobFailed` (inclusive).

        With ``keepalive_s``, yields None after that many seconds without an event, so
        streaming routes can send keepalives while the job waits in the queue.

        Cancellation (the client went away and the server cancels the handler) always
        propagates. ``asyncio.wait_for`` on Python 3.11 swallows a cancel that arrives
        while its inner ``get()`` completes (cpython gh-86296): the stream then kept
        reading events and the job ran to ``max_tokens``. ``asyncio.timeout`` tells its
        own deadline from an outside cancel, so it is used instead.
        """
        while True:
            try:
                if keepalive_s:
                    async with asyncio.timeout(keepalive_s):
                        ev = await self.queue.get()
                else:
                    ev = await self.queue.get()
            except TimeoutError:
                yield None
                continue
            yield ev
            if isinstance(ev, JobDone | JobFailed):
                self.done = True
                return
