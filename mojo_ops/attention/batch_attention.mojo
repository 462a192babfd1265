"""Batch decode and prefill attention over the paged cache: the registered op.

One op serves both; what tells them apart is run-time data from plan(): the
work items, and int_params[INT_KV_SPLIT] (whether items split a request's
keys, whose partial states then get merged).

- Decode: each of B requests has one query token with num_qo_heads heads
  attending to all K/V cached for it (the new token's K/V already appended).
  Output o [B, Hq, D] and the base-2 log-sum-exp lse [B, Hq]; an item is one
  query row over a chunk of keys (long requests are split).
- Prefill: request b has qo_indptr[b + 1] - qo_indptr[b] query tokens, the
  last ones of its sequence: query i of a request of L cached tokens and n
  queries sits at position L - n + i. Causal or not; chunked prefill and
  speculative decoding are the same call. Output o [nnz_qo, Hq, D] and lse
  [nnz_qo, Hq]; an item is a tile of a request's queries over all its keys.
  custom_mask and mask_rows carry a custom mask (custom_mask.mojo; CPU only);
  an empty mask_rows means none.
"""

import extensibility
from extensibility import InputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext

from ..cache.cache_tensors import cache_from_tensors
from ..cache.paged_kv_cache import KVLayout
from ..cache.tensor_access import ptr_of
from .custom_mask import CustomMask
from .params import INT_KV_SPLIT
from .run import kv_element_type, run_attention


@extensibility.register("pagedkv_batch_attention")
struct BatchAttention:
    """Attention over a pool passed as k_cache, v_cache [pages, kv, ...page...]
    (see cache/cache_tensors.mojo). The pool is declared mutable though only read,
    so that in a graph it is the same buffer value the appends write: MAX
    then orders this op after them and never copies the pool."""

    @staticmethod
    def execute[
        target: StaticString, layout: Int, kv_format: Int
    ](
        output: MutableInputTensor[rank=3, ...],
        lse: MutableInputTensor[dtype=DType.float32, rank=2, ...],
        partial_o: MutableInputTensor[dtype=DType.float32, rank=3, ...],
        partial_lse: MutableInputTensor[dtype=DType.float32, rank=2, ...],
        q: InputTensor[dtype=output.dtype, rank=3, ...],
        k_cache: MutableInputTensor[rank=5, ...],
        v_cache: MutableInputTensor[dtype=k_cache.dtype, rank=5, ...],
        kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
        work_items: InputTensor[dtype=DType.int32, rank=2, ...],
        request_items: InputTensor[dtype=DType.int32, rank=1, ...],
        custom_mask: InputTensor[dtype=DType.uint8, rank=1, ...],
        mask_rows: InputTensor[dtype=DType.int32, rank=1, ...],
        float_params: InputTensor[dtype=DType.float32, rank=1, ...],
        int_params: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var cache = cache_from_tensors[KVLayout(layout)](
            k_cache, v_cache, kv_indices, kv_indptr, kv_last_page_len
        ).bitcast[kv_element_type[k_cache.dtype, kv_format]()]()
        # Items that split keys (decode) leave partial states to merge;
        # prefill items split queries only, and plan() passes one-row
        # placeholders for partial_o and partial_lse.
        var kv_split = Int(int_params[INT_KV_SPLIT]) != 0
        var mask = CustomMask(
            ptr_of(custom_mask), ptr_of(mask_rows), mask_rows.dim_size(0) > 0
        )
        run_attention[target](
            cache,
            output,
            lse,
            partial_o,
            partial_lse,
            q,
            work_items,
            request_items,
            mask,
            float_params,
            int_params,
            kv_split,
            ctx,
        )
