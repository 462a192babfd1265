"""Append throughput on the CPU beside NumPy's fancy-index assignment and
torch's index_put of the same data, in one run: ms, GB/s moved, ratios.

    python benchmarks/append.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

from harness.append_bench import format_append_table, run_append_bench
from harness.script import dtype_table_main

if __name__ == "__main__":
    dtype_table_main(__doc__, run_append_bench, format_append_table)
