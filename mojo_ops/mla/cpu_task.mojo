"""MLA attention on the CPU: one task, a block of a work item's query rows
over the item's keys, as matrix products.

Absorbed MLA is multi-query attention with one shared latent: every query
row (a query token's head) scores q_nope . ckv + q_pe . kpe, and its output
is the softmax-weighted sum of ckv rows. All the task's rows read every key,
so each chunk of CHUNK keys is reshaped once for them all and both products
run on the register-blocked `product_tile` of attention/cpu/products.mojo:

- scores [rows, CHUNK] = Q [rows, ckv_dim + kpe_dim] x K^T, where K^T is the
  chunk's ckv and kpe rows transposed and widened to float32 (one column
  per key, ckv's elements then kpe's);
- acc [rows, ckv_dim] += P [rows, CHUNK] x V [CHUNK, ckv_dim], V the chunk's
  ckv rows widened.

Between them the base-2 online softmax of attention/cpu/softmax.mojo, with
each row's causal position. q rows are scaled before the products (see
MLAScales) and kept in the order `load_block` widens K (bfloat16's paired
order), which the accumulators then follow until they are written.
"""

from std.math import log2
from std.memory.alloc import unsafe_alloc
from std.utils.numerics import nan, neg_inf

from ..attention.cpu.key_chunks import CHUNK, BlockPrefetch, RowOffsets
from ..attention.cpu.products import (
    BF16_PAIRS,
    FLOATS,
    padded_dim,
    product_rows,
    score_transposed,
    transpose_chunk,
    widen_values,
)
from ..attention.cpu.scores import scale_scores
from ..attention.cpu.softmax import softmax_tile
from ..attention.custom_mask import CustomMask
from ..attention.params import POS_NONE, AttentionParams
from ..attention.work import AttentionWork
from ..cache.paged_kv_cache import IndexPtr, Ptr
from ..simd.exp2 import is_nan_f32
from ..simd.widen import (
    DOT_BF16,
    F32,
    W,
    from_paired_order,
    kv_load_scale,
    load_f32,
    narrow,
    paired,
    to_paired_order,
)
from .mla_pages import MLAPages, MLAScales

comptime MLA_TASK_ROWS = 64
"""Query rows (token x head) of one CPU task: 128 heads make two tasks a
query, each reading the latent once for all its rows."""


struct MLATaskState(Movable):
    """Per-task scratch on the heap (64 rows of 576 floats would crowd a
    worker's stack): scaled q rows, accumulators, softmax state and positions
    per row, one chunk's scores, K^T and widened V, and the chunk's row
    offsets in both pools."""

    var q: Ptr[F32]
    var acc: Ptr[F32]
    var m: Ptr[F32]
    var l: Ptr[F32]
    var row_pos: Ptr[F32]
    var zeros: Ptr[F32]
    """Per-row ALiBi slopes for `softmax_tile`: MLA has none."""
    var mask_bit: IndexPtr
    var scores: Ptr[F32]
    var kt: Ptr[F32]
    var vw: Ptr[F32]
    var ckv_rows: RowOffsets
    var kpe_rows: RowOffsets
    var _storage: Ptr[F32]

    def __init__(out self, rows: Int, ckv_dim: Int, qk_dim: Int):
        """Scratch for `rows` query rows of ckv_dim and qk_dim elements
        (`padded_dim` widths)."""
        var at = 0

        @always_inline
        def take(mut at: Int, count: Int) -> Int:
            var start = at
            at += (count + W - 1) // W * W
            return start

        var q_at = take(at, rows * qk_dim)
        var acc_at = take(at, rows * ckv_dim)
        var m_at = take(at, rows)
        var l_at = take(at, rows)
        var pos_at = take(at, rows)
        var zeros_at = take(at, rows)
        var mask_at = take(at, rows)
        var scores_at = take(at, rows * CHUNK)
        var kt_at = take(at, qk_dim * CHUNK)
        var vw_at = take(at, CHUNK * ckv_dim)
        var rows_at = take(at, 2 * 2 * CHUNK)  # int64 offsets: two floats each
        self._storage = rebind[Ptr[F32]](
            unsafe_alloc[Float32](at, alignment=64)
        )
        self.q = self._storage.unsafe_offset(q_at)
        self.acc = self._storage.unsafe_offset(acc_at)
        self.m = self._storage.unsafe_offset(m_at)
        self.l = self._storage.unsafe_offset(l_at)
        self.row_pos = self._storage.unsafe_offset(pos_at)
        self.zeros = self._storage.unsafe_offset(zeros_at)
        self.mask_bit = rebind[IndexPtr](self._storage.unsafe_offset(mask_at))
        self.scores = self._storage.unsafe_offset(scores_at)
        self.kt = self._storage.unsafe_offset(kt_at)
        self.vw = self._storage.unsafe_offset(vw_at)
        self.ckv_rows = rebind[RowOffsets](self._storage.unsafe_offset(rows_at))
        self.kpe_rows = self.ckv_rows.unsafe_offset(CHUNK)

    def __deinit__(deinit self):
        self._storage.unsafe_free()


