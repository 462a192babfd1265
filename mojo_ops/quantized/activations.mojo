"""Activations quantized per block for the quantized products, after an
optional prologue (RMSNorm, or SwiGLU's silu(gate) * up).

Row r's block b (inputs [32b, 32b + 32)) becomes 32 signed bytes q and a
scale d with x ~ d * q: d = max |x| / 127 and q = round(x / d) (ties to
even; 0 when the block is all zeros), as llama.cpp's Q8_0 and Q8_1 do, so
every q is in [-127, 127]. Each block also keeps d * sum(q), and that of
each half of 16 codes, as float32: what a weight block's min or zero
point multiplies (llama.cpp's Q8_1 keeps the first).
"""

from std.math import exp, sqrt, tanh
from std.sys import llvm_intrinsic

from std.memory.alloc import unsafe_alloc

from ..cache.paged_kv_cache import Ptr
from ..simd.widen import F32, load_f32
from ..work_queue import row_block, row_blocks
from .block_formats import QK

comptime NO_PROLOGUE = 0
"""The activations as they are (pagedkv._ops.contract.QLINEAR_PROLOGUES)."""
comptime RMS_NORM = 1
"""RMSNorm: x * gamma / sqrt(mean(x^2) + eps), gamma the op's norm weight."""
comptime SWIGLU = 2
"""SwiGLU: silu(x[:, :K]) * x[:, K:], x twice the weight's inputs wide."""
comptime GEGLU = 3
"""GeGLU with GELU's tanh form: gelu_tanh(x[:, :K]) * x[:, K:] (Gemma's MLP)."""


def is_gated(prologue: Int) -> Bool:
    """Whether the prologue takes gate and up side by side (x is 2K wide)."""
    return prologue == SWIGLU or prologue == GEGLU


@always_inline
def gelu_tanh[n: Int](x: SIMD[F32, n]) -> SIMD[F32, n]:
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    comptime SQRT_2_OVER_PI = Float32(0.7978845608028654)
    return 0.5 * x * (1 + tanh(SQRT_2_OVER_PI * x.fma(0.044715 * x * x, x)))


