"""FlashInfer's fast_decode_plan: plan() by another name.

FlashInfer's version skips checks to re-plan a CUDA-graph wrapper quickly in
multi-step drafting; pagedkv's plan() has no slow path to skip, so this is
plan() with fast_decode_plan's argument order.
"""

from __future__ import annotations

from ._ops.tensors import Array
from .decode import BatchDecodeWithPagedKVCacheWrapper


def fast_decode_plan(
    self: BatchDecodeWithPagedKVCacheWrapper,
    indptr: Array,
    indices: Array,
    last_page_len: Array,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pos_encoding_mode: str = "NONE",
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    q_data_type: object = None,
    kv_data_type: object = None,
    data_type: object = None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    non_blocking: bool = True,
    fixed_split_size: int | None = None,
    disable_split_kv: bool = False,
    q_len_per_req: int = 1,
    global_override_indptr_cpu: Array | None = None,
) -> None:
    """`self.plan(...)` (see BatchDecodeWithPagedKVCacheWrapper.plan).

    global_override_indptr_cpu, FlashInfer's host copy of indptr, is not
    read: plan() reads indptr itself. As FlashInfer's, it needs a prior
    plan() on the wrapper (ValueError otherwise).

    Example
    -------
    >>> w.plan = functools.partial(fast_decode_plan, w)   # as FlashInfer's tests do
    >>> w.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16)
    """
    del global_override_indptr_cpu
    if getattr(self, "_planned", None) is None:
        # FlashInfer's fast path re-plans a planned wrapper; so does this one.
        raise ValueError("fast_decode_plan needs a prior plan() call on this wrapper")
    BatchDecodeWithPagedKVCacheWrapper.plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        pos_encoding_mode=pos_encoding_mode,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        q_data_type=q_data_type,
        kv_data_type=kv_data_type,
        data_type=data_type,
        sm_scale=sm_scale,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        non_blocking=non_blocking,
        fixed_split_size=fixed_split_size,
        disable_split_kv=disable_split_kv,
        q_len_per_req=q_len_per_req,
    )
