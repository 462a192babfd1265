"""Merging attention states on the CPU (merge_states, merge_state_in_place)
beside the same merge in torch and a plain read of the same bytes, in one
run: ms, GB/s, ratio to torch, share of the read's speed.

    python benchmarks/merge.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse

from pagedkv.bench.merge_bench import format_merge_table, run_merge_bench
from pagedkv.bench.threads import pin_max_workers


def main() -> None:
    pin_max_workers()  # MAX's CPU workers one per core (pagedkv/bench/threads.py)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    rows = run_merge_bench(dtypes=args.dtypes.split(","), reps=args.reps)
    print()
    print(format_merge_table(rows))


if __name__ == "__main__":
    main()
