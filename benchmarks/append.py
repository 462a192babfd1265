"""Append throughput on the CPU beside NumPy's fancy-index assignment and
torch's index_put of the same data, in one run: ms, GB/s moved, ratios.

    python benchmarks/append.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse

from pagedkv.bench.append_bench import format_append_table, run_append_bench
from pagedkv.bench.threads import pin_max_workers


def main() -> None:
    pin_max_workers()  # MAX's CPU workers one per core (pagedkv/bench/threads.py)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    rows = run_append_bench(dtypes=args.dtypes.split(","), reps=args.reps)
    print()
    print(format_append_table(rows))


if __name__ == "__main__":
    main()
