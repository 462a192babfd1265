"""Replays generated sequences through the NumPy reference (dense KV cache).

Each sequence is teacher-forced: the reference reads the prompt and then the
tokens the engine generated, and at every step must pick the same token
(argmax, or the k-th choice for sample k's first token). A token on which the
two disagree only by rounding is counted as a near-tie, not a mismatch: the
reference's own logits for the two candidates lie within `tie_tolerance` plus
twice that step's largest engine-vs-reference logit difference, so that the
engine's error at that step could have swapped them. That error itself is
bounded by the caller, through `max_logit_diff`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from .model import DecoderConfig
from .numpy_reference import DenseDecoder
from .scheduler import Sequence


@dataclass
class CheckResult:
    tokens: int = 0
    mismatches: list[str] = field(default_factory=list)
    near_ties: int = 0
    max_logit_diff: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.mismatches


def check_sequences(
    config: DecoderConfig,
    weights: Mapping[str, np.ndarray],
    sequences: list[Sequence],
    tie_tolerance: float = 1e-3,
    quantized: bool | Collection[str] = False,
) -> CheckResult:
    """Compares every token (and the logits behind it) with the reference
    (`DenseDecoder`, quantizing the activations of every product or of the
    products `quantized` names).

    NumPy's BLAS runs on one thread here: the reference's matrices are small,
    and a BLAS thread pool that waits on a busy core runs them many times
    slower than one thread does.
    """
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        return _check(config, weights, sequences, tie_tolerance, quantized)


def _check(
    config: DecoderConfig,
    weights: Mapping[str, np.ndarray],
    sequences: list[Sequence],
    tie_tolerance: float,
    quantized: bool | Collection[str],
) -> CheckResult:
    result = CheckResult()
    by_request: dict[str, list[Sequence]] = {}
    for s in sequences:
        by_request.setdefault(s.request.request_id, []).append(s)
    for group in by_request.values():
        prompt = list(group[0].request.prompt)
        prompt_ref = DenseDecoder(config, weights, quantized)
        first_logits = prompt_ref.feed(prompt)
        ranked = np.argsort(-first_logits, kind="stable")
        for s in group:
            # One teacher-forced pass over the generated tokens gives the
            # reference's logits at every later step.
            later = prompt_ref.fork().feed_all(s.tokens[:-1]) if len(s.tokens) > 1 else []
            for i, token in enumerate(s.tokens):
                logits = first_logits if i == 0 else later[i - 1]
                want = int(ranked[s.sample]) if i == 0 else int(np.argmax(logits))
                result.tokens += 1
                error = float(np.abs(logits - s.logits[i]).max())
                result.max_logit_diff = max(result.max_logit_diff, error)
                if token == want:
                    continue
                if abs(float(logits[want] - logits[token])) <= tie_tolerance + 2 * error:
                    result.near_ties += 1
                else:
                    result.mismatches.append(
                        f"{s.seq_id} token {i}: engine {token}, reference {want} "
                        f"(logits {logits[token]:.4f} vs {logits[want]:.4f})"
                    )
    return result