@always_inline
def quantize_row[
    dtype: DType, prologue: Int
](
    x: Ptr[dtype],
    k_dim: Int,
    gamma: Ptr[F32],
    eps: Float32,
    q: Ptr[DType.int8],
    d: Ptr[F32],
    d_sums: Ptr[F32],
    d_half_sums: Ptr[F32],
):
    """Quantizes one row of k_dim inputs (after the prologue) into q [k_dim],
    d [k_dim / QK], d_sums [k_dim / QK] (d * sum(q)) and d_half_sums
    [2 * k_dim / QK] (d * the sum of each half's codes)."""
    var scale = Float32(1)
    comptime if prologue == RMS_NORM:
        var squares = SIMD[F32, QK](0)
        for k in range(0, k_dim, QK):
            var v = load_f32[dtype, QK](x, k)
            squares = v.fma(v, squares)
        scale = 1 / sqrt(squares.reduce_add() / Float32(k_dim) + eps)
    for b in range(k_dim // QK):
        var v: SIMD[F32, QK]
        comptime if prologue == SWIGLU:
            var gate = load_f32[dtype, QK](x, b * QK)
            var up = load_f32[dtype, QK](x, k_dim + b * QK)
            v = gate / (1 + exp(-gate)) * up
        elif prologue == GEGLU:
            var gate = load_f32[dtype, QK](x, b * QK)
            var up = load_f32[dtype, QK](x, k_dim + b * QK)
            v = gelu_tanh[QK](gate) * up
        else:
            v = load_f32[dtype, QK](x, b * QK)
            comptime if prologue == RMS_NORM:
                v = (
                    v
                    * scale
                    * gamma.unsafe_offset(b * QK).unsafe_load[width=QK]()
                )
        var amax = abs(v).reduce_max()
        var inverse = Float32(127) / amax if amax > 0 else Float32(0)
        var codes = llvm_intrinsic["llvm.roundeven", SIMD[F32, QK]](
            v * inverse
        ).cast[DType.int32]()
        q.unsafe_offset(b * QK).unsafe_store(codes.cast[DType.int8]())
        var scale = amax / 127
        var first = codes.slice[QK // 2]().reduce_add()
        var second = codes.slice[QK // 2, offset=QK // 2]().reduce_add()
        d[unsafe_offset=b] = scale
        d_sums[unsafe_offset=b] = scale * Float32(first + second)
        d_half_sums[unsafe_offset=2 * b] = scale * Float32(first)
        d_half_sums[unsafe_offset=2 * b + 1] = scale * Float32(second)


comptime ROWS_PER_QUANTIZE_TASK = 8
"""Rows a quantize task takes: a few microseconds of work."""


struct ScratchArena(Movable):
    """One 64-byte-aligned allocation an op carves its scratch buffers from.

    Its buffers are raw pointers, which do not keep it alive: Mojo ends a
    value after its last use, so the op frees it explicitly (`free`) after
    the phases that use its buffers."""

    var base: Ptr[DType.uint8]
    var size: Int
    var used: Int

    def __init__(out self, size: Int):
        self.size = size
        self.used = 0
        self.base = rebind[Ptr[DType.uint8]](
            unsafe_alloc[UInt8](max(size, 64), alignment=64)
        )

    def take(mut self, size: Int) -> Ptr[DType.uint8]:
        """The next `size` bytes, 64-byte aligned (the arena was sized for
        every take, each rounded up to 64)."""
        var at = self.base.unsafe_offset(self.used)
        self.used += (size + 63) // 64 * 64
        return at

    def free(deinit self):
        self.base.unsafe_free()


struct QuantizedRows(TrivialRegisterPassable):
    """Rows of activations quantized per block, in one buffer: codes q
    [M, K] int8, and float32 scales d [M, K / QK], d * sum(q) d_sums
    [M, K / QK] and d * the sum of each half block's codes d_half_sums
    [M, 2 K / QK]."""

    var q: Ptr[DType.int8]
    var d: Ptr[F32]
    var d_sums: Ptr[F32]
    var d_half_sums: Ptr[F32]
    var k_dim: Int
    var blocks: Int

    @staticmethod
    def bytes(m_dim: Int, k_dim: Int) -> Int:
        """The buffer's size for m_dim rows of k_dim inputs, rounded to 64."""
        var size = m_dim * k_dim + 16 * m_dim * (k_dim // QK)
        return (size + 63) // 64 * 64

    def __init__(out self, buffer: Ptr[DType.uint8], m_dim: Int, k_dim: Int):
        """Views `buffer` (at least `bytes(m_dim, k_dim)`) as the rows."""
        self.k_dim = k_dim
        self.blocks = k_dim // QK
        self.q = rebind[Ptr[DType.int8]](buffer)
        # k_dim is a multiple of QK, so the scales start 4-byte aligned.
        self.d = rebind[Ptr[F32]](buffer.unsafe_offset(m_dim * k_dim))
        self.d_sums = self.d.unsafe_offset(m_dim * self.blocks)
        self.d_half_sums = self.d_sums.unsafe_offset(m_dim * self.blocks)

    @always_inline
    def row(self, r: Int) -> Self:
        """The same view from row r on."""
        var out = self
        out.q = self.q.unsafe_offset(r * self.k_dim)
        out.d = self.d.unsafe_offset(r * self.blocks)
        out.d_sums = self.d_sums.unsafe_offset(r * self.blocks)
        out.d_half_sums = self.d_half_sums.unsafe_offset(2 * r * self.blocks)
        return out


struct RowQuantizer[dtype: DType, prologue: Int](TrivialRegisterPassable):
    """The tasks of a quantize phase: blocks of rows of x [M, K] (or
    [M, 2K] under a gated prologue) quantized into `rows` after the
    prologue."""

    var x: Ptr[Self.dtype]
    var gamma: Ptr[F32]
    var eps: Float32
    var rows: QuantizedRows
    var m_dim: Int

    def __init__(
        out self,
        x: Ptr[Self.dtype],
        gamma: Ptr[F32],
        eps: Float32,
        rows: QuantizedRows,
        m_dim: Int,
    ):
        self.x = x
        self.gamma = gamma
        self.eps = eps
        self.rows = rows
        self.m_dim = m_dim

    def tasks(self) -> Int:
        return row_blocks(self.m_dim, ROWS_PER_QUANTIZE_TASK)

    def run(self, t: Int):
        var k_dim = self.rows.k_dim
        var stride = 2 * k_dim if is_gated(Self.prologue) else k_dim
        var rows = row_block(t, self.m_dim, ROWS_PER_QUANTIZE_TASK)
        for r in range(rows[0], rows[1]):
            var out = self.rows.row(r)
            quantize_row[Self.dtype, Self.prologue](
                self.x.unsafe_offset(r * stride),
                k_dim,
                self.gamma,
                self.eps,
                out.q,
                out.d,
                out.d_sums,
                out.d_half_sums,
            )
