"""Paged attention on the CPU: decode and prefill.

A task is one work item (a tile of one request's query tokens against a run
of its keys, see attention_work.mojo) over a block of KV heads. Decode tasks
take all KV heads when their query heads fit (see `heads_per_task` in the
plan): in an NHD page a token's heads are one contiguous row, so the task
streams K and V through memory in order. Prefill tasks take one KV head and
a tile of query tokens, whose rows all reuse each K and V row read; from
PRODUCT_MIN_ROWS rows on they take each chunk as matrix products instead of
the steps below (attention_products.mojo).

The task walks its keys in chunks of CHUNK tokens, which may span pages
(see key_chunks.mojo). Per chunk: scores for all its query rows, then a
base-2 online softmax with per-row masks (causal, window), then V folded
into the rows' accumulators. K, and then V, are read in blocks of a few
tokens (`block_tokens`): all the task's heads of a block's tokens before the
next block, so that reads stay within a few adjacent token rows, which the
hardware prefetchers stream; meanwhile the next block is prefetched
(BlockPrefetch). Heads of one or two query rows each (GQA group 1 or 2) are
taken several at a time, so that each token's read is a run of adjacent
heads; heads of more rows take the block in sub-blocks of a few tokens
(`sub_block_tokens`), all heads of one before the next.

The inner loops are specialised at compile time for the number of query rows
scored together (tiles of 8, 4, 2, 1) and unrolled so that every tile keeps at
least 8 independent FMA chains in flight; tiles of one row (GQA group 1)
read each K and V row in runs of RUN_BYTES. head_dim is a run-time value, so one
compile serves every model. bfloat16 K and V are widened in "paired" order
(see widen.mojo), which the q and accumulator rows follow.
"""

from std.math import log2
from std.memory import stack_allocation
from std.memory.alloc import unsafe_alloc
from std.sys import size_of
from std.utils.numerics import nan, neg_inf

from .attention_products import (
    PRODUCT_MIN_ROWS,
    accumulate_chunk,
    score_chunk,
)
from .attention_params import (
    LOG2E,
    POS_ALIBI,
    POS_ROPE_LLAMA,
    AttentionParams,
    alibi_slope,
    rope_inv_freq,
    rope_rotate,
)
from .attention_work import AttentionWork
from .exp2 import exp2_f32, is_nan_f32, nan_lanes
from .key_chunks import CHUNK, BlockPrefetch, RowOffsets, chunk_rows
from .lane_reduce import reduce_many
from .merge_states import merge_row
from .paged_kv_cache import DYNAMIC, KVLayout, PagedKVCache, Ptr
from .widen import (
    BLOCK,
    DOT_BF16,
    F32,
    VECTOR_REGISTERS,
    W,
    dot_bf16,
    from_paired_order,
    kv_load_scale,
    load_block,
    load_f32,
    load_half,
    load_kv,
    narrow,
    paired,
    to_paired_order,
)

comptime CHAINS = VECTOR_REGISTERS // 2
"""Independent FMA chains a V pass keeps in flight, half the registers:
the other half hold the V block, the probabilities and the loads in flight.
With AVX-512 that is twice FMA latency x ports (4 x 2), so the widening and
loads between a tile's FMAs leave no port idle; with AVX2, 16 chains would
spill to the stack (docs/design.md, "Kernel notes")."""

comptime DOTS_PER_STEP = W
"""(Head, token) dot products scored together: one vector of sums, so that
the reduction's shuffles are shared by a whole vector."""

comptime MIN_HEAD_DIM = 64
"""The head_dim granule: head_dim is a run-time value (one compiled kernel
serves all), a multiple of MIN_HEAD_DIM (four AVX-512 float32 vectors,
eight AVX2 ones)."""

comptime RUN_BYTES = 256
"""Bytes of one K or V row that a step of single-row tiles (GQA group 1)
reads in a run before the next row. A step reads its tokens' and heads'
rows side by side, and the L1 fills from L2 far faster from few long runs
than from many short ones. Larger tiles keep one BLOCK: a step's q slices
would outnumber the registers and be reloaded for every token
(docs/design.md, "Kernel notes")."""


