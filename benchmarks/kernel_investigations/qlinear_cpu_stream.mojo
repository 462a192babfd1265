"""The quantized products of one decode step, without MAX's per-op cost:
how fast they stream their weights, and how far that is from a plain read
and from the cores' integer peak.

A SmolLM2-135M-shaped stack (30 layers of Q|K|V 960 x 576, O 576 x 576,
gate|up 3072 x 576 and down 576 x 1536 in Q4_1, then a 49152 x 576 Q8_0
output head: 91 MiB of packed panels, three times the L3) is multiplied by
M rows of quantized activations, the products in a step's order, each
product one `parallel_phases` call (as the fused layer's phases), timed in
turns with a plain read of the same bytes in as many calls. For M = 1 the
figure is GB/s of weights (a decode step of one request is this stream),
and also the layers' products as the tasks of one call, and a plain read
of all the bytes in one call: the stream with no call or barrier between
products. For larger M, GOP/s (two per multiply-add) beside a loop of
independent `dot_u8s8`s on every core (the integer peak).

    mojo run -I . benchmarks/kernel_investigations/qlinear_cpu_stream.mojo
    mojo run -D HUGE_PAGES=true -I . benchmarks/kernel_investigations/qlinear_cpu_stream.mojo

Prints, per M, the medians of ROUNDS rounds. What it showed on a 2-core
AMD EPYC (Zen 4, AVX-512 VNNI), several runs each:

- A plain read of 91 MiB in one call: 21-29 GB/s on 4 KiB pages, 28-32 on
  2 MiB pages (HUGE_PAGES). The same read in 121 calls, one per weight:
  14-25 GB/s; each call wakes the cores (about 4 us) and starts its
  stream cold.
- One-row products streamed well below a plain read until their tasks
  grew and their codes were prefetched into the L2 (qlinear.mojo's
  TASK_BYTES, PREFETCH_AHEAD). The layers' products as tasks of one
  call, and the 262144 x 640 head alone, in GB/s:

  | tile | layers | head |
  | --- | --- | --- |
  | tasks of 16 KiB, no prefetch | 17-25 | 17-23 |
  | tasks of 64 KiB | 23-28 | 26-28 |
  | tasks of 64 KiB, 4 KiB ahead into the L2 | 24-29 | 28-35 |

  Without effect (each beside the 16 KiB tile): two independent int32
  sums per block; prefetch into the L1 1-4 KiB ahead (4 KiB slower); each
  block's codes, scales and mins interleaved (one stream per panel
  instead of three); 2 MiB pages. Into the L2, 2 KiB ahead was too little
  and 8 KiB no better than 4.
- The step in 121 calls: 1.1-1.2x the plain read in as many calls.
- M = 32: 350-445 GOP/s, about half of the dot-product peak measured in
  the same run (565-920 GOP/s: the host's neighbours move it). Neither
  register tiles of 8 or 12 rows (32 rows without a tile of 2 left over)
  nor an epilogue of four vector operations per row and block instead of
  eight (the zero point folded into the min, the activations' d * sum
  kept by the quantizer: kept, for M = 4's 1.03-1.09x) moved it.
- AVX2's paths on the same host (`mojo run --target-cpu x86-64-v3 ...`,
  the kernels' `vpmaddubsw` form): M = 1 took 1.28-1.31x the plain read
  (the layers' products 19-21 GB/s against 27 with VNNI; the Q8_0 head
  26-28 GB/s either way), M = 4 10.7 ms and M = 32 39.4 ms. Summing a
  block's 4- to 6-bit dot products in int16 pairs before widening them
  (simd/int8_dot.mojo's add_pair_dot) took M = 4 to 8.2 ms and M = 32 to
  33.0 ms; M = 1 did not move. Prefetching 8 KiB ahead instead of 4 took
  M = 1 to 1.01-1.03x the plain read (the layers' products 25-26 GB/s);
  16 KiB, 1.15x. With VNNI, 8 KiB streamed the layers' products at 33 GB/s
  in two runs against 25 with 4 KiB and 26 with 16 KiB in the same hour.
- In the real decode step (30 fused layer ops), the weights on 2 MiB
  pages took as long as on the memory-mapped 4 KiB pages (alternating
  engines in one process: 7.93 against 7.77 ms median).
"""

