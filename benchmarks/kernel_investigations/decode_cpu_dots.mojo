"""Scoring of bfloat16 K on hot rows, two ways in one process: float32 q
against K widened for FMAs, and (on an AVX512_BF16 target) bfloat16 q
against K in `dot_bf16`s, as `attention_task` scores when `raw_bf16_q`
holds. Timed in alternation, best of ROUNDS each, ns per (token, KV head),
head_dim 128, one KV head of GQA group 1, 2, 4 and 8.

    mojo run -I . benchmarks/kernel_investigations/decode_cpu_dots.mojo
"""

from std.memory.alloc import unsafe_alloc
from std.time import perf_counter_ns

from mojo_ops.attention.cpu.key_chunks import CHUNK, BlockPrefetch
from mojo_ops.attention.cpu.scores import score_tile
from mojo_ops.cache.paged_kv_cache import Ptr
from mojo_ops.simd.widen import DOT_BF16

comptime HEAD_DIM = 128
comptime ITERATIONS = 4000
comptime ROUNDS = 9


def time_scoring[
    group: Int, raw_q: Bool
](
    q: Ptr[DType.float32],
    k: Ptr[DType.bfloat16],
    rows: Ptr[DType.int64],
    scores: Ptr[DType.float32],
) -> Float64:
    var quiet = BlockPrefetch[DType.bfloat16](k, rows, 0, 0, 1, 0, 0, True)
    var start = Int(perf_counter_ns())
    for _ in range(ITERATIONS):
        # A q element that depends on the last scores: each call is work.
        q[unsafe_offset=0] = scores[unsafe_offset=0] * 1e-30
        score_tile[group, DType.bfloat16, raw_q=raw_q](
            HEAD_DIM, q, k, 0, rows, 0, CHUNK, scores, quiet
        )
    return Float64(Int(perf_counter_ns()) - start) / Float64(ITERATIONS * CHUNK)


def bench[group: Int]():
    var k = rebind[Ptr[DType.bfloat16]](
        unsafe_alloc[BFloat16](CHUNK * HEAD_DIM, alignment=64)
    )
    for i in range(CHUNK * HEAD_DIM):
        k[unsafe_offset=i] = BFloat16(Float32(i % 7) * 0.125 - 0.3)
    var rows = rebind[Ptr[DType.int64]](
        unsafe_alloc[Int64](CHUNK, alignment=64)
    )
    for j in range(CHUNK):
        rows[unsafe_offset=j] = Int64(j * HEAD_DIM)
    var q = rebind[Ptr[DType.float32]](
        unsafe_alloc[Float32](group * HEAD_DIM, alignment=64)
    )
    for i in range(group * HEAD_DIM):
        q[unsafe_offset=i] = 0.001 * Float32(i % HEAD_DIM)
    var scores = rebind[Ptr[DType.float32]](
        unsafe_alloc[Float32](group * CHUNK, alignment=64)
    )
    var fma = Float64.MAX
    var dots = Float64.MAX
    for _ in range(ROUNDS):
        fma = min(fma, time_scoring[group, False](q, k, rows, scores))
        comptime if DOT_BF16:
            dots = min(dots, time_scoring[group, True](q, k, rows, scores))
    print(
        "group",
        group,
        "scoring hot, ns per (token, KV head): widened K + FMAs",
        fma,
        "| dot_bf16",
        dots if DOT_BF16 else Float64(0),
        "| ratio",
        dots / fma if DOT_BF16 else Float64(0),
    )
    k.unsafe_free()
    rows.unsafe_free()
    q.unsafe_free()
    scores.unsafe_free()


def main():
    print("AVX512_BF16 dot products:", DOT_BF16)
    bench[1]()
    bench[2]()
    bench[4]()
    bench[8]()
