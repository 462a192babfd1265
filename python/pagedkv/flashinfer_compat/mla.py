"""``flashinfer.mla`` over pagedkv: the paged MLA wrapper (absorbed form), its
plan metadata, the block-table MLA entry points, and FlashInfer's table of
the MLA shapes its GPU kernels were built for (its tests read it)."""

from __future__ import annotations

from dataclasses import dataclass

from ..mla import BatchMLAPagedAttentionWrapper
from ..mla_block_tables import (
    trtllm_batch_decode_with_kv_cache_mla,
    trtllm_prefill_with_kv_cache_mla,
    xqa_batch_decode_with_kv_cache_mla,
)
from ..mla_inputs import MLAPlanMetadata


@dataclass(frozen=True)
class MLAHeadDimensions:
    """One MLA head's widths, as FlashInfer names them."""

    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int


@dataclass(frozen=True)
class MLALayerDimensions:
    """An MLA layer: its heads' widths and their count."""

    head_dimensions: MLAHeadDimensions
    num_heads: int


deepseek_mla_dimensions = MLAHeadDimensions(128, 64, 128, 512)
smaller_mla_dimensions = MLAHeadDimensions(64, 64, 128, 256)
nope_mla_dimensions = MLAHeadDimensions(256, 0, 256, 512)
supported_mla_head_dimensions = [
    deepseek_mla_dimensions,
    smaller_mla_dimensions,
    nope_mla_dimensions,
]
supported_mla_layer_dimensions = [
    MLALayerDimensions(deepseek_mla_dimensions, 128),
    MLALayerDimensions(deepseek_mla_dimensions, 64),
    MLALayerDimensions(smaller_mla_dimensions, 32),
]

__all__ = [
    "BatchMLAPagedAttentionWrapper",
    "MLAHeadDimensions",
    "MLALayerDimensions",
    "MLAPlanMetadata",
    "deepseek_mla_dimensions",
    "nope_mla_dimensions",
    "smaller_mla_dimensions",
    "supported_mla_head_dimensions",
    "supported_mla_layer_dimensions",
    "trtllm_batch_decode_with_kv_cache_mla",
    "trtllm_prefill_with_kv_cache_mla",
    "xqa_batch_decode_with_kv_cache_mla",
]
