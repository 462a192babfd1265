"""How the order in which decode reads K/V rows decides how fast memory
serves them, and how much arithmetic that hides.

    mojo run -I . benchmarks/kernel_investigations/decode_cpu_overlap.mojo

Streams the bfloat16 K/V rows of 32 requests x 2048 tokens (8 KV heads,
head_dim 128, pages of 16 tokens in random order: 512 MiB), each chunk of
CHUNK tokens its K rows then its V rows, in four orders:

- head by head: one head's rows of the chunk, then the next head's (the
  CPU kernel's order before blocks), rows prefetched 4 KiB ahead;
- blocks of 8 and of 16 tokens: all heads of a block's tokens before the
  next block (the kernel's order now, `block_tokens` in
  mojo_ops/attention/cpu/block_sizes.mojo),
  the next block prefetched;
- token by token: all heads of one token, then the next, 16 KiB ahead.

Each order runs with no arithmetic, with GQA group 4's: 4 float32 FMA lanes
per element read (4 query rows score each K element and fold each V
element), in the target's vectors (AVX2: 16 FMAs a 64-byte line, AVX-512:
8), and with group 8's, twice that. Prints GB/s (best of 5) on all cores,
from memory, and the arithmetic alone: the same order over 4 pages that stay
in L2. Where the arithmetic hides behind the reads, GB/s with arithmetic
stays near GB/s without; where the arithmetic is the slower, near its rate
from L2. Head by head, a run of reads is one head's 256 B piece of each of
many token rows; in blocks it stays within a few adjacent rows, which the
hardware prefetchers stream. One run on a 2-core Zen 5 VM, with twice group
4's arithmetic (16 FMAs of 16 lanes a line): 32 GB/s head by head, 42 in
blocks of 8, 41 in blocks of 16, 44 token by token. Three runs on a 2-core
Zen 3 VM (AVX2), with group 4's arithmetic: 15-20, 17-22, 16-20 and 22-24
GB/s, in each run the same as without it within the noise, and the
arithmetic alone 27-38 GB/s: there the reads hide the arithmetic in every
order. With group 8's, as slow alone (21.5-22.5 GB/s from L2) as the reads
(16-26 GB/s), two runs there read 16.6-20.2 GB/s from memory: 0.74-0.90 of
the arithmetic's rate, where reading and computing in turn would give about
half. The Zen 3 VM overlaps a core's reads with its arithmetic even where
the arithmetic is the slower. The kernel itself (`decode_cpu_chunk.mojo`,
bfloat16 at group 4, 8 KV heads a task) overlaps less: in the same session,
three times its whole task over 512 tokens with the pool in L3 (41.7, 55-59
ns per (token, KV head) on one core) beside its batch from memory on both
cores (16.7, 13.6-13.9 GB/s), it read at 0.68-0.79 of the rate of two cores
at the task's speed. With the pool in L3 its software prefetch made no
difference (41.6 ns without it), from memory it did (10.7 GB/s without it).
"""

from std.memory import stack_allocation
from std.memory.alloc import unsafe_alloc
from std.random import random_ui64, seed
from std.sys import num_physical_cores
from std.sys.intrinsics import PrefetchOptions, prefetch
from std.time import perf_counter_ns

from max.algorithm import sync_parallelize

from mojo_ops.attention.cpu.key_chunks import CHUNK
from mojo_ops.cache.paged_kv_cache import Ptr
from mojo_ops.simd.widen import BLOCK, F32, W, load_block

comptime BF16 = DType.bfloat16
comptime PAGE_SIZE = 16
comptime KV_HEADS = 8
comptime HEAD_DIM = 128
comptime LINE = 32
"""Elements (bfloat16) per 64-byte line."""
comptime GROUP4_FMAS = 4 * LINE // W
"""FMAs a line at GQA group 4: 4 lanes per element."""
comptime ROW_LINES = HEAD_DIM // LINE
comptime TOKEN_ELEMS = KV_HEADS * HEAD_DIM
comptime HALF_ELEMS = PAGE_SIZE * TOKEN_ELEMS
"""A page's K (or V) half: [PAGE_SIZE, KV_HEADS, HEAD_DIM], NHD."""
comptime PAGE_ELEMS = 2 * HALF_ELEMS
comptime ROWS_PER_CHUNK = 2 * CHUNK * KV_HEADS
"""K rows, then V rows, of every head of a chunk's tokens."""


