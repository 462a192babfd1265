"""Batch prefill attention over the paged cache, FlashInfer's wrapper API.

Each request brings several query tokens, the last ones of its sequence (their
K/V already appended): a prompt prefilled in one step, a chunk of a long
prompt (chunked prefill), or a few draft tokens (speculative decoding). The
queries attend, causally or not, to all of the request's cached K/V, with the
same options as decode.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from max.dtype import DType

from ._checks import as_int32_index, check_index_array, check_int, host_index_copy
from ._ops.kernels import OpSpec
from ._ops.tensors import Array, check_array, contiguous, device_of, dtype_of, is_torch, new_like
from ._plan.block_tables import check_trtllm_table
from ._plan.io_dtypes import kernel_out, kernel_q_dtype, output_dtype, output_in
from ._plan.one_page import attention_of_nothing, one_page_kv
from ._plan.plan import AttentionPlan, PageTable, attention_spec
from ._plan.work import (
    PREFILL_BACKENDS,
    AttentionOptions,
    as_dtype,
    check_backend,
    check_heads,
    prefill_work,
)
from ._wrappers import PagedWrapper, fixed_index_buffers, refuse_jit_variants
from .attention_sinks import merge_sinks, sink_log2_lse
from .custom_mask import custom_mask_rows, multi_item_mask
from .lse_forms import finished_lse, staged_lse
from .nvfp4 import attention_cache, dequantize_ragged_for_attention, plan_kv_dtype


def prefill_spec(q_dtype: DType, kv_dtype: DType, layout: int) -> OpSpec:
    """The compiled prefill op for these dtypes and layout."""
    return attention_spec(q_dtype, kv_dtype, layout)


FIXED_PREFILL_BUFFERS = (
    "qo_indptr_buf",
    "paged_kv_indptr_buf",
    "paged_kv_indices_buf",
    "paged_kv_last_page_len_buf",
)
"""The constructor's fixed buffers (use_cuda_graph), in plan()'s order."""

PAGED_KV_TABLE = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
"""plan()'s CSR page table arguments, in order."""


