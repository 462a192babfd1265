"""The page manager's per-step cost beside the decode attention it feeds.

One decode step of a batch of B requests of about L tokens: reserve one token
for each (allocating a page where one fills up) and build the batch metadata,
timed against BatchDecodeWithPagedKVCacheWrapper.plan and .run on the same
batch, in one run on one machine. The manager's step must stay under 10% of
the attention's run time (one layer: a model pays the metadata once per step
and the attention once per layer, so this is the strict case).

    python benchmarks/manager.py [--requests 256] [--tokens 2000] [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from pagedkv import BatchDecodeWithPagedKVCacheWrapper
from pagedkv.manager import PagedKVCacheManager

BUDGET = 0.10
"""The manager's step may cost at most this share of the attention's run."""


def median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def timed(call: Callable[[], object], reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2000, help="mean tokens per request")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per variant")
    parser.add_argument("--runs", type=int, default=7, help="timed decode runs")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--qo-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    import torch

    rng = np.random.default_rng(0)
    batch, size = args.requests, args.page_size
    steps = 2 * args.steps + 2  # two timed variants and a warm-up step each
    # Start short by the steps to come: the decode batch is `tokens` long on average.
    lens = rng.integers(args.tokens - 50, args.tokens + 50, batch) - steps
    pages_each = -(-(lens + steps) // size)
    manager = PagedKVCacheManager(
        int(pages_each.sum()) + batch,
        size,
        args.kv_heads,
        args.head_dim,
        dtype="bfloat16",
        kv_layout="NHD",
    )
    pool = manager.pools[0]
    gib = pool.numel() * pool.element_size() / 2**30
    ids = list(range(batch))
    t0 = time.perf_counter()
    prompts = [rng.integers(0, 32000, n) for n in lens]
    for rid, prompt in zip(ids, prompts, strict=True):
        manager.add(rid, prompt)
    manager.reserve(ids, lens, prompts)
    prefill_s = time.perf_counter() - t0
    print(
        f"batch {batch} x ~{args.tokens} tokens, page {size}, {args.kv_heads} KV / "
        f"{args.qo_heads} q heads, D {args.head_dim}, bf16 pool {gib:.2f} GiB "
        f"({manager.num_pages} pages); prompts added + reserved in {prefill_s:.2f} s"
    )

    def step(tokens: np.ndarray | None) -> Callable[[], object]:
        def run() -> object:
            manager.reserve(ids, 1, tokens)
            return manager.metadata(ids)

        return run

    next_tokens = rng.integers(0, 32000, batch)
    # With token ids (pages that fill are hashed for the prefix cache) while
    # the requests' hash chains are intact, then without.
    rows = []
    for label, tokens in (("with token ids", next_tokens), ("without token ids", None)):
        timed(step(tokens), 1)
        steps_s = timed(step(tokens), args.steps)
        meta_s = timed(lambda: manager.metadata(ids), args.steps)
        rows.append((label, steps_s, meta_s))

    meta = manager.metadata(ids)
    seq = meta.seq_lens
    wrapper = BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")

    def plan() -> None:
        wrapper.plan(
            meta.kv_indptr,
            meta.kv_indices,
            meta.kv_last_page_len,
            args.qo_heads,
            args.kv_heads,
            args.head_dim,
            size,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
        )

    t0 = time.perf_counter()
    plan()  # compiles the decode op (or loads it from MAX's cache)
    compile_s = time.perf_counter() - t0
    plan_s = timed(plan, 5)
    q = torch.randn(batch, args.qo_heads, args.head_dim).to(torch.bfloat16)
    wrapper.run(q, pool)
    run_s = timed(lambda: wrapper.run(q, pool), args.runs)

    run_ms = median_ms(run_s)
    kv_gb = 2 * int(seq.sum()) * args.kv_heads * args.head_dim * 2 / 1e9
    print(
        f"decode batch: seq_lens {seq.min()}..{seq.max()} (mean {seq.mean():.0f}), "
        f"{meta.kv_indices.size} pages, {kv_gb:.2f} GB of K/V; first plan {compile_s:.2f} s"
    )
    print()
    print(f"{'per decode step (median)':44s} {'ms':>9s} {'of run':>8s}")
    for label, steps_s, meta_s in rows:
        step_ms = median_ms(steps_s)
        print(
            f"{'reserve(1 each) + metadata, ' + label:44s} {step_ms:9.3f} {step_ms / run_ms:8.2%}"
        )
        print(
            f"{'  metadata alone':44s} {median_ms(meta_s):9.3f} {median_ms(meta_s) / run_ms:8.2%}"
        )
    print(f"{'decode plan':44s} {median_ms(plan_s):9.3f} {median_ms(plan_s) / run_ms:8.2%}")
    print(f"{'decode run (1 layer)':44s} {run_ms:9.3f} {1:8.2%}")
    print(f"{'  effective K/V read bandwidth':44s} {kv_gb / (run_ms / 1e3):7.1f} GB/s")
    worst = max(median_ms(steps_s) for _, steps_s, _ in rows) / run_ms
    verdict = "OK" if worst < BUDGET else "OVER BUDGET"
    print()
    print(f"manager step / decode run = {worst:.2%} (budget {BUDGET:.0%}): {verdict}")
    manager.validate()
    return 0 if worst < BUDGET else 1


if __name__ == "__main__":
    sys.exit(main())
