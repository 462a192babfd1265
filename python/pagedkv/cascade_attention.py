"""Cascade attention: a shared prefix attended once for a whole batch, the
rest per request, merged by log-sum-exp (FlashInfer's `flashinfer.cascade`).

Attention over keys split into parts is the merge of the attention over each
part: (o, lse) of the whole equal `merge_state` of the parts' (o, lse). So a
batch whose requests share a prefix attends to it as one long request (all
queries against the prefix's keys, read once) and to each request's own
keys apart, then merges. The wrappers here compose pagedkv's prefill and
decode wrappers with `merge_state_in_place`; they add no kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._ops.tensors import Array
from .cascade import merge_state_in_place
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithPagedKVCacheWrapper, single_prefill_with_kv_cache


class MultiLevelCascadeAttentionWrapper:
    """Attention over a page table in levels (FlashInfer's class of that name).

    Level i has its own (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
    over the same pool: its "requests" are groups of consecutive queries
    (level 0: often one group of all queries, the shared prefix), each
    attending to that level's pages. The last level is causal when `causal`
    is; earlier levels are not (their keys all precede the queries). run()
    merges the levels' states into the last level's output.

    Example
    -------
    >>> w = MultiLevelCascadeAttentionWrapper(2, workspace, "NHD")
    >>> w.plan([qo_shared, qo_unique], [indptr_shared, indptr_unique],
    ...        [indices_shared, indices_unique], [last_shared, last_unique],
    ...        num_qo_heads, num_kv_heads, head_dim, page_size)
    >>> o = w.run(q, paged_kv_cache)      # q [queries, Hq, D]

    Parameters
    ----------
    num_levels : int
        Levels of the cascade (1 is plain prefill).
    float_workspace_buffer : array, optional
        Shared by the levels' wrappers (see BatchPrefillWithPagedKVCacheWrapper).
    kv_layout : str
        "NHD" or "HND".
    use_cuda_graph : bool
        Fixed buffers for capture are not supported: must be False.
    """

    def __init__(
        self,
        num_levels: int,
        float_workspace_buffer: Array | None = None,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf_arr: Sequence[Array] | None = None,
        paged_kv_indptr_buf_arr: Sequence[Array] | None = None,
        paged_kv_indices_buf_arr: Sequence[Array] | None = None,
        paged_kv_last_page_len_buf_arr: Sequence[Array] | None = None,
    ) -> None:
        if isinstance(num_levels, bool) or not isinstance(num_levels, int) or num_levels < 1:
            raise ValueError(f"num_levels must be an int >= 1, got {num_levels!r}")
        buffers = (
            qo_indptr_buf_arr,
            paged_kv_indptr_buf_arr,
            paged_kv_indices_buf_arr,
            paged_kv_last_page_len_buf_arr,
        )
        if use_cuda_graph or any(b is not None for b in buffers):
            raise ValueError("use_cuda_graph and its fixed buffers are not supported")
        self._levels = [
            BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
            for _ in range(num_levels)
        ]
        self._kv_layout = kv_layout

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def plan(
        self,
        qo_indptr_arr: Sequence[Array],
        paged_kv_indptr_arr: Sequence[Array],
        paged_kv_indices_arr: Sequence[Array],
        paged_kv_last_page_len: Sequence[Array],
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: object = None,
        kv_data_type: object = None,
    ) -> None:
        """Plans every level (one list entry per level in each of the first
        four arguments); the other arguments as for
        BatchPrefillWithPagedKVCacheWrapper.plan, the same for all levels."""
        tables = [qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len]
        if any(len(t) != len(self._levels) for t in tables):
            raise ValueError(f"plan() needs one page table per level ({len(self._levels)})")
        last = len(self._levels) - 1
        for i, (level, qo, indptr, indices, last_len) in enumerate(
            zip(self._levels, *tables, strict=True)
        ):
            level.plan(
                qo,
                indptr,
                indices,
                last_len,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                page_size,
                causal=causal and i == last,
                pos_encoding_mode=pos_encoding_mode,
                use_fp16_qk_reduction=use_fp16_qk_reduction,
                sm_scale=sm_scale,
                window_left=window_left,
                logits_soft_cap=logits_soft_cap,
                rope_scale=rope_scale,
                rope_theta=rope_theta,
                q_data_type=q_data_type,
                kv_data_type=kv_data_type,
            )

    begin_forward = plan

    def prewarm_paged_kv_stride_variant(self, variant: str = "independent") -> None:
        """Checks the call, as FlashInfer 0.7's (pagedkv._plan.workspace.check_prewarm)."""
        self._levels[-1].prewarm_paged_kv_stride_variant(variant)

    def run(self, q: Array, paged_kv_cache: Array | Sequence[Array]) -> Array:
        """o [queries, Hq, D] of q [queries, Hq, D] over every level's keys."""
        o, lse = self._levels[-1].run(q, paged_kv_cache, return_lse=True)
        for level in self._levels[:-1]:
            o_level, lse_level = level.run(q, paged_kv_cache, return_lse=True)
            merge_state_in_place(o, lse, o_level, lse_level)
        return o

    forward = run

    def end_forward(self) -> None:
        """FlashInfer's deprecated no-op."""


class _SharedPrefixWrapper:
    """FlashInfer's older cascade API: a prefix every request shares, given
    as contiguous K/V that every query attends (it precedes all their
    keys: no mask), merged with each request's own keys in the paged cache,
    which `_inner`, a wrapper of the class `_inner_class`, plans and runs."""

    _inner_class: type[BatchDecodeWithPagedKVCacheWrapper | BatchPrefillWithPagedKVCacheWrapper]

    def __init__(self, float_workspace_buffer: Array | None = None, kv_layout: str = "NHD"):
        self._inner = self._inner_class(float_workspace_buffer, kv_layout)
        self._kv_layout = kv_layout

    def _prefix_state(
        self, q: Array, k_shared: Array, v_shared: Array, **options: float | None
    ) -> tuple[Array, Array]:
        """(o, lse) of every query over the shared prefix alone; options:
        single_prefill_with_kv_cache's sm_scale, rope_scale, rope_theta."""
        return single_prefill_with_kv_cache(
            q,
            k_shared,
            v_shared,
            causal=False,
            kv_layout=self._kv_layout,
            return_lse=True,
            **options,
        )

    def end_forward(self) -> None:
        """FlashInfer's deprecated no-op."""


class BatchDecodeWithSharedPrefixPagedKVCacheWrapper(_SharedPrefixWrapper):
    """Decode with a prefix every request shares, given as contiguous K/V,
    and each request's own keys in the paged cache (FlashInfer's older
    cascade API; MultiLevelCascadeAttentionWrapper is the newer one).

    Example
    -------
    >>> w = BatchDecodeWithSharedPrefixPagedKVCacheWrapper(workspace, "NHD")
    >>> w.begin_forward(unique_indptr, unique_indices, unique_last, 32, 8, 128, 16)
    >>> o = w.forward(q, k_shared, v_shared, unique_kv_cache)   # q [B, Hq, D]

    k_shared, v_shared: [prefix_len, Hkv, D] (NHD) or [Hkv, prefix_len, D] (HND).
    """

    _inner_class = BatchDecodeWithPagedKVCacheWrapper

    def begin_forward(
        self,
        unique_kv_indptr: Array,
        unique_kv_indices: Array,
        unique_kv_last_page_len: Array,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        data_type: object = "float16",
    ) -> None:
        """Plans decode over the requests' own pages (the shared prefix needs
        no plan)."""
        self._inner.plan(
            unique_kv_indptr,
            unique_kv_indices,
            unique_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            kv_data_type=data_type,
        )

    def forward(
        self, q: Array, k_shared: Array, v_shared: Array, unique_kv_cache: Array | Sequence[Array]
    ) -> Array:
        """o [B, Hq, D]: each request's query over the shared prefix and its own keys."""
        o, lse = self._prefix_state(q, k_shared, v_shared)
        o_unique, lse_unique = self._inner.run(q, unique_kv_cache, return_lse=True)
        merge_state_in_place(o, lse, o_unique, lse_unique)
        return o


class BatchPrefillWithSharedPrefixPagedKVCacheWrapper(_SharedPrefixWrapper):
    """Prefill with a prefix every request shares, given as contiguous K/V,
    and each request's own keys in the paged cache (FlashInfer's older
    cascade API). With `causal`, a request's queries are its last tokens and
    see its own keys causally; the whole prefix precedes them.

    Example
    -------
    >>> w = BatchPrefillWithSharedPrefixPagedKVCacheWrapper(workspace, "NHD")
    >>> w.begin_forward(qo_indptr, kv_indptr, kv_indices, kv_last, 32, 8, 128, 16)
    >>> o = w.forward(q, k_shared, v_shared, unique_kv_cache, causal=True)
    """

    _inner_class = BatchPrefillWithPagedKVCacheWrapper

    def begin_forward(
        self,
        qo_indptr: Array,
        paged_kv_indptr: Array,
        paged_kv_indices: Array,
        paged_kv_last_page_len: Array,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
    ) -> None:
        """Keeps the requests' page table; forward() plans with its options."""
        self._inner.begin_forward(
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
        )

    def forward(
        self,
        q: Array,
        k_shared: Array,
        v_shared: Array,
        unique_kv_cache: Array | Sequence[Array],
        causal: bool = False,
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
    ) -> Array:
        """o [queries, Hq, D]: every query over the shared prefix and its
        request's own keys (causally among those with `causal`)."""
        options = {"sm_scale": sm_scale, "rope_scale": rope_scale, "rope_theta": rope_theta}
        o, lse = self._prefix_state(q, k_shared, v_shared, **options)
        o_unique, lse_unique = self._inner.forward_return_lse(
            q, unique_kv_cache, causal=causal, **options
        )
        merge_state_in_place(o, lse, o_unique, lse_unique)
        return o
