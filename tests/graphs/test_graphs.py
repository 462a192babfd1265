"""The main job: step graphs against NumPy, the scheduler, the demo and its CLI.

All tests share the demo's model (one compile of its two step graphs per
process, reused from MAX's disk cache by the demo subprocess).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import warm_graphs
from conftest import DEMO_CONFIG as CONFIG
from conftest import (
    assert_exact_and_released,
    assert_greedy_steps_match,
    engine_with_pool,
    shared_prompt_requests,
)
from pagedkv.graphs.demo import DemoError, DemoOptions, check_options, gpu_visible
from pagedkv.graphs.numpy_reference import DenseDecoder
from pagedkv.graphs.scheduler import Request, Scheduler
from pagedkv.graphs.self_check import check_sequences

WARM_GRAPHS = ("demo", "demo-command")
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""


def test_one_prefill_and_decode_step_equal_numpy(weights):
    """Logits of a ragged prefill and of the next decode step, through the paged
    graphs, against the dense-cache NumPy model."""
    engine = engine_with_pool(weights, 64)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (1, 17, 40)]
    logits, want = assert_greedy_steps_match(engine, CONFIG, weights, ["a", "b", "c"], prompts, 1)
    assert (logits.argmax(-1) == want.argmax(-1)).all()


def test_decode_reads_two_interleaved_shared_prefixes_once_each(weights):
    """Requests on two system prompts, interleaved in the batch: decode puts
    each prompt's requests side by side, scores each prefix in shared work
    items, and returns every request's logits in the caller's order, equal
    to the dense NumPy model's."""
    engine = engine_with_pool(weights, 256)
    assert engine.share_prefixes
    rng = np.random.default_rng(5)
    systems = [rng.integers(0, CONFIG.vocab_size, 300).tolist() for _ in range(2)]
    ids = [f"r{i}" for i in range(8)]
    prompts = [
        systems[i % 2] + rng.integers(0, CONFIG.vocab_size, 5 + i).tolist() for i in range(8)
    ]
    for i in ids[:2]:
        engine.manager.add(i)
    first = engine.prefill(ids[:2], prompts[:2])
    hits = [engine.manager.add(i, p) for i, p in zip(ids[2:], prompts[2:], strict=True)]
    assert min(hits) == 288  # 18 whole pages of each system prompt
    rest = engine.prefill(ids[2:], [p[h:] for h, p in zip(hits, prompts[2:], strict=True)])
    refs = [DenseDecoder(CONFIG, weights) for _ in prompts]
    want = np.stack([r.feed(p) for r, p in zip(refs, prompts, strict=True)])
    np.testing.assert_allclose(np.concatenate([first, rest]), want, rtol=1e-4, atol=1e-4)
    plans = []
    work = engine._work
    engine._work = lambda kind, meta: plans.append(work(kind, meta)) or plans[-1]
    nxt = want.argmax(-1)
    logits = engine.decode(ids, nxt)
    items, _ = plans[-1]
    assert sorted(items[:, 2].tolist())[-2:] == [4, 4]  # each prompt's four requests
    want = np.stack([r.feed([int(t)]) for r, t in zip(refs, nxt, strict=True)])
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)


