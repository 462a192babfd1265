"""Batch-invariant mode (`batch_invariant=True`): one request's logits are
bitwise the same alone and among 31 companions of other lengths, 15 of
which share its prompt's first pages, for the
demo's float model and SmolLM2's GGUF blocks, with MAX's workers on
all cores or crowded onto one (tasks then finish in another order), and
with its prompt prefilled whole or in pieces that start at page starts.
Equality is bitwise because the code guarantees it: decode splits a
request's keys at fixed positions, and every other part of a step computes
each row on its own in an order the batch does not change."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import engine_with_pool

WARM_GRAPHS = ("demo",)
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""

PROMPT_LEN, COMPANIONS, STEPS = 300, 31, 4


def logits_alone_and_in_a_batch(engine, vocab: int) -> tuple[list, list]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, vocab, PROMPT_LEN).tolist()
    others = [rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(20, 700, COMPANIONS)]
    # The first half of the companions start with the prompt's first 200
    # tokens: a prefix hit on its pages, which decode reads once for the
    # request and them unless it is batch-invariant.
    half = COMPANIONS // 2
    others[:half] = [prompt[:200] + o for o in others[:half]]

    def run(companions: list) -> list[np.ndarray]:
        ids = ["t"] + [f"o{i}" for i in range(len(companions))]
        engine.manager.add("t", [])  # no hit on the last run's pages: prefilled whole
        out = [engine.prefill(["t"], [prompt])[0].copy()]
        if companions:
            hits = [engine.manager.add(i, c) for i, c in zip(ids[1:], companions, strict=True)]
            assert max(hits) > 0
            engine.prefill(ids[1:], [c[h:] for h, c in zip(hits, companions, strict=True)])
        tokens = [int(np.argmax(out[0]))] * len(ids)
        for _ in range(STEPS):
            logits = engine.decode(ids, tokens)
            out.append(logits[0].copy())
            tokens = [int(t) for t in logits.argmax(-1)]
        for i in ids:
            engine.manager.release(i)
        engine.manager.validate()
        return out

    return run([]), run(others)


def test_demo_model_logits_do_not_depend_on_the_batch(weights):
    from conftest import DEMO_CONFIG

    engine = engine_with_pool(weights, 1024, batch_invariant=True)
    assert engine.decode_chunk is not None
    alone, batched = logits_alone_and_in_a_batch(engine, DEMO_CONFIG.vocab_size)
    for a, b in zip(alone, batched, strict=True):
        np.testing.assert_array_equal(a, b)


def logits_prefilled_in_pieces(engine, prompt: list, pieces: list) -> list[np.ndarray]:
    """The last prompt token's logits and 3 greedy decode steps' after the
    prompt is prefilled in pieces of these sizes (each one step)."""
    engine.manager.add("p", [])
    start = 0
    for size in pieces:
        logits = engine.prefill(["p"], [prompt[start : start + size]])[0].copy()
        start += size
    out = [logits]
    for _ in range(3):
        out.append(engine.decode(["p"], [int(np.argmax(out[-1]))])[0].copy())
    engine.manager.release("p")
    return out


def prefill_tiles(pieces: list, group: int, align) -> set:
    """(first query position, queries, first key, key end) of every CPU
    prefill tile when a prompt is prefilled in pieces of these sizes."""
    from pagedkv._plan.work import AttentionOptions, prefill_work

    tiles, done = set(), 0
    for size in pieces:
        done += size
        items, _, _ = prefill_work(
            np.array([done]), np.array([0, size]), group, AttentionOptions(64), True, False, align
        )
        tiles |= {tuple(int(v) for v in row[[3, 2, 4, 5]]) for row in items}
    return tiles


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
def test_aligned_prefill_tiles_are_the_same_however_a_prompt_is_split(group):
    """The fields of the work items: with align, a query's tile (its rows,
    its keys) is the whole prefill's whenever the pieces start at multiples
    of align; without it, a group whose tile is not a power of two does not
    keep them."""
    whole = prefill_tiles([300], group, 16)
    for pieces in ([16, 284], [128, 172], [96, 96, 108]):
        assert prefill_tiles(pieces, group, 16) == whole
    if group in (3, 5):
        assert prefill_tiles([128, 172], group, None) != prefill_tiles([300], group, None)


def test_a_prompt_prefilled_in_pieces_from_page_starts_gets_the_same_logits(weights):
    """Pieces that start at page starts, as a prefix-cache hit or a resumed
    preempted request prefills them: the prefill's query tiles lie on the
    page grid, so every query gets the sums a whole prefill gives it."""
    from conftest import DEMO_CONFIG, DEMO_PAGE

    engine = engine_with_pool(weights, 256, batch_invariant=True)
    prompt = np.random.default_rng(1).integers(1, DEMO_CONFIG.vocab_size, 300).tolist()
    whole = logits_prefilled_in_pieces(engine, prompt, [300])
    for pieces in ([DEMO_PAGE, 284], [8 * DEMO_PAGE, 172], [6 * DEMO_PAGE] * 2 + [108]):
        got = logits_prefilled_in_pieces(engine, prompt, pieces)
        for a, b in zip(whole, got, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_gguf_logits_do_not_depend_on_the_batch_or_the_cores(tmp_path):
    """SmolLM2's quantized step graphs, alone and in a batch, in this process
    and in one whose threads may run on one core only. Slow: the only test
    that compiles the GGUF step graphs (over a minute cold)."""
    from pagedkv.models import load

    llm = load(weights="gguf", batch_invariant=True)
    alone, batched = logits_alone_and_in_a_batch(llm.engine, llm.config.vocab_size)
    for a, b in zip(alone, batched, strict=True):
        np.testing.assert_array_equal(a, b)
    # GQA group 3: its whole-prefill tiles (16 tokens on the page grid) differ
    # from a piece's unless they are aligned.
    prompt = np.random.default_rng(2).integers(1, llm.config.vocab_size, 300).tolist()
    whole = logits_prefilled_in_pieces(llm.engine, prompt, [300])
    for a, b in zip(whole, logits_prefilled_in_pieces(llm.engine, prompt, [128, 172]), strict=True):
        np.testing.assert_array_equal(a, b)
    script = textwrap.dedent(
        """
        import os, sys, numpy as np
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # this folder, tests/
        from test_batch_invariance import logits_alone_and_in_a_batch
        from pagedkv.models import load
        llm = load(weights="gguf", batch_invariant=True)
        alone, _ = logits_alone_and_in_a_batch(llm.engine, llm.config.vocab_size)
        np.save(sys.argv[2], np.stack(alone))
        """
    )
    out = str(tmp_path / "one_core.npy")
    here = os.path.dirname(__file__)
    done = subprocess.run([sys.executable, "-c", script, here, out], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(done.stderr[-2000:])
    np.testing.assert_array_equal(np.load(out), np.stack(alone))
