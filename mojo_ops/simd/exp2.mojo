"""Base-2 exponential for float32 softmax weights, to about 2e-7 relative error.

The standard library's float32 exp2 is off by up to 1.4e-5 relatively (measured
over [-30, 0]), which alone puts float32 attention at the edge of a 1e-5
tolerance. This is Cephes' exp2f: 2^x = 2^n * 2^f with n = round(x) and a
degree-6 polynomial for 2^f on [-0.5, 0.5]. Arguments below -127 (including
-inf, a masked score) give exactly 0.
"""

from std.memory import bitcast

comptime F32 = DType.float32


@always_inline
def exp2_f32[width: Int](x: SIMD[F32, width]) -> SIMD[F32, width]:
    var clamped = min(max(x, SIMD[F32, width](-127)), SIMD[F32, width](127))
    var n = round(clamped)
    var f = clamped - n
    var p = SIMD[F32, width](1.535336188319500e-4)
    p = p.fma(f, 1.339887440266574e-3)
    p = p.fma(f, 9.618437357674640e-3)
    p = p.fma(f, 5.550332471162809e-2)
    p = p.fma(f, 2.402264791363012e-1)
    p = p.fma(f, 6.931472028550421e-1)
    p = p.fma(f, 1)
    # 2^n from its exponent bits: n = -127 gives the bits of 0.
    var scale = bitcast[F32, width](
        (n.cast[DType.int32]() + 127).cast[DType.uint32]() << 23
    )
    return p * scale


@always_inline
def nan_lanes[width: Int](x: SIMD[F32, width]) -> SIMD[DType.bool, width]:
    """Which lanes of x are NaN, read from the bits: a `x != x` test may be
    folded away by fast-math compilation, and NaN must reach the output."""
    var magnitude = bitcast[DType.uint32, width](x) & SIMD[DType.uint32, width](
        0x7FFFFFFF
    )
    return magnitude.gt(SIMD[DType.uint32, width](0x7F800000))


@always_inline
def is_nan_f32(x: Float32) -> Bool:
    """Whether x is NaN, read from its bits (see `nan_lanes`)."""
    return nan_lanes[1](x)[0]
