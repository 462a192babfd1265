"""MLA attention on a GPU: a simple CUDA-core kernel (no tensor cores).

One thread block per (work item, tile of MLA_GPU_ROWS query rows). The
block keeps its rows' scaled q (ckv_dim + kpe_dim floats each) in shared
memory and walks the item's keys in tiles of MLA_GPU_KEYS tokens: the
tile's ckv and kpe rows are widened into shared memory, each warp takes
(row, key) pairs in turn and sums their dot product across its lanes, one
thread per row runs the base-2 online softmax, and every thread folds the
tile's ckv rows into its own elements of each row's accumulator (element
thread, thread + 128, ..). Key-split items write partial states, merged
afterwards by `merge_split_head`.
"""

from std.math import exp2, log2
from std.memory import stack_allocation
from std.utils.numerics import nan, neg_inf

from max.gpu import (
    WARP_SIZE,
    barrier,
    block_dim,
    block_idx,
    lane_id,
    thread_idx,
)
from max.gpu.memory import AddressSpace
from max.gpu.primitives import warp

from ..attention.cpu.dispatch import merge_split_head
from ..attention.work import AttentionWork
from ..cache.paged_kv_cache import Ptr
from ..simd.widen import F32, kv_load_scale, load_f32, load_kv, narrow
from .mla_pages import MLAPages, MLAScales

comptime MLA_GPU_THREADS = 128
comptime MLA_GPU_WARPS = MLA_GPU_THREADS // WARP_SIZE
comptime MLA_GPU_ROWS = 8
"""Query rows per block: their accumulators live in registers."""
comptime MLA_GPU_KEYS = 8
"""Key tokens staged in shared memory per step."""
comptime MLA_GPU_MAX_CKV = 512
comptime MLA_GPU_MAX_QK = 640
"""Bounds of ckv_dim and ckv_dim + kpe_dim on a GPU (shared memory sizes)."""
comptime PER_THREAD = MLA_GPU_MAX_CKV // MLA_GPU_THREADS


