"""Paged attention on the CPU: decode and prefill.

A task is one work item (a tile of one request's query tokens against a run
of its keys, see attention_work.mojo) over a block of KV heads. Decode tasks
take all KV heads when their query heads fit (see `heads_per_task` in the
plan): in an NHD page a token's heads are one contiguous row, so the task
streams K and V through memory in order. Prefill tasks take one KV head and
a tile of query tokens, whose rows all reuse each K and V row read.

The task walks its keys in chunks of CHUNK tokens, which may span pages
(see key_chunks.mojo). Per chunk and KV head: scores for all the head's
query rows (each K row loaded once), a base-2 online softmax with per-row
masks (causal, window), then the same V rows, still in L1, folded into the
rows' accumulators. While a chunk is computed, the next chunk's rows are
prefetched row by row, at the rate they will be consumed.

The inner loops are specialised at compile time for the number of query rows
scored together (tiles of 8, 4, 2, 1) and unrolled so that every tile keeps at
least 8 independent FMA chains in flight; head_dim is a run-time value, so one
compile serves every model. bfloat16 K and V are widened in "paired" order
(see widen.mojo), which the q and accumulator rows follow.
"""

from std.math import log2
from std.memory import stack_allocation
from std.memory.alloc import unsafe_alloc
from std.utils.numerics import neg_inf

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
from .exp2 import exp2_f32
from .key_chunks import CHUNK, RowOffsets, RowPrefetch, chunk_rows
from .lane_reduce import reduce_many
from .merge_states import merge_row
from .paged_kv_cache import DYNAMIC, KVLayout, PagedKVCache, Ptr
from .widen import (
    BLOCK,
    F32,
    W,
    from_paired_order,
    load_block,
    load_f32,
    narrow,
    paired,
    to_paired_order,
)

comptime CHAINS = 16
"""Independent FMA chains a V pass keeps in flight: twice FMA latency x
ports (4 x 2), so that the widening and loads between a tile's FMAs leave
no port idle (at GQA group 4, the V pass of float32 K/V took about 18% less
time with 16 than with 8, hot in cache)."""

comptime DOTS_PER_STEP = W
"""(Head, token) dot products scored together: one vector of sums, so that
the reduction's shuffles are shared by a whole vector."""

comptime MIN_HEAD_DIM = 64
"""The head_dim granule: head_dim is a run-time value (one compiled kernel
serves all), a multiple of MIN_HEAD_DIM: four float32 vectors, the most slices a V pass takes."""


@always_inline
def score_tokens[
    tile: Int, tokens: Int, kv_dtype: DType
](
    head_dim: Int,
    q: Ptr[F32],
    k: Ptr[kv_dtype],
    rows: RowOffsets,
    j: Int,
    scores: Ptr[F32],
    prefetcher: RowPrefetch,
):
    """Scores of tokens j..j+tokens for the tile's heads; q rows in the
    order `load_block` widens K.

    Each K block is loaded once for the tile's heads and each q slice once
    for the step's tokens: the loop is bound by FMAs, not by loads.
    """
    var acc = stack_allocation[tile * tokens, SIMD[F32, W]]()
    comptime for i in range(tile * tokens):
        acc[unsafe_offset=i] = 0
    comptime for t in range(tokens):
        prefetcher.after_k_row(j + t)
    # A while loop: `range` with a step checks for overflow on every
    # iteration of this, the hottest loop.
    var c = 0
    while c < head_dim:
        comptime for t in range(tokens):
            var kb = load_block[kv_dtype](k, Int(rows[unsafe_offset=j + t]) + c)
            comptime for h in range(2):
                comptime for g in range(tile):
                    acc[unsafe_offset=g * tokens + t] = (
                        q.unsafe_offset(g * head_dim + c + h * W)
                        .unsafe_load[width=W]()
                        .fma(
                            kb.slice[W, offset=h * W](),
                            acc[unsafe_offset=g * tokens + t],
                        )
                    )
        c += BLOCK
    # Lane g * tokens + t: head g's score of token j + t.
    var sums = reduce_many[tile * tokens](acc)
    comptime for g in range(tile):
        scores.unsafe_offset(g * CHUNK + j).unsafe_store(
            sums.slice[tokens, offset=g * tokens]()
        )


