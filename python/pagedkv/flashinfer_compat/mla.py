"""``flashinfer.mla`` over pagedkv: the paged MLA wrapper (absorbed form) and
its plan metadata."""

from __future__ import annotations

from ..mla import BatchMLAPagedAttentionWrapper
from ..mla_inputs import MLAPlanMetadata

__all__ = ["BatchMLAPagedAttentionWrapper", "MLAPlanMetadata"]
