"""The order in which the CPU task reads a chunk's K or V: block by block,
all its heads of a block before the next; heads of one or two query rows
several at a time, heads of more rows over sub-blocks; each head's rows in
tiles of 8, 4, 3, 2 and 1 (see task.mojo for the task as a whole)."""

from ...cache.paged_kv_cache import Ptr
from .accumulate import accumulate_tile
from .block_sizes import sub_block_tokens
from .key_chunks import CHUNK, BlockPrefetch, RowOffsets
from .scores import score_tile
from .step_sizes import paired_heads, v_heads
from .task_state import TaskState


@always_inline
def tile_rows[
    kv_dtype: DType,
    scoring: Bool,
    tile: Int,
    heads: Int = 1,
    raw_q: Bool = False,
](
    head_dim: Int,
    state: TaskState,
    r: Int,
    kv: Ptr[kv_dtype],
    head_stride: Int,
    rows: RowOffsets,
    j0: Int,
    j1: Int,
    prefetcher: BlockPrefetch,
):
    """Tokens j0..j1 for the task's rows r.. of `heads` adjacent KV heads of
    `tile` rows each (head hh's rows at kv + hh * head_stride): their
    scores (scoring, kv is K) or V folded into them (kv is V)."""
    comptime if scoring:
        score_tile[tile, kv_dtype, heads, raw_q](
            head_dim,
            state.q.unsafe_offset(r * head_dim),
            kv,
            head_stride,
            rows,
            j0,
            j1,
            state.scores.unsafe_offset(r * CHUNK),
            prefetcher,
        )
    else:
        accumulate_tile[tile, kv_dtype, heads](
            head_dim,
            state.scores.unsafe_offset(r * CHUNK),
            kv,
            head_stride,
            rows,
            j0,
            j1,
            state.acc.unsafe_offset(r * head_dim),
            prefetcher,
        )


def row_tile(i: Int) -> Int:
    """The i-th tile of rows `walk_rows` tries, i < 5: 8, 4, 3, 2, 1."""
    return 8 >> i if i < 2 else 5 - i


@always_inline
def walk_rows[
    kv_dtype: DType, scoring: Bool, raw_q: Bool = False
](
    head_dim: Int,
    state: TaskState,
    r0: Int,
    count: Int,
    kv: Ptr[kv_dtype],
    rows: RowOffsets,
    j0: Int,
    j1: Int,
    prefetcher: BlockPrefetch,
):
    """`tile_rows` over the task's rows r0..r0+count of one KV head, in tiles
    of 8, 4, 3, 2 and 1; the first tile drives the prefetcher. A tile reads
    each K and V row once for all its rows: the tile of 3 takes a GQA
    group of 3 (or the rest of 7 after 4) in one pass, where 2 and 1 would
    read and widen each row twice."""
    var r = r0
    var prefetching = prefetcher
    while r < r0 + count:
        var left = r0 + count - r
        var taken = False
        comptime for i in range(5):
            comptime tile = row_tile(i)
            if not taken and left >= tile:
                tile_rows[kv_dtype, scoring, tile, raw_q=raw_q](
                    head_dim, state, r, kv, 0, rows, j0, j1, prefetching
                )
                r += tile
                taken = True
        prefetching = prefetcher.disabled()


@always_inline
def walk_heads[
    kv_dtype: DType, scoring: Bool, raw_q: Bool = False
](
    head_dim: Int,
    state: TaskState,
    heads: Int,
    head_rows: Int,
    kv: Ptr[kv_dtype],
    head_stride: Int,
    rows: RowOffsets,
    j0: Int,
    j1: Int,
    target: BlockPrefetch,
):
    """`tile_rows` over all the task's `heads` KV heads of head_rows query
    rows each (head h's rows at kv + h * head_stride); target: the block to
    prefetch meanwhile. Heads of one or two rows go `paired_heads` (or half
    as many) at a time, the V of heads of one row `v_heads` at a time."""
    comptime P = paired_heads[kv_dtype]()
    var h = 0
    if head_rows == 1:
        comptime together = P if scoring else v_heads[kv_dtype]()
        while h + together <= heads:
            tile_rows[kv_dtype, scoring, 1, together, raw_q](
                head_dim,
                state,
                h,
                kv.unsafe_offset(h * head_stride),
                head_stride,
                rows,
                j0,
                j1,
                target.for_head(h, j0, j1 - j0),
            )
            h += together
    elif head_rows == 2:
        while h + P // 2 <= heads:
            tile_rows[kv_dtype, scoring, 2, P // 2, raw_q](
                head_dim,
                state,
                2 * h,
                kv.unsafe_offset(h * head_stride),
                head_stride,
                rows,
                j0,
                j1,
                target.for_head(h, j0, j1 - j0),
            )
            h += P // 2
    # The other heads one by one; heads of three or more rows over
    # sub-blocks of the block's tokens, every head of a sub-block before the
    # next (see `sub_block_tokens`).
    var sub = j1 - j0
    if head_rows > 2 and heads > 1:
        sub = sub_block_tokens[kv_dtype](heads, head_dim)
    var s0 = j0
    while s0 < j1:
        var s1 = min(s0 + sub, j1)
        for hh in range(h, heads):
            walk_rows[kv_dtype, scoring, raw_q](
                head_dim,
                state,
                hh * head_rows,
                head_rows,
                kv.unsafe_offset(hh * head_stride),
                rows,
                s0,
                s1,
                target.for_sub_block(hh, heads, j0, s0, s1 - s0),
            )
        s0 = s1


@always_inline
def walk_blocks[
    kv_dtype: DType, scoring: Bool, raw_q: Bool = False
](
    head_dim: Int,
    state: TaskState,
    heads: Int,
    head_rows: Int,
    kv: Ptr[kv_dtype],
    head_stride: Int,
    rows: RowOffsets,
    n: Int,
    block: Int,
    ahead_max: Int,
    nhd: Bool,
    after: BlockPrefetch[kv_dtype],
):
    """`walk_heads` over a chunk's n tokens, K (scoring) or V, in blocks of
    `block` tokens: all the task's heads of a block before the next. While a
    block is read the next one is prefetched (at most ahead_max tokens of
    it); while the last is read, `after` (the chunk's first V block after
    K, the next chunk's first K block after V)."""
    var jb = 0
    while jb < n:
        var je = min(jb + block, n)
        var target = (
            BlockPrefetch[kv_dtype](
                kv,
                rows,
                je,
                min(ahead_max, n - je),
                heads,
                head_stride,
                head_dim,
                nhd,
            ) if je
            < n else after
        )
        walk_heads[scoring=scoring, raw_q=raw_q](
            head_dim,
            state,
            heads,
            head_rows,
            kv,
            head_stride,
            rows,
            jb,
            je,
            target,
        )
        jb = je
