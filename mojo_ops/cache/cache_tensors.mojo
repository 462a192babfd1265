"""Builds a `PagedKVCache` from an op's pool and page-table tensors.

Every op takes its pool the same way, as two rank-5 tensors
`k_cache, v_cache: [num_pages, kv, ...page...]` with a page [P, H, D] (NHD) or
[H, P, D] (HND):

- a one-tensor pool [num_pages, 2, ...page...] (kv = 2) is passed as both
  k_cache and v_cache (a graph passes the same buffer twice);
- separate K and V pools [num_pages, ...page...] are passed viewed (for free)
  as [num_pages, 1, ...page...] each (kv = 1).

So one compiled op serves both forms, and the shapes (page size, heads, head
dim) come from the pool itself: one compile serves them all.
"""

from extensibility import InputTensor, ManagedTensorSlice
from max.gpu.host import DeviceContext

from .paged_kv_cache import KVLayout, PagedKVCache, row_scale_elems
from .tensor_access import ptr_of


@always_inline
def page_dims[
    layout: KVLayout
](pool: ManagedTensorSlice[rank=5, ...]) -> Tuple[Int, Int, Int]:
    """(page_size, num_kv_heads, head_dim) of a [pages, kv, ...page...] pool
    (an int8 pool's last axis is head_dim + 4: cache/int8_rows.mojo)."""
    var a = pool.dim_size(2)
    var b = pool.dim_size(3)
    var d = pool.dim_size(4) - row_scale_elems[pool.dtype]()
    comptime if layout == KVLayout.NHD:
        return (a, b, d)
    return (b, a, d)


def cache_from_tensors[
    layout: KVLayout
](
    k_cache: ManagedTensorSlice[rank=5, ...],
    v_cache: ManagedTensorSlice[dtype=k_cache.dtype, rank=5, ...],
    kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
) raises -> PagedKVCache[k_cache.dtype, layout]:
    """Views a pool passed as (k_cache, v_cache) [pages, kv, ...page...]."""
    comptime for axis in range(5):
        if k_cache.dim_size(axis) != v_cache.dim_size(axis):
            raise Error(
                "pagedkv: k_cache and v_cache differ in shape (axis ", axis, ")"
            )
    var kv = k_cache.dim_size(1)
    if kv != 1 and kv != 2:
        raise Error(
            (
                "pagedkv: a pool is [pages, 2, ...page...] or a (K, V) pair;"
                " axis 1 has "
            ),
            kv,
            " entries",
        )
    var dims = page_dims[layout](k_cache)
    if dims[2] < 1:
        raise Error(
            (
                "pagedkv: an int8 pool's last axis is head_dim + 4 (each"
                " row's codes and a 4-byte scale); it has "
            ),
            k_cache.dim_size(4),
            " entries",
        )
    comptime Cache = PagedKVCache[k_cache.dtype, layout]
    if kv == 2:
        return Cache.from_pool(
            ptr_of(k_cache),
            k_cache.dim_size(0),
            ptr_of(kv_indptr),
            ptr_of(kv_indices),
            ptr_of(kv_last_page_len),
            kv_last_page_len.dim_size(0),
            dims[0],
            dims[1],
            dims[2],
        )
    return Cache.from_pools(
        ptr_of(k_cache),
        ptr_of(v_cache),
        k_cache.dim_size(0),
        ptr_of(kv_indptr),
        ptr_of(kv_indices),
        ptr_of(kv_last_page_len),
        kv_last_page_len.dim_size(0),
        dims[0],
        dims[1],
        dims[2],
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
