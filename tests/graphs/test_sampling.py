"""Choosing tokens (pagedkv.graphs.sampling): which tokens sampling keeps,
logit adjustments and log probabilities against float64 computations
written out here."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pagedkv.graphs.sampling import (
    LogitAdjustments,
    SamplingParams,
    greedy_tokens,
    log_softmax,
    sample_token,
    token_logprob,
)


def kept_distribution(logits, temperature, top_k, top_p, min_p):
    """The distribution sampling draws from, in float64, token by token:
    top-k (0: off), renormalize, top-p (a token stays while the mass of the
    tokens ranked above it, by probability then id, is under top_p), min-p."""
    x = np.asarray(logits, np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    ranked = sorted(range(len(p)), key=lambda t: (-p[t], t))
    if top_k > 0:
        kth = p[ranked[min(top_k, len(p)) - 1]]
        p = np.where(p >= kth, p, 0.0)
        p /= p.sum()
    above = 0.0
    keep = np.zeros(len(p), bool)
    for t in ranked:
        keep[t] = above < top_p or t == ranked[0]
        above += p[t]
    p = np.where(keep & (p >= min_p * p.max()), p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [(3, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.3), (5, 0.8, 0.1), (-1, 1.0, 0.0)],
)
def test_sampling_draws_from_the_kept_tokens_in_proportion(top_k, top_p, min_p):
    """Over 4000 seeded draws (a fixed set: the test is deterministic), every
    token drawn is one the rules keep, and each kept token's share is its
    probability to within 0.03."""
    logits = np.random.default_rng(3).normal(0, 1.5, 12).astype(np.float32)
    params = SamplingParams(0.8, top_p, top_k=top_k, min_p=min_p)
    want = kept_distribution(logits, 0.8, top_k, top_p, min_p)
    draws = [sample_token(logits, params, np.random.default_rng(s)) for s in range(4000)]
    counts = np.bincount(draws, minlength=len(logits)) / len(draws)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(want))
    np.testing.assert_allclose(counts, want, atol=0.03)


@pytest.mark.parametrize(
    "field, value",
    [("top_k", -2), ("min_p", 1.5), ("min_p", -0.1), ("top_p", 0.0), ("seed", -1)],
)
def test_sampling_params_refuse_values_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(1.0, **{field: value})


@pytest.mark.parametrize("field, value", [("top_k", 2.5), ("seed", "x"), ("seed", True)])
def test_sampling_params_refuse_what_is_not_an_integer(field, value):
    with pytest.raises(TypeError, match=f"{field} must be an integer"):
        SamplingParams(1.0, **{field: value})


def test_log_softmax_sums_to_one_and_survives_extreme_logits():
    rng = np.random.default_rng(0)
    rows = np.concatenate(
        [rng.normal(0, 3, (3, 1000)), np.full((1, 1000), -1e30), [[1e30] + [0.0] * 999]]
    ).astype(np.float32)
    out = log_softmax(rows)
    assert out.dtype == np.float64 and np.isfinite(out).any(axis=1).all()
    assert np.exp(out).sum(axis=1) == pytest.approx(np.ones(5), abs=1e-12)
    x = rows[0].astype(np.float64)
    want = x - np.log(np.sum(np.exp(x)))
    np.testing.assert_allclose(out[0], want, rtol=0, atol=1e-12)


def test_token_logprob_ranks_the_most_likely_with_ties_to_the_lower_id():
    logprobs = log_softmax(np.array([1.0, 3.0, 3.0, -2.0, 2.0], np.float32))
    lp = token_logprob(logprobs, 3, 3)
    assert lp.token == 3 and lp.logprob == logprobs[3]
    assert [t for t, _ in lp.top] == [1, 2, 4]
    assert token_logprob(logprobs, 0, 0).top == ()
    assert len(token_logprob(logprobs, 0, 50).top) == 5


def test_adjustments_add_the_bias_and_subtract_the_penalties():
    logits = np.arange(8, dtype=np.float32)
    adjust = LogitAdjustments(((2, 5.0), (7, -100.0)), presence_penalty=0.5, frequency_penalty=2.0)
    out = adjust.apply(logits, [3, 3, 5])
    want = logits.astype(np.float64).copy()
    want[2] += 5.0
    want[7] -= 100.0
    want[3] -= 0.5 + 2 * 2.0
    want[5] -= 0.5 + 1 * 2.0
    np.testing.assert_array_equal(out, want.astype(np.float32))
    assert logits[2] == 2.0  # the model's logits are left as they are
    assert not LogitAdjustments().active and adjust.active


def test_the_repetition_penalty_counts_the_prompt_and_the_sample_once():
    """transformers' rule, written out per token: a seen token's positive
    logit divided by the penalty, a negative one multiplied; after the bias,
    before presence and frequency."""
    logits = np.array([2.0, -1.0, 3.0, -4.0, 0.5, 1.0], np.float32)
    adjust = LogitAdjustments(((4, 1.0),), presence_penalty=0.25, repetition_penalty=2.0)
    out = adjust.apply(logits, [2, 2, 4], prompt=[3, 0, 3])
    want = logits.astype(np.float64).copy()
    want[4] += 1.0
    for token in (0, 2, 3, 4):  # each seen token once, however often
        want[token] = want[token] / 2.0 if want[token] > 0 else want[token] * 2.0
    want[[2, 4]] -= 0.25
    np.testing.assert_allclose(out, want, rtol=1e-6)
    unseen = LogitAdjustments(repetition_penalty=1.5)
    assert unseen.active
    np.testing.assert_array_equal(unseen.apply(logits, []), logits)


@given(
    arrays(np.float32, st.integers(1, 300), elements=st.sampled_from([-2.0, 0.0, 1.5, 3.0])),
    st.integers(1, 8),
)
def test_greedy_tokens_are_a_stable_sort_of_the_top(logits, n):
    """The n best tokens, ties in token order: a stable argsort's first n
    (logits drawn from four values, so that most are tied)."""
    want = np.argsort(-logits, kind="stable")[:n]
    np.testing.assert_array_equal(greedy_tokens(logits, n), want)
    with_nan = logits.copy()
    with_nan[0] = np.nan
    np.testing.assert_array_equal(
        greedy_tokens(with_nan, n), np.argsort(-with_nan, kind="stable")[:n]
    )
