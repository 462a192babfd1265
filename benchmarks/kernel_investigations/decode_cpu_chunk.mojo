"""The CPU attention kernel's compute cost without memory traffic, and its
read rate from memory without MAX's per-call cost.

First one task's chunk loop (scores, online softmax, V accumulation) over the
same 32 token rows, hot in L1/L2, on one core; then a whole task
(`attention_task`: row tables, block prefetch, q and state set-up) over one
request of TASK_TOKENS tokens in random pages, a pool small enough to stay in
L2; last, a decode batch of BATCH requests from memory (a pool of 256 MiB
or more, far past the L3) on all cores and then on one, each timed in turns
with a plain read of the same pool on as many cores.

    mojo run -I . benchmarks/kernel_investigations/decode_cpu_chunk.mojo

The hot figures are the best of REPEATS runs, in ns per (token, KV head), for
GQA groups 8 (chunk loop only), 4 and 1, head_dim 128, K/V in bfloat16 and
float32 (and group 3, SmolLM2's, chunk loop only, in int8 too: its codes
widened as in the task, the row scales left out), with the split between
scoring and accumulating, and beside the time their FMAs would take at this core's FMA peak (measured first, in the
same run): the share of that peak the chunk loop reaches. Set beside the
memory's time for the same bytes they say whether decode is bound by compute
or by memory: the task's figure is the one to compare, as the chunk loop alone
leaves out the L2 reads and the prefetch bookkeeping. The batch from memory
prints medians, as GB/s and as a share of the plain read: the kernel's own
efficiency, without the per-call cost of MAX and Python that
`benchmarks/decode.py` includes. The one-core line says whether the kernel
falls short of the plain read because the cores share the memory or because
of how each core reads. In four runs on a 2-core Zen 3 VM (AVX2), 8 KV
heads of group 4 read 0.47-0.57 of the plain read on all cores and
0.49-0.52 on one in bfloat16, 0.66-0.76 and 0.59-0.64 in float32 (plain
read: 16-19.5 GB/s on one core, 25-35 on both): about the same alone, so
each core's own reads set the limit, not the sharing.

Where the time goes inside a task: the VM has no hardware counters, but
`perf record -e cpu-clock` samples a binary built with `mojo build -g -I .`
and `perf annotate` places the samples on instructions. Sampled so, the
batch from memory (bfloat16, group 4) spent 46% of the kernel's samples in
the V pass's loops, 35% in scoring's and 5% in its reduction; 11%, counted
in those, on the instruction just after a prefetch (where a sample lands
while the prefetch waits to issue), most likely for want of free miss
buffers: the core's reads were then at their limit. With the pool in L3 (the
task figure), 44% and 26%: the V pass, with as many FMAs as scoring, costs
more in both, as it does in the hot chunk loop."""

from std.memory import stack_allocation
from std.memory.alloc import unsafe_alloc
from std.sys import size_of
from std.time import perf_counter_ns

from mojo_ops.attention.cpu.accumulate import accumulate_tile
from mojo_ops.attention.cpu.key_chunks import CHUNK, BlockPrefetch
from mojo_ops.attention.cpu.read_order import walk_heads
from mojo_ops.attention.cpu.scores import score_tile
from mojo_ops.attention.cpu.softmax import softmax_rows
from mojo_ops.attention.cpu.task import attention_task
from mojo_ops.attention.cpu.task_state import TaskState
from mojo_ops.attention.params import AttentionParams
from mojo_ops.attention.work import AttentionWork
from mojo_ops.cache.paged_kv_cache import DYNAMIC, KVLayout, PagedKVCache, Ptr
from mojo_ops.simd.widen import W
from mojo_ops.work_queue import parallel_dynamic
from rig_parts import PEAK_CHAINS, fma_rate, no_mask


