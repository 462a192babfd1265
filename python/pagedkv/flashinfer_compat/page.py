"""``flashinfer.page`` over pagedkv."""

from __future__ import annotations

from typing import Any

from ..page import (
    append_paged_kv_cache,
    append_paged_mla_kv_cache,
    get_batch_indices_positions,
    get_seq_lens,
)
from ._missing import missing_function
from .jit import JitSpec

NVFP4 = "NVFP4 (e2m1 + e4m3 block-scale) KV caches are not supported"
nvfp4_quantize_append_paged_kv_cache = missing_function(
    "nvfp4_quantize_append_paged_kv_cache", NVFP4
)
nvfp4_quantize_append_paged_kv_cache_with_slot_mapping = missing_function(
    "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping", NVFP4
)


def gen_page_module(*args: Any, **kwargs: Any) -> JitSpec:
    return JitSpec()


__all__ = [
    "append_paged_kv_cache",
    "append_paged_mla_kv_cache",
    "gen_page_module",
    "get_batch_indices_positions",
    "get_seq_lens",
    "nvfp4_quantize_append_paged_kv_cache",
    "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping",
]
