"""Products of a model's linear layers with GGUF-quantized weights on the
CPU: y = prologue(x) @ w^T (+ residual).

x [M, K] (or [M, 2K] for SwiGLU's prologue) is quantized per block of 32
inputs to signed bytes (activations.mojo); w [N, K] stays in its GGUF block
format, repacked in panels of 16 columns (block_formats.mojo), so a step
reads 4 or 8 bits per weight plus the block scales. Each block's product is
a byte dot product summed exactly in int32 lanes (simd/int8_dot.mojo),
scaled by both block scales into float32 accumulators, and corrected for
the weight's zero point z or min m by the activations' d_x * sum(q_x), which
the quantizer keeps beside their codes (a zero point is a min of -z d_w):

    y[r, c] += d_w * d_x * sum_i q_w q_x - z d_w * (d_x sum_i q_x)   zero point z
    y[r, c] += d_w * d_x * sum_i q_w q_x + m_w * (d_x sum_i q_x)     min m

The op runs in two passes over all cores: the rows of x are quantized, then
tasks of one panel by a block of rows each stream their panel once, a
register tile of rows at a time.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from std.memory import bitcast, stack_allocation
from std.sys.intrinsics import PrefetchOptions, prefetch

from ..cache.paged_kv_cache import Ptr
from ..cache.tensor_access import ptr_of
from ..simd.int8_dot import (
    BYTES,
    MADDUBS,
    SIGNED_CODES,
    WI,
    Acc,
    Bytes,
    Pairs,
    add_pair_dot,
    broadcast_word,
    dot_s8s8,
    dot_u8s8,
    pair_dot_steps,
    widen_pairs,
)
from ..simd.amx import (
    AMX_ROWS,
    AMX_TARGET,
    amx_ready,
    configure_tiles,
    release_tiles,
    tile_product,
)
from ..simd.widen import F32, VECTOR_REGISTERS
from max.runtime.asyncrt import parallelism_level

from ..work_queue import Phases, parallel_phases, row_block, row_blocks
from .activations import (
    NO_PROLOGUE,
    RMS_NORM,
    SWIGLU,
    QuantizedRows,
    is_gated,
    RowQuantizer,
    ScratchArena,
)
from .block_formats import (
    GROUP_BYTES,
    PANEL,
    QK,
    code_bits,
    code_bytes,
    code_groups,
    has_min,
    has_super_scales,
    super_blocks,
    is_supported,
    panel_bytes,
    scale_bytes,
    scales_per_block,
    zero_point,
)

comptime NO_EPILOGUE = 0
"""The product as computed (pagedkv._ops.contract.QLINEAR_EPILOGUES)."""
comptime ADD_RESIDUAL = 1
"""The product plus residual, [M, N] float32."""

comptime NV = PANEL // WI
"""Vectors of 32-bit lanes across a panel's columns."""
comptime MR = 6 if VECTOR_REGISTERS >= 32 else 4
"""Rows of x in a register tile: a tile takes one vector of its columns
at a time, so 2 * MR accumulators (int32 or int16 pairs for the block,
float32 across blocks), the codes and the scales stay within the target's
vector registers."""
comptime MAX_TILES_PER_TASK = 8
"""Register tiles of rows a task runs over its panel at most (the panel
stays in L1 across them)."""
comptime MIN_TASKS = 32
"""Tasks a product is split into when it has that many tiles."""
comptime TASK_BYTES = 1 << 20
"""Weight bytes a task of a one-tile product (a decode step of a few
requests) streams at least: adjacent panels lie one after another in
memory, so a task reads on in one stream, and its claim from the shared
counter is a small part of its time. Each core's stream stays long:
with tasks of 64 KiB, each core taking every other one, one-row products
read their weights slower than with tasks of 1 MiB, on AVX2 and AVX-512
alike (docs/performance.md, "Longer tasks for one-row products"). Small
products keep TASKS_PER_CORE tasks a core instead."""
comptime PREFETCH_AHEAD = 8192
"""How far ahead of a panel's first register tile its codes are asked into
the L2 (a run of panels is one stream, so this reaches into the next one).
A block's loads feed a chain of dot products that waits on them, and the
core stops issuing loads once its vector scheduler fills with such waiting
operations, a few blocks ahead: the prefetches, which wait on nothing, keep
more of the stream in flight. 8 KiB ahead streamed the layers' one-row
products faster than 4 KiB and 16 KiB, most on AVX2, whose products take
twice the operations a byte (they reached the plain read's speed there,
from 1.3x its time); into the L1 (prefetcht0) they did not help."""
comptime TASKS_PER_CORE = 4
"""Tasks per core a one-tile product keeps at least, so that a core slowed
by a neighbour leaves the others little to wait for."""


