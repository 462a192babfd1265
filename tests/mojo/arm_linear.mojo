"""`linear_cpu` on panels, checked against a plain triple loop: the program
tests/test_arm_compile.py builds for an Arm (NEON) target, where a register
tile covers a quarter of a panel row. On x86 test_linear.py covers the op.

Run anywhere with `mojo run -I . tests/mojo/arm_linear.mojo`.
"""

from std.memory.alloc import unsafe_alloc
from std.testing import assert_almost_equal

from mojo_ops.cache.paged_kv_cache import Ptr
from mojo_ops.linear.linear import LINEAR_PANEL, linear_cpu


def check[dtype: DType](m: Int, k: Int, n: Int) raises:
    """Checks y = x @ w for x [m, k] and w [k, n] packed into panels against
    float64 sums of the same (rounded) inputs."""
    var panels_n = (n + LINEAR_PANEL - 1) // LINEAR_PANEL
    var x = rebind[Ptr[dtype]](unsafe_alloc[Scalar[dtype]](m * k))
    var panels = rebind[Ptr[dtype]](
        unsafe_alloc[Scalar[dtype]](panels_n * k * LINEAR_PANEL)
    )
    var y = rebind[Ptr[dtype]](unsafe_alloc[Scalar[dtype]](m * n))
    for i in range(m * k):
        x[unsafe_offset=i] = Scalar[dtype](Float32((i * 37) % 11 - 5) * 0.125)
    for p in range(panels_n):
        for kk in range(k):
            for c in range(LINEAR_PANEL):
                var col = p * LINEAR_PANEL + c
                var v = Float32(((kk * 13 + col * 7) % 9) - 4) * 0.25
                panels[unsafe_offset=(p * k + kk) * LINEAR_PANEL + c] = (
                    Scalar[dtype](v) if col < n else 0
                )
    linear_cpu[dtype](x, panels, y, m, k, n)
    for r in range(m):
        for col in range(n):
            var p, c = divmod(col, LINEAR_PANEL)
            var want = Float64(0)
            for kk in range(k):
                want += Float64(x[unsafe_offset=r * k + kk]) * Float64(
                    panels[unsafe_offset=(p * k + kk) * LINEAR_PANEL + c]
                )
            # Small integers times powers of two: exact in float32 sums;
            # bfloat16 output rounds once.
            assert_almost_equal(
                Float64(y[unsafe_offset=r * n + col]),
                want,
                rtol=0.0 if dtype == DType.float32 else 0.00390625,
            )
    x.unsafe_free()
    panels.unsafe_free()
    y.unsafe_free()


def main() raises:
    comptime for dtype in [DType.float32, DType.bfloat16]:
        check[dtype](13, 37, 100)
        check[dtype](1, 64, 64)
    print("linear_cpu: passed")
