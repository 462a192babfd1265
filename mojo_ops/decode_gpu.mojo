"""Decode attention on a GPU: the generic kernel (any NVIDIA or AMD GPU).

One thread block per (work item, KV head, tile of up to MAX_GROUP query
heads of that head's group). The block stages tiles of its tokens' K and V
through shared memory (coalesced 16-byte loads, widened to float32, RoPE
applied there); each warp then takes every WARPS-th token of the tile: a lane
holds head_dim / 32 elements of q for each query head, a warp-wide sum gives
the score, and the warp keeps its own online-softmax state. At the end the
warps' states are merged through shared memory and written, final or
partial (split requests are merged by `merge_split_request` afterwards).

The Hopper kernel (decode_sm90.mojo) is the fast path on sm_90; this one
serves every other GPU and is the reference the fast path is checked against.
"""

from std.math import cos, exp2, log2, sin
from std.sys import size_of
from std.memory import stack_allocation
from std.utils.numerics import neg_inf

from max.gpu import WARP_SIZE, barrier, block_idx, lane_id, thread_idx
from max.gpu.memory import AddressSpace
from max.gpu.primitives import warp

from .attention_params import (
    LOG2E,
    POS_ALIBI,
    POS_ROPE_LLAMA,
    AttentionParams,
    alibi_slope,
    rope_angle,
    rope_inv_freq,
)
from .decode_work import DecodeWork
from .paged_kv_cache import DYNAMIC, KV, KVLayout, PagedKVCache, Ptr

comptime GPU_THREADS = 128
comptime WARPS = GPU_THREADS // WARP_SIZE
comptime MAX_GROUP = 8
"""Query heads per block: their q fragments and states live in registers."""
comptime TILE_ELEMS = 4096
"""Elements of K (and of V) staged per step: 32 tokens of dim 128, 16 of 256."""
comptime F32 = DType.float32


@always_inline
def group_tiles(group: Int) -> Int:
    return (group + MAX_GROUP - 1) // MAX_GROUP


