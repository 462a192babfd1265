"""A task of products' chunk loop over an int8 pool, hot in L1/L2 on one
core, piece by piece, beside the core's FMA peak measured in the same run.

SmolLM2's shared-prefix decode item: 96 query rows of one KV head (32
requests x a GQA group of 3), head_dim 64, chunks of CHUNK keys. Two
forms of the loop: the codes widened to float32 for FMAs (products.mojo),
and the codes multiplied as int16 pairs (code_products.mojo); for each,
the whole loop (scores, online softmax, V) and its parts, in ns per chunk
and KV head, the best of REPEATS runs.

    mojo build -I . --target-cpu x86-64-v3 -o /tmp/products_chunk \
        benchmarks/kernel_investigations/products_chunk.mojo && /tmp/products_chunk

(`--target-cpu x86-64-v3` builds the AVX2 branches; leave it out for the
host's.) On a 2-vCPU AMD EPYC guest (Zen 4, AVX2 build), 2026-11-29: FMA
peak 7.3 vector FMAs per ns on a core; the widened loop 8.6 us a chunk
(78% of that peak, its two products alone 95-98%), the loop of codes 6.6
us (scores 2.4, the softmax 1.1-1.25, V's 3.1 with 0.65 of it rounding
the probabilities to codes). The loop of codes is faster because
`vpmaddwd` takes 16 products where an FMA takes 8 and its add issues on
another port; AVX2 multiplies codes since (docs/design.md, "Kernel
notes").
"""

from std.memory.alloc import unsafe_alloc
from std.time import perf_counter_ns

from mojo_ops.attention.cpu.code_products import (
    accumulate_chunk_codes,
    code_rows,
    quantize_query_codes,
    score_chunk_codes,
)
from mojo_ops.attention.cpu.key_chunks import CHUNK, BlockPrefetch
from mojo_ops.attention.cpu.products import (
    FLOATS,
    accumulate_chunk,
    product_rows,
    score_chunk,
    score_transposed,
    transpose_keys,
)
from mojo_ops.attention.cpu.softmax import softmax_rows
from mojo_ops.attention.cpu.task_state import TaskState
from mojo_ops.attention.params import AttentionParams
from mojo_ops.cache.paged_kv_cache import Ptr
from mojo_ops.simd.widen import W
from rig_parts import fma_rate, no_mask

comptime HEAD_DIM = 64
comptime ROWS = 96
comptime KV_HEADS = 3
comptime ITERATIONS = 3000
comptime REPEATS = 7
"""Timed runs of ITERATIONS chunks; the best is printed (the machine is
shared)."""


def codes(n: Int) -> Ptr[DType.int8]:
    """n int8 codes in [-6, 6]."""
    var p = rebind[Ptr[DType.int8]](unsafe_alloc[Int8](n, alignment=64))
    for i in range(n):
        p[unsafe_offset=i] = Int8((i * 7919) % 13 - 6)
    return p


def per_chunk(start: Int) -> Float64:
    """ns per chunk since start (a perf_counter_ns reading)."""
    return Float64(Int(perf_counter_ns()) - start) / Float64(ITERATIONS)


