"""Greedy answers compared with transformers' stored ones, up to the first
near-tie: shared by the real models' exactness tests."""

from __future__ import annotations

NEAR_TIE = 1e-2
"""Below this gap between transformers' top two logits, float32 rounding in
a different order may pick either token: the comparison stops there."""


def compared_prefix(reference: dict) -> int:
    """How many generated tokens must equal transformers': all of them, or
    those before the first near-tie."""
    gaps = reference["top2_gaps"]
    ties = [i for i, gap in enumerate(gaps) if gap < NEAR_TIE]
    return ties[0] if ties else len(reference["token_ids"])


def assert_matches_reference(completions, records) -> list[int]:
    """Asserts each completion equals transformers' up to its first near-tie;
    returns how many tokens each comparison covered."""
    covered = []
    for got, want in zip(completions, records, strict=True):
        assert got.prompt_token_ids == want["prompt_token_ids"], want["prompt"]
        n = compared_prefix(want)
        assert got.token_ids[:n] == want["token_ids"][:n], (
            f"{want['prompt']!r}: pagedkv {got.text!r}, transformers {want['text']!r}"
        )
        if n == len(want["token_ids"]):  # no near-tie: the whole answer, EOS included
            assert got.token_ids == want["token_ids"]
        covered.append(n)
    return covered
