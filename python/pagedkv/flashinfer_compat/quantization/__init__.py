"""``flashinfer.quantization``: the bit packing of custom masks and the NVFP4
KV-cache helpers."""

from __future__ import annotations

from ...custom_mask import packbits, segment_packbits
from ..fp4_quantization import (
    e2m1_and_ufp8sf_scale_to_float,
    nvfp4_kv_dequantize,
    nvfp4_kv_dequantize_paged,
    nvfp4_kv_quantize,
)
from ..jit import module_generator

__all__ = [
    "e2m1_and_ufp8sf_scale_to_float",
    "gen_quantization_module",
    "nvfp4_kv_dequantize",
    "nvfp4_kv_dequantize_paged",
    "nvfp4_kv_quantize",
    "packbits",
    "segment_packbits",
]

gen_quantization_module = module_generator("gen_quantization_module")