from std.ffi import external_call
from std.memory import stack_allocation
from std.sys import get_defined_bool
from std.memory.alloc import unsafe_alloc
from std.time import perf_counter_ns

from mojo_ops.cache.paged_kv_cache import Ptr
from mojo_ops.quantized.activations import QuantizedRows
from mojo_ops.quantized.block_formats import Q4_1, Q8_0, panel_bytes, PANEL
from mojo_ops.quantized.qlinear import NO_EPILOGUE, QuantizedProduct
from mojo_ops.simd.int8_dot import Acc, BYTES, Bytes, SBytes, dot_u8s8
from mojo_ops.simd.widen import F32
from mojo_ops.work_queue import Phases, parallel_dynamic, parallel_phases

comptime LAYERS = 30
comptime HIDDEN = 576
comptime QKV = 960
comptime FFN = 1536
comptime VOCAB = 49152
comptime BIG_VOCAB = 262144
comptime BIG_HIDDEN = 640
comptime ROUNDS = 15
comptime HUGE_PAGES = get_defined_bool["HUGE_PAGES", False]()
"""Whether the weights are advised onto 2 MiB pages (-D HUGE_PAGES=true)."""
comptime HUGE_PAGE = 1 << 21
comptime MADV_HUGEPAGE = 14


def filled_bytes(n: Int, seed: Int) -> Ptr[DType.uint8]:
    """Returns n bytes of a fixed pseudo-random pattern whose float16 pairs are
    normal numbers (no denormal arithmetic in the scales)."""
    var p = rebind[Ptr[DType.uint8]](
        unsafe_alloc[UInt8](n, alignment=HUGE_PAGE)
    )
    comptime if HUGE_PAGES:
        _ = external_call["madvise", Int32](p, n, Int32(MADV_HUGEPAGE))
    var s = UInt64(seed * 2654435761 + 1)
    for i in range(n):
        s = s * 6364136223846793005 + 1442695040888963407
        var b = UInt8(Int(s >> 56) & 0xFF)
        p[unsafe_offset=i] = b if i % 2 == 0 else (b & 0x3F) | 0x10
    return p


struct Weight(TrivialRegisterPassable):
    var panels: Ptr[DType.uint8]
    var n: Int
    var k: Int
    var fmt: Int

    def __init__(out self, n: Int, k: Int, fmt: Int, seed: Int):
        self.n = n
        self.k = k
        self.fmt = fmt
        self.panels = filled_bytes(
            (n + PANEL - 1) // PANEL * panel_bytes(fmt, k), seed
        )

    def nbytes(self) -> Int:
        return (self.n + PANEL - 1) // PANEL * panel_bytes(self.fmt, self.k)


def run_product[
    fmt: Int
](w: Weight, x: QuantizedRows, y: Ptr[F32], m: Int) raises:
    var product = QuantizedProduct[fmt, NO_EPILOGUE](
        w.panels, x, y, y, m, w.n, w.n
    )

    def task(_p: Int, t: Int) {var product}:
        product.run(t)

    var phases = Phases()
    _ = phases.add(product.tasks())
    parallel_phases(task, phases)


def step_seconds(
    weights: List[Weight],
    head: Weight,
    xs: List[QuantizedRows],
    y: Ptr[F32],
    m: Int,
) raises -> Float64:
    var start = perf_counter_ns()
    for i in range(len(weights)):
        var kind = i % 4
        run_product[Q4_1](weights[i], xs[1 if kind == 3 else 0], y, m)
    run_product[Q8_0](head, xs[0], y, m)
    return Float64(Int(perf_counter_ns() - start)) * 1e-9


