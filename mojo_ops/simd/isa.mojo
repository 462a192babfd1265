"""What the CPU kernels were compiled for: the vector features their
`comptime` branches read, as the compiled op sees them.

MAX compiles the kernels for the host's CPU unless a virtual CPU target is
set (`max.driver.set_virtual_cpu_target`, pagedkv's PAGEDKV_CPU_TARGET).
This op reports the branches a compile took, so a benchmark can print the
code path it timed and a test can check that a target took effect.
"""

import extensibility
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext
from std.sys.info import CompilationTarget

from ..cache.tensor_access import ptr_of
from .amx import amx_ready
from .int8_dot import MADDUBS, SDOT, VNNI
from .widen import DOT_BF16, VECTOR_REGISTERS, W

comptime CPU_ISA_FIELDS = 10
"""Fields of the op's output, in order: x86, AVX2, AVX-512F, int8 dot
products in one `vpdpbusd` (VNNI), in `vpmaddubsw` pairs, in NEON `sdot`,
bfloat16 dot products (`vdpbf16ps`), float32 lanes of a vector register,
vector registers, and whether quantized products of many rows run on AMX
tiles in this process (asked at run time: `amx_ready`)."""


@extensibility.register("pagedkv_cpu_isa")
struct CpuIsa:
    """Writes the CPU kernels' compiled features into an int32
    [CPU_ISA_FIELDS] array."""

    @staticmethod
    def execute[
        target: StaticString
    ](
        isa: MutableInputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("pagedkv_cpu_isa reports the CPU kernels' features")
        if isa.dim_size(0) != CPU_ISA_FIELDS:
            raise Error("pagedkv_cpu_isa writes CPU_ISA_FIELDS values")
        var out = ptr_of(isa)
        out[unsafe_offset=0] = Int32(CompilationTarget.is_x86())
        out[unsafe_offset=1] = Int32(CompilationTarget.has_avx2())
        out[unsafe_offset=2] = Int32(CompilationTarget.has_avx512f())
        out[unsafe_offset=3] = Int32(VNNI)
        out[unsafe_offset=4] = Int32(MADDUBS)
        out[unsafe_offset=5] = Int32(SDOT)
        out[unsafe_offset=6] = Int32(DOT_BF16)
        out[unsafe_offset=7] = Int32(W)
        out[unsafe_offset=8] = Int32(VECTOR_REGISTERS)
        out[unsafe_offset=9] = Int32(amx_ready())
