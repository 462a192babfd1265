"""Builds a `PagedKVCache` from an op's pool and page-table tensors.

A pool is one tensor [pages, 2, ...page...] or a (K, V) pair of
[pages, ...page...]; a page is [P, H, D] (NHD) or [H, P, D] (HND). Shapes come
from the pool itself, so one compiled op serves every page size, head count
and head dim.
"""

from extensibility import InputTensor, ManagedTensorSlice

from .page_table import check_page_table_tensors
from .paged_kv_cache import KVLayout, PagedKVCache
from .tensor_access import ptr_of
from max.gpu.host import DeviceContext


@always_inline
def page_dims[
    layout: KVLayout
](pool: ManagedTensorSlice, first_page_axis: Int) -> Tuple[Int, Int, Int]:
    """(page_size, num_kv_heads, head_dim) of a pool whose page axes start at
    first_page_axis."""
    var a = pool.dim_size(first_page_axis)
    var b = pool.dim_size(first_page_axis + 1)
    var d = pool.dim_size(first_page_axis + 2)
    comptime if layout == KVLayout.NHD:
        return (a, b, d)
    return (b, a, d)


def cache_from_pool[
    layout: KVLayout
](
    pool: ManagedTensorSlice[rank=5, ...],
    kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
) raises -> PagedKVCache[pool.dtype, layout]:
    """Views a one-tensor pool [pages, 2, ...page...]."""
    if pool.dim_size(1) != 2:
        raise Error(
            "pagedkv: paged_kv_cache must be [pages, 2, ...]; axis 1 has ",
            pool.dim_size(1),
            " entries",
        )
    var dims = page_dims[layout](pool, 2)
    return PagedKVCache[pool.dtype, layout].from_pool(
        ptr_of(pool),
        pool.dim_size(0),
        ptr_of(kv_indptr),
        ptr_of(kv_indices),
        ptr_of(kv_last_page_len),
        kv_last_page_len.dim_size(0),
        dims[0],
        dims[1],
        dims[2],
    )


def cache_from_pair[
    layout: KVLayout
](
    k_pool: ManagedTensorSlice[rank=4, ...],
    v_pool: ManagedTensorSlice[dtype=k_pool.dtype, rank=4, ...],
    kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
) raises -> PagedKVCache[k_pool.dtype, layout]:
    """Views separate K and V pools, each [pages, ...page...]."""
    comptime for axis in range(4):
        if k_pool.dim_size(axis) != v_pool.dim_size(axis):
            raise Error(
                "pagedkv: the K and V pools differ in shape (axis ", axis, ")"
            )
    var dims = page_dims[layout](k_pool, 1)
    return PagedKVCache[k_pool.dtype, layout].from_pools(
        ptr_of(k_pool),
        ptr_of(v_pool),
        k_pool.dim_size(0),
        ptr_of(kv_indptr),
        ptr_of(kv_indices),
        ptr_of(kv_last_page_len),
        kv_last_page_len.dim_size(0),
        dims[0],
        dims[1],
        dims[2],
    )


def cache_from_tensors[
    layout: KVLayout
](
    k_cache: ManagedTensorSlice[rank=4, ...],
    v_cache: ManagedTensorSlice[dtype=k_cache.dtype, rank=4, ...],
    interleaved: Bool,
    kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
) raises -> PagedKVCache[k_cache.dtype, layout]:
    """Views either pool form through rank-4 tensors, so that one compiled op
    serves both: separate K and V pools [pages, ...page...], or (interleaved)
    a one-tensor pool [pages, 2, ...page...] viewed as [2 * pages, ...page...]
    and passed as both k_cache and v_cache."""
    if not interleaved:
        return cache_from_pair[layout](
            k_cache, v_cache, kv_indices, kv_indptr, kv_last_page_len
        )
    var dims = page_dims[layout](k_cache, 1)
    return PagedKVCache[k_cache.dtype, layout].from_pool(
        ptr_of(k_cache),
        k_cache.dim_size(0) // 2,
        ptr_of(kv_indptr),
        ptr_of(kv_indices),
        ptr_of(kv_last_page_len),
        kv_last_page_len.dim_size(0),
        dims[0],
        dims[1],
        dims[2],
    )


def check_cache_page_table[
    target: StaticString
](
    cache: PagedKVCache,
    kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
    ctx: DeviceContext,
) raises:
    """Raises unless the cache's page table stays inside its pool."""
    check_page_table_tensors[target](
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        cache.page_size(),
        cache.num_pages,
        ctx,
    )


def check_rows(
    name: StaticString,
    rows: ManagedTensorSlice[rank=3, ...],
    nnz: Int,
    heads: Int,
    head_dim: Int,
) raises:
    """Raises unless rows is [nnz, heads, head_dim]."""
    if (
        rows.dim_size(0) != nnz
        or rows.dim_size(1) != heads
        or rows.dim_size(2) != head_dim
    ):
        raise Error(
            "pagedkv: ",
            name,
            " is [",
            rows.dim_size(0),
            ", ",
            rows.dim_size(1),
            ", ",
            rows.dim_size(2),
            "] but the cache needs [",
            nnz,
            ", ",
            heads,
            ", ",
            head_dim,
            "]",
        )
