"""The scheduler under generated load on pools too small for it: requests of
random prompts (some sharing a prefix), samples, lengths, priorities and
arrival steps, whole or chunked prefills, on the demo's model and on the
Gemma-3-shaped one (sliding-window layers, whose pages come back as the
window passes). Whatever the admission and preemption order, every request
the pool can hold at its full length gets all its tokens, the same as the
NumPy model's, in a bounded number of steps, and every page comes back;
the others are refused before anything runs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import gemma3_shaped
from conftest import DEMO_CONFIG, DEMO_PAGE, engine_with_pool
from pagedkv.graphs.model import init_weights
from pagedkv.graphs.scheduler import Request, Scheduler
from pagedkv.graphs.self_check import check_sequences

WARM_GRAPHS = ("demo", "gemma3-shaped")
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""

MODELS = {
    "demo": (DEMO_CONFIG, DEMO_PAGE, engine_with_pool),
    "gemma3-shaped": (gemma3_shaped.CONFIG, gemma3_shaped.PAGE, gemma3_shaped.engine),
}
"""Each model's config, page size and engine over a fresh pool."""

SHARED = tuple(np.random.default_rng(3).integers(0, gemma3_shaped.CONFIG.vocab_size, 40).tolist())
"""The prefix that generated prompts may start with (40 tokens: past the
Gemma-shaped model's 12-token window, two and a half of the demo's pages)."""

request_shapes = st.lists(
    st.tuples(
        st.integers(0, 40),  # tokens of SHARED the prompt starts with
        st.integers(1, 24),  # tokens of its own
        st.integers(1, 3),  # samples
        st.integers(1, 24),  # max_tokens
        st.integers(0, 6),  # arrival step
        st.integers(0, 2),  # priority (lower first, under the "priority" policy)
    ),
    min_size=1,
    max_size=5,
)


@pytest.fixture(scope="module")
def gemma_weights():
    return init_weights(gemma3_shaped.CONFIG, seed=gemma3_shaped.WEIGHTS_SEED)


@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=30, suppress_health_check=list(HealthCheck))
@given(
    shapes=request_shapes,
    num_pages=st.integers(3, 10),  # in 16 tokens' worth of pages
    prefill_budget=st.sampled_from([8, 4096]),
    max_num_seqs=st.sampled_from([2, 64]),
    policy=st.sampled_from(["fcfs", "priority"]),
    seed=st.integers(0, 2**16),
)
# Found by this test: a request of two samples, preempted after 16 tokens
# each and recomputed in 8-token chunks alone on a pool its full length
# fills, was charged twice for one page (the page its last chunk opens, and
# a page for the next token at the length held before that chunk), and
# failed as if the pool could not hold it.
@example(
    shapes=[(0, 1, 1, 1, 0, 0)] * 3 + [(0, 10, 1, 24, 0, 0), (0, 1, 2, 17, 0, 0)],
    num_pages=4,
    prefill_budget=8,
    max_num_seqs=64,
    policy="fcfs",
    seed=0,
)
def test_every_request_the_pool_can_hold_completes(
    weights, gemma_weights, model, shapes, num_pages, prefill_budget, max_num_seqs, policy, seed
):
    config, page_size, make_engine = MODELS[model]
    weights = weights if model == "demo" else gemma_weights
    num_pages *= 16 // page_size
    rng = np.random.default_rng(seed)
    requests = [
        Request(
            f"r{i}",
            SHARED[:shared] + tuple(rng.integers(0, config.vocab_size, own).tolist()),
            max_tokens=max_tokens,
            n=n,
            arrival_step=arrival,
            priority=priority,
        )
        for i, (shared, own, n, max_tokens, arrival, priority) in enumerate(shapes)
    ]
    engine = make_engine(weights, num_pages)
    scheduler = Scheduler(
        engine,
        max_num_seqs=max_num_seqs,
        max_prefill_tokens=prefill_budget,
        policy=policy,
        keep_logits=True,
    )
    # Every step prefills, preempts or decodes; far more steps than tokens
    # means requests are readmitted and preempted again without end.
    bound = 10 * sum(r.n * (len(r.prompt) + r.max_tokens) for r in requests) + 50

    def on_step(step: int, *_) -> None:
        assert step <= bound, f"{step} steps for {len(requests)} requests"

    sequences, _ = scheduler.run(requests, on_step=on_step)
    fits = {
        r.request_id: r.n <= max_num_seqs and scheduler.footprint(r) <= num_pages for r in requests
    }
    served = [s for s in sequences if fits[s.request.request_id]]
    for s in sequences:
        if fits[s.request.request_id]:
            assert (s.error, s.finish_reason) == (None, "length"), s
            assert len(s.tokens) == s.request.max_tokens
        else:
            assert s.error is not None and not s.tokens
    assert engine.manager.num_used_pages == 0
    engine.manager.validate()
    check = check_sequences(config, weights, served)
    assert check.passed, check.mismatches
    # Each token's logits, not only its choice: a wrong key or value in a
    # recomputed or shared page moves them far past float32's rounding.
    scale = max((float(np.abs(row).max()) for s in served for row in s.logits), default=0.0)
    assert check.max_logit_diff <= 1e-4 * scale, (check.max_logit_diff, scale)
