"""Decode attention on the CPU: one task per (work item, KV head).

A task walks its tokens page by page in chunks of CHUNK tokens. Each chunk of
K is read once for all query heads of the group (GQA), scores go through a
base-2 online softmax, and the same chunk of V, still in L1, is folded into
the heads' accumulators. Only the accumulators for up to MAX_PASS_HEADS query
heads live on the stack; larger groups take more passes.

The inner loops are specialised at compile time for the head dim and for the
number of heads scored together (TILE_SIZES), so every vector op is
full-width and every loop over head_dim is unrolled.
"""

from std.math import exp2, log2
from std.memory import bitcast, stack_allocation
from std.sys import simd_width_of, size_of
from std.sys.intrinsics import PrefetchOptions, prefetch
from std.utils.numerics import neg_inf

from .attention_params import (
    POS_ALIBI,
    POS_ROPE_LLAMA,
    AttentionParams,
    alibi_slope,
    rope_inv_freq,
    rope_rotate,
)
from .decode_work import DecodeWork
from .merge_states import merge_row
from .paged_kv_cache import DYNAMIC, KV, KVLayout, PagedKVCache, Ptr

comptime CHUNK = 32
"""Tokens scored together: two AVX-512 vectors of scores per head."""

comptime MAX_PASS_HEADS = 16
"""Query heads whose state one pass keeps on the stack."""

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()


@always_inline
def load_f32[
    dtype: DType, width: Int
](p: Ptr[dtype], offset: Int) -> SIMD[F32, width]:
    """Width elements at p + offset, widened to float32."""
    var raw = p.unsafe_offset(offset).unsafe_load[width=width]()
    comptime if dtype == DType.bfloat16:
        # bfloat16 is the top half of a float32: a shift, not a conversion.
        var bits = bitcast[DType.uint16, width](raw).cast[DType.uint32]() << 16
        return bitcast[F32, width](bits)
    else:
        return raw.cast[F32]()