def one_call_seconds(
    weights: List[Weight], xs: List[QuantizedRows], y: Ptr[F32]
) raises -> Float64:
    """Every layer product's panels as tasks of one call (no barrier: the
    products' order does not matter for the stream), one row."""
    var products = List[QuantizedProduct[Q4_1, NO_EPILOGUE]]()
    var first = List[Int]()
    var n = 0
    for i in range(len(weights)):
        var kind = i % 4
        var prod = QuantizedProduct[Q4_1, NO_EPILOGUE](
            weights[i].panels,
            xs[1 if kind == 3 else 0],
            y,
            y,
            1,
            weights[i].n,
            weights[i].n,
        )
        first.append(n)
        n += prod.tasks()
        products.append(prod)
    first.append(n)
    var pp = products.unsafe_ptr()
    var fp = first.unsafe_ptr()
    var count = len(products)

    def task(t: Int) {var pp, var fp, var count}:
        var lo = 0
        var hi = count
        while hi - lo > 1:
            var mid = (lo + hi) // 2
            if fp[mid] <= t:
                lo = mid
            else:
                hi = mid
        pp[lo].run(t - fp[lo])

    var start = perf_counter_ns()
    parallel_dynamic(task, n)
    return Float64(Int(perf_counter_ns() - start)) * 1e-9


