"""Batch prefill attention over the paged cache: the registered op.

Request b has qo_indptr[b + 1] - qo_indptr[b] query tokens, the last ones of
its sequence (their K/V already appended): query i of a request of L cached
tokens and n queries sits at position L - n + i. Causal or not, with
FlashInfer's options; chunked prefill and speculative decoding (several new
tokens per request) are the same call. Output o [nnz_qo, Hq, D] and lse
[nnz_qo, Hq]; the work items (tiles of each request's queries) come from
plan().
"""

import extensibility
from extensibility import InputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext

from .attention import kv_element_type, run_attention
from .cache_tensors import cache_from_tensors
from .paged_kv_cache import KVLayout


@extensibility.register("pagedkv_batch_prefill")
struct BatchPrefill:
    """Prefill over a pool passed as k_cache, v_cache (see decode.mojo); the
    operands are decode's, so the Python side builds both the same way."""

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
        float_params: InputTensor[dtype=DType.float32, rank=1, ...],
        int_params: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var cache = cache_from_tensors[KVLayout(layout)](
            k_cache, v_cache, kv_indices, kv_indptr, kv_last_page_len
        ).bitcast[kv_element_type[k_cache.dtype, kv_format]()]()
        # Prefill items split queries, never keys: partial_o and partial_lse
        # stay unused (plan() passes one-row placeholders).
        run_attention[target](
            cache,
            output,
            lse,
            partial_o,
            partial_lse,
            q,
            work_items,
            request_items,
            float_params,
            int_params,
            False,
            ctx,
        )
