"""``flashinfer.decode`` over pagedkv."""

from __future__ import annotations

from ..block_tables import trtllm_batch_decode_with_kv_cache, xqa_batch_decode_with_kv_cache
from ..decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    single_decode_with_kv_cache,
)
from ..fast_decode_plan import fast_decode_plan
from ..mla_block_tables import (
    trtllm_batch_decode_with_kv_cache_mla,
    xqa_batch_decode_with_kv_cache_mla,
)
from .jit.attention import gen_batch_decode_module, gen_single_decode_module

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "fast_decode_plan",
    "gen_batch_decode_module",
    "gen_single_decode_module",
    "single_decode_with_kv_cache",
    "trtllm_batch_decode_with_kv_cache",
    "trtllm_batch_decode_with_kv_cache_mla",
    "xqa_batch_decode_with_kv_cache",
    "xqa_batch_decode_with_kv_cache_mla",
]