@always_inline
def block_scales[
    fmt: Int
](scales: Ptr[DType.uint8], first: Int) -> SIMD[F32, WI]:
    """WI consecutive scales (or mins) from index `first` of a panel's
    scale array, as float32: stored as float16 or int8 (`scale_bytes`)."""
    comptime if scale_bytes(fmt) == 1:
        return (
            scales.unsafe_offset(first)
            .unsafe_bitcast[Int8]()
            .unsafe_load[width=WI]()
            .cast[F32]()
        )
    return (
        scales.unsafe_offset(first * 2)
        .unsafe_bitcast[Float16]()
        .unsafe_load[width=WI]()
        .cast[F32]()
    )


@always_inline
def top_bits[bit: Int, width: Int](top: Bytes) -> Bytes:
    """Bits bit .. bit + width - 1 of each byte of top, moved to bit 4 on:
    the top of a 5- or 6-bit code."""
    var mask = Bytes(((1 << width) - 1) << 4)
    comptime if bit < 4:
        return (top << Bytes(4 - bit)) & mask
    elif bit == 4:
        return top & mask
    else:
        return (top >> Bytes(bit - 4)) & mask


@always_inline
def prefetch_codes[fmt: Int](codes: Ptr[DType.uint8], ahead: Int):
    """Asks for the block codes `ahead` bytes on from `codes` (a block's
    first byte) into the L2; nothing with `ahead` 0 (PREFETCH_AHEAD says
    why)."""
    if ahead != 0:
        comptime for g in range(code_bytes(fmt) // GROUP_BYTES):
            prefetch[PrefetchOptions().for_read().low_locality()](
                codes.unsafe_offset(ahead + g * GROUP_BYTES)
            )


@always_inline
def group_codes[
    fmt: Int, g: Int, v: Int
](codes: Ptr[DType.uint8]) -> Tuple[Bytes, Bytes]:
    """The codes of group g of a 4- to 6-bit block (`codes` its first byte),
    vector v of its columns, as unsigned bytes: the inputs 8g .. 8g + 3 of
    each column (the low nibbles, with their top bits), then 8g + 4 .. 8g +
    7 (the high ones)."""
    comptime BITS = code_bits(fmt)
    comptime GROUPS = code_groups(fmt)
    comptime assert BITS <= 6, "8-bit codes are bytes as stored"
    var raw = codes.unsafe_offset(g * GROUP_BYTES + v * BYTES).unsafe_load[
        width=BYTES
    ]()
    var lo = raw & 0x0F
    var hi = raw >> 4
    comptime if BITS > 4:
        # The top bits' groups follow the nibbles' (block_formats.mojo).
        comptime TOP = BITS - 4
        comptime PER_GROUP = 8 // (2 * TOP)
        var top = codes.unsafe_offset(
            (GROUPS + g // PER_GROUP) * GROUP_BYTES + v * BYTES
        ).unsafe_load[width=BYTES]()
        comptime at = (g % PER_GROUP) * 2 * TOP
        lo |= top_bits[at, TOP](top)
        hi |= top_bits[at + TOP, TOP](top)
    return (lo, hi)


@always_inline
def add_block[
    fmt: Int, rows: Int, v: Int, signed_codes: Bool
](
    acc: Pointer[SIMD[F32, WI], MutUntrackedOrigin],
    sums: Pointer[Acc, MutUntrackedOrigin],
    panel: Ptr[DType.uint8],
    x: QuantizedRows,
    b: Int,
):
    """Adds block b's products to acc [rows] (vector v of the panel's
    columns): its exact sums [parts, rows] of byte products, each scaled by
    the weight's and the activations' block scales, then corrected for the
    zero point or min by the activations' d * sum over the part's inputs:
    four vector operations per row and part. `signed_codes`: whether the
    sums took 8-bit codes as signed bytes (else offset by 128)."""
    comptime CODE_BYTES = code_bytes(fmt)
    comptime Z = zero_point(fmt, signed_codes)
    comptime MIN = has_min(fmt)
    comptime PARTS = scales_per_block(fmt)
    var blocks = x.blocks
    var scales = panel.unsafe_offset(blocks * CODE_BYTES)
    var mins = scales.unsafe_offset(blocks * PARTS * PANEL * scale_bytes(fmt))
    # Super-blocks' float16 scales follow the blocks' (and their mins).
    var supers = mins.unsafe_offset(
        blocks * PANEL * scale_bytes(fmt) if MIN else 0
    )
    comptime for part in range(PARTS):
        var d = block_scales[fmt](scales, (b * PARTS + part) * PANEL + v * WI)
        comptime if has_super_scales(fmt):
            d *= (
                supers.unsafe_offset(((b // 8) * PANEL + v * WI) * 2)
                .unsafe_bitcast[Float16]()
                .unsafe_load[width=WI]()
                .cast[F32]()
            )
        # What multiplies the activations' d * sum: the block's min, or its
        # zero point as one (w = d q - z d).
        var shift = SIMD[F32, WI](0)
        comptime if MIN:
            shift = block_scales[fmt](mins, b * PANEL + v * WI)
            comptime if has_super_scales(fmt):
                shift *= (
                    supers.unsafe_offset(
                        ((super_blocks(x.k_dim) + b // 8) * PANEL + v * WI) * 2
                    )
                    .unsafe_bitcast[Float16]()
                    .unsafe_load[width=WI]()
                    .cast[F32]()
                )
        elif Z != 0:
            shift = d * Float32(-Z)
        comptime for r in range(rows):
            var dot = sums[unsafe_offset=part * rows + r]
            acc[unsafe_offset=r] = dot.cast[F32]().fma(
                d * x.d[unsafe_offset=r * blocks + b], acc[unsafe_offset=r]
            )
            comptime if MIN or Z != 0:
                var d_sum: Float32
                comptime if PARTS == 2:
                    d_sum = x.d_half_sums[
                        unsafe_offset=2 * (r * blocks + b) + part
                    ]
                else:
                    d_sum = x.d_sums[unsafe_offset=r * blocks + b]
                acc[unsafe_offset=r] = shift.fma(
                    SIMD[F32, WI](d_sum), acc[unsafe_offset=r]
                )


@always_inline
def tile[
    fmt: Int, rows: Int
](panel: Ptr[DType.uint8], x: QuantizedRows, dst: Ptr[F32], ahead: Int):
    """Computes dst[r, :PANEL] = x[r] . w[c] for the panel's columns c and
    rows r < rows of the quantized activations x (a view from the tile's
    first row); dst's row stride is PANEL. With `ahead` (bytes, 0 for
    none), each block asks for the codes that far on into the L2.

    A block's byte dot products sum exactly in int32, one sum per scale of
    the weight's block (two for Q6_K's halves of 16 inputs), then
    `add_block` scales them into float32."""
    comptime BITS = code_bits(fmt)
    comptime GROUPS = code_groups(fmt)
    comptime CODE_BYTES = code_bytes(fmt)
    comptime SIGNED = BITS == 8 and SIGNED_CODES
    comptime PARTS = scales_per_block(fmt)
    comptime PART_GROUPS = GROUPS // PARTS
    # Without VNNI, 4- to 6-bit codes sum their dot products in int16 pairs
    # for PAIR_STEPS steps before widening them to int32 (add_pair_dot).
    comptime PAIRED = MADDUBS and BITS <= 6
    comptime PAIR_STEPS = pair_dot_steps(BITS)
    # A group adds two steps (its low and high nibbles) before a widening.
    comptime assert not PAIRED or PAIR_STEPS % 2 == 0, "pairs of steps fit"
    var blocks = x.blocks
    var k_dim = x.k_dim
    # One vector of columns at a time, all blocks: its rows' accumulators
    # are all a tile keeps live, so that AVX2's 16 registers hold a tile of
    # 4 rows, each unpacked vector of codes serving all of them.
    comptime for v in range(NV):
        var acc = stack_allocation[rows, SIMD[F32, WI]]()
        comptime for r in range(rows):
            acc[unsafe_offset=r] = 0
        for b in range(blocks):
            var isum = stack_allocation[PARTS * rows, Acc]()
            var pairs = stack_allocation[PARTS * rows, Pairs]()
            comptime for i in range(PARTS * rows):
                isum[unsafe_offset=i] = 0
                comptime if PAIRED:
                    pairs[unsafe_offset=i] = 0
            var codes = panel.unsafe_offset(b * CODE_BYTES)
            var xb = x.q.unsafe_offset(b * QK)
            comptime if v == 0:
                prefetch_codes[fmt](codes, ahead)
            comptime for g in range(GROUPS):
                comptime part = g // PART_GROUPS
                comptime if BITS <= 6:
                    var lo, hi = group_codes[fmt, g, v](codes)
                    # The part's steps so far, this group's two included.
                    comptime steps = (g % PART_GROUPS + 1) * 2
                    comptime for r in range(rows):
                        var xr = xb.unsafe_offset(r * k_dim + 8 * g)
                        var i = part * rows + r
                        comptime if PAIRED:
                            var p = add_pair_dot(
                                pairs[unsafe_offset=i], lo, broadcast_word(xr)
                            )
                            p = add_pair_dot(
                                p, hi, broadcast_word(xr.unsafe_offset(4))
                            )
                            comptime if (
                                steps % PAIR_STEPS == 0
                                or steps == 2 * PART_GROUPS
                            ):
                                isum[unsafe_offset=i] = widen_pairs(
                                    isum[unsafe_offset=i], p
                                )
                                p = 0
                            pairs[unsafe_offset=i] = p
                        else:
                            isum[unsafe_offset=i] = dot_u8s8(
                                isum[unsafe_offset=i], lo, broadcast_word(xr)
                            )
                            isum[unsafe_offset=i] = dot_u8s8(
                                isum[unsafe_offset=i],
                                hi,
                                broadcast_word(xr.unsafe_offset(4)),
                            )
                else:
                    var raw = codes.unsafe_offset(
                        g * GROUP_BYTES + v * BYTES
                    ).unsafe_load[width=BYTES]()
                    comptime for r in range(rows):
                        var xr = xb.unsafe_offset(r * k_dim + 4 * g)
                        var i = part * rows + r
                        comptime if SIGNED:
                            isum[unsafe_offset=i] = dot_s8s8(
                                isum[unsafe_offset=i],
                                bitcast[DType.int8, BYTES](raw),
                                broadcast_word(xr),
                            )
                        else:
                            isum[unsafe_offset=i] = dot_u8s8(
                                isum[unsafe_offset=i],
                                raw ^ 0x80,
                                broadcast_word(xr),
                            )
            add_block[fmt, rows, v, SIGNED_CODES](acc, isum, panel, x, b)
        comptime for r in range(rows):
            dst.unsafe_offset(r * PANEL + v * WI).unsafe_store(
                acc[unsafe_offset=r]
            )


comptime AMX_CODES = 8 * BYTES
"""Bytes of one block's codes as a B tile (8 rows of 64 bytes)."""
comptime AMX_SUMS = AMX_ROWS * PANEL * 4
"""Bytes of one block's sums (a C tile)."""
comptime AMX_SCRATCH = 2 * (AMX_CODES + AMX_SUMS)
"""Bytes of a task's AMX scratch (64-byte aligned): two blocks' unpacked
codes, then two blocks' sums."""


def takes_amx(fmt: Int) -> Bool:
    """Whether the format's products of many rows take AMX tiles (where the
    CPU has them): one scale a block. Q6_K's two halves, each half a tile
    product's depth, ran no faster than the AVX-512 tile."""
    return scales_per_block(fmt) == 1


@always_inline
def _amx_codes[
    fmt: Int
](
    panel: Ptr[DType.uint8], b: Int, scratch: Ptr[DType.uint8], ahead: Int
) -> Ptr[DType.uint8]:
    """Block b's codes as unsigned B tile rows in scratch's half b % 2:
    4- to 6-bit codes unpacked, row 2g the group's low codes and 2g + 1 its
    high ones; 8-bit codes offset by 128, as the register tile reads them
    (so a row's sums, and its products, are the same bits whichever tile
    takes it). With `ahead` (bytes, 0 for none), asks for the codes that
    far on into the L2, as `tile` does."""
    var codes = panel.unsafe_offset(b * code_bytes(fmt))
    prefetch_codes[fmt](codes, ahead)
    var rows = scratch.unsafe_offset((b % 2) * AMX_CODES)
    comptime if code_bits(fmt) == 8:
        comptime assert not SIGNED_CODES, "AMX targets have VNNI"
        comptime for g in range(code_groups(fmt)):
            var raw = codes.unsafe_offset(g * GROUP_BYTES).unsafe_load[
                width=BYTES
            ]()
            rows.unsafe_offset(g * BYTES).unsafe_store(raw ^ 0x80)
    else:
        comptime for g in range(code_groups(fmt)):
            var lo, hi = group_codes[fmt, g, 0](codes)
            rows.unsafe_offset(2 * g * BYTES).unsafe_store(lo)
            rows.unsafe_offset((2 * g + 1) * BYTES).unsafe_store(hi)
    return rows


@always_inline
def amx_tile[
    fmt: Int
](
    panel: Ptr[DType.uint8],
    x: QuantizedRows,
    dst: Ptr[F32],
    scratch: Ptr[DType.uint8],
    ahead: Int,
):
    """`tile` for AMX_ROWS rows with AMX tile products (simd/amx.mojo), in a
    thread whose tiles are configured, for a format with one scale a block
    (`takes_amx`): each block's codes as the B tile (`_amx_codes`), the
    rows' activations as the A tile, the sums scaled by `add_block`: bit
    for bit the register tile's products, so a row's result does not depend
    on the rows beside it (batch-invariant decode).

    The work is staggered over three blocks, so that no load waits on the
    store just before it: block b + 1's codes are unpacked and block b's
    tile products stored while block b - 1's sums are scaled."""
    comptime assert NV == 1, "a panel is one vector of columns"
    comptime assert takes_amx(fmt), "one scale a block"
    comptime BLOCK_SUMS = AMX_ROWS * PANEL
    var sums = rebind[Ptr[DType.int32]](scratch.unsafe_offset(2 * AMX_CODES))
    var acc = stack_allocation[AMX_ROWS, SIMD[F32, WI]]()
    comptime for r in range(AMX_ROWS):
        acc[unsafe_offset=r] = 0
    var blocks = x.blocks
    var next_codes = _amx_codes[fmt](panel, 0, scratch, ahead)
    for b in range(blocks + 1):
        if b < blocks:
            var codes = next_codes
            if b + 1 < blocks:
                next_codes = _amx_codes[fmt](panel, b + 1, scratch, ahead)
            tile_product(
                sums.unsafe_offset((b % 2) * BLOCK_SUMS),
                x.q.unsafe_offset(b * QK),
                x.k_dim,
                codes,
            )
        if b > 0:
            add_block[fmt, AMX_ROWS, 0, SIGNED_CODES](
                acc,
                rebind[Pointer[Acc, MutUntrackedOrigin]](
                    sums.unsafe_offset(((b - 1) % 2) * BLOCK_SUMS)
                ),
                panel,
                x,
                b - 1,
            )
    comptime for r in range(AMX_ROWS):
        dst.unsafe_offset(r * PANEL).unsafe_store(acc[unsafe_offset=r])


@always_inline
def store_rows[
    epilogue: Int
](
    tile_out: Ptr[F32],
    y: Ptr[F32],
    residual: Ptr[F32],
    rows: Int,
    cols: Int,
    n_dim: Int,
):
    """y[i, :cols] = tile_out[i, :cols] (+ residual[i, :cols]) for i < rows:
    a register tile's rows (PANEL apart) into the output (n_dim apart)."""
    for i in range(rows):
        var dst = y.unsafe_offset(i * n_dim)
        var add = residual.unsafe_offset(i * n_dim)
        var src = tile_out.unsafe_offset(i * PANEL)
        if cols == PANEL:
            comptime for v in range(NV):
                var value = src.unsafe_offset(v * WI).unsafe_load[width=WI]()
                comptime if epilogue == ADD_RESIDUAL:
                    value += add.unsafe_offset(v * WI).unsafe_load[width=WI]()
                dst.unsafe_offset(v * WI).unsafe_store(value)
        else:
            for c in range(cols):
                var value = src[unsafe_offset=c]
                comptime if epilogue == ADD_RESIDUAL:
                    value += add[unsafe_offset=c]
                dst[unsafe_offset=c] = value


@always_inline
def panel_rows[
    fmt: Int, epilogue: Int
](
    panel: Ptr[DType.uint8],
    x: QuantizedRows,
    y: Ptr[F32],
    residual: Ptr[F32],
    rows: Int,
    cols: Int,
    n_dim: Int,
    amx_scratch: Ptr[DType.uint8],
    amx: Bool,
):
    """Computes y[r, :cols] for r < rows of x (a view from the first row)
    from one panel (y's and residual's row stride n_dim): with `amx` (the
    thread's tiles configured, `amx_scratch` AMX_SCRATCH bytes) AMX_ROWS
    rows at a time while that many are left, then MR at a time."""
    var tile_out = stack_allocation[
        max(MR, AMX_ROWS) * PANEL, Scalar[F32], alignment=64
    ]()
    var r = 0
    comptime if AMX_TARGET and takes_amx(fmt):
        if amx:
            while rows - r >= AMX_ROWS:
                amx_tile[fmt](
                    panel,
                    x.row(r),
                    tile_out,
                    amx_scratch,
                    PREFETCH_AHEAD if r == 0 else 0,
                )
                store_rows[epilogue](
                    tile_out,
                    y.unsafe_offset(r * n_dim),
                    residual.unsafe_offset(r * n_dim),
                    AMX_ROWS,
                    cols,
                    n_dim,
                )
                r += AMX_ROWS
    while r < rows:
        var n = min(MR, rows - r)
        comptime for m in range(1, MR + 1):
            if n == m:
                tile[fmt, m](
                    panel, x.row(r), tile_out, PREFETCH_AHEAD if r == 0 else 0
                )
        store_rows[epilogue](
            tile_out,
            y.unsafe_offset(r * n_dim),
            residual.unsafe_offset(r * n_dim),
            n,
            cols,
            n_dim,
        )
        r += MR


struct QuantizedProduct[fmt: Int, epilogue: Int](TrivialRegisterPassable):
    """y [M, N] = x @ w^T (+ residual) for quantized activations x: the
    tasks of one product phase, each a run of adjacent panels by a block of
    rows. y and residual rows are y_stride apart (N, or more where y is
    some columns of a wider matrix)."""

    var weight: Ptr[DType.uint8]
    var x: QuantizedRows
    var y: Ptr[F32]
    var residual: Ptr[F32]
    var m_dim: Int
    var n_dim: Int
    var panels: Int
    var stride: Int
    var y_stride: Int
    var rows_per_task: Int
    var panels_per_task: Int
    var amx: Bool

    def __init__(
        out self,
        weight: Ptr[DType.uint8],
        x: QuantizedRows,
        y: Ptr[F32],
        residual: Ptr[F32],
        m_dim: Int,
        n_dim: Int,
        y_stride: Int,
    ):
        """Splits the product into tasks: blocks of rows of at most
        MAX_TILES_PER_TASK register tiles, enough of them to keep every core
        busy (MIN_TASKS); where the rows are one register tile, runs of
        adjacent panels of about TASK_BYTES, at least TASKS_PER_CORE per
        core."""
        self.weight = weight
        self.x = x
        self.y = y
        self.residual = residual
        self.m_dim = m_dim
        self.n_dim = n_dim
        self.panels = (n_dim + PANEL - 1) // PANEL
        self.stride = panel_bytes(Self.fmt, x.k_dim)
        self.y_stride = y_stride
        var row_tiles = (m_dim + MR - 1) // MR
        var tiles_per_task = min(
            max(row_tiles * self.panels // MIN_TASKS, 1), MAX_TILES_PER_TASK
        )
        self.rows_per_task = tiles_per_task * MR
        # AMX takes rows AMX_ROWS at a time: a task's block of rows is a
        # multiple of that where the product has as many.
        self.amx = takes_amx(Self.fmt) and m_dim >= AMX_ROWS and amx_ready()
        if self.amx:
            self.rows_per_task = (
                (self.rows_per_task + AMX_ROWS - 1) // AMX_ROWS * AMX_ROWS
            )
        self.panels_per_task = 1
        var cores = max(parallelism_level(None), 1)
        if self.amx:
            # A task configures and releases its tiles: runs of panels keep
            # that small beside its products (docs/design.md, "Kernel notes").
            self.panels_per_task = max(
                self.panels // (TASKS_PER_CORE * cores), 1
            )
        elif row_tiles == 1:
            self.panels_per_task = max(
                min(
                    TASK_BYTES // self.stride,
                    self.panels // (TASKS_PER_CORE * cores),
                ),
                1,
            )

    def panel_runs(self) -> Int:
        """Runs of adjacent panels the product's tasks take."""
        return (self.panels + self.panels_per_task - 1) // self.panels_per_task

    def tasks(self) -> Int:
        return self.panel_runs() * row_blocks(self.m_dim, self.rows_per_task)

    def run(self, t: Int):
        """Task t: panel run t % panel_runs, rows block t // panel_runs."""
        var runs = self.panel_runs()
        var first = (t % runs) * self.panels_per_task
        var rows = row_block(t // runs, self.m_dim, self.rows_per_task)
        var r0 = rows[0]
        var amx_scratch = stack_allocation[
            AMX_SCRATCH, DType.uint8, alignment=64
        ]()
        var amx = self.amx and rows[1] - r0 >= AMX_ROWS
        comptime if AMX_TARGET:
            if amx:
                configure_tiles(amx_scratch)
        for p in range(first, min(first + self.panels_per_task, self.panels)):
            panel_rows[Self.fmt, Self.epilogue](
                self.weight.unsafe_offset(p * self.stride),
                self.x.row(r0),
                self.y.unsafe_offset(r0 * self.y_stride + p * PANEL),
                self.residual.unsafe_offset(r0 * self.y_stride + p * PANEL),
                rows[1] - r0,
                min(PANEL, self.n_dim - p * PANEL),
                self.y_stride,
                amx_scratch,
                amx,
            )
        comptime if AMX_TARGET:
            if amx:
                release_tiles()


def qlinear_cpu[
    fmt: Int, prologue: Int, epilogue: Int, dtype: DType
](
    x: Ptr[dtype],
    weight: Ptr[DType.uint8],
    gamma: Ptr[F32],
    eps: Float32,
    residual: Ptr[F32],
    y: Ptr[F32],
    m_dim: Int,
    k_dim: Int,
    n_dim: Int,
) raises:
    """Computes y = prologue(x) @ w^T (+ residual) on all cores, in two
    phases of one dispatch: the rows of x quantized, then the product; see
    the module docstring. k_dim is the weight's inputs (x has 2 * k_dim
    columns under a gated prologue)."""
    var scratch = ScratchArena(QuantizedRows.bytes(m_dim, k_dim))
    var rows = QuantizedRows(
        scratch.take(QuantizedRows.bytes(m_dim, k_dim)), m_dim, k_dim
    )
    var quantizer = RowQuantizer[dtype, prologue](x, gamma, eps, rows, m_dim)
    var product = QuantizedProduct[fmt, epilogue](
        weight, rows, y, residual, m_dim, n_dim, n_dim
    )

    def task(p: Int, t: Int) {var quantizer, var product}:
        if p == 0:
            quantizer.run(t)
        else:
            product.run(t)

    var phases = Phases()
    _ = phases.add(quantizer.tasks())
    _ = phases.add(product.tasks())
    parallel_phases(task, phases)
    scratch^.free()


@extensibility.register("pagedkv_qlinear")
struct QLinear:
    """Computes y [M, N] = prologue(x) @ w^T (+ residual) for w [N, K] in a
    GGUF block format packed in panels [ceil(N / 16), panel_bytes];
    float32 output; CPU only.

    Parameters: `format` (GGML's type id), `prologue` (activations.mojo:
    NO_PROLOGUE, RMS_NORM with `norm` [K] and eps = params[0], SWIGLU or
    GEGLU with x [M, 2K]) and `epilogue` (NO_EPILOGUE, ADD_RESIDUAL with residual
    [M, N]). Unused operands may be empty.
    """

    @staticmethod
    def execute[
        target: StaticString, format: Int, prologue: Int, epilogue: Int
    ](
        y: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[rank=2, ...],
        weight: InputTensor[dtype=DType.uint8, rank=2, ...],
        norm: InputTensor[dtype=DType.float32, rank=1, ...],
        residual: InputTensor[dtype=DType.float32, rank=2, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_supported(format), "pagedkv: unsupported format"
        comptime if target != "cpu":
            raise Error("pagedkv: pagedkv_qlinear runs on the CPU")
        var m_dim = x.dim_size(0)
        var n_dim = y.dim_size(1)
        var k_dim = x.dim_size(1) // 2 if is_gated(prologue) else x.dim_size(1)
        var panels = (n_dim + PANEL - 1) // PANEL
        if (
            y.dim_size(0) != m_dim
            or k_dim % QK != 0
            or (is_gated(prologue) and x.dim_size(1) != 2 * k_dim)
            or weight.dim_size(0) != panels
            or weight.dim_size(1) != panel_bytes(format, k_dim)
        ):
            raise Error("pagedkv: qlinear operand shapes do not match")
        if prologue == RMS_NORM and (
            norm.dim_size(0) != k_dim or params.dim_size(0) < 1
        ):
            raise Error("pagedkv: qlinear's RMSNorm needs norm [K] and eps")
        if epilogue == ADD_RESIDUAL and (
            residual.dim_size(0) != m_dim or residual.dim_size(1) != n_dim
        ):
            raise Error("pagedkv: qlinear's residual is not [M, N]")
        if m_dim == 0 or n_dim == 0:
            return
        var eps = ptr_of(params)[
            unsafe_offset=0
        ] if prologue == RMS_NORM else Float32(0)
        comptime if target == "cpu":
            qlinear_cpu[format, prologue, epilogue, x.dtype](
                ptr_of(x),
                ptr_of(weight),
                ptr_of(norm),
                eps,
                ptr_of(residual),
                ptr_of(y),
                m_dim,
                k_dim,
                n_dim,
            )
