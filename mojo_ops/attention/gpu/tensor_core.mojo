"""Decode attention on tensor cores (sm_90): q.K and p.V as mma.sync.

The Hopper kernel's producer (sm90.mojo) fills a ring of K/V stages by TMA,
here 64 tokens a stage; four consumer warps each take 16 tokens of a stage
and run them through `mma.sync.m16n8k16` in bfloat16 or float16 with float32
accumulators:

- S = Q K^T: Q's rows are the KV head's group of query heads (padded to
  M_TILE = 8 or 16 rows; the padding rows are zero and never read back),
  loaded once into A fragments; K's token rows come straight from the
  swizzled stage by `ld_matrix` as B fragments (a B operand is stored
  N x K, which is K's token-major layout);
- the online softmax runs on the accumulators: a lane holds two rows (g and
  g + 8) and four tokens of each, the quad of lanes sharing a row reduces
  its max with two shuffles, and the row sums stay per lane until the end;
- O += P V: the score accumulators of two token tiles are, in order, the A
  fragment of P (FlashAttention-2's register reuse), and V's rows come by
  `ld_matrix.trans`.

Each warp keeps its own state over its share of every stage; the four states
merge through shared memory at the end and are written as the other decode
kernels write them (a key-split item's partial state for merge_split_head).
A stage's rows outside the item's keys [first, end) may hold anything (an
unwritten slot of a last page, NaN included): their scores are masked and
their V rows zeroed before P V, as 0 x NaN would poison the product.

At up to 16 query heads per KV head a decode step does 16 FLOPs per K/V byte
on tensor cores, a few per cent of their rate: the kernel is paced by HBM
and by the softmax, not by arithmetic.
"""

from std.math import ceildiv, exp2, log2
from std.memory import stack_allocation
from std.sys import size_of
from std.utils import StaticTuple
from std.utils.numerics import nan, neg_inf

from max.gpu import (
    MAX_THREADS_PER_BLOCK_METADATA,
    WARP_SIZE,
    barrier,
    block_idx,
    lane_id,
    thread_idx,
)
from max.gpu.compute.mma import ld_matrix, mma
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.memory import (
    AddressSpace,
    external_memory,
    fence_async_view_proxy,
    fence_mbarrier_init,
)
from max.gpu.primitives import warp
from max.gpu.sync import named_barrier, syncwarp
from layout.tma_async import SharedMemBarrier

from ...cache.paged_kv_cache import (
    DYNAMIC,
    KV,
    KVLayout,
    KVTile,
    PagedKVCache,
    Ptr,
)
from ...simd.exp2 import is_nan_f32
from ..params import (
    LOG2E,
    POS_ALIBI,
    POS_NONE,
    AttentionParams,
    alibi_slope,
)
from ..work import AttentionWork
from .sm90 import (
    BOX_ROWS,
    CONSUMERS,
    SM90_THREADS,
    SWIZZLE,
    Sm90Shape,
    produce_stages,
)

comptime STAGE_TOKENS = 64
"""Tokens per pipeline stage: 16 per consumer warp."""
comptime WARP_TOKENS = 16
comptime CONSUMER_WARPS = CONSUMERS // WARP_SIZE
comptime TC_HEAD_DIMS = (64, 128)
"""Head dims of the kernel: a lane keeps head_dim / 2 float32 of O and
head_dim / 8 registers of Q."""
comptime TC_M_TILES = (8, 16)
"""Compiled row tiles: groups of up to 8 query heads use the mma's rows
0-7 only (rows 8-15 are padding the softmax skips), 9-16 all 16."""
comptime RING_BYTES = 96 * 1024
"""Shared memory for the stage ring: three 64-token stages at head_dim 128."""
comptime F32 = DType.float32


@always_inline
def m_tile(group: Int) -> Int:
    """The compiled row tile that runs `group` query heads per KV head, or 0
    when the group is too wide for this kernel."""
    comptime for i in range(len(TC_M_TILES)):
        if group <= TC_M_TILES[i]:
            return TC_M_TILES[i]
    return 0


