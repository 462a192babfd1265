"""Integer dot products of bytes: four byte products summed into each 32-bit
lane, the step of every quantized product.

`dot_u8s8(acc, a, b)` returns acc[i] + sum_j a[4i + j] * b[4i + j] with a's
bytes unsigned and b's signed, exactly, on every target:

- AVX512_VNNI or AVX-VNNI: one `vpdpbusd`.
- AVX2 (and AVX-512 without VNNI): `vpmaddubsw` then `vpmaddwd` by ones and
  an add. `vpmaddubsw` saturates pairs of products to int16, so it is exact
  only while 2 * a * |b| fits: a < 128 with b in [-127, 127] (4-, 5- and
  6-bit codes). 8-bit codes take `dot_s8s8` there instead.
- NEON with the dot-product extension: `sdot`, signed by signed, exact for
  a < 128.
- Anything else: the bytes widened to int32 lanes and multiplied.

`dot_i16(acc, a, b)` takes int16 lanes instead, two products to a 32-bit
lane (`vpdpwssd` with VNNI): the products of attention over an int8 pool
(attention/cpu/code_products.mojo).

`SIGNED_CODES` says which form a target multiplies 8-bit weight codes in:
unsigned codes with a zero point of 128 (`vpdpbusd` takes a full byte) or
signed codes (`dot_s8s8`, exact for all of them).
"""

from std.memory import bitcast
from std.sys import llvm_intrinsic, simd_width_of
from std.sys.info import CompilationTarget

from ..cache.paged_kv_cache import Ptr

comptime I32 = DType.int32
comptime WI = simd_width_of[I32]()
"""32-bit lanes of a vector register: 16 with AVX-512, 8 with AVX2, 4 with
NEON."""
comptime BYTES = 4 * WI
"""Bytes in a vector register: the bytes one dot product step takes."""

comptime VNNI_512 = CompilationTarget._has_feature["avx512vnni"]() and WI == 16
comptime VNNI_256 = (
    CompilationTarget._has_feature["avxvnni"]()
    or CompilationTarget._has_feature["avx512vnni"]()
) and WI == 8
comptime VNNI = VNNI_512 or VNNI_256
"""Whether `vpdpbusd` multiplies a register of bytes in one instruction."""
comptime MADDUBS = (
    CompilationTarget.is_x86() and CompilationTarget.has_avx2() and not VNNI
)
"""Whether the x86 target pairs `vpmaddubsw` with `vpmaddwd` instead."""
comptime SDOT = (
    CompilationTarget.has_neon()
    and CompilationTarget._has_feature["dotprod"]()
    and WI == 4
)
"""Whether the Arm target has `sdot`."""

comptime SIGNED_CODES = not VNNI
"""Whether 8-bit weight codes are multiplied as signed bytes (`dot_s8s8`)
rather than as unsigned bytes offset by 128 (`dot_u8s8`)."""

comptime Bytes = SIMD[DType.uint8, BYTES]
comptime SBytes = SIMD[DType.int8, BYTES]
comptime Acc = SIMD[I32, WI]


@always_inline
def _maddubs(a: Bytes, b: SBytes) -> SIMD[DType.int16, 2 * WI]:
    """Pairs of products a * b summed into int16 lanes (saturating)."""
    comptime if WI == 16:
        return llvm_intrinsic[
            "llvm.x86.avx512.pmaddubs.w.512", SIMD[DType.int16, 2 * WI]
        ](a, b)
    else:
        return llvm_intrinsic[
            "llvm.x86.avx2.pmadd.ub.sw", SIMD[DType.int16, 2 * WI]
        ](a, b)


@always_inline
def _madd(a: SIMD[DType.int16, 2 * WI], b: SIMD[DType.int16, 2 * WI]) -> Acc:
    """Pairs of int16 products a * b summed into int32 lanes (`vpmaddwd`)."""
    comptime if WI == 16:
        return llvm_intrinsic["llvm.x86.avx512.pmaddw.d.512", Acc](a, b)
    else:
        return llvm_intrinsic["llvm.x86.avx2.pmadd.wd", Acc](a, b)


@always_inline
def _madd_ones(p: SIMD[DType.int16, 2 * WI]) -> Acc:
    """Pairs of int16 lanes summed into int32 lanes."""
    return _madd(p, SIMD[DType.int16, 2 * WI](1))


@always_inline
def dot_u8s8(acc: Acc, a: Bytes, b: SBytes) -> Acc:
    """Returns acc[i] + sum_j a[4i + j] * b[4i + j], a unsigned, b signed.

    Exact for every a where VNNI is true; elsewhere for a < 128 and b in
    [-127, 127] (see the module docstring)."""
    comptime if VNNI_512:
        return llvm_intrinsic["llvm.x86.avx512.vpdpbusd.512", Acc](acc, a, b)
    elif VNNI_256:
        return llvm_intrinsic["llvm.x86.avx512.vpdpbusd.256", Acc](acc, a, b)
    elif MADDUBS:
        return acc + _madd_ones(_maddubs(a, b))
    elif SDOT:
        return llvm_intrinsic["llvm.aarch64.neon.sdot.v4i32.v16i8", Acc](
            acc, bitcast[DType.int8, BYTES](a), b
        )
    else:
        return acc + _widened_dot(a.cast[I32](), b.cast[I32]())


