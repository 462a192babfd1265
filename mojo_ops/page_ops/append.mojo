"""Ragged append: scatter new tokens' K/V (or MLA's ckv/kpe) into their pages.

Token i of the append goes to request `batch_indices[i]` at sequence position
`positions[i]`, i.e. to slot `positions[i] % page_size` of page
`kv_indices[kv_indptr[b] + positions[i] // page_size]`. The page table and the
targets are checked on the host first (see page_table.mojo), so a bad call
raises before a single element is written. On a GPU that check costs a
synchronization and a copy of the index arrays to the host, so a caller that
made the table itself (the step graphs, once per layer) appends unchecked
(`checked` = 0); every writer still skips a token that has no slot in the
pool (`PagedKVCache.holds`), so a wrong table loses rows instead of writing
outside the pool.

CPU: tokens are split across all cores; each token's row moves with full-width
vector loads and stores. GPU: one thread block per (token, K or V), each
thread moving 16-byte vectors, so consecutive threads touch consecutive
addresses. Float rows appended to an int8 pool are quantized into its rows
instead (cache/int8_rows.mojo), on the CPU.
"""

import extensibility
from extensibility import InputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.algorithm import sync_parallelize
from max.gpu import block_dim, block_idx, thread_idx
from max.gpu.host import DeviceContext
from std.math import ceildiv
from std.sys import num_physical_cores, size_of

from ..cache.cache_tensors import cache_from_tensors, check_rows
from ..cache.int8_rows import store_int8_head
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
from .page_table import HostPageTable, check_append_targets

comptime CPU_BYTES_PER_TASK = 1 << 16
"""Appends smaller than this per core stay on fewer cores: a thread's start
costs more than moving 64 KiB."""

comptime GPU_BLOCK = 128


