"""FlashInfer's ``flashinfer.rope``, served by `pagedkv.rope`."""

from pagedkv.rope import (
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
    mla_rope_quantize_fp8,
    rope_quantize_fp8,
    rope_quantize_fp8_append_paged_kv_cache,
)

__all__ = [
    "apply_llama31_rope",
    "apply_llama31_rope_inplace",
    "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace",
    "apply_rope",
    "apply_rope_inplace",
    "apply_rope_pos_ids",
    "apply_rope_pos_ids_inplace",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "mla_rope_quantize_fp8",
    "rope_quantize_fp8",
    "rope_quantize_fp8_append_paged_kv_cache",
]