def main() raises:
    comptime kv = DType.int8
    # Token rows as in an NHD page of an int8 pool: all KV heads of a token
    # side by side, each row's codes followed by its scale's four bytes.
    var token_stride = KV_HEADS * (HEAD_DIM + 4)
    var k = codes(CHUNK * token_stride)
    var v = codes(CHUNK * token_stride)
    var rows = rebind[Ptr[DType.int64]](
        unsafe_alloc[Int64](CHUNK, alignment=64)
    )
    for j in range(CHUNK):
        rows[unsafe_offset=j] = Int64(j * token_stride)
    var params = AttentionParams(0.125, 0, 1, 10000, 1, 1, -1, 0, False)
    var mask = no_mask()
    var st = TaskState(ROWS, HEAD_DIM)
    for r in range(ROWS):
        for c in range(HEAD_DIM):
            st.q[unsafe_offset=r * HEAD_DIM + c] = 0.001 * Float32(c)
            st.acc[unsafe_offset=r * HEAD_DIM + c] = 0
        st.m[unsafe_offset=r] = -1e30
        st.l[unsafe_offset=r] = 0
        st.row_pos[unsafe_offset=r] = 1e6
        st.alibi_log2[unsafe_offset=r] = 0
    for j in range(CHUNK):
        st.row_scales[unsafe_offset=j] = 0.01
    quantize_query_codes(st, ROWS, HEAD_DIM)
    var quiet = BlockPrefetch[kv](k, rows, 0, 0, 1, 0, 0, True)
    var peak = fma_rate()
    var fmas = Float64(2 * ROWS * CHUNK * HEAD_DIM // W)

    var widened = Float64.MAX
    var transposing = Float64.MAX
    var scoring = Float64.MAX
    var softmax = Float64.MAX
    var accumulating = Float64.MAX
    var coded = Float64.MAX
    var coded_scores = Float64.MAX
    var coding_p = Float64.MAX
    var coded_values = Float64.MAX
    for _ in range(REPEATS):
        var start = Int(perf_counter_ns())
        for i in range(ITERATIONS):
            score_chunk[kv](
                HEAD_DIM, st.q, ROWS, k, rows, CHUNK, st.kt, st.scores, quiet
            )
            softmax_rows(HEAD_DIM, params, mask, st, ROWS, CHUNK, i * CHUNK)
            accumulate_chunk[kv](
                HEAD_DIM,
                st.scores,
                ROWS,
                v,
                rows,
                CHUNK,
                st.krot,
                st.acc,
                quiet,
            )
        widened = min(widened, per_chunk(start))
        start = Int(perf_counter_ns())
        for _ in range(ITERATIONS):
            transpose_keys[kv](HEAD_DIM, k, rows, CHUNK, st.kt)
        transposing = min(transposing, per_chunk(start))
        start = Int(perf_counter_ns())
        for _ in range(ITERATIONS):
            score_transposed[FLOATS](
                HEAD_DIM, st.q, HEAD_DIM, ROWS, st.kt, CHUNK, st.scores, quiet
            )
        scoring = min(scoring, per_chunk(start))
        start = Int(perf_counter_ns())
        for i in range(ITERATIONS):
            softmax_rows(HEAD_DIM, params, mask, st, ROWS, CHUNK, i * CHUNK)
        softmax = min(softmax, per_chunk(start))
        start = Int(perf_counter_ns())
        for _ in range(ITERATIONS):
            var fetched = 0
            for s in range(HEAD_DIM // (2 * W)):
                product_rows[accumulate=True](
                    ROWS,
                    CHUNK,
                    st.scores,
                    CHUNK,
                    st.krot.unsafe_offset(s * 2 * W),
                    HEAD_DIM,
                    st.acc.unsafe_offset(s * 2 * W),
                    HEAD_DIM,
                    quiet,
                    fetched,
                    0,
                )
        accumulating = min(accumulating, per_chunk(start))
        start = Int(perf_counter_ns())
        for i in range(ITERATIONS):
            score_chunk_codes(HEAD_DIM, st, ROWS, k, rows, CHUNK, quiet)
            softmax_rows(HEAD_DIM, params, mask, st, ROWS, CHUNK, i * CHUNK)
            accumulate_chunk_codes(HEAD_DIM, st, ROWS, v, rows, CHUNK, quiet)
        coded = min(coded, per_chunk(start))
        start = Int(perf_counter_ns())
        for _ in range(ITERATIONS):
            score_chunk_codes(HEAD_DIM, st, ROWS, k, rows, CHUNK, quiet)
        coded_scores = min(coded_scores, per_chunk(start))
        start = Int(perf_counter_ns())
        for _ in range(ITERATIONS):
            code_rows[CHUNK](
                ROWS,
                st.scores,
                CHUNK,
                st.row_scales,
                rebind[Ptr[DType.int16]](st.p_codes),
                CHUNK,
                st.p_code_scale,
            )
        coding_p = min(coding_p, per_chunk(start))
        start = Int(perf_counter_ns())
        for _ in range(ITERATIONS):
            accumulate_chunk_codes(HEAD_DIM, st, ROWS, v, rows, CHUNK, quiet)
        coded_values = min(coded_values, per_chunk(start))
    var at_peak = fmas / peak
    print("FMA peak:", peak, "vector FMAs per ns on a core")
    print("the loop's FMAs at that peak:", at_peak, "ns a chunk")
    print("widened to float32, whole loop:", widened, "ns;", at_peak / widened)
    print("  K^T widened:", transposing, "ns")
    print("  scores:", scoring, "ns;", at_peak / 2 / scoring)
    print("  softmax:", softmax, "ns")
    print("  V:", accumulating, "ns;", at_peak / 2 / accumulating)
    print("codes, whole loop:", coded, "ns;", at_peak / coded)
    print("  scores:", coded_scores, "ns")
    print("  V (probabilities coded first):", coded_values, "ns")
    print("  probabilities coded:", coding_p, "ns")
    if st.acc[unsafe_offset=5] == 12345:  # Keeps the results.
        print(st.acc[unsafe_offset=5])