comptime HEAD_DIM = 128
comptime KV_HEADS = 8
comptime ITERATIONS = 4000
comptime REPEATS = 9
"""Timed runs of ITERATIONS chunks; the best is printed (the machine is shared)."""
comptime PAGE_SIZE = 16
comptime TASK_TOKENS = 128
"""One request's tokens in the task measurement: 512 KiB of bfloat16 K/V,
1 MiB of float32, within a 1.25 MiB L2 (Zen 5). A 512 KiB L2 (Zen 3) holds
neither with the task's own state: there the task figures include L3 reads."""
comptime TASK_RUNS = 500
"""Tasks per timed run."""
comptime BATCH = 64
comptime BATCH_TOKENS = 2048
"""The batch from memory: 64 requests of 2048 tokens, 256 MiB of bfloat16
K/V (512 MiB of float32), one task per request."""
comptime STEP_CHAINS = 8
"""FMA chains a scoring step or V pass keeps with AVX2 (`CHAINS` and
`DOTS_PER_STEP` in mojo_ops/attention/cpu/step_sizes.mojo). In four runs
of this benchmark on a 2-core Zen 3 VM, 8 chains of bare FMAs ran at 0.86-0.90 of the rate of
10 (a C loop of the same FMAs, gcc -O2 -march=znver3, five runs:
0.76-0.86; 12 chains about as fast as 10): a chain's FMA takes 4.2-4.6
cycles there, so 8 chains cannot quite keep both FMA ports busy. The kernel's hot loops, at
0.50-0.55 of the peak, lose the rest elsewhere."""
comptime MEMORY_ROUNDS = 7
"""Rounds of (kernel, read) from memory; medians are printed."""


def filled[dtype: DType](n: Int) -> Ptr[dtype]:
    var p = rebind[Ptr[dtype]](unsafe_alloc[Scalar[dtype]](n, alignment=64))
    for i in range(n):
        p[unsafe_offset=i] = Scalar[dtype](Float32((i * 7919) % 13) * 0.01)
    return p


def index_array(values: List[Int]) -> Ptr[DType.int32]:
    var p = rebind[Ptr[DType.int32]](
        unsafe_alloc[Int32](len(values), alignment=64)
    )
    for i in range(len(values)):
        p[unsafe_offset=i] = Int32(values[i])
    return p


def ns_per_token(start: Int, stop: Int) -> Float64:
    return Float64(stop - start) / Float64(ITERATIONS * CHUNK)


def chunk_times[
    kv_dtype: DType, group: Int
](repeats: Int = REPEATS) raises -> Tuple[Float64, Float64, Float64]:
    """The best of `repeats` timed runs, per (token, KV head), of one head's
    chunk loop hot in L1 on this core: the whole loop (scores, softmax, V),
    scoring alone and the V pass alone."""
    # Token rows as in an NHD page: all KV heads of a token side by side.
    var token_stride = KV_HEADS * HEAD_DIM
    var k = filled[kv_dtype](CHUNK * token_stride)
    var v = filled[kv_dtype](CHUNK * token_stride)
    var rows = rebind[Ptr[DType.int64]](
        unsafe_alloc[Int64](CHUNK, alignment=64)
    )
    for j in range(CHUNK):
        rows[unsafe_offset=j] = Int64(j * token_stride)
    var params = AttentionParams(0.088, 0, 1, 10000, 1, 1, -1, 0, True)
    var mask = no_mask()
    var state = TaskState(group, HEAD_DIM)
    for r in range(group):
        for c in range(HEAD_DIM):
            state.q[unsafe_offset=r * HEAD_DIM + c] = 0.001 * Float32(c)
            state.acc[unsafe_offset=r * HEAD_DIM + c] = 0
        state.m[unsafe_offset=r] = -1e30
        state.l[unsafe_offset=r] = 0
        state.row_pos[unsafe_offset=r] = 1e6
        state.alibi_log2[unsafe_offset=r] = 0
    var quiet = BlockPrefetch[kv_dtype](k, rows, 0, 0, 1, 0, 0, True)

    var total = Float64.MAX
    var scoring = Float64.MAX
    var accumulating = Float64.MAX
    for _ in range(repeats):
        var start = Int(perf_counter_ns())
        for i in range(ITERATIONS):
            walk_heads[scoring=True](
                HEAD_DIM, state, 1, group, k, 0, rows, 0, CHUNK, quiet
            )
            softmax_rows(HEAD_DIM, params, mask, state, group, CHUNK, i * CHUNK)
            walk_heads[scoring=False](
                HEAD_DIM, state, 1, group, v, 0, rows, 0, CHUNK, quiet
            )
        total = min(total, ns_per_token(start, Int(perf_counter_ns())))
        start = Int(perf_counter_ns())
        for _ in range(ITERATIONS):
            score_tile[group](
                HEAD_DIM, state.q, k, 0, rows, 0, CHUNK, state.scores, quiet
            )
        scoring = min(scoring, ns_per_token(start, Int(perf_counter_ns())))
        start = Int(perf_counter_ns())
        for _ in range(ITERATIONS):
            accumulate_tile[group](
                HEAD_DIM, state.scores, v, 0, rows, 0, CHUNK, state.acc, quiet
            )
        accumulating = min(
            accumulating, ns_per_token(start, Int(perf_counter_ns()))
        )
    k.unsafe_free()
    v.unsafe_free()
    rows.unsafe_free()
    return (total, scoring, accumulating)


