"""Unit test of `narrow`: the CPU kernels' float32 -> bfloat16 rounding.

It rounds in integer lanes instead of calling the compiler's per-element
library routine, so it is checked against the compiler's cast bit for bit:
every sign, exponent and top mantissa bits, with low halves at and around
the rounding ties. NaNs must stay NaN (quiet). Denormal inputs are checked
against nearest-even rounding of their mantissa instead: on a CPU with
AVX512_BF16 the cast is an instruction that reads them as zero.
"""

from std.memory import bitcast
from std.testing import assert_equal, assert_true

from mojo_ops.simd.widen import narrow


def main() raises:
    var checked = 0
    for hi in range(65536):
        for lo in [0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234]:
            var bits = UInt32(hi << 16 | lo)
            var x = bitcast[DType.float32, 1](bits)
            var got = bitcast[DType.uint16, 1](narrow[DType.bfloat16, 1](x))
            if (bits & 0x7FFFFFFF) > 0x7F800000:
                assert_equal(
                    got & 0x7FC0, 0x7FC0, "a NaN must stay a quiet NaN"
                )
            elif (bits & 0x7F800000) == 0 and (bits & 0x7FFFFF) != 0:
                # A denormal is m x 2^-149, a bfloat16 denormal k x 2^-133:
                # k is m / 2^16 rounded to nearest, ties to even.
                var exact = Float64(Int(bits & 0x7FFFFF)) / 65536.0
                var k = Int(exact)
                var rest = exact - Float64(k)
                if rest > 0.5 or (rest == 0.5 and k % 2 == 1):
                    k += 1
                var want = UInt16((bits >> 16) & 0x8000) | UInt16(k)
                assert_equal(got, want, String("rounding ", hex(bits)))
            else:
                var want = bitcast[DType.uint16, 1](x.cast[DType.bfloat16]())
                assert_equal(got, want, String("rounding ", hex(bits)))
            checked += 1
    # The vector form rounds each lane alike.
    var v = SIMD[DType.float32, 4](1.0, -2.5, 3.0e38, 1.00390625)
    var w = narrow[DType.bfloat16, 4](v)
    assert_true(w == v.cast[DType.bfloat16]())
    print("narrow:", checked, "values passed")
