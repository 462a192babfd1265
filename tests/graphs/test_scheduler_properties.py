"""The scheduler under generated load on pools too small for it: requests of
random prompts (some sharing a prefix, some asking for prompt logprobs and
so prefilled whole), samples, lengths, priorities and arrival steps, whole
or chunked prefills, on the demo's model and on the
Gemma-3-shaped one (sliding-window layers, whose pages come back as the
window passes). Whatever the admission and preemption order, every request
the pool can hold at its full length gets all its tokens, the same as the
NumPy model's, in a bounded number of steps, and every page comes back;
the others are refused before anything runs. Run again with a stop token
each, samples end where their answers first hold it, and later than that
where min_tokens holds the stop token back; with some requests cancelled
at a step, the others still complete and no page is lost."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import gemma3_shaped
from conftest import (
    DEMO_CONFIG,
    DEMO_PAGE,
    assert_exact_and_released,
    assert_released,
    engine_with_pool,
)
from pagedkv.graphs.model import init_weights
from pagedkv.graphs.scheduler import Delta, Done, Request, Scheduler

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
        st.sampled_from([None, None, 0, 2]),  # prompt_logprobs (prefilled whole)
    ),
    min_size=1,
    max_size=5,
)


@pytest.fixture(scope="module")
def gemma_weights():
    return init_weights(gemma3_shaped.CONFIG, seed=gemma3_shaped.WEIGHTS_SEED)


@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=20, suppress_health_check=list(HealthCheck))
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
    shapes=[(0, 1, 1, 1, 0, 0, None)] * 3 + [(0, 10, 1, 24, 0, 0, None), (0, 1, 2, 17, 0, 0, None)],
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
    requests = make_requests(shapes, config.vocab_size, rng)
    fits = {
        r.request_id: r.n <= max_num_seqs and footprint(r, page_size) <= num_pages for r in requests
    }
    options = {"max_num_seqs": max_num_seqs, "max_prefill_tokens": prefill_budget}
    engine = make_engine(weights, num_pages)
    sequences = serve(engine, requests, policy=policy, **options)
    for s in sequences:
        if fits[s.request.request_id]:
            assert (s.error, s.finish_reason) == (None, "length"), s
            assert len(s.tokens) == s.request.max_tokens
        else:
            assert s.error is not None and not s.tokens
    served = [s for s in sequences if fits[s.request.request_id]]
    assert_exact_and_released(engine, config, weights, served)

    # Again, each request stopping at a token of its first sample's answer:
    # its samples end early (a fork's before another's), release their
    # pages and stop nothing else.
    answers = {s.request.request_id: s.tokens for s in sequences if s.sample == 0}
    stopping = []
    for r in requests:
        answer = answers[r.request_id] or [0]
        stop = answer[int(rng.integers(len(answer)))]
        stopping.append(replace(r, stop_token_ids=frozenset({stop})))
    engine = make_engine(weights, num_pages)
    sequences = serve(engine, stopping, policy=policy, **options)
    for s in sequences:
        r = s.request
        if not fits[r.request_id]:
            assert s.error is not None and not s.tokens
            continue
        assert s.error is None and len(s.tokens) <= r.max_tokens
        early = [i for i, t in enumerate(s.tokens) if t in r.stop_token_ids]
        if s.finish_reason == "stop":
            assert early == [len(s.tokens) - 1], s
        else:
            assert (s.finish_reason, early, len(s.tokens)) == ("length", [], r.max_tokens), s
    served = [s for s in sequences if fits[s.request.request_id]]
    assert_exact_and_released(engine, config, weights, served)


def make_requests(shapes, vocab_size: int, rng: np.random.Generator) -> list[Request]:
    """Request i of each drawn shape (`request_shapes`), its own tokens drawn
    from rng."""
    return [
        Request(
            f"r{i}",
            SHARED[:shared] + tuple(rng.integers(0, vocab_size, own).tolist()),
            max_tokens=max_tokens,
            n=n,
            arrival_step=arrival,
            priority=priority,
            prompt_logprobs=prompt_logprobs,
        )
        for i, (shared, own, n, max_tokens, arrival, priority, prompt_logprobs) in enumerate(shapes)
    ]


def footprint(request: Request, page_size: int) -> int:
    """Pages a request's samples hold at their full length, each its own."""
    return request.n * -(-(len(request.prompt) + request.max_tokens) // page_size)


def step_bound(requests: list[Request]) -> int:
    """Steps that serving `requests` may take. Every step prefills, preempts
    or decodes; far more steps than tokens means requests are readmitted
    and preempted again without end."""
    return 10 * sum(r.n * (len(r.prompt) + r.max_tokens) for r in requests) + 50


def serve(engine, requests: list[Request], **options) -> list:
    """Scheduler(engine, **options).run(requests)'s sequences, within
    `step_bound` steps."""
    bound = step_bound(requests)

    def on_step(step: int, *_) -> None:
        assert step <= bound, f"{step} steps for {len(requests)} requests"

    sequences, _ = Scheduler(engine, keep_logits=True, **options).run(requests, on_step=on_step)
    return sequences


@settings(max_examples=20, suppress_health_check=list(HealthCheck))
@given(
    shapes=request_shapes,
    cancels=st.lists(st.one_of(st.none(), st.integers(0, 30)), min_size=5, max_size=5),
    num_pages=st.integers(3, 10),
    prefill_budget=st.sampled_from([8, 4096]),
    seed=st.integers(0, 2**16),
)
def test_cancelled_requests_give_their_pages_back_and_others_complete(
    weights, shapes, cancels, num_pages, prefill_budget, seed
):
    """The same loads on the demo's model, some requests cancelled at a
    step (waiting, prefilling in chunks, decoding or preempted): each
    cancelled one gets no event after it, every other servable one every
    token and its Done, and every page comes back."""
    # Every request is submitted at once; arrival steps are run()'s.
    requests = make_requests(shapes, DEMO_CONFIG.vocab_size, np.random.default_rng(seed))
    engine = engine_with_pool(weights, num_pages)
    scheduler = Scheduler(engine, max_prefill_tokens=prefill_budget)
    events: dict[str, list] = {}
    for r in requests:
        if footprint(r, DEMO_PAGE) <= num_pages:
            events[r.request_id] = []
            scheduler.submit(r, events[r.request_id].append)
    cancel_at = {f"r{i}": step for i, step in enumerate(cancels) if step is not None}
    seen: dict[str, int] = {}
    bound = step_bound(requests)
    step = 0
    while scheduler.has_work:
        for rid, at in cancel_at.items():
            if at == step and rid in events and rid not in seen:
                scheduler.cancel(rid)
                seen[rid] = len(events[rid])
        if scheduler.has_work:
            scheduler.step()
        step += 1
        assert step <= bound
    for r in requests:
        if r.request_id not in events:
            continue
        got = events[r.request_id]
        if r.request_id in seen:
            assert len(got) == seen[r.request_id]
        else:
            assert isinstance(got[-1], Done), got[-1]
            tokens = sum(len(e.token_ids) for e in got if isinstance(e, Delta))
            assert tokens == r.n * r.max_tokens
    assert_released(engine)


@settings(max_examples=10, suppress_health_check=list(HealthCheck))
@given(
    shapes=request_shapes,
    num_pages=st.integers(3, 10),
    prefill_budget=st.sampled_from([8, 4096]),
    seed=st.integers(0, 2**16),
)
def test_min_tokens_holds_stop_tokens_back_through_preemption(
    weights, shapes, num_pages, prefill_budget, seed
):
    """The same loads on the demo's model, each request stopping at a
    token of its first sample's answer and asking for min_tokens past
    that token's first place in it: whatever the preemptions and chunked
    prefills, no sample holds a stop token among its first min_tokens
    tokens, a first sample's answer is the unstopped one's until that
    place, a sample that stops ends on its first stop token, and every
    page comes back."""
    rng = np.random.default_rng(seed)
    requests = make_requests(shapes, DEMO_CONFIG.vocab_size, rng)
    fits = {r.request_id: footprint(r, DEMO_PAGE) <= num_pages for r in requests}
    options = {"max_prefill_tokens": prefill_budget}
    sequences = serve(engine_with_pool(weights, num_pages), requests, **options)
    answers = {s.request.request_id: s.tokens for s in sequences if s.sample == 0}
    holding = []
    for r in requests:
        answer = answers[r.request_id] or [0]
        stop = answer[int(rng.integers(len(answer)))]
        first = answer.index(stop)
        held = min(first + 1 + int(rng.integers(0, 3)), r.max_tokens)
        holding.append(replace(r, stop_token_ids=frozenset({stop}), min_tokens=held))
    engine = engine_with_pool(weights, num_pages)
    for s in serve(engine, holding, **options):
        r = s.request
        if not fits[r.request_id]:
            assert s.error is not None and not s.tokens
            continue
        assert s.error is None, s
        if s.sample == 0:
            # Greedy, its row's first choice; the other samples take the
            # next ones, which the held stop token may shift from the start.
            (stop,) = r.stop_token_ids
            first = answers[r.request_id].index(stop)
            assert s.tokens[:first] == answers[r.request_id][:first], s
        stops = [i for i, t in enumerate(s.tokens) if t in r.stop_token_ids]
        assert not stops or stops[0] >= r.min_tokens, s
        if s.finish_reason == "stop":
            assert stops == [len(s.tokens) - 1], s
        else:
            assert (s.finish_reason, stops, len(s.tokens)) == ("length", [], r.max_tokens), s
    assert_released(engine)
