"""How much arithmetic the memory system hides while decode streams K/V.

    mojo run -I . benchmarks/decode_cpu_overlap.mojo

Streams the bfloat16 K/V rows of 32 requests x 2048 tokens (8 KV heads,
head_dim 128, pages of 16 tokens in random order: 512 MiB) in the CPU decode
kernel's order (per chunk of CHUNK tokens and KV head: its K rows, then its
V rows), with the kernel's row prefetch, and does FMAS float32 FMAs per 64-byte line it
reads. Prints GB/s (best of 5) on 1 and on all cores for 0, 8 and 16 FMAs per
line. The decode kernel's own arithmetic is about 12 FMA-port operations per
line at GQA group 4 (`decode_cpu_chunk.mojo`): the row for 16 is the most
that kernel can expect to read at; the row for 0 is what the access pattern
alone allows.

The same rows again with every request's pages among HOT_PAGES (the pool
stays in L2) say what the cores alone can do: where the rows from memory
read about as fast as the hot ones, the loop is bound by its arithmetic, not
by the memory.
"""

from std.memory import bitcast, stack_allocation
from std.memory.alloc import unsafe_alloc
from std.random import random_ui64, seed
from std.sys import num_physical_cores
from std.sys.intrinsics import PrefetchOptions, prefetch
from std.time import perf_counter_ns

from max.algorithm import sync_parallelize

from mojo_ops.key_chunks import CHUNK, PREFETCH_BYTES
from mojo_ops.paged_kv_cache import Ptr

comptime W = 16
comptime F32 = DType.float32
comptime BF16 = DType.bfloat16
comptime PAGE_SIZE = 16
comptime KV_HEADS = 8
comptime HEAD_DIM = 128
comptime LINE = 32
"""Elements (bfloat16) per 64-byte line."""
comptime HOT_PAGES = 4
"""Pages the L2-resident rows cycle through: 256 KiB."""
comptime ROW_LINES = HEAD_DIM // LINE
comptime TOKEN_ELEMS = KV_HEADS * HEAD_DIM
comptime HALF_ELEMS = PAGE_SIZE * TOKEN_ELEMS
"""A page's K (or V) half: [PAGE_SIZE, KV_HEADS, HEAD_DIM], NHD."""
comptime PAGE_ELEMS = 2 * HALF_ELEMS
comptime ROWS_PER_HEAD = 2 * CHUNK
"""Rows a (chunk, KV head) consumes: CHUNK K rows, then CHUNK V rows."""
comptime ROWS_PER_CHUNK = KV_HEADS * ROWS_PER_HEAD
comptime DISTANCE = PREFETCH_BYTES // (HEAD_DIM * 2)
"""The kernel's prefetch distance for 16-bit rows, in rows."""


