"""Decode attention on the CPU beside MAX's built-in paged attention and torch
SDPA, in one run: ms, GB/s, share of the measured read bandwidth, ratios.

    python benchmarks/decode.py [--shapes 0,1,2,3] [--dtypes float32,bfloat16]

MAX's worker threads are pinned one per core (MODULAR_ENABLE_AFFINITY=1, see
benchmarks/harness/threads.py); MODULAR_ENABLE_AFFINITY=0 measures them unpinned.
"""

from __future__ import annotations

from harness.decode_bench import CPU_SHAPES, format_table, run_cpu_decode_bench
from harness.script import bench_arguments


def main() -> None:
    args = bench_arguments(__doc__, reps=15, default_dtypes="float32,bfloat16", shapes=CPU_SHAPES)
    machine, rows = run_cpu_decode_bench(args.shapes, args.dtypes, args.reps)
    print()
    print(format_table(machine, rows))


if __name__ == "__main__":
    main()
