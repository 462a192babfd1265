"""Paged attention on the CPU: one task, decode or prefill.

A task is one work item (a tile of one request's query tokens against a run
of its keys, see attention/work.mojo) over a block of KV heads. Decode tasks
take all KV heads when their query heads fit (see `heads_per_task` in the
plan): in an NHD page a token's heads are one contiguous row, so the task
streams K and V through memory in order. Prefill tasks take one KV head and
a tile of query tokens, whose rows all reuse each K and V row read; from
PRODUCT_MIN_ROWS rows on they take each chunk as matrix products instead of
the steps below (products.mojo).

The task walks its keys in chunks of CHUNK tokens, which may span pages
(see key_chunks.mojo). Per chunk: scores for all its query rows
(scores.mojo), then a base-2 online softmax with per-row masks (causal,
window, a custom mask; softmax.mojo), then V folded into the rows' accumulators
(accumulate.mojo); an int8 pool's row scales multiply the chunk's scores
before the softmax and its probabilities after it. K, and then V, are read
in blocks of a few tokens (block_sizes.mojo): all the task's heads of a
block's tokens before the next block, so that reads stay within a few
adjacent token rows, which the hardware prefetchers stream; meanwhile the
next block is prefetched (BlockPrefetch). Heads of one or two query rows each (GQA group 1 or 2) are
taken several at a time, so that each token's read is a run of adjacent
heads; heads of more rows take the block in sub-blocks of a few tokens
(`sub_block_tokens`), all heads of one before the next (read_order.mojo).

The inner loops are specialised at compile time for the number of query rows
scored together (tiles of 8, 4, 3, 2, 1) and unrolled so that every tile keeps
at least 8 independent FMA chains in flight (the tile of 3, six with AVX2);
tiles of one row (GQA group 1) read each K and V row in runs of RUN_BYTES
(step_sizes.mojo). head_dim is a run-time value, so one compile serves every
model. bfloat16 K and V are widened in "paired" order (see simd/widen.mojo),
which the q and accumulator rows follow.
"""

from std.math import log2
from std.utils.numerics import nan, neg_inf

from ...cache.paged_kv_cache import DYNAMIC, KV, KVLayout, PagedKVCache, Ptr
from ...simd.exp2 import is_nan_f32
from ...simd.widen import (
    BLOCK,
    F32,
    W,
    from_paired_order,
    kv_load_scale,
    load_f32,
    narrow,
    paired,
    to_paired_order,
)
from ..custom_mask import CustomMask
from ..params import (
    LOG2E,
    POS_ALIBI,
    POS_ROPE_LLAMA,
    AttentionParams,
    alibi_slope,
    rope_inv_freq,
    rope_rotate,
)
from ..work import AttentionWork
from .block_sizes import block_tokens, prefetches_block
from .code_products import (
    accumulate_chunk_codes,
    quantize_query_codes,
    score_chunk_codes,
    takes_codes,
)
from .key_chunks import CHUNK, BlockPrefetch, RowOffsets, chunk_rows
from .products import PRODUCT_MIN_ROWS, accumulate_chunk, score_chunk
from .read_order import walk_blocks, walk_rows
from .scores import raw_bf16_q, rotated_keys, scale_scores
from .softmax import softmax_rows
from .task_state import TaskState


def attention_task[
    q_dtype: DType, kv_dtype: DType, layout: KVLayout
](
    cache: PagedKVCache[kv_dtype, layout, DYNAMIC, DYNAMIC, DYNAMIC],
    q: Ptr[q_dtype],
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    work: AttentionWork,
    params: AttentionParams,
    mask: CustomMask,
    num_qo_heads: Int,
    heads_per_task: Int,
    task: Int,
):
    """One work item over a block of KV heads; task = item * blocks + block.

    An item that takes its chunks as matrix products (`takes_products`) runs
    them one KV head at a time; any other item runs the block's heads
    together. Writes final outputs, or partial states where a request's keys
    are split across items (decode).
    """
    var kv_heads = cache.num_kv_heads()
    var blocks = (kv_heads + heads_per_task - 1) // heads_per_task
    var item = task // blocks
    var h0 = (task % blocks) * heads_per_task
    var h1 = min(h0 + heads_per_task, kv_heads)
    var group = num_qo_heads // kv_heads
    if work.q_count(item) == 0:
        return  # padding, or a request's place in a shared decode item
    if takes_products(work, item, group, h1 - h0):
        for h in range(h0, h1):
            item_heads_task[q_dtype, kv_dtype, layout](
                cache,
                q,
                output,
                lse,
                work,
                params,
                mask,
                num_qo_heads,
                item,
                h,
                h + 1,
                True,
            )
    else:
        item_heads_task[q_dtype, kv_dtype, layout](
            cache,
            q,
            output,
            lse,
            work,
            params,
            mask,
            num_qo_heads,
            item,
            h0,
            h1,
            False,
        )


