"""Moving one token's [num_kv_heads, head_dim] row between a dense array and
its slot in the pages: the inner step of append (rows -> cache) and of gather
(cache -> rows), on the CPU and in GPU threads alike.
"""

from std.sys import size_of

from .paged_kv_cache import KV, KVLayout, PagedKVCache, Ptr


@always_inline
def copy_run[
    dtype: DType, width: Int, alignment: Int = 1
](dst: Ptr[dtype], src: Ptr[dtype], n: Int, first: Int, step: Int):
    """Copies n elements; this worker moves vectors first, first + step, ...

    On the CPU (first=0, step=1) that is the whole run; GPU threads pass their
    index and the block size, so neighbouring threads move neighbouring
    vectors. A scalar tail covers n % width.
    """
    var vectors = n // width
    var v = first
    while v < vectors:
        dst.unsafe_offset(v * width).unsafe_store[alignment=alignment](
            src.unsafe_offset(v * width).unsafe_load[
                width=width, alignment=alignment
            ]()
        )
        v += step
    var i = vectors * width + first
    while i < n:
        dst[unsafe_offset=i] = src[unsafe_offset=i]
        i += step


@always_inline
def copy_run_aligned[
    dtype: DType, width: Int
](dst: Ptr[dtype], src: Ptr[dtype], n: Int, first: Int, step: Int):
    """`copy_run` with whole, aligned vectors where both runs start on a
    vector boundary and hold whole vectors (a GPU splits a vector access it
    cannot prove aligned into scalar ones), element by element otherwise."""
    comptime vector_bytes = width * size_of[dtype]()
    if (
        n % width == 0
        and Int(dst) % vector_bytes == 0
        and Int(src) % vector_bytes == 0
    ):
        copy_run[dtype, width, vector_bytes](dst, src, n, first, step)
    else:
        copy_run[dtype, 1](dst, src, n, first, step)


@always_inline
def move_token[
    kv: KV, width: Int, to_cache: Bool
](
    cache: PagedKVCache,
    rows: Ptr[cache.dtype],
    row: Int,
    b: Int,
    pos: Int,
    first: Int,
    step: Int,
):
    """Copies rows[row] ([num_kv_heads, head_dim]) into the K or V slot of
    (request b, position pos) when to_cache, else the slot into rows[row]."""
    var heads = cache.num_kv_heads()
    var d = cache.head_dim()
    var dense = rows.unsafe_offset(row * heads * d)
    comptime if cache.layout == KVLayout.NHD:
        # A token's heads are adjacent in an NHD page: one run of heads * d.
        var slot = cache.block_paged_ptr[kv](b, pos, 0)
        comptime if to_cache:
            copy_run_aligned[cache.dtype, width](
                slot, dense, heads * d, first, step
            )
        else:
            copy_run_aligned[cache.dtype, width](
                dense, slot, heads * d, first, step
            )
    else:
        for h in range(heads):
            var slot = cache.block_paged_ptr[kv](b, pos, h)
            comptime if to_cache:
                copy_run_aligned[cache.dtype, width](
                    slot, dense.unsafe_offset(h * d), d, first, step
                )
            else:
                copy_run_aligned[cache.dtype, width](
                    dense.unsafe_offset(h * d), slot, d, first, step
                )
