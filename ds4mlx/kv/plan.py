"""What to reuse from the live session for a job (DESIGN.md §3, "matching order").

`plan_prefill` is the one place that decides how a job's prompt is put into the live
`Session`: keep every live token and prefill only a suffix, or reset and prefill the
whole prompt. The worker (``ds4mlx.server.Worker``) calls it on the inference thread
right before prefill, and calls `after_generation` when the job is done, so that
state a later job can continue from (tool-call ids, the visible key of a thinking
turn) is remembered in one module.

Implemented here (steps 4, 5 and 7 of DESIGN.md §3):

- ``exact-token-prefix``: the live tokens are a prefix of the prompt's tokens.
- ``text-prefix``: the live tokens' decoded text is a byte prefix of the rendered
  prompt. The live tokens are kept and only the remaining text is tokenized, on its
  own: tokens of the whole prompt are never reused across that byte boundary, since
  BPE may merge across it.
- ``cold``: reset and prefill everything.

The live continuations by tool ids (steps 1–3) and the disk KV cache (step 6) extend
this module (issue 5); the `Plan` fields and the two function signatures are the seam.

DeepSeek V4 caches cannot be trimmed backwards past the compressed frontier, so a
plan keeps either all live tokens or none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class _Session(Protocol):
    tokens: list[int]
    logits: Any

    @property
    def text(self) -> str: ...


class _Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass
class Plan:
    """How to bring the live session to a job's prompt.

    Attributes:
        keep: live tokens kept (``len(session.tokens)`` or 0; 0 means reset first).
        suffix_tokens: token ids to prefill after the kept ones.
        decision: name of the matching rule that fired (``"exact-token-prefix"``,
            ``"text-prefix"``, ``"cold"``; issue 5 adds the live continuations and
            ``"disk"``), used in the per-request log line and the trace.
        cached: prompt tokens served from existing state (== ``keep`` unless a disk
            restore supplied them).
        detail: extra ``key=value`` words for the log line (e.g. ``"ids=2"``).
        restore: an opaque object the worker passes to ``session.restore`` before
            prefilling (disk hits, issue 5); None here.
    """

    keep: int
    suffix_tokens: list[int]
    decision: str
    cached: int
    detail: str = ""
    restore: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the prompt as the session will hold it after prefill."""
        return self.keep + len(self.suffix_tokens)


def plan_prefill(
    session: _Session, tokenizer: _Tokenizer, rendered_text: str | None, job: Any
) -> Plan:
    """Decide what to keep of the live session for ``job``'s prompt.

    Args:
        session: the live ``ds4mlx.engine.Session`` (read only here).
        tokenizer: the engine's ``ds4mlx.tokenizer.Tokenizer``.
        rendered_text: the job's whole prompt text, or None when the client sent
            token ids (then only exact token prefixes match).
        job: the ``ds4mlx.server.Job``; ``job.request.prompt_tokens`` (list of int, the
            tokenization of the whole prompt) is read; issue 5 also reads the
            request's conversation and protocol for id-based continuation.
    Returns:
        A `Plan`. Never raises for a mismatch: the fallback is ``cold``.
    """
    live = session.tokens
    prompt = job.request.prompt_tokens
    n = len(live)
    if n and session.logits is not None:
        if n <= len(prompt) and prompt[:n] == live:
            return Plan(
                keep=n, suffix_tokens=list(prompt[n:]), decision="exact-token-prefix", cached=n
            )
        if rendered_text is not None:
            live_text = session.text
            # "\ufffd" means the live tokens end inside a UTF-8 sequence: their text is
            # not a faithful byte prefix of anything, so do not match on it.
            if (
                live_text
                and not live_text.endswith("\ufffd")
                and len(live_text) <= len(rendered_text)
                and rendered_text.startswith(live_text)
            ):
                rest = rendered_text[len(live_text) :]
                return Plan(
                    keep=n, suffix_tokens=tokenizer.encode(rest), decision="text-prefix", cached=n
                )
    return Plan(keep=0, suffix_tokens=list(prompt), decision="cold", cached=0)


def after_generation(session: _Session, tokenizer: _Tokenizer, job: Any, outcome: Any) -> None:
    """Hook called on the inference thread after every job (finished, stopped or cancelled).

    ``outcome`` is the job's ``ds4mlx.server.JobDone`` (finish reason, tool calls
    sampled with their ids, token counts). Nothing is remembered yet; issue 5 records
    here the live tool-call id set with the live token count (Anthropic / Responses /
    chat live continuation) and the visible key of a thinking turn.
    """
    return None
