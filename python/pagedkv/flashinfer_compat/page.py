"""``flashinfer.page`` over pagedkv."""

from __future__ import annotations

from ..nvfp4 import (
    nvfp4_quantize_append_paged_kv_cache,
    nvfp4_quantize_append_paged_kv_cache_with_slot_mapping,
)
from ..page import (
    append_paged_kv_cache,
    append_paged_mla_kv_cache,
    get_batch_indices_positions,
    get_seq_lens,
)
from .jit import module_generator

gen_page_module = module_generator("gen_page_module")

__all__ = [
    "append_paged_kv_cache",
    "append_paged_mla_kv_cache",
    "gen_page_module",
    "get_batch_indices_positions",
    "get_seq_lens",
    "nvfp4_quantize_append_paged_kv_cache",
    "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping",
]