@always_inline
def row[
    block: Int
](pool: Ptr[BF16], pages: Ptr[DType.int64], index: Int) -> Ptr[BF16]:
    """The index-th row read: per chunk, its K rows, then its V rows, in
    blocks of `block` tokens (all heads of a block's tokens, head by head,
    before the next block); a block of CHUNK tokens is the chunk head by
    head, a block of 1 token by token."""
    var chunk = index // ROWS_PER_CHUNK
    var r = index % ROWS_PER_CHUNK
    var half = r // (CHUNK * KV_HEADS)
    var w = r % (CHUNK * KV_HEADS)
    var head = (w % (block * KV_HEADS)) // block
    var token = chunk * CHUNK + w // (block * KV_HEADS) * block + w % block
    var page = Int(pages[unsafe_offset=token // PAGE_SIZE])
    return pool.unsafe_offset(
        page * PAGE_ELEMS
        + half * HALF_ELEMS
        + (token % PAGE_SIZE) * TOKEN_ELEMS
        + head * HEAD_DIM
    )


def stream_request[
    fmas: Int, block: Int, distance: Int
](pool: Ptr[BF16], pages: Ptr[DType.int64], num_pages: Int) -> Float32:
    """Reads one request's K/V rows in blocks of `block` tokens, prefetching
    the row `distance` rows ahead, fmas FMAs per line; returns a sum (kept
    so the work is not optimised away)."""
    var acc = stack_allocation[8, SIMD[F32, W]]()
    comptime for i in range(8):
        acc[unsafe_offset=i] = 0
    var rows = num_pages * PAGE_SIZE // CHUNK * ROWS_PER_CHUNK
    for index in range(rows):
        if index + distance < rows:
            var ahead = row[block](pool, pages, index + distance)
            comptime for l in range(ROW_LINES):
                prefetch[PrefetchOptions().for_read().medium_locality()](
                    ahead.unsafe_offset(l * LINE)
                )
        var p = row[block](pool, pages, index)
        comptime for l in range(ROW_LINES):
            # A line as the kernel widens it, BLOCK elements at a time.
            comptime for half in range(LINE // BLOCK):
                var kb = load_block[BF16](p, l * LINE + half * BLOCK)
                var even = kb.slice[W, offset=0]()
                var odd = kb.slice[W, offset=W]()
                comptime if fmas == 0:
                    acc[unsafe_offset=half] += even + odd
                comptime for f in range(fmas * BLOCK // LINE):
                    comptime a = (half * fmas * BLOCK // LINE + f) % 8
                    acc[unsafe_offset=a] = even.fma(odd, acc[unsafe_offset=a])
    var total = acc[unsafe_offset=0]
    comptime for i in range(1, 8):
        total += acc[unsafe_offset=i]
    return total.reduce_add()


def gbps[
    fmas: Int, block: Int, distance: Int
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
                total += stream_request[fmas, block, distance](
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
    # The same reads over 4 pages (256 KiB, in L2): the arithmetic alone.
    var hot_table = rebind[Ptr[DType.int64]](
        unsafe_alloc[Int64](num_pages, alignment=64)
    )
    for i in range(num_pages):
        hot_table[unsafe_offset=i] = Int64(i % 4)
    var cores = num_physical_cores()

    @always_inline
    def line[
        block: Int, distance: Int
    ](name: String) raises {
        var pool,
        var table,
        var hot_table,
        var requests,
        var pages_per_request,
        var cores,
    }:
        print(name)
        print(
            "  GB/s from memory with none / group 4's / group 8's arithmetic:",
            gbps[0, block, distance](
                pool, table, requests, pages_per_request, cores
            ),
            gbps[GROUP4_FMAS, block, distance](
                pool, table, requests, pages_per_request, cores
            ),
            gbps[2 * GROUP4_FMAS, block, distance](
                pool, table, requests, pages_per_request, cores
            ),
        )
        print(
            "  GB/s from L2 with group 4's / group 8's arithmetic:",
            gbps[GROUP4_FMAS, block, distance](
                pool, hot_table, requests, pages_per_request, cores
            ),
            gbps[2 * GROUP4_FMAS, block, distance](
                pool, hot_table, requests, pages_per_request, cores
            ),
        )

    print(
        cores,
        "threads;",
        GROUP4_FMAS,
        "FMAs of",
        W,
        "float32 lanes a 64-byte line at group 4,",
        2 * GROUP4_FMAS,
        "at group 8",
    )
    line[CHUNK, 16]("head by head, 4 KiB ahead:")
    line[8, 8 * KV_HEADS]("blocks of 8 tokens, a block ahead:")
    line[16, 16 * KV_HEADS]("blocks of 16 tokens, a block ahead:")
    line[1, 64]("token by token, 16 KiB ahead:")
    pool.unsafe_free()
    table.unsafe_free()
    hot_table.unsafe_free()
