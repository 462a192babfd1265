"""The page manager's per-step cost beside the decode attention it feeds.

One decode step of a batch of B requests of about L tokens: reserve one token
for each (allocating a page where one fills up) and build the batch metadata,
timed against BatchDecodeWithPagedKVCacheWrapper.plan and .run on the same
batch, in one run on one machine. The manager's step must stay under 10% of
the attention's run time (one layer: a model pays the metadata once per step
and the attention once per layer, so this is the strict case).

--window W times the same step on a manager of two layer groups, a full one
and one with a sliding window of W tokens, which gives pages back as the
requests grow (each step also builds the window group's metadata).

--memory W measures, instead, the pages a 1:5 mix of full and window-W
layers holds (one full layer, five windowed ones) for requests of
--memory-tokens tokens, prefilled in --chunk-token chunks, against the same
six layers without groups.

    python benchmarks/manager.py [--requests 256] [--tokens 2000] [--steps 60]
    python benchmarks/manager.py --window 1024
    python benchmarks/manager.py --memory 1024 [--memory-tokens 8192]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from pagedkv import BatchDecodeWithPagedKVCacheWrapper
from pagedkv.cache.manager import PagedKVCacheManager

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
    parser.add_argument("--window", type=int, help="time a full + window-W group manager")
    parser.add_argument("--memory", type=int, help="pages held by a 1:5 full/window-W mix")
    parser.add_argument("--memory-tokens", type=int, default=8192)
    parser.add_argument("--memory-requests", type=int, default=8)
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    args = parser.parse_args()
    if args.memory:
        return memory(args)

    rng = np.random.default_rng(0)
    batch, size = args.requests, args.page_size
    steps = 2 * args.steps + 2  # two timed variants and a warm-up step each
    # Start short by the steps to come: the decode batch is `tokens` long on average.
    lens = rng.integers(args.tokens - 50, args.tokens + 50, batch) - steps
    pages_each = -(-(lens + steps) // size)
    groups = None if args.window is None else [([0], None), ([1], args.window)]
    manager = PagedKVCacheManager(
        int(pages_each.sum()) + batch,
        size,
        args.kv_heads,
        args.head_dim,
        num_layers=1 if groups is None else 2,
        dtype="bfloat16",
        kv_layout="NHD",
        layer_groups=groups,
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
    if groups is not None:
        print(f"layer groups: one full-attention layer, one with a window of {args.window}")
    group = None if groups is None else 0

    def step(tokens: np.ndarray | None) -> Callable[[], object]:
        def run() -> object:
            manager.reserve(ids, 1, tokens)
            if groups is not None:
                manager.metadata(ids, group=1)
            return manager.metadata(ids, group=group)

        return run

    next_tokens = rng.integers(0, 32000, batch)
    # With token ids (pages that fill are hashed for the prefix cache) while
    # the requests' hash chains are intact, then without.
    rows = []
    for label, tokens in (("with token ids", next_tokens), ("without token ids", None)):
        timed(step(tokens), 1)
        steps_s = timed(step(tokens), args.steps)
        meta_s = timed(lambda: manager.metadata(ids, group=group), args.steps)
        rows.append((label, steps_s, meta_s))
    if groups is not None:
        held = [pool.num_used for pool in manager.page_pools]
        print(f"pages held after the steps: full group {held[0]}, window group {held[1]}")

    return decode_and_report(args, manager, ids, group, rows)


def decode_and_report(args, manager: PagedKVCacheManager, ids: list, group, rows: list) -> int:
    """Times a decode step's plan and run over the manager's batch and
    prints each manager cost as a share of the run; 1 if over BUDGET."""
    import torch

    batch, size, pool = len(ids), args.page_size, manager.pools[0]
    meta = manager.metadata(ids, group=group)
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


def memory(args: argparse.Namespace) -> int:
    """Pages held by a 1:5 mix of full and window layers against six full
    layers, for requests prefilled in chunks, then decoding."""
    size, window, tokens = args.page_size, args.memory, args.memory_tokens
    batch, chunk = args.memory_requests, args.chunk_tokens
    layers = 6
    pages = batch * -(-(tokens + 64) // size)
    groups = [([0], None), (list(range(1, layers)), window)]

    def run(layer_groups: list | None) -> tuple[list[int], list[int]]:
        # Tiny pools: only the page counts matter here.
        manager = PagedKVCacheManager(
            pages, size, 1, 8, num_layers=layers, layer_groups=layer_groups
        )
        ids = list(range(batch))
        for rid in ids:
            manager.add(rid)
        peak = [0] * len(manager.page_pools)
        for start in range(0, tokens, chunk):
            manager.reserve(ids, min(chunk, tokens - start))
            peak = [max(p, pool.num_used) for p, pool in zip(peak, manager.page_pools, strict=True)]
        for _ in range(64):
            manager.reserve(ids, 1)
            peak = [max(p, pool.num_used) for p, pool in zip(peak, manager.page_pools, strict=True)]
        manager.validate()
        return [pool.num_used for pool in manager.page_pools], peak

    plain, plain_peak = run(None)
    held, peak = run(groups)
    page_bytes = 2 * size * args.kv_heads * args.head_dim * 2  # bf16 K and V, one layer
    full_layers = layers * plain[0] / batch
    mixed_layers = (held[0] * 1 + held[1] * (layers - 1)) / batch
    peak_layers = (peak[0] * 1 + peak[1] * (layers - 1)) / batch
    print(
        f"{batch} requests of {tokens} + 64 decoded tokens, page {size}, prefill chunks of "
        f"{chunk}; layers: 1 full + {layers - 1} with a window of {window}"
    )
    print(f"pages held per request: full group {held[0] / batch:.0f}, window group "
          f"{held[1] / batch:.0f} (peak {peak[1] / batch:.0f} during a chunk); "
          f"without groups {plain[0] / batch:.0f}")  # fmt: skip
    gib = page_bytes / 2**30
    print(
        f"KV memory per request ({args.kv_heads} KV heads, D {args.head_dim}, bf16): "
        f"{mixed_layers * gib:.3f} GiB with groups (peak {peak_layers * gib:.3f}), "
        f"{full_layers * gib:.3f} GiB without: {1 - mixed_layers / full_layers:.1%} saved "
        f"({1 - peak_layers / full_layers:.1%} at the peak)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
