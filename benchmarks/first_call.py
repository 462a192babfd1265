"""How long the first eager call of each public op takes in a fresh process.

Each op runs in its own new Python process twice: the first run fills the
caches (a cold compile if they are empty), the second is the one reported:
`import` is `import pagedkv` (with NumPy), `call` is the op's first call in
that process (a warm compile cache: it loads the compiled op from disk).

    python benchmarks/first_call.py
"""

from __future__ import annotations

import json
import subprocess
import sys

from harness.serve_bench import cpu_model

SETUP = """
import numpy as np
rng = np.random.default_rng(0)
f32 = np.float32
pool = np.zeros((8, 2, 16, 2, 64), f32)
kv_indptr = np.array([0, 2, 3], np.int32)
kv_indices = np.array([5, 1, 7], np.int32)
last = np.array([4, 9], np.int32)
q = rng.standard_normal((2, 8, 64), dtype=f32)
k, v = rng.standard_normal((2, 29, 2, 64), dtype=f32)
append_indptr = np.array([0, 20, 29], np.int32)
s = rng.standard_normal((2, 8), dtype=f32)
"""

OPS = {
    "append_paged_kv_cache": "pagedkv.append_paged_kv_cache(k, v, append_indptr, pool, "
    "kv_indices, kv_indptr, last)",
    "get_seq_lens": "pagedkv.get_seq_lens(kv_indptr, last, 16)",
    "get_batch_indices_positions": "pagedkv.get_batch_indices_positions(append_indptr, "
    "pagedkv.get_seq_lens(kv_indptr, last, 16), 29)",
    "BatchDecodeWithPagedKVCacheWrapper": "w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(); "
    "w.plan(kv_indptr, kv_indices, last, 8, 2, 64, 16); w.run(q, pool)",
    "BatchPrefillWithPagedKVCacheWrapper": "w = pagedkv.BatchPrefillWithPagedKVCacheWrapper(); "
    "w.plan(np.array([0, 1, 2], np.int32), kv_indptr, kv_indices, last, 8, 2, 64, 16); "
    "w.run(q, pool)",
    "single_decode_with_kv_cache": "pagedkv.single_decode_with_kv_cache(q[0], k, v)",
    "single_prefill_with_kv_cache": "pagedkv.single_prefill_with_kv_cache("
    "rng.standard_normal((29, 8, 64), dtype=f32), k, v, causal=True)",
    "merge_state": "pagedkv.merge_state(q, s, q, s)",
    "merge_states": "pagedkv.merge_states(q[:, None].repeat(3, 1), s[:, None].repeat(3, 1))",
    "copy_pages": "pagedkv.copy_pages(pool, np.array([5], np.int32), np.array([0], np.int32))",
    "gather_kv": "pagedkv.gather_kv(pool, kv_indices, kv_indptr, last)",
}

SNIPPET = """
import time, json
t0 = time.perf_counter()
import pagedkv
t1 = time.perf_counter()
{setup}
t2 = time.perf_counter()
{call}
t3 = time.perf_counter()
print(json.dumps({{"import": t1 - t0, "call": t3 - t2}}))
"""


def time_first_call(call: str) -> dict[str, float]:
    code = SNIPPET.format(setup=SETUP, call=call)
    for _ in range(2):  # the first run fills the caches
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    print(f"CPU: {cpu_model()}; warm caches, fresh processes")
    print(f"{'op':40} {'import s':>9} {'first call s':>13}")
    for name, call in OPS.items():
        t = time_first_call(call)
        print(f"{name:40} {t['import']:9.2f} {t['call']:13.2f}", flush=True)


if __name__ == "__main__":
    main()