def test_a_step_that_raises_leaves_no_prefix_key_on_what_it_was_to_write(weights, monkeypatch):
    """A prefill chunk and a decode step whose computation raises after
    reserve() keyed the pages they were to fill: those keys are dropped
    (the page a chunk was to complete included), the keys of pages filled
    before stay, and the prompt prefilled again on what is still cached
    gives the NumPy model's logits. Bad flags are refused before reserve()."""
    engine = engine_with_pool(weights, 64)
    m, size = engine.manager, engine.manager.page_size
    rng = np.random.default_rng(41)
    prompt = rng.integers(0, CONFIG.vocab_size, 3 * size + 2).tolist()
    short = rng.integers(0, CONFIG.vocab_size, 2 * size - 1).tolist()
    m.add("chunked", prompt)
    m.add("short", short)
    engine.prefill(["chunked", "short"], [prompt[: 2 * size - 3], short])
    run = engine._run

    def failing(*args):
        raise RuntimeError("the step failed")

    monkeypatch.setattr(engine, "_run", failing)
    with pytest.raises(RuntimeError, match="the step failed"):
        engine.prefill(["chunked"], [prompt[2 * size - 3 :]])
    with pytest.raises(RuntimeError, match="the step failed"):
        engine.decode(["short"], [7])
    assert m.cached_prefix_length(prompt) == size
    assert m.cached_prefix_length([*short, 7]) == size
    m.release("chunked")
    m.release("short")
    m.validate()
    monkeypatch.setattr(engine, "_run", run)
    assert m.add("again", prompt) == size
    logits = engine.prefill(["again"], [prompt[size:]])
    want = DenseDecoder(CONFIG, weights).feed(prompt)
    np.testing.assert_allclose(logits[0], want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="every_row"):  # refused before reserve()
        engine.prefill(["again"], [[1]], every_row=[True, False])
    assert m.seq_len("again") == len(prompt)


def test_scheduler_replaces_finished_requests_and_leaks_nothing(weights):
    """A pool that holds two requests at a time: later arrivals wait, start when
    earlier ones finish, and every page comes back."""
    engine = engine_with_pool(weights, 12)
    rng = np.random.default_rng(5)
    requests = shared_prompt_requests(
        rng, CONFIG.vocab_size, 32, [5, 6, 7, 8], [4, 7, 10, 13], forked=2
    )
    steps_running: list[int] = []
    sequences, stats = Scheduler(engine, keep_logits=True).run(
        requests, on_step=lambda step, tokens, running: steps_running.append(running)
    )
    assert [len(s.tokens) for s in sequences] == [4, 7, 10, 10, 13]
    assert max(steps_running) < sum(r.n for r in requests)  # not all at once
    assert engine.manager.stats.prefix_hits > 0  # the shared system prompt
    check = assert_exact_and_released(engine, CONFIG, weights, sequences)
    assert check.tokens == sum(len(s.tokens) for s in sequences)


def test_self_check_forgives_a_swap_only_within_the_engines_own_error(weights):
    """A token that differs from the reference's is a near-tie when the two
    candidates' reference logits lie within twice that step's logit error,
    and a mismatch otherwise."""
    from pagedkv.graphs.scheduler import Sequence

    prompt = (5, 9, 200, 31)
    reference = DenseDecoder(CONFIG, weights)
    logits = [reference.feed(list(prompt))]
    first = int(np.argmax(logits[0]))
    logits.append(reference.feed([first]))
    ranked = np.argsort(-logits[1])
    gap = float(logits[1][ranked[0]] - logits[1][ranked[1]])
    assert gap > 1e-3  # this seed's second step is not a tie already

    def sequence(second: int, error: float) -> Sequence:
        engine_logits = [logits[0].copy(), logits[1] + error]
        request = Request("r", prompt, max_tokens=2)
        return Sequence("r/0", request, 0, [first, second], engine_logits)

    # The check recomputes the reference's logits; NumPy's float32 products
    # may round differently from one call to the next (BLAS kernels chosen
    # by shape and alignment), so "exact" is within a float32 rounding here.
    rounding = 1e-5 * float(np.abs(logits[1]).max())
    assert gap > 100 * rounding
    check = check_sequences(CONFIG, weights, [sequence(int(ranked[0]), 0.0)])
    assert check.passed and check.near_ties == 0 and check.max_logit_diff <= rounding
    check = check_sequences(CONFIG, weights, [sequence(int(ranked[1]), 0.0)])
    assert not check.passed  # the runner-up, with exact logits
    check = check_sequences(CONFIG, weights, [sequence(int(ranked[1]), 0.6 * gap)])
    assert check.passed and check.near_ties == 1
    assert check.max_logit_diff == pytest.approx(0.6 * gap, abs=rounding)


