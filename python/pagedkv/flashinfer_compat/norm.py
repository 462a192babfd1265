"""FlashInfer's ``flashinfer.norm``, served by `pagedkv.norm`."""

from pagedkv.norm import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_quant,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    layernorm,
    layernorm_quant,
    rmsnorm,
    rmsnorm_quant,
)

__all__ = [
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_quant",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "layernorm",
    "layernorm_quant",
    "rmsnorm",
    "rmsnorm_quant",
]
