"""Unit test of the CPU kernels' widening loads: `load_block` (a block of
BLOCK elements, bfloat16 in paired order), `load_half` (one half of it,
chosen at run time) and `to_paired_order`, which puts q and accumulator
rows in the order `load_block` widens K and V. Exact: widening is a copy.
And `load_f32`'s vector widening of float8, against the standard library's
scalar cast for every one of the 256 bit patterns of each format, and
`load_kv`'s, the same times `kv_load_scale`.
"""

from std.memory import bitcast
from std.memory.alloc import unsafe_alloc
from std.testing import assert_equal, assert_true

from mojo_ops.cache.paged_kv_cache import Ptr
from mojo_ops.simd.widen import (
    BLOCK,
    F32,
    W,
    is_fp8,
    kv_load_scale,
    load_block,
    load_f32,
    load_half,
    load_kv,
    paired,
    to_paired_order,
)


def check[dtype: DType]() raises:
    """Two blocks of distinct values, each element i = i + 1 (exact in the
    16- and 32-bit dtypes, rounded in float8), wanted as the standard
    library's scalar cast widens them, times `kv_load_scale`; the second
    block checks that offsets are honoured."""
    var n = 2 * BLOCK
    var row = rebind[Ptr[dtype]](unsafe_alloc[Scalar[dtype]](n, alignment=64))
    var want = rebind[Ptr[F32]](unsafe_alloc[Float32](n, alignment=64))
    for i in range(n):
        row[unsafe_offset=i] = Scalar[dtype](Float32(i + 1))
        want[unsafe_offset=i] = (
            row[unsafe_offset=i].cast[F32]() * kv_load_scale[dtype]()
        )
    comptime if not is_fp8[dtype]():
        assert_equal(want[unsafe_offset=n - 1], Float32(n))
    comptime if paired[dtype]():
        to_paired_order(want, n)
    for b in range(2):
        var block = load_block[dtype](row, b * BLOCK)
        for half in range(2):
            var got = load_half[dtype](row, b * BLOCK, half)
            for i in range(W):
                var at = b * BLOCK + half * W + i
                assert_equal(block[half * W + i], want[unsafe_offset=at])
                assert_equal(got[i], want[unsafe_offset=at])
    # Paired order: a block's even elements, then its odd ones.
    comptime if paired[dtype]():
        assert_equal(want[unsafe_offset=0], 1.0)
        assert_equal(want[unsafe_offset=1], 3.0)
        assert_equal(want[unsafe_offset=W], 2.0)
    row.unsafe_free()
    want.unsafe_free()


def check_fp8[dtype: DType]() raises:
    """Every bit pattern of dtype, widened a vector at a time, is the
    standard library's float32 for it: the same bits, or NaN for NaN; and
    `load_kv` gives it times `kv_load_scale` (a power of two: exact too)."""
    var row = rebind[Ptr[dtype]](unsafe_alloc[Scalar[dtype]](256, alignment=64))
    for i in range(256):
        row[unsafe_offset=i] = bitcast[dtype](UInt8(i))
    for i in range(0, 256, BLOCK):
        var got = load_f32[dtype, BLOCK](row, i)
        var got_kv = load_kv[dtype, BLOCK](row, i)
        for lane in range(BLOCK):
            var want = row[unsafe_offset=i + lane].cast[F32]()
            var want_kv = want * kv_load_scale[dtype]()
            if want_kv != want_kv:
                assert_true(
                    got_kv[lane] != got_kv[lane], String(dtype, " ", i + lane)
                )
            else:
                assert_equal(
                    got_kv[lane], want_kv, String(dtype, " load_kv ", i + lane)
                )
            if want != want:
                assert_true(
                    got[lane] != got[lane], String(dtype, " ", i + lane)
                )
            else:
                assert_equal(
                    bitcast[DType.uint32](got[lane]),
                    bitcast[DType.uint32](want),
                    String(dtype, " bits ", i + lane),
                )
    # Spot values, independent of the standard library: the largest finite
    # numbers and the smallest subnormals.
    comptime if dtype == DType.float8_e4m3fn:
        assert_equal(load_f32[dtype, 1](row, 0x7E)[0], 448.0)
        assert_equal(load_f32[dtype, 1](row, 0x01)[0], Float32(2.0) ** -9)
    else:
        assert_equal(load_f32[dtype, 1](row, 0x7B)[0], 57344.0)
        assert_equal(load_f32[dtype, 1](row, 0x01)[0], Float32(2.0) ** -16)
        assert_equal(load_f32[dtype, 1](row, 0xFC)[0], -Float32.MAX * 2)
    row.unsafe_free()


def main() raises:
    check[DType.bfloat16]()
    check[DType.float16]()
    check[DType.float32]()
    check[DType.float8_e4m3fn]()
    check[DType.float8_e5m2]()
    check_fp8[DType.float8_e4m3fn]()
    check_fp8[DType.float8_e5m2]()
    print("widen: load_block, load_half and float8 widening passed")