struct TensorCoreShape[dtype: DType, head_dim: Int]:
    """Compile-time geometry of the tensor-core kernel."""

    comptime Stage = Sm90Shape[Self.dtype, Self.head_dim, 8, STAGE_TOKENS]
    """The ring's layout, shared with the Hopper kernel's producer (its group
    parameter only sizes the CUDA-core consumers, unused here)."""
    comptime STAGES = min(max(RING_BYTES // Self.Stage.STAGE_BYTES, 2), 4)
    comptime SMEM_BYTES = Self.STAGES * Self.Stage.STAGE_BYTES
    comptime K_STEPS = Self.head_dim // 16
    """mma k-steps over the head dim (q.k) and column pairs of n-tiles (p.v)."""
    comptime O_TILES = Self.head_dim // 8
    """n-tiles of O's columns."""


def tensor_core_dtypes[q_dtype: DType, kv_dtype: DType]() -> Bool:
    """Whether the kernel is built for these dtypes: one 16-bit float type
    for q and the cache (the mma's operands)."""
    return q_dtype == kv_dtype and (
        q_dtype == DType.bfloat16 or q_dtype == DType.float16
    )


def tensor_core_decode_applies[
    q_dtype: DType, kv_dtype: DType, layout: KVLayout
](cache: PagedKVCache, group: Int, params: AttentionParams) -> Bool:
    """Whether decode_tensor_core_kernel serves this batch: an NHD pool of
    q's 16-bit float type, pages a multiple of BOX_ROWS, no RoPE on the
    fly, a head dim of TC_HEAD_DIMS and at most 16 query heads per KV head.
    """
    comptime if layout != KVLayout.NHD or not tensor_core_dtypes[
        q_dtype, kv_dtype
    ]():
        return False
    if cache.num_pages == 0 or cache.page_size() % BOX_ROWS != 0:
        return False
    if params.pos_encoding != POS_NONE and params.pos_encoding != POS_ALIBI:
        return False
    if m_tile(group) == 0:
        return False
    var d = cache.head_dim()
    comptime for i in range(len(TC_HEAD_DIMS)):
        if d == TC_HEAD_DIMS[i]:
            return True
    return False


def launch_decode_tensor_core[
    q_dtype: DType, kv_dtype: DType
](
    cache: PagedKVCache[kv_dtype, KVLayout.NHD, ...],
    q: Ptr[q_dtype],
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    work: AttentionWork,
    params: AttentionParams,
    num_qo_heads: Int,
    ctx: DeviceContext,
) raises:
    """Enqueues decode_tensor_core_kernel on a batch that
    `tensor_core_decode_applies` to."""
    comptime assert q_dtype == kv_dtype, "q and the cache share a dtype"
    var tile = m_tile(num_qo_heads // cache.num_kv_heads())
    comptime for i in range(len(TC_M_TILES)):
        comptime M = TC_M_TILES[i]
        comptime for j in range(len(TC_HEAD_DIMS)):
            comptime D = TC_HEAD_DIMS[j]
            comptime Shape = TensorCoreShape[kv_dtype, D]
            if tile == M and cache.head_dim() == D:
                var fixed = cache.specialized[DYNAMIC, DYNAMIC, D]()
                var k_tma = fixed.create_tma_tile[
                    KV.K, BOX_ROWS, Shape.Stage.CHUNK, SWIZZLE
                ](ctx)
                var v_tma = fixed.create_tma_tile[
                    KV.V, BOX_ROWS, Shape.Stage.CHUNK, SWIZZLE
                ](ctx)
                ctx.enqueue_function[decode_tensor_core_kernel[kv_dtype, D, M]](
                    k_tma,
                    v_tma,
                    fixed,
                    rebind[Ptr[kv_dtype]](q),
                    rebind[Ptr[kv_dtype]](output),
                    lse,
                    work,
                    params,
                    Int64(num_qo_heads),
                    grid_dim=(work.num_items, fixed.num_kv_heads()),
                    block_dim=SM90_THREADS,
                    shared_mem_bytes=Shape.SMEM_BYTES,
                    func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(
                        UInt32(Shape.SMEM_BYTES)
                    ),
                )
                return
    raise Error("pagedkv: no tensor-core decode kernel for this batch")


@always_inline
def quad_max(x: Float32) -> Float32:
    """The max over the four lanes that share an mma row (lanes 4g .. 4g+3)."""
    var m = max(x, warp.shuffle_xor(x, UInt32(1)))
    return max(m, warp.shuffle_xor(m, UInt32(2)))


@always_inline
def quad_sum(x: Float32) -> Float32:
    """The sum over the four lanes that share an mma row."""
    var s = x + warp.shuffle_xor(x, UInt32(1))
    return s + warp.shuffle_xor(s, UInt32(2))


@__llvm_arg_metadata(k_tma, `nvvm.grid_constant`)
@__llvm_arg_metadata(v_tma, `nvvm.grid_constant`)
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(SM90_THREADS)),
)
def decode_tensor_core_kernel[
    dtype: DType, head_dim: Int, rows: Int
](
    k_tma: KVTile[
        dtype, BOX_ROWS, TensorCoreShape[dtype, head_dim].Stage.CHUNK
    ],
    v_tma: KVTile[
        dtype, BOX_ROWS, TensorCoreShape[dtype, head_dim].Stage.CHUNK
    ],
    cache: PagedKVCache[dtype, KVLayout.NHD, DYNAMIC, DYNAMIC, head_dim],
    q: Ptr[dtype],
    output: Ptr[dtype],
    lse: Ptr[F32],
    work: AttentionWork,
    params: AttentionParams,
    num_qo_heads: Int64,
):
    """Grid (num_items, num_kv_heads), SM90_THREADS threads (four consumer
    warps, one producer), Shape.SMEM_BYTES of dynamic shared memory. `rows`
    is the compiled row tile (8 or 16) holding the group's query heads."""
    comptime Shape = TensorCoreShape[dtype, head_dim]
    comptime Stage = Shape.Stage
    comptime STAGES = Shape.STAGES
    comptime CHUNK = Stage.CHUNK
    var qo_heads = Int(num_qo_heads)
    var kv_head = Int(block_idx.y)
    var group = qo_heads // cache.num_kv_heads()
    var item = Int(block_idx.x)
    if work.q_count(item) == 0:
        return  # capacity padding of a fixed work list: nothing to do
    var first = work.kv_first(item)
    var end = work.kv_end(item)
    var base = first - first % BOX_ROWS
    var num_stages = ceildiv(end - base, STAGE_TOKENS) if end > first else 0
    var tid = Int(thread_idx.x)

    var ring = external_memory[
        Scalar[dtype],
        address_space=AddressSpace.SHARED,
        alignment=1024,
        name="pagedkv_tensor_core_stages",
    ]()
    var full = stack_allocation[
        STAGES, SharedMemBarrier, address_space=AddressSpace.SHARED, alignment=8
    ]()
    var empty = stack_allocation[
        STAGES, SharedMemBarrier, address_space=AddressSpace.SHARED, alignment=8
    ]()
    # Q's 16 rows (the group's heads, zeros after them), swizzled as a stage.
    var q_tile = stack_allocation[
        16 * head_dim,
        Scalar[dtype],
        address_space=AddressSpace.SHARED,
        alignment=128,
    ]()
    var final_ml = stack_allocation[
        2 * CONSUMER_WARPS * 16, F32, address_space=AddressSpace.SHARED
    ]()

    var b = work.request(item)
    var q_pos = work.q_pos(item)
    var q_row = work.q_row(item)
    for i in range(tid, 16 * head_dim, SM90_THREADS):
        var r = i // head_dim
        var c = i % head_dim
        var value = Scalar[dtype](0)
        if r < group:
            value = q[
                unsafe_offset=(q_row * qo_heads + kv_head * group + r)
                * head_dim
                + c
            ]
        q_tile[unsafe_offset=q_offset[head_dim](r, c)] = value
    if tid == 0:
        comptime for s in range(STAGES):
            full[unsafe_offset=s].init(1)
            empty[unsafe_offset=s].init(Int32(CONSUMERS))
        fence_mbarrier_init()
    barrier()

    if tid >= CONSUMERS:
        produce_stages[dtype, head_dim, 8, STAGE_TOKENS, RING_BYTES](
            k_tma,
            v_tma,
            cache,
            ring,
            full,
            empty,
            work,
            item,
            kv_head,
            base,
            end,
            num_stages,
        )
        return

    # ---- consumers --------------------------------------------------------
    var lane = Int(lane_id())
    var warp_id = tid // WARP_SIZE
    var g = lane // 4
    var t = lane % 4

    # Q as A fragments, one per k-step: matrices (rows 0-7 | 8-15) x
    # (columns 0-7 | 8-15) of the step, lanes 0-15 then 16-31.
    var q_frag = StaticTuple[SIMD[dtype, 8], Shape.K_STEPS]()
    comptime for ks in range(Shape.K_STEPS):
        q_frag[ks] = ld_matrix[8](
            q_tile.unsafe_offset(
                q_offset[head_dim](lane % 16, ks * 16 + (lane // 16) * 8)
            )
        )

    var alibi0 = Float32(0)
    var alibi1 = Float32(0)
    if params.pos_encoding == POS_ALIBI:
        if g < group:
            alibi0 = alibi_slope(kv_head * group + g, qo_heads) * LOG2E
        if g + 8 < group:
            alibi1 = alibi_slope(kv_head * group + g + 8, qo_heads) * LOG2E

    # State of rows g (m0, l0) and g + 8 (m1, l1); l is this lane's share.
    var m0 = neg_inf[F32]()
    var m1 = neg_inf[F32]()
    var l0 = Float32(0)
    var l1 = Float32(0)
    var o = StaticTuple[SIMD[F32, 4], Shape.O_TILES]()
    comptime for nt in range(Shape.O_TILES):
        o[nt] = SIMD[F32, 4](0)

    for st in range(num_stages):
        var s = st % STAGES
        full[unsafe_offset=s].wait(UInt32((st // STAGES) & 1))
        var k_stage = ring.unsafe_offset(s * 2 * Stage.STAGE_ELEMS)
        var v_stage = k_stage.unsafe_offset(Stage.STAGE_ELEMS)
        var row0 = warp_id * WARP_TOKENS  # this warp's first row of the stage
        var tok0 = base + st * STAGE_TOKENS + row0

        # 1. S = Q K^T over the warp's 16 tokens: two n-tiles of 8.
        var s0 = SIMD[F32, 4](0)
        var s1 = SIMD[F32, 4](0)
        comptime for ks in range(Shape.K_STEPS):
            var k_frag = ld_matrix[8](
                k_stage.unsafe_offset(
                    Stage.swizzled(
                        row0 + (lane // 16) * 8 + lane % 8,
                        ks * 16 + ((lane // 8) % 2) * 8,
                    )
                )
            )
            mma(s0, q_frag[ks], k_frag.slice[4, offset=0](), s0)
            mma(s1, q_frag[ks], k_frag.slice[4, offset=4](), s1)

        # 2. Scores, masks and the online softmax. Lane (g, t) holds tokens
        # 2t, 2t + 1 (s0) and 8 + 2t, 9 + 2t (s1) of rows g and g + 8.
        var tokens = SIMD[F32, 4](
            Float32(tok0 + 2 * t),
            Float32(tok0 + 2 * t + 1),
            Float32(tok0 + 8 + 2 * t),
            Float32(tok0 + 9 + 2 * t),
        )
        var in_range = SIMD[DType.bool, 4]()
        comptime for e in range(4):
            var tok = Int(tokens[e])
            in_range[e] = tok >= first and tok < end
        var distance = tokens - Float32(q_pos)
        var seen = params.visible[4](distance, in_range)
        var lo = SIMD[F32, 4](s0[0], s0[1], s1[0], s1[1])
        var hi = SIMD[F32, 4](s0[2], s0[3], s1[2], s1[3])
        var a0 = Float32(1)
        var a1 = Float32(1)
        var p_lo = softmax_row(
            params, lo * params.q_scale_log2, alibi0, distance, seen, m0, l0, a0
        )
        var p_hi = SIMD[F32, 4](0)
        comptime if rows > 8:
            p_hi = softmax_row(
                params,
                hi * params.q_scale_log2,
                alibi1,
                distance,
                seen,
                m1,
                l1,
                a1,
            )
        comptime for nt in range(Shape.O_TILES):
            o[nt] = o[nt] * SIMD[F32, 4](a0, a0, a1, a1)

        # Rows of the warp's tokens outside [first, end) hold anything:
        # zero their V rows (P is 0 there, but 0 x NaN is NaN).
        if tok0 < first or tok0 + WARP_TOKENS > end:
            for i in range(lane, WARP_TOKENS * head_dim, WARP_SIZE):
                var r = i // head_dim
                if tok0 + r < first or tok0 + r >= end:
                    v_stage[
                        unsafe_offset=Stage.swizzled(row0 + r, i % head_dim)
                    ] = 0
            # The ring's next TMA write must follow these generic writes.
            fence_async_view_proxy()
            syncwarp()

        # 3. O += P V: P's A fragment is the two tiles' probabilities in
        # order; V's B fragments come transposed, two n-tiles per load.
        var p = SIMD[F32, 8](
            p_lo[0],
            p_lo[1],
            p_hi[0],
            p_hi[1],
            p_lo[2],
            p_lo[3],
            p_hi[2],
            p_hi[3],
        ).cast[dtype]()
        comptime for ks in range(Shape.K_STEPS):
            var v_frag = ld_matrix[8, transpose=True](
                v_stage.unsafe_offset(
                    Stage.swizzled(
                        row0 + ((lane // 8) % 2) * 8 + lane % 8,
                        ks * 16 + (lane // 16) * 8,
                    )
                )
            )
            mma(o[2 * ks], p, v_frag.slice[4, offset=0](), o[2 * ks])
            mma(o[2 * ks + 1], p, v_frag.slice[4, offset=4](), o[2 * ks + 1])
        _ = empty[unsafe_offset=s].arrive()

    # ---- epilogue: merge the warps' states, then normalise and write -----
    var m_row = SIMD[F32, 2](m0, m1)
    var l_row = SIMD[F32, 2](quad_sum(l0), quad_sum(l1))
    named_barrier[Int32(CONSUMERS)](1)  # every warp is done with the ring
    var parked = ring.unsafe_bitcast[Float32]()
    comptime for nt in range(Shape.O_TILES):
        comptime for e in range(4):
            var r = g + 8 * (e // 2)
            var c = nt * 8 + 2 * t + e % 2
            parked[unsafe_offset=(warp_id * 16 + r) * head_dim + c] = o[nt][e]
    if t == 0:
        comptime for h in range(2):
            final_ml[unsafe_offset=2 * (warp_id * 16 + g + 8 * h)] = m_row[h]
            final_ml[unsafe_offset=2 * (warp_id * 16 + g + 8 * h) + 1] = l_row[
                h
            ]
    named_barrier[Int32(CONSUMERS)](1)

    var partial_state = work.writes_partial(b)
    for i in range(tid, group * head_dim, CONSUMERS):
        var r = i // head_dim
        var c = i % head_dim
        var top = neg_inf[F32]()
        comptime for w in range(CONSUMER_WARPS):
            top = max(top, final_ml[unsafe_offset=2 * (w * 16 + r)])
        var total = Float32(0)
        var acc = Float32(0)
        if top != neg_inf[F32]():
            comptime for w in range(CONSUMER_WARPS):
                var scale = exp2(final_ml[unsafe_offset=2 * (w * 16 + r)] - top)
                total += final_ml[unsafe_offset=2 * (w * 16 + r) + 1] * scale
                acc += parked[unsafe_offset=(w * 16 + r) * head_dim + c] * scale
        # NaN is data: a warp that saw a NaN score has a NaN sum, which
        # max() may have hidden from top.
        comptime for w in range(CONSUMER_WARPS):
            if is_nan_f32(final_ml[unsafe_offset=2 * (w * 16 + r) + 1]):
                total = nan[F32]()
        var value = acc / total * params.v_scale if total != 0 else Float32(0)
        var state_lse = top + log2(total) if total != 0 else neg_inf[F32]()
        var qo = kv_head * group + r
        if partial_state:
            work.partial_o[
                unsafe_offset=(item * qo_heads + qo) * head_dim + c
            ] = value
            if c == 0:
                work.partial_lse[unsafe_offset=item * qo_heads + qo] = state_lse
        else:
            output[
                unsafe_offset=(q_row * qo_heads + qo) * head_dim + c
            ] = value.cast[dtype]()
            if c == 0:
                lse[unsafe_offset=q_row * qo_heads + qo] = state_lse


@always_inline
def q_offset[head_dim: Int](row: Int, col: Int) -> Int:
    """Offset of Q's (row, col) in q_tile: [16, head_dim], each row's 16-byte
    vectors swizzled by the row (v ^ (row % 8)) so that ld_matrix's eight
    rows hit eight bank groups."""
    comptime VEC = 8
    var v = col // VEC
    var block = v // 8
    return (
        row * head_dim + (block * 8 + ((v % 8) ^ (row & 7))) * VEC + col % VEC
    )


@always_inline
def softmax_row(
    params: AttentionParams,
    raw: SIMD[F32, 4],
    alibi_log2: Float32,
    distance: SIMD[F32, 4],
    seen: SIMD[DType.bool, 4],
    mut m: Float32,
    mut l: Float32,
    mut alpha: Float32,
) -> SIMD[F32, 4]:
    """One row's step of the online softmax over this lane's four tokens of
    it: returns their probabilities against the row's new max m, and sets
    alpha = exp2(old m - new m), by which the row's O and l are rescaled
    (l here, O by the caller).

    The row's 16 tokens of the warp live in the 4 lanes of a quad: the max
    is reduced across them; the sum is not (each lane keeps its share of l,
    summed once at the end), as FlashAttention-2 does.
    """
    var s = params.finish_scores[4](raw, alibi_log2, distance)
    var masked = seen.select(s, SIMD[F32, 4](neg_inf[F32]()))
    var new_m = max(m, quad_max(masked.reduce_max()))
    var p = SIMD[F32, 4](0)
    alpha = 1
    if new_m != neg_inf[F32]():
        alpha = exp2(m - new_m)
        p = seen.select(exp2(s - new_m), SIMD[F32, 4](0))
    # NaN is data: a visible NaN score enters l (and p.v) as NaN.
    comptime for e in range(4):
        if seen[e] and is_nan_f32(s[e]):
            p[e] = s[e]
    l = l * alpha + p.reduce_add()
    m = new_m
    return p
