"""Float32 arithmetic on narrower rows: K, V and q rows widened to float32
as they are loaded, results rounded back to the output dtype, and the
"paired" order in which bfloat16 blocks widen without shuffles."""

from std.memory import bitcast
from std.sys import is_gpu, llvm_intrinsic, simd_width_of, size_of
from std.sys.info import CompilationTarget

from ..cache.paged_kv_cache import Ptr

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()

comptime VECTOR_REGISTERS = (
    16 if CompilationTarget.is_x86()
    and not CompilationTarget.has_avx512f() else 32
)
"""Vector registers of the target: 16 with AVX2, 32 with AVX-512 (and
Arm's NEON and SVE). What a step keeps in registers is sized to them."""

comptime DOT_BF16 = CompilationTarget._has_feature["avx512bf16"]()
"""Whether the target has AVX512_BF16's dot products (`vdpbf16ps`): 32
bfloat16 products summed in pairs into 16 float32 lanes, one instruction
where widening takes two and the products two FMAs."""


@always_inline
def dot_bf16(
    acc: SIMD[F32, W],
    a: SIMD[DType.bfloat16, 2 * W],
    b: SIMD[DType.bfloat16, 2 * W],
) -> SIMD[F32, W]:
    """Returns acc[i] + a[2i] * b[2i] + a[2i + 1] * b[2i + 1]; needs DOT_BF16.
    Each product of two bfloat16 values is exact in float32; the sums round
    as float32 adds do, with subnormal inputs and results taken as zero."""
    comptime assert DOT_BF16, "vdpbf16ps needs AVX512_BF16"
    return llvm_intrinsic[
        "llvm.x86.avx512bf16.dpbf16ps." + String(W * 32), SIMD[F32, W]
    ](acc, a, b)


@always_inline
def load_f32[
    dtype: DType, width: Int
](p: Ptr[dtype], offset: Int) -> SIMD[F32, width]:
    """Width elements at p + offset, widened to float32."""
    return widen_f32(p.unsafe_offset(offset).unsafe_load[width=width]())


@always_inline
def widen_f32[
    dtype: DType, width: Int
](raw: SIMD[dtype, width]) -> SIMD[F32, width]:
    """Raw lanes widened to float32 (`load_f32` on loaded lanes)."""
    comptime if dtype == DType.bfloat16:
        # bfloat16 is the top half of a float32: a shift, not a conversion.
        var bits = bitcast[DType.uint16, width](raw).cast[DType.uint32]() << 16
        return bitcast[F32, width](bits)
    elif is_fp8[dtype]() and not is_gpu():
        return widen_fp8(raw)
    else:
        return raw.cast[F32]()


def is_fp8[dtype: DType]() -> Bool:
    """Whether dtype is one of the float8 formats a pool may hold."""
    return dtype == DType.float8_e4m3fn or dtype == DType.float8_e5m2


@always_inline
def widen_fp8[
    dtype: DType, width: Int
](raw: SIMD[dtype, width]) -> SIMD[F32, width]:
    """Widens float8 (e4m3fn or e5m2) to float32, exactly, in vector lanes.

    A CPU has no fp8 instructions, and the standard library's cast widens
    lane by lane in a scalar routine, which inlined at every K and V load
    makes compiling and decoding several times slower (docs/design.md,
    "Kernel notes"). Both formats go through float16, which the CPU widens
    in vector lanes: e5m2 is the top byte of a float16, infinities and NaNs
    included; e4m3fn's fields shifted into float16's places read 2^-8 of its
    value, subnormals included, and its one NaN (S.1111.111) is set apart
    (`e4m3_as_float16`).
    """
    comptime if dtype == DType.float8_e5m2:
        var bits = bitcast[DType.uint8, width](raw).cast[DType.uint16]()
        return bitcast[DType.float16, width](bits << 8).cast[F32]()
    else:
        return e4m3_as_float16(raw).cast[F32]() * 256.0


@always_inline
def e4m3_as_float16[
    dtype: DType, width: Int
](raw: SIMD[dtype, width]) -> SIMD[DType.float16, width]:
    """Float8_e4m3fn lanes as float16 lanes of 2^-8 of their value, exactly
    (NaN for its NaN): a bit shuffle, where float16's exponent bias (15)
    exceeds e4m3fn's (7) by 8.

    The NaN is set apart in integer lanes: as a select on the float32
    result, LLVM's code widens the NaN mask to 32-bit lanes and blends on
    the FMA ports, which slows the e4m3fn task (docs/design.md, "Kernel
    notes")."""
    # S EEEE MMM sign-extended and shifted: S S EEEE MMM 0000000, bit 14 a
    # copy of the sign. With it cleared the bits are float16's for 2^-8 of
    # the value; set only for the NaN code (EEEE MMM all ones), they are
    # float16's NaN.
    comptime I16 = SIMD[DType.int16, width]
    var t = bitcast[DType.int8, width](raw).cast[DType.int16]() << I16(7)
    var nan = ((t & 0x3F80) + 0x80) & 0x4000
    return bitcast[DType.float16, width]((t & I16(-0x4001)) | nan)


@always_inline
def narrow[dtype: DType, width: Int](x: SIMD[F32, width]) -> SIMD[dtype, width]:
    """Rounds x to dtype (to nearest, ties to even)."""
    comptime if dtype == DType.bfloat16 and not is_gpu():
        # In integer lanes: on a CPU without AVX512_BF16 a plain cast is a
        # library call per element (a GPU has an instruction for it).
        var bits = bitcast[DType.uint32, width](x)
        var rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        var is_nan = (bits & 0x7FFFFFFF).gt(0x7F800000)
        var kept = is_nan.select(bits | 0x00400000, rounded)  # NaN: quiet
        return bitcast[dtype, width]((kept >> 16).cast[DType.uint16]())
    else:
        return x.cast[dtype]()


