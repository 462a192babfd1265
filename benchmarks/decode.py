"""Decode attention on the CPU beside MAX's built-in paged attention and torch
SDPA, in one run: ms, GB/s, share of the measured read bandwidth, ratios.

    python benchmarks/decode.py [--shapes 0,1,2,3] [--dtypes float32,bfloat16]

MAX's worker threads are pinned one per core (MODULAR_ENABLE_AFFINITY=1, see
benchmarks/harness/threads.py); MODULAR_ENABLE_AFFINITY=0 measures them unpinned.
"""

from __future__ import annotations

import argparse

from harness.decode_bench import CPU_SHAPES, format_table, run_cpu_decode_bench
from harness.threads import pin_max_workers


def main() -> None:
    pin_max_workers()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default=",".join(str(i) for i in range(len(CPU_SHAPES))))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    shapes = [CPU_SHAPES[int(i)] for i in args.shapes.split(",")]
    machine, rows = run_cpu_decode_bench(shapes, args.dtypes.split(","), args.reps)
    print()
    print(format_table(machine, rows))


if __name__ == "__main__":
    main()
