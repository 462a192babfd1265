"""Folding a chunk's V into the CPU task's accumulators: acc[r] += sum_j
probs[r * CHUNK + j] * v[row j] (see task.mojo for the task as a whole)."""

from std.memory import stack_allocation

from ...cache.paged_kv_cache import Ptr
from ...simd.widen import BLOCK, F32, W, load_block, load_half
from .key_chunks import CHUNK, BlockPrefetch, RowOffsets
from .step_sizes import CHAINS, MIN_HEAD_DIM, row_run


@always_inline
def accumulate_tile[
    tile: Int, kv_dtype: DType, heads: Int = 1
](
    head_dim: Int,
    probs: Ptr[F32],
    v: Ptr[kv_dtype],
    head_stride: Int,
    rows: RowOffsets,
    j0: Int,
    j1: Int,
    acc: Ptr[F32],
    prefetcher: BlockPrefetch,
):
    """Folds tokens j0..j1 of V in: acc[r] += sum_j probs[r * CHUNK + j] *
    v[row j] for the rows r = hh * tile + g of `heads` adjacent KV heads
    (head hh's V at v + hh * head_stride), acc rows in the order
    `load_block` widens V.

    head_dim is covered a few vector slices at a time, so the rows'
    accumulators for those slices stay in registers while the V rows
    stream from L1; few rows take more slices per pass to keep CHAINS
    independent chains, single-row tiles up to a run of `row_run`
    elements. Rows are prefetched on the first pass.
    """
    comptime R = heads * tile
    comptime widest = row_run[kv_dtype]() if tile == 1 else MIN_HEAD_DIM
    # One slice where CHAINS rows fill the chains: two would hold 2 x CHAINS
    # accumulators, past the registers. Otherwise whole blocks, an even
    # count (a tile of 3 rows: CHAINS // 3 rounded down to an even count).
    comptime wanted = max(CHAINS // R - (CHAINS // R) % 2, BLOCK // W)
    comptime slices = 1 if R >= CHAINS else min(wanted, widest // W)
    comptime if slices * W > MIN_HEAD_DIM:
        # As in `score_tile`: an odd number of granules, its own path.
        if head_dim % (slices * W) != 0:
            accumulate_runs[tile, kv_dtype, heads, MIN_HEAD_DIM // W](
                head_dim, probs, v, head_stride, rows, j0, j1, acc, prefetcher
            )
            return
    accumulate_runs[tile, kv_dtype, heads, slices](
        head_dim, probs, v, head_stride, rows, j0, j1, acc, prefetcher
    )


@always_inline
def accumulate_runs[
    tile: Int, kv_dtype: DType, heads: Int, slices: Int
](
    head_dim: Int,
    probs: Ptr[F32],
    v: Ptr[kv_dtype],
    head_stride: Int,
    rows: RowOffsets,
    j0: Int,
    j1: Int,
    acc: Ptr[F32],
    prefetcher: BlockPrefetch,
):
    """`accumulate_tile` over head_dim `slices` vectors at a time: an even
    number (whole blocks), or one (a half block a pass)."""
    comptime assert slices == 1 or slices % 2 == 0, "whole or half blocks"
    comptime R = heads * tile
    # While loops, as in `score_tokens`: `range` loops here make slower
    # code (docs/design.md, "Kernel notes").
    var c0 = 0
    while c0 < head_dim // W:
        var o = stack_allocation[R * slices, SIMD[F32, W]]()
        comptime for r in range(R):
            comptime for s in range(slices):
                o[unsafe_offset=r * slices + s] = acc.unsafe_offset(
                    r * head_dim + (c0 + s) * W
                ).unsafe_load[width=W]()
        var vb = SIMD[F32, BLOCK]()
        var j = j0
        while j < j1:
            if c0 == 0:
                comptime for hh in range(heads):
                    prefetcher.after_row(j, hh)
            var row = Int(rows[unsafe_offset=j])
            comptime for hh in range(heads):
                comptime for s in range(slices):
                    var vv: SIMD[F32, W]
                    comptime if slices == 1:
                        vv = load_half[kv_dtype](
                            v, hh * head_stride + row + c0 // 2 * BLOCK, c0 % 2
                        )
                    else:
                        comptime if s % 2 == 0:
                            vb = load_block[kv_dtype](
                                v, hh * head_stride + row + (c0 + s) * W
                            )
                        vv = vb.slice[W, offset=(s % 2) * W]()
                    comptime for g in range(tile):
                        comptime r = hh * tile + g
                        o[unsafe_offset=r * slices + s] = vv.fma(
                            probs[unsafe_offset=r * CHUNK + j],
                            o[unsafe_offset=r * slices + s],
                        )
            j += 1
        comptime for r in range(R):
            comptime for s in range(slices):
                acc.unsafe_offset(r * head_dim + (c0 + s) * W).unsafe_store(
                    o[unsafe_offset=r * slices + s]
                )
        c0 += slices