def scatter_tokens[
    target: StaticString, kv_a: KV, kv_b: KV
](
    cache_a: PagedKVCache,
    src_a: Ptr[cache_a.dtype],
    cache_b: type_of(cache_a),
    src_b: Ptr[cache_a.dtype],
    batch_indices: IndexPtr,
    positions: IndexPtr,
    nnz: Int,
    ctx: DeviceContext,
) raises:
    """Writes src_a into side kv_a of cache_a and src_b into side kv_b of
    cache_b, both [nnz, heads, head_dim] of their cache.

    K/V append is (cache, K, cache, V); MLA append is (ckv, K, kpe, K), two
    one-head caches of different widths.
    """
    if nnz == 0:
        return
    comptime if target == "cpu":
        comptime width = vector_width[cache_a.dtype, VECTOR_BYTES]()
        var token_bytes = (
            cache_a.num_kv_heads() * cache_a.head_dim()
            + cache_b.num_kv_heads() * cache_b.head_dim()
        ) * size_of[cache_a.dtype]()
        var tasks = min(
            nnz,
            max(nnz * token_bytes // CPU_BYTES_PER_TASK, 1),
            4 * num_physical_cores(),
        )

        def run_task(
            t: Int,
        ) {
            var cache_a,
            var src_a,
            var cache_b,
            var src_b,
            var batch_indices,
            var positions,
            var nnz,
            var tasks,
        }:
            for i in range(t * nnz // tasks, (t + 1) * nnz // tasks):
                var b = Int(batch_indices[unsafe_offset=i])
                var pos = Int(positions[unsafe_offset=i])
                if not (cache_a.holds(b, pos) and cache_b.holds(b, pos)):
                    continue
                move_token[kv_a, width, True](cache_a, src_a, i, b, pos, 0, 1)
                move_token[kv_b, width, True](cache_b, src_b, i, b, pos, 0, 1)

        sync_parallelize(run_task, tasks)
    else:
        comptime width = vector_width[cache_a.dtype, GPU_VECTOR_BYTES]()

        def kernel(
            cache_a: type_of(cache_a),
            src_a: Ptr[cache_a.dtype],
            cache_b: type_of(cache_a),
            src_b: Ptr[cache_a.dtype],
            batch_indices: IndexPtr,
            positions: IndexPtr,
        ):
            var i = Int(block_idx.x)
            var b = Int(batch_indices[unsafe_offset=i])
            var pos = Int(positions[unsafe_offset=i])
            if not (cache_a.holds(b, pos) and cache_b.holds(b, pos)):
                return
            var t = Int(thread_idx.x)
            var step = Int(block_dim.x)
            if block_idx.y == 0:
                move_token[kv_a, width, True](
                    cache_a, src_a, i, b, pos, t, step
                )
            else:
                move_token[kv_b, width, True](
                    cache_b, src_b, i, b, pos, t, step
                )

        ctx.enqueue_function[kernel](
            cache_a,
            src_a,
            cache_b,
            src_b,
            batch_indices,
            positions,
            grid_dim=(nnz, 2),
            block_dim=GPU_BLOCK,
        )


def check_append[
    target: StaticString
](
    cache: PagedKVCache,
    batch_indices: InputTensor[dtype=DType.int32, rank=1, ...],
    positions: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
    ctx: DeviceContext,
) raises:
    """Raises unless the page table is sound and every token has a slot.

    On a GPU the five index arrays come to the host in one synchronization.
    """
    var nnz = batch_indices.dim_size(0)
    if positions.dim_size(0) != nnz:
        raise Error(
            "pagedkv: positions has ",
            positions.dim_size(0),
            " entries but batch_indices has ",
            nnz,
        )
    var table = HostPageTable.enqueue[target](
        kv_indptr, kv_indices, kv_last_page_len, ctx
    )
    var bi = HostIndices.enqueue[target](batch_indices, ctx)
    var pos = HostIndices.enqueue[target](positions, ctx)
    host_ready[target](ctx)
    table.check(cache.page_size(), cache.num_pages)
    check_append_targets(bi, pos, nnz, table, cache.page_size())


def append_paged_kv[
    target: StaticString, checked: Bool
](
    cache: PagedKVCache,
    append_key: InputTensor[rank=3, ...],
    append_value: InputTensor[dtype=append_key.dtype, rank=3, ...],
    batch_indices: InputTensor[dtype=DType.int32, rank=1, ...],
    positions: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
    ctx: DeviceContext,
) raises:
    """Checks everything (the index arrays only when `checked`), then
    writes key/value [nnz, H, D] into the pages: copied when they have the
    pool's dtype, quantized (on the CPU) when the pool is int8 and they are
    float rows (cache/int8_rows.mojo)."""
    comptime quantizes = cache.dtype == DType.int8
    comptime if quantizes and not append_key.dtype.is_floating_point():
        raise Error(
            "pagedkv: an int8 pool takes float rows, which append quantizes"
        )
    elif not quantizes and append_key.dtype != cache.dtype:
        raise Error("pagedkv: append takes rows of the pool's dtype")
    elif quantizes and target != "cpu":
        raise Error("pagedkv: int8 pools are written on the CPU")
    var nnz = batch_indices.dim_size(0)
    var heads = cache.num_kv_heads()
    check_rows("append_key", append_key, nnz, heads, cache.head_dim())
    check_rows("append_value", append_value, nnz, heads, cache.head_dim())
    comptime if checked:
        check_append[target](
            cache,
            batch_indices,
            positions,
            kv_indices,
            kv_indptr,
            kv_last_page_len,
            ctx,
        )
    comptime if quantizes:
        quantize_tokens(
            cache,
            ptr_of(append_key),
            ptr_of(append_value),
            ptr_of(batch_indices),
            ptr_of(positions),
            nnz,
        )
    else:
        scatter_tokens[target, KV.K, KV.V](
            cache,
            rebind[Ptr[cache.dtype]](ptr_of(append_key)),
            cache,
            rebind[Ptr[cache.dtype]](ptr_of(append_value)),
            ptr_of(batch_indices),
            ptr_of(positions),
            nnz,
            ctx,
        )


def quantize_tokens[
    src_dtype: DType
](
    cache: PagedKVCache,
    keys: Ptr[src_dtype],
    values: Ptr[src_dtype],
    batch_indices: IndexPtr,
    positions: IndexPtr,
    nnz: Int,
):
    """Writes float keys and values [nnz, H, D] into an int8 pool as int8
    rows, on all cores."""
    if nnz == 0:
        return
    var heads = cache.num_kv_heads()
    var d = cache.head_dim()
    var tasks = min(nnz, 4 * num_physical_cores())

    def run_task(
        t: Int,
    ) {
        var cache,
        var keys,
        var values,
        var batch_indices,
        var positions,
        var heads,
        var d,
        var nnz,
        var tasks,
    }:
        for i in range(t * nnz // tasks, (t + 1) * nnz // tasks):
            var b = Int(batch_indices[unsafe_offset=i])
            var pos = Int(positions[unsafe_offset=i])
            if not cache.holds(b, pos):
                continue
            for h in range(heads):
                var at = (i * heads + h) * d
                store_int8_head[KV.K](cache, keys.unsafe_offset(at), b, pos, h)
                store_int8_head[KV.V](
                    cache, values.unsafe_offset(at), b, pos, h
                )

    sync_parallelize(run_task, tasks)


@extensibility.register("pagedkv_append_paged_kv_cache")
struct AppendPagedKVCache:
    """Appends into a pool passed as k_cache, v_cache [pages, kv, ...page...]
    (see cache/cache_tensors.mojo: a one-tensor pool twice, or a K, V pair).

    Parameters: `layout` (`KVLayout`'s code) and `checked`: 1 checks the
    index arrays on the host before writing and raises on a bad one; 0
    trusts them (a table the caller made) and only skips tokens without a
    slot (`PagedKVCache.holds`).
    """

    @staticmethod
    def execute[
        target: StaticString, layout: Int, checked: Int
    ](
        k_cache: MutableInputTensor[rank=5, ...],
        v_cache: MutableInputTensor[dtype=k_cache.dtype, rank=5, ...],
        append_key: InputTensor[rank=3, ...],
        append_value: InputTensor[dtype=append_key.dtype, rank=3, ...],
        batch_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        positions: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var cache = cache_from_tensors[KVLayout(layout)](
            k_cache, v_cache, kv_indices, kv_indptr, kv_last_page_len
        )
        append_paged_kv[target, checked != 0](
            cache,
            append_key,
            append_value,
            batch_indices,
            positions,
            kv_indices,
            kv_indptr,
            kv_last_page_len,
            ctx,
        )


@extensibility.register("pagedkv_append_paged_mla_kv_cache")
struct AppendPagedMLAKVCache:
    """Appends MLA's compressed KV [nnz, ckv_dim] into ckv_cache [pages, P, ckv_dim]
    and its rope part [nnz, kpe_dim] into kpe_cache [pages, P, kpe_dim]."""

    @staticmethod
    def execute[
        target: StaticString
    ](
        ckv_cache: MutableInputTensor[rank=3, ...],
        kpe_cache: MutableInputTensor[dtype=ckv_cache.dtype, rank=3, ...],
        append_ckv: InputTensor[dtype=ckv_cache.dtype, rank=2, ...],
        append_kpe: InputTensor[dtype=ckv_cache.dtype, rank=2, ...],
        batch_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        positions: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var nnz = batch_indices.dim_size(0)
        if kpe_cache.dim_size(0) != ckv_cache.dim_size(0) or kpe_cache.dim_size(
            1
        ) != ckv_cache.dim_size(1):
            raise Error(
                "pagedkv: ckv_cache and kpe_cache must have the same pages"
                " and page size"
            )
        if append_ckv.dim_size(0) != nnz or append_kpe.dim_size(0) != nnz:
            raise Error(
                "pagedkv: append_ckv and append_kpe must have one row per token"
            )
        if append_ckv.dim_size(1) != ckv_cache.dim_size(
            2
        ) or append_kpe.dim_size(1) != kpe_cache.dim_size(2):
            raise Error(
                "pagedkv: append_ckv / append_kpe widths differ from the"
                " caches'"
            )
        var batch_size = kv_last_page_len.dim_size(0)
        # Each MLA cache is a K-only, one-head NHD cache of its own width.
        comptime Cache = PagedKVCache[ckv_cache.dtype, KVLayout.NHD]
        var ckv = Cache.from_pools(
            ptr_of(ckv_cache),
            ptr_of(ckv_cache),
            ckv_cache.dim_size(0),
            ptr_of(kv_indptr),
            ptr_of(kv_indices),
            ptr_of(kv_last_page_len),
            batch_size,
            ckv_cache.dim_size(1),
            1,
            ckv_cache.dim_size(2),
        )
        var kpe = Cache.from_pools(
            ptr_of(kpe_cache),
            ptr_of(kpe_cache),
            kpe_cache.dim_size(0),
            ptr_of(kv_indptr),
            ptr_of(kv_indices),
            ptr_of(kv_last_page_len),
            batch_size,
            kpe_cache.dim_size(1),
            1,
            kpe_cache.dim_size(2),
        )
        check_append[target](
            ckv,
            batch_indices,
            positions,
            kv_indices,
            kv_indptr,
            kv_last_page_len,
            ctx,
        )
        scatter_tokens[target, KV.K, KV.K](
            ckv,
            ptr_of(append_ckv),
            kpe,
            ptr_of(append_kpe),
            ptr_of(batch_indices),
            ptr_of(positions),
            nnz,
            ctx,
        )
