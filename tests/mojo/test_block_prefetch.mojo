"""Unit test of `BlockPrefetch.row_offset`: the rows a prefetcher asks for
are the target block's, in memory order, whether they form one run (NHD,
all of a token's heads, tokens adjacent in a page) or come from the row
table (a block across pages, a subset of heads, HND). A wrong address would
not fail any numerical test: a prefetch never faults and changes no result.
"""

from std.memory.alloc import unsafe_alloc
from std.testing import assert_equal

from mojo_ops.attention.cpu.key_chunks import BlockPrefetch, RowOffsets
from mojo_ops.cache.paged_kv_cache import Ptr

comptime HEADS = 4
comptime HEAD_DIM = 8
comptime PAGE_SIZE = 4
comptime TOKEN_ELEMS = HEADS * HEAD_DIM
comptime PAGE_ELEMS = PAGE_SIZE * TOKEN_ELEMS
comptime TOKENS = 12


def page_of(tok: Int) -> Int:
    """The request's pages, out of order: tokens 0-3 in page 5, 4-7 in page
    1, 8-11 in page 3."""
    return [5, 1, 3][tok // PAGE_SIZE]


def token_rows(nhd: Bool) -> RowOffsets:
    """Offsets of the request's TOKENS tokens at head 0, as `chunk_rows` fills
    them: NHD rows [page, token, head, dim], HND rows [page, head, token,
    dim]."""
    var rows = rebind[RowOffsets](unsafe_alloc[Int64](TOKENS, alignment=64))
    for tok in range(TOKENS):
        var page = page_of(tok)
        var slot = tok % PAGE_SIZE
        var token_stride = TOKEN_ELEMS if nhd else HEAD_DIM
        rows[unsafe_offset=tok] = Int64(page * PAGE_ELEMS + slot * token_stride)
    return rows


def check(
    name: String,
    base: Ptr[DType.float32],
    rows: RowOffsets,
    first: Int,
    count: Int,
    heads: Int,
    nhd: Bool,
    one_run: Bool,
) raises:
    """Every row_offset of the block against the row table's, and whether the
    prefetcher took the block as one run."""
    var head_stride = HEAD_DIM if nhd else PAGE_SIZE * HEAD_DIM
    var prefetcher = BlockPrefetch[DType.float32](
        base, rows, first, count, heads, head_stride, HEAD_DIM, nhd
    )
    assert_equal(prefetcher.rows_total, count * heads, name)
    assert_equal(prefetcher.run_first >= 0, one_run, name + ": one run")
    for i in range(count * heads):
        var t = i // heads if nhd else i % count
        var h = i % heads if nhd else i // count
        var want = Int(rows[unsafe_offset=first + t]) + h * head_stride
        assert_equal(prefetcher.row_offset(i), want, String(name, ", row ", i))
    assert_equal(prefetcher.disabled().rows_total, 0, name + ": disabled")
    prefetcher.fetch_all()  # addresses inside the pool: must not fault


def main() raises:
    var pool = rebind[Ptr[DType.float32]](
        unsafe_alloc[Float32](6 * PAGE_ELEMS, alignment=64)
    )
    var nhd_rows = token_rows(True)
    var hnd_rows = token_rows(False)
    check("NHD, one page, all heads", pool, nhd_rows, 0, 4, HEADS, True, True)
    check("NHD, part of a page", pool, nhd_rows, 5, 2, HEADS, True, True)
    check("NHD, two pages", pool, nhd_rows, 2, 4, HEADS, True, False)
    check("NHD, two of four heads", pool, nhd_rows, 0, 4, 2, True, False)
    check("NHD, one token", pool, nhd_rows, 9, 1, HEADS, True, True)
    check("HND, one page", pool, hnd_rows, 0, 4, HEADS, False, False)
    check("HND, two pages", pool, hnd_rows, 3, 3, HEADS, False, False)
    check("no tokens", pool, nhd_rows, 0, 0, HEADS, True, False)
    print("BlockPrefetch: 8 blocks passed")
    pool.unsafe_free()
    nhd_rows.unsafe_free()
    hnd_rows.unsafe_free()
