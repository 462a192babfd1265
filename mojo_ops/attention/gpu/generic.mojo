"""Paged attention on a GPU: the generic kernel (any NVIDIA or AMD GPU).

One thread block per (work item, KV head, tile of up to MAX_ROWS query rows
of that head: a row is one query token's head of the group). The block
stages tiles of its keys' K and V through shared memory (coalesced 16-byte
loads, widened to float32, RoPE applied there); each warp then takes every
WARPS-th key of the tile: a lane holds head_dim / 32 elements of each row's
q, a warp-wide sum gives the score, and the warp keeps its own online-softmax
state per row, masking by each row's position (causal, window). At the end
the warps' states are merged through shared memory and written, final or
partial (key-split decode items are merged by `merge_split_head`).

The Hopper kernel (sm90.mojo) is the fast path for decode on sm_90;
this one serves every other case and GPU.
"""

from std.math import cos, exp2, log2, sin
from std.sys import size_of
from std.memory import stack_allocation
from std.utils.numerics import nan, neg_inf

from max.gpu import WARP_SIZE, barrier, block_idx, lane_id, thread_idx
from max.gpu.memory import AddressSpace
from max.gpu.primitives import warp

from ...cache.paged_kv_cache import DYNAMIC, KV, KVLayout, PagedKVCache, Ptr
from ...simd.exp2 import is_nan_f32
from ..custom_mask import CustomMask
from ..params import (
    LOG2E,
    POS_ALIBI,
    POS_ROPE_LLAMA,
    AttentionParams,
    alibi_slope,
    rope_angle,
    rope_inv_freq,
)
from ..work import AttentionWork

comptime GPU_THREADS = 128
comptime WARPS = GPU_THREADS // WARP_SIZE
comptime MAX_ROWS = 8
"""Query rows per block: their q fragments and states live in registers."""
comptime TILE_ELEMS = 4096
"""Elements of K (and of V) staged per step: 32 tokens of dim 128, 16 of 256."""
comptime F32 = DType.float32


@always_inline
def row_tiles(rows: Int) -> Int:
    """Blocks per KV head for an item of `rows` query rows per head."""
    return (rows + MAX_ROWS - 1) // MAX_ROWS


