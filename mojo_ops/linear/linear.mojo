"""Dense products of a model's linear layers on the CPU: y = x @ w.

x is [M, K] (a step's token rows), y is [M, N], and the weight w [K, N] comes
packed in panels, [ceil(N / LINEAR_PANEL), K, LINEAR_PANEL]: panel p holds columns
[p * LINEAR_PANEL, (p + 1) * LINEAR_PANEL) of every row of w, zero past N. A task reads its
panel as one contiguous stream (a weight is read once per step from memory),
and a register tile of rows of x by the panel's columns accumulates in
float32 over all of K: per k, the panel row's vectors and one broadcast of x
per row.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from std.memory import bitcast, stack_allocation

from ..cache.paged_kv_cache import Ptr
from ..cache.tensor_access import ptr_of
from ..simd.widen import DOT_BF16, F32, VECTOR_REGISTERS, W, dot_bf16, load_f32
from ..work_queue import parallel_dynamic

comptime LINEAR_PANEL = 64
"""Columns of a packed weight panel (pagedkv._ops.contract.LINEAR_PANEL)."""
comptime NV = min(4, LINEAR_PANEL // W)
"""Vectors of columns in a register tile: a whole panel row with AVX-512,
half of one with AVX2, a quarter with NEON; a tile sweeps the panel."""
comptime MR = 6 if VECTOR_REGISTERS >= 32 else 4
"""Rows of x in a register tile: MR * NV accumulators, NV panel vectors and
a broadcast stay within the target's vector registers."""
comptime MAX_TILES_PER_TASK = 8
"""Register tiles of rows a task runs over its panel at most (it reuses the
panel from L2 across them)."""
comptime MIN_TASKS = 32
"""Tasks a product is split into when it has that many tiles: a projection
of few panels (576 columns: 9) still keeps every core busy to the end."""


@always_inline
def tile[
    dtype: DType, rows: Int
](x: Ptr[dtype], panel: Ptr[dtype], acc_out: Ptr[F32], k_dim: Int):
    """Computes acc_out[r, :NV*W] = sum_k x[r, k] * panel[k, :NV*W] for r < rows
    (row strides: k_dim for x, LINEAR_PANEL for panel and out)."""
    var acc = stack_allocation[rows * NV, SIMD[F32, W]]()
    var wk = stack_allocation[NV, SIMD[F32, W]]()
    comptime for i in range(rows * NV):
        acc[unsafe_offset=i] = 0
    var k = 0
    comptime if DOT_BF16 and dtype == DType.bfloat16:
        # Two k at a time in AVX512_BF16 dot products: panel rows k and k + 1
        # interleaved into pairs, x's pair broadcast as one 32-bit word. Each
        # product is exact in float32, as with widening.
        comptime BF = DType.bfloat16
        var pairs = stack_allocation[NV, SIMD[BF, 2 * W]]()
        while k + 1 < k_dim:
            comptime for v in range(NV):
                var row = panel.unsafe_offset(k * LINEAR_PANEL + v * W)
                pairs[unsafe_offset=v] = rebind[SIMD[BF, 2 * W]](
                    rebind[SIMD[BF, W]](row.unsafe_load[width=W]()).interleave(
                        rebind[SIMD[BF, W]](
                            row.unsafe_offset(LINEAR_PANEL).unsafe_load[
                                width=W
                            ]()
                        )
                    )
                )
            comptime for r in range(rows):
                var word = bitcast[F32, 1](
                    x.unsafe_offset(r * k_dim + k).unsafe_load[width=2]()
                )
                var xr = bitcast[BF, 2 * W](SIMD[F32, W](word[0]))
                comptime for v in range(NV):
                    acc[unsafe_offset=r * NV + v] = dot_bf16(
                        acc[unsafe_offset=r * NV + v],
                        xr,
                        pairs[unsafe_offset=v],
                    )
            k += 2
    while k < k_dim:
        comptime for v in range(NV):
            wk[unsafe_offset=v] = load_f32[dtype, W](
                panel, k * LINEAR_PANEL + v * W
            )
        comptime for r in range(rows):
            var xr = SIMD[F32, W](
                x.unsafe_offset(r * k_dim + k).unsafe_load().cast[F32]()
            )
            comptime for v in range(NV):
                acc[unsafe_offset=r * NV + v] = xr.fma(
                    wk[unsafe_offset=v], acc[unsafe_offset=r * NV + v]
                )
        k += 1
    comptime for r in range(rows):
        comptime for v in range(NV):
            acc_out.unsafe_offset(r * LINEAR_PANEL + v * W).unsafe_store(
                acc[unsafe_offset=r * NV + v]
            )


