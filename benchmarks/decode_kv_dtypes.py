"""CPU decode with K/V in each cache dtype, in one run: ms, GB/s of its own
K/V bytes, and its time as a multiple of bfloat16 K/V's (q in bfloat16; in
float32 for float32 K/V), at (16, 1024) and (32, 2048) (B, L; 32 query and
8 KV heads of dim 128, pages of 16 tokens).

    python benchmarks/decode_kv_dtypes.py [--dtypes bfloat16,float8_e4m3fn,...]
"""

from __future__ import annotations

from harness.decode_bench import KV_DTYPES, format_kv_dtype_table, run_kv_dtype_bench
from harness.script import dtype_table_main

if __name__ == "__main__":
    dtype_table_main(
        __doc__, run_kv_dtype_bench, format_kv_dtype_table, default_dtypes=",".join(KV_DTYPES)
    )
