"""MLA decode (absorbed, DeepSeek's 512 + 64 latent) on the CPU beside torch
SDPA on the gathered latents: ms, GFLOP/s, GB/s, share of the read bandwidth.

    python benchmarks/mla.py [--shapes 0,1,2,3] [--dtypes bfloat16,float32]

At 128 heads a CPU spends about 280 kFLOP per cached token per request
against 1152 bytes read (bfloat16): compute-bound, so GFLOP/s is the figure
to watch; the issue's 70% of read bandwidth at batch 32 x 4k is a GPU goal.
"""

from __future__ import annotations

import argparse

from harness.mla_bench import SHAPES, format_mla_table, run_mla_bench
from harness.serve_bench import cpu_model
from harness.threads import pin_max_workers


def main() -> None:
    pin_max_workers()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default=",".join(str(i) for i in range(len(SHAPES))))
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    print(f"CPU: {cpu_model()}", flush=True)
    bandwidth, rows = run_mla_bench(shapes, args.dtypes.split(","), args.reps)
    print()
    print(format_mla_table(cpu_model(), bandwidth, rows))


if __name__ == "__main__":
    main()
