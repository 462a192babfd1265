"""A task's products over an int8 pool in integer arithmetic: q and the
probabilities rounded to 16-bit codes and multiplied by the pool's K and V
codes, two products to a 32-bit lane (`dot_i16`), instead of the codes
widened to float32 (products.mojo). A multiplying instruction then takes
twice the products of a float32 FMA: one `vpdpwssd` with VNNI, or
`vpmaddwd` with AVX2, whose add goes to a port the multiplies leave free.

- Scores: each query row is rounded to codes within CODE_MAX, q[r] ~
  sq[r] * cq[r], and score[r, j] = sq[r] * w[j] * (cq[r] . ck[j]), w[j]
  key j's row scale: the int32 sum is exact.
- Values: the probabilities weighted by V's row scales, all >= 0, are
  rounded per row and chunk, p[r, j] ~ sp[r] * cp[r, j], and acc[r] +=
  sp[r] * (cp[r] . cv), V's codes two keys to a lane
  (`interleave_value_pairs`).

A code is within 1.5e-5 of its row's largest magnitude (half of 1 /
CODE_MAX), where float32 rounds within 6e-8 of the value and the pool's
own int8 rows within 4e-3 of their largest: errors some 250 times smaller
than the pool's (docs/performance.md, "The KV cache in 8 bits", for what
they do to a model). The sums stay within int32: CODE_MAX * 127 times
head_dim (up to 256) or CHUNK terms is below 2^31.
"""

from std.memory import bitcast, stack_allocation
from std.sys import llvm_intrinsic

from ...cache.paged_kv_cache import Ptr
from ...simd.int8_dot import MADDUBS, VNNI
from ...simd.lane_reduce import reduce_many
from ...simd.widen import F32, W
from .key_chunks import CHUNK, BlockPrefetch, RowOffsets
from .products import (
    CODE_PAIRS,
    fetches_per_tile,
    product_rows,
    score_transposed,
    transpose_chunk,
)
from .task_state import TaskState

comptime CODE_PRODUCTS = VNNI or MADDUBS
"""Whether tasks of products over an int8 pool multiply codes on this
target: x86 with VNNI (`vpdpwssd`) or AVX2 (`vpmaddwd`, then `vpaddd` on
another port), where a multiply takes twice an FMA's products. Elsewhere
they widen the codes to float32."""
comptime CODE_MAX = 32767
"""The largest magnitude of q's and the probabilities' codes."""

comptime I16 = DType.int16
comptime I32 = DType.int32


@always_inline
def takes_codes(head_dim: Int) -> Bool:
    """Whether a task of products over an int8 pool of head_dim multiplies
    codes: on a target with CODE_PRODUCTS, for rows of whole pairs of
    vectors (as the float products take them)."""
    return CODE_PRODUCTS and head_dim % (2 * W) == 0


@always_inline
def code_tile[
    tile: Int, width: Int
](
    src: Ptr[F32],
    src_stride: Int,
    weights: Ptr[F32],
    codes: Ptr[I16],
    codes_stride: Int,
    scales: Ptr[F32],
):
    """Rows i < tile of src [tile, width] (src_stride apart), times weights
    [width], as int16 codes within CODE_MAX (codes_stride
    apart) and their scales, max |row| / CODE_MAX (0 for a row of zeros,
    whose codes are 0); src keeps the weighted rows. The tile's maxima come
    out of one transposed reduction, so that its rows' roundings overlap
    instead of each waiting on its own maximum."""
    var tops = stack_allocation[tile, SIMD[F32, W]]()
    comptime for g in range(tile):
        var row = src.unsafe_offset(g * src_stride)
        var top = SIMD[F32, W](0)
        comptime for c in range(0, width, W):
            var x = row.unsafe_offset(c).unsafe_load[width=W]() * (
                weights.unsafe_offset(c).unsafe_load[width=W]()
            )
            row.unsafe_offset(c).unsafe_store(x)
            top = max(top, abs(x))
        tops[unsafe_offset=g] = top
    var maxima = reduce_many[tile, is_max=True](tops)
    var inverse = maxima.gt(0).select(
        Float32(CODE_MAX) / maxima, SIMD[F32, tile](0)
    )
    scales.unsafe_store(maxima / Float32(CODE_MAX))
    comptime for g in range(tile):
        var row = src.unsafe_offset(g * src_stride)
        comptime for c in range(0, width, W):
            var code = llvm_intrinsic["llvm.roundeven", SIMD[F32, W]](
                row.unsafe_offset(c).unsafe_load[width=W]() * inverse[g]
            )
            codes.unsafe_offset(g * codes_stride + c).unsafe_store(
                code.cast[I32]().cast[I16]()
            )


@always_inline
def code_rows[
    width: Int
](
    count: Int,
    src: Ptr[F32],
    src_stride: Int,
    weights: Ptr[F32],
    codes: Ptr[I16],
    codes_stride: Int,
    scales: Ptr[F32],
):
    """`code_tile` over rows 0..count, in tiles of 8, 4, 2 and 1."""
    var r = 0
    while r < count:
        var left = count - r
        var taken = False
        comptime for i in range(4):
            comptime tile = 8 >> i
            if not taken and left >= tile:
                code_tile[tile, width](
                    src.unsafe_offset(r * src_stride),
                    src_stride,
                    weights,
                    codes.unsafe_offset(r * codes_stride),
                    codes_stride,
                    scales.unsafe_offset(r),
                )
                r += tile
                taken = True