@always_inline
def prefetch_rows[
    dtype: DType, row_elems: Int
](p: Ptr[dtype], stride: Int, rows: Int):
    """Asks for `rows` rows of row_elems elements, stride apart, ahead of use."""
    comptime lines = max(row_elems * size_of[dtype]() // 64, 1)
    comptime line_elems = max(64 // size_of[dtype](), 1)
    for r in range(rows):
        comptime for c in range(lines):
            prefetch[PrefetchOptions().for_read().high_locality()](
                p.unsafe_offset(r * stride + c * line_elems)
            )


@always_inline
def score_tile[
    tile: Int, head_dim: Int, kv_dtype: DType
](
    q: Ptr[F32],
    k: Ptr[kv_dtype],
    k_stride: Int,
    n: Int,
    scores: Ptr[F32],
):
    """scores[g * CHUNK + j] = q[g] . k[j] for tile heads and n tokens.

    Each K row is loaded once and used by all heads of the tile.
    """
    for j in range(n):
        var acc = stack_allocation[tile, SIMD[F32, W]]()
        comptime for g in range(tile):
            acc[unsafe_offset=g] = 0
        comptime for c in range(head_dim // W):
            var kv = load_f32[kv_dtype, W](k, j * k_stride + c * W)
            comptime for g in range(tile):
                acc[unsafe_offset=g] = q.unsafe_offset(
                    g * head_dim + c * W
                ).unsafe_load[width=W]().fma(kv, acc[unsafe_offset=g])
        comptime for g in range(tile):
            scores[unsafe_offset = g * CHUNK + j] = acc[
                unsafe_offset=g
            ].reduce_add()


@always_inline
def accumulate_tile[
    tile: Int, head_dim: Int, kv_dtype: DType
](
    probs: Ptr[F32],
    v: Ptr[kv_dtype],
    v_stride: Int,
    n: Int,
    acc: Ptr[F32],
):
    """acc[g] += sum_j probs[g * CHUNK + j] * v[j], head_dim slice by slice so
    that the tile's accumulators stay in registers while V streams from L1."""
    comptime for c in range(head_dim // W):
        var o = stack_allocation[tile, SIMD[F32, W]]()
        comptime for g in range(tile):
            o[unsafe_offset=g] = acc.unsafe_offset(
                g * head_dim + c * W
            ).unsafe_load[width=W]()
        for j in range(n):
            var vv = load_f32[kv_dtype, W](v, j * v_stride + c * W)
            comptime for g in range(tile):
                o[unsafe_offset=g] = vv.fma(
                    probs[unsafe_offset = g * CHUNK + j], o[unsafe_offset=g]
                )
        comptime for g in range(tile):
            acc.unsafe_offset(g * head_dim + c * W).unsafe_store(
                o[unsafe_offset=g]
            )


@always_inline
def softmax_tile[
    tile: Int, head_dim: Int
](
    params: AttentionParams,
    scores: Ptr[F32],
    n: Int,
    distance0: Int,
    alibi_log2: Ptr[F32],
    m: Ptr[F32],
    l: Ptr[F32],
    acc: Ptr[F32],
):
    """Online softmax over one chunk: scores become probabilities relative to
    the running max m, and l and acc are rescaled when m grows.

    distance0 = position of token 0 of the chunk - query position.
    """
    var iota = SIMD[F32, W]()
    comptime for i in range(W):
        iota[i] = Float32(i)
    comptime for g in range(tile):
        var row = scores.unsafe_offset(g * CHUNK)
        var top = neg_inf[F32]()
        comptime for c in range(CHUNK // W):
            var s = params.finish_scores(
                row.unsafe_offset(c * W).unsafe_load[width=W](),
                alibi_log2[unsafe_offset=g],
                iota + Float32(distance0 + c * W),
            )
            # Lanes past the chunk's last token get no weight.
            var live = iota.lt(Float32(n - c * W))
            s = live.select(s, neg_inf[F32]())
            row.unsafe_offset(c * W).unsafe_store(s)
            top = max(top, s.reduce_max())
        var old = m[unsafe_offset=g]
        var new = max(old, top)
        var total: Float32 = 0
        comptime for c in range(CHUNK // W):
            var p = exp2(row.unsafe_offset(c * W).unsafe_load[width=W]() - new)
            row.unsafe_offset(c * W).unsafe_store(p)
            total += p.reduce_add()
        var alpha = exp2(old - new)
        l[unsafe_offset=g] = l[unsafe_offset=g] * alpha + total
        m[unsafe_offset=g] = new
        if alpha != 1:
            comptime for c in range(head_dim // W):
                var a = acc.unsafe_offset(g * head_dim + c * W)
                a.unsafe_store(a.unsafe_load[width=W]() * alpha)


@always_inline
def chunk_tile[
    tile: Int, head_dim: Int, k_dtype: DType, v_dtype: DType
](
    params: AttentionParams,
    q: Ptr[F32],
    k: Ptr[k_dtype],
    k_stride: Int,
    v: Ptr[v_dtype],
    v_stride: Int,
    n: Int,
    distance0: Int,
    alibi_log2: Ptr[F32],
    scores: Ptr[F32],
    m: Ptr[F32],
    l: Ptr[F32],
    acc: Ptr[F32],
):
    score_tile[tile, head_dim](q, k, k_stride, n, scores)
    softmax_tile[tile, head_dim](
        params, scores, n, distance0, alibi_log2, m, l, acc
    )
    accumulate_tile[tile, head_dim](scores, v, v_stride, n, acc)


@always_inline
def chunk_heads[
    head_dim: Int, k_dtype: DType, v_dtype: DType
](
    params: AttentionParams,
    heads: Int,
    q: Ptr[F32],
    k: Ptr[k_dtype],
    k_stride: Int,
    v: Ptr[v_dtype],
    v_stride: Int,
    n: Int,
    distance0: Int,
    alibi_log2: Ptr[F32],
    scores: Ptr[F32],
    m: Ptr[F32],
    l: Ptr[F32],
    acc: Ptr[F32],
):
    """One chunk for `heads` query heads, in tiles of 8, 4, 2 and 1 heads."""
    var g = 0
    while g < heads:
        var left = heads - g
        var qg = q.unsafe_offset(g * head_dim)
        var ag = acc.unsafe_offset(g * head_dim)
        var sg = alibi_log2.unsafe_offset(g)
        var mg = m.unsafe_offset(g)
        var lg = l.unsafe_offset(g)
        if left >= 8:
            chunk_tile[8, head_dim](
                params, qg, k, k_stride, v, v_stride, n, distance0, sg, scores, mg, lg, ag
            )
            g += 8
        elif left >= 4:
            chunk_tile[4, head_dim](
                params, qg, k, k_stride, v, v_stride, n, distance0, sg, scores, mg, lg, ag
            )
            g += 4
        elif left >= 2:
            chunk_tile[2, head_dim](
                params, qg, k, k_stride, v, v_stride, n, distance0, sg, scores, mg, lg, ag
            )
            g += 2
        else:
            chunk_tile[1, head_dim](
                params, qg, k, k_stride, v, v_stride, n, distance0, sg, scores, mg, lg, ag
            )
            g += 1


@always_inline
def rotated_keys[
    head_dim: Int, kv_dtype: DType
](
    k: Ptr[kv_dtype],
    k_stride: Int,
    n: Int,
    first_pos: Int,
    inv_freq: Ptr[F32],
    output: Ptr[F32],
):
    """n K rows widened to float32 and rotated by their positions (ROPE_LLAMA)."""
    for j in range(n):
        comptime for c in range(head_dim // W):
            output.unsafe_offset(j * head_dim + c * W).unsafe_store(
                load_f32[kv_dtype, W](k, j * k_stride + c * W)
            )
        rope_rotate[head_dim, W](
            output.unsafe_offset(j * head_dim), inv_freq, first_pos + j
        )


def decode_task[
    q_dtype: DType, kv_dtype: DType, layout: KVLayout, head_dim: Int
](
    cache: PagedKVCache[kv_dtype, layout, DYNAMIC, DYNAMIC, head_dim],
    q: Ptr[q_dtype],
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    work: DecodeWork,
    params: AttentionParams,
    num_qo_heads: Int,
    task: Int,
):
    """Attention of work item task // H over KV head task % H, for all query
    heads of that head's group. Writes the final output for an unsplit
    request, else the item's partial state."""
    var kv_heads = cache.num_kv_heads()
    var item = task // kv_heads
    var kv_head = task % kv_heads
    var b = work.request(item)
    var length = cache.cache_length(b)
    var q_pos = length - 1
    var first = max(work.first(item), params.first_visible(q_pos))
    var end = work.end(item)
    var group = num_qo_heads // kv_heads
    var page_size = cache.page_size()
    var ts = cache.token_stride()
    var rope = params.pos_encoding == POS_ROPE_LLAMA

    var qf = stack_allocation[MAX_PASS_HEADS * head_dim, F32]()
    var acc = stack_allocation[MAX_PASS_HEADS * head_dim, F32]()
    var scores = stack_allocation[MAX_PASS_HEADS * CHUNK, F32]()
    var m = stack_allocation[MAX_PASS_HEADS, F32]()
    var l = stack_allocation[MAX_PASS_HEADS, F32]()
    var alibi_log2 = stack_allocation[MAX_PASS_HEADS, F32]()
    var inv_freq = stack_allocation[head_dim // 2, F32]()
    var krot = stack_allocation[CHUNK * head_dim, F32]()
    if rope:
        for i in range(head_dim // 2):
            inv_freq[unsafe_offset=i] = rope_inv_freq(params, i, head_dim)

    var pass_first = 0
    while pass_first < group:
        var heads = min(MAX_PASS_HEADS, group - pass_first)
        var qo0 = kv_head * group + pass_first
        for g in range(heads):
            var src = q.unsafe_offset((b * num_qo_heads + qo0 + g) * head_dim)
            var dst = qf.unsafe_offset(g * head_dim)
            comptime for c in range(head_dim // W):
                dst.unsafe_offset(c * W).unsafe_store(
                    load_f32[q_dtype, W](src, c * W)
                )
            if rope:
                rope_rotate[head_dim, W](dst, inv_freq, q_pos)
            comptime for c in range(head_dim // W):
                var d = dst.unsafe_offset(c * W)
                d.unsafe_store(d.unsafe_load[width=W]() * params.q_scale_log2)
            m[unsafe_offset=g] = neg_inf[F32]()
            l[unsafe_offset=g] = 0
            alibi_log2[unsafe_offset=g] = 0
            if params.pos_encoding == POS_ALIBI:
                alibi_log2[unsafe_offset=g] = alibi_slope(
                    qo0 + g, num_qo_heads
                ) * 1.4426950408889634
            comptime for c in range(head_dim // W):
                acc.unsafe_offset(g * head_dim + c * W).unsafe_store(
                    SIMD[F32, W](0)
                )

        var tok = first
        while tok < end:
            var page = cache.page_id(b, tok)
            var slot = tok % page_size
            var n = min(CHUNK, page_size - slot, end - tok)
            var k = cache.page_ptr[KV.K](page, kv_head).unsafe_offset(
                slot * ts
            )
            var v = cache.page_ptr[KV.V](page, kv_head).unsafe_offset(
                slot * ts
            )
            # Ask for the next chunk while this one is computed.
            var next = tok + n
            if next < end:
                var next_page = cache.page_id(b, next)
                var next_slot = next % page_size
                var ahead = min(CHUNK, page_size - next_slot, end - next)
                prefetch_rows[kv_dtype, head_dim](
                    cache.page_ptr[KV.K](next_page, kv_head).unsafe_offset(
                        next_slot * ts
                    ),
                    ts,
                    ahead,
                )
                prefetch_rows[kv_dtype, head_dim](
                    cache.page_ptr[KV.V](next_page, kv_head).unsafe_offset(
                        next_slot * ts
                    ),
                    ts,
                    ahead,
                )
            if rope:
                rotated_keys[head_dim](k, ts, n, tok, inv_freq, krot)
                chunk_heads[head_dim](
                    params, heads, qf, krot, head_dim, v, ts, n,
                    tok - q_pos, alibi_log2, scores, m, l, acc,
                )
            else:
                chunk_heads[head_dim](
                    params, heads, qf, k, ts, v, ts, n,
                    tok - q_pos, alibi_log2, scores, m, l, acc,
                )
            tok = next

        var split = work.is_split(b)
        for g in range(heads):
            var qo = qo0 + g
            var total = l[unsafe_offset=g]
            var norm = params.v_scale / total if total > 0 else Float32(0)
            var state_lse = (
                m[unsafe_offset=g] + log2(total) if total > 0 else neg_inf[F32]()
            )
            var a = acc.unsafe_offset(g * head_dim)
            if split:
                var dst = work.partial_o.unsafe_offset(
                    (item * num_qo_heads + qo) * head_dim
                )
                comptime for c in range(head_dim // W):
                    dst.unsafe_offset(c * W).unsafe_store(
                        a.unsafe_offset(c * W).unsafe_load[width=W]() * norm
                    )
                work.partial_lse[unsafe_offset = item * num_qo_heads + qo] = (
                    state_lse
                )
            else:
                var dst = output.unsafe_offset((b * num_qo_heads + qo) * head_dim)
                comptime for c in range(head_dim // W):
                    dst.unsafe_offset(c * W).unsafe_store(
                        (a.unsafe_offset(c * W).unsafe_load[width=W]() * norm).cast[
                            q_dtype
                        ]()
                    )
                lse[unsafe_offset = b * num_qo_heads + qo] = state_lse
        pass_first += heads


def merge_split_request[
    q_dtype: DType
](
    work: DecodeWork,
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    num_qo_heads: Int,
    head_dim: Int,
    b: Int,
    first: Int,
    step: Int,
):
    """Merges the partial states of request b (if it was split) into output, lse."""
    if not work.is_split(b):
        return
    var item0 = Int(work.request_items[unsafe_offset=b])
    var count = work.items_of(b)
    for qo in range(num_qo_heads):
        merge_row(
            work.partial_o.unsafe_offset((item0 * num_qo_heads + qo) * head_dim),
            num_qo_heads * head_dim,
            work.partial_lse.unsafe_offset(item0 * num_qo_heads + qo),
            num_qo_heads,
            count,
            head_dim,
            output.unsafe_offset((b * num_qo_heads + qo) * head_dim),
            lse.unsafe_offset(b * num_qo_heads + qo),
            first,
            step,
        )
