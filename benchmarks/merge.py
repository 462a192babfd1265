"""Merging attention states on the CPU (merge_states, merge_state_in_place)
beside the same merge in torch and a plain read of the same bytes, in one
run: ms, GB/s, ratio to torch, share of the read's speed.

    python benchmarks/merge.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

from harness.merge_bench import format_merge_table, run_merge_bench
from harness.script import dtype_table_main

if __name__ == "__main__":
    dtype_table_main(__doc__, run_merge_bench, format_merge_table)
