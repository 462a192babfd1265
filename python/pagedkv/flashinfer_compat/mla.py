"""``flashinfer.mla`` over pagedkv: the paged MLA wrapper (absorbed form)."""

from __future__ import annotations

from ..mla import BatchMLAPagedAttentionWrapper

__all__ = ["BatchMLAPagedAttentionWrapper"]
