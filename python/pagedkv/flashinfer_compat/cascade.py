"""``flashinfer.cascade`` over pagedkv."""

from __future__ import annotations

from ..cascade import merge_state, merge_state_in_place, merge_states
from ._missing import missing_class

CASCADE = "cascade wrappers are not implemented (merge_state composes them)"

MultiLevelCascadeAttentionWrapper = missing_class(
    "MultiLevelCascadeAttentionWrapper",
    CASCADE,
)
BatchDecodeWithSharedPrefixPagedKVCacheWrapper = missing_class(
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
    CASCADE,
)
BatchPrefillWithSharedPrefixPagedKVCacheWrapper = missing_class(
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    CASCADE,
)

__all__ = [
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
]
