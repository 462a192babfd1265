"""``flashinfer.attention`` over pagedkv."""

from __future__ import annotations

from ..attention import BatchAttention, BatchAttentionWithAttentionSinkWrapper

__all__ = ["BatchAttention", "BatchAttentionWithAttentionSinkWrapper"]
