"""Rows of a GGUF-quantized weight packed in panels (block_formats.mojo),
dequantized to float32: the lookup of a token embedding that stays in its
block format (a model whose output head is its embedding reads the head's
panels).

Row r of a weight [N, K] is column r % PANEL of panel r // PANEL. Each
element equals llama.cpp's `dequantize_row_*` and the `gguf` package's
NumPy dequantization of it bit for bit: the products below are exact in
float32 (a float16 scale's 11 significant bits times at most 7 of an int8
multiple and 5 of a code, or 7 of a Q8_0 code), so an element is rounded
at most once, in the addition of its min, whatever the order or fusing:

    Q4_0, Q5_0, Q8_0:   d * (q - z)               z = 8, 16, 0
    Q4_1, Q5_1:         d * q + m
    Q4_K, Q5_K:         (D * sc) * q - (Dmin * m)  (the panel keeps -Dmin)
    Q6_K:               (D * sc) * (q - 32)
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext

from ..cache.paged_kv_cache import Ptr
from ..cache.tensor_access import ptr_of
from ..simd.widen import F32
from .block_formats import (
    GROUP_BYTES,
    PANEL,
    QK,
    code_bits,
    code_bytes,
    code_groups,
    has_min,
    has_super_scales,
    is_supported,
    nibble_bits,
    panel_bytes,
    scale_bytes,
    scales_per_block,
    super_blocks,
    zero_point,
)

comptime ROWS_PER_TASK = 16
"""Rows a task dequantizes: a decode step's few rows stay on one core."""


@always_inline
def code[fmt: Int](block: Ptr[DType.uint8], c: Int, i: Int) -> Int:
    """Code i (< QK) of column c among one block's codes in a panel, as
    stored: unsigned for 4 to 6 bits, signed for Q8_0."""
    comptime if nibble_bits(fmt) == 8:
        var byte = block[unsafe_offset=(i // 4) * GROUP_BYTES + 4 * c + i % 4]
        return Int(byte.cast[DType.int8]())
    var g = i // 8
    var h = (i % 8) // 4
    var j = i % 4
    var q = (
        Int(block[unsafe_offset=g * GROUP_BYTES + 4 * c + j]) >> (4 * h)
    ) & 0x0F
    comptime TOP = code_bits(fmt) - 4
    comptime if TOP > 0:
        # The top bits' groups follow the nibbles': a 5-bit block's one group
        # covers four nibble groups, a 6-bit block's two cover two each.
        comptime PER_GROUP = 8 // (2 * TOP)
        var top = Int(
            block[
                unsafe_offset=(code_groups(fmt) + g // PER_GROUP) * GROUP_BYTES
                + 4 * c
                + j
            ]
        )
        var at = (g % PER_GROUP) * 2 * TOP + h * TOP
        q |= ((top >> at) & ((1 << TOP) - 1)) << 4
    return q


@always_inline
def float16_at(p: Ptr[DType.uint8], index: Int) -> Float32:
    """Float16 number `index` of a byte array, as float32."""
    return (
        p.unsafe_offset(2 * index)
        .unsafe_bitcast[Float16]()[unsafe_offset=0]
        .cast[F32]()
    )


@always_inline
def scale_at[fmt: Int](scales: Ptr[DType.uint8], index: Int) -> Float32:
    """Entry `index` of a panel's scale (or min) array, as float32: stored as
    float16 or int8 (`scale_bytes`)."""
    comptime if scale_bytes(fmt) == 1:
        return scales[unsafe_offset=index].cast[DType.int8]().cast[F32]()
    return float16_at(scales, index)


def dequantize_row[
    fmt: Int
](panel: Ptr[DType.uint8], c: Int, k_dim: Int, dst: Ptr[F32]):
    """Writes dst[:k_dim] = column c of a panel, dequantized (the module
    docstring's formulas)."""
    comptime PARTS = scales_per_block(fmt)
    comptime Z = zero_point(fmt, True)
    var blocks = k_dim // QK
    var scales = panel.unsafe_offset(blocks * code_bytes(fmt))
    var mins = scales.unsafe_offset(blocks * PARTS * PANEL * scale_bytes(fmt))
    var supers = mins.unsafe_offset(
        blocks * PANEL * scale_bytes(fmt) if has_min(fmt) else 0
    )
    for b in range(blocks):
        var codes = panel.unsafe_offset(b * code_bytes(fmt))
        var out = dst.unsafe_offset(b * QK)
        comptime for part in range(PARTS):
            var d = scale_at[fmt](scales, (b * PARTS + part) * PANEL + c)
            comptime if has_super_scales(fmt):
                d = float16_at(supers, (b // 8) * PANEL + c) * d
            var m = Float32(0)
            comptime if has_min(fmt):
                m = scale_at[fmt](mins, b * PANEL + c)
                comptime if has_super_scales(fmt):
                    m = (
                        float16_at(
                            supers, (super_blocks(k_dim) + b // 8) * PANEL + c
                        )
                        * m
                    )
            comptime for i in range(
                part * QK // PARTS, (part + 1) * QK // PARTS
            ):
                var q = code[fmt](codes, c, i)
                comptime if has_min(fmt):
                    out[unsafe_offset=i] = d * Float32(q) + m
                else:
                    out[unsafe_offset=i] = d * Float32(q - Z)


@extensibility.register("pagedkv_packed_rows")
struct PackedRows:
    """Gathers rows [M, K] float32 of a weight [N, K] in a GGUF block
    format packed in panels [ceil(N / 16), panel_bytes]; CPU only.

    Parameters: `format` (GGML's type id) and `out_features` (N). Raises
    before writing anything when an id is outside [0, N).
    """

    @staticmethod
    def execute[
        target: StaticString, format: Int, out_features: Int
    ](
        rows: OutputTensor[dtype=DType.float32, rank=2, ...],
        weight: InputTensor[dtype=DType.uint8, rank=2, ...],
        ids: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_supported(format), "pagedkv: unsupported format"
        comptime if target != "cpu":
            raise Error("pagedkv: pagedkv_packed_rows runs on the CPU")
        var m_dim = ids.dim_size(0)
        var k_dim = rows.dim_size(1)
        if (
            rows.dim_size(0) != m_dim
            or k_dim % QK != 0
            or weight.dim_size(0) != (out_features + PANEL - 1) // PANEL
            or weight.dim_size(1) != panel_bytes(format, k_dim)
        ):
            raise Error("pagedkv: packed_rows operand shapes do not match")
        var id_ptr = ptr_of(ids)
        for r in range(m_dim):
            var id = Int(id_ptr[unsafe_offset=r])
            if id < 0 or id >= out_features:
                raise Error("pagedkv: a token id is outside the vocabulary")
        var w = ptr_of(weight)
        var dst = ptr_of(rows)
        var row_bytes = weight.dim_size(1)

        def task(
            t: Int,
        ) {var w, var dst, var id_ptr, var m_dim, var k_dim, var row_bytes}:
            for r in range(
                t * ROWS_PER_TASK, min(m_dim, (t + 1) * ROWS_PER_TASK)
            ):
                var id = Int(id_ptr[unsafe_offset=r])
                dequantize_row[format](
                    w.unsafe_offset((id // PANEL) * row_bytes),
                    id % PANEL,
                    k_dim,
                    dst.unsafe_offset(r * k_dim),
                )

        var tasks = (m_dim + ROWS_PER_TASK - 1) // ROWS_PER_TASK
        if tasks > 0:
            sync_parallelize(task, tasks)