@always_inline
def mla_chunk_rows[
    kv_dtype: DType
](
    pages: MLAPages[kv_dtype],
    b: Int,
    first: Int,
    end: Int,
    ckv_rows: RowOffsets,
    kpe_rows: RowOffsets,
) -> Int:
    """Fills the element offsets of tokens first.. of request b (up to CHUNK,
    stopping at end) in both pools; returns how many."""
    var n = min(CHUNK, end - first)
    for j in range(n):
        var slot = pages.token_slot(b, first + j)
        ckv_rows[unsafe_offset=j] = Int64(slot * pages.ckv_stride)
        kpe_rows[unsafe_offset=j] = Int64(slot * pages.kpe_stride)
    return n


def mla_task[
    q_dtype: DType, kv_dtype: DType
](
    pages: MLAPages[kv_dtype],
    q_nope: Ptr[q_dtype],
    q_pe: Ptr[q_dtype],
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    work: AttentionWork,
    scales: MLAScales,
    num_heads: Int,
    blocks: Int,
    task: Int,
):
    """Rows [block x MLA_TASK_ROWS, + MLA_TASK_ROWS) of work item task //
    blocks, block = task % blocks. An item's rows are its query tokens'
    heads in q's order (token t's head h is row t x num_heads + h), so a
    task's rows are consecutive rows of q and of the output. Writes final
    rows, or the item's partial state where its request's keys are split
    across items (decode)."""
    var item = task // blocks
    var r0 = (task % blocks) * MLA_TASK_ROWS
    var total_rows = work.q_count(item) * num_heads
    if r0 >= total_rows:
        return  # an item with fewer queries than the widest
    var count = min(MLA_TASK_ROWS, total_rows - r0)
    var ckv_dim = pages.ckv_dim
    var kpe_dim = pages.kpe_dim
    # Scratch rows are padded to whole blocks, the padding 0 (q, K^T, V):
    # it adds nothing to scores or outputs.
    var ckv_pad = padded_dim(ckv_dim)
    var kpe_pad = padded_dim(kpe_dim)
    var qk_pad = ckv_pad + kpe_pad
    var b = work.request(item)
    var first_row = work.q_row(item) * num_heads + r0
    var st = MLATaskState(count, ckv_pad, qk_pad)
    # K and V loads return kv_load_scale times the values (simd/widen.mojo).
    var unload = 1 / kv_load_scale[kv_dtype]()
    var nope_scale = scales.nope_log2 * unload
    var pe_scale = scales.pe_log2 * unload
    # bfloat16 q and latent with AVX512_BF16: scores as dot products of the
    # raw pairs (exact products, float32 sums), scaled afterwards, which
    # needs one scale for both parts (ckv and kpe scales are 1 here).
    var dots = score_dots[q_dtype, kv_dtype]() and nope_scale == pe_scale
    for r in range(count):
        var row = first_row + r
        if dots:
            # Raw rows, q_nope then q_pe, two bfloat16 to a float32 slot.
            var raw = rebind[Ptr[q_dtype]](st.q).unsafe_offset(r * qk_pad)
            for c in range(ckv_pad):
                raw[unsafe_offset=c] = q_nope[
                    unsafe_offset=row * ckv_dim + c
                ] if c < ckv_dim else Scalar[q_dtype](0)
            for c in range(kpe_pad):
                raw[unsafe_offset=ckv_pad + c] = q_pe[
                    unsafe_offset=row * kpe_dim + c
                ] if c < kpe_dim else Scalar[q_dtype](0)
        var dst = st.q.unsafe_offset(r * qk_pad)
        var src = q_nope.unsafe_offset(row * ckv_dim)
        for c in range(ckv_pad // W):
            if not dots:
                var x = SIMD[F32, W](0)
                if c < ckv_dim // W:
                    x = load_f32[q_dtype, W](src, c * W) * nope_scale
                dst.unsafe_offset(c * W).unsafe_store(x)
            st.acc.unsafe_offset(r * ckv_pad + c * W).unsafe_store(
                SIMD[F32, W](0)
            )
        if not dots:
            var pe = q_pe.unsafe_offset(row * kpe_dim)
            for c in range(kpe_pad // W):
                var x = SIMD[F32, W](0)
                if c < kpe_dim // W:
                    x = load_f32[q_dtype, W](pe, c * W) * pe_scale
                dst.unsafe_offset(ckv_pad + c * W).unsafe_store(x)
            comptime if paired[kv_dtype]():
                to_paired_order(dst, ckv_pad)
                to_paired_order(dst.unsafe_offset(ckv_pad), kpe_pad)
        st.m[unsafe_offset=r] = neg_inf[F32]()
        st.l[unsafe_offset=r] = 0
        st.row_pos[unsafe_offset=r] = Float32(
            work.q_pos(item) + (r0 + r) // num_heads
        )
        st.zeros[unsafe_offset=r] = 0
        st.mask_bit[unsafe_offset=r] = 0

    var params = AttentionParams(
        sm_scale=1,
        soft_cap=0,
        rope_scale=1,
        rope_theta=1e4,
        qk_scale=1,
        v_scale=1,
        window_left=-1,
        pos_encoding=POS_NONE,
        causal=scales.causal,
    )
    var no_mask = CustomMask(
        rebind[Ptr[DType.uint8]](st.mask_bit), st.mask_bit, False
    )
    # The products issue no prefetches: a chunk's rows are few and adjacent
    # in a page, which the hardware prefetchers stream.
    var quiet = BlockPrefetch[kv_dtype](
        pages.ckv, st.ckv_rows, 0, 0, 1, ckv_dim, ckv_dim, True
    )
    var fetched = 0
    var tok = work.kv_first(item)
    var end = work.kv_end(item)
    while tok < end:
        var n = mla_chunk_rows(pages, b, tok, end, st.ckv_rows, st.kpe_rows)
        if dots:
            comptime if score_dots[q_dtype, kv_dtype]():
                score_latent[kv_dtype, True](pages, st, count, n, quiet)
                scale_scores(st.scores, count, nope_scale)
        else:
            score_latent[kv_dtype, False](pages, st, count, n, quiet)
        softmax_block(ckv_pad, params, no_mask, st, count, n, tok)
        widen_values[kv_dtype](ckv_dim, pages.ckv, st.ckv_rows, n, st.vw)
        for s in range(ckv_pad // (2 * W)):
            product_rows[accumulate=True](
                count,
                n,
                st.scores,
                CHUNK,
                st.vw.unsafe_offset(s * 2 * W),
                ckv_pad,
                st.acc.unsafe_offset(s * 2 * W),
                ckv_pad,
                quiet,
                fetched,
                0,
            )
        tok += n

    var v_scale = scales.v_scale * unload
    var partial = work.writes_partial(b)
    for r in range(count):
        var total = st.l[unsafe_offset=r]
        # l is 0 (no key seen), positive, or NaN (a NaN seen): NaN passes
        # through to o and lse.
        var norm = v_scale / total if total != 0 else Float32(0)
        var state_lse = (
            st.m[unsafe_offset=r] + log2(total) if total
            != 0 else neg_inf[F32]()
        )
        if is_nan_f32(total):
            norm = nan[F32]()
            state_lse = nan[F32]()
        var a = st.acc.unsafe_offset(r * ckv_pad)
        comptime if paired[kv_dtype]():
            from_paired_order(a, ckv_pad)
        if partial:
            # Key-split items hold one query: row r0 + r is head r0 + r.
            var slot = item * num_heads + r0 + r
            var dst = work.partial_o.unsafe_offset(slot * ckv_dim)
            for c in range(ckv_dim // W):
                dst.unsafe_offset(c * W).unsafe_store(
                    a.unsafe_offset(c * W).unsafe_load[width=W]() * norm
                )
            work.partial_lse[unsafe_offset=slot] = state_lse
        else:
            var dst = output.unsafe_offset((first_row + r) * ckv_dim)
            for c in range(ckv_dim // W):
                dst.unsafe_offset(c * W).unsafe_store(
                    narrow[q_dtype](
                        a.unsafe_offset(c * W).unsafe_load[width=W]() * norm
                    )
                )
            lse[unsafe_offset=first_row + r] = state_lse


def score_dots[q_dtype: DType, kv_dtype: DType]() -> Bool:
    """Whether the task may score in AVX512_BF16 dot products: bfloat16 q and
    latent on a target that has them."""
    return DOT_BF16 and q_dtype == DType.bfloat16 and kv_dtype == DType.bfloat16


@always_inline
def score_latent[
    kv_dtype: DType, dots: Bool
](
    pages: MLAPages[kv_dtype],
    st: MLATaskState,
    count: Int,
    n: Int,
    quiet: BlockPrefetch,
):
    """Scores of the chunk's n keys (ckv then kpe, one K^T) for the task's
    count rows: widened, from scaled float32 q rows, or with dots from raw
    bfloat16 q rows (two to a slot) and K^T in pairs, unscaled."""
    var ckv_pad = padded_dim(pages.ckv_dim)
    var qk_pad = ckv_pad + padded_dim(pages.kpe_dim)
    var slots = qk_pad // 2 if dots else qk_pad
    var kpe_at = (ckv_pad // 2 if dots else ckv_pad) * CHUNK
    comptime form = BF16_PAIRS if dots else FLOATS
    transpose_chunk[kv_dtype, form](
        pages.ckv_dim, pages.ckv, st.ckv_rows, n, st.kt
    )
    transpose_chunk[kv_dtype, form](
        pages.kpe_dim, pages.kpe, st.kpe_rows, n, st.kt.unsafe_offset(kpe_at)
    )
    score_transposed[form](
        qk_pad, st.q, slots, count, st.kt, n, st.scores, quiet
    )


@always_inline
def softmax_block(
    ckv_dim: Int,
    params: AttentionParams,
    mask: CustomMask,
    st: MLATaskState,
    count: Int,
    n: Int,
    kv_pos0: Int,
):
    """The online softmax step of one chunk of n keys from kv_pos0 for the
    task's count rows, in tiles of 8, 4, 2 and 1 (as softmax_rows does for
    the attention task's state)."""
    var r = 0
    while r < count:
        var left = count - r
        var taken = False
        comptime for i in range(4):
            comptime tile = 8 >> i
            if not taken and left >= tile:
                softmax_tile[tile](
                    ckv_dim,
                    params,
                    mask,
                    st.scores.unsafe_offset(r * CHUNK),
                    n,
                    kv_pos0,
                    st.row_pos.unsafe_offset(r),
                    st.mask_bit.unsafe_offset(r),
                    st.zeros.unsafe_offset(r),
                    st.m.unsafe_offset(r),
                    st.l.unsafe_offset(r),
                    st.acc.unsafe_offset(r * ckv_dim),
                )
                r += tile
                taken = True
