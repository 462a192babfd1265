"""Choosing the next token from a row of logits: greedy, or temperature and
nucleus (top-p) sampling from a seeded generator.

Sampling works on float64 probabilities so that a seed gives the same token
on every machine for the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks its tokens.

    temperature 0 is greedy (argmax; ties go to the lowest id). Otherwise
    logits are divided by `temperature`, the smallest set of tokens whose
    probability reaches `top_p` is kept, and a token is drawn from it with a
    generator seeded by `seed` (different for each sample of a request).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """A token id drawn from logits [vocab] as `params` says."""
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, params.top_p)) + 1]
        kept = np.zeros_like(probs)
        kept[keep] = probs[keep]
        probs = kept / kept.sum()
    return int(rng.choice(probs.size, p=probs))