@always_inline
def row(pool: Ptr[BF16], pages: Ptr[DType.int64], index: Int) -> Ptr[BF16]:
    """The index-th row in consumption order."""
    var chunk = index // ROWS_PER_CHUNK
    var head = (index % ROWS_PER_CHUNK) // ROWS_PER_HEAD
    var r = index % ROWS_PER_HEAD
    var token = chunk * CHUNK + r % CHUNK
    var page = Int(pages[unsafe_offset=token // PAGE_SIZE])
    return pool.unsafe_offset(
        page * PAGE_ELEMS
        + (r // CHUNK) * HALF_ELEMS
        + (token % PAGE_SIZE) * TOKEN_ELEMS
        + head * HEAD_DIM
    )


def stream_request[
    fmas: Int
](pool: Ptr[BF16], pages: Ptr[DType.int64], num_pages: Int) -> Float32:
    """Reads one request's K/V rows, fmas FMAs per line; returns a sum (kept
    so the work is not optimised away)."""
    var acc = stack_allocation[8, SIMD[F32, W]]()
    comptime for i in range(8):
        acc[unsafe_offset=i] = 0
    var rows = num_pages * PAGE_SIZE // CHUNK * ROWS_PER_CHUNK
    for index in range(rows):
        if index + DISTANCE < rows:
            var ahead = row(pool, pages, index + DISTANCE)
            comptime for l in range(ROW_LINES):
                prefetch[PrefetchOptions().for_read().medium_locality()](
                    ahead.unsafe_offset(l * LINE)
                )
        var p = row(pool, pages, index)
        comptime for l in range(ROW_LINES):
            var words = bitcast[DType.uint32, W](
                p.unsafe_offset(l * LINE).unsafe_load[width=LINE]()
            )
            var even = bitcast[F32, W](words << 16)
            var odd = bitcast[F32, W](words & 0xFFFF0000)
            comptime if fmas == 0:
                acc[unsafe_offset=0] += even + odd
            comptime for f in range(fmas // 2):
                acc[unsafe_offset=f % 8] = even.fma(
                    odd, acc[unsafe_offset=f % 8]
                )
                acc[unsafe_offset=(f + 4) % 8] = odd.fma(
                    even, acc[unsafe_offset=(f + 4) % 8]
                )
    var total = acc[unsafe_offset=0]
    comptime for i in range(1, 8):
        total += acc[unsafe_offset=i]
    return total.reduce_add()


def gbps[
    fmas: Int
](
    pool: Ptr[BF16],
    table: Ptr[DType.int64],
    requests: Int,
    pages_per_request: Int,
    threads: Int,
) raises -> Float64:
    var sums = rebind[Ptr[F32]](unsafe_alloc[Float32](threads, alignment=64))
    var best = 0.0
    for _ in range(5):
        var start = perf_counter_ns()

        def worker(
            t: Int,
        ) {
            var sums,
            var pool,
            var table,
            var requests,
            var pages_per_request,
            var threads,
        }:
            var total: Float32 = 0
            var b = t
            while b < requests:
                total += stream_request[fmas](
                    pool,
                    table.unsafe_offset(b * pages_per_request),
                    pages_per_request,
                )
                b += threads
            sums[unsafe_offset=t] = total

        sync_parallelize(worker, threads)
        var seconds = Float64(perf_counter_ns() - start)
        var nbytes = requests * pages_per_request * PAGE_ELEMS * 2
        best = max(best, Float64(nbytes) / seconds)
    sums.unsafe_free()
    return best


def main() raises:
    var requests = 32
    var pages_per_request = 2048 // PAGE_SIZE
    var num_pages = requests * pages_per_request
    var pool = rebind[Ptr[BF16]](
        unsafe_alloc[BFloat16](num_pages * PAGE_ELEMS, alignment=4096)
    )
    for i in range(num_pages * PAGE_ELEMS // LINE):
        pool.unsafe_offset(i * LINE).unsafe_store(SIMD[BF16, LINE](0.5))
    # A page table in random order (Fisher-Yates), as a long-running
    # server's pool ends up.
    var table = rebind[Ptr[DType.int64]](
        unsafe_alloc[Int64](num_pages, alignment=64)
    )
    for i in range(num_pages):
        table[unsafe_offset=i] = Int64(i)
    seed(1)
    for i in range(num_pages - 1, 0, -1):
        var j = Int(random_ui64(0, UInt64(i)))
        var swap = table[unsafe_offset=i]
        table[unsafe_offset=i] = table[unsafe_offset=j]
        table[unsafe_offset=j] = swap
    var hot = rebind[Ptr[DType.int64]](
        unsafe_alloc[Int64](num_pages, alignment=64)
    )
    for i in range(num_pages):
        hot[unsafe_offset=i] = table[unsafe_offset=i] % HOT_PAGES
    var cores = num_physical_cores()
    for pages in [(table, "memory"), (hot, "L2")]:
        for threads in [1, cores]:
            print(
                threads,
                "thread(s), rows from",
                pages[1],
                "GB/s with 0 / 8 / 16 FMAs per line:",
                gbps[0](pool, pages[0], requests, pages_per_request, threads),
                gbps[8](pool, pages[0], requests, pages_per_request, threads),
                gbps[16](pool, pages[0], requests, pages_per_request, threads),
            )
    pool.unsafe_free()
    table.unsafe_free()
    hot.unsafe_free()
