"""pagedkv: a paged KV cache for LLM inference, Mojo kernels behind FlashInfer's API.

Kernels live in the Mojo package ``mojo_ops`` and run as MAX custom ops; this
package validates arguments and dispatches to them, on NumPy arrays or torch
tensors, writing caches in place.
"""

from .decode import BatchDecodeWithPagedKVCacheWrapper
from .page import (
    append_paged_kv_cache,
    append_paged_mla_kv_cache,
    gather_kv,
    get_batch_indices_positions,
    get_seq_lens,
)

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "append_paged_kv_cache",
    "append_paged_mla_kv_cache",
    "gather_kv",
    "get_batch_indices_positions",
    "get_seq_lens",
]

__version__ = "0.1.0"
