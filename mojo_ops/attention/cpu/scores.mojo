"""Scoring a chunk's keys on the CPU: q . k for a tile of query rows, a few
tokens and heads a step, reduced to scores[r * CHUNK + j] (see task.mojo for
the task as a whole)."""

from std.bit import log2_floor
from std.memory import stack_allocation

from ...cache.paged_kv_cache import Ptr
from ...simd.lane_reduce import reduce_padded
from ...simd.widen import BLOCK, DOT_BF16, F32, W, dot_bf16, load_block, load_kv
from ..params import rope_rotate
from .key_chunks import CHUNK, BlockPrefetch, RowOffsets
from .step_sizes import DOTS_PER_STEP, MIN_HEAD_DIM, row_run


@always_inline
def score_tokens[
    tile: Int,
    tokens: Int,
    heads: Int,
    run: Int,
    kv_dtype: DType,
    deferred: Bool = False,
    raw_q: Bool = False,
](
    head_dim: Int,
    q: Ptr[F32],
    k: Ptr[kv_dtype],
    head_stride: Int,
    rows: RowOffsets,
    j: Int,
    scores: Ptr[F32],
    dots: Pointer[mut=True, SIMD[F32, W], _],
    prefetcher: BlockPrefetch,
):
    """Scores of tokens j..j+tokens for `heads` adjacent KV heads of `tile`
    query rows each (rows hh * tile + g, head hh's K at k + hh *
    head_stride); q rows in the order `load_block` widens K; head_dim a
    multiple of `run`. Deferred, the step leaves its lane-wise dot
    products in dots[r * tokens + t] for `store_scores` to reduce instead.
    raw_q (see `raw_bf16_q`): q rows hold the query's bfloat16 elements in
    order, 2 * head_dim a row, and K blocks meet them in `dot_bf16`s.

    Each K block is loaded once for the tile's rows and each q slice once
    for the step's tokens, so that loads do not outnumber FMAs.
    """
    comptime R = heads * tile
    var acc = stack_allocation[R * tokens, SIMD[F32, W]]()
    comptime for i in range(R * tokens):
        acc[unsafe_offset=i] = 0
    comptime for t in range(tokens):
        comptime for hh in range(heads):
            prefetcher.after_row(j + t, hh)
    # Each row's run of `run` elements in turn (see RUN_BYTES). A
    # while loop: `range` with a step checks for overflow on every
    # iteration of this, the hottest loop.
    var c = 0
    while c < head_dim:
        comptime for t in range(tokens):
            comptime for hh in range(heads):
                var row = hh * head_stride + Int(rows[unsafe_offset=j + t])
                comptime for b in range(run // BLOCK):
                    comptime if raw_q:
                        var kw = rebind[SIMD[DType.bfloat16, BLOCK]](
                            k.unsafe_offset(row + c + b * BLOCK).unsafe_load[
                                width=BLOCK
                            ]()
                        )
                        var qb = rebind[Ptr[DType.bfloat16]](q)
                        comptime for g in range(tile):
                            comptime r = hh * tile + g
                            acc[unsafe_offset=r * tokens + t] = dot_bf16(
                                acc[unsafe_offset=r * tokens + t],
                                qb.unsafe_offset(
                                    2 * r * head_dim + c + b * BLOCK
                                ).unsafe_load[width=BLOCK](),
                                kw,
                            )
                    else:
                        var kb = load_block[kv_dtype](k, row + c + b * BLOCK)
                        comptime for h in range(2):
                            comptime for g in range(tile):
                                comptime r = hh * tile + g
                                acc[unsafe_offset=r * tokens + t] = (
                                    q.unsafe_offset(
                                        r * head_dim + c + b * BLOCK + h * W
                                    )
                                    .unsafe_load[width=W]()
                                    .fma(
                                        kb.slice[W, offset=h * W](),
                                        acc[unsafe_offset=r * tokens + t],
                                    )
                                )
        c += run
    comptime if deferred:
        comptime for i in range(R * tokens):
            dots[unsafe_offset=i] = acc[unsafe_offset=i]
    else:
        store_scores[R, tokens](acc, j, scores)


@always_inline
def store_scores[
    rows: Int, tokens: Int
](dots: Pointer[mut=True, SIMD[F32, W], _], j: Int, scores: Ptr[F32]):
    """Reduces the dots of a `score_tokens` step of tokens j..j+tokens for
    `rows` query rows (dots may be overwritten) into scores[r * CHUNK + j +
    t]."""
    # Lane r * tokens + t: row r's score of token j + t.
    var sums = reduce_padded[rows * tokens](dots)
    comptime for r in range(rows):
        scores.unsafe_offset(r * CHUNK + j).unsafe_store(
            sums.slice[tokens, offset=r * tokens]()
        )


@always_inline
def score_tile[
    tile: Int, kv_dtype: DType, heads: Int = 1, raw_q: Bool = False
](
    head_dim: Int,
    q: Ptr[F32],
    k: Ptr[kv_dtype],
    head_stride: Int,
    rows: RowOffsets,
    j0: Int,
    j1: Int,
    scores: Ptr[F32],
    prefetcher: BlockPrefetch,
):
    """Scores of tokens j0..j1: scores[r * CHUNK + j] = q[r] . k[row j] for
    the rows r = hh * tile + g of `heads` adjacent KV heads (see
    `score_tokens`).

    Each K row is loaded once for all the tile's rows of its head; a step
    scores DOTS_PER_STEP (row, token) pairs, enough independent FMA chains
    to keep both FMA ports busy, and their sums fill one vector.
    """
    comptime run = row_run[kv_dtype]() if tile == 1 else BLOCK
    comptime if run > MIN_HEAD_DIM:
        # A head_dim of an odd number of granules takes its own compiled
        # path: a remainder loop after the runs, in the same function, slows
        # the compiler's code for the runs (docs/design.md, "Kernel notes").
        if head_dim % run != 0:
            score_runs[tile, kv_dtype, heads, MIN_HEAD_DIM, raw_q](
                head_dim, q, k, head_stride, rows, j0, j1, scores, prefetcher
            )
            return
    score_runs[tile, kv_dtype, heads, run, raw_q](
        head_dim, q, k, head_stride, rows, j0, j1, scores, prefetcher
    )


@always_inline
def score_runs[
    tile: Int, kv_dtype: DType, heads: Int, run: Int, raw_q: Bool = False
](
    head_dim: Int,
    q: Ptr[F32],
    k: Ptr[kv_dtype],
    head_stride: Int,
    rows: RowOffsets,
    j0: Int,
    j1: Int,
    scores: Ptr[F32],
    prefetcher: BlockPrefetch,
):
    """`score_tile` reading each K row in runs of `run` elements.

    Steps of several tokens for several rows reduce their dots to scores
    after the last step, not each after its own: such a step's FMA chains
    (8 with AVX2, 4 cycles each, 2 FMA ports) take as long as its FMAs at
    full rate, so a reduction at its end would lie on the critical path, and
    the next step's loads, past the reorder window, could not start under
    it. Steps of one token (group 8) or of one row (group 1) lose by
    deferring and reduce step by step (docs/design.md, "Kernel notes").
    """
    comptime R = heads * tile
    # A power of two, so that a block's tokens (`step_tokens`) are whole
    # steps for every tile (3 rows: 2 tokens with AVX2, 4 with AVX-512).
    comptime tokens = 1 << log2_floor(max(DOTS_PER_STEP // R, 1))
    comptime deferred = R > 1 and tokens > 1
    var dots = stack_allocation[CHUNK * R if deferred else 1, SIMD[F32, W]]()
    var j = j0
    while j + tokens <= j1:
        score_tokens[tile, tokens, heads, run, deferred=deferred, raw_q=raw_q](
            head_dim,
            q,
            k,
            head_stride,
            rows,
            j,
            scores,
            dots.unsafe_offset((j - j0) * R if deferred else 0),
            prefetcher,
        )
        j += tokens
    comptime if deferred:
        var done = j0
        while done < j:
            store_scores[R, tokens](
                dots.unsafe_offset((done - j0) * R), done, scores
            )
            done += tokens
    # Short runs (sub-blocks, a chunk's end) in pairs where they can: twice
    # the independent chains of single tokens.
    comptime if tokens > 2:
        while j + 2 <= j1:
            score_tokens[tile, 2, heads, run, raw_q=raw_q](
                head_dim, q, k, head_stride, rows, j, scores, dots, prefetcher
            )
            j += 2
    while j < j1:
        score_tokens[tile, 1, heads, run, raw_q=raw_q](
            head_dim, q, k, head_stride, rows, j, scores, dots, prefetcher
        )
        j += 1


@always_inline
def raw_bf16_q[q_dtype: DType, kv_dtype: DType]() -> Bool:
    """Whether decode scores bfloat16 q against bfloat16 K in `dot_bf16`s
    (AVX512_BF16): q kept as it came, unscaled, so that every product is
    exact as with widened K, and the scale applied to the chunk's scores
    instead (`scale_scores`); prefill's products take the same rows in
    pairs (`score_chunk[dots=True]`). Tasks of rotated keys keep float32 q
    rows."""
    return DOT_BF16 and q_dtype == DType.bfloat16 and kv_dtype == DType.bfloat16


def scale_scores(scores: Ptr[F32], count: Int, scale: Float32):
    """Multiplies scores[r * CHUNK + j] by scale for the rows r < count, all
    of CHUNK."""
    for i in range(0, count * CHUNK, W):
        var p = scores.unsafe_offset(i)
        p.unsafe_store(p.unsafe_load[width=W]() * scale)


@always_inline
def rotated_keys[
    kv_dtype: DType
](
    head_dim: Int,
    k: Ptr[kv_dtype],
    rows: RowOffsets,
    n: Int,
    first_pos: Int,
    inv_freq: Ptr[DType.float64],
    out_rows: Ptr[F32],
):
    """The chunk's K rows widened to float32 as `load_kv` widens them and
    rotated by their positions (ROPE_LLAMA), into out_rows [n, head_dim]."""
    for j in range(n):
        var dst = out_rows.unsafe_offset(j * head_dim)
        for c in range(head_dim // W):
            dst.unsafe_offset(c * W).unsafe_store(
                load_kv[kv_dtype, W](k, Int(rows[unsafe_offset=j]) + c * W)
            )
        rope_rotate(dst, inv_freq, first_pos + j, head_dim)