@always_inline
def score_tile[
    tile: Int, kv_dtype: DType
](
    head_dim: Int,
    q: Ptr[F32],
    k: Ptr[kv_dtype],
    rows: RowOffsets,
    n: Int,
    scores: Ptr[F32],
    prefetcher: RowPrefetch,
):
    """Scores: scores[g * CHUNK + j] = q[g] . k[row j] for the tile's heads.

    Each K row is loaded once for all heads of the tile; a step scores
    DOTS_PER_STEP (head, token) pairs, enough independent FMA chains to keep
    both FMA ports busy, and their sums fill one vector.
    """
    comptime tokens = max(DOTS_PER_STEP // tile, 1)
    var j = 0
    while j + tokens <= n:
        score_tokens[tile, tokens](head_dim, q, k, rows, j, scores, prefetcher)
        j += tokens
    while j < n:
        score_tokens[tile, 1](head_dim, q, k, rows, j, scores, prefetcher)
        j += 1


@always_inline
def accumulate_tile[
    tile: Int, kv_dtype: DType
](
    head_dim: Int,
    probs: Ptr[F32],
    v: Ptr[kv_dtype],
    rows: RowOffsets,
    n: Int,
    acc: Ptr[F32],
    prefetcher: RowPrefetch,
):
    """Folds V in: acc[g] += sum_j probs[g * CHUNK + j] * v[row j], acc rows
    in the order `load_block` widens V.

    head_dim is covered a few vector slices at a time, so the tile's
    accumulators for those slices stay in registers while the chunk's V rows
    stream from L1; small tiles take more slices per pass to keep CHAINS
    independent chains. Rows are prefetched on the first pass.
    """
    comptime slices = min(max(CHAINS // tile, BLOCK // W), MIN_HEAD_DIM // W)
    for c0 in range(0, head_dim // W, slices):
        var o = stack_allocation[tile * slices, SIMD[F32, W]]()
        comptime for g in range(tile):
            comptime for s in range(slices):
                o[unsafe_offset=g * slices + s] = acc.unsafe_offset(
                    g * head_dim + (c0 + s) * W
                ).unsafe_load[width=W]()
        var vb = SIMD[F32, BLOCK]()
        for j in range(n):
            if c0 == 0:
                prefetcher.after_v_row(j)
            var row = Int(rows[unsafe_offset=j])
            comptime for s in range(slices):
                comptime if s % 2 == 0:
                    vb = load_block[kv_dtype](v, row + (c0 + s) * W)
                var vv = vb.slice[W, offset=(s % 2) * W]()
                comptime for g in range(tile):
                    o[unsafe_offset=g * slices + s] = vv.fma(
                        probs[unsafe_offset=g * CHUNK + j],
                        o[unsafe_offset=g * slices + s],
                    )
        comptime for g in range(tile):
            comptime for s in range(slices):
                acc.unsafe_offset(g * head_dim + (c0 + s) * W).unsafe_store(
                    o[unsafe_offset=g * slices + s]
                )


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
    comptime for g in range(tile):
        var row = scores.unsafe_offset(g * CHUNK)
        var top = SIMD[F32, W](neg_inf[F32]())
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
        tops[unsafe_offset=g] = top
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
        l.unsafe_load[width=tile]() * alpha + reduce_many[tile](totals)
    )
    m.unsafe_store(new)
    comptime for g in range(tile):
        if alpha[g] != 1:
            for c in range(head_dim // W):
                var a = acc.unsafe_offset(g * head_dim + c * W)
                a.unsafe_store(a.unsafe_load[width=W]() * alpha[g])


@always_inline
def chunk_tile[
    tile: Int, k_dtype: DType, v_dtype: DType
](
    head_dim: Int,
    params: AttentionParams,
    state: TaskState,
    g: Int,
    k: Ptr[k_dtype],
    k_rows: RowOffsets,
    v: Ptr[v_dtype],
    v_rows: RowOffsets,
    n: Int,
    kv_pos0: Int,
    prefetcher: RowPrefetch,
):
    """One chunk for the task's query rows g..g+tile."""
    var q = state.q.unsafe_offset(g * head_dim)
    var acc = state.acc.unsafe_offset(g * head_dim)
    score_tile[tile](head_dim, q, k, k_rows, n, state.scores, prefetcher)
    softmax_tile[tile](
        head_dim,
        params,
        state.scores,
        n,
        kv_pos0,
        state.row_pos.unsafe_offset(g),
        state.alibi_log2.unsafe_offset(g),
        state.m.unsafe_offset(g),
        state.l.unsafe_offset(g),
        acc,
    )
    accumulate_tile[tile](head_dim, state.scores, v, v_rows, n, acc, prefetcher)


@always_inline
def chunk_group[
    k_dtype: DType, v_dtype: DType
](
    head_dim: Int,
    params: AttentionParams,
    state: TaskState,
    g0: Int,
    group: Int,
    k: Ptr[k_dtype],
    k_rows: RowOffsets,
    v: Ptr[v_dtype],
    v_rows: RowOffsets,
    n: Int,
    kv_pos0: Int,
    prefetcher: RowPrefetch,
):
    """One chunk for the `group` query heads g0.. of one KV head, in tiles of
    8, 4, 2 and 1; the first tile drives the prefetcher."""
    var g = g0
    var prefetching = prefetcher
    while g < g0 + group:
        var left = g0 + group - g
        var taken = False
        comptime for i in range(4):
            comptime tile = 8 >> i
            if not taken and left >= tile:
                chunk_tile[tile](
                    head_dim,
                    params,
                    state,
                    g,
                    k,
                    k_rows,
                    v,
                    v_rows,
                    n,
                    kv_pos0,
                    prefetching,
                )
                g += tile
                taken = True
        prefetching = prefetcher.disabled()


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
    """The chunk's K rows widened to float32 and rotated by their positions
    (ROPE_LLAMA), into out_rows [n, head_dim]."""
    for j in range(n):
        var dst = out_rows.unsafe_offset(j * head_dim)
        for c in range(head_dim // W):
            dst.unsafe_offset(c * W).unsafe_store(
                load_f32[kv_dtype, W](k, Int(rows[unsafe_offset=j]) + c * W)
            )
        rope_rotate(dst, inv_freq, first_pos + j, head_dim)


struct TaskState(Movable):
    """Per-task scratch: the q vector, accumulator, softmax state, position
    and ALiBi slope of each query row (a query token's head), the scores of
    one tile, row offset tables. On the heap: 64 rows of dim 256 would not fit
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
        var scores_at = take(at, 8 * CHUNK)
        var freq_at = take(at, D)  # D // 2 float64s
        var krot_at = take(at, CHUNK * D)
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

    var st = TaskState((h1 - h0) * head_rows, head_dim)
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
                    dst.unsafe_offset(c * W).unsafe_store(
                        load_f32[q_dtype, W](src, c * W)
                    )
                if rope:
                    rope_rotate(dst, st.inv_freq, q_pos0 + t, head_dim)
                for c in range(head_dim // W):
                    var d = dst.unsafe_offset(c * W)
                    d.unsafe_store(
                        d.unsafe_load[width=W]() * params.q_scale_log2
                    )
                    st.acc.unsafe_offset(r * head_dim + c * W).unsafe_store(
                        SIMD[F32, W](0)
                    )
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
    var tok = first
    var n = chunk_rows(cache, b, tok, end, rows) if tok < end else 0
    while tok < end:
        var next = tok + n
        var n_ahead = (
            chunk_rows(cache, b, next, end, ahead) if next < end else 0
        )
        for h in range(h0, h1):
            var k = cache.k_pages.unsafe_offset(h * hs)
            var v = cache.v_pages.unsafe_offset(h * hs)
            var r0 = (h - h0) * head_rows
            # After this head's V rows come the next head's K rows, or the
            # next chunk's first head's.
            var prefetcher = RowPrefetch[kv_dtype](
                k, v, rows, n, k.unsafe_offset(hs), rows, n, head_dim
            ) if h + 1 < h1 else RowPrefetch[kv_dtype](
                k,
                v,
                rows,
                n,
                cache.k_pages.unsafe_offset(h0 * hs),
                ahead,
                n_ahead,
                head_dim,
            )
            if rope:
                rotated_keys(head_dim, k, rows, n, tok, st.inv_freq, st.krot)
                chunk_group(
                    head_dim,
                    params,
                    st,
                    r0,
                    head_rows,
                    st.krot,
                    rot_rows,
                    v,
                    rows,
                    n,
                    tok,
                    RowPrefetch[DType.float32](
                        st.krot, st.krot, rot_rows, 0, st.krot, rot_rows, 0, 0
                    ),
                )
            else:
                chunk_group(
                    head_dim,
                    params,
                    st,
                    r0,
                    head_rows,
                    k,
                    rows,
                    v,
                    rows,
                    n,
                    tok,
                    prefetcher,
                )
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
                var norm = params.v_scale / total if total > 0 else Float32(0)
                var state_lse = (
                    st.m[unsafe_offset=r] + log2(total) if total
                    > 0 else neg_inf[F32]()
                )
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
