"""``flashinfer.fp4_quantization``: NVFP4 is not supported by pagedkv."""

from __future__ import annotations

from ._missing import missing_function
from .page import NVFP4

e2m1_and_ufp8sf_scale_to_float = missing_function(
    "fp4_quantization.e2m1_and_ufp8sf_scale_to_float", NVFP4
)
