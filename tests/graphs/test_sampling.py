"""Choosing tokens (pagedkv.graphs.sampling): logit adjustments and log
probabilities against float64 computations written out here."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pagedkv.graphs.sampling import LogitAdjustments, greedy_tokens, log_softmax, token_logprob


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
