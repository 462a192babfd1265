"""The one scheduler (pagedkv.graphs.scheduler) on the demo's random model:
preemption by recompute checked token by token against NumPy, the queue
policies, cancellation, a raising callback, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import DEMO_CONFIG as CONFIG
from conftest import assert_reference_tokens, engine_with_pool
from pagedkv.graphs.numpy_reference import DenseDecoder
from pagedkv.graphs.sampling import LogitAdjustments, log_softmax
from pagedkv.graphs.scheduler import (
    Delta,
    Done,
    PromptLogprobs,
    QueueFullError,
    Request,
    RequestError,
    Scheduler,
)

WARM_GRAPHS = ("demo",)
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""


def prompts(seed: int, count: int, length: int) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(0, CONFIG.vocab_size, length).tolist()) for _ in range(count)]


def record_prefills(engine) -> list[list[int]]:
    """The token counts of each prefill call the engine gets from now on, a
    list per call (the engine's prefill is wrapped)."""
    prefills: list[list[int]] = []
    prefill = engine.prefill

    def recorded(ids, tokens, *args, **kwargs):
        prefills.append([len(t) for t in tokens])
        return prefill(ids, tokens, *args, **kwargs)

    engine.prefill = recorded
    return prefills


@pytest.mark.parametrize("prefill_budget", [4096, 8])
def test_preempted_requests_recompute_the_reference_tokens(weights, prefill_budget):
    """A pool a quarter the size of the requests' full lengths: admission is
    optimistic, so decode steps run out and requests are preempted and
    prefilled again from prompt + tokens so far; every token still matches
    the NumPy model's, and every page comes back. With a budget of 8
    tokens a step, prompts and recomputes are prefilled in chunks of at
    most 8 tokens meanwhile."""
    engine = engine_with_pool(weights, 8)
    requests = [
        Request(f"r{i}", p, max_tokens=40, n=2 if i == 1 else 1)
        for i, p in enumerate(prompts(11, 4, 20))
    ]
    # Full length: 60 tokens, 4 pages a sample, 20 pages in all.
    scheduler = Scheduler(engine, max_prefill_tokens=prefill_budget, keep_logits=True)
    prefills = record_prefills(engine)
    sequences, stats = scheduler.run(requests)
    assert stats.preemptions > 0
    assert max(sum(call) for call in prefills) <= prefill_budget
    assert [len(s.tokens) for s in sequences] == [40] * 5
    assert all(s.finish_reason == "length" for s in sequences)
    assert stats.peak_used_pages <= 8
    assert engine.manager.num_used_pages == 0
    engine.manager.validate()
    check = assert_reference_tokens(CONFIG, weights, sequences)
    assert check.tokens == 200


@pytest.mark.parametrize(
    ("policy", "order"), [("fcfs", ["r0", "r1", "r2"]), ("priority", ["r1", "r2", "r0"])]
)
def test_the_policy_orders_admission(weights, policy, order):
    """One sequence at a time: requests start in submission order under
    "fcfs", by priority (lower first) under "priority"."""
    engine = engine_with_pool(weights, 32)
    requests = [
        Request(f"r{i}", p, max_tokens=3, priority=priority)
        for i, (p, priority) in enumerate(zip(prompts(2, 3, 6), (2, 0, 1), strict=True))
    ]
    started: list[str] = []

    def on_token(s, token: int) -> None:
        if len(s.tokens) == 1:
            started.append(s.request.request_id)

    Scheduler(engine, max_num_seqs=1, policy=policy).run(requests, on_token=on_token)
    assert started == order
    assert engine.manager.num_used_pages == 0


@pytest.mark.parametrize(("prompt_len", "first_prefill"), [(20, [20, 20]), (32, [32])])
def test_admission_counts_the_first_decode_as_reserve_does(weights, prompt_len, first_prefill):
    """Two requests on a 4-page pool (16-token pages), each needing 3 pages
    at its full length. A prompt that ends inside its last page decodes its
    first token into that page, so both prompts (2 pages each) fit at once;
    a prompt that fills its pages opens a third at its first decode, so
    the second request waits."""
    engine = engine_with_pool(weights, 4)
    requests = [Request(f"r{i}", p, max_tokens=13) for i, p in enumerate(prompts(5, 2, prompt_len))]
    prefills = record_prefills(engine)
    sequences, _ = Scheduler(engine, keep_logits=True).run(requests)
    assert prefills[0] == first_prefill
    assert [len(s.tokens) for s in sequences] == [13, 13]
    assert engine.manager.num_used_pages == 0
    assert_reference_tokens(CONFIG, weights, sequences)


def test_a_cancelled_request_releases_its_pages_and_gets_no_more_events(weights):
    engine = engine_with_pool(weights, 32)
    scheduler = Scheduler(engine)
    events: dict[str, list] = {"a": [], "b": []}
    for rid, p in zip(events, prompts(3, 2, 20), strict=True):
        scheduler.submit(Request(rid, p, max_tokens=30), events[rid].append)
    for _ in range(3):
        scheduler.step()
    used = engine.manager.num_used_pages
    assert scheduler.cancel("a") and not scheduler.cancel("nobody")
    assert engine.manager.num_used_pages < used
    seen = len(events["a"])
    while scheduler.has_work:
        scheduler.step()
    assert len(events["a"]) == seen
    assert isinstance(events["b"][-1], Done)
    assert sum(isinstance(e, Delta) for e in events["b"]) == 30
    assert engine.manager.num_used_pages == 0
    engine.manager.validate()


def test_a_raising_callback_stops_the_run_and_leaks_no_page(weights):
    engine = engine_with_pool(weights, 32)

    def on_token(s, token: int) -> None:
        if len(s.tokens) == 3:
            raise KeyboardInterrupt("the user pressed ^C")

    with pytest.raises(KeyboardInterrupt):
        Scheduler(engine).run(
            [Request(f"r{i}", p, 10) for i, p in enumerate(prompts(4, 2, 8))],
            on_token=on_token,
        )
    assert engine.manager.num_used_pages == 0
    engine.manager.validate()


def test_refusals_come_before_anything_is_queued(weights):
    engine = engine_with_pool(weights, 8)
    scheduler = Scheduler(engine, max_waiting=1)
    prompt = prompts(5, 1, 8)[0]
    with pytest.raises(RequestError, match="empty"):
        scheduler.submit(Request("e", (), 4), print)
    with pytest.raises(RequestError, match="detokenizer"):
        scheduler.submit(Request("s", prompt, 4, stop=("\n",)), print)
    with pytest.raises(RequestError, match="pool holds 8"):
        scheduler.submit(Request("big", prompt, 200), print)
    with pytest.raises(RequestError, match="context length"):
        scheduler.submit(Request("long", prompt, CONFIG.max_positions), print)
    assert not scheduler.has_work
    scheduler.submit(Request("ok", prompt, 4), lambda event: None)
    with pytest.raises(QueueFullError):
        scheduler.submit(Request("more", prompt, 4), print)
    with pytest.raises(ValueError, match="policy"):
        Scheduler(engine, policy="lifo")
    while scheduler.has_work:
        scheduler.step()
    assert engine.manager.num_used_pages == 0


def test_logprobs_are_the_models_log_softmax(weights):
    """Each token's logprob and its top 5, and every prompt token's after the
    first, against the float64 NumPy model's log-softmax; the greedy token is
    the most likely one and the probabilities sum to 1."""
    engine = engine_with_pool(weights, 32)
    prompt = prompts(6, 1, 12)[0]
    events: list = []
    scheduler = Scheduler(engine)
    scheduler.submit(Request("lp", prompt, 6, logprobs=5, prompt_logprobs=3), events.append)
    while scheduler.has_work:
        scheduler.step()
    assert isinstance(events[0], PromptLogprobs)
    deltas = [e for e in events if isinstance(e, Delta)]
    assert len(deltas) == 6 and isinstance(events[-1], Done)

    reference = DenseDecoder(CONFIG, weights)
    want_prompt = log_softmax(reference.feed_all(list(prompt)))
    entries = events[0].entries
    assert entries[0] is None and len(entries) == len(prompt)
    for j, entry in enumerate(entries[1:], start=1):
        assert entry.token == prompt[j]
        assert entry.logprob == pytest.approx(want_prompt[j - 1, prompt[j]], abs=2e-3)
        assert [t for t, _ in entry.top] == list(np.argsort(-want_prompt[j - 1])[:3])

    generated = [d.token_ids[0] for d in deltas]
    want = log_softmax(np.stack([want_prompt[-1], *reference.feed_all(generated[:-1])]))
    for i, d in enumerate(deltas):
        lp = d.logprobs
        assert lp.token == generated[i]
        assert lp.logprob == pytest.approx(want[i, lp.token], abs=2e-3)
        assert lp.top[0][0] == lp.token  # greedy: the most likely
        assert lp.top[0][1] == lp.logprob
        assert len(lp.top) == 5 and np.all(np.diff([v for _, v in lp.top]) <= 0)
    assert engine.manager.num_used_pages == 0


def test_logit_bias_and_penalties_change_the_choice_not_the_logprobs(weights):
    engine = engine_with_pool(weights, 32)
    prompt = prompts(7, 1, 10)[0]
    forced = 17
    bias = LogitAdjustments(logit_bias=((forced, 1e4),))
    events: list = []
    scheduler = Scheduler(engine)
    scheduler.submit(Request("b", prompt, 4, logprobs=1, adjustments=bias), events.append)
    plain: list = []
    scheduler.submit(Request("p", prompt, 4, logprobs=1), plain.append)
    while scheduler.has_work:
        scheduler.step()
    biased = [e for e in events if isinstance(e, Delta)]
    assert [d.token_ids[0] for d in biased] == [forced] * 4
    # The reported logprobs are the model's, without the bias: the forced
    # token's own and the model's most likely token on top.
    reference = DenseDecoder(CONFIG, weights)
    want_prompt = log_softmax(reference.feed_all(list(prompt)))
    want = log_softmax(np.stack([want_prompt[-1], *reference.feed_all([forced] * 3)]))
    assert want[0].max() - want[0, forced] > 1  # else a leaked bias would not show
    for i, d in enumerate(biased):
        assert d.logprobs.logprob == pytest.approx(want[i, forced], abs=2e-3)
        # A most likely token (within the tolerance: near ties may go either way).
        assert want[i, d.logprobs.top[0][0]] == pytest.approx(want[i].max(), abs=2e-3)
    first_plain = next(e for e in plain if isinstance(e, Delta))
    assert want[0, first_plain.token_ids[0]] == pytest.approx(want[0].max(), abs=2e-3)

    # A large frequency penalty: a greedy answer never repeats a token.
    events = []
    no_repeats = LogitAdjustments(frequency_penalty=1e4)
    scheduler.submit(Request("f", prompt, 24, adjustments=no_repeats), events.append)
    while scheduler.has_work:
        scheduler.step()
    tokens = [e.token_ids[0] for e in events if isinstance(e, Delta)]
    assert len(tokens) == 24 and len(set(tokens)) == 24
    assert engine.manager.num_used_pages == 0


def test_the_repetition_penalty_chooses_from_the_penalized_logits(weights):
    """Each greedy token is the argmax of the model's logits with every token
    of the prompt and the answer so far penalized (written out here)."""
    engine = engine_with_pool(weights, 32)
    prompt = prompts(0, 1, 12)[0]  # its plain greedy answer repeats a token
    penalty = 3.0
    scheduler = Scheduler(engine, keep_logits=True)
    adjustments = LogitAdjustments(repetition_penalty=penalty)
    (s,), _ = scheduler.run([Request("r", prompt, 24, ignore_eos=True, adjustments=adjustments)])
    for k, (token, row) in enumerate(zip(s.tokens, s.logits, strict=True)):
        want = row.astype(np.float64).copy()
        seen = sorted({*prompt, *s.tokens[:k]})
        want[seen] = np.where(want[seen] > 0, want[seen] / penalty, want[seen] * penalty)
        assert token == int(np.argmax(want)), k
    (plain,), _ = Scheduler(engine).run([Request("p", prompt, 24, ignore_eos=True)])
    assert plain.tokens != s.tokens  # the penalty bites on this prompt
    assert engine.manager.num_used_pages == 0


def test_stop_token_ids_end_a_sample_and_min_tokens_holds_them_back(weights):
    engine = engine_with_pool(weights, 32)
    prompt = prompts(10, 1, 8)[0]
    (plain,), _ = Scheduler(engine).run([Request("p", prompt, 16, ignore_eos=True)])
    stop = plain.tokens[2]
    (stopped,), _ = Scheduler(engine).run(
        [Request("s", prompt, 16, ignore_eos=True, stop_token_ids=frozenset({stop}))]
    )
    first = plain.tokens.index(stop)
    assert stopped.tokens == plain.tokens[: first + 1] and stopped.finish_reason == "stop"
    held = Request("m", prompt, 16, stop_token_ids=frozenset({stop}), min_tokens=6)
    (late,), _ = Scheduler(engine, eos_token_ids=frozenset({plain.tokens[0]})).run([held])
    assert len(late.tokens) >= 6
    assert not {stop, plain.tokens[0]} & set(late.tokens[:6])
    # Held in a decode step: the same tokens up to the stop's place, then another.
    held = Request("d", prompt, 16, stop_token_ids=frozenset({stop}), min_tokens=6)
    (late,), _ = Scheduler(engine).run([held])
    assert late.tokens[:first] == plain.tokens[:first] and first > 0
    assert stop not in late.tokens[:6]
    assert engine.manager.num_used_pages == 0


def test_bad_logprob_and_bias_requests_are_refused(weights):
    scheduler = Scheduler(engine_with_pool(weights, 8))
    prompt = prompts(8, 1, 4)[0]
    bad = [
        (Request("a", prompt, 2, logprobs=21), "logprobs"),
        (Request("b", prompt, 2, prompt_logprobs=-1), "prompt_logprobs"),
        (
            Request("c", prompt, 2, adjustments=LogitAdjustments(((CONFIG.vocab_size, 1.0),))),
            "outside the vocabulary",
        ),
        (Request("d", prompt, 2, adjustments=LogitAdjustments(((3, np.inf),))), "not finite"),
        (Request("e", prompt, 2, adjustments=LogitAdjustments(presence_penalty=np.nan)), "finite"),
        (Request("f", prompt, 2, adjustments=LogitAdjustments(repetition_penalty=0)), "above 0"),
        (Request("g", prompt, 2, stop_token_ids=frozenset({-1})), "stop_token_ids"),
        (Request("h", prompt, 2, min_tokens=3), "min_tokens"),
    ]
    for request, message in bad:
        with pytest.raises(RequestError, match=message):
            scheduler.submit(request, print)
    assert not scheduler.has_work


def test_samples_whose_first_token_ends_them_still_fork(weights):
    """n = 3 with max_tokens 1 (or a first token that stops sample 0):
    every sample is forked before the first one ends and releases its pages."""
    engine = engine_with_pool(weights, 32)
    prompt = prompts(9, 1, 20)[0]
    scheduler = Scheduler(engine)
    events: list = []
    scheduler.submit(Request("one", prompt, 1, n=3), events.append)
    first = {}

    def learn(event) -> None:
        if isinstance(event, Delta) and event.index == 0:
            first.setdefault("token", event.token_ids[0])

    scheduler.submit(Request("probe", prompt, 1), learn)
    while scheduler.has_work:
        scheduler.step()
    stop = frozenset({first["token"]})
    scheduler.submit(Request("stop", prompt, 5, n=3, stop_token_ids=stop), events.append)
    while scheduler.has_work:
        scheduler.step()
    deltas = [e for e in events if isinstance(e, Delta)]
    assert [d.finish_reason for d in deltas[:3]] == ["length"] * 3
    assert deltas[3].finish_reason == "stop" and deltas[3].index == 0
    assert sum(isinstance(e, Done) for e in events) == 2
    assert engine.manager.num_used_pages == 0
    engine.manager.validate()


def test_a_shared_prompt_is_prefilled_once_and_other_requests_go_on(weights):
    """Three requests on one uncached prompt of several pages and one
    unrelated request, submitted together: one prefill computes the shared
    pages, the other two wait a step and find them cached (while the
    unrelated request is admitted at once); every token matches the NumPy
    model's."""
    engine = engine_with_pool(weights, 64)
    size = engine.manager.page_size
    shared = prompts(21, 1, 3 * size)[0]
    tails = prompts(22, 4, 3)
    requests = [Request(f"s{i}", shared + tails[i], max_tokens=4) for i in range(3)]
    requests.append(Request("other", prompts(23, 1, 3 * size)[0], max_tokens=4))
    scheduler = Scheduler(engine, keep_logits=True)
    prefills = record_prefills(engine)
    sequences, _ = scheduler.run(requests)
    # The first step: s0 and the unrelated request, each computing its
    # whole prompt; the next: s1 and s2, only their own tails.
    assert prefills[0] == [3 * size + 3, 3 * size]
    assert prefills[1] == [3, 3]
    assert scheduler.stats.prompt_tokens_cached == 2 * 3 * size
    assert engine.manager.num_used_pages == 0
    assert_reference_tokens(CONFIG, weights, sequences)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(weights):
    """With a budget of one page of prompt tokens a step, a prompt of four
    pages and a bit arriving beside a running stream is prefilled a page a
    step; the stream gets a token every step meanwhile; the long request's
    two samples fork after its last chunk; every token matches the NumPy
    model's and every page comes back."""
    engine = engine_with_pool(weights, 64)
    size = engine.manager.page_size
    short, long = prompts(31, 1, 5)[0], prompts(32, 1, 4 * size + 6)[0]
    requests = [
        Request("short", short, max_tokens=12),
        Request("long", long, max_tokens=4, n=2, arrival_step=1),
    ]
    prefills = record_prefills(engine)
    order: list[str] = []
    scheduler = Scheduler(engine, max_prefill_tokens=size, keep_logits=True)
    sequences, _ = scheduler.run(
        requests, on_token=lambda s, token: order.append(s.request.request_id)
    )
    assert prefills == [[5], [size], [size], [size], [size], [6]]
    # The stream's first two tokens, then one with each of the first four
    # chunks; the last chunk's step prefills before it decodes.
    assert order.index("long") == 2 + 4
    assert [len(s.tokens) for s in sequences] == [12, 4, 4]
    assert engine.manager.num_used_pages == 0
    engine.manager.validate()
    assert_reference_tokens(CONFIG, weights, sequences)


def test_a_request_cancelled_between_chunks_releases_its_pages(weights):
    engine = engine_with_pool(weights, 64)
    size = engine.manager.page_size
    scheduler = Scheduler(engine, max_prefill_tokens=size)
    events: list = []
    scheduler.submit(Request("long", prompts(33, 1, 5 * size)[0], max_tokens=4), events.append)
    scheduler.step()
    scheduler.step()
    assert engine.manager.num_used_pages == 2 and scheduler.num_prefilling == 1 and not events
    assert scheduler.cancel("long")
    assert engine.manager.num_used_pages == 0 and not scheduler.has_work
    assert scheduler.num_prefilling == 0
    engine.manager.validate()


def test_chunks_end_on_page_boundaries_whatever_else_is_prefilled(weights):
    """A budget of two pages and a half: a prompt's chunk is cut at a page
    boundary; its last chunk and a new prompt's first share a step, the new
    one taking the whole pages of what is left."""
    engine = engine_with_pool(weights, 64)
    size = engine.manager.page_size
    first, second = prompts(34, 1, 3 * size + 5)[0], prompts(35, 1, 40)[0]
    prefills = record_prefills(engine)
    scheduler = Scheduler(engine, max_prefill_tokens=2 * size + 8, keep_logits=True)
    sequences, _ = scheduler.run([Request("a", first, 3), Request("b", second, 3)])
    assert prefills == [[2 * size], [size + 5, size], [40 - size]]
    assert_reference_tokens(CONFIG, weights, sequences)
    assert engine.manager.num_used_pages == 0


@pytest.mark.parametrize("chunked", [False, True])
def test_a_prompt_ending_mid_page_is_shared_to_its_last_token(weights, chunked):
    """Requests on a system prompt of two pages and 5 tokens: the later ones
    take the two pages cached and the 5 tokens of the third copied from the
    first request's (a partial hit), and prefill only their own tails; with
    a budget of a page and 2 tokens a step (`chunked`), chunks still end
    on page boundaries, the first after the copied tokens. Every token
    matches the NumPy model's (logits within 1e-4)."""
    engine = engine_with_pool(weights, 64)
    size = engine.manager.page_size
    budget = size + 2 if chunked else 4096
    system, tails = prompts(38, 1, 2 * size + 5)[0], prompts(39, 3, size + 4)
    requests = [Request(f"s{i}", system + tails[i], max_tokens=3) for i in range(3)]
    calls: list[list[tuple[int, int]]] = []
    prefill = engine.prefill

    def recorded(ids, tokens, *args, **kwargs):
        m = engine.manager
        calls.append([(m.seq_len(i), len(t)) for i, t in zip(ids, tokens, strict=True)])
        return prefill(ids, tokens, *args, **kwargs)

    engine.prefill = recorded
    scheduler = Scheduler(engine, max_prefill_tokens=budget, keep_logits=True)
    sequences, _ = scheduler.run(requests)
    assert engine.manager.stats.partial_hit_tokens == 2 * 5
    assert scheduler.stats.prompt_tokens_cached == 2 * (2 * size + 5)
    prompt_length = len(system) + size + 4
    starts = [start for call in calls for start, _ in call]
    assert starts.count(2 * size + 5) == 2  # the copied tokens' end
    for call in calls:
        assert sum(n for _, n in call) <= budget
        for start, n in call:  # a chunk short of the prompt's end ends a page
            assert start + n == prompt_length or (start + n) % size == 0, calls
    if not chunked:
        assert calls[1:] == [[(2 * size + 5, size + 4)] * 2]
    assert_reference_tokens(CONFIG, weights, sequences)
    assert engine.manager.num_used_pages == 0


def test_requests_sharing_a_chunked_prompt_wait_for_its_pages(weights):
    """Three requests on one uncached prompt of four pages, a budget of
    three pages a step: the first is prefilled in two chunks; the others
    wait while its last chunk computes the page they would start on, then
    find the whole prompt cached and compute only their own tails."""
    engine = engine_with_pool(weights, 64)
    size = engine.manager.page_size
    shared, tails = prompts(36, 1, 4 * size)[0], prompts(37, 3, 3)
    requests = [Request(f"s{i}", shared + tails[i], max_tokens=3) for i in range(3)]
    prefills = record_prefills(engine)
    scheduler = Scheduler(engine, max_prefill_tokens=3 * size, keep_logits=True)
    sequences, _ = scheduler.run(requests)
    assert prefills == [[3 * size], [size + 3], [3, 3]]
    assert scheduler.stats.prompt_tokens_cached == 2 * 4 * size
    assert_reference_tokens(CONFIG, weights, sequences)
    assert engine.manager.num_used_pages == 0