@always_inline
def panel_rows[
    dtype: DType
](
    x: Ptr[dtype],
    panel: Ptr[dtype],
    y: Ptr[dtype],
    rows: Int,
    cols: Int,
    k_dim: Int,
    n_dim: Int,
):
    """Computes y[r, :cols] = x[r] @ panel[:, :cols] for r < rows, MR rows
    at a time (y's row stride n_dim)."""
    var tile_out = stack_allocation[MR * LINEAR_PANEL, Scalar[F32]]()
    var r = 0
    while r < rows:
        var n = min(MR, rows - r)
        var xr = x.unsafe_offset(r * k_dim)
        # A run-time sweep: one tile per row count to compile, on any width.
        for c in range(0, LINEAR_PANEL, NV * W):
            comptime for m in range(1, MR + 1):
                if n == m:
                    tile[dtype, m](
                        xr,
                        panel.unsafe_offset(c),
                        tile_out.unsafe_offset(c),
                        k_dim,
                    )
        for i in range(n):
            var dst = y.unsafe_offset((r + i) * n_dim)
            var src = tile_out.unsafe_offset(i * LINEAR_PANEL)
            if cols == LINEAR_PANEL:
                comptime for v in range(LINEAR_PANEL // W):
                    dst.unsafe_offset(v * W).unsafe_store(
                        src.unsafe_offset(v * W)
                        .unsafe_load[width=W]()
                        .cast[dtype]()
                    )
            else:
                for c in range(cols):
                    dst[unsafe_offset=c] = src[unsafe_offset=c].cast[dtype]()
        r += MR


def linear_cpu[
    dtype: DType
](
    x: Ptr[dtype],
    panels: Ptr[dtype],
    y: Ptr[dtype],
    m_dim: Int,
    k_dim: Int,
    n_dim: Int,
) raises:
    """Computes y = x @ w on all cores, a task per panel and block of rows;
    see the module docstring."""
    var num_panels = (n_dim + LINEAR_PANEL - 1) // LINEAR_PANEL
    var row_tiles = (m_dim + MR - 1) // MR
    var tiles_per_task = min(
        max(row_tiles * num_panels // MIN_TASKS, 1), MAX_TILES_PER_TASK
    )
    var rows_per_task = tiles_per_task * MR
    var row_blocks = (m_dim + rows_per_task - 1) // rows_per_task

    def task(
        t: Int,
    ) {
        var x,
        var panels,
        var y,
        var m_dim,
        var k_dim,
        var n_dim,
        var num_panels,
        var rows_per_task,
    }:
        var p = t % num_panels
        var r0 = (t // num_panels) * rows_per_task
        panel_rows[dtype](
            x.unsafe_offset(r0 * k_dim),
            panels.unsafe_offset(p * k_dim * LINEAR_PANEL),
            y.unsafe_offset(r0 * n_dim + p * LINEAR_PANEL),
            min(rows_per_task, m_dim - r0),
            min(LINEAR_PANEL, n_dim - p * LINEAR_PANEL),
            k_dim,
            n_dim,
        )

    parallel_dynamic(task, num_panels * row_blocks)


@extensibility.register("pagedkv_linear")
struct Linear:
    """Computes y [M, N] = x [M, K] @ w for w packed as panels
    [ceil(N / LINEAR_PANEL), K, LINEAR_PANEL]; float32 accumulation; CPU only.
    """

    @staticmethod
    def execute[
        target: StaticString
    ](
        y: OutputTensor[rank=2, ...],
        x: InputTensor[dtype=y.dtype, rank=2, ...],
        panels: InputTensor[dtype=y.dtype, rank=3, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error(
                "pagedkv: pagedkv_linear runs on the CPU (a GPU graph uses"
                " MAX's matmul)"
            )
        var m_dim = x.dim_size(0)
        var k_dim = x.dim_size(1)
        var n_dim = y.dim_size(1)
        if (
            y.dim_size(0) != m_dim
            or panels.dim_size(1) != k_dim
            or panels.dim_size(2) != LINEAR_PANEL
            or panels.dim_size(0) != (n_dim + LINEAR_PANEL - 1) // LINEAR_PANEL
        ):
            raise Error("pagedkv: linear operand shapes do not match")
        if m_dim == 0 or n_dim == 0:
            return
        comptime if target == "cpu":
            linear_cpu[y.dtype](
                ptr_of(x), ptr_of(panels), ptr_of(y), m_dim, k_dim, n_dim
            )
