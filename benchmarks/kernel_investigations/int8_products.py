"""The attention of many query rows over an int8 pool beside the same over a
float16 pool, in one run: the tasks of matrix products (prefill, and decode
of requests sharing a prefix), where a VNNI host multiplies the int8 pool's
codes as integers (mojo_ops/attention/cpu/code_products.mojo) and a
float16 pool's values are widened to float32 for FMAs (as an int8 pool's
codes are on other hosts).

    python benchmarks/kernel_investigations/int8_products.py [--keys 928] [--calls 200]

SmolLM2's shapes: 8 requests of 21 queries each, 9 query and 3 KV heads of
64, pages of 16, all keys visible (the shape of a shared-prefix decode
item's rows). Prints the CPU and the kernels' ISA, the best and the 10th
percentile of `run()` over the calls, GOP/s of the two products, and each
pool's best time as a multiple of float16's. What it showed (docs/design.md,
"Kernel notes"): 1.86-1.97 ms for the codes against 2.63-2.77 for widened
values, on a 2-core AVX-512 host with VNNI.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import pagedkv
from pagedkv._ops.cpu_target import kernel_isa_line

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.serve_bench import cpu_model  # noqa: E402

B, QUERIES, HQ, HKV, D, P = 8, 21, 9, 3, 64, 16


def filled_pool(dtype: torch.dtype, pages: int) -> torch.Tensor:
    """A pool of random rows: float16 values, or int8 codes with a scale
    of 0.01 after each page half's codes (docs/flashinfer.md, "int8 KV
    caches")."""
    if dtype != torch.int8:
        return torch.randn(pages, 2, P, HKV, D).to(dtype)
    pool = torch.randint(-127, 128, (pages, 2, P, HKV, D + 4), dtype=torch.int8)
    scales = torch.full((pages, 2, P * HKV), 0.01).view(torch.int8)
    pool.view(pages, 2, -1)[:, :, P * HKV * D :] = scales
    return pool


def time_run(dtype: torch.dtype, keys: int, calls: int) -> tuple[float, float]:
    """Best and 10th-percentile seconds of one planned prefill `run()`."""
    pages = keys // P
    indptr = torch.arange(B + 1, dtype=torch.int32) * pages
    indices = torch.arange(B * pages, dtype=torch.int32)
    last = torch.full((B,), P, dtype=torch.int32)
    qo_indptr = torch.arange(B + 1, dtype=torch.int32) * QUERIES
    q = torch.randn(B * QUERIES, HQ, D)
    pool = filled_pool(dtype, B * pages)
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 26, dtype=torch.uint8))
    w.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, P, causal=False, kv_data_type=dtype)
    w.run(q, pool)  # compiles
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        w.run(q, pool)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[0], times[len(times) // 10]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=928, help="keys a request (whole pages)")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    keys = args.keys // P * P
    ops = 2 * 2 * B * QUERIES * HQ * keys * D  # two products, a multiply and an add
    print(f"CPU: {cpu_model()}")
    print(kernel_isa_line())
    print(f"{B} x {QUERIES} queries, {HQ}/{HKV} heads of {D}, {keys} keys, best of {args.calls}")
    times = {dtype: time_run(dtype, keys, args.calls) for dtype in (torch.int8, torch.float16)}
    print("| pool | best ms | p10 ms | GOP/s (best) | best / float16's |")
    print("|---|---|---|---|---|")
    for dtype, (best, p10) in times.items():
        ratio = best / times[torch.float16][0]
        print(
            f"| {dtype} | {best * 1e3:.2f} | {p10 * 1e3:.2f} | {ops / best / 1e9:.0f} "
            f"| {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
