"""``flashinfer.attention`` over pagedkv."""

from __future__ import annotations

from ..attention import BatchAttentionWithAttentionSinkWrapper

__all__ = ["BatchAttentionWithAttentionSinkWrapper"]