comptime Pairs = SIMD[DType.int16, 2 * WI]
"""int16 lanes of pair sums, `vpmaddubsw`'s output (MADDUBS targets)."""


def pair_dot_steps(code_bits: Int) -> Int:
    """How many `add_pair_dot` steps of codes below 2^code_bits by
    activations in [-127, 127] an int16 lane sums exactly: each adds at
    most 2 * (2^code_bits - 1) * 127 to it (8 steps for 4-bit codes, 4 for
    5-bit, 2 for 6-bit)."""
    return 32767 // (2 * ((1 << code_bits) - 1) * 127)


@always_inline
def add_pair_dot(pairs: Pairs, a: Bytes, b: SBytes) -> Pairs:
    """pairs + the products a * b summed in pairs (one `vpmaddubsw`), a
    unsigned, b signed, MADDUBS targets only.

    Where several dot products of a block go into one int32 sum, adding
    them first in int16 (`pair_dot_steps` of them) and widening once
    (`widen_pairs`) saves `dot_u8s8`'s `vpmaddwd` and add per step: on
    AVX2 that step is three operations against VNNI's one."""
    return pairs + _maddubs(a, b)


@always_inline
def widen_pairs(acc: Acc, pairs: Pairs) -> Acc:
    """acc + pairs summed by twos into int32 lanes: what `dot_u8s8` adds
    for the products `pairs` summed."""
    return acc + _madd_ones(pairs)


@always_inline
def dot_s8s8(acc: Acc, a: SBytes, b: SBytes) -> Acc:
    """Returns acc[i] + sum_j a[4i + j] * b[4i + j], both signed, for b in
    [-127, 127]; exact on every target."""
    comptime if MADDUBS and WI == 8:
        # |a| is at most 128, which vpmaddubsw takes as unsigned; the sign
        # moves to b (one vpsignb: b * sign(a), which is 0 where a is 0, as
        # the product is anyway), so that pairs of products stay within
        # int16.
        var magnitude = bitcast[DType.uint8, BYTES](abs(a))
        var signed = llvm_intrinsic["llvm.x86.avx2.psign.b", SBytes](b, a)
        return acc + _madd_ones(_maddubs(magnitude, signed))
    elif MADDUBS:
        # AVX-512 has no vpsignb: the same with a select.
        var negative = a.lt(0)
        var magnitude = bitcast[DType.uint8, BYTES](negative.select(-a, a))
        return acc + _madd_ones(_maddubs(magnitude, negative.select(-b, b)))
    elif SDOT:
        return llvm_intrinsic["llvm.aarch64.neon.sdot.v4i32.v16i8", Acc](
            acc, a, b
        )
    else:
        return acc + _widened_dot(a.cast[I32](), b.cast[I32]())


comptime Halves = SIMD[DType.int16, 2 * WI]
"""int16 lanes, two to each 32-bit lane of a register."""


@always_inline
def dot_i16(acc: Acc, a: Halves, b: Halves) -> Acc:
    """Returns acc[i] + a[2i] * b[2i] + a[2i + 1] * b[2i + 1], all signed,
    exactly while the sums stay within int32 (they wrap beyond): one
    `vpdpwssd` with VNNI, `vpmaddwd` and an add on other x86 targets (where
    the two products' sum must also fit: not both -32768 * -32768)."""
    comptime if VNNI_512:
        return llvm_intrinsic["llvm.x86.avx512.vpdpwssd.512", Acc](acc, a, b)
    elif VNNI_256:
        return llvm_intrinsic["llvm.x86.avx512.vpdpwssd.256", Acc](acc, a, b)
    elif CompilationTarget.is_x86() and CompilationTarget.has_avx2():
        return acc + _madd(a, b)
    else:
        var p = a.cast[I32]() * b.cast[I32]()
        var out = acc
        comptime for i in range(WI):
            out[i] += p[2 * i] + p[2 * i + 1]
        return out


@always_inline
def _widened_dot(a: SIMD[I32, BYTES], b: SIMD[I32, BYTES]) -> Acc:
    """The portable form: products in int32 lanes, summed by fours."""
    var p = a * b
    var out = Acc(0)
    comptime for i in range(WI):
        out[i] = p[4 * i] + p[4 * i + 1] + p[4 * i + 2] + p[4 * i + 3]
    return out


@always_inline
def broadcast_word(p: Ptr[DType.int8]) -> SBytes:
    """The four bytes at p repeated across a register."""
    var word = bitcast[I32, 1](p.unsafe_load[width=4]())
    return bitcast[DType.int8, BYTES](Acc(word[0]))