comptime BLOCK = 2 * W
"""Elements one K or V load covers: 64 bytes of bfloat16, two float32
vectors once widened."""


@always_inline
def paired[dtype: DType]() -> Bool:
    """Whether blocks of dtype widen in paired order: a bfloat16 block's even
    elements, then its odd ones. Its 32-bit words then widen with a shift and
    a mask, no shuffles; the q or accumulator rows a paired block meets are
    kept in the same order (`to_paired_order`).

    What is left of widening costs little beside the FMAs, where the chunk
    loop's time goes (docs/design.md, "Kernel notes")."""
    return dtype == DType.bfloat16


def kv_load_scale[dtype: DType]() -> Float32:
    """What the CPU attention kernel's K and V loads (`load_kv`, `load_block`,
    `load_half`) return for an element of 1.0: 2^-8 for float8_e4m3fn, so
    that its widening through float16 ends without a multiply, an op per
    vector on the FMA ports; 1 for every other dtype. The kernel divides its
    q.k and V scales by it, a power of two, so its results are those of exact
    loads, bit for bit, unless a product or sum falls below float32's normal
    range (2^-126), where rounding is coarser. The multiply it spares
    measurably slows the e4m3fn task (docs/design.md, "Kernel notes")."""
    comptime if dtype == DType.float8_e4m3fn and not is_gpu():
        return 1.0 / 256.0
    return 1.0


@always_inline
def load_kv[
    dtype: DType, width: Int
](p: Ptr[dtype], offset: Int) -> SIMD[F32, width]:
    """Width elements of a K or V row at p + offset widened to float32, times
    `kv_load_scale[dtype]()`."""
    return widen_kv(p.unsafe_offset(offset).unsafe_load[width=width]())


@always_inline
def widen_kv[
    dtype: DType, width: Int
](raw: SIMD[dtype, width]) -> SIMD[F32, width]:
    """Raw K or V lanes as `load_kv` widens them."""
    comptime if dtype == DType.float8_e4m3fn and not is_gpu():
        return e4m3_as_float16(raw).cast[F32]()
    else:
        return widen_f32(raw)


@always_inline
def load_block[dtype: DType](p: Ptr[dtype], offset: Int) -> SIMD[F32, BLOCK]:
    """BLOCK elements at p + offset as `load_kv` widens them, in paired order
    if `paired[dtype]`."""
    return widen_block(p.unsafe_offset(offset).unsafe_load[width=BLOCK]())


@always_inline
def load_block_tail[
    dtype: DType
](p: Ptr[dtype], offset: Int, count: Int) -> SIMD[F32, BLOCK]:
    """`load_block` of the last count (< BLOCK) elements of a row at p +
    offset, the lanes past them 0: no memory beyond the row is read (a row
    whose length is not a multiple of BLOCK, the pool's last row included)."""
    return widen_block(load_raw_tail[dtype, BLOCK](p, offset, count))


@always_inline
def load_raw_tail[
    dtype: DType, width: Int
](p: Ptr[dtype], offset: Int, count: Int) -> SIMD[dtype, width]:
    """The count (< width) elements at p + offset as they lie in memory,
    lanes past them 0, read one by one."""
    var raw = bitcast[dtype, width](
        SIMD[DType.uint8, width * size_of[dtype]()](0)
    )
    for i in range(count):
        raw[i] = p[unsafe_offset=offset + i]
    return raw


@always_inline
def widen_block[dtype: DType](raw: SIMD[dtype, BLOCK]) -> SIMD[F32, BLOCK]:
    """A block's raw lanes as `load_block` widens them."""
    comptime if paired[dtype]():
        var words = bitcast[DType.uint32, W](raw)
        var even = bitcast[F32, W](words << 16)
        var odd = bitcast[F32, W](words & 0xFFFF0000)
        return even.join(odd)
    else:
        return widen_kv(raw)


@always_inline
def load_half[
    dtype: DType
](p: Ptr[dtype], offset: Int, half: Int) -> SIMD[F32, W]:
    """Half `half` (0 or 1, a run-time value) of the BLOCK elements at p +
    offset as `load_block` widens them: `load_block(p, offset)` sliced at
    half * W, without a branch."""
    comptime if paired[dtype]():
        var words = bitcast[DType.uint32, W](
            p.unsafe_offset(offset).unsafe_load[width=BLOCK]()
        )
        # Even elements: the low halves of the words, shifted up; odd ones:
        # the high halves, masked.
        var shift = SIMD[DType.uint32, W](UInt32(16 - 16 * half))
        return bitcast[F32, W]((words << shift) & 0xFFFF0000)
    else:
        return load_kv[dtype, W](p, offset + half * W)


@always_inline
def to_paired_order(row: Ptr[F32], n: Int):
    """Reorders each BLOCK of row[:n] as `load_block` widens a paired dtype."""
    for c in range(0, n, BLOCK):
        var halves = (
            row.unsafe_offset(c).unsafe_load[width=BLOCK]().deinterleave()
        )
        row.unsafe_offset(c).unsafe_store(halves[0].join(halves[1]))


@always_inline
def from_paired_order(row: Ptr[F32], n: Int):
    """Undoes `to_paired_order`."""
    for c in range(0, n, BLOCK):
        var x = row.unsafe_offset(c).unsafe_load[width=BLOCK]()
        row.unsafe_offset(c).unsafe_store(
            x.slice[W]().interleave(x.slice[W, offset=W]())
        )
