"""``flashinfer.fp4_quantization``: the NVFP4 KV-cache helpers (pagedkv.nvfp4).

FlashInfer's other FP4 names (GEMM and MoE quantizers, swizzled scale
layouts) are not provided.
"""

from __future__ import annotations

from ..nvfp4 import (
    e2m1_and_ufp8sf_scale_to_float,
    nvfp4_kv_dequantize,
    nvfp4_kv_dequantize_paged,
    nvfp4_kv_quantize,
)

__all__ = [
    "e2m1_and_ufp8sf_scale_to_float",
    "nvfp4_kv_dequantize",
    "nvfp4_kv_dequantize_paged",
    "nvfp4_kv_quantize",
]
