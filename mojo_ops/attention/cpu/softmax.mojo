"""The CPU task's base-2 online softmax over one chunk's scores, with the
rows' masks (causal, window, a custom mask) and NaN kept as data (see task.mojo for the
task as a whole)."""

from std.memory import stack_allocation
from std.utils.numerics import nan, neg_inf

from ...cache.paged_kv_cache import IndexPtr, Ptr
from ...simd.exp2 import exp2_f32, nan_lanes
from ...simd.lane_reduce import reduce_many
from ...simd.widen import F32, W
from ..custom_mask import CustomMask
from ..params import POS_ALIBI, AttentionParams
from .key_chunks import CHUNK
from .task_state import TaskState


@always_inline
def softmax_tile[
    tile: Int, whole: Bool = False
](
    head_dim: Int,
    params: AttentionParams,
    mask: CustomMask,
    scores: Ptr[F32],
    n: Int,
    kv_pos0: Int,
    row_pos: Ptr[F32],
    mask_bit: IndexPtr,
    alibi_log2: Ptr[F32],
    m: Ptr[F32],
    l: Ptr[F32],
    acc: Ptr[F32],
):
    """Online softmax over one chunk: scores become probabilities relative to
    the running max m, and l and acc are rescaled when m grows.

    kv_pos0: position of the chunk's first key; row_pos[g]: the position of
    row g's query; mask_bit[g]: its custom mask row (when mask.enabled).
    Keys a row may not see (past the chunk's end, after the query when
    causal, before its window, masked out) get no weight. The tile's rows go
    through each step together, without branches, so that their reductions
    and exponentials overlap instead of forming one long chain per row.
    With `whole` (`sees_whole_chunk`), every row sees all CHUNK keys and
    the scores are final as they are: the masks and the score function
    are skipped.
    """
    comptime vectors = CHUNK // W
    var iota = SIMD[F32, W]()
    comptime for i in range(W):
        iota[i] = Float32(i)
    var tops = stack_allocation[tile, SIMD[F32, W]]()
    # NaN is data, not a mask: a visible NaN score (from q, k or q_scale)
    # makes its row's l NaN for good, so the row ends NaN. One compare per
    # vector here; the exp2 clamp below would turn NaN into a finite weight.
    var nans = SIMD[DType.bool, tile](fill=False)
    comptime for g in range(tile):
        var row = scores.unsafe_offset(g * CHUNK)
        var top = SIMD[F32, W](neg_inf[F32]())
        var nan_seen = SIMD[DType.bool, W](fill=False)
        comptime for c in range(vectors):
            var s = row.unsafe_offset(c * W).unsafe_load[width=W]()
            comptime if not whole:
                var distance = (
                    iota + Float32(kv_pos0 + c * W) - row_pos[unsafe_offset=g]
                )
                s = params.finish_scores(
                    s, alibi_log2[unsafe_offset=g], distance
                )
                var seen = params.visible(distance, iota.lt(Float32(n - c * W)))
                if mask.enabled:
                    seen = seen & mask.lanes[W](
                        Int(mask_bit[unsafe_offset=g]) + kv_pos0 + c * W
                    )
                s = seen.select(s, neg_inf[F32]())
                row.unsafe_offset(c * W).unsafe_store(s)
            top = max(top, s)
            nan_seen = nan_seen | nan_lanes(s)
        tops[unsafe_offset=g] = top
        nans[g] = nan_seen.reduce_or()
    var old = m.unsafe_load[width=tile]()
    var new = max(old, reduce_many[tile, is_max=True](tops))
    # A row that has seen nothing yet keeps m = -inf: exponents relative to 0
    # give its scores (all -inf) no weight, and its state stays zero.
    var base = new.eq(neg_inf[F32]()).select(SIMD[F32, tile](0), new)
    var alpha = exp2_f32[tile](old - base)
    var totals = stack_allocation[tile, SIMD[F32, W]]()
    comptime for g in range(tile):
        var row = scores.unsafe_offset(g * CHUNK)
        var total = SIMD[F32, W](0)
        comptime for c in range(vectors):
            var p = exp2_f32[W](
                row.unsafe_offset(c * W).unsafe_load[width=W]() - base[g]
            )
            row.unsafe_offset(c * W).unsafe_store(p)
            total += p
        totals[unsafe_offset=g] = total
    l.unsafe_store(
        nans.select(
            SIMD[F32, tile](nan[F32]()),
            l.unsafe_load[width=tile]() * alpha + reduce_many[tile](totals),
        )
    )
    m.unsafe_store(new)
    comptime for g in range(tile):
        if alpha[g] != 1:
            for c in range(head_dim // W):
                var a = acc.unsafe_offset(g * head_dim + c * W)
                a.unsafe_store(a.unsafe_load[width=W]() * alpha[g])


@always_inline
def sees_whole_chunk(
    params: AttentionParams,
    mask: CustomMask,
    state: TaskState,
    count: Int,
    n: Int,
    kv_pos0: Int,
) -> Bool:
    """Whether each of the count rows sees every key of a full chunk from
    kv_pos0 with its score as it is: no custom mask, soft cap or ALiBi,
    each row's query at or past the chunk's last key (or no causal mask)
    and its window (if any) reaching back to the chunk's first key."""
    if n != CHUNK or mask.enabled:
        return False
    if params.has_soft_cap() or params.pos_encoding == POS_ALIBI:
        return False
    var window = params.window_left >= 0
    if not params.causal and not window:
        return True
    var last = Float32(kv_pos0 + CHUNK - 1)
    # A row sees key j when j - pos >= -window_left (`AttentionParams.visible`).
    var reach = Float32(kv_pos0 + params.window_left)
    for r in range(count):
        var pos = state.row_pos[unsafe_offset=r]
        if params.causal and pos < last:
            return False
        if window and pos > reach:
            return False
    return True


@always_inline
def softmax_rows(
    head_dim: Int,
    params: AttentionParams,
    mask: CustomMask,
    state: TaskState,
    count: Int,
    n: Int,
    kv_pos0: Int,
):
    """The online softmax step of one chunk of n keys from kv_pos0 for all
    the task's count query rows, in tiles of 8, 4, 2 and 1."""
    if sees_whole_chunk(params, mask, state, count, n, kv_pos0):
        softmax_tiles[whole=True](
            head_dim, params, mask, state, count, n, kv_pos0
        )
    else:
        softmax_tiles[whole=False](
            head_dim, params, mask, state, count, n, kv_pos0
        )


@always_inline
def softmax_tiles[
    whole: Bool
](
    head_dim: Int,
    params: AttentionParams,
    mask: CustomMask,
    state: TaskState,
    count: Int,
    n: Int,
    kv_pos0: Int,
):
    """`softmax_tile[whole]` over the count rows, in tiles of 8, 4, 2 and 1."""
    var r = 0
    while r < count:
        var left = count - r
        var taken = False
        comptime for i in range(4):
            comptime tile = 8 >> i
            if not taken and left >= tile:
                softmax_tile[tile, whole](
                    head_dim,
                    params,
                    mask,
                    state.scores.unsafe_offset(r * CHUNK),
                    n,
                    kv_pos0,
                    state.row_pos.unsafe_offset(r),
                    state.mask_bit.unsafe_offset(r),
                    state.alibi_log2.unsafe_offset(r),
                    state.m.unsafe_offset(r),
                    state.l.unsafe_offset(r),
                    state.acc.unsafe_offset(r * head_dim),
                )
                r += tile
                taken = True
