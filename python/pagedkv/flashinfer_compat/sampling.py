"""``flashinfer.sampling`` over pagedkv."""

from __future__ import annotations

from ..sampling import (
    chain_speculative_sampling,
    min_p_sampling_from_probs,
    sampling_from_logits,
    sampling_from_probs,
    softmax,
    top_k_mask_logits,
    top_k_renorm_probs,
    top_k_sampling_from_probs,
    top_k_top_p_sampling_from_logits,
    top_k_top_p_sampling_from_probs,
    top_p_renorm_probs,
    top_p_sampling_from_probs,
)

__all__ = [
    "chain_speculative_sampling",
    "min_p_sampling_from_probs",
    "sampling_from_logits",
    "sampling_from_probs",
    "softmax",
    "top_k_mask_logits",
    "top_k_renorm_probs",
    "top_k_sampling_from_probs",
    "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs",
    "top_p_renorm_probs",
    "top_p_sampling_from_probs",
]
