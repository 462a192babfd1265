"""Decode attention on Hopper (sm_90): K/V tiles fetched by the TMA.

One thread block per (work item, KV head) computes all query heads of the
KV head's GQA group, so each K/V byte is read from HBM once per step. Warp 4
is the producer: its lane 0 issues TMA copies of BN-token stages of K and V
(boxes of BOX_ROWS tokens x one 128-byte swizzle row, fetched page by page
through `PagedKVCache.create_tma_tile`) into a ring of STAGES stages, each
guarded by a pair of mbarriers (full: bytes landed; empty: consumers done).
Warps 0-3 consume a stage in three steps separated by named barriers:

1. q.k: TPT threads per token, each holding its share of every group head's
   q in registers, read the token's K row in 16-byte vectors (the token
   permutation makes each 8-thread phase hit 8 distinct swizzled chunks, so
   shared memory serves it without bank conflicts) and reduce across lanes;
2. softmax: a warp per head, a lane per token (BN = 32): mask, online
   max/sum, probabilities to shared memory;
3. p.v: a thread per output column (or two), all group heads in registers.

Scores use CUDA cores: a decode step reads each byte of K/V once and does
`group` multiply-adds with it, far below what the SM computes while HBM
delivers it. Key-split items (plan() splits long requests over SMs) write
partial states that `merge_split_head` combines, as for the generic
kernel (generic.mojo), which serves every case this one does not:
HND pools, RoPE on the fly, groups above 8, other GPUs.
"""

from std.bit import log2_floor
from std.math import ceildiv, exp2, log2
from std.memory import stack_allocation
from std.sys import size_of
from std.utils import StaticTuple
from std.utils.numerics import neg_inf

from layout import Layout, LayoutTensor
from layout.tma_async import SharedMemBarrier
from max.gpu import (
    MAX_THREADS_PER_BLOCK_METADATA,
    WARP_SIZE,
    barrier,
    block_idx,
    lane_id,
    thread_idx,
)
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.host.nvidia.tma import TensorMapSwizzle
from max.gpu.memory import AddressSpace, external_memory, fence_mbarrier_init
from max.gpu.primitives import warp
from max.gpu.sync import named_barrier