@always_inline
def takes_products(
    work: AttentionWork, item: Int, group: Int, heads: Int
) -> Bool:
    """Whether the item takes its chunks as matrix products (products.mojo),
    one KV head at a time: at least PRODUCT_MIN_ROWS rows of one KV head,
    in a task of one head (prefill) or of several queries (a shared decode
    item). One decode query keeps its steps over all the task's heads."""
    var queries = work.q_count(item)
    return queries * group >= PRODUCT_MIN_ROWS and (heads == 1 or queries > 1)


def item_heads_task[
    q_dtype: DType, kv_dtype: DType, layout: KVLayout
](
    cache: PagedKVCache[kv_dtype, layout, DYNAMIC, DYNAMIC, DYNAMIC],
    q: Ptr[q_dtype],
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    work: AttentionWork,
    params: AttentionParams,
    mask: CustomMask,
    num_qo_heads: Int,
    item: Int,
    h0: Int,
    h1: Int,
    products: Bool,
):
    """Work item `item` over KV heads h0..h1, as products (one head) or as
    decode's steps.

    The task's query rows are (KV head, query token, head of the group), so
    each KV head's rows are contiguous and share every K and V row it reads.
    """
    var group = num_qo_heads // cache.num_kv_heads()
    var queries = work.q_count(item)
    var q_row0 = work.q_row(item)
    var head_rows = queries * group
    var b = work.request(item)
    var first = work.kv_first(item)
    var end = work.kv_end(item)
    var hs = cache.head_stride()
    var head_dim = cache.head_dim()
    var rope = params.pos_encoding == POS_ROPE_LLAMA
    # The K and V loads return kv_load_scale times the values (simd/widen.mojo):
    # the q.k and V scales undo it.
    var q_scale = params.q_scale_log2 / kv_load_scale[kv_dtype]()
    var v_scale = params.v_scale / kv_load_scale[kv_dtype]()

    var st = TaskState((h1 - h0) * head_rows, head_dim)
    comptime raw_q = raw_bf16_q[q_dtype, kv_dtype]()
    var keep_raw_q = raw_q and not rope
    if rope:
        for i in range(head_dim // 2):
            st.inv_freq[unsafe_offset=i] = rope_inv_freq(params, i, head_dim)
    load_query_rows[q_dtype, kv_dtype](
        q,
        st,
        params,
        mask,
        num_qo_heads,
        head_dim,
        h0,
        h1,
        group,
        queries,
        q_row0,
        work,
        item,
        q_scale,
        rope,
        keep_raw_q,
    )
    # An int8 pool's products multiply codes (code_products.mojo); a task of
    # products has one KV head, so its rows are head_rows.
    var codes = False
    comptime if kv_dtype == DType.int8:
        codes = products and not rope and takes_codes(head_dim)
        if codes:
            quantize_query_codes(st, head_rows, head_dim)

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
            score_rotated_chunk(
                cache,
                st,
                h0,
                h1,
                head_rows,
                rows,
                rot_rows,
                n,
                tok,
                products,
                first_v,
            )
        elif codes:
            comptime if kv_dtype == DType.int8:
                load_row_scales[KV.K](st, cache, b, tok, n, h0)
                score_chunk_codes(
                    head_dim,
                    st,
                    head_rows,
                    rebind[Ptr[DType.int8]](k0),
                    rows,
                    n,
                    first_v,
                )
        elif products:
            # Without rotation, keep_raw_q is raw_q: dot products of pairs.
            score_chunk[dots=raw_q](
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
        else:
            # Scores block by block; the last K block asks for the first V one.
            walk_blocks[scoring=True, raw_q=raw_q](
                head_dim,
                st,
                heads,
                head_rows,
                k0,
                hs,
                rows,
                n,
                block,
                ahead_max,
                nhd,
                first_v,
            )
        if keep_raw_q:
            scale_scores(st.scores, heads * head_rows, q_scale)
        comptime if kv_dtype == DType.int8:
            if not codes:  # products of codes weight them as they score
                scale_by_row_scales[KV.K](
                    st, cache, b, tok, n, h0, heads, head_rows
                )
        softmax_rows(head_dim, params, mask, st, heads * head_rows, n, tok)
        comptime if kv_dtype == DType.int8:
            # After the softmax has summed the probabilities: V's scales
            # weight only what the rows accumulate (products of codes weight
            # them as they quantize them).
            if codes:
                load_row_scales[KV.V](st, cache, b, tok, n, h0)
            else:
                scale_by_row_scales[KV.V](
                    st, cache, b, tok, n, h0, heads, head_rows
                )
        var next_k = BlockPrefetch[kv_dtype](
            k0, ahead, 0, min(ahead_max, n_ahead), heads, hs, head_dim, nhd
        )
        if codes:
            comptime if kv_dtype == DType.int8:
                accumulate_chunk_codes(
                    head_dim,
                    st,
                    head_rows,
                    rebind[Ptr[DType.int8]](v0),
                    rows,
                    n,
                    next_k,
                )
        elif products:
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
        else:
            # V, block by block; the last V block asks for the next chunk's
            # first K block.
            walk_blocks[scoring=False](
                head_dim,
                st,
                heads,
                head_rows,
                v0,
                hs,
                rows,
                n,
                block,
                ahead_max,
                nhd,
                next_k,
            )
        tok = next
        n = n_ahead
        var swap = rows
        rows = ahead
        ahead = swap

    write_rows[q_dtype, kv_dtype](
        st,
        output,
        lse,
        work,
        item,
        num_qo_heads,
        head_dim,
        h0,
        h1,
        group,
        queries,
        q_row0,
        v_scale,
    )


@always_inline
def scale_by_row_scales[
    kv: KV
](
    st: TaskState,
    cache: PagedKVCache,
    b: Int,
    first: Int,
    n: Int,
    h0: Int,
    heads: Int,
    head_rows: Int,
):
    """Multiplies column j of each row of st.scores (a chunk's scores, or
    its probabilities) by the K (or V) scale of request b's token first + j
    at the row's head: rows hh * head_rows .. of head h0 + hh (an int8
    pool, cache/int8_rows.mojo)."""
    var scales = st.row_scales
    for hh in range(heads):
        load_row_scales[kv](st, cache, b, first, n, h0 + hh)
        for r in range(hh * head_rows, (hh + 1) * head_rows):
            var row = st.scores.unsafe_offset(r * CHUNK)
            var j = 0
            while j + W <= n:
                var at = row.unsafe_offset(j)
                at.unsafe_store(
                    at.unsafe_load[width=W]()
                    * scales.unsafe_offset(j).unsafe_load[width=W]()
                )
                j += W
            while j < n:
                row[unsafe_offset=j] *= scales[unsafe_offset=j]
                j += 1


@always_inline
def load_row_scales[
    kv: KV
](st: TaskState, cache: PagedKVCache, b: Int, first: Int, n: Int, head: Int):
    """st.row_scales[j] = the K (or V) scale of request b's token first + j
    at `head` for j < n, and 0 for the rest of the chunk (an int8 pool,
    cache/int8_rows.mojo)."""
    var scales = st.row_scales
    var page_size = cache.page_size()
    var j = 0
    while j < n:
        var tok = first + j
        var slot = tok % page_size
        var page_scales = cache.row_scales[kv](cache.page_id(b, tok))
        var run = min(page_size - slot, n - j)
        for t in range(run):
            scales[unsafe_offset=j + t] = page_scales[
                unsafe_offset=cache.scale_index(slot + t, head)
            ]
        j += run
    for t in range(n, CHUNK):
        scales[unsafe_offset=t] = 0


@always_inline
def load_query_rows[
    q_dtype: DType, kv_dtype: DType
](
    q: Ptr[q_dtype],
    st: TaskState,
    params: AttentionParams,
    mask: CustomMask,
    num_qo_heads: Int,
    head_dim: Int,
    h0: Int,
    h1: Int,
    group: Int,
    queries: Int,
    q_row0: Int,
    work: AttentionWork,
    item: Int,
    q_scale: Float32,
    rope: Bool,
    keep_raw_q: Bool,
):
    """The task's query rows into its state: query token t's head h * group
    + g (KV heads h0..h1) as row r = (h - h0) * head_rows + t * group + g,
    widened, rotated (RoPE), scaled by q_scale and put in the order K widens
    in (or kept as it came, keep_raw_q: see `raw_bf16_q`); the rows'
    accumulators and softmax states cleared, their positions
    (`AttentionWork.query_pos`), ALiBi slopes and custom mask rows set. The
    RoPE frequencies must be in st.inv_freq.
    """
    var head_rows = queries * group
    comptime raw_q = raw_bf16_q[q_dtype, kv_dtype]()
    for h in range(h0, h1):
        for t in range(queries):
            var pos = work.query_pos(item, t)
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
                        rope_rotate(dst, st.inv_freq, pos, head_dim)
                    for c in range(head_dim // W):
                        var d = dst.unsafe_offset(c * W)
                        d.unsafe_store(d.unsafe_load[width=W]() * q_scale)
                    comptime if paired[kv_dtype]():
                        # Rotated keys are widened to float32 rows in order.
                        if not rope:
                            to_paired_order(dst, head_dim)
                st.m[unsafe_offset=r] = neg_inf[F32]()
                st.l[unsafe_offset=r] = 0
                st.row_pos[unsafe_offset=r] = Float32(pos)
                if mask.enabled:
                    st.mask_bit[unsafe_offset=r] = mask.row_bits[
                        unsafe_offset=q_row0 + t
                    ]
                st.alibi_log2[unsafe_offset=r] = 0
                if params.pos_encoding == POS_ALIBI:
                    st.alibi_log2[unsafe_offset=r] = (
                        alibi_slope(qo, num_qo_heads) * LOG2E
                    )


@always_inline
def score_rotated_chunk[
    kv_dtype: DType, layout: KVLayout
](
    cache: PagedKVCache[kv_dtype, layout, DYNAMIC, DYNAMIC, DYNAMIC],
    st: TaskState,
    h0: Int,
    h1: Int,
    head_rows: Int,
    rows: RowOffsets,
    rot_rows: RowOffsets,
    n: Int,
    tok: Int,
    products: Bool,
    first_v: BlockPrefetch[kv_dtype],
):
    """Scores of a chunk of n keys from position tok (row offsets `rows`)
    for the task's KV heads h0..h1, each key rotated by its position first
    (ROPE_LLAMA) into st.krot, whose rows are at rot_rows. first_v: the
    chunk's first V block, to prefetch meanwhile."""
    var head_dim = cache.head_dim()
    var hs = cache.head_stride()
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


@always_inline
def write_rows[
    q_dtype: DType, kv_dtype: DType
](
    st: TaskState,
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    work: AttentionWork,
    item: Int,
    num_qo_heads: Int,
    head_dim: Int,
    h0: Int,
    h1: Int,
    group: Int,
    queries: Int,
    q_row0: Int,
    v_scale: Float32,
):
    """The task's rows (as `load_query_rows` lays them out) normalised by
    their softmax sums and scaled by v_scale: into output and lse, or the
    partial state slots (work.partial_o, partial_lse) of query t's request
    where its keys are split across items (decode)."""
    var head_rows = queries * group
    for h in range(h0, h1):
        for t in range(queries):
            var partial = work.writes_partial(work.query_request(item, t))
            var slot = work.partial_slot(item, t)
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
                    # A key-split item's queries are one per request (decode).
                    var dst = work.partial_o.unsafe_offset(
                        (slot * num_qo_heads + qo) * head_dim
                    )
                    for c in range(head_dim // W):
                        dst.unsafe_offset(c * W).unsafe_store(
                            a.unsafe_offset(c * W).unsafe_load[width=W]() * norm
                        )
                    work.partial_lse[
                        unsafe_offset=slot * num_qo_heads + qo
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
