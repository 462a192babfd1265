"""``flashinfer.fp4_quantization``: the NVFP4 KV-cache helpers (pagedkv.nvfp4),
trtllm-gen's NVFP4 cache (`nvfp4_quantize_paged_kv_cache`) included.

FlashInfer's other FP4 names (GEMM and MoE quantizers) are not provided.
"""

from __future__ import annotations

from enum import Enum

from ..nvfp4 import (
    e2m1_and_ufp8sf_scale_to_float,
    nvfp4_kv_dequantize,
    nvfp4_kv_dequantize_paged,
    nvfp4_kv_quantize,
    nvfp4_quantize_paged_kv_cache,
)
from ._missing import missing_function


class SfLayout(Enum):
    """FlashInfer's NVFP4 scale-factor layouts (pagedkv reads the linear one)."""

    layout_128x4 = 0
    layout_8x4 = 1
    layout_linear = 2


nvfp4_quantize = missing_function(
    "fp4_quantization.nvfp4_quantize", "FlashInfer's NVFP4 GEMM quantizer (swizzled scales)"
)

__all__ = [
    "SfLayout",
    "e2m1_and_ufp8sf_scale_to_float",
    "nvfp4_kv_dequantize",
    "nvfp4_kv_dequantize_paged",
    "nvfp4_kv_quantize",
    "nvfp4_quantize",
    "nvfp4_quantize_paged_kv_cache",
]
