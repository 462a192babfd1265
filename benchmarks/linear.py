"""The step graphs' linear layers on the CPU: pagedkv's product over packed
weight panels beside MAX's matmul and torch's, in one run: ms, GFLOP/s, and
pagedkv's speed as a multiple of each (SmolLM2-135M's shapes, M = 1, 32, 256).

    python benchmarks/linear.py [--dtypes float32,bfloat16] [--reps 20]
"""

from __future__ import annotations

from harness.linear_bench import format_linear_table, run_linear_bench
from harness.script import dtype_table_main
from harness.serve_bench import cpu_model

if __name__ == "__main__":
    print(f"CPU: {cpu_model()}")
    dtype_table_main(__doc__, run_linear_bench, format_linear_table)
