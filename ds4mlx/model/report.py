"""How much do lower-bit routed experts change the model? ``ds4mlx convert --report``.

For each expert choice (``"4"``, ``"3"``, ``"2"``, ``"mxfp4"`` ...) the source is converted,
loaded, and run over a fixed set of prompts; every position's next-token distribution is
compared with the reference network's:

* **top-1 agreement** — share of positions whose most likely token is the reference's;
* **mean KL** — mean over positions of KL(reference ‖ quantized), in nats.

The reference is the source with nothing re-quantized (``keep``): DeepSeek's own FP8/FP4
numbers for the release, the float weights for a float checkpoint. Only the routed experts
vary between rows; everything else uses the same choice in every row (``rest``). One model
is in memory at a time; each converted copy is deleted once measured.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from .convert import ConvertOptions, convert
from .loading import load_model


@dataclass
class ReportRow:
    """One expert choice: ``agreement`` (0–1), ``mean_kl`` (nats), ``weight_bytes`` written,
    ``positions`` compared, ``expert_format``: the routed experts' stored format(s) in that
    conversion (e.g. ``"affine4"``; the reference's when the choice could not apply)."""

    choice: str
    agreement: float
    mean_kl: float
    weight_bytes: int
    positions: int
    expert_format: str = ""

    def coverage(self) -> str:
        """How much of the routed experts this conversion stores quantized: ``"all"``,
        ``"part"`` (some matrices' dimensions do not divide by the group size and stay
        float) or ``"none"`` (then its agreement and KL measure nothing)."""
        labels = [x for x in self.expert_format.split("+") if x and x != "none"]
        floats = sum(x in FLOAT_LABELS for x in labels)
        return "none" if floats == len(labels) else "part" if floats else "all"


FLOAT_LABELS = frozenset({"f32", "bf16", "f16"})  # convert's labels of unquantized tensors


def _expert_format(summary) -> str:
    part = summary.parts.get("experts")
    return "+".join(sorted(part.formats)) if part and part.params else "none"


def _log_probs(path: str, prompts: Sequence[Sequence[int]], dtype) -> list[np.ndarray]:
    """float32 log-softmax ``(L, vocab)`` of every position of every prompt."""
    model, _ = load_model(path, dtype=dtype)
    out = []
    for ids in prompts:
        logits = model(mx.array(np.asarray(ids, dtype=np.int32)[None]))[0]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out.append(np.array(lp))
    del model
    mx.clear_cache()
    return out


def compare(ref: list[np.ndarray], other: list[np.ndarray]) -> tuple[float, float, int]:
    """``(top-1 agreement, mean KL(ref ‖ other) in nats, positions)`` over all prompts."""
    agree, kl, n = 0, 0.0, 0
    for a, b in zip(ref, other, strict=True):
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        kl += float((np.exp(a) * (a - b)).sum())
        n += a.shape[0]
    return agree / n, kl / n, n


def quant_report(
    src: str,
    choices: Sequence[str],
    prompts: Sequence[Sequence[int]],
    workdir: str,
    *,
    base: ConvertOptions | None = None,
    log: Callable[[str], None] | None = None,
) -> list[ReportRow]:
    """Agreement and KL vs the reference for each expert ``choices`` entry.

    Args:
        src: checkpoint directory (any layout ``convert`` reads).
        choices: expert choices (``formats.parse_spec`` strings).
        prompts: token-id lists (ids below the model's vocabulary size).
        workdir: scratch directory for the converted copies (needs room for two).
        base: options for everything but the experts (``rest``, ``dtype``, overrides).
        log: progress messages.

    Raises:
        ConvertError / LoadError: as ``convert`` and ``load_model``.
    """
    base = base or ConvertOptions()
    say = log or (lambda _s: None)
    os.makedirs(workdir, exist_ok=True)
    ref_dir = os.path.join(workdir, "reference")
    ref_opts = replace(base, expert="keep", rest=base.rest or "keep", overwrite=True)
    say("converting the reference (experts as stored)")
    summary = convert(src, ref_dir, ref_opts)
    dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[
        base.dtype or ("bfloat16" if mx.metal.is_available() else "float32")
    ]
    ref = _log_probs(ref_dir, prompts, dtype)
    positions = sum(len(p) for p in prompts)
    rows = [
        ReportRow("reference", 1.0, 0.0, summary.total_bytes, positions, _expert_format(summary))
    ]
    shutil.rmtree(ref_dir)
    for choice in choices:
        d = os.path.join(workdir, f"experts-{choice.replace(':', 'g')}")
        say(f"converting with experts={choice}")
        summary = convert(src, d, replace(ref_opts, expert=choice))
        agree, kl, n = compare(ref, _log_probs(d, prompts, dtype))
        rows.append(ReportRow(choice, agree, kl, summary.total_bytes, n, _expert_format(summary)))
        shutil.rmtree(d)
    return rows