def row_run[kv_dtype: DType]() -> Int:
    """Elements of a K or V row a step of single-row tiles reads in a run:
    RUN_BYTES, at most two MIN_HEAD_DIM granules (a head_dim of an odd
    number of granules is read in runs of one)."""
    return min(RUN_BYTES // size_of[kv_dtype](), 2 * MIN_HEAD_DIM)


def v_heads[kv_dtype: DType]() -> Int:
    """KV heads of one query row each whose V a step folds in together:
    as many as CHAINS accumulators hold when each head takes a run of
    `row_run` elements (float32: 4 heads, 16-bit and fp8: 2)."""
    return max(CHAINS // (row_run[kv_dtype]() // W), 1)


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
    `rows` query rows (dots overwritten) into scores[r * CHUNK + j + t]."""
    # Lane r * tokens + t: row r's score of token j + t.
    var sums = reduce_many[rows * tokens](dots)
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
    comptime tokens = max(DOTS_PER_STEP // R, 1)
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
    # accumulators, past the registers.
    comptime slices = 1 if R >= CHAINS else min(
        max(CHAINS // R, BLOCK // W), widest // W
    )
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


@always_inline
def softmax_tile[
    tile: Int
](
    head_dim: Int,
    params: AttentionParams,
    scores: Ptr[F32],
    n: Int,
    kv_pos0: Int,
    row_pos: Ptr[F32],
    alibi_log2: Ptr[F32],
    m: Ptr[F32],
    l: Ptr[F32],
    acc: Ptr[F32],
):
    """Online softmax over one chunk: scores become probabilities relative to
    the running max m, and l and acc are rescaled when m grows.

    kv_pos0: position of the chunk's first key; row_pos[g]: the position of
    row g's query. Keys a row may not see (past the chunk's end, after the
    query when causal, before its window) get no weight. The tile's rows go
    through each step together, without branches, so that their reductions
    and exponentials overlap instead of forming one long chain per row.
    """
    comptime vectors = CHUNK // W
    var iota = SIMD[F32, W]()
    comptime for i in range(W):
        iota[i] = Float32(i)
    var tops = stack_allocation[tile, SIMD[F32, W]]()
    # NaN is data, not a mask: a visible NaN score (from q, k or q_scale)
    # makes its row's l NaN for good, so the row ends NaN. One compare per
    # vector here; the exp2 clamp below would turn NaN into a finite weight.
    var nans = SIMD[DType.bool, tile](fill=False)
    comptime for g in range(tile):
        var row = scores.unsafe_offset(g * CHUNK)
        var top = SIMD[F32, W](neg_inf[F32]())
        var nan_seen = SIMD[DType.bool, W](fill=False)
        comptime for c in range(vectors):
            var distance = (
                iota + Float32(kv_pos0 + c * W) - row_pos[unsafe_offset=g]
            )
            var s = params.finish_scores(
                row.unsafe_offset(c * W).unsafe_load[width=W](),
                alibi_log2[unsafe_offset=g],
                distance,
            )
            s = params.visible(distance, iota.lt(Float32(n - c * W))).select(
                s, neg_inf[F32]()
            )
            row.unsafe_offset(c * W).unsafe_store(s)
            top = max(top, s)
            nan_seen = nan_seen | nan_lanes(s)
        tops[unsafe_offset=g] = top
        nans[g] = nan_seen.reduce_or()
    var old = m.unsafe_load[width=tile]()
    var new = max(old, reduce_many[tile, is_max=True](tops))
    # A row that has seen nothing yet keeps m = -inf: exponents relative to 0
    # give its scores (all -inf) no weight, and its state stays zero.
    var base = new.eq(neg_inf[F32]()).select(SIMD[F32, tile](0), new)
    var alpha = exp2_f32[tile](old - base)
    var totals = stack_allocation[tile, SIMD[F32, W]]()
    comptime for g in range(tile):
        var row = scores.unsafe_offset(g * CHUNK)
        var total = SIMD[F32, W](0)
        comptime for c in range(vectors):
            var p = exp2_f32[W](
                row.unsafe_offset(c * W).unsafe_load[width=W]() - base[g]
            )
            row.unsafe_offset(c * W).unsafe_store(p)
            total += p
        totals[unsafe_offset=g] = total
    l.unsafe_store(
        nans.select(
            SIMD[F32, tile](nan[F32]()),
            l.unsafe_load[width=tile]() * alpha + reduce_many[tile](totals),
        )
    )
    m.unsafe_store(new)
    comptime for g in range(tile):
        if alpha[g] != 1:
            for c in range(head_dim // W):
                var a = acc.unsafe_offset(g * head_dim + c * W)
                a.unsafe_store(a.unsafe_load[width=W]() * alpha[g])


@always_inline
def raw_bf16_q[q_dtype: DType, kv_dtype: DType]() -> Bool:
    """Whether decode scores bfloat16 q against bfloat16 K in `dot_bf16`s
    (AVX512_BF16): q kept as it came, unscaled, so that every product is
    exact as with widened K, and the scale applied to the chunk's scores
    instead (`scale_scores`). Tasks of rotated keys or of products keep
    float32 q rows."""
    return DOT_BF16 and q_dtype == DType.bfloat16 and kv_dtype == DType.bfloat16


def scale_scores(scores: Ptr[F32], count: Int, scale: Float32):
    """Multiplies scores[r * CHUNK + j] by scale for the rows r < count, all
    of CHUNK."""
    for i in range(0, count * CHUNK, W):
        var p = scores.unsafe_offset(i)
        p.unsafe_store(p.unsafe_load[width=W]() * scale)


def paired_heads[kv_dtype: DType]() -> Int:
    """KV heads of one query row each (GQA group 1) that a step scores
    together (V: `v_heads`; group 2: half as many, scores and V): each
    token's run of adjacent head rows read in order is then 2 KiB at
    head_dim 128 (float32: 4 heads, 16-bit: 8), instead of one head's
    256-512 B piece of many tokens' rows."""
    return 4 if size_of[kv_dtype]() >= 4 else 8


comptime BLOCK_BYTES = 16 << 10
"""What a block of a task's heads and tokens should read, K or V: blocks of
a few tokens read faster than head by head (docs/design.md, "Kernel
notes"), and small ones keep the kernel's step structure (whole tiles of
rows per head)."""

comptime GROUP_BLOCK_TOKENS = 8
"""With 16 vector registers, the fewest tokens a block of heads of three or
more query rows each takes, where they fit GROUP_BLOCK_MAX_BYTES. Such a
block is one sub-block (see `sub_block_tokens`): each head's q rows are
loaded for scoring, and its accumulators loaded and stored for the V pass,
once per slice of head_dim and block, so more tokens share those loads.
Where BLOCK_BYTES already holds 8 tokens or more, that size stays
(docs/design.md, "Kernel notes")."""

comptime GROUP_BLOCK_MAX_BYTES = 32 << 10
"""The most a block of GROUP_BLOCK_TOKENS reads, K or V, prefetched: 32
KiB, the L1 of a core with 16 vector registers."""


comptime PREFETCH_MAX_BYTES = (32 << 10) if VECTOR_REGISTERS >= 32 else (
    16 << 10
)
"""The largest block whose successor is prefetched while it is read. A
larger block (the steps' tokens across many wide heads, such as 32 float32
heads of group 1: 16 KiB a token) is read as runs of many token rows at
once, which the hardware prefetchers stream faster alone; with AVX2's
smaller steps that block is 2 tokens (32 KiB). See docs/design.md, "Kernel
notes"."""

comptime STREAMED_BLOCK = 16 if VECTOR_REGISTERS >= 32 else 4
"""Tokens per block when the hardware prefetchers alone fetch it (see
PREFETCH_MAX_BYTES): that many token rows read side by side, the fastest
count for each register file (docs/design.md, "Kernel notes")."""


comptime SUB_BLOCK_BYTES = (8 << 10) if VECTOR_REGISTERS >= 32 else (
    GROUP_BLOCK_MAX_BYTES
)
"""What a sub-block of a block reads: see `sub_block_tokens`."""


@no_inline
def wanted_tokens(head_rows: Int, token_bytes: Int) -> Int:
    """Tokens a block of a task's heads of head_rows query rows each aims
    for, token_bytes a token: BLOCK_BYTES, or with 16 registers and three
    or more rows at least GROUP_BLOCK_TOKENS within GROUP_BLOCK_MAX_BYTES."""
    var wanted = max(BLOCK_BYTES // token_bytes, 1)
    comptime if VECTOR_REGISTERS < 32:
        if head_rows > 2:
            var fewest = min(
                GROUP_BLOCK_TOKENS, GROUP_BLOCK_MAX_BYTES // token_bytes
            )
            wanted = max(wanted, fewest)
    return wanted


@no_inline
def prefetch_max_bytes(head_rows: Int) -> Int:
    """The largest block of a task's heads of head_rows query rows each
    whose successor is prefetched: PREFETCH_MAX_BYTES, or with 16 registers
    and three or more rows GROUP_BLOCK_MAX_BYTES.

    Not inlined (neither is `wanted_tokens`), though called once per task:
    inlined, their branch on head_rows changed the compiler's code for the
    task's inner loops and slowed them (docs/design.md, "Kernel notes")."""
    comptime if VECTOR_REGISTERS < 32:
        if head_rows > 2:
            return GROUP_BLOCK_MAX_BYTES
    return PREFETCH_MAX_BYTES


def sub_block_tokens[kv_dtype: DType](heads: Int, head_dim: Int) -> Int:
    """Tokens per sub-block for a task's `heads` KV heads of three or more
    query rows each: within a block, each head takes a sub-block's tokens
    before the next head, and all heads a sub-block before the next one.

    Fewer tokens per head keep the reads closer to address order, which the
    hardware prefetchers follow; more keep more independent FMA chains and
    reuse each accumulator load. With 32 vector registers, float32 rows (4
    KiB a token at 8 heads) go token by token; narrower rows, half the
    bytes for the same arithmetic, take SUB_BLOCK_BYTES. With 16 registers
    a V pass's accumulators are loaded and stored for every sub-block, so
    the whole block is one sub-block (docs/design.md, "Kernel notes")."""
    comptime if size_of[kv_dtype]() >= 4 and VECTOR_REGISTERS >= 32:
        return 1
    return max(SUB_BLOCK_BYTES // (heads * head_dim * size_of[kv_dtype]()), 1)


def step_tokens[kv_dtype: DType](heads: Int, head_rows: Int) -> Int:
    """The tokens every scoring step of a task takes divide this (see
    `walk_heads`)."""
    comptime paired = paired_heads[kv_dtype]()
    if head_rows == 1:
        return DOTS_PER_STEP // paired if heads % paired == 0 else DOTS_PER_STEP
    if head_rows == 2:
        return (
            DOTS_PER_STEP // paired if heads % (paired // 2)
            == 0 else DOTS_PER_STEP // 2
        )
    # Tiles of 8, 4, 2, 1 rows take 2, 4, 8, 16 tokens a step.
    return DOTS_PER_STEP // min(head_rows & -head_rows, 8)


def prefetches_block[
    kv_dtype: DType
](tokens: Int, heads: Int, head_rows: Int, head_dim: Int) -> Bool:
    """Whether a block of `tokens` tokens of a task's `heads` KV heads of
    head_rows query rows each is prefetched while its predecessor is read:
    within `prefetch_max_bytes`."""
    var block_bytes = tokens * heads * head_dim * size_of[kv_dtype]()
    return block_bytes <= prefetch_max_bytes(head_rows)


def block_tokens[
    kv_dtype: DType
](heads: Int, head_rows: Int, head_dim: Int) -> Int:
    """Tokens per block of a task with `heads` KV heads of head_rows query
    rows each: `wanted_tokens`, rounded up to a multiple of the steps'
    tokens, or STREAMED_BLOCK where that is past `prefetch_max_bytes`. One head
    (prefill) has nothing to interleave: its block is the chunk."""
    if heads == 1:
        return CHUNK
    var step = step_tokens[kv_dtype](heads, head_rows)
    var token_bytes = heads * head_dim * size_of[kv_dtype]()
    var wanted = wanted_tokens(head_rows, token_bytes)
    var block = min((wanted + step - 1) // step * step, CHUNK)
    if not prefetches_block[kv_dtype](block, heads, head_rows, head_dim):
        return STREAMED_BLOCK
    return block


@always_inline
def tile_rows[
    kv_dtype: DType,
    scoring: Bool,
    tile: Int,
    heads: Int = 1,
    raw_q: Bool = False,
](
    head_dim: Int,
    state: TaskState,
    r: Int,
    kv: Ptr[kv_dtype],
    head_stride: Int,
    rows: RowOffsets,
    j0: Int,
    j1: Int,
    prefetcher: BlockPrefetch,
):
    """Tokens j0..j1 for the task's rows r.. of `heads` adjacent KV heads of
    `tile` rows each (head hh's rows at kv + hh * head_stride): their
    scores (scoring, kv is K) or V folded into them (kv is V)."""
    comptime if scoring:
        score_tile[tile, kv_dtype, heads, raw_q](
            head_dim,
            state.q.unsafe_offset(r * head_dim),
            kv,
            head_stride,
            rows,
            j0,
            j1,
            state.scores.unsafe_offset(r * CHUNK),
            prefetcher,
        )
    else:
        accumulate_tile[tile, kv_dtype, heads](
            head_dim,
            state.scores.unsafe_offset(r * CHUNK),
            kv,
            head_stride,
            rows,
            j0,
            j1,
            state.acc.unsafe_offset(r * head_dim),
            prefetcher,
        )


@always_inline
def walk_rows[
    kv_dtype: DType, scoring: Bool, raw_q: Bool = False
](
    head_dim: Int,
    state: TaskState,
    r0: Int,
    count: Int,
    kv: Ptr[kv_dtype],
    rows: RowOffsets,
    j0: Int,
    j1: Int,
    prefetcher: BlockPrefetch,
):
    """`tile_rows` over the task's rows r0..r0+count of one KV head, in tiles
    of 8, 4, 2 and 1; the first tile drives the prefetcher."""
    var r = r0
    var prefetching = prefetcher
    while r < r0 + count:
        var left = r0 + count - r
        var taken = False
        comptime for i in range(4):
            comptime tile = 8 >> i
            if not taken and left >= tile:
                tile_rows[kv_dtype, scoring, tile, raw_q=raw_q](
                    head_dim, state, r, kv, 0, rows, j0, j1, prefetching
                )
                r += tile
                taken = True
        prefetching = prefetcher.disabled()


@always_inline
def walk_heads[
    kv_dtype: DType, scoring: Bool, raw_q: Bool = False
](
    head_dim: Int,
    state: TaskState,
    heads: Int,
    head_rows: Int,
    kv: Ptr[kv_dtype],
    head_stride: Int,
    rows: RowOffsets,
    j0: Int,
    j1: Int,
    target: BlockPrefetch,
):
    """`tile_rows` over all the task's `heads` KV heads of head_rows query
    rows each (head h's rows at kv + h * head_stride); target: the block to
    prefetch meanwhile. Heads of one or two rows go `paired_heads` (or half
    as many) at a time, the V of heads of one row `v_heads` at a time."""
    comptime P = paired_heads[kv_dtype]()
    var h = 0
    if head_rows == 1:
        comptime together = P if scoring else v_heads[kv_dtype]()
        while h + together <= heads:
            tile_rows[kv_dtype, scoring, 1, together, raw_q](
                head_dim,
                state,
                h,
                kv.unsafe_offset(h * head_stride),
                head_stride,
                rows,
                j0,
                j1,
                target.for_head(h, j0, j1 - j0),
            )
            h += together
    elif head_rows == 2:
        while h + P // 2 <= heads:
            tile_rows[kv_dtype, scoring, 2, P // 2, raw_q](
                head_dim,
                state,
                2 * h,
                kv.unsafe_offset(h * head_stride),
                head_stride,
                rows,
                j0,
                j1,
                target.for_head(h, j0, j1 - j0),
            )
            h += P // 2
    # The other heads one by one; heads of three or more rows over
    # sub-blocks of the block's tokens, every head of a sub-block before the
    # next (see `sub_block_tokens`).
    var sub = j1 - j0
    if head_rows > 2 and heads > 1:
        sub = sub_block_tokens[kv_dtype](heads, head_dim)
    var s0 = j0
    while s0 < j1:
        var s1 = min(s0 + sub, j1)
        for hh in range(h, heads):
            walk_rows[kv_dtype, scoring, raw_q](
                head_dim,
                state,
                hh * head_rows,
                head_rows,
                kv.unsafe_offset(hh * head_stride),
                rows,
                s0,
                s1,
                target.for_sub_block(hh, heads, j0, s0, s1 - s0),
            )
        s0 = s1


@always_inline
def softmax_rows(
    head_dim: Int,
    params: AttentionParams,
    state: TaskState,
    count: Int,
    n: Int,
    kv_pos0: Int,
):
    """The online softmax step of one chunk of n keys from kv_pos0 for all
    the task's count query rows, in tiles of 8, 4, 2 and 1."""
    var r = 0
    while r < count:
        var left = count - r
        var taken = False
        comptime for i in range(4):
            comptime tile = 8 >> i
            if not taken and left >= tile:
                softmax_tile[tile](
                    head_dim,
                    params,
                    state.scores.unsafe_offset(r * CHUNK),
                    n,
                    kv_pos0,
                    state.row_pos.unsafe_offset(r),
                    state.alibi_log2.unsafe_offset(r),
                    state.m.unsafe_offset(r),
                    state.l.unsafe_offset(r),
                    state.acc.unsafe_offset(r * head_dim),
                )
                r += tile
                taken = True


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


struct TaskState(Movable):
    """Per-task scratch: the q vector, accumulator, softmax state, position
    and ALiBi slope of each query row (a query token's head), the scores of
    one chunk, row offset tables. On the heap: 64 rows of dim 256 would not fit
    a worker thread's stack."""

    var q: Ptr[F32]
    var acc: Ptr[F32]
    var m: Ptr[F32]
    var l: Ptr[F32]
    var alibi_log2: Ptr[F32]
    var row_pos: Ptr[F32]
    var scores: Ptr[F32]
    var inv_freq: Ptr[DType.float64]
    var krot: Ptr[F32]
    """Rotated keys (ROPE_LLAMA), then, for a task of products (see
    attention_products.mojo), V widened."""
    var kt: Ptr[F32]
    """K^T of a chunk, for a task of products."""
    var rows: RowOffsets
    """Offsets of this chunk's rows, then of the next chunk's, then the
    rotated keys' rows (j * head_dim)."""
    var _storage: Ptr[F32]

    def __init__(out self, rows: Int, head_dim: Int):
        var D = head_dim
        var at = 0

        @always_inline
        def take(mut at: Int, count: Int) -> Int:
            var start = at
            at += (count + W - 1) // W * W
            return start

        var q_at = take(at, rows * D)
        var acc_at = take(at, rows * D)
        var m_at = take(at, rows)
        var l_at = take(at, rows)
        var alibi_at = take(at, rows)
        var pos_at = take(at, rows)
        var scores_at = take(at, rows * CHUNK)
        var freq_at = take(at, D)  # D // 2 float64s
        var krot_at = take(at, CHUNK * D)
        var kt_at = take(at, CHUNK * D)
        var rows_at = take(at, 2 * 3 * CHUNK)  # int64 rows: two floats each
        self._storage = rebind[Ptr[F32]](
            unsafe_alloc[Float32](at, alignment=64)
        )
        self.q = self._storage.unsafe_offset(q_at)
        self.acc = self._storage.unsafe_offset(acc_at)
        self.m = self._storage.unsafe_offset(m_at)
        self.l = self._storage.unsafe_offset(l_at)
        self.alibi_log2 = self._storage.unsafe_offset(alibi_at)
        self.row_pos = self._storage.unsafe_offset(pos_at)
        self.scores = self._storage.unsafe_offset(scores_at)
        self.inv_freq = rebind[Ptr[DType.float64]](
            self._storage.unsafe_offset(freq_at)
        )
        self.krot = self._storage.unsafe_offset(krot_at)
        self.kt = self._storage.unsafe_offset(kt_at)
        self.rows = rebind[RowOffsets](self._storage.unsafe_offset(rows_at))

    def __deinit__(deinit self):
        self._storage.unsafe_free()


def attention_task[
    q_dtype: DType, kv_dtype: DType, layout: KVLayout
](
    cache: PagedKVCache[kv_dtype, layout, DYNAMIC, DYNAMIC, DYNAMIC],
    q: Ptr[q_dtype],
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    work: AttentionWork,
    params: AttentionParams,
    num_qo_heads: Int,
    heads_per_task: Int,
    task: Int,
):
    """One work item over a block of KV heads; task = item * blocks + block.

    The task's query rows are (KV head, query token, head of the group), so
    each KV head's rows are contiguous and share every K and V row it reads.
    Writes final outputs, or the item's partial state when its request's keys
    are split across items (decode).
    """
    var kv_heads = cache.num_kv_heads()
    var blocks = (kv_heads + heads_per_task - 1) // heads_per_task
    var item = task // blocks
    var h0 = (task % blocks) * heads_per_task
    var h1 = min(h0 + heads_per_task, kv_heads)
    var group = num_qo_heads // kv_heads
    var queries = work.q_count(item)
    var q_row0 = work.q_row(item)
    var q_pos0 = work.q_pos(item)
    var head_rows = queries * group
    var b = work.request(item)
    var first = work.kv_first(item)
    var end = work.kv_end(item)
    var hs = cache.head_stride()
    var head_dim = cache.head_dim()
    var rope = params.pos_encoding == POS_ROPE_LLAMA
    # The K and V loads return kv_load_scale times the values (widen.mojo):
    # the q.k and V scales undo it.
    var q_scale = params.q_scale_log2 / kv_load_scale[kv_dtype]()
    var v_scale = params.v_scale / kv_load_scale[kv_dtype]()

    var st = TaskState((h1 - h0) * head_rows, head_dim)
    # Many rows of one KV head (prefill) take the chunk as matrix products.
    var products = h1 - h0 == 1 and head_rows >= PRODUCT_MIN_ROWS
    comptime raw_q = raw_bf16_q[q_dtype, kv_dtype]()
    var keep_raw_q = raw_q and not rope and not products
    if rope:
        for i in range(head_dim // 2):
            st.inv_freq[unsafe_offset=i] = rope_inv_freq(params, i, head_dim)
    for h in range(h0, h1):
        for t in range(queries):
            for g in range(group):
                var r = (h - h0) * head_rows + t * group + g
                var qo = h * group + g
                var src = q.unsafe_offset(
                    ((q_row0 + t) * num_qo_heads + qo) * head_dim
                )
                var dst = st.q.unsafe_offset(r * head_dim)
                for c in range(head_dim // W):
                    st.acc.unsafe_offset(r * head_dim + c * W).unsafe_store(
                        SIMD[F32, W](0)
                    )
                comptime if raw_q:
                    if keep_raw_q:
                        var qb = rebind[Ptr[DType.bfloat16]](dst)
                        for c in range(0, head_dim, BLOCK):
                            qb.unsafe_offset(c).unsafe_store(
                                rebind[SIMD[DType.bfloat16, BLOCK]](
                                    src.unsafe_offset(c).unsafe_load[
                                        width=BLOCK
                                    ]()
                                )
                            )
                if not keep_raw_q:
                    for c in range(head_dim // W):
                        dst.unsafe_offset(c * W).unsafe_store(
                            load_f32[q_dtype, W](src, c * W)
                        )
                    if rope:
                        rope_rotate(dst, st.inv_freq, q_pos0 + t, head_dim)
                    for c in range(head_dim // W):
                        var d = dst.unsafe_offset(c * W)
                        d.unsafe_store(d.unsafe_load[width=W]() * q_scale)
                    comptime if paired[kv_dtype]():
                        # Rotated keys are widened to float32 rows in order.
                        if not rope:
                            to_paired_order(dst, head_dim)
                st.m[unsafe_offset=r] = neg_inf[F32]()
                st.l[unsafe_offset=r] = 0
                st.row_pos[unsafe_offset=r] = Float32(q_pos0 + t)
                st.alibi_log2[unsafe_offset=r] = 0
                if params.pos_encoding == POS_ALIBI:
                    st.alibi_log2[unsafe_offset=r] = (
                        alibi_slope(qo, num_qo_heads) * LOG2E
                    )

    var rows = st.rows
    var ahead = st.rows.unsafe_offset(CHUNK)
    var rot_rows = st.rows.unsafe_offset(2 * CHUNK)
    for j in range(CHUNK):
        rot_rows[unsafe_offset=j] = Int64(j * head_dim)
    # A chunk's K, then its V, is read in blocks of `block` tokens, all the
    # task's heads of a block before the next (see BlockPrefetch).
    var heads = h1 - h0
    var block = block_tokens[kv_dtype](heads, head_rows, head_dim)
    # A block too large to prefetch asks for nothing (count 0).
    var ahead_max = block if prefetches_block[kv_dtype](
        block, heads, head_rows, head_dim
    ) else 0
    var nhd = layout == KVLayout.NHD
    var k0 = cache.k_pages.unsafe_offset(h0 * hs)
    var v0 = cache.v_pages.unsafe_offset(h0 * hs)
    var tok = first
    var n = chunk_rows(cache, b, tok, end, rows) if tok < end else 0
    BlockPrefetch[kv_dtype](
        k0, rows, 0, min(ahead_max, n), heads, hs, head_dim, nhd
    ).fetch_all()
    while tok < end:
        var next = tok + n
        var n_ahead = (
            chunk_rows(cache, b, next, end, ahead) if next < end else 0
        )
        var first_v = BlockPrefetch[kv_dtype](
            v0, rows, 0, min(ahead_max, n), heads, hs, head_dim, nhd
        )
        if rope:
            # Rotated keys are scored head by head, the whole chunk at once.
            for h in range(h0, h1):
                rotated_keys(
                    head_dim,
                    cache.k_pages.unsafe_offset(h * hs),
                    rows,
                    n,
                    tok,
                    st.inv_freq,
                    st.krot,
                )
                if products:
                    score_chunk(
                        head_dim,
                        st.q,
                        head_rows,
                        st.krot,
                        rot_rows,
                        n,
                        st.kt,
                        st.scores,
                        first_v,
                    )
                    continue
                walk_rows[scoring=True](
                    head_dim,
                    st,
                    (h - h0) * head_rows,
                    head_rows,
                    st.krot,
                    rot_rows,
                    0,
                    n,
                    first_v.for_head(h - h0, 0, n),
                )
        elif products:
            score_chunk(
                head_dim,
                st.q,
                head_rows,
                k0,
                rows,
                n,
                st.kt,
                st.scores,
                first_v,
            )
        # Scores block by block; the last K block asks for the first V one.
        var jb = 0
        while jb < n and not rope and not products:
            var je = min(jb + block, n)
            var target = (
                BlockPrefetch[kv_dtype](
                    k0,
                    rows,
                    je,
                    min(ahead_max, n - je),
                    heads,
                    hs,
                    head_dim,
                    nhd,
                ) if je
                < n else first_v
            )
            walk_heads[scoring=True, raw_q=raw_q](
                head_dim,
                st,
                heads,
                head_rows,
                k0,
                hs,
                rows,
                jb,
                je,
                target,
            )
            jb = je
        if keep_raw_q:
            scale_scores(st.scores, heads * head_rows, q_scale)
        softmax_rows(head_dim, params, st, heads * head_rows, n, tok)
        var next_k = BlockPrefetch[kv_dtype](
            k0, ahead, 0, min(ahead_max, n_ahead), heads, hs, head_dim, nhd
        )
        if products:
            accumulate_chunk(
                head_dim,
                st.scores,
                head_rows,
                v0,
                rows,
                n,
                st.krot,
                st.acc,
                next_k,
            )
        # V, block by block; the last V block asks for the next chunk's
        # first K block.
        jb = 0
        while jb < n and not products:
            var je = min(jb + block, n)
            var target = (
                BlockPrefetch[kv_dtype](
                    v0,
                    rows,
                    je,
                    min(ahead_max, n - je),
                    heads,
                    hs,
                    head_dim,
                    nhd,
                ) if je
                < n else next_k
            )
            walk_heads[scoring=False](
                head_dim,
                st,
                heads,
                head_rows,
                v0,
                hs,
                rows,
                jb,
                je,
                target,
            )
            jb = je
        tok = next
        n = n_ahead
        var swap = rows
        rows = ahead
        ahead = swap

    var partial = work.writes_partial(b)
    for h in range(h0, h1):
        for t in range(queries):
            for g in range(group):
                var r = (h - h0) * head_rows + t * group + g
                var qo = h * group + g
                var total = st.l[unsafe_offset=r]
                # l is 0 (no key seen), positive, or NaN (a NaN seen): NaN
                # passes through to o and lse.
                var norm = v_scale / total if total != 0 else Float32(0)
                var state_lse = (
                    st.m[unsafe_offset=r] + log2(total) if total
                    != 0 else neg_inf[F32]()
                )
                if is_nan_f32(total):
                    norm = nan[F32]()
                    state_lse = nan[F32]()
                var a = st.acc.unsafe_offset(r * head_dim)
                comptime if paired[kv_dtype]():
                    from_paired_order(a, head_dim)
                if partial:
                    # Key-split items hold one query (decode).
                    var dst = work.partial_o.unsafe_offset(
                        (item * num_qo_heads + qo) * head_dim
                    )
                    for c in range(head_dim // W):
                        dst.unsafe_offset(c * W).unsafe_store(
                            a.unsafe_offset(c * W).unsafe_load[width=W]() * norm
                        )
                    work.partial_lse[
                        unsafe_offset=item * num_qo_heads + qo
                    ] = state_lse
                else:
                    var out_row = (q_row0 + t) * num_qo_heads + qo
                    var dst = output.unsafe_offset(out_row * head_dim)
                    for c in range(head_dim // W):
                        dst.unsafe_offset(c * W).unsafe_store(
                            narrow[q_dtype](
                                a.unsafe_offset(c * W).unsafe_load[width=W]()
                                * norm
                            )
                        )
                    lse[unsafe_offset=out_row] = state_lse


def merge_split_head[
    q_dtype: DType
](
    work: AttentionWork,
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    num_qo_heads: Int,
    head_dim: Int,
    b: Int,
    qo: Int,
    first: Int,
    step: Int,
):
    """Merges the partial states of request b's key-split items, if any, for
    query head qo into its query's output row (elements first, first + step,
    ... of it: see `merge_row`)."""
    if not work.writes_partial(b):
        return
    var item0 = Int(work.request_items[unsafe_offset=b])
    var row = work.q_row(item0)
    merge_row(
        work.partial_o.unsafe_offset((item0 * num_qo_heads + qo) * head_dim),
        num_qo_heads * head_dim,
        work.partial_lse.unsafe_offset(item0 * num_qo_heads + qo),
        num_qo_heads,
        work.items_of(b),
        head_dim,
        output.unsafe_offset((row * num_qo_heads + qo) * head_dim),
        lse.unsafe_offset(row * num_qo_heads + qo),
        first,
        step,
    )
