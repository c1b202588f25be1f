"""Sampling parameters: a stdlib-only leaf, shared by the routes (which validate a
request's knobs into it) and the engine (which draws with it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token from the logits.

    Args:
        temperature: softmax temperature (>= 0); below `GREEDY_BELOW` (0 included)
            greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        min_p: drop tokens whose probability is below ``min_p`` × the top probability;
            0 disables it.
        seed: seeds the session's generator at the start of a request
            (``Session.seed``), making the sampled continuation reproducible.

    The filters (``ds4mlx.engine.sampling``: top-p, then min-p, then top-k, on the
    untempered distribution; the order mlx-lm's ``make_sampler`` uses) run first; the
    temperature then scales the surviving log-probabilities before the categorical draw.

    Raises:
        ValueError: a value is out of range.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: ``top_k`` 1, or a temperature below
        `GREEDY_BELOW` (0 included). Below it the draw is the argmax in all but
        near-ties anyway, and far below it 1/T overflows float32 (~2.9e-39): the scaled
        logits would be ±inf, NaN where a logit is 0."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1


GREEDY_BELOW = 1e-4


# DeepSeek's recommended sampling (docs/ARCHITECTURE.md §6): the defaults of a request
# that sets none, and what thinking mode always uses.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.05


# Speculative decoding settings (``ds4mlx.engine.speculative``): here, stdlib-only, so
# the command line declares its flags without importing MLX.
SPECULATIVE_MODES = ("off", "auto", "lookup", "mtp", "dspark")
MAX_DRAFT_TOKENS = 16
DEFAULT_DRAFT_TOKENS = 4
