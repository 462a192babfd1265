"""``flashinfer.quantization``: the bit packing of custom masks; NVFP4 is not
supported by pagedkv."""

from __future__ import annotations

from typing import Any

from ...custom_mask import packbits, segment_packbits
from ..jit import JitSpec

__all__ = ["gen_quantization_module", "packbits", "segment_packbits"]


def gen_quantization_module(*args: Any, **kwargs: Any) -> JitSpec:
    return JitSpec()
