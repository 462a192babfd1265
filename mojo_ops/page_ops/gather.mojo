"""`gather_kv`: the contiguous K and V of a batch, read back out of the pages.

Request b's tokens land in rows seq_indptr[b] .. seq_indptr[b + 1] of
[total_tokens, num_kv_heads, head_dim] outputs (NHD order whatever the pool's
layout), in the pool's dtype, or an int8 pool's values in float32 (CPU).
For debugging and for references; decode never gathers.
"""

import extensibility
from extensibility import InputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.algorithm import sync_parallelize
from max.gpu import block_dim, block_idx, thread_idx
from max.gpu.host import DeviceContext

from ..cache.cache_tensors import cache_from_tensors, check_rows
from ..cache.int8_rows import load_int8_head
from ..cache.paged_kv_cache import KV, IndexPtr, KVLayout, PagedKVCache, Ptr
from ..cache.tensor_access import (
    GPU_VECTOR_BYTES,
    VECTOR_BYTES,
    HostIndices,
    host_ready,
    ptr_of,
    vector_width,
)
from ..cache.token_rows import move_token
from .page_table import HostPageTable


@always_inline
def request_of_row(seq_indptr: IndexPtr, batch_size: Int, row: Int) -> Int:
    """The b with seq_indptr[b] <= row < seq_indptr[b + 1] (binary search)."""
    var lo = 0
    var hi = batch_size
    while hi - lo > 1:
        var mid = (lo + hi) // 2
        if Int(seq_indptr[unsafe_offset=mid]) <= row:
            lo = mid
        else:
            hi = mid
    # Skip empty requests that share the start offset.
    while lo + 1 < batch_size and Int(seq_indptr[unsafe_offset=lo + 1]) <= row:
        lo += 1
    return lo


def gather_kv[
    target: StaticString
](
    cache: PagedKVCache,
    out_k: MutableInputTensor[rank=3, ...],
    out_v: MutableInputTensor[dtype=out_k.dtype, rank=3, ...],
    kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
    seq_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
    ctx: DeviceContext,
) raises:
    """Checks the page table and seq_indptr, then copies every cached token
    (an int8 pool's as float32 values: cache/int8_rows.mojo)."""
    comptime dequantizes = cache.dtype == DType.int8
    comptime if dequantizes and out_k.dtype != DType.float32:
        raise Error("pagedkv: gather gives an int8 pool's values in float32")
    elif not dequantizes and out_k.dtype != cache.dtype:
        raise Error("pagedkv: gather gives rows in the pool's dtype")
    elif dequantizes and target != "cpu":
        raise Error("pagedkv: int8 pools are read on the CPU")
    var total = out_k.dim_size(0)
    check_rows("out_k", out_k, total, cache.num_kv_heads(), cache.head_dim())
    check_rows("out_v", out_v, total, cache.num_kv_heads(), cache.head_dim())
    var batch_size = cache.batch_size
    if seq_indptr.dim_size(0) != batch_size + 1:
        raise Error("pagedkv: seq_indptr must have batch_size + 1 entries")
    # One synchronization on a GPU for all four index arrays.
    var table = HostPageTable.enqueue[target](
        kv_indptr, kv_indices, kv_last_page_len, ctx
    )
    var host_seq = HostIndices.enqueue[target](seq_indptr, ctx)
    host_ready[target](ctx)
    table.check(cache.page_size(), cache.num_pages)
    var offset = 0
    for b in range(batch_size):
        if host_seq[b] != offset:
            raise Error(
                "pagedkv: seq_indptr[",
                b,
                "] must be ",
                offset,
                " (cumulative lengths)",
            )
        offset += table.seq_len(b, cache.page_size())
    if host_seq[batch_size] != offset or offset != total:
        raise Error(
            "pagedkv: the batch caches ",
            offset,
            " tokens; outputs hold ",
            total,
        )
    if total == 0:
        return

    var seq = ptr_of(seq_indptr)
    comptime if dequantizes:
        var values = (
            rebind[Ptr[DType.float32]](ptr_of(out_k)),
            rebind[Ptr[DType.float32]](ptr_of(out_v)),
        )
        var heads = cache.num_kv_heads()
        var d = cache.head_dim()

        def dequantize_request(
            b: Int,
        ) {var cache, var values, var seq, var heads, var d}:
            var first = Int(seq[unsafe_offset=b])
            for tok in range(cache.cache_length(b)):
                for h in range(heads):
                    var at = ((first + tok) * heads + h) * d
                    load_int8_head[KV.K](
                        cache, values[0].unsafe_offset(at), b, tok, h
                    )
                    load_int8_head[KV.V](
                        cache, values[1].unsafe_offset(at), b, tok, h
                    )

        sync_parallelize(dequantize_request, batch_size)
        return
    var k = rebind[Ptr[cache.dtype]](ptr_of(out_k))
    var v = rebind[Ptr[cache.dtype]](ptr_of(out_v))
    comptime if target == "cpu":
        comptime width = vector_width[cache.dtype, VECTOR_BYTES]()

        def one_request(b: Int) {var cache, var k, var v, var seq}:
            var first = Int(seq[unsafe_offset=b])
            for tok in range(cache.cache_length(b)):
                move_token[KV.K, width, False](
                    cache, k, first + tok, b, tok, 0, 1
                )
                move_token[KV.V, width, False](
                    cache, v, first + tok, b, tok, 0, 1
                )

        sync_parallelize(one_request, batch_size)
    else:
        comptime width = vector_width[cache.dtype, GPU_VECTOR_BYTES]()

        def kernel(
            cache: type_of(cache),
            k: Ptr[cache.dtype],
            v: Ptr[cache.dtype],
            seq: IndexPtr,
        ):
            var row = Int(block_idx.x)
            var b = request_of_row(seq, cache.batch_size, row)
            var tok = row - Int(seq[unsafe_offset=b])
            var t = Int(thread_idx.x)
            var step = Int(block_dim.x)
            if block_idx.y == 0:
                move_token[KV.K, width, False](cache, k, row, b, tok, t, step)
            else:
                move_token[KV.V, width, False](cache, v, row, b, tok, t, step)

        ctx.enqueue_function[kernel](
            cache, k, v, seq, grid_dim=(total, 2), block_dim=128
        )


@extensibility.register("pagedkv_gather_kv")
struct GatherKV:
    """Gathers from a pool passed as k_cache, v_cache [pages, kv, ...page...].
    """

    @staticmethod
    def execute[
        target: StaticString, layout: Int
    ](
        out_k: MutableInputTensor[rank=3, ...],
        out_v: MutableInputTensor[dtype=out_k.dtype, rank=3, ...],
        k_cache: InputTensor[rank=5, ...],
        v_cache: InputTensor[dtype=k_cache.dtype, rank=5, ...],
        kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
        seq_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var cache = cache_from_tensors[KVLayout(layout)](
            k_cache, v_cache, kv_indices, kv_indptr, kv_last_page_len
        )
        gather_kv[target](
            cache,
            out_k,
            out_v,
            kv_indices,
            kv_indptr,
            kv_last_page_len,
            seq_indptr,
            ctx,
        )
