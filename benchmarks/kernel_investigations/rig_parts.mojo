"""What the CPU kernel rigs beside this file share: a disabled custom mask,
and the FMA rate of one core that their hot figures are set beside."""

from std.memory import stack_allocation
from std.memory.alloc import unsafe_alloc
from std.time import perf_counter_ns

from mojo_ops.attention.custom_mask import CustomMask
from mojo_ops.cache.paged_kv_cache import Ptr
from mojo_ops.simd.widen import W

comptime PEAK_CHAINS = 10
"""Independent FMA chains that fill both FMA ports of a Zen or Intel core
(latency 4-5 cycles x 2 ports): with them `fma_rate` is the core's peak."""


def no_mask() -> CustomMask:
    """A disabled custom mask (its pointers are never read)."""
    return CustomMask(
        rebind[Ptr[DType.uint8]](unsafe_alloc[UInt8](8)),
        rebind[Ptr[DType.int32]](unsafe_alloc[Int32](1)),
        enabled=False,
    )


@no_inline
def fma_rate[chains: Int = PEAK_CHAINS]() -> Float64:
    """Vector FMAs per ns on one core from `chains` independent chains of
    register operands, the best of three runs. With PEAK_CHAINS, the core's
    peak: the FMAs a rig's loop takes, at this rate, are the least time its
    arithmetic can take. With fewer, what a loop keeping that many in
    flight could reach."""
    comptime STEPS = 20_000_000
    var acc = stack_allocation[chains, SIMD[DType.float32, W]]()
    comptime for i in range(chains):
        acc[unsafe_offset=i] = Float32(i + 2)  # Not 1: the fixed point.
    var x = SIMD[DType.float32, W](0.999999)
    var y = SIMD[DType.float32, W](1e-6)
    var best = Float64.MAX
    for _ in range(3):
        var start = Int(perf_counter_ns())
        for _ in range(STEPS):
            comptime for i in range(chains):
                acc[unsafe_offset=i] = acc[unsafe_offset=i].fma(x, y)
        best = min(best, Float64(Int(perf_counter_ns()) - start))
    var total = SIMD[DType.float32, W](0)
    comptime for i in range(chains):
        total += acc[unsafe_offset=i]
    if total[0] == 0:  # Keeps the chains.
        print(total)
    return Float64(STEPS * chains) / best
