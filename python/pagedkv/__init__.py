"""pagedkv: a paged KV cache for LLM inference, Mojo kernels behind FlashInfer's API.

Kernels live in the Mojo package ``mojo_ops`` and run as MAX custom ops; this
package validates arguments and dispatches to them, on NumPy arrays or torch
tensors, writing caches in place.
"""

from .attention import BatchAttention, BatchAttentionWithAttentionSinkWrapper
from .block_tables import (
    csr_from_block_tables,
    trtllm_batch_context_with_kv_cache,
    trtllm_batch_decode_with_kv_cache,
    xqa_batch_decode_with_kv_cache,
)
from .cache.manager import BatchMetadata, CacheStateError, OutOfPagesError, PagedKVCacheManager
from .cascade import merge_state, merge_state_in_place, merge_states
from .cascade_attention import (
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper,
    BatchPrefillWithSharedPrefixPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)
from .decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    single_decode_with_kv_cache,
)
from .functional import (
    allocate_blocks,
    append_kv,
    init_paged_kv_cache,
    release_blocks,
)
from .mla import BatchMLAPagedAttentionWrapper
from .mla_block_tables import (
    trtllm_batch_decode_with_kv_cache_mla,
    trtllm_prefill_with_kv_cache_mla,
    xqa_batch_decode_with_kv_cache_mla,
)
from .mla_inputs import MLAPlanMetadata
from .nvfp4 import (
    nvfp4_kv_dequantize,
    nvfp4_kv_dequantize_paged,
    nvfp4_kv_quantize,
    nvfp4_quantize_append_paged_kv_cache,
    nvfp4_quantize_append_paged_kv_cache_with_slot_mapping,
    nvfp4_quantize_paged_kv_cache,
)
from .page import (
    append_paged_kv_cache,
    append_paged_mla_kv_cache,
    copy_pages,
    gather_kv,
    get_batch_indices_positions,
    get_seq_lens,
)
from .pod import BatchPODWithPagedKVCacheWrapper, PODWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithPagedKVCacheWrapper, single_prefill_with_kv_cache
from .prefill_ragged import BatchPrefillWithRaggedKVCacheWrapper, trtllm_ragged_attention_deepseek

__all__ = [
    "BatchAttention",
    "BatchAttentionWithAttentionSinkWrapper",
    "BatchDecodeWithPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
    "BatchMLAPagedAttentionWrapper",
    "BatchMetadata",
    "BatchPODWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    "CacheStateError",
    "MLAPlanMetadata",
    "MultiLevelCascadeAttentionWrapper",
    "OutOfPagesError",
    "PODWithPagedKVCacheWrapper",
    "PagedKVCacheManager",
    "allocate_blocks",
    "append_kv",
    "append_paged_kv_cache",
    "append_paged_mla_kv_cache",
    "copy_pages",
    "csr_from_block_tables",
    "gather_kv",
    "get_batch_indices_positions",
    "get_seq_lens",
    "init_paged_kv_cache",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "nvfp4_kv_dequantize",
    "nvfp4_kv_dequantize_paged",
    "nvfp4_kv_quantize",
    "nvfp4_quantize_append_paged_kv_cache",
    "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping",
    "nvfp4_quantize_paged_kv_cache",
    "release_blocks",
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
    "trtllm_batch_context_with_kv_cache",
    "trtllm_batch_decode_with_kv_cache",
    "trtllm_batch_decode_with_kv_cache_mla",
    "trtllm_prefill_with_kv_cache_mla",
    "trtllm_ragged_attention_deepseek",
    "xqa_batch_decode_with_kv_cache",
    "xqa_batch_decode_with_kv_cache_mla",
]

__version__ = "0.1.0"

_MOVED_TO_RUNTIME = ("demote_max_poller", "huge_page_zeros")
"""Names that moved to `pagedkv.runtime`; the top-level names still work,
with a DeprecationWarning."""


def __getattr__(name: str) -> object:
    if name in _MOVED_TO_RUNTIME:
        import warnings

        from . import runtime

        warnings.warn(
            f"pagedkv.{name} is deprecated: use pagedkv.runtime.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