def bench[kv_dtype: DType, group: Int](peak: Float64) raises:
    var total, scoring, accumulating = chunk_times[kv_dtype, group]()
    # q.k and p.v: group FMAs per head_dim vector of K and of V.
    var fmas_per_token = Float64(2 * group * HEAD_DIM // W)
    print(
        kv_dtype,
        " group ",
        group,
        ": ",
        total,
        " ns per token and KV head (",
        "scores ",
        scoring,
        ", V ",
        accumulating,
        "); at the FMA peak ",
        fmas_per_token / peak,
        ": ",
        fmas_per_token / peak / total,
        " of it",
        sep="",
    )


def task_ns[
    kv_dtype: DType, group: Int, tokens: Int = TASK_TOKENS
](repeats: Int = REPEATS) raises -> Float64:
    """The best of `repeats` timed runs, per (token, KV head), of a whole task
    over one request of `tokens` tokens in pages out of order, its pool small
    enough to stay in cache, on this core."""
    var pages = tokens // PAGE_SIZE
    var page_elems = 2 * PAGE_SIZE * KV_HEADS * HEAD_DIM
    var pool = filled[kv_dtype](pages * page_elems)
    # Pages out of order, as a long-running pool holds them.
    var indices = index_array([(i * 5 + 3) % pages for i in range(pages)])
    var cache = (
        PagedKVCache[kv_dtype, KVLayout.NHD]
        .from_pool(
            pool,
            pages,
            index_array([0, pages]),
            indices,
            index_array([PAGE_SIZE]),
            1,
            PAGE_SIZE,
            KV_HEADS,
            HEAD_DIM,
        )
        .specialized[DYNAMIC, DYNAMIC, DYNAMIC]()
    )
    # One work item: request 0, its one query at the last position, all keys.
    var items = index_array([0, 0, 1, tokens - 1, 0, tokens])
    var request_items = index_array([0, 1])
    var heads = KV_HEADS * group
    var partial_o = filled[DType.float32](heads * HEAD_DIM)
    var partial_lse = filled[DType.float32](heads)
    var work = AttentionWork(
        items, 1, request_items, partial_o, partial_lse, True
    )
    var q = filled[kv_dtype](heads * HEAD_DIM)
    var o = filled[kv_dtype](heads * HEAD_DIM)
    var lse = filled[DType.float32](heads)
    var params = AttentionParams(0.088, 0, 1, 10000, 1, 1, -1, 0, True)
    var mask = no_mask()

    var best = Float64.MAX
    for _ in range(repeats):
        var start = Int(perf_counter_ns())
        for _ in range(TASK_RUNS):
            attention_task(
                cache, q, o, lse, work, params, mask, heads, KV_HEADS, 0
            )
        best = min(
            best,
            Float64(Int(perf_counter_ns()) - start)
            / Float64(TASK_RUNS * tokens * KV_HEADS),
        )
    pool.unsafe_free()
    return best


def bench_task[kv_dtype: DType, group: Int]() raises:
    print(
        kv_dtype,
        " group ",
        group,
        ": ",
        task_ns[kv_dtype, group](),
        " ns per token and KV head (whole task, pool in L2)",
        sep="",
    )


def run_tasks[
    FuncType: def(Int) -> None
](func: FuncType, num_tasks: Int, one_core: Bool) raises:
    """Runs func(0) ... func(num_tasks - 1): in order on this core, or on all
    cores (`parallel_dynamic`)."""
    if one_core:
        for t in range(num_tasks):
            func(t)
    else:
        parallel_dynamic(func, num_tasks)


def plain_read(
    pool: Ptr[DType.uint8], nbytes: Int, one_core: Bool
) raises -> Float64:
    """Seconds to read nbytes at pool (a multiple of 1 MiB) in 1 MiB runs, on
    all cores (runs taken in turn) or on one: the anchor of the batch from
    memory."""
    comptime RUN_BYTES = 1 << 20
    comptime VECTORS = 4
    """Independent sums: enough loads in flight for one core's share."""
    # Where each run's sum goes, so that its loads are kept: 64 slots of one
    # 64-byte line, run i's in slot i mod 64, so that the cores' runs in
    # flight do not share a line.
    var sums = filled[DType.float32](16 * 64)

    def read_run(i: Int) {var pool, var sums}:
        var p = rebind[Ptr[DType.float32]](pool.unsafe_offset(i * RUN_BYTES))
        var totals = stack_allocation[VECTORS, SIMD[DType.float32, 16]]()
        comptime for v in range(VECTORS):
            totals[unsafe_offset=v] = 0
        for off in range(0, RUN_BYTES // 4, 16 * VECTORS):
            comptime for v in range(VECTORS):
                totals[unsafe_offset=v] += p.unsafe_offset(
                    off + 16 * v
                ).unsafe_load[width=16]()
        var total = SIMD[DType.float32, 16](0)
        comptime for v in range(VECTORS):
            total += totals[unsafe_offset=v]
        sums[unsafe_offset=(i % 64) * 16] += total.reduce_add()

    var start = Int(perf_counter_ns())
    run_tasks(read_run, nbytes // RUN_BYTES, one_core)
    var seconds = Float64(Int(perf_counter_ns()) - start) * 1e-9
    sums.unsafe_free()
    return seconds


def median(mut values: List[Float64]) -> Float64:
    sort(values)
    return values[len(values) // 2]


def memory_gbps[
    kv_dtype: DType, group: Int
](one_core: Bool, rounds: Int = MEMORY_ROUNDS) raises -> Tuple[
    Float64, Float64
]:
    """GB/s of the batch from memory and of a plain read of its pool, timed in
    turns: the medians of `rounds` of each, on all cores or on one."""
    var per_request = BATCH_TOKENS // PAGE_SIZE
    var pages = BATCH * per_request
    var page_elems = 2 * PAGE_SIZE * KV_HEADS * HEAD_DIM
    var pool = filled[kv_dtype](pages * page_elems)
    var nbytes = pages * page_elems * size_of[kv_dtype]()
    # A permutation of the pages (an odd multiplier of a power of two).
    var indices = index_array([(i * 40503 + 7) % pages for i in range(pages)])
    var indptr = List[Int]()
    var items = List[Int]()
    for b in range(BATCH + 1):
        indptr.append(b * per_request)
    for b in range(BATCH):
        items += [b, b, 1, BATCH_TOKENS - 1, 0, BATCH_TOKENS]
    var cache = (
        PagedKVCache[kv_dtype, KVLayout.NHD]
        .from_pool(
            pool,
            pages,
            index_array(indptr),
            indices,
            index_array([PAGE_SIZE for _ in range(BATCH)]),
            BATCH,
            PAGE_SIZE,
            KV_HEADS,
            HEAD_DIM,
        )
        .specialized[DYNAMIC, DYNAMIC, DYNAMIC]()
    )
    var heads = KV_HEADS * group
    var work = AttentionWork(
        index_array(items),
        BATCH,
        index_array([b for b in range(BATCH + 1)]),
        filled[DType.float32](BATCH * heads * HEAD_DIM),
        filled[DType.float32](BATCH * heads),
        True,
    )
    var q = filled[kv_dtype](BATCH * heads * HEAD_DIM)
    var o = filled[kv_dtype](BATCH * heads * HEAD_DIM)
    var lse = filled[DType.float32](BATCH * heads)
    var params = AttentionParams(0.088, 0, 1, 10000, 1, 1, -1, 0, True)
    var mask = no_mask()

    def task(
        t: Int,
    ) {
        var cache,
        var q,
        var o,
        var lse,
        var work,
        var params,
        var mask,
        var heads,
    }:
        attention_task(cache, q, o, lse, work, params, mask, heads, KV_HEADS, t)

    var kernel = List[Float64]()
    var read = List[Float64]()
    for _ in range(rounds):
        # 256 MiB or more, far past the L3: each pass reads from memory.
        var start = Int(perf_counter_ns())
        run_tasks(task, BATCH, one_core)
        kernel.append(Float64(Int(perf_counter_ns()) - start) * 1e-9)
        read.append(
            plain_read(rebind[Ptr[DType.uint8]](pool), nbytes, one_core)
        )
    pool.unsafe_free()
    return (
        Float64(nbytes) / median(kernel) * 1e-9,
        Float64(nbytes) / median(read) * 1e-9,
    )


def bench_from_memory[kv_dtype: DType, group: Int]() raises:
    # One core as well as all: where the kernel's share of the plain read
    # is the same on one core, a core's own reads are what it lacks, not
    # the memory the cores share.
    for one_core in [False, True]:
        var kernel_gbps, read_gbps = memory_gbps[kv_dtype, group](one_core)
        print(
            kv_dtype,
            " group ",
            group,
            ": ",
            kernel_gbps,
            " GB/s from memory on ",
            "one core" if one_core else "all cores",
            ", plain read ",
            read_gbps,
            " GB/s: ",
            kernel_gbps / read_gbps,
            " of it",
            sep="",
        )


def main() raises:
    var peak = fma_rate[PEAK_CHAINS]()
    var stepped = fma_rate[STEP_CHAINS]()
    print(
        "FMA peak: ",
        peak,
        " vector FMAs per ns on one core; from ",
        STEP_CHAINS,
        " chains: ",
        stepped,
        " (",
        stepped / peak,
        " of it)",
        sep="",
    )
    bench[DType.bfloat16, 8](peak)
    bench[DType.float32, 8](peak)
    bench[DType.bfloat16, 4](peak)
    bench[DType.float32, 4](peak)
    bench[DType.bfloat16, 1](peak)
    bench[DType.float32, 1](peak)
    bench[DType.int8, 3](peak)
    bench[DType.bfloat16, 3](peak)
    bench[DType.float32, 3](peak)
    bench_task[DType.bfloat16, 4]()
    bench_task[DType.float32, 4]()
    bench_task[DType.bfloat16, 1]()
    bench_task[DType.float32, 1]()
    bench_from_memory[DType.bfloat16, 4]()
    bench_from_memory[DType.float32, 4]()
