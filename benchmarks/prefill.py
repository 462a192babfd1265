"""Prefill attention on the CPU beside torch SDPA on pre-gathered K/V, in one
run: ms, GFLOP/s and the ratio of their times, for prompts prefilled in one
step (causal; 32 query and 8 KV heads of dim 128, pages of 16 tokens).

    python benchmarks/prefill.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

from harness.prefill_bench import format_prefill_table, run_prefill_bench
from harness.script import dtype_table_main

if __name__ == "__main__":
    dtype_table_main(__doc__, run_prefill_bench, format_prefill_table, reps=8)
