"""Unit tests of `PagedKVCache`.

Mojo 1.2 has no `mojo test`: tests/test_mojo_unit.py runs this file with
`mojo run -I .` so that the suite's pytest command covers it. Offsets are
checked against FlashInfer's pool shapes written out by hand here.
"""

from std.memory.alloc import unsafe_alloc
from std.testing import assert_equal, assert_false, assert_true

from mojo_ops.cache.paged_kv_cache import (
    DYNAMIC,
    KV,
    IndexPtr,
    KVLayout,
    PagedKVCache,
    Ptr,
)

comptime P = 4  # page size
comptime H = 3  # kv heads
comptime D = 8  # head dim
comptime NUM_PAGES = 6


def buffer[dtype: DType](n: Int) -> Ptr[dtype]:
    """Zeroed elements that live until the process ends (tests only)."""
    var p = rebind[Ptr[dtype]](unsafe_alloc[Scalar[dtype]](n))
    for i in range(n):
        p[unsafe_offset=i] = 0
    return p


def index_array(values: List[Int]) -> IndexPtr:
    var p = buffer[DType.int32](len(values))
    for i in range(len(values)):
        p[unsafe_offset=i] = Int32(values[i])
    return p


def pool_offset[
    layout: KVLayout
](page: Int, kv: Int, tok: Int, head: Int, d: Int) -> Int:
    """Offset into a one-tensor pool [pages, 2, P, H, D] (NHD) or [pages, 2, H, P, D].
    """
    comptime if layout == KVLayout.NHD:
        return (((page * 2 + kv) * P + tok) * H + head) * D + d
    return (((page * 2 + kv) * H + head) * P + tok) * D + d


struct Table:
    """Three requests of 6, 0 and 9 tokens over permuted pages."""

    var indptr: IndexPtr
    var indices: IndexPtr
    var last: IndexPtr

    def __init__(out self):
        self.indptr = index_array([0, 2, 2, 5])
        self.indices = index_array([4, 1, 0, 5, 2])
        self.last = index_array([2, 0, 1])


def check_layout[
    layout: KVLayout, P_: Int, H_: Int, D_: Int
](table: Table) raises:
    var n = NUM_PAGES * 2 * P * H * D
    var pool = buffer[DType.float32](n)
    for i in range(n):
        pool[unsafe_offset=i] = Float32(i)
    var cache = PagedKVCache[DType.float32, layout, P_, H_, D_].from_pool(
        pool, NUM_PAGES, table.indptr, table.indices, table.last, 3, P, H, D
    )
    assert_equal(cache.page_size(), P)
    assert_equal(cache.num_kv_heads(), H)
    assert_equal(cache.head_dim(), D)
    assert_equal(cache.cache_length(0), 6)
    assert_equal(cache.cache_length(1), 0)
    assert_equal(cache.cache_length(2), 9)
    assert_equal(cache.max_context_length(), 9)
    assert_false(cache.empty_cache())

    # Request 2, token 5 lives in its second page (page 5), slot 1.
    for head in range(H):
        for d in range(D):
            var k = cache.load[KV.K](2, head, 5, d)
            var v = cache.load[KV.V](2, head, 5, d)
            assert_equal(Int(k), pool_offset[layout](5, 0, 1, head, d))
            assert_equal(Int(v), pool_offset[layout](5, 1, 1, head, d))
            var row = cache.row_idx(2, 5)
            assert_equal(
                row * cache.token_stride() + cache.col_idx(head) + d,
                pool_offset[layout](5, 0, 1, head, d),
            )

    # A vector load reads head_dim-contiguous elements.
    var vec = cache.load[KV.V, 8](0, 2, 3, 0)
    for d in range(8):
        assert_equal(Int(vec[d]), pool_offset[layout](4, 1, 3, 2, d))

    # block_paged_ptr walks the tokens of one page at token_stride().
    var run = cache.block_paged_ptr[KV.K](2, 8, 1)
    assert_equal(Int(run[unsafe_offset=0]), pool_offset[layout](2, 0, 0, 1, 0))

    var run0 = cache.block_paged_ptr[KV.K](0, 0, 1)
    for t in range(P):
        assert_equal(
            Int(run0[unsafe_offset=t * cache.token_stride()]),
            pool_offset[layout](4, 0, t, 1, 0),
        )

    # store writes exactly one place, in the V half.
    cache.store[KV.V](2, 1, 8, 3, SIMD[DType.float32, 2](-1.0, -2.0))
    assert_equal(
        pool[unsafe_offset=pool_offset[layout](2, 1, 0, 1, 3)], Float32(-1.0)
    )
    assert_equal(
        pool[unsafe_offset=pool_offset[layout](2, 1, 0, 1, 4)], Float32(-2.0)
    )
    var changed = 0
    for i in range(n):
        if pool[unsafe_offset=i] != Float32(i):
            changed += 1
    assert_equal(changed, 2)


def check_separate_pools(table: Table) raises:
    var n = NUM_PAGES * P * H * D
    var k = buffer[DType.float32](n)
    var v = buffer[DType.float32](n)
    for i in range(n):
        k[unsafe_offset=i] = Float32(i)
        v[unsafe_offset=i] = Float32(-i)
    var cache = PagedKVCache[DType.float32, KVLayout.HND].from_pools(
        k, v, NUM_PAGES, table.indptr, table.indices, table.last, 3, P, H, D
    )
    # Request 0, token 2, head 1, d 5 -> page 4, slot 2 of [pages, H, P, D].
    var off = ((4 * H + 1) * P + 2) * D + 5
    assert_equal(Int(cache.load[KV.K](0, 1, 2, 5)), off)
    assert_equal(Int(cache.load[KV.V](0, 1, 2, 5)), -off)


def check_empty() raises:
    var cache = PagedKVCache[DType.float32, KVLayout.NHD].from_pool(
        buffer[DType.float32](1),
        1,
        index_array([0, 0, 0]),
        index_array([0]),
        index_array([0, 0]),
        2,
        16,
        1,
        1,
    )
    assert_true(cache.empty_cache())
    assert_equal(cache.max_context_length(), 0)


def main() raises:
    var table = Table()
    check_layout[KVLayout.NHD, DYNAMIC, DYNAMIC, DYNAMIC](table)
    check_layout[KVLayout.HND, DYNAMIC, DYNAMIC, DYNAMIC](table)
    check_layout[KVLayout.NHD, P, H, D](table)
    check_layout[KVLayout.HND, P, H, D](table)
    check_separate_pools(table)
    check_empty()
    print("test_paged_kv_cache: all passed")
