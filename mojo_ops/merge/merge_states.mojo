"""Merging attention states (v, s): FlashInfer's cascade helpers.

A state is the attention output v over some keys and s, the base-2
log-sum-exp of its scores. States over disjoint key sets merge exactly:

    M = max_i s_i,  w_i = 2^(s_i - M),  v = sum_i w_i v_i / sum_i w_i,
    s = M + log2(sum_i w_i)

A state over no keys has s = -inf and weighs nothing; merging only such
states gives v = 0, s = -inf. Split-K decode merges its partial states with
the same code.
"""

import extensibility
from extensibility import InputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu import barrier, block_dim, block_idx, thread_idx
from max.gpu.host import DeviceContext
from std.math import log2
from std.memory import stack_allocation
from std.sys import simd_width_of
from std.utils.numerics import nan, neg_inf

from ..cache.paged_kv_cache import Ptr
from ..cache.tensor_access import ptr_of
from ..simd.exp2 import exp2_f32, is_nan_f32
from ..simd.widen import load_f32, narrow
from ..work_queue import parallel_row_blocks

comptime SLICE = 256
"""Elements of a head merged per pass (a stack buffer of float32)."""
comptime W = simd_width_of[DType.float32]()
"""Float32 lanes per vector: what one CPU worker merges at a time."""
comptime TASK_ELEMENTS = 1 << 15
"""Elements of v one CPU task reads (64-128 KiB): rows are grouped into
tasks of about this size, so that dispatch costs little beside the work."""


@always_inline
def merge_row[
    in_dtype: DType, out_dtype: DType
](
    v: Ptr[in_dtype],
    v_stride: Int,
    s: Ptr[DType.float32],
    s_stride: Int,
    count: Int,
    head_dim: Int,
    out_v: Ptr[out_dtype],
    out_s: Ptr[DType.float32],
    first: Int,
    step: Int,
):
    """Merges `count` states of one head; state i is v[i * v_stride : + head_dim],
    s[i * s_stride]. This worker writes elements first, first + step, ... of the
    head (CPU: 0, 1; GPU: thread index, block size) and, when first == 0, out_s.
    """
    var top = neg_inf[DType.float32]()
    var has_nan = False
    for i in range(count):
        top = max(top, s[unsafe_offset=i * s_stride])
        has_nan = has_nan or is_nan_f32(s[unsafe_offset=i * s_stride])
    if has_nan:
        # NaN is data: max() and the exp2 clamp would drop it, so a NaN s
        # makes the whole merged state NaN.
        if first == 0:
            out_s[unsafe_offset=0] = nan[DType.float32]()
        var e = first
        while e < head_dim:
            out_v[unsafe_offset=e] = narrow[out_dtype, 1](nan[DType.float32]())
            e += step
        return
    var total: Float32 = 0
    if top != neg_inf[DType.float32]():
        for i in range(count):
            total += exp2_f32[1](s[unsafe_offset=i * s_stride] - top)
    if first == 0:
        out_s[unsafe_offset=0] = (
            top + log2(total) if total > 0 else neg_inf[DType.float32]()
        )
    # head_dim in slices of SLICE: each state's weight is computed once per
    # slice, not once per element. One worker per head (step 1: the CPU)
    # takes whole vectors of it; GPU threads take every step-th element.
    var acc = stack_allocation[SLICE, Float32]()
    var d0 = 0
    while d0 < head_dim:
        var width = min(SLICE, head_dim - d0)
        var vectors = width // W if step == 1 else 0
        for c in range(vectors):
            acc.unsafe_offset(c * W).unsafe_store(SIMD[DType.float32, W](0))
        var d = first + vectors * W
        while d < width:
            acc[unsafe_offset=d] = 0
            d += step
        if total > 0:
            for i in range(count):
                var w = exp2_f32[1](s[unsafe_offset=i * s_stride] - top) / total
                var row = v.unsafe_offset(i * v_stride + d0)
                for c in range(vectors):
                    var a = acc.unsafe_offset(c * W)
                    a.unsafe_store(
                        row.unsafe_offset(c * W)
                        .unsafe_load[width=W]()
                        .cast[DType.float32]()
                        .fma(w, a.unsafe_load[width=W]())
                    )
                d = first + vectors * W
                while d < width:
                    acc[unsafe_offset=d] += (
                        w * row[unsafe_offset=d].cast[DType.float32]()
                    )
                    d += step
        for c in range(vectors):
            out_v.unsafe_offset(d0 + c * W).unsafe_store(
                narrow[out_dtype](
                    acc.unsafe_offset(c * W).unsafe_load[width=W]()
                )
            )
        d = first + vectors * W
        while d < width:
            out_v[unsafe_offset=d0 + d] = narrow[out_dtype, 1](
                acc[unsafe_offset=d]
            )
            d += step
        d0 += SLICE


