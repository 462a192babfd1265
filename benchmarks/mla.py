"""MLA decode (absorbed, DeepSeek's 512 + 64 latent) on the CPU beside torch
SDPA on the gathered latents: ms, GFLOP/s, GB/s, share of the read bandwidth.

    python benchmarks/mla.py [--shapes 0,1,2,3] [--dtypes bfloat16,float32]

At 128 heads a CPU spends about 280 kFLOP per cached token per request
against 1152 bytes read (bfloat16): compute-bound, so GFLOP/s is the figure
to watch; the issue's 70% of read bandwidth at batch 32 x 4k is a GPU goal.
"""

from __future__ import annotations

from harness.mla_bench import SHAPES, format_mla_table, run_mla_bench
from harness.script import bench_arguments
from harness.serve_bench import cpu_model


def main() -> None:
    args = bench_arguments(__doc__, reps=7, default_dtypes="bfloat16", shapes=SHAPES)
    print(f"CPU: {cpu_model()}", flush=True)
    bandwidth, rows = run_mla_bench(args.shapes, args.dtypes, args.reps)
    print()
    print(format_mla_table(cpu_model(), bandwidth, rows))


if __name__ == "__main__":
    main()
