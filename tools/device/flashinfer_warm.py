"""Builds FlashInfer's JIT modules that benchmarks/decode_gpu.py uses, ahead
of the benchmark (each takes nvcc a minute or more), by running each once on a
tiny batch of the benchmark's dtypes and head dims.

    python tools/device/flashinfer_warm.py decode|decode-tc|mla|append

One part per process, so that parts build side by side (FlashInfer locks
each module's build on its own).
"""

from __future__ import annotations

import math
import sys
import time

import torch


def main(part: str) -> None:
    import flashinfer

    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    one = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    t0 = time.perf_counter()
    if part in ("decode", "decode-tc"):
        for group in (4, 8):
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=part == "decode-tc"
            )
            w.plan(one, one[:1], one[1:], 8 * group, 8, 128, 16, q_data_type=bf16,
                   kv_data_type=bf16)  # fmt: skip
            w.run(torch.randn(1, 8 * group, 128, dtype=bf16, device=dev),
                  torch.randn(1, 2, 16, 8, 128, dtype=bf16, device=dev))  # fmt: skip
    elif part == "mla":
        w = flashinfer.BatchMLAPagedAttentionWrapper(workspace)
        w.plan(one, one, one[:1], torch.tensor([64], dtype=torch.int32, device=dev), 128, 512,
               64, 64, False, 1 / math.sqrt(192), bf16, bf16)  # fmt: skip
        w.run(torch.randn(1, 128, 512, dtype=bf16, device=dev),
              torch.randn(1, 128, 64, dtype=bf16, device=dev),
              torch.randn(1, 64, 512, dtype=bf16, device=dev),
              torch.randn(1, 64, 64, dtype=bf16, device=dev))  # fmt: skip
    elif part == "append":
        pool = torch.zeros(1, 2, 16, 8, 128, dtype=bf16, device=dev)
        k = torch.randn(1, 8, 128, dtype=bf16, device=dev)
        flashinfer.append_paged_kv_cache(k, k, one[:1], one[:1], pool, one[:1], one, one[1:])
    else:
        raise SystemExit(f"unknown part {part!r}")
    torch.cuda.synchronize()
    print(f"flashinfer {part}: built and ran in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