@extensibility.register("pagedkv_merge_state_in_place")
struct MergeStateInPlace:
    """(v, s) <- merge((v, s), (v_other, s_other)); v, v_other [N, H, D], s [N, H].
    """

    @staticmethod
    def execute[
        target: StaticString
    ](
        v: MutableInputTensor[rank=3, ...],
        s: MutableInputTensor[dtype=DType.float32, rank=2, ...],
        v_other: InputTensor[dtype=v.dtype, rank=3, ...],
        s_other: InputTensor[dtype=DType.float32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var rows = v.dim_size(0) * v.dim_size(1)
        var head_dim = v.dim_size(2)
        merge_pairs[target](
            ptr_of(v),
            ptr_of(s),
            ptr_of(v_other),
            ptr_of(s_other),
            rows,
            head_dim,
            ctx,
        )


@always_inline
def pair_weights(sa: Float32, sb: Float32) -> Tuple[Float32, Float32, Float32]:
    """(w_a, w_b, merged s) of two states' base-2 log-sum-exps; w sum to 1."""
    if is_nan_f32(sa) or is_nan_f32(sb):
        var n = nan[DType.float32]()
        return (n, n, n)
    var top = max(sa, sb)
    if top == neg_inf[DType.float32]():
        return (Float32(0), Float32(0), top)
    var wa = exp2_f32[1](sa - top)
    var wb = exp2_f32[1](sb - top)
    var total = wa + wb
    return (wa / total, wb / total, top + log2(total))


@always_inline
def blend[
    dtype: DType
](
    v: Ptr[dtype],
    v_other: Ptr[dtype],
    weights: Tuple[Float32, Float32, Float32],
    head_dim: Int,
    first: Int,
    step: Int,
):
    """Blends in place: v[d] <- w_a v[d] + w_b v_other[d], d = first, first + step, ...
    """
    var d = first
    if step == 1:
        while d + W <= head_dim:
            var merged = weights[0] * load_f32[dtype, W](v, d) + (
                weights[1] * load_f32[dtype, W](v_other, d)
            )
            v.unsafe_offset(d).unsafe_store(narrow[dtype](merged))
            d += W
    while d < head_dim:
        var merged = weights[0] * load_f32[dtype, 1](v, d) + (
            weights[1] * load_f32[dtype, 1](v_other, d)
        )
        v[unsafe_offset=d] = narrow[dtype, 1](merged)
        d += step


def merge_pairs[
    target: StaticString, dtype: DType
](
    v: Ptr[dtype],
    s: Ptr[DType.float32],
    v_other: Ptr[dtype],
    s_other: Ptr[DType.float32],
    rows: Int,
    head_dim: Int,
    ctx: DeviceContext,
) raises:
    """Merges row r of (v_other, s_other) into row r of (v, s), in place."""
    if rows == 0:
        return
    comptime if target == "cpu":

        def task(
            first: Int, end: Int
        ) {var v, var s, var v_other, var s_other, var head_dim}:
            for r in range(first, end):
                var w = pair_weights(
                    s[unsafe_offset=r], s_other[unsafe_offset=r]
                )
                blend(
                    v.unsafe_offset(r * head_dim),
                    v_other.unsafe_offset(r * head_dim),
                    w,
                    head_dim,
                    0,
                    1,
                )
                s[unsafe_offset=r] = w[2]

        parallel_row_blocks(task, rows, TASK_ELEMENTS // max(2 * head_dim, 1))
    else:

        def kernel(
            v: Ptr[dtype],
            s: Ptr[DType.float32],
            v_other: Ptr[dtype],
            s_other: Ptr[DType.float32],
            head_dim: Int64,
        ):
            var r = Int(block_idx.x)
            var w = pair_weights(s[unsafe_offset=r], s_other[unsafe_offset=r])
            # Every thread has read s[r] before thread 0 overwrites it.
            barrier()
            blend(
                v.unsafe_offset(r * Int(head_dim)),
                v_other.unsafe_offset(r * Int(head_dim)),
                w,
                Int(head_dim),
                Int(thread_idx.x),
                Int(block_dim.x),
            )
            if thread_idx.x == 0:
                s[unsafe_offset=r] = w[2]

        ctx.enqueue_function[kernel](
            v, s, v_other, s_other, Int64(head_dim), grid_dim=rows, block_dim=64
        )


@extensibility.register("pagedkv_merge_states")
struct MergeStates:
    """Merges S states per row: v [N, S, H, D], s [N, S, H] -> out_v [N, H, D], out_s [N, H].
    """

    @staticmethod
    def execute[
        target: StaticString
    ](
        out_v: MutableInputTensor[rank=3, ...],
        out_s: MutableInputTensor[dtype=DType.float32, rank=2, ...],
        v: InputTensor[dtype=out_v.dtype, rank=4, ...],
        s: InputTensor[dtype=DType.float32, rank=3, ...],
        ctx: DeviceContext,
    ) raises:
        var n = v.dim_size(0)
        var states = v.dim_size(1)
        var heads = v.dim_size(2)
        var head_dim = v.dim_size(3)
        var vp = ptr_of(v)
        var sp = ptr_of(s)
        var ov = ptr_of(out_v)
        var os = ptr_of(out_s)
        if n * heads == 0:
            return
        comptime if target == "cpu":

            def task(
                first: Int,
                end: Int,
            ) {
                var vp,
                var sp,
                var ov,
                var os,
                var states,
                var heads,
                var head_dim,
            }:
                for row in range(first, end):
                    var i = row // heads
                    var h = row % heads
                    merge_row(
                        vp.unsafe_offset((i * states * heads + h) * head_dim),
                        heads * head_dim,
                        sp.unsafe_offset(i * states * heads + h),
                        heads,
                        states,
                        head_dim,
                        ov.unsafe_offset(row * head_dim),
                        os.unsafe_offset(row),
                        0,
                        1,
                    )

            parallel_row_blocks(
                task, n * heads, TASK_ELEMENTS // max(states * head_dim, 1)
            )
        else:

            def kernel(
                vp: Ptr[v.dtype],
                sp: Ptr[DType.float32],
                ov: Ptr[v.dtype],
                os: Ptr[DType.float32],
                states: Int64,
                heads: Int64,
                head_dim: Int64,
            ):
                var row = Int(block_idx.x)
                var h = row % Int(heads)
                var i = row // Int(heads)
                var base = i * Int(states) * Int(heads) + h
                merge_row(
                    vp.unsafe_offset(base * Int(head_dim)),
                    Int(heads * head_dim),
                    sp.unsafe_offset(base),
                    Int(heads),
                    Int(states),
                    Int(head_dim),
                    ov.unsafe_offset(row * Int(head_dim)),
                    os.unsafe_offset(row),
                    Int(thread_idx.x),
                    Int(block_dim.x),
                )

            ctx.enqueue_function[kernel](
                vp,
                sp,
                ov,
                os,
                Int64(states),
                Int64(heads),
                Int64(head_dim),
                grid_dim=n * heads,
                block_dim=64,
            )