def mla_gpu_kernel[
    q_dtype: DType, kv_dtype: DType
](
    pages: MLAPages[kv_dtype],
    q_nope: Ptr[q_dtype],
    q_pe: Ptr[q_dtype],
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    work: AttentionWork,
    scales: MLAScales,
    num_heads: Int64,
):
    """Grid (num_items, row tiles of the widest item), MLA_GPU_THREADS
    threads."""
    var heads = Int(num_heads)
    var item = Int(block_idx.x)
    var r0 = Int(block_idx.y) * MLA_GPU_ROWS
    var total_rows = work.q_count(item) * heads
    if r0 >= total_rows:
        return
    var count = min(MLA_GPU_ROWS, total_rows - r0)
    var ckv_dim = pages.ckv_dim
    var kpe_dim = pages.kpe_dim
    var qk_dim = ckv_dim + kpe_dim
    var b = work.request(item)
    var first_row = work.q_row(item) * heads + r0
    var tid = Int(thread_idx.x)
    var lane = Int(lane_id())
    var warp_id = tid // WARP_SIZE
    var unload = 1 / kv_load_scale[kv_dtype]()

    var q_s = stack_allocation[
        MLA_GPU_ROWS * MLA_GPU_MAX_QK, F32, address_space=AddressSpace.SHARED
    ]()
    var k_s = stack_allocation[
        MLA_GPU_KEYS * MLA_GPU_MAX_QK, F32, address_space=AddressSpace.SHARED
    ]()
    var p_s = stack_allocation[
        MLA_GPU_ROWS * MLA_GPU_KEYS, F32, address_space=AddressSpace.SHARED
    ]()
    var m_s = stack_allocation[
        MLA_GPU_ROWS, F32, address_space=AddressSpace.SHARED
    ]()
    var l_s = stack_allocation[
        MLA_GPU_ROWS, F32, address_space=AddressSpace.SHARED
    ]()
    var alpha_s = stack_allocation[
        MLA_GPU_ROWS, F32, address_space=AddressSpace.SHARED
    ]()

    var idx = tid
    while idx < count * qk_dim:
        var r = idx // qk_dim
        var d = idx - r * qk_dim
        var row = first_row + r
        var value: Float32
        if d < ckv_dim:
            value = load_f32[q_dtype, 1](q_nope, row * ckv_dim + d)[0] * (
                scales.nope_log2 * unload
            )
        else:
            value = load_f32[q_dtype, 1](q_pe, row * kpe_dim + d - ckv_dim)[
                0
            ] * (scales.pe_log2 * unload)
        q_s[unsafe_offset=r * MLA_GPU_MAX_QK + d] = value
        idx += MLA_GPU_THREADS
    if tid < MLA_GPU_ROWS:
        m_s[unsafe_offset=tid] = neg_inf[F32]()
        l_s[unsafe_offset=tid] = 0
    var acc = SIMD[F32, MLA_GPU_ROWS * PER_THREAD](0)
    barrier()

    var q_pos0 = work.q_pos(item)
    var tok = work.kv_first(item)
    var end = work.kv_end(item)
    while tok < end:
        var nk = min(MLA_GPU_KEYS, end - tok)
        idx = tid
        while idx < nk * qk_dim:
            var j = idx // qk_dim
            var d = idx - j * qk_dim
            var slot = pages.token_slot(b, tok + j)
            var value: Float32
            if d < ckv_dim:
                value = load_kv[kv_dtype, 1](
                    pages.ckv, slot * pages.ckv_stride + d
                )[0]
            else:
                value = load_kv[kv_dtype, 1](
                    pages.kpe, slot * pages.kpe_stride + d - ckv_dim
                )[0]
            k_s[unsafe_offset=j * MLA_GPU_MAX_QK + d] = value
            idx += MLA_GPU_THREADS
        barrier()
        var pair = warp_id
        while pair < MLA_GPU_ROWS * MLA_GPU_KEYS:
            var r = pair // MLA_GPU_KEYS
            var j = pair - r * MLA_GPU_KEYS
            var partial: Float32 = 0
            if r < count and j < nk:
                var d = lane
                while d < qk_dim:
                    partial += (
                        q_s[unsafe_offset=r * MLA_GPU_MAX_QK + d]
                        * k_s[unsafe_offset=j * MLA_GPU_MAX_QK + d]
                    )
                    d += WARP_SIZE
            var s = warp.sum(partial)
            if lane == 0:
                var q_pos = q_pos0 + (r0 + r) // heads
                var seen = r < count and j < nk
                if scales.causal:
                    seen = seen and tok + j <= q_pos
                p_s[unsafe_offset=pair] = s if seen else neg_inf[F32]()
            pair += MLA_GPU_WARPS
        barrier()
        if tid < MLA_GPU_ROWS:
            var old = m_s[unsafe_offset=tid]
            var top = old
            for j in range(MLA_GPU_KEYS):
                top = max(top, p_s[unsafe_offset=tid * MLA_GPU_KEYS + j])
            # A row that has seen nothing keeps m = -inf and weighs nothing.
            var base = top if top != neg_inf[F32]() else Float32(0)
            var total: Float32 = 0
            for j in range(MLA_GPU_KEYS):
                var p = exp2(p_s[unsafe_offset=tid * MLA_GPU_KEYS + j] - base)
                p_s[unsafe_offset=tid * MLA_GPU_KEYS + j] = p
                total += p
            var alpha = exp2(old - base)
            alpha_s[unsafe_offset=tid] = alpha
            l_s[unsafe_offset=tid] = l_s[unsafe_offset=tid] * alpha + total
            m_s[unsafe_offset=tid] = top
        barrier()
        comptime for r in range(MLA_GPU_ROWS):
            comptime for i in range(PER_THREAD):
                var d = tid + i * MLA_GPU_THREADS
                if d < ckv_dim:
                    var sum = acc[r * PER_THREAD + i] * alpha_s[unsafe_offset=r]
                    for j in range(nk):
                        sum += (
                            p_s[unsafe_offset=r * MLA_GPU_KEYS + j]
                            * k_s[unsafe_offset=j * MLA_GPU_MAX_QK + d]
                        )
                    acc[r * PER_THREAD + i] = sum
        # The next tile's loads overwrite k_s and p_s.
        barrier()
        tok += nk

    var partial = work.writes_partial(b)
    comptime for r in range(MLA_GPU_ROWS):
        if r < count:
            var total = l_s[unsafe_offset=r]
            var norm = (
                scales.v_scale * unload / total if total != 0 else Float32(0)
            )
            var state_lse = (
                m_s[unsafe_offset=r] + log2(total) if total
                != 0 else neg_inf[F32]()
            )
            if total != total:
                norm = nan[F32]()
                state_lse = nan[F32]()
            var slot = item * heads + r0 + r
            comptime for i in range(PER_THREAD):
                var d = tid + i * MLA_GPU_THREADS
                if d < ckv_dim:
                    var value = acc[r * PER_THREAD + i] * norm
                    if partial:
                        work.partial_o[unsafe_offset=slot * ckv_dim + d] = value
                    else:
                        output[
                            unsafe_offset=(first_row + r) * ckv_dim + d
                        ] = narrow[q_dtype, 1](value)
            if tid == 0:
                if partial:
                    work.partial_lse[unsafe_offset=slot] = state_lse
                else:
                    lse[unsafe_offset=first_row + r] = state_lse


def mla_merge_gpu_kernel[
    dtype: DType
](
    work: AttentionWork,
    output: Ptr[dtype],
    lse: Ptr[F32],
    num_heads: Int64,
    ckv_dim: Int64,
):
    """Grid (batch x num_heads): merges one (request, head)'s key-split
    partial states into its output row, the block's threads taking every
    block_dim-th element."""
    var heads = Int(num_heads)
    merge_split_head(
        work,
        output,
        lse,
        heads,
        Int(ckv_dim),
        Int(block_idx.x) // heads,
        Int(block_idx.x) % heads,
        Int(thread_idx.x),
        Int(block_dim.x),
    )
