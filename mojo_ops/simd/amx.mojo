"""Intel AMX's int8 tile products: one instruction multiplies a tile of 16
rows of bytes by a tile of byte columns into 16 x 16 int32 sums.

A quantized product of many rows (prefill, a decode step of many
requests) spends most of its time in byte dot products; AMX's `tdpbsud`
takes 16 x 16 x 32 of them in one instruction where
AVX512_VNNI's `vpdpbusd` takes 16 x 4, so the scaling of each block's sums
(AVX-512, as before) becomes the larger part of the work.

Three tiles hold one block's product (`tile_product`):

    tmm0  C  [16 rows, 16 int32]   the block's sums, stored to memory
    tmm1  A  [16 rows, 32 bytes]   activations, signed bytes
    tmm2  B  [8 rows, 64 bytes]    the weight's codes, unsigned, 4 inputs of
                                   16 columns a row (the VNNI layout of a
                                   panel's groups)

The instructions are emitted as inline assembly:
the compile target of a virtual machine may lack the CPU's AMX features
(LLVM names such a CPU from its model number), and the assembler takes
them regardless. Whether the running CPU has AMX and the OS lets this
process use it is asked at run time (`amx_ready`); the tile configuration
is per thread, so each task loads it (`configure_tiles`) and releases the
tiles when done (`release_tiles`), leaving no tile state to save when the
thread is switched out.
"""

from std.ffi import external_call
from std.os import getenv
from std.sys import inlined_assembly
from std.sys.info import CompilationTarget

from ..cache.paged_kv_cache import Ptr
from .int8_dot import VNNI_512

comptime AMX_TARGET = (
    CompilationTarget.is_x86() and CompilationTarget.is_linux() and VNNI_512
)
"""Whether a compile has the AMX path: Linux (whose `arch_prctl` grants the
tiles' state) on x86 with AVX-512 and VNNI, whose 16-lane vectors scale a
tile's rows of sums."""
comptime AMX_ROWS = 16
"""Rows of activations one tile product takes."""
comptime CONFIG_BYTES = 64
"""Bytes of a tile configuration (palette 1)."""

comptime _SYS_ARCH_PRCTL = 158
comptime _ARCH_REQ_XCOMP_PERM = 0x1023
comptime _XFEATURE_XTILEDATA = 18

comptime AMX_ENV = "PAGEDKV_AMX"
"""Set to 0 to keep the products off AMX (the AVX-512 path instead)."""


def amx_ready() -> Bool:
    """Whether this process may run AMX int8 tile products: a compile with
    the AMX path, PAGEDKV_AMX not 0, and Linux's permission for the tiles'
    state (`arch_prctl` ARCH_REQ_XCOMP_PERM: refused where the CPU or the
    kernel lacks it; granted once per process, asking again is a no-op of
    about 0.1 us). Every CPU with AMX's tiles has its int8 products.

    Not CPUID: in a virtual machine it exits to the hypervisor, some
    microseconds a call, and each product of many rows asks."""
    comptime if not AMX_TARGET:
        return False
    else:
        if getenv(AMX_ENV, "1") == "0":
            return False
        return (
            external_call["syscall", Int](
                _SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA
            )
            == 0
        )


@always_inline
def configure_tiles(config: Ptr[DType.uint8]):
    """Loads the configuration of `tile_product`'s three tiles into this
    thread, built in `config` (CONFIG_BYTES, 64-byte aligned scratch)."""
    for i in range(CONFIG_BYTES):
        config[unsafe_offset=i] = 0
    config[unsafe_offset=0] = 1  # palette 1
    # Tile t's bytes a row (colsb, 16 bits) at byte 16 + 2t, rows at 48 + t.
    config[unsafe_offset=16] = 64
    config[unsafe_offset=18] = 32
    config[unsafe_offset=20] = 64
    config[unsafe_offset=48] = AMX_ROWS
    config[unsafe_offset=49] = AMX_ROWS
    config[unsafe_offset=50] = 8
    inlined_assembly["ldtilecfg ($0)", NoneType, constraints="r,~{memory}"](
        config
    )


@always_inline
def release_tiles():
    """Returns this thread's tiles to their initial state."""
    inlined_assembly["tilerelease", NoneType, constraints="~{memory}"]()


@always_inline
def tile_product(
    sums: Ptr[DType.int32],
    a: Ptr[DType.int8],
    a_stride: Int,
    b: Ptr[DType.uint8],
):
    """sums [16, 16] (rows 64 bytes apart) = A . B over the configured depth
    (`tdpbsud`): A's 16 rows of signed bytes from `a` (a_stride bytes
    apart), B's rows of 64 unsigned bytes from `b` (64 apart)."""
    inlined_assembly[
        (
            "tilezero %tmm0\n\ttileloadd ($1,$2,1), %tmm1\n\t"
            "tileloadd ($3,$4,1), %tmm2\n\ttdpbsud %tmm2, %tmm1, %tmm0\n\t"
            "tilestored %tmm0, ($0,$4,1)"
        ),
        NoneType,
        constraints="r,r,r,r,r,~{memory}",
    ](sums, a, a_stride, b, 64)