def quantize_query_codes(st: TaskState, count: Int, head_dim: Int):
    """Rows r < count of st.q [count, head_dim] as codes, st.q_codes, and
    their scales, st.q_code_scale (see the module docstring)."""
    for r in range(count):
        # head_dim is a run-time value: a row at a time, in vectors.
        var row = st.q.unsafe_offset(r * head_dim)
        var top = SIMD[F32, W](0)
        for c in range(0, head_dim, W):
            top = max(top, abs(row.unsafe_offset(c).unsafe_load[width=W]()))
        var amax = top.reduce_max()
        var inverse = Float32(CODE_MAX) / amax if amax > 0 else Float32(0)
        var codes = st.q_codes.unsafe_offset(r * head_dim)
        for c in range(0, head_dim, W):
            var code = llvm_intrinsic["llvm.roundeven", SIMD[F32, W]](
                row.unsafe_offset(c).unsafe_load[width=W]() * inverse
            )
            codes.unsafe_offset(c).unsafe_store(code.cast[I32]().cast[I16]())
        st.q_code_scale[unsafe_offset=r] = amax / Float32(CODE_MAX)


def score_chunk_codes(
    head_dim: Int,
    st: TaskState,
    count: Int,
    k: Ptr[DType.int8],
    rows: RowOffsets,
    n: Int,
    prefetcher: BlockPrefetch,
):
    """st.scores[r * CHUNK + j] = q[r] . k[row j] * w[j] for the rows r <
    count of one KV head and the chunk's keys j < n, from q's codes
    (`quantize_query_codes`) and K's, w K's row scales in st.row_scales
    (finite for every key of the chunk); the scores of keys from n to the
    chunk's end are finite. Meanwhile asks for the prefetcher's block."""
    transpose_chunk[DType.int8, CODE_PAIRS](head_dim, k, rows, n, st.kt)
    score_transposed[CODE_PAIRS](
        head_dim,
        rebind[Ptr[F32]](st.q_codes),
        head_dim // 2,
        count,
        st.kt,
        n,
        st.scores,
        prefetcher,
    )
    for r in range(count):
        var row = st.scores.unsafe_offset(r * CHUNK)
        var scale = st.q_code_scale[unsafe_offset=r]
        comptime for c in range(0, CHUNK, W):
            var sums = bitcast[I32, W](
                row.unsafe_offset(c).unsafe_load[width=W]()
            )
            var weights = st.row_scales.unsafe_offset(c).unsafe_load[width=W]()
            row.unsafe_offset(c).unsafe_store(
                sums.cast[F32]() * (weights * scale)
            )


def interleave_value_pairs(
    head_dim: Int, v: Ptr[DType.int8], rows: RowOffsets, n: Int, vp: Ptr[F32]
):
    """V's codes of a chunk as int16 pairs of keys, for `product_tile`'s
    CODE_PAIRS form: slot vp[t * head_dim + d] holds element d of the value
    rows of keys 2t and 2t + 1 (at v + rows[j]), 0 for keys from n on, for t
    < ceil(n / 2); head_dim a multiple of W."""
    for t in range((n + 1) // 2):
        var first = v.unsafe_offset(Int(rows[unsafe_offset=2 * t]))
        var has_second = 2 * t + 1 < n
        var second = v.unsafe_offset(
            Int(rows[unsafe_offset=2 * t + 1]) if has_second else 0
        )
        for d in range(0, head_dim, W):
            var a = first.unsafe_offset(d).unsafe_load[width=W]().cast[I16]()
            var b = SIMD[I16, W](0)
            if has_second:
                b = second.unsafe_offset(d).unsafe_load[width=W]().cast[I16]()
            vp.unsafe_offset(t * head_dim + d).unsafe_store(
                bitcast[F32, W](a.interleave(b))
            )


def accumulate_chunk_codes(
    head_dim: Int,
    st: TaskState,
    count: Int,
    v: Ptr[DType.int8],
    rows: RowOffsets,
    n: Int,
    prefetcher: BlockPrefetch,
):
    """Adds sum_j p[r, j] * w[j] * v[row j] over the chunk's keys j < n to
    st.acc[r] for the rows r < count of one KV head, p the probabilities in
    st.scores (0 past the keys a row sees; weighted in place) and w V's row
    scales in st.row_scales (finite for every key of the chunk), from their
    codes and V's. st.krot holds V's pairs meanwhile. Meanwhile asks for the
    prefetcher's block."""
    code_rows[CHUNK](
        count,
        st.scores,
        CHUNK,
        st.row_scales,
        rebind[Ptr[I16]](st.p_codes),
        CHUNK,
        st.p_code_scale,
    )
    interleave_value_pairs(head_dim, v, rows, n, st.krot)
    var slices = head_dim // (2 * W)
    var per_tile = fetches_per_tile(prefetcher, slices, count)
    var fetched = 0
    for s in range(slices):
        product_rows[accumulate=True, form=CODE_PAIRS](
            count,
            (n + 1) // 2,
            st.p_codes,
            CHUNK // 2,
            st.krot.unsafe_offset(s * 2 * W),
            head_dim,
            st.acc.unsafe_offset(s * 2 * W),
            head_dim,
            prefetcher,
            fetched,
            per_tile,
            st.p_code_scale,
        )