class BatchPrefillWithPagedKVCacheWrapper(PagedWrapper):
    """Ragged multi-token attention over the paged cache.

    >>> w = BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD")
    >>> w.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16,
    ...        causal=True)
    >>> o = w.run(q, paged_kv_cache)          # q [qo_indptr[-1], 32, 128]

    The constructor takes FlashInfer's arguments in FlashInfer's order.
    use_cuda_graph=True takes qo_indptr_buf and the three paged_kv_*_buf
    arrays, which plan() writes and run() reads, as in
    BatchDecodeWithPagedKVCacheWrapper (pagedkv.fixed_buffers); custom masks
    then go through plan()'s arguments (custom_mask_buf and mask_indptr_buf
    must be None). backend: FlashInfer's "auto" or "fa2", both pagedkv's one
    prefill kernel for the device.
    """

    def __init__(
        self,
        float_workspace_buffer: Array | None = None,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Array | None = None,
        paged_kv_indptr_buf: Array | None = None,
        paged_kv_indices_buf: Array | None = None,
        paged_kv_last_page_len_buf: Array | None = None,
        custom_mask_buf: Array | None = None,
        mask_indptr_buf: Array | None = None,
        backend: str = "auto",
        jit_args: object = None,
        jit_kwargs: object = None,
        variant_owns_mask: bool = False,
    ) -> None:
        refuse_jit_variants(jit_args, jit_kwargs, variant_owns_mask)
        if custom_mask_buf is not None or mask_indptr_buf is not None:
            raise ValueError(
                "custom_mask_buf and mask_indptr_buf are not supported: pass the mask to plan()"
            )
        given = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf)
        given += (paged_kv_last_page_len_buf,)
        fixed = fixed_index_buffers(
            use_cuda_graph,
            dict(zip(FIXED_PREFILL_BUFFERS, given, strict=True)),
            ("qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_last_page_len_buf"),
            "*_buf",
        )
        check_backend(backend, PREFILL_BACKENDS)
        super().__init__(float_workspace_buffer, kv_layout, backend, fixed)
        self._multi = None
        self._head_dim_vo = 0
        """The value head dim planned (below the query's: DeepSeek's
        non-absorbed MLA prefill, V padded with zeros for the kernel)."""

    def _plain(self) -> BatchPrefillWithPagedKVCacheWrapper:
        """A wrapper of the same layout and backend without fixed buffers."""
        return BatchPrefillWithPagedKVCacheWrapper(None, self._kv_layout, backend=self._backend)

    def plan(
        self,
        qo_indptr: Array, paged_kv_indptr: Array, paged_kv_indices: Array,
        paged_kv_last_page_len: Array, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
        page_size: int, head_dim_vo: int | None = None, custom_mask: Array | None = None,
        packed_custom_mask: Array | None = None, causal: bool = False,
        pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
        rope_scale: float | None = None, rope_theta: float | None = None,
        q_data_type: object = None, kv_data_type: object = None, o_data_type: object = None,
        non_blocking: bool = True, prefix_len_ptr: Array | None = None,
        token_pos_in_items_ptr: Array | None = None, token_pos_in_items_len: int = 0,
        max_item_len_ptr: Array | None = None, seq_lens: Array | None = None,
        seq_lens_q: Array | None = None, block_tables: Array | None = None,
        max_token_per_sequence: int | None = None, max_sequence_kv: int | None = None,
        fixed_split_size: int | None = None, disable_split_kv: bool = False,
    ) -> None:  # fmt: skip
        """Prepares the batch: qo_indptr [B + 1] (request b's queries are rows
        qo_indptr[b]:qo_indptr[b + 1] of q) and the CSR page table of the
        cached K/V, which already includes the queries' own tokens. Index
        arrays are int32, or an integer dtype whose values fit (converted).

        Options as in FlashInfer and decode. custom_mask (bool, each request's
        [qo_len, kv_len] flattened and concatenated) or packed_custom_mask
        (the same packed little-endian, each request from a byte boundary:
        pagedkv.custom_mask) replaces causal (on a GPU, the generic kernel
        runs it). use_fp16_qk_reduction is accepted and ignored (scores are
        always accumulated in float32).
        Multi-item scoring (prefix_len_ptr, token_pos_in_items_ptr,
        token_pos_in_items_len; max_item_len_ptr, a kernel hint, is not read)
        runs as the custom mask it stands for (pagedkv.custom_mask.multi_item_mask).
        An fp8 q_data_type is widened to bfloat16 for the kernel, and
        o_data_type, given, is the output's dtype (else the query's, as
        given; pagedkv._plan.io_dtypes). non_blocking,
        fixed_split_size and disable_split_kv are accepted and change nothing
        (prefill work is tiled by queries, never split by keys). The
        parameters are in FlashInfer's order, so positional calls agree.
        block_tables and seq_lens (FlashInfer's trtllm-gen form of the
        table), given, must name the CSR table's pages, and seq_lens_q
        qo_indptr's counts (ValueError otherwise); max_token_per_sequence and
        max_sequence_kv, trtllm-gen's launch bounds, are not read.

        Example
        -------
        >>> w.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16,
        ...        causal=True, q_data_type=torch.float16)
        """
        del non_blocking, fixed_split_size, disable_split_kv, max_item_len_ptr
        del max_token_per_sequence, max_sequence_kv  # trtllm-gen's launch bounds
        masked = custom_mask is not None or packed_custom_mask is not None
        multi_item = (prefix_len_ptr, token_pos_in_items_ptr)
        self._check_plan_contract(multi_item, masked, window_left, (head_dim_qk, head_dim_vo))
        self._o_dtype = output_dtype(o_data_type, as_dtype)
        q_kernel = kernel_q_dtype(q_data_type, as_dtype)  # run() widens an fp8 query
        csr = (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        check_trtllm_table(block_tables, seq_lens, page_size, csr, qo_indptr, seq_lens_q)
        self._planned = dict(
            qo_indptr=qo_indptr,
            paged_kv_indptr=paged_kv_indptr,
            paged_kv_indices=paged_kv_indices,
            paged_kv_last_page_len=paged_kv_last_page_len,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk,
            page_size=page_size,
            causal=causal,
            pos_encoding_mode=pos_encoding_mode,
            sm_scale=sm_scale,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            q_data_type=q_kernel,
            kv_data_type=plan_kv_dtype(kv_data_type, q_kernel),  # uint8: NVFP4
        )
        items = (*multi_item, token_pos_in_items_len) if prefix_len_ptr is not None else None
        self._plan_pages(self._planned, (custom_mask, packed_custom_mask), items)
        self._planned["head_dim_vo"] = head_dim_vo
        self._head_dim_vo = head_dim_vo or head_dim_qk

    @staticmethod
    def _check_plan_contract(multi_item, masked, window_left, head_dims) -> None:
        """Refuses what plan() does not take: multi-item scoring with a
        custom mask, half of its two arrays or a window, a value head dim
        larger than the query's."""
        if any(ptr is not None for ptr in multi_item):
            if masked:
                raise ValueError("multi-item scoring and a custom mask are exclusive")
            if any(ptr is None for ptr in multi_item):
                raise ValueError(
                    "multi-item scoring needs prefix_len_ptr and token_pos_in_items_ptr"
                )
            if window_left >= 0:
                raise ValueError("multi-item scoring with window_left is not supported")
        head_dim_qk, head_dim_vo = head_dims
        if head_dim_vo is not None and not 1 <= head_dim_vo <= head_dim_qk:
            raise ValueError(
                f"head_dim_vo ({head_dim_vo}) must be in [1, head_dim_qk ({head_dim_qk})]"
            )

    def _plan_pages(self, p: dict, masks: tuple, multi_item: tuple | None) -> None:
        """The plan of the checked arguments (p: plan()'s, as `_planned` keeps
        them): the page table, the query rows, the mask (masks: the custom
        mask, bool or packed; or multi_item, multi-item scoring's arrays and
        token_pos_in_items_len), the work list."""
        custom_mask, packed_custom_mask = masks
        qo_indptr = as_int32_index("qo_indptr", p["qo_indptr"])
        csr = [as_int32_index(name, p[name]) for name in PAGED_KV_TABLE]
        masked = custom_mask is not None or packed_custom_mask is not None or multi_item
        # As in FlashInfer: a custom mask replaces causal.
        causal = False if masked else p["causal"]
        num_qo_heads, num_kv_heads = check_heads(p["num_qo_heads"], p["num_kv_heads"])
        options = AttentionOptions.of_plan(check_int("head_dim_qk", p["head_dim_qk"], 1), p)
        table = PageTable.checked(*csr, check_int("page_size", p["page_size"], 1))
        check_index_array("qo_indptr", qo_indptr, table.batch_size + 1)
        host_qo = host_index_copy("qo_indptr", qo_indptr).astype(np.int64)
        counts = np.diff(host_qo)
        if host_qo[0] != 0 or (counts < 0).any():
            raise ValueError("qo_indptr must start at 0 and never decrease")
        if multi_item:
            custom_mask = multi_item_mask(counts, table.seq_lens, *multi_item)
        mask = (
            custom_mask_rows(counts, table.seq_lens, custom_mask, packed_custom_mask)
            if masked
            else None
        )
        # More queries than keys is allowed, as in FlashInfer: query i sits
        # at position kv_len - qo_len + i, so under a causal mask the first
        # ones see no key (o = 0, lse = -inf).
        views = None
        if self._fixed is not None:
            # qo_indptr is written for the caller; the kernel's query tiling
            # lives in the plan's work items.
            written = self._fixed.write_all(
                host_qo, table.indptr, table.indices, table.last_page_len
            )
            views = written[1:]
        items, request_items, max_queries = prefill_work(
            table.seq_lens,
            host_qo,
            num_qo_heads // num_kv_heads,
            options,
            causal,
            device_of(qo_indptr).is_gpu,
        )
        self._plan = AttentionPlan(
            table,
            items=items,
            request_items=request_items,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            layout=self._layout,
            options=options,
            # Prefill tasks take one KV head and a tile of query tokens.
            int_params=options.int_params(
                1, causal=causal, max_queries=max_queries, kv_split=False
            ),
            q_rows=int(host_qo[-1]),
            q_data_type=p["q_data_type"],
            kv_data_type=p["kv_data_type"],
            workspace=self._workspace,
            custom_mask=mask,
            table_views=views,
        )

    def run(
        self,
        q: Array,
        paged_kv_cache: Array | Sequence[Array],
        k_scale: float | None = None,
        v_scale: float | None = None,
        return_lse: bool = False,
        *,
        q_scale: float | None = None,
        out: Array | None = None,
        lse: Array | None = None,
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: Array | None = None,
        kv_cache_sf: Array | Sequence[Array] | None = None,
        lse_base: str = "log2",
        lse_layout: str = "NH",
        skip_softmax_threshold_scale_factor: float | None = None,
        use_fp16_softmax: bool = False,
        uses_spcompress: bool = False,
    ) -> Array | tuple[Array, Array]:
        """Attention of q [qo_indptr[-1], num_qo_heads, head_dim] over the batch.

        kv_cache_sf: an NVFP4 cache's block scales (pagedkv.nvfp4, planned
        with kv_data_type=uint8; k_scale / v_scale its global scales).

        Returns o (q's shape; the planned o_data_type, else q's dtype; an fp8
        q is widened for the kernel), and lse [rows, Hq] (float32, base 2)
        with return_lse; `out` and `lse` take them in place, as in
        BatchDecodeWithPagedKVCacheWrapper.run. window_left, if given, must
        be the planned one; enable_pdl is ignored. sinks: float [Hq], a logit
        a head added to each softmax's denominator (pagedkv.attention_sinks).
        lse_base ("log2" or "ln") and lse_layout ("NH" or "HN") shape the
        lse returned (pagedkv.lse_forms). use_fp16_softmax and
        uses_spcompress name GPU kernel variants and must keep their
        defaults; so must skip_softmax_threshold_scale_factor, except with
        backend "trtllm-gen" (whose FlashInfer kernel takes it): nothing is
        skipped there, the attention is exact.

        Example
        -------
        >>> o, lse = w.run(q, paged_kv_cache, return_lse=True)
        """
        del enable_pdl
        if self._plan is None:
            raise RuntimeError("run() called before plan()")
        gpu_only = {
            "skip_softmax_threshold_scale_factor": skip_softmax_threshold_scale_factor,
            "use_fp16_softmax": use_fp16_softmax,
            "uses_spcompress": uses_spcompress,
        }
        q, o_dtype = self._run_query(q, out, gpu_only)
        # A caller's lse buffer is filled even without return_lse.
        want_lse = return_lse or lse is not None
        lse, lse_into = staged_lse(lse, lse_base, lse_layout, q, want_lse)
        sink_lse = None
        if sinks is not None:
            sink_lse = sink_log2_lse(sinks, int(self._plan.num_qo_heads))
        planned = self._plan.options.window_left
        if window_left is not None and window_left != planned:
            raise ValueError(f"window_left={window_left} differs from the planned {planned}")
        if kv_cache_sf is not None:
            paged_kv_cache = attention_cache(
                paged_kv_cache, kv_cache_sf, self._kv_layout, q, self._plan.table
            )
        narrow = self._head_dim_vo < self._plan.options.head_dim
        direct = None if narrow else kernel_out(out, q)
        if narrow:
            table = self._plan.table
            widened = values_padded(paged_kv_cache, table.indices, self._plan.options.head_dim)
            paged_kv_cache = widened
        o, lse = self._plan.run(
            q, paged_kv_cache, self._kv_layout, q_scale, k_scale, v_scale, direct, lse,
            want_lse or sink_lse is not None,
        )  # fmt: skip
        if narrow:
            o = values_narrowed(o, self._head_dim_vo, kernel_out(out, q))
        if sink_lse is not None:
            merge_sinks(o, lse, sink_lse)
        o = output_in(o, o_dtype, out)
        if not want_lse:
            return o
        lse = finished_lse(lse, lse_base, lse_layout, lse_into)
        return (o, lse) if return_lse else o

    begin_forward = plan

    def forward(
        self,
        q: Array,
        paged_kv_cache: Array | Sequence[Array],
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale: float | None = None,
        v_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        return_lse: bool = False,
    ) -> Array | tuple[Array, Array]:
        """FlashInfer's deprecated run(): the options come with the call and
        replace the planned ones (plan() runs again when they differ)."""
        del use_fp16_qk_reduction
        self._replan_with(
            causal=causal,
            pos_encoding_mode=pos_encoding_mode,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
        )
        return self.run(q, paged_kv_cache, k_scale, v_scale, return_lse)


def single_prefill_with_kv_cache(
    q: Array,
    k: Array,
    v: Array,
    scale_q: Array | None = None,
    scale_k: Array | None = None,
    scale_v: Array | None = None,
    o_dtype: object = None,
    custom_mask: Array | None = None,
    packed_custom_mask: Array | None = None,
    causal: bool = False,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_fp16_qk_reduction: bool = False,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    kv_cache_sf: object = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> Array | tuple[Array, Array]:
    """Attention of one request's qo_len queries over contiguous K/V, with
    FlashInfer's arguments in FlashInfer's order.

    Parameters
    ----------
    q : [qo_len, num_qo_heads, head_dim]
    k, v : [kv_len, num_kv_heads, head_dim] (NHD) or [num_kv_heads, kv_len, head_dim] (HND)
    k_scale, v_scale
        Float scales of q.k and of o (float8 K/V's calibration).
    scale_q, scale_k, scale_v
        FlashInfer's per-head fp8 scale tensors: must be None.
    kv_cache_sf
        NVFP4 K/V's (k_sf, v_sf) block scales (pagedkv.nvfp4): k, v are then
        uint8 [..., head_dim // 2], dequantized to q's dtype for the kernel,
        with k_scale, v_scale their global scales.
    o_dtype
        None or q's dtype. backend: "auto" or "fa2".

    Returns
    -------
    o (q's shape and dtype), and lse [qo_len, num_qo_heads] (float32, base 2)
    with return_lse. As in FlashInfer, the queries are the last qo_len tokens:
    query i sits at position kv_len - qo_len + i (causal mask, window, RoPE
    and ALiBi), so with causal and qo_len > kv_len the first queries see no
    key (o = 0, lse = -inf). custom_mask ([qo_len, kv_len]
    bool) or packed_custom_mask replaces causal. The K/V are viewed, without
    a copy, as one page of kv_len tokens and run through the batch prefill
    kernel; use_fp16_qk_reduction is ignored.

    Example
    -------
    >>> o = single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa2")
    """
    check_backend(backend, PREFILL_BACKENDS)
    if any(x is not None for x in (scale_q, scale_k, scale_v)):
        raise ValueError("scale_q, scale_k and scale_v (per-head fp8 scales) are not supported")
    if kv_cache_sf is not None:
        # NVFP4 K/V with their block scales; k_scale, v_scale stay the global ones.
        k, v = dequantize_ragged_for_attention(k, v, kv_cache_sf, q)
    if o_dtype is not None and as_dtype(o_dtype, "o_dtype") != dtype_of(q):
        raise ValueError("o_dtype must be None or q's dtype: o is written in q's dtype")
    kv = one_page_kv(q, k, v, kv_layout, q_dims=3, narrow_values=True)
    queries, num_qo_heads, head_dim = (int(n) for n in q.shape)
    head_dim_vo = int(v.shape[-1])
    if custom_mask is not None or packed_custom_mask is not None:
        causal = False  # a custom mask replaces causal
    if queries == 0 or kv.length == 0:
        return attention_of_nothing(q[..., :head_dim_vo], return_lse)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(kv_layout=kv_layout)
    wrapper.plan(
        new_like(q, np.array([0, queries], np.int32)),
        kv.indptr,
        kv.indices,
        kv.last_page_len,
        num_qo_heads,
        kv.num_kv_heads,
        head_dim,
        kv.length,
        head_dim_vo=head_dim_vo,
        custom_mask=custom_mask,
        packed_custom_mask=packed_custom_mask,
        causal=causal,
        pos_encoding_mode=pos_encoding_mode,
        use_fp16_qk_reduction=use_fp16_qk_reduction,
        sm_scale=sm_scale,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        q_data_type=dtype_of(q),
        kv_data_type=dtype_of(k),
    )
    return wrapper.run(q, kv.cache, k_scale, v_scale, return_lse)


single_prefill_with_kv_cache_return_lse = functools.partial(
    single_prefill_with_kv_cache, return_lse=True
)
"""`single_prefill_with_kv_cache` with return_lse=True: (o, lse)."""


def values_padded(
    cache: Array | Sequence[Array], pages: np.ndarray, head_dim: int
) -> tuple[Array, Array]:
    """A (K, V) cache whose V rows are shorter than the query's head dim, V
    widened to `head_dim` with zero lanes: the kernel's one head dim, and
    the same attention (zero value lanes add nothing). Only the pages the
    plan reads (`pages`, host ids) are copied; the rest of the new pool is
    never read."""
    if not (isinstance(cache, (list, tuple)) and len(cache) == 2):
        raise ValueError("head_dim_vo below head_dim_qk needs the cache as a (K, V) pair")
    k, v = cache
    check_array("paged_kv_cache[1]", v)
    if int(v.shape[-1]) > head_dim:
        raise ValueError(f"V rows have {v.shape[-1]} lanes, more than head_dim_qk {head_dim}")
    used = np.unique(pages)
    shape = (*v.shape[:-1], head_dim)
    if is_torch(v):
        import torch

        widened = torch.zeros(shape, dtype=v.dtype, device=v.device)
        index = torch.from_numpy(used.astype(np.int64)).to(v.device)
        widened[index, ..., : v.shape[-1]] = v[index]
    else:
        widened = np.zeros(shape, v.dtype)  # untouched pages cost no copy
        widened[used, ..., : v.shape[-1]] = v[used]
    return k, widened


def values_narrowed(o: Array, head_dim_vo: int, out: Array | None) -> Array:
    """The first head_dim_vo lanes of each output row (the zero-padded
    value lanes dropped), in `out` when given."""
    narrowed = o[..., :head_dim_vo]
    if out is None:
        return contiguous(narrowed)
    check_array("out", out)
    if tuple(out.shape) != tuple(narrowed.shape) or dtype_of(out) != dtype_of(o):
        raise ValueError(
            f"out must be {tuple(narrowed.shape)} in q's dtype, got {tuple(out.shape)}"
        )
    if is_torch(out):
        out.copy_(narrowed)
    else:
        out[...] = narrowed
    return out