def attention_gpu_kernel[
    q_dtype: DType, kv_dtype: DType, layout: KVLayout, head_dim: Int
](
    cache: PagedKVCache[kv_dtype, layout, DYNAMIC, DYNAMIC, head_dim],
    q: Ptr[q_dtype],
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    work: AttentionWork,
    params: AttentionParams,
    mask: CustomMask,
    num_qo_heads: Int64,
    tiles: Int64,
):
    """Grid (num_items, num_kv_heads * tiles), GPU_THREADS threads; tiles =
    row_tiles(most query rows per head of any item). A key is seen where
    the row's position (causal, window) and its custom mask bit allow."""
    comptime VEC = head_dim // WARP_SIZE
    comptime TILE = TILE_ELEMS // head_dim
    var qo_heads = Int(num_qo_heads)
    var kv_heads = cache.num_kv_heads()
    var group = qo_heads // kv_heads
    var item = Int(block_idx.x)
    var kv_head = Int(block_idx.y) // Int(tiles)
    var r0 = (Int(block_idx.y) % Int(tiles)) * MAX_ROWS
    var rows = min(MAX_ROWS, work.q_count(item) * group - r0)
    if rows <= 0:
        return  # this item has fewer rows than the widest one
    var b = work.request(item)
    var q_row0 = work.q_row(item)
    var q_pos0 = work.q_pos(item)
    var first = work.kv_first(item)
    var end = work.kv_end(item)
    var tid = Int(thread_idx.x)
    var lane = Int(lane_id())
    var warp_id = tid // WARP_SIZE
    var rope = params.pos_encoding == POS_ROPE_LLAMA

    # K and V tiles side by side: the warps' merge at the end parks their
    # outputs across both (WARPS * MAX_ROWS rows of head_dim, 8192 floats at
    # head_dim 256, twice one tile).
    comptime assert (
        WARPS * MAX_ROWS * head_dim <= 2 * TILE_ELEMS
    ), "the warps' outputs fit in the K/V tiles"
    comptime assert (
        2 * WARPS * MAX_ROWS <= MAX_ROWS * head_dim
    ), "the warps' (m, l) pairs fit in the query rows"
    var kv_tiles = stack_allocation[
        2 * TILE_ELEMS, F32, address_space=AddressSpace.SHARED
    ]()
    var k_tile = kv_tiles
    var v_tile = kv_tiles + TILE_ELEMS
    var q_rows = stack_allocation[
        MAX_ROWS * head_dim, F32, address_space=AddressSpace.SHARED
    ]()

    # Row r of the block is head-row r0 + r: query token (r0 + r) // group,
    # head (r0 + r) % group of the KV head's group.
    for i in range(tid, rows * head_dim, GPU_THREADS):
        var hr = r0 + i // head_dim
        var qo = kv_head * group + hr % group
        q_rows[unsafe_offset=i] = q[
            unsafe_offset=((q_row0 + hr // group) * qo_heads + qo) * head_dim
            + i % head_dim
        ].cast[F32]()
    barrier()
    if rope:
        rotate_query_rows[head_dim](
            q_rows, rows, r0, group, q_pos0, params, tid
        )
        barrier()

    var q_frag = SIMD[F32, MAX_ROWS * VEC]()
    var alibi_log2 = SIMD[F32, MAX_ROWS]()
    var row_pos = SIMD[F32, MAX_ROWS]()
    comptime for r in range(MAX_ROWS):
        if r < rows:
            comptime for e in range(VEC):
                q_frag[r * VEC + e] = (
                    q_rows[unsafe_offset=r * head_dim + lane * VEC + e]
                    * params.q_scale_log2
                )
            row_pos[r] = Float32(q_pos0 + (r0 + r) // group)
            if params.pos_encoding == POS_ALIBI:
                var qo = kv_head * group + (r0 + r) % group
                alibi_log2[r] = alibi_slope(qo, qo_heads) * LOG2E

    var m = SIMD[F32, MAX_ROWS](neg_inf[F32]())
    var l = SIMD[F32, MAX_ROWS](0)
    var o = SIMD[F32, MAX_ROWS * VEC](0)

    var t0 = first
    while t0 < end:
        var n = min(TILE, end - t0)
        stage_rows[KV.K, head_dim](cache, b, t0, n, kv_head, k_tile, tid)
        stage_rows[KV.V, head_dim](cache, b, t0, n, kv_head, v_tile, tid)
        barrier()
        if rope:
            rotate_rows_shared[head_dim](k_tile, n, params, t0, 1, tid)
            barrier()
        for j in range(warp_id, n, WARPS):
            var k_frag = SIMD[F32, VEC]()
            var v_frag = SIMD[F32, VEC]()
            comptime for e in range(VEC):
                k_frag[e] = k_tile[unsafe_offset=j * head_dim + lane * VEC + e]
                v_frag[e] = v_tile[unsafe_offset=j * head_dim + lane * VEC + e]
            comptime for r in range(MAX_ROWS):
                if r < rows:
                    var distance = Float32(t0 + j) - row_pos[r]
                    var q_row = q_row0 + (r0 + r) // group
                    if params.visible[1](
                        SIMD[F32, 1](distance),
                        SIMD[DType.bool, 1](mask.visible(q_row, t0 + j)),
                    )[0]:
                        var partial = (
                            q_frag.slice[VEC, offset=r * VEC]() * k_frag
                        ).reduce_add()
                        var raw = warp.sum(partial)
                        var s = params.finish_scores[1](
                            SIMD[F32, 1](raw),
                            alibi_log2[r],
                            SIMD[F32, 1](distance),
                        )[0]
                        var new = max(m[r], s)
                        var alpha = exp2(m[r] - new)
                        var p = exp2(s - new)
                        l[r] = l[r] * alpha + p
                        m[r] = new
                        comptime for e in range(VEC):
                            o[r * VEC + e] = (
                                o[r * VEC + e] * alpha + p * v_frag[e]
                            )
        barrier()
        t0 += n

    # Merge the warps' states: each warp parks its state in shared memory
    # (outputs in the K/V tiles, (m, l) pairs in the query rows, both done
    # with), then the block combines them per (row, element).
    var parked_o = kv_tiles
    var parked_ml = q_rows
    barrier()  # no thread still reads q_rows (an empty key range skips the loop)
    comptime for r in range(MAX_ROWS):
        if r < rows:
            comptime for e in range(VEC):
                parked_o[
                    unsafe_offset=(warp_id * MAX_ROWS + r) * head_dim
                    + lane * VEC
                    + e
                ] = o[r * VEC + e]
            if lane == 0:
                parked_ml[unsafe_offset=2 * (warp_id * MAX_ROWS + r)] = m[r]
                parked_ml[unsafe_offset=2 * (warp_id * MAX_ROWS + r) + 1] = l[r]
    barrier()
    var partial_state = work.writes_partial(b)
    for i in range(tid, rows * head_dim, GPU_THREADS):
        var r = i // head_dim
        var d = i % head_dim
        var top = neg_inf[F32]()
        comptime for w in range(WARPS):
            top = max(top, parked_ml[unsafe_offset=2 * (w * MAX_ROWS + r)])
        var total: Float32 = 0
        var acc: Float32 = 0
        if top != neg_inf[F32]():
            comptime for w in range(WARPS):
                var scale = exp2(
                    parked_ml[unsafe_offset=2 * (w * MAX_ROWS + r)] - top
                )
                total += (
                    parked_ml[unsafe_offset=2 * (w * MAX_ROWS + r) + 1] * scale
                )
                acc += (
                    parked_o[unsafe_offset=(w * MAX_ROWS + r) * head_dim + d]
                    * scale
                )
        # A warp whose l is NaN saw a NaN score: max() may have dropped its
        # m, so the NaN is carried over explicitly (NaN in, NaN out).
        comptime for w in range(WARPS):
            if is_nan_f32(parked_ml[unsafe_offset=2 * (w * MAX_ROWS + r) + 1]):
                total = nan[F32]()
        var value = acc / total * params.v_scale if total != 0 else Float32(0)
        var state_lse = top + log2(total) if total != 0 else neg_inf[F32]()
        var hr = r0 + r
        var qo = kv_head * group + hr % group
        if partial_state:
            # Key-split items hold one query (decode).
            work.partial_o[
                unsafe_offset=(item * qo_heads + qo) * head_dim + d
            ] = value
            if d == 0:
                work.partial_lse[unsafe_offset=item * qo_heads + qo] = state_lse
        else:
            var out_row = (q_row0 + hr // group) * qo_heads + qo
            output[unsafe_offset=out_row * head_dim + d] = value.cast[q_dtype]()
            if d == 0:
                lse[unsafe_offset=out_row] = state_lse


@always_inline
def rotate_query_rows[
    head_dim: Int
](
    rows: Pointer[mut=True, Float32, address_space=AddressSpace.SHARED, _],
    n: Int,
    r0: Int,
    group: Int,
    q_pos0: Int,
    params: AttentionParams,
    tid: Int,
):
    """RoPE of the block's query rows: row r is at q_pos0 + (r0 + r) // group.
    """
    comptime half = head_dim // 2
    for i in range(tid, n * half, GPU_THREADS):
        var r = i // half
        var e = i % half
        rotate_pair[head_dim](rows, r, e, q_pos0 + (r0 + r) // group, params)


@always_inline
def stage_rows[
    kv: KV, head_dim: Int
](
    cache: PagedKVCache,
    b: Int,
    t0: Int,
    n: Int,
    kv_head: Int,
    tile: Pointer[mut=True, Float32, address_space=AddressSpace.SHARED, _],
    tid: Int,
):
    """Copies tokens t0..t0+n of one head (K or V) into a float32 tile
    [n, head_dim]: each thread moves 16-byte vectors, neighbouring threads
    neighbouring vectors of a row (run_attention checked that the pools
    start on 16 bytes, so every such vector is aligned)."""
    comptime width = 16 // size_of[cache.dtype]()
    comptime per_row = head_dim // width
    for i in range(tid, n * per_row, GPU_THREADS):
        var j = i // per_row
        var d = (i % per_row) * width
        var x = (
            cache.block_paged_ptr[kv](b, t0 + j, kv_head, d)
            .unsafe_load[width=width, alignment=16]()
            .cast[F32]()
        )
        comptime for e in range(width):
            tile[unsafe_offset=j * head_dim + d + e] = x[e]


@always_inline
def rotate_rows_shared[
    head_dim: Int
](
    rows: Pointer[mut=True, Float32, address_space=AddressSpace.SHARED, _],
    n: Int,
    params: AttentionParams,
    pos0: Int,
    pos_step: Int,
    tid: Int,
):
    """RoPE (rotate-half) of n rows in shared memory; row j is at position
    pos0 + j * pos_step."""
    comptime half = head_dim // 2
    for i in range(tid, n * half, GPU_THREADS):
        var j = i // half
        rotate_pair[head_dim](rows, j, i % half, pos0 + j * pos_step, params)


@always_inline
def rotate_pair[
    head_dim: Int
](
    rows: Pointer[mut=True, Float32, address_space=AddressSpace.SHARED, _],
    j: Int,
    e: Int,
    pos: Int,
    params: AttentionParams,
):
    """Rotates elements (e, e + head_dim / 2) of row j by position pos."""
    comptime half = head_dim // 2
    var angle = rope_angle[1](
        SIMD[DType.float64, 1](rope_inv_freq(params, e, head_dim)), pos
    )[0]
    var c = cos(angle)
    var s = sin(angle)
    var lo = rows[unsafe_offset=j * head_dim + e]
    var hi = rows[unsafe_offset=j * head_dim + half + e]
    rows[unsafe_offset=j * head_dim + e] = lo * c - hi * s
    rows[unsafe_offset=j * head_dim + half + e] = hi * c + lo * s


def merge_split_gpu_kernel[
    dtype: DType, head_dim: Int
](work: AttentionWork, output: Ptr[dtype], lse: Ptr[F32], num_qo_heads: Int64,):
    """Grid (batch * num_qo_heads), GPU_THREADS threads: merges the partial
    states of one (request, query head) whose keys were split over items.

    Warp w takes items w, w + WARPS, ..: a lane holds head_dim / 32 elements
    of each in registers, so the partial rows stream in as independent
    16-byte loads rather than one dependent chain per element (a request
    split 64 ways would otherwise wait on 64 loads in a row). Every warp
    finds the states' max and sum itself; the warps' sums meet in shared
    memory."""
    comptime VEC = head_dim // WARP_SIZE
    var heads = Int(num_qo_heads)
    var b = Int(block_idx.x) // heads
    var qo = Int(block_idx.x) % heads
    if not work.writes_partial(b):
        return
    var item0 = Int(work.request_items[unsafe_offset=b])
    var count = work.items_of(b)
    var tid = Int(thread_idx.x)
    var lane = Int(lane_id())
    var warp_id = tid // WARP_SIZE
    var states = work.partial_lse.unsafe_offset(item0 * heads + qo)

    var top = neg_inf[F32]()
    var nans: Float32 = 0
    for i in range(lane, count, WARP_SIZE):
        top = max(top, states[unsafe_offset=i * heads])
        if is_nan_f32(states[unsafe_offset=i * heads]):
            nans = 1
    top = warp.max(top)
    var total: Float32 = 0
    if top != neg_inf[F32]():
        for i in range(lane, count, WARP_SIZE):
            total += exp2(states[unsafe_offset=i * heads] - top)
    total = warp.sum(total)
    # A NaN partial state makes the merge NaN (max() may have dropped it).
    if warp.max(nans) > 0:
        total = nan[F32]()

    var acc = SIMD[F32, VEC](0)
    if total != 0:
        var rows = work.partial_o.unsafe_offset(
            (item0 * heads + qo) * head_dim + lane * VEC
        )
        for i in range(warp_id, count, WARPS):
            var weight = exp2(states[unsafe_offset=i * heads] - top)
            acc += (
                weight
                * rows.unsafe_offset(i * heads * head_dim).unsafe_load[
                    width=VEC, alignment=4 * min(VEC, 4)
                ]()
            )

    var sums = stack_allocation[
        WARPS * head_dim, F32, address_space=AddressSpace.SHARED
    ]()
    comptime for e in range(VEC):
        sums[unsafe_offset=warp_id * head_dim + lane * VEC + e] = acc[e]
    barrier()
    var row = work.q_row(item0) * heads + qo
    for d in range(tid, head_dim, GPU_THREADS):
        var value: Float32 = 0
        comptime for w in range(WARPS):
            value += sums[unsafe_offset=w * head_dim + d]
        output[unsafe_offset=row * head_dim + d] = (
            value / total if total != 0 else Float32(0)
        ).cast[dtype]()
    if tid == 0:
        lse[unsafe_offset=row] = (
            top + log2(total) if total != 0 else neg_inf[F32]()
        )
