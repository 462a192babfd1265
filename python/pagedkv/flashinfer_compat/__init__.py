"""FlashInfer's module layout over pagedkv: ``import flashinfer`` served by pagedkv.

>>> import pagedkv.flashinfer_compat as compat
>>> compat.install()               # from now on `import flashinfer` is this package
>>> import flashinfer
>>> flashinfer.BatchDecodeWithPagedKVCacheWrapper is pagedkv.BatchDecodeWithPagedKVCacheWrapper
True

The top-level names and the submodules FlashInfer's users and tests import
(`attention`, `decode`, `prefill`, `pod`, `page`, `mla`, `cascade`,
`sampling`, `norm`, `rope`, `utils`, `jit`, `quantization`,
`fp4_quantization`)
map to pagedkv's implementations. Names that exist only
to drive FlashInfer's CUDA JIT (`jit.*`, `gen_*_module`) are no-ops; names
pagedkv does not implement raise NotImplementedError when called, so that
code importing them still loads (see docs/flashinfer.md).
"""

# ruff: noqa: F401
# Every import below is a re-export, listed in __all__ (built at the end).

from types import ModuleType as _ModuleType

from ._install import install
from ._missing import missing_class as _missing_class

# A submodule imported with `*` has every one of its names at the top level too.
from .attention import *  # noqa: F403
from .cascade import *  # noqa: F403
from .decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    fast_decode_plan,
    single_decode_with_kv_cache,
    trtllm_batch_decode_with_kv_cache,
    xqa_batch_decode_with_kv_cache,
)
from .fp4_quantization import (
    SfLayout,
    e2m1_and_ufp8sf_scale_to_float,
    nvfp4_kv_dequantize,
    nvfp4_kv_dequantize_paged,
    nvfp4_kv_quantize,
)
from .mla import BatchMLAPagedAttentionWrapper
from .norm import (
    fused_add_rmsnorm,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    layernorm,
    rmsnorm,
)
from .page import (
    append_paged_kv_cache,
    append_paged_mla_kv_cache,
    get_batch_indices_positions,
    get_seq_lens,
    nvfp4_quantize_append_paged_kv_cache,
    nvfp4_quantize_append_paged_kv_cache_with_slot_mapping,
)
from .pod import *  # noqa: F403
from .prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
    trtllm_batch_context_with_kv_cache,
)
from .quantization import packbits, segment_packbits
from .rope import (
    apply_llama31_rope,
    apply_llama31_rope_inplace,
    apply_llama31_rope_pos_ids,
    apply_llama31_rope_pos_ids_inplace,
    apply_rope,
    apply_rope_inplace,
    apply_rope_pos_ids,
    apply_rope_pos_ids_inplace,
    apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
)
from .sampling import *  # noqa: F403

BatchDecodeMlaWithPagedKVCacheWrapper = _missing_class(
    "BatchDecodeMlaWithPagedKVCacheWrapper",
    "FlashInfer's older MLA decode wrapper; use BatchMLAPagedAttentionWrapper",
)

__all__ = sorted(
    name
    for name, value in globals().items()
    if not name.startswith("_") and not isinstance(value, _ModuleType)
)
"""Every public name above but the submodules themselves: what FlashInfer's
own top level re-exports, the stand-in and `install`."""