def test_a_callers_module_holds_its_specs_whatever_was_compiled_before():
    """A module's compile is cached on disk by what the module holds: the
    step graphs' module must carry the page-copy op even when this process
    loaded it before (the suite does, the demo does not), or the demo misses
    the compile the suite cached."""
    from pagedkv._ops.kernels import prepare
    from pagedkv._ops.tensors import CPU
    from pagedkv.page import COPY_PAGES

    prepare([COPY_PAGES], CPU)
    assert len(prepare([COPY_PAGES], CPU, graphs=lambda module: None, key="none")) == 1


def test_demo_runs_and_checks_itself():
    warm_graphs.wait("demo-command")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "demo",
            "--model",
            "random",
            "--requests",
            "5",
            "--max-new-tokens",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "self-check" in result.stdout and "PASS" in result.stdout
    assert "0 at the end (none leaked)" in result.stdout
    assert "compile:" in result.stdout and "tokens/s" in result.stdout


def test_a_demo_of_one_token_a_request_has_no_decode_steps_to_report(capsys):
    """Every request ends with the token its prefill sampled: the demo says
    so instead of taking percentiles of no step times."""
    from pagedkv.graphs.demo import run_demo

    warm_graphs.wait("demo-command")
    assert run_demo(DemoOptions(model="random", requests=1, max_new_tokens=1)) == 0
    printed = capsys.readouterr().out
    assert "decode step latency: no decode steps" in printed
    assert "PASS" in printed


@pytest.mark.parametrize(
    "flags,message",
    [
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (
            ["demo", "--model", "random", "--qo-heads", "6", "--kv-heads", "4"],
            "not a multiple of --kv-heads",
        ),
        (["demo", "--layers", "2"], "--layers shape the random model only"),
        (["demo", "--model", "gpt5"], "unknown model 'gpt5'"),
        (["demo", "--model", "random", "--max-new-tokens", "5000"], "past the model's maximum"),
        (["demo", "--model", "random", "--num-pages", "3"], "raise --num-pages"),
        (["demo", "--device", "tpu"], "--device must be cpu or gpu"),
        (["demo", "--requests", "x"], "invalid int value"),
        (["bench", "--dtypes", "float64"], "--dtypes takes"),
        (["serve", "--kv-events", "127.0.0.1:5557"], "--kv-events: endpoint must be a ZeroMQ"),
        (["serve", "--prefix-store", "http://127.0.0.1:1"], "--prefix-store: Redis URL must"),
        (["route"], "give --replica URLs"),
        (["route", "--prefill", "http://a"], "give --prefill and --decode instances"),
    ],
)
def test_cli_errors_are_one_line_with_status_2(flags, message):
    result = subprocess.run(
        [sys.executable, "-m", "pagedkv", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(gpu_visible(), reason="a GPU is visible here")
def test_demo_on_gpu_without_one_is_a_clear_error():
    with pytest.raises(DemoError, match="no CUDA GPU visible"):
        check_options(DemoOptions(device="gpu"))


def test_demo_options_are_checked_before_anything_runs():
    config, requests, num_pages = check_options(DemoOptions(requests=3, max_new_tokens=4))
    assert config == CONFIG and len(requests) == 3 and num_pages >= 1
    assert all(r.prompt[:64] == requests[0].prompt[:64] for r in requests)  # shared prompt


@pytest.mark.gpu
def test_demo_serves_and_checks_itself_on_gpu(capsys):
    """The main job on the GPU: graphs, pools and copy-on-write there."""
    from pagedkv.graphs.demo import DemoOptions, run_demo

    status = run_demo(
        DemoOptions(device="gpu", model="random", requests=5, layers=2, max_new_tokens=8)
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "PASS" in out and "(none leaked)" in out