from ...cache.paged_kv_cache import (
    DYNAMIC,
    KV,
    KVLayout,
    KVTile,
    PagedKVCache,
    Ptr,
    tma_element,
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

comptime BN = WARP_SIZE
"""Tokens per pipeline stage: one lane per token in the softmax step."""
comptime BOX_ROWS = 16
"""Tokens per TMA box; page sizes are multiples of it, so no box straddles
two pages."""
comptime SWIZZLE = TensorMapSwizzle.SWIZZLE_128B
comptime SWIZZLE_BYTES = 128
comptime CONSUMERS = 4 * WARP_SIZE
comptime SM90_THREADS = CONSUMERS + WARP_SIZE
"""Four consumer warps and one producer warp."""
comptime STAGE_RING_BYTES = 64 * 1024
"""Shared memory for the stage ring: three blocks fit on an SM."""
comptime SM90_HEAD_DIMS = (64, 128, 256)
comptime SM90_GROUPS = (1, 4, 8)
"""Compiled group widths; a group of 2 or 3 runs padded to 4, 5-7 to 8."""
comptime F32 = DType.float32
comptime SharedF32 = Pointer[
    mut=True, Float32, address_space=AddressSpace.SHARED, _
]


@always_inline
def padded_group(group: Int) -> Int:
    """The compiled group width that runs `group` query heads per KV head, or
    0 when the group is too wide for this kernel."""
    comptime for i in range(len(SM90_GROUPS)):
        if group <= SM90_GROUPS[i]:
            return SM90_GROUPS[i]
    return 0


struct Sm90Shape[
    kv_dtype: DType,
    head_dim: Int,
    group: Int,
    stage_tokens: Int = BN,
    ring_bytes: Int = STAGE_RING_BYTES,
]:
    """The kernel's compile-time geometry for one (dtype, head dim, group);
    stage_tokens: tokens per pipeline stage (a multiple of BOX_ROWS), and
    ring_bytes the shared memory of the stage ring (the tensor-core kernel of
    tensor_core.mojo takes 64 and 96 KiB). Producer and consumers derive the
    ring's stage count from the same Shape."""

    comptime ELEM = size_of[Self.kv_dtype]()
    comptime CHUNK = SWIZZLE_BYTES // Self.ELEM
    """Columns per box: one 128-byte swizzle row."""
    comptime NCHUNK = Self.head_dim // Self.CHUNK
    comptime VEC = 16 // Self.ELEM
    """Elements per 16-byte vector, the swizzle's unit."""
    comptime VECS = Self.head_dim // Self.VEC
    comptime TPT = min(max(4, Self.group * Self.head_dim // 64), Self.VECS)
    """Threads per token in q.k: each keeps group * head_dim / TPT q values
    in registers (64, or 128 for 1-byte caches with wide groups)."""
    comptime NPT = Self.VECS // Self.TPT
    """16-byte vectors per thread per token."""
    comptime ROWS_PER_PASS = CONSUMERS // Self.TPT
    comptime STAGE_ELEMS = Self.stage_tokens * Self.head_dim
    """Elements of K (and of V) in a stage."""
    comptime STAGE_BYTES = 2 * Self.STAGE_ELEMS * Self.ELEM
    comptime STAGES = min(max(Self.ring_bytes // Self.STAGE_BYTES, 2), 4)
    comptime SMEM_BYTES = Self.STAGES * Self.STAGE_BYTES
    comptime BOX_BYTES = BOX_ROWS * SWIZZLE_BYTES
    comptime COLS = max(Self.head_dim // CONSUMERS, 1)
    """Output columns per thread in p.v."""
    comptime TOKEN_SPLIT = max(CONSUMERS // Self.head_dim, 1)
    """Threads sharing a column in p.v (head_dim 64: each takes half the
    tokens)."""
    comptime CHAINS = ceildiv(4, Self.group)
    """Independent FMA chains per head in q.k, so that a narrow group still
    has four in flight."""
    comptime SLOTS = ceildiv(Self.group, 4)
    """Group heads per consumer warp in the softmax step."""

    @staticmethod
    def compiles() -> Bool:
        return Self.NCHUNK >= 1 and Self.VECS % Self.TPT == 0

    @staticmethod
    @always_inline
    def swizzled(row: Int, col: Int) -> Int:
        """Offset of element (row, col) of a stage's K or V, stored as NCHUNK
        column blocks [stage_tokens, CHUNK] as the TMA's 128-byte swizzle
        wrote them: 16-byte vector v of row r sits at v ^ (r % 8)."""
        var block = col // Self.CHUNK
        var c = col % Self.CHUNK
        return (
            block * Self.stage_tokens * Self.CHUNK
            + row * Self.CHUNK
            + (((c // Self.VEC) ^ (row & 7)) * Self.VEC)
            + c % Self.VEC
        )

    @staticmethod
    @always_inline
    def load_row[
        width: Int
    ](
        stage: Pointer[
            mut=True,
            Scalar[Self.kv_dtype],
            address_space=AddressSpace.SHARED,
            _,
        ],
        row: Int,
        col: Int,
    ) -> SIMD[F32, width]:
        """Elements col .. col + width (within one 16-byte vector) of row
        `row` of a stage's K or V, widened to float32."""
        return (
            stage.unsafe_offset(Self.swizzled(row, col))
            .unsafe_load[width=width, alignment=width * Self.ELEM]()
            .cast[F32]()
        )


def tma_decode_applies[
    kv_dtype: DType, layout: KVLayout
](cache: PagedKVCache, group: Int, params: AttentionParams) -> Bool:
    """Whether decode_sm90_kernel serves this batch (else the generic kernel).
    """
    comptime if layout != KVLayout.NHD:
        return False
    if cache.num_pages == 0 or cache.page_size() % BOX_ROWS != 0:
        return False
    if params.pos_encoding != POS_NONE and params.pos_encoding != POS_ALIBI:
        return False
    var g = padded_group(group)
    if g == 0:
        return False
    var d = cache.head_dim()
    comptime for i in range(len(SM90_GROUPS)):
        comptime for j in range(len(SM90_HEAD_DIMS)):
            comptime hd = SM90_HEAD_DIMS[j]
            if g == SM90_GROUPS[i] and d == hd:
                return Sm90Shape[kv_dtype, hd, SM90_GROUPS[i]].compiles()
    return False


def launch_decode_sm90[
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
    """Enqueues decode_sm90_kernel on a batch that `tma_decode_applies` to."""
    var group = num_qo_heads // cache.num_kv_heads()
    var g = padded_group(group)
    comptime for i in range(len(SM90_GROUPS)):
        comptime G = SM90_GROUPS[i]
        comptime for j in range(len(SM90_HEAD_DIMS)):
            comptime hd = SM90_HEAD_DIMS[j]
            comptime Shape = Sm90Shape[kv_dtype, hd, G]
            comptime if Shape.compiles():
                if g == G and cache.head_dim() == hd:
                    var fixed = cache.specialized[DYNAMIC, DYNAMIC, hd]()
                    var k_tma = fixed.create_tma_tile[
                        KV.K, BOX_ROWS, Shape.CHUNK, SWIZZLE
                    ](ctx)
                    var v_tma = fixed.create_tma_tile[
                        KV.V, BOX_ROWS, Shape.CHUNK, SWIZZLE
                    ](ctx)
                    ctx.enqueue_function[
                        decode_sm90_kernel[q_dtype, kv_dtype, hd, G]
                    ](
                        k_tma,
                        v_tma,
                        fixed,
                        q,
                        output,
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
    raise Error("pagedkv: no sm_90 decode kernel for this batch")


@__llvm_arg_metadata(k_tma, `nvvm.grid_constant`)
@__llvm_arg_metadata(v_tma, `nvvm.grid_constant`)
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(SM90_THREADS)),
    `nvvm.minctasm`=SIMDLength(2),
)
def decode_sm90_kernel[
    q_dtype: DType, kv_dtype: DType, head_dim: Int, group: Int
](
    k_tma: KVTile[
        kv_dtype, BOX_ROWS, Sm90Shape[kv_dtype, head_dim, group].CHUNK
    ],
    v_tma: KVTile[
        kv_dtype, BOX_ROWS, Sm90Shape[kv_dtype, head_dim, group].CHUNK
    ],
    cache: PagedKVCache[kv_dtype, KVLayout.NHD, DYNAMIC, DYNAMIC, head_dim],
    q: Ptr[q_dtype],
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    work: AttentionWork,
    params: AttentionParams,
    num_qo_heads: Int64,
):
    """Grid (num_items, num_kv_heads), SM90_THREADS threads, Shape.SMEM_BYTES
    of dynamic shared memory. `group` is the compiled (padded) group width.
    """
    comptime Shape = Sm90Shape[kv_dtype, head_dim, group]
    comptime STAGES = Shape.STAGES
    var qo_heads = Int(num_qo_heads)
    var kv_head = Int(block_idx.y)
    var real_group = qo_heads // cache.num_kv_heads()
    var item = Int(block_idx.x)
    if work.q_count(item) == 0:
        return  # capacity padding of a fixed work list: nothing to do
    var first = work.kv_first(item)
    var end = work.kv_end(item)
    # Stages start on a box boundary at or before `first`; rows outside
    # [first, end) are fetched (they lie in the request's pages) but masked.
    var base = first - first % BOX_ROWS
    var num_stages = ceildiv(end - base, BN) if end > first else 0
    var tid = Int(thread_idx.x)

    var ring = external_memory[
        Scalar[kv_dtype],
        address_space=AddressSpace.SHARED,
        alignment=1024,
        name="pagedkv_sm90_stages",
    ]()
    var full = stack_allocation[
        STAGES, SharedMemBarrier, address_space=AddressSpace.SHARED, alignment=8
    ]()
    var empty = stack_allocation[
        STAGES, SharedMemBarrier, address_space=AddressSpace.SHARED, alignment=8
    ]()
    var scores = stack_allocation[
        group * BN, F32, address_space=AddressSpace.SHARED
    ]()
    var probs = stack_allocation[
        group * BN, F32, address_space=AddressSpace.SHARED, alignment=16
    ]()
    var alpha = stack_allocation[
        group, F32, address_space=AddressSpace.SHARED
    ]()
    var final_ml = stack_allocation[
        2 * group, F32, address_space=AddressSpace.SHARED
    ]()

    if tid == 0:
        comptime for s in range(STAGES):
            full[unsafe_offset=s].init(1)
            empty[unsafe_offset=s].init(Int32(CONSUMERS))
        # The TMA (the async proxy) completes transactions on these barriers.
        fence_mbarrier_init()
    barrier()

    if tid >= CONSUMERS:
        produce_stages[kv_dtype, head_dim, group](
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

    # ---- consumers: warps 0-3 -------------------------------------------
    var lane = Int(lane_id())
    var warp_id = tid // WARP_SIZE
    var b = work.request(item)
    var q_pos = work.q_pos(item)
    var q_row = work.q_row(item)

    # q.k role: token slot and part. With 4 threads per token, a warp's 8
    # tokens are ordered 0,4,1,5,.. so an 8-thread phase reads rows r and
    # r + 4, whose swizzles differ in the chunk bit the parts share.
    var part = tid % Shape.TPT
    var slot = tid // Shape.TPT
    var token_in_pass = slot
    comptime if Shape.TPT == 4:
        var s8 = slot % 8
        token_in_pass = slot - s8 + s8 // 2 + 4 * (s8 % 2)

    comptime QN = Shape.NPT * Shape.VEC
    var q_frag = SIMD[F32, group * QN](0)
    comptime for g in range(group):
        if g < real_group:
            var head_q = q.unsafe_offset(
                (q_row * qo_heads + kv_head * real_group + g) * head_dim
            )
            comptime for i in range(Shape.NPT):
                var col = (part + Shape.TPT * i) * Shape.VEC
                comptime for e in range(Shape.VEC):
                    q_frag[g * QN + i * Shape.VEC + e] = (
                        head_q[unsafe_offset=col + e].cast[F32]()
                        * params.q_scale_log2
                    )

    # softmax role: warp w owns heads w, w + 4, ..
    var m_state = SIMD[F32, Shape.SLOTS](neg_inf[F32]())
    var l_state = SIMD[F32, Shape.SLOTS](0)
    var alibi_log2 = SIMD[F32, Shape.SLOTS](0)
    comptime for j in range(Shape.SLOTS):
        var g = warp_id + 4 * j
        if params.pos_encoding == POS_ALIBI and g < real_group:
            alibi_log2[j] = (
                alibi_slope(kv_head * real_group + g, qo_heads) * LOG2E
            )

    # p.v role: columns c0 .. c0 + COLS, tokens split .. by TOKEN_SPLIT.
    comptime COLUMN_THREADS = head_dim // Shape.COLS
    var c0 = (tid % COLUMN_THREADS) * Shape.COLS
    var split = tid // COLUMN_THREADS
    var o = SIMD[F32, group * Shape.COLS](0)

    for t in range(num_stages):
        var s = t % STAGES
        full[unsafe_offset=s].wait(UInt32((t // STAGES) & 1))
        var k_stage = ring.unsafe_offset(s * 2 * Shape.STAGE_ELEMS)
        var v_stage = k_stage.unsafe_offset(Shape.STAGE_ELEMS)
        var tok0 = base + t * BN

        # 1. q.k for every head of the group, as chains of scalar FMAs (a
        # vector product and its reduce_add take half again as many
        # instructions, and the consumers' instruction issue, not HBM, bounds
        # wide groups); narrow groups keep CHAINS chains a head in flight.
        comptime for p in range(BN // Shape.ROWS_PER_PASS):
            var r = p * Shape.ROWS_PER_PASS + token_in_pass
            var chains = SIMD[F32, group * Shape.CHAINS](0)
            comptime for i in range(Shape.NPT):
                var col = (part + Shape.TPT * i) * Shape.VEC
                var k = Shape.load_row[Shape.VEC](k_stage, r, col)
                comptime for g in range(group):
                    comptime for e in range(Shape.VEC):
                        comptime a = g * Shape.CHAINS + e % Shape.CHAINS
                        chains[a] = q_frag[g * QN + i * Shape.VEC + e].fma(
                            k[e], chains[a]
                        )
            var dots = SIMD[F32, group](0)
            comptime for g in range(group):
                dots[g] = chains.slice[
                    Shape.CHAINS, offset=g * Shape.CHAINS
                ]().reduce_add()
            comptime SHARE = max(group // Shape.TPT, 1)
            comptime COPIES = max(Shape.TPT // group, 1)
            var share = sum_across_lanes[Shape.TPT](dots, part)
            if part % COPIES == 0:
                comptime for j in range(SHARE):
                    scores[
                        unsafe_offset=((part // COPIES) * SHARE + j) * BN + r
                    ] = share[j]
        named_barrier[Int32(CONSUMERS)](1)

        # 2. Online softmax: lane = token of the stage.
        var tok = tok0 + lane
        var distance = Float32(tok - q_pos)
        var in_range = tok >= first and tok < end
        var seen = params.visible[1](
            SIMD[F32, 1](distance), SIMD[DType.bool, 1](in_range)
        )[0]
        comptime for j in range(Shape.SLOTS):
            var g = warp_id + 4 * j
            if g < real_group:
                var score = params.finish_scores[1](
                    SIMD[F32, 1](scores[unsafe_offset=g * BN + lane]),
                    alibi_log2[j],
                    SIMD[F32, 1](distance),
                )[0]
                var masked = score if seen else neg_inf[F32]()
                var new_m = max(m_state[j], warp.max(masked))
                var p = Float32(0)
                var a = Float32(1)
                if new_m != neg_inf[F32]():
                    a = exp2(m_state[j] - new_m)
                    if seen:
                        p = exp2(score - new_m)
                if seen and is_nan_f32(score):
                    # NaN is data: warp.max may drop it, so it enters l and
                    # p.v directly and the row ends NaN.
                    p = score
                l_state[j] = l_state[j] * a + warp.sum(p)
                m_state[j] = new_m
                probs[unsafe_offset=g * BN + lane] = p
                if lane == 0:
                    alpha[unsafe_offset=g] = a
        named_barrier[Int32(CONSUMERS)](1)

        # 3. p.v over the stage's tokens in [first, end).
        comptime for g in range(group):
            if g < real_group:
                var a = alpha[unsafe_offset=g]
                comptime for c in range(Shape.COLS):
                    o[g * Shape.COLS + c] *= a
        var lo = max(first - tok0, 0)
        var hi = min(end - tok0, BN)
        if lo == 0 and hi == BN:
            # A full stage (all but a work item's first and last): each token
            # split takes a contiguous run, and probabilities come four
            # tokens to a shared-memory load.
            comptime RUN = BN // Shape.TOKEN_SPLIT
            var r0 = split * RUN
            comptime for r4 in range(0, RUN, 4):
                var v = SIMD[F32, 4 * Shape.COLS](0)
                comptime for j in range(4):
                    v = v.insert[offset=j * Shape.COLS](
                        Shape.load_row[Shape.COLS](v_stage, r0 + r4 + j, c0)
                    )
                comptime for g in range(group):
                    var pr = probs.unsafe_offset(g * BN + r0 + r4).unsafe_load[
                        width=4, alignment=16
                    ]()
                    comptime for j in range(4):
                        comptime for c in range(Shape.COLS):
                            o[g * Shape.COLS + c] = pr[j].fma(
                                v[j * Shape.COLS + c], o[g * Shape.COLS + c]
                            )
        else:
            # Rows outside [first, end) may hold anything (a last page's
            # unwritten slots, a stale stage): skip them, not weight them 0.
            var r = lo + (
                split - lo % Shape.TOKEN_SPLIT + Shape.TOKEN_SPLIT
            ) % (Shape.TOKEN_SPLIT)
            while r < hi:
                var v = Shape.load_row[Shape.COLS](v_stage, r, c0)
                comptime for g in range(group):
                    var pr = probs[unsafe_offset=g * BN + r]
                    comptime for c in range(Shape.COLS):
                        o[g * Shape.COLS + c] += pr * v[c]
                r += Shape.TOKEN_SPLIT
        _ = empty[unsafe_offset=s].arrive()

    # ---- epilogue: normalise and write, final or partial ----------------
    if lane == 0:
        comptime for j in range(Shape.SLOTS):
            var g = warp_id + 4 * j
            if g < group:
                final_ml[unsafe_offset=2 * g] = m_state[j]
                final_ml[unsafe_offset=2 * g + 1] = l_state[j]
    comptime if Shape.TOKEN_SPLIT > 1:
        # Threads of the later token splits hand their sums to split 0
        # through the (drained) stage ring.
        var parked = ring.unsafe_bitcast[Float32]()
        if split > 0:
            comptime for g in range(group):
                comptime for c in range(Shape.COLS):
                    parked[
                        unsafe_offset=((split - 1) * group + g) * head_dim
                        + c0
                        + c
                    ] = o[g * Shape.COLS + c]
        named_barrier[Int32(CONSUMERS)](1)
        if split > 0:
            return
        comptime for h in range(1, Shape.TOKEN_SPLIT):
            comptime for g in range(group):
                comptime for c in range(Shape.COLS):
                    o[g * Shape.COLS + c] += parked[
                        unsafe_offset=((h - 1) * group + g) * head_dim + c0 + c
                    ]
    else:
        named_barrier[Int32(CONSUMERS)](1)

    var partial_state = work.writes_partial(b)
    comptime for g in range(group):
        if g < real_group:
            var m = final_ml[unsafe_offset=2 * g]
            var l = final_ml[unsafe_offset=2 * g + 1]
            var qo = kv_head * real_group + g
            # l is 0 (no key seen), positive, or NaN (passed through).
            var scale = params.v_scale / l if l != 0 else Float32(0)
            var state_lse = m + log2(l) if l != 0 else neg_inf[F32]()
            comptime for c in range(Shape.COLS):
                var value = o[g * Shape.COLS + c] * scale
                if partial_state:
                    work.partial_o[
                        unsafe_offset=(item * qo_heads + qo) * head_dim + c0 + c
                    ] = value
                else:
                    output[
                        unsafe_offset=(q_row * qo_heads + qo) * head_dim
                        + c0
                        + c
                    ] = value.cast[q_dtype]()
            if c0 == 0:
                if partial_state:
                    work.partial_lse[
                        unsafe_offset=item * qo_heads + qo
                    ] = state_lse
                else:
                    lse[unsafe_offset=q_row * qo_heads + qo] = state_lse


@always_inline
def sum_across_lanes[
    width: Int, //, lanes: Int
](values: SIMD[F32, width], part: Int) -> SIMD[F32, max(width // lanes, 1)]:
    """Sums `values` over a group of `lanes` neighbouring lanes (powers of
    two; `part` is this lane's index in the group) and hands each lane a
    share: lane `part` gets the sums of elements [i * SHARE, (i + 1) * SHARE),
    i = part // COPIES, where SHARE = max(width // lanes, 1) and
    COPIES = max(lanes // width, 1) lanes hold each share.

    A reduce-scatter: each butterfly step sends the half a lane gives up and
    adds the half it keeps, so `width` values over `lanes` lanes take
    about width shuffles, where a sum of each value takes width * log2(lanes).
    """
    comptime SCATTER_STEPS = log2_floor(min(width, lanes))
    comptime SHARE = max(width // lanes, 1)
    var v = values
    comptime for s in range(SCATTER_STEPS):
        comptime half = (width >> s) // 2
        comptime offset = lanes >> (s + 1)
        var lo = v.slice[half, offset=0]()
        var hi = v.slice[half, offset=half]()
        var upper = (part & offset) != 0
        var keep = hi if upper else lo
        var send = lo if upper else hi
        # Shuffles move 32 bits: one per element.
        comptime for e in range(half):
            v[e] = keep[e] + warp.shuffle_xor(send[e], UInt32(offset))
    var share = v.slice[SHARE, offset=0]()
    comptime for s in range(SCATTER_STEPS, log2_floor(lanes)):
        comptime for e in range(SHARE):
            share[e] += warp.shuffle_xor(share[e], UInt32(lanes >> (s + 1)))
    return share


@always_inline
def produce_stages[
    kv_dtype: DType,
    head_dim: Int,
    group: Int,
    stage_tokens: Int = BN,
    ring_bytes: Int = STAGE_RING_BYTES,
](
    k_tma: KVTile[
        kv_dtype, BOX_ROWS, Sm90Shape[kv_dtype, head_dim, group].CHUNK
    ],
    v_tma: KVTile[
        kv_dtype, BOX_ROWS, Sm90Shape[kv_dtype, head_dim, group].CHUNK
    ],
    cache: PagedKVCache[kv_dtype, KVLayout.NHD, DYNAMIC, DYNAMIC, head_dim],
    ring: Pointer[
        mut=True, Scalar[kv_dtype], address_space=AddressSpace.SHARED, _
    ],
    full: Pointer[
        mut=True, SharedMemBarrier, address_space=AddressSpace.SHARED, _
    ],
    empty: Pointer[
        mut=True, SharedMemBarrier, address_space=AddressSpace.SHARED, _
    ],
    work: AttentionWork,
    item: Int,
    kv_head: Int,
    base: Int,
    end: Int,
    num_stages: Int,
):
    """The producer warp: fills stage t % STAGES with tokens
    base + t * stage_tokens .. of K and V. The warp's lanes look up the pool
    rows of 32 boxes at a time (one page-table read each, in parallel, the
    next 32 already in flight); lane 0 issues the copies."""
    comptime Shape = Sm90Shape[
        kv_dtype, head_dim, group, stage_tokens, ring_bytes
    ]
    comptime STAGES = Shape.STAGES
    comptime BOXES = stage_tokens // BOX_ROWS
    comptime Box = LayoutTensor[
        tma_element[kv_dtype](),
        Layout.row_major(BOX_ROWS, Shape.CHUNK),
        MutAnyOrigin,
        address_space=AddressSpace.SHARED,
        alignment=128,
    ]
    var lane = Int(lane_id())
    var b = work.request(item)
    var num_boxes = ceildiv(end - base, BOX_ROWS)

    @always_inline
    def box_row(i: Int) {var cache, var b, var base, var num_boxes} -> Int32:
        if i >= num_boxes:
            return 0
        return Int32(cache.row_idx(b, base + i * BOX_ROWS))

    if lane == 0:
        k_tma.prefetch_descriptor()
        v_tma.prefetch_descriptor()
    var rows_now = box_row(lane)
    var rows_next = box_row(WARP_SIZE + lane)
    for t in range(num_stages):
        var s = t % STAGES
        if t >= STAGES:
            empty[unsafe_offset=s].wait(UInt32(((t // STAGES) - 1) & 1))
        var first_box = t * BOXES
        var boxes = min(BOXES, num_boxes - first_box)
        if lane == 0:
            full[unsafe_offset=s].expect_bytes(
                Int32(boxes * 2 * Shape.NCHUNK * Shape.BOX_BYTES)
            )
        var k_stage = ring.unsafe_offset(s * 2 * Shape.STAGE_ELEMS)
        var v_stage = k_stage.unsafe_offset(Shape.STAGE_ELEMS)
        comptime for x in range(BOXES):
            var i = first_box + x
            if i % WARP_SIZE == 0 and i > 0:
                rows_now = rows_next
                rows_next = box_row(i + WARP_SIZE + lane)
            var row = Int(warp.shuffle_idx(rows_now, UInt32(i % WARP_SIZE)))
            if lane == 0 and x < boxes:
                comptime for j in range(Shape.NCHUNK):
                    var offset = (
                        j * stage_tokens * Shape.CHUNK
                        + x * BOX_ROWS * Shape.CHUNK
                    )
                    var col = kv_head * head_dim + j * Shape.CHUNK
                    k_tma.async_copy(
                        Box(
                            k_stage.unsafe_offset(offset)
                            .unsafe_bitcast[Scalar[tma_element[kv_dtype]()]]()
                            .as_unsafe_any_origin()
                        ),
                        full[unsafe_offset=s],
                        (col, row),
                    )
                    v_tma.async_copy(
                        Box(
                            v_stage.unsafe_offset(offset)
                            .unsafe_bitcast[Scalar[tma_element[kv_dtype]()]]()
                            .as_unsafe_any_origin()
                        ),
                        full[unsafe_offset=s],
                        (col, row),
                    )
