"""``flashinfer.prefill`` over pagedkv."""

from __future__ import annotations

from ..block_tables import trtllm_batch_context_with_kv_cache
from ..mla_block_tables import trtllm_prefill_with_kv_cache_mla
from ..prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from ..prefill_ragged import BatchPrefillWithRaggedKVCacheWrapper, trtllm_ragged_attention_deepseek
from .jit.attention import gen_batch_prefill_module, gen_single_prefill_module

__all__ = [
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "gen_batch_prefill_module",
    "gen_single_prefill_module",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "trtllm_batch_context_with_kv_cache",
    "trtllm_prefill_with_kv_cache_mla",
    "trtllm_ragged_attention_deepseek",
]
