"""``flashinfer.pod`` over pagedkv."""

from __future__ import annotations

from ..pod import BatchPODWithPagedKVCacheWrapper, PODWithPagedKVCacheWrapper

__all__ = ["BatchPODWithPagedKVCacheWrapper", "PODWithPagedKVCacheWrapper"]
