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
from std.memory.alloc import unsafe_alloc
from std.sys import simd_width_of, size_of
from std.sys.intrinsics import PrefetchOptions, prefetch
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
from .decode_work import DecodeWork
from .merge_states import merge_row
from .paged_kv_cache import DYNAMIC, KV, KVLayout, PagedKVCache, Ptr

comptime CHUNK = 32
"""Tokens scored together: two AVX-512 vectors of scores per head."""

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
def prefetch_row[dtype: DType, elems: Int](p: Ptr[dtype]):
    """Asks for the cache lines of one row of `elems` elements."""
    comptime line_elems = max(64 // size_of[dtype](), 1)
    comptime for i in range((elems + line_elems - 1) // line_elems):
        prefetch[PrefetchOptions().for_read().medium_locality()](
            p.unsafe_offset(i * line_elems)
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
    k_next: Ptr[kv_dtype],
    n_next: Int,
):
    """scores[g * CHUNK + j] = q[g] . k[j] for tile heads and n tokens.

    Each K row is loaded once and used by all heads of the tile. Row j of the
    next chunk (k_next, n_next rows) is prefetched as row j is scored, so
    memory requests stay in flight at the rate the rows are consumed.
    """
    for j in range(n):
        if j < n_next:
            prefetch_row[kv_dtype, head_dim](k_next.unsafe_offset(j * k_stride))
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
    v_next: Ptr[kv_dtype],
    n_next: Int,
):
    """acc[g] += sum_j probs[g * CHUNK + j] * v[j], head_dim slice by slice so
    that the tile's accumulators stay in registers while V streams from L1.
    The next chunk's V rows are prefetched alongside."""
    for j in range(n_next):
        prefetch_row[kv_dtype, head_dim](v_next.unsafe_offset(j * v_stride))
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
    k_next: Ptr[k_dtype],
    v_next: Ptr[v_dtype],
    n_next: Int,
):
    score_tile[tile, head_dim](q, k, k_stride, n, scores, k_next, n_next)
    softmax_tile[tile, head_dim](
        params, scores, n, distance0, alibi_log2, m, l, acc
    )
    accumulate_tile[tile, head_dim](
        scores, v, v_stride, n, acc, v_next, n_next
    )


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
    k_next: Ptr[k_dtype],
    v_next: Ptr[v_dtype],
    n_next: Int,
):
    """One chunk for `heads` query heads, in tiles of 8, 4, 2 and 1 heads;
    the first tile prefetches the next chunk (k_next, v_next, n_next rows)."""
    var g = 0
    var ahead = n_next
    while g < heads:
        var left = heads - g
        var qg = q.unsafe_offset(g * head_dim)
        var ag = acc.unsafe_offset(g * head_dim)
        var sg = alibi_log2.unsafe_offset(g)
        var mg = m.unsafe_offset(g)
        var lg = l.unsafe_offset(g)
        if g > 0:
            ahead = 0
        if left >= 8:
            chunk_tile[8, head_dim](
                params, qg, k, k_stride, v, v_stride, n, distance0, sg, scores,
                mg, lg, ag, k_next, v_next, ahead,
            )
            g += 8
        elif left >= 4:
            chunk_tile[4, head_dim](
                params, qg, k, k_stride, v, v_stride, n, distance0, sg, scores,
                mg, lg, ag, k_next, v_next, ahead,
            )
            g += 4
        elif left >= 2:
            chunk_tile[2, head_dim](
                params, qg, k, k_stride, v, v_stride, n, distance0, sg, scores,
                mg, lg, ag, k_next, v_next, ahead,
            )
            g += 2
        else:
            chunk_tile[1, head_dim](
                params, qg, k, k_stride, v, v_stride, n, distance0, sg, scores,
                mg, lg, ag, k_next, v_next, ahead,
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


struct TaskState[head_dim: Int]:
    """Per-task scratch: q rows, accumulators and softmax state of up to
    `heads` query heads. On the heap: groups of 64 heads of dim 256 do not fit
    a worker thread's stack."""

    var q: Ptr[F32]
    var acc: Ptr[F32]
    var m: Ptr[F32]
    var l: Ptr[F32]
    var alibi_log2: Ptr[F32]
    var scores: Ptr[F32]
    var inv_freq: Ptr[F32]
    var krot: Ptr[F32]
    var _storage: Ptr[F32]

    def __init__(out self, heads: Int):
        comptime D = Self.head_dim
        var sizes = (
            heads * D,
            heads * D,
            heads,
            heads,
            heads,
            8 * CHUNK,
            D // 2,
            CHUNK * D,
        )
        var total = 0
        comptime for i in range(8):
            total += (sizes[i] + W - 1) // W * W
        self._storage = rebind[Ptr[F32]](
            unsafe_alloc[Float32](total, alignment=64)
        )
        var offsets = List[Int]()
        var at = 0
        comptime for i in range(8):
            offsets.append(at)
            at += (sizes[i] + W - 1) // W * W
        self.q = self._storage.unsafe_offset(offsets[0])
        self.acc = self._storage.unsafe_offset(offsets[1])
        self.m = self._storage.unsafe_offset(offsets[2])
        self.l = self._storage.unsafe_offset(offsets[3])
        self.alibi_log2 = self._storage.unsafe_offset(offsets[4])
        self.scores = self._storage.unsafe_offset(offsets[5])
        self.inv_freq = self._storage.unsafe_offset(offsets[6])
        self.krot = self._storage.unsafe_offset(offsets[7])

    def __del__(deinit self):
        self._storage.free()


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
    heads_per_task: Int,
    task: Int,
):
    """Attention of one work item over a block of KV heads, for every query
    head of those heads' groups.

    Tasks are (item, head block) pairs, task = item * blocks + block. A block
    spans all KV heads when it can, so that in an NHD page the task reads
    each token's K (and V) row from end to end, in memory order. Writes the
    final output for an unsplit request, else the item's partial state.
    """
    var kv_heads = cache.num_kv_heads()
    var blocks = (kv_heads + heads_per_task - 1) // heads_per_task
    var item = task // blocks
    var h0 = (task % blocks) * heads_per_task
    var h1 = min(h0 + heads_per_task, kv_heads)
    var group = num_qo_heads // kv_heads
    var heads = (h1 - h0) * group
    var qo0 = h0 * group
    var b = work.request(item)
    var q_pos = cache.cache_length(b) - 1
    var first = max(work.first(item), params.first_visible(q_pos))
    var end = work.end(item)
    var page_size = cache.page_size()
    var ts = cache.token_stride()
    var rope = params.pos_encoding == POS_ROPE_LLAMA

    var st = TaskState[head_dim](heads)
    if rope:
        for i in range(head_dim // 2):
            st.inv_freq[unsafe_offset=i] = rope_inv_freq(params, i, head_dim)
    for g in range(heads):
        var src = q.unsafe_offset((b * num_qo_heads + qo0 + g) * head_dim)
        var dst = st.q.unsafe_offset(g * head_dim)
        comptime for c in range(head_dim // W):
            dst.unsafe_offset(c * W).unsafe_store(load_f32[q_dtype, W](src, c * W))
        if rope:
            rope_rotate[head_dim, W](dst, st.inv_freq, q_pos)
        comptime for c in range(head_dim // W):
            var d = dst.unsafe_offset(c * W)
            d.unsafe_store(d.unsafe_load[width=W]() * params.q_scale_log2)
            st.acc.unsafe_offset(g * head_dim + c * W).unsafe_store(
                SIMD[F32, W](0)
            )
        st.m[unsafe_offset=g] = neg_inf[F32]()
        st.l[unsafe_offset=g] = 0
        st.alibi_log2[unsafe_offset=g] = 0
        if params.pos_encoding == POS_ALIBI:
            st.alibi_log2[unsafe_offset=g] = (
                alibi_slope(qo0 + g, num_qo_heads) * LOG2E
            )

    var tok = first
    while tok < end:
        var page = cache.page_id(b, tok)
        var slot = tok % page_size
        var n = min(CHUNK, page_size - slot, end - tok)
        # Where the next chunk starts, for prefetching alongside this one.
        var next = tok + n
        var next_page = page
        var next_slot = slot
        var n_next = 0
        if next < end:
            next_page = cache.page_id(b, next)
            next_slot = next % page_size
            n_next = min(CHUNK, page_size - next_slot, end - next)
        for h in range(h0, h1):
            var k = cache.page_ptr[KV.K](page, h).unsafe_offset(slot * ts)
            var v = cache.page_ptr[KV.V](page, h).unsafe_offset(slot * ts)
            var k_next = cache.page_ptr[KV.K](next_page, h).unsafe_offset(
                next_slot * ts
            )
            var v_next = cache.page_ptr[KV.V](next_page, h).unsafe_offset(
                next_slot * ts
            )
            var g0 = (h - h0) * group
            if rope:
                rotated_keys[head_dim](k, ts, n, tok, st.inv_freq, st.krot)
                chunk_heads[head_dim](
                    params, group, st.q.unsafe_offset(g0 * head_dim), st.krot,
                    head_dim, v, ts, n, tok - q_pos,
                    st.alibi_log2.unsafe_offset(g0), st.scores,
                    st.m.unsafe_offset(g0), st.l.unsafe_offset(g0),
                    st.acc.unsafe_offset(g0 * head_dim), st.krot, v_next, 0,
                )
            else:
                chunk_heads[head_dim](
                    params, group, st.q.unsafe_offset(g0 * head_dim), k, ts,
                    v, ts, n, tok - q_pos, st.alibi_log2.unsafe_offset(g0),
                    st.scores, st.m.unsafe_offset(g0), st.l.unsafe_offset(g0),
                    st.acc.unsafe_offset(g0 * head_dim), k_next, v_next, n_next,
                )
        tok = next

    var split = work.is_split(b)
    for g in range(heads):
        var qo = qo0 + g
        var total = st.l[unsafe_offset=g]
        var norm = params.v_scale / total if total > 0 else Float32(0)
        var state_lse = (
            st.m[unsafe_offset=g] + log2(total) if total > 0 else neg_inf[F32]()
        )
        var a = st.acc.unsafe_offset(g * head_dim)
        if split:
            var dst = work.partial_o.unsafe_offset(
                (item * num_qo_heads + qo) * head_dim
            )
            comptime for c in range(head_dim // W):
                dst.unsafe_offset(c * W).unsafe_store(
                    a.unsafe_offset(c * W).unsafe_load[width=W]() * norm
                )
            work.partial_lse[unsafe_offset = item * num_qo_heads + qo] = state_lse
        else:
            var dst = output.unsafe_offset((b * num_qo_heads + qo) * head_dim)
            comptime for c in range(head_dim // W):
                dst.unsafe_offset(c * W).unsafe_store(
                    (a.unsafe_offset(c * W).unsafe_load[width=W]() * norm).cast[
                        q_dtype
                    ]()
                )
            lse[unsafe_offset = b * num_qo_heads + qo] = state_lse


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