def decode_gpu_kernel[
    q_dtype: DType, kv_dtype: DType, layout: KVLayout, head_dim: Int
](
    cache: PagedKVCache[kv_dtype, layout, DYNAMIC, DYNAMIC, head_dim],
    q: Ptr[q_dtype],
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    work: DecodeWork,
    params: AttentionParams,
    num_qo_heads: Int64,
):
    """Grid (num_items, num_kv_heads * group_tiles(group)), GPU_THREADS threads.
    """
    comptime VEC = head_dim // WARP_SIZE
    comptime TILE = TILE_ELEMS // head_dim
    var qo_heads = Int(num_qo_heads)
    var kv_heads = cache.num_kv_heads()
    var group = qo_heads // kv_heads
    var tiles = group_tiles(group)
    var item = Int(block_idx.x)
    var kv_head = Int(block_idx.y) // tiles
    var g0 = (Int(block_idx.y) % tiles) * MAX_GROUP
    var heads = min(MAX_GROUP, group - g0)
    var qo0 = kv_head * group + g0
    var b = work.request(item)
    var q_pos = cache.cache_length(b) - 1
    var first = max(work.first(item), params.first_visible(q_pos))
    var end = work.end(item)
    var tid = Int(thread_idx.x)
    var lane = Int(lane_id())
    var warp_id = tid // WARP_SIZE
    var rope = params.pos_encoding == POS_ROPE_LLAMA

    var k_tile = stack_allocation[
        TILE_ELEMS, F32, address_space=AddressSpace.SHARED
    ]()
    var v_tile = stack_allocation[
        TILE_ELEMS, F32, address_space=AddressSpace.SHARED
    ]()
    var q_rows = stack_allocation[
        MAX_GROUP * head_dim, F32, address_space=AddressSpace.SHARED
    ]()

    # q rows of this block's heads, rotated in shared memory when RoPE is on.
    for i in range(tid, heads * head_dim, GPU_THREADS):
        var g = i // head_dim
        q_rows[unsafe_offset=i] = q[
            unsafe_offset=(b * qo_heads + qo0 + g) * head_dim + i % head_dim
        ].cast[F32]()
    barrier()
    if rope:
        rotate_rows_shared[head_dim](q_rows, heads, params, q_pos, 0, tid)
        barrier()

    var q_frag = SIMD[F32, MAX_GROUP * VEC]()
    var alibi_log2 = SIMD[F32, MAX_GROUP]()
    comptime for g in range(MAX_GROUP):
        if g < heads:
            comptime for e in range(VEC):
                q_frag[g * VEC + e] = (
                    q_rows[unsafe_offset=g * head_dim + lane * VEC + e]
                    * params.q_scale_log2
                )
            if params.pos_encoding == POS_ALIBI:
                alibi_log2[g] = alibi_slope(qo0 + g, qo_heads) * LOG2E

    var m = SIMD[F32, MAX_GROUP](neg_inf[F32]())
    var l = SIMD[F32, MAX_GROUP](0)
    var o = SIMD[F32, MAX_GROUP * VEC](0)

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
            var distance = Float32(t0 + j - q_pos)
            comptime for g in range(MAX_GROUP):
                if g < heads:
                    var partial = (
                        q_frag.slice[VEC, offset=g * VEC]() * k_frag
                    ).reduce_add()
                    var raw = warp.sum(partial)
                    var s = params.finish_scores[1](
                        SIMD[F32, 1](raw), alibi_log2[g], SIMD[F32, 1](distance)
                    )[0]
                    var new = max(m[g], s)
                    var alpha = exp2(m[g] - new)
                    var p = exp2(s - new)
                    l[g] = l[g] * alpha + p
                    m[g] = new
                    comptime for e in range(VEC):
                        o[g * VEC + e] = o[g * VEC + e] * alpha + p * v_frag[e]
        barrier()
        t0 += n

    # Merge the warps' states: each warp parks its state in shared memory
    # (the K tile's space), then the block combines them per (head, element).
    var parked_o = k_tile
    var parked_ml = v_tile
    comptime for g in range(MAX_GROUP):
        if g < heads:
            comptime for e in range(VEC):
                parked_o[
                    unsafe_offset=(warp_id * MAX_GROUP + g) * head_dim
                    + lane * VEC
                    + e
                ] = o[g * VEC + e]
            if lane == 0:
                parked_ml[unsafe_offset=2 * (warp_id * MAX_GROUP + g)] = m[g]
                parked_ml[unsafe_offset=2 * (warp_id * MAX_GROUP + g) + 1] = l[
                    g
                ]
    barrier()
    var split = work.is_split(b)
    for i in range(tid, heads * head_dim, GPU_THREADS):
        var g = i // head_dim
        var d = i % head_dim
        var top = neg_inf[F32]()
        comptime for w in range(WARPS):
            top = max(top, parked_ml[unsafe_offset=2 * (w * MAX_GROUP + g)])
        var total: Float32 = 0
        var acc: Float32 = 0
        if top != neg_inf[F32]():
            comptime for w in range(WARPS):
                var scale = exp2(
                    parked_ml[unsafe_offset=2 * (w * MAX_GROUP + g)] - top
                )
                total += (
                    parked_ml[unsafe_offset=2 * (w * MAX_GROUP + g) + 1] * scale
                )
                acc += (
                    parked_o[unsafe_offset=(w * MAX_GROUP + g) * head_dim + d]
                    * scale
                )
        var value = acc / total * params.v_scale if total > 0 else Float32(0)
        var state_lse = top + log2(total) if total > 0 else neg_inf[F32]()
        var qo = qo0 + g
        if split:
            work.partial_o[
                unsafe_offset=(item * qo_heads + qo) * head_dim + d
            ] = value
            if d == 0:
                work.partial_lse[unsafe_offset=item * qo_heads + qo] = state_lse
        else:
            output[
                unsafe_offset=(b * qo_heads + qo) * head_dim + d
            ] = value.cast[q_dtype]()
            if d == 0:
                lse[unsafe_offset=b * qo_heads + qo] = state_lse


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
    neighbouring vectors of a row."""
    comptime width = 16 // size_of[cache.dtype]()
    comptime per_row = head_dim // width
    for i in range(tid, n * per_row, GPU_THREADS):
        var j = i // per_row
        var d = (i % per_row) * width
        var x = (
            cache.block_paged_ptr[kv](b, t0 + j, kv_head, d)
            .unsafe_load[width=width]()
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
        var e = i % half
        var angle = rope_angle[1](
            SIMD[DType.float64, 1](rope_inv_freq(params, e, head_dim)),
            pos0 + j * pos_step,
        )[0]
        var c = cos(angle)
        var s = sin(angle)
        var lo = rows[unsafe_offset=j * head_dim + e]
        var hi = rows[unsafe_offset=j * head_dim + half + e]
        rows[unsafe_offset=j * head_dim + e] = lo * c - hi * s
        rows[unsafe_offset=j * head_dim + half + e] = hi * c + lo * s