def plain_read_seconds(weights: List[Weight], head: Weight) raises -> Float64:
    """Both cores read every weight's bytes, 16 KiB per task."""
    comptime RUN = 16384
    var sums = stack_allocation[64 * 16, Float32]()
    var start = perf_counter_ns()
    for i in range(len(weights) + 1):
        var w = head if i == len(weights) else weights[i]
        var base = w.panels
        var runs = w.nbytes() // RUN

        def read(t: Int) {var base, var sums}:
            var p = rebind[Ptr[DType.float32]](base.unsafe_offset(t * RUN))
            var a = SIMD[DType.float32, 16](0)
            var b = SIMD[DType.float32, 16](0)
            for off in range(0, RUN // 4, 32):
                a += p.unsafe_offset(off).unsafe_load[width=16]()
                b += p.unsafe_offset(off + 16).unsafe_load[width=16]()
            sums[unsafe_offset=(t % 64) * 16] += (a + b).reduce_add()

        parallel_dynamic(read, runs)
    return Float64(Int(perf_counter_ns() - start)) * 1e-9


def one_read_seconds(base: Ptr[DType.uint8], nbytes: Int) raises -> Float64:
    """Both cores read nbytes at base in one call, 16 KiB per task."""
    comptime RUN = 16384
    var sums = stack_allocation[64 * 16, Float32]()

    def read(t: Int) {var base, var sums}:
        var p = rebind[Ptr[DType.float32]](base.unsafe_offset(t * RUN))
        var a = SIMD[DType.float32, 16](0)
        var b = SIMD[DType.float32, 16](0)
        for off in range(0, RUN // 4, 32):
            a += p.unsafe_offset(off).unsafe_load[width=16]()
            b += p.unsafe_offset(off + 16).unsafe_load[width=16]()
        sums[unsafe_offset=(t % 64) * 16] += (a + b).reduce_add()

    var start = perf_counter_ns()
    parallel_dynamic(read, nbytes // RUN)
    return Float64(Int(perf_counter_ns() - start)) * 1e-9


@no_inline
def dot_peak_gops() raises -> Float64:
    """GOP/s of independent byte dot products on every core (12 chains)."""
    comptime ITERS = 4_000_000
    comptime CHAINS = 12
    var out = stack_allocation[64 * 16, Int32]()

    def spin(t: Int) {var out}:
        var acc = stack_allocation[CHAINS, Acc]()
        comptime for c in range(CHAINS):
            acc[unsafe_offset=c] = Acc(c)
        var a = Bytes(3)
        var b = SBytes(5)
        for _ in range(ITERS):
            comptime for c in range(CHAINS):
                acc[unsafe_offset=c] = dot_u8s8(acc[unsafe_offset=c], a, b)
        var total = Acc(0)
        comptime for c in range(CHAINS):
            total += acc[unsafe_offset=c]
        out[unsafe_offset=(t % 64) * 16] = total.reduce_add()

    var start = perf_counter_ns()
    parallel_dynamic(spin, 2)
    var s = Float64(Int(perf_counter_ns() - start)) * 1e-9
    return Float64(2 * 2 * ITERS * CHAINS * BYTES) / s * 1e-9


def median(mut values: List[Float64]) -> Float64:
    sort(values)
    return values[len(values) // 2]


def main() raises:
    var weights = List[Weight]()
    var total = 0
    var macs_per_row = 0
    for layer in range(LAYERS):
        for shape in [
            (QKV, HIDDEN),
            (HIDDEN, HIDDEN),
            (2 * FFN, HIDDEN),
            (HIDDEN, FFN),
        ]:
            var w = Weight(shape[0], shape[1], Q4_1, layer * 4 + len(weights))
            total += w.nbytes()
            macs_per_row += shape[0] * shape[1]
            weights.append(w)
    var head = Weight(VOCAB, HIDDEN, Q8_0, 999)
    var big_head = Weight(BIG_VOCAB, BIG_HIDDEN, Q8_0, 998)
    total += head.nbytes()
    macs_per_row += VOCAB * HIDDEN
    print(
        "weights:",
        total // (1 << 20),
        "MiB;",
        "int8 dot peak:",
        dot_peak_gops(),
        "GOP/s",
    )
    var big = filled_bytes(total, 7)
    var ones = List[Float64]()
    for _ in range(ROUNDS):
        ones.append(one_read_seconds(big, total))
    print(
        "one read of",
        total // (1 << 20),
        "MiB in one call:",
        Float64(total) / median(ones) * 1e-9,
        "GB/s",
    )
    for m in [1, 4, 32]:
        var xs = List[QuantizedRows]()
        for k in [HIDDEN, FFN, BIG_HIDDEN]:
            var size = QuantizedRows.bytes(m, k)
            xs.append(QuantizedRows(filled_bytes(size, k + m), m, k))
        var y = rebind[Ptr[F32]](
            unsafe_alloc[Float32](m * BIG_VOCAB, alignment=64)
        )
        var steps = List[Float64]()
        var reads = List[Float64]()
        for _ in range(ROUNDS):
            steps.append(step_seconds(weights, head, xs, y, m))
            reads.append(plain_read_seconds(weights, head))
        if m == 1:
            var ones = List[Float64]()
            var layer_bytes = total - head.nbytes()
            for _ in range(ROUNDS):
                ones.append(one_call_seconds(weights, xs, y))
            var heads = List[Float64]()
            for _ in range(ROUNDS):
                var start = perf_counter_ns()
                run_product[Q8_0](big_head, xs[2], y, 1)
                heads.append(Float64(Int(perf_counter_ns() - start)) * 1e-9)
            print(
                (
                    "M = 1: a Gemma 3-sized Q8_0 head alone (262144 x 640, one"
                    " call):"
                ),
                Float64(big_head.nbytes()) / median(heads) * 1e-9,
                "GB/s",
            )
            print(
                "M = 1: the layers' products in one call:",
                Float64(layer_bytes) / median(ones) * 1e-9,
                "GB/s",
            )
        var s = median(steps)
        var r = median(reads)
        print(
            "M =",
            m,
            ": step",
            s * 1e3,
            "ms,",
            Float64(total) / s * 1e-9,
            "GB/s of weights,",
            2.0 * Float64(macs_per_row * m) / s * 1e-9,
            "GOP/s; plain read",
            r * 1e3,
            "ms,",
            Float64(total) / r * 1e-9,
            "GB/s; step / read",
            s / r,
        )
