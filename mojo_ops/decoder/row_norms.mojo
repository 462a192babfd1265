"""The row phases of a decoder layer between its products (decoder_layer.mojo):
the Q|K|V rows' bias (Qwen 2) and the RMSNorm of each query and key head
(QK-norm: Qwen 3, Gemma 3), and Gemma 3's norms after the attention and MLP
products (sandwich norms). The norms:

    x * w / sqrt(mean(x^2) + eps)         over a head's D or a row's H

in float32, as MAX's `ops.rms_norm` over float32 rows computes it.
"""

from std.math import sqrt

from ..cache.paged_kv_cache import Ptr
from ..simd.widen import F32
from ..work_queue import row_block, row_blocks

comptime V = 16
"""float32 lanes per step."""
comptime ROWS_PER_TASK = 8
"""Rows a core takes at a time."""


@always_inline
def rms_scale(x: Ptr[F32], n: Int, eps: Float32) -> Float32:
    """1 / sqrt(mean(x[:n]^2) + eps)."""
    var squares = SIMD[F32, V](0)
    var tail = Float32(0)
    var j = 0
    while j + V <= n:
        var v = x.unsafe_offset(j).unsafe_load[width=V]()
        squares = v.fma(v, squares)
        j += V
    while j < n:
        var v = x[unsafe_offset=j]
        tail += v * v
        j += 1
    return 1 / sqrt((squares.reduce_add() + tail) / Float32(n) + eps)


@always_inline
def scale_into(
    src: Ptr[F32],
    w: Ptr[F32],
    scale: Float32,
    dst: Ptr[F32],
    add: Ptr[F32],
    n: Int,
    accumulate: Bool,
):
    """dst[:n] = src * scale * w (+ add, with `accumulate`)."""
    var j = 0
    while j + V <= n:
        var v = (
            src.unsafe_offset(j).unsafe_load[width=V]()
            * scale
            * w.unsafe_offset(j).unsafe_load[width=V]()
        )
        if accumulate:
            v += add.unsafe_offset(j).unsafe_load[width=V]()
        dst.unsafe_offset(j).unsafe_store(v)
        j += V
    while j < n:
        var v = src[unsafe_offset=j] * scale * w[unsafe_offset=j]
        if accumulate:
            v += add[unsafe_offset=j]
        dst[unsafe_offset=j] = v
        j += 1


@always_inline
def add_into(dst: Ptr[F32], src: Ptr[F32], n: Int):
    """dst[:n] += src[:n]."""
    var j = 0
    while j + V <= n:
        var v = dst.unsafe_offset(j).unsafe_load[width=V]()
        dst.unsafe_offset(j).unsafe_store(
            v + src.unsafe_offset(j).unsafe_load[width=V]()
        )
        j += V
    while j < n:
        dst[unsafe_offset=j] += src[unsafe_offset=j]
        j += 1


struct QKVRows(TrivialRegisterPassable):
    """The tasks of the phase after the Q|K|V product, in place on qkv
    [rows, (Hq + 2 Hkv) D]: the bias [(Hq + 2 Hkv) D] added to each row
    (with `add_bias`), then each query head RMS-normed with q_norm [D] and
    each key head with k_norm [D] (with `norm_heads`); the value heads are
    not normed. No tasks where the layer has neither."""

    var qkv: Ptr[F32]
    var bias: Ptr[F32]
    var q_norm: Ptr[F32]
    var k_norm: Ptr[F32]
    var eps: Float32
    var rows: Int
    var num_qo_heads: Int
    var num_kv_heads: Int
    var head_dim: Int
    var add_bias: Bool
    var norm_heads: Bool

    def __init__(
        out self,
        qkv: Ptr[F32],
        bias: Ptr[F32],
        q_norm: Ptr[F32],
        k_norm: Ptr[F32],
        eps: Float32,
        rows: Int,
        num_qo_heads: Int,
        num_kv_heads: Int,
        head_dim: Int,
        add_bias: Bool,
        norm_heads: Bool,
    ):
        self.qkv = qkv
        self.bias = bias
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.eps = eps
        self.rows = rows if add_bias or norm_heads else 0
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.add_bias = add_bias
        self.norm_heads = norm_heads

    def tasks(self) -> Int:
        return row_blocks(self.rows, ROWS_PER_TASK)

    def run(self, t: Int):
        var d = self.head_dim
        var width = (self.num_qo_heads + 2 * self.num_kv_heads) * d
        var rows = row_block(t, self.rows, ROWS_PER_TASK)
        for r in range(rows[0], rows[1]):
            var row = self.qkv.unsafe_offset(r * width)
            if self.add_bias:
                add_into(row, self.bias, width)
            if not self.norm_heads:
                continue
            for h in range(self.num_qo_heads + self.num_kv_heads):
                var head = row.unsafe_offset(h * d)
                var w = self.q_norm if h < self.num_qo_heads else self.k_norm
                var scale = rms_scale(head, d, self.eps)
                scale_into(head, w, scale, head, head, d, False)


struct NormAddRows(TrivialRegisterPassable):
    """The tasks of a sandwich-norm phase: dst [rows, H] = residual +
    RMSNorm(src) * w (dst may be residual)."""

    var src: Ptr[F32]
    var w: Ptr[F32]
    var residual: Ptr[F32]
    var dst: Ptr[F32]
    var eps: Float32
    var rows: Int
    var width: Int

    def __init__(
        out self,
        src: Ptr[F32],
        w: Ptr[F32],
        residual: Ptr[F32],
        dst: Ptr[F32],
        eps: Float32,
        rows: Int,
        width: Int,
    ):
        self.src = src
        self.w = w
        self.residual = residual
        self.dst = dst
        self.eps = eps
        self.rows = rows
        self.width = width

    def tasks(self) -> Int:
        return row_blocks(self.rows, ROWS_PER_TASK)

    def run(self, t: Int):
        var n = self.width
        var rows = row_block(t, self.rows, ROWS_PER_TASK)
        for r in range(rows[0], rows[1]):
            var src = self.src.unsafe_offset(r * n)
            scale_into(
                src,
                self.w,
                rms_scale(src, n, self.eps),
                self.dst.unsafe_offset(r * n),
                self.residual.unsafe_offset(r * n),
                n,
                True,
            )
