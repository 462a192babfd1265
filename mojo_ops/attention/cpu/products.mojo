"""Prefill on the CPU as small matrix products: a task's many query rows of
one KV head against a chunk of keys.

Decode's steps (scores.mojo, accumulate.mojo) take a dot product per (row, key), lanes
along head_dim, and reduce it across lanes: right for the few rows of a
decode task, which cannot repay a reordering of K. A prefill task holds up
to 64 rows of one KV head (CPU_MAX_TASK_ROWS in _attention.py), all reading
every key of the chunk, so the chunk is reshaped once for them all and both
products run as register-blocked tiles, with no reductions and more
independent FMA chains than decode's steps keep:

- scores[r, j] = q[r] . k[j] multiplies q [rows, head_dim] by K^T
  [head_dim, CHUNK], built per chunk by `transpose_keys`;
- acc[r] += sum_j p[r, j] v[j] multiplies the probabilities [rows, CHUNK] by
  V [CHUNK, head_dim], widened per chunk by `widen_values`.

`product_tile` is the one micro-kernel of both: a tile of `rows` rows by two
vectors, each row's element broadcast against the two vectors of a row of the
right-hand side. With AVX2's 16 vector registers that is 6 rows (12
accumulators, the two right-hand vectors and a broadcast); with 32, 12 rows.
Its step takes one of three forms (`ProductForm`): float32 FMAs, bfloat16
pairs (`dot_bf16`), or int16 pairs (`dot_i16`) for the products of an int8
pool (code_products.mojo).
"""

from std.bit import log2_floor
from std.memory import bitcast, stack_allocation

from ...cache.paged_kv_cache import Ptr
from ...simd.int8_dot import I32, Acc, Halves, dot_i16
from ...simd.widen import (
    BLOCK,
    F32,
    VECTOR_REGISTERS,
    W,
    dot_bf16,
    load_block,
    load_block_tail,
    load_raw_tail,
)
from .key_chunks import CHUNK, BlockPrefetch, RowOffsets

comptime ProductForm = Int
"""What a `product_tile` step multiplies: one of the three forms below."""
comptime FLOATS: ProductForm = 0
"""float32 slots, one FMA per broadcast element and vector."""
comptime BF16_PAIRS: ProductForm = 1
"""Slots of two bfloat16 values, one `dot_bf16` (AVX512_BF16)."""
comptime CODE_PAIRS: ProductForm = 2
"""Slots of two int16 codes, one `dot_i16` into int32 lanes (products of
an int8 pool's codes, code_products.mojo)."""


@always_inline
def slot_elements[form: ProductForm]() -> Int:
    """Elements of the product's depth one float32 slot holds in `form`."""
    comptime if form == BF16_PAIRS or form == CODE_PAIRS:
        return 2
    return 1


comptime PRODUCT_ROWS = 12 if VECTOR_REGISTERS >= 32 else 6
"""Rows of a `product_tile`: two accumulators each, with room left for the
two right-hand vectors and a broadcast."""

comptime PRODUCT_MIN_ROWS = 12
"""The fewest rows of one KV head (query tokens x GQA group) that take the
products: fewer cannot repay the reshaping of K and V (docs/design.md,
"Kernel notes")."""


@always_inline
def code_dot(
    acc: SIMD[F32, W], a: SIMD[F32, W], b: SIMD[F32, W]
) -> SIMD[F32, W]:
    """`dot_i16` on the bits of float32 vectors: acc's int32 lanes plus the
    sums of the products of a's and b's int16 pairs."""
    # W and int8_dot's WI are the same lanes counted in two types.
    var sums = dot_i16(
        rebind[Acc](bitcast[I32, W](acc)),
        rebind[Halves](bitcast[DType.int16, 2 * W](a)),
        rebind[Halves](bitcast[DType.int16, 2 * W](b)),
    )
    return bitcast[F32, W](rebind[SIMD[I32, W]](sums))


@always_inline
def product_tile[
    rows: Int, accumulate: Bool, form: ProductForm = FLOATS
](
    depth: Int,
    a: Ptr[F32],
    a_stride: Int,
    b: Ptr[F32],
    b_stride: Int,
    c: Ptr[F32],
    c_stride: Int,
    code_scales: Optional[Ptr[F32]] = None,
):
    """Computes c[i, :2W] = (c[i, :2W] if accumulate else 0) +
    sum_k a[i, k] * b[k, :2W] for i < rows, k < depth; element (i, k) of a
    at a + i * a_stride + k, and so on.

    In BF16_PAIRS form (AVX512_BF16) every float32 slot of a and b holds a
    pair of bfloat16 values (`transpose_key_words`) and each step is one
    `dot_bf16` of the pairs: depth counts pairs, half the FMAs of widened
    values. In CODE_PAIRS form every slot holds two int16 codes and each
    step is one `dot_i16`, exact while the sums fit int32; c then receives
    the int32 sums (bit for bit in its float32 slots), or, accumulating,
    holds float32 and row i gains code_scales[i] times its sums."""
    var acc = stack_allocation[2 * rows, SIMD[F32, W]]()
    comptime for i in range(rows):
        comptime for h in range(2):
            comptime if accumulate and form != CODE_PAIRS:
                acc[unsafe_offset=2 * i + h] = c.unsafe_offset(
                    i * c_stride + h * W
                ).unsafe_load[width=W]()
            else:
                acc[unsafe_offset=2 * i + h] = 0
    # A while loop, as in the hot loops of scores.mojo and accumulate.mojo.
    var k = 0
    while k < depth:
        var right = b.unsafe_offset(k * b_stride)
        var b0 = right.unsafe_load[width=W]()
        var b1 = right.unsafe_offset(W).unsafe_load[width=W]()
        comptime for i in range(rows):
            var x = SIMD[F32, W](a[unsafe_offset=i * a_stride + k])
            comptime if form == CODE_PAIRS:
                acc[unsafe_offset=2 * i] = code_dot(
                    acc[unsafe_offset=2 * i], x, b0
                )
                acc[unsafe_offset=2 * i + 1] = code_dot(
                    acc[unsafe_offset=2 * i + 1], x, b1
                )
            elif form == BF16_PAIRS:
                comptime BF = DType.bfloat16
                var pairs = bitcast[BF, 2 * W](x)
                acc[unsafe_offset=2 * i] = dot_bf16(
                    acc[unsafe_offset=2 * i], pairs, bitcast[BF, 2 * W](b0)
                )
                acc[unsafe_offset=2 * i + 1] = dot_bf16(
                    acc[unsafe_offset=2 * i + 1],
                    pairs,
                    bitcast[BF, 2 * W](b1),
                )
            else:
                acc[unsafe_offset=2 * i] = x.fma(b0, acc[unsafe_offset=2 * i])
                acc[unsafe_offset=2 * i + 1] = x.fma(
                    b1, acc[unsafe_offset=2 * i + 1]
                )
        k += 1
    comptime if form == CODE_PAIRS and accumulate:
        var scales = code_scales.value()
        comptime for i in range(rows):
            comptime for h in range(2):
                var out = c.unsafe_offset(i * c_stride + h * W)
                var sums = bitcast[I32, W](acc[unsafe_offset=2 * i + h])
                out.unsafe_store(
                    sums.cast[F32]().fma(
                        scales[unsafe_offset=i], out.unsafe_load[width=W]()
                    )
                )
        return
    comptime for i in range(rows):
        comptime for h in range(2):
            c.unsafe_offset(i * c_stride + h * W).unsafe_store(
                acc[unsafe_offset=2 * i + h]
            )


@always_inline
def row_scales(scales: Optional[Ptr[F32]], r: Int) -> Optional[Ptr[F32]]:
    """scales from row r on, where there are any."""
    if scales:
        return scales.value().unsafe_offset(r)
    return None


@always_inline
def product_rows[
    accumulate: Bool, form: ProductForm = FLOATS
](
    count: Int,
    depth: Int,
    a: Ptr[F32],
    a_stride: Int,
    b: Ptr[F32],
    b_stride: Int,
    c: Ptr[F32],
    c_stride: Int,
    prefetcher: BlockPrefetch,
    mut fetched: Int,
    fetch_per_tile: Int,
    code_scales: Optional[Ptr[F32]] = None,
):
    """`product_tile` (in `form`; code_scales row by row) over rows 0..count of a and c, PRODUCT_ROWS at a time
    and the rest in tiles of 8, 4, 2 and 1 rows. Before each tile it asks
    for the next fetch_per_tile rows of the prefetcher's block, from
    `fetched` on, so that the next reads arrive spread over the products."""
    var r = 0
    while r < count:
        var left = count - r
        for _ in range(fetch_per_tile):
            prefetcher.fetch(fetched)
            fetched += 1
        if left >= PRODUCT_ROWS:
            product_tile[PRODUCT_ROWS, accumulate, form](
                depth,
                a.unsafe_offset(r * a_stride),
                a_stride,
                b,
                b_stride,
                c.unsafe_offset(r * c_stride),
                c_stride,
                row_scales(code_scales, r),
            )
            r += PRODUCT_ROWS
            continue
        var taken = False
        comptime for i in range(4):
            comptime rows = 8 >> i
            comptime if rows < PRODUCT_ROWS:
                if not taken and left >= rows:
                    product_tile[rows, accumulate, form](
                        depth,
                        a.unsafe_offset(r * a_stride),
                        a_stride,
                        b,
                        b_stride,
                        c.unsafe_offset(r * c_stride),
                        c_stride,
                        row_scales(code_scales, r),
                    )
                    r += rows
                    taken = True


@always_inline
def fetches_per_tile(prefetcher: BlockPrefetch, passes: Int, count: Int) -> Int:
    """Rows of the prefetcher's block to ask for before each tile of
    `passes` passes of `product_rows` over count rows, so that all are asked
    for (at least count // PRODUCT_ROWS tiles a pass)."""
    var tiles = passes * max(count // PRODUCT_ROWS, 1)
    return (prefetcher.rows_total + tiles - 1) // tiles


@always_inline
def transpose_square(v: Pointer[mut=True, SIMD[F32, W], _]):
    """Transposes the W x W matrix of rows v[0..W) in place: log2(W) rounds
    of interleaving row i with row i + W/2, each of which moves a bit of the
    row index into the lane index."""
    comptime half = W // 2
    var out = stack_allocation[W, SIMD[F32, W]]()
    comptime for _ in range(log2_floor(W)):
        comptime for i in range(half):
            var x = v[unsafe_offset=i]
            var y = v[unsafe_offset=i + half]
            out[unsafe_offset=2 * i] = rebind[SIMD[F32, W]](
                x.slice[half]().interleave(y.slice[half]())
            )
            out[unsafe_offset=2 * i + 1] = rebind[SIMD[F32, W]](
                x.slice[half, offset=half]().interleave(
                    y.slice[half, offset=half]()
                )
            )
        comptime for i in range(W):
            v[unsafe_offset=i] = out[unsafe_offset=i]


@always_inline
def padded_dim(dim: Int) -> Int:
    """dim rounded up to whole BLOCKs: the rows of K^T and the row stride of
    widened V for rows whose length is not a multiple of BLOCK (MLA's latent
    and rope parts); the q and accumulator rows beside them follow it."""
    return (dim + BLOCK - 1) // BLOCK * BLOCK


@always_inline
def key_columns(n: Int) -> Int:
    """Columns of K^T the scores of n keys read: n rounded up to the two
    vectors of a `product_tile`."""
    return (n + 2 * W - 1) // (2 * W) * (2 * W)


def transpose_keys[
    kv_dtype: DType
](head_dim: Int, k: Ptr[kv_dtype], rows: RowOffsets, n: Int, kt: Ptr[F32]):
    """K^T of a chunk: kt[d * CHUNK + j] = element d of key row j (at k +
    rows[j]) as `load_block` widens it, for j < n, and 0 for the rest of
    `key_columns(n)`; rows d from head_dim to `padded_dim(head_dim)` are 0.
    Square W x W pieces go through registers."""
    var lo = stack_allocation[W, SIMD[F32, W]]()
    var hi = stack_allocation[W, SIMD[F32, W]]()
    var j0 = 0
    while j0 < key_columns(n):
        var c = 0
        while c < head_dim:
            var valid = head_dim - c
            comptime for t in range(W):
                var block = SIMD[F32, BLOCK](0)
                if j0 + t < n:
                    var at = Int(rows[unsafe_offset=j0 + t]) + c
                    if valid >= BLOCK:
                        block = load_block[kv_dtype](k, at)
                    else:
                        block = load_block_tail[kv_dtype](k, at, valid)
                lo[unsafe_offset=t] = block.slice[W]()
                hi[unsafe_offset=t] = block.slice[W, offset=W]()
            transpose_square(lo)
            transpose_square(hi)
            comptime for e in range(W):
                kt.unsafe_offset((c + e) * CHUNK + j0).unsafe_store(
                    lo[unsafe_offset=e]
                )
                kt.unsafe_offset((c + W + e) * CHUNK + j0).unsafe_store(
                    hi[unsafe_offset=e]
                )
            c += BLOCK
        j0 += W


def transpose_key_words[
    dtype: DType
](dim: Int, k: Ptr[dtype], rows: RowOffsets, n: Int, kt: Ptr[F32]):
    """K^T of a chunk in pairs of 16-bit values, for `product_tile`'s
    BF16_PAIRS form (bfloat16 K, as it lies in memory) and CODE_PAIRS form
    (int8 codes, sign-extended to int16): the float32 slot kt[p * CHUNK + j]
    holds elements 2p and 2p + 1 of key row j (at k + rows[j]), for j < n,
    and 0 for the rest of `key_columns(n)`; slots from dim / 2 to
    `padded_dim(dim)` / 2 are 0. W x W squares of 32-bit words go through
    registers."""
    comptime assert (
        dtype == DType.bfloat16 or dtype == DType.int8
    ), "pairs of bfloat16 values or of int8 codes"
    comptime span = 2 * W
    var square = stack_allocation[W, SIMD[F32, W]]()
    var j0 = 0
    while j0 < key_columns(n):
        var c = 0
        while c < dim:
            var valid = dim - c
            comptime for t in range(W):
                var raw = SIMD[dtype, span](0)
                if j0 + t < n:
                    var at = Int(rows[unsafe_offset=j0 + t]) + c
                    if valid >= span:
                        raw = k.unsafe_offset(at).unsafe_load[width=span]()
                    else:
                        raw = load_raw_tail[dtype, span](k, at, valid)
                comptime if dtype == DType.int8:
                    square[unsafe_offset=t] = bitcast[F32, W](
                        raw.cast[DType.int16]()
                    )
                else:
                    square[unsafe_offset=t] = bitcast[F32, W](raw)
            transpose_square(square)
            comptime for e in range(W):
                kt.unsafe_offset((c // 2 + e) * CHUNK + j0).unsafe_store(
                    square[unsafe_offset=e]
                )
            c += span
        j0 += W


def widen_values[
    kv_dtype: DType
](head_dim: Int, v: Ptr[kv_dtype], rows: RowOffsets, n: Int, vw: Ptr[F32]):
    """V of a chunk as float32 rows `padded_dim(head_dim)` apart: vw[j *
    stride + d] = element d of value row j (at v + rows[j]) as `load_block`
    widens it, for j < n, and 0 for d from head_dim to the stride."""
    var stride = padded_dim(head_dim)
    for j in range(n):
        var row = Int(rows[unsafe_offset=j])
        var c = 0
        while c < head_dim:
            var block: SIMD[F32, BLOCK]
            if head_dim - c >= BLOCK:
                block = load_block[kv_dtype](v, row + c)
            else:
                block = load_block_tail[kv_dtype](v, row + c, head_dim - c)
            vw.unsafe_offset(j * stride + c).unsafe_store(block)
            c += BLOCK


def transpose_chunk[
    kv_dtype: DType, form: ProductForm
](dim: Int, k: Ptr[kv_dtype], rows: RowOffsets, n: Int, kt: Ptr[F32]):
    """K^T of a chunk as `score_transposed[form]` reads it: widened to
    float32 (FLOATS: `transpose_keys`, dim x CHUNK slots), or in pairs
    (BF16_PAIRS, bfloat16 K, or CODE_PAIRS, int8 K: `transpose_key_words`,
    dim / 2 x CHUNK)."""
    comptime if form == FLOATS:
        transpose_keys[kv_dtype](dim, k, rows, n, kt)
    else:
        transpose_key_words[kv_dtype](dim, k, rows, n, kt)


def score_transposed[
    form: ProductForm
](
    dim: Int,
    q: Ptr[F32],
    q_stride: Int,
    count: Int,
    kt: Ptr[F32],
    n: Int,
    scores: Ptr[F32],
    prefetcher: BlockPrefetch,
):
    """Computes scores[r * CHUNK + j] = q[r] . key j for the rows r < count
    (q rows q_stride slots apart, dim elements each) and the keys of K^T kt
    (`transpose_chunk[form]`), up to `key_columns(n)`. In BF16_PAIRS form q
    rows hold raw bfloat16, two to a slot, and the products are `dot_bf16`s
    of pairs; in CODE_PAIRS form they hold int16 codes, two to a slot, and
    the scores are int32 sums against K's codes (code_products.mojo).
    Meanwhile asks for the prefetcher's block."""
    var depth = dim // slot_elements[form]()
    var passes = key_columns(n) // (2 * W)
    var per_tile = fetches_per_tile(prefetcher, passes, count)
    var fetched = 0
    for p in range(passes):
        product_rows[accumulate=False, form=form](
            count,
            depth,
            q,
            q_stride,
            kt.unsafe_offset(p * 2 * W),
            CHUNK,
            scores.unsafe_offset(p * 2 * W),
            CHUNK,
            prefetcher,
            fetched,
            per_tile,
        )


def score_chunk[
    kv_dtype: DType, dots: Bool = False
](
    head_dim: Int,
    q: Ptr[F32],
    count: Int,
    k: Ptr[kv_dtype],
    rows: RowOffsets,
    n: Int,
    kt: Ptr[F32],
    scores: Ptr[F32],
    prefetcher: BlockPrefetch,
):
    """Computes scores[r * CHUNK + j] = q[r] . k[row j] for the rows r <
    count of one KV head (q [count, head_dim], in the order `load_block`
    widens K) and keys j < n; scores of keys from n to `key_columns(n)` are
    0. kt: scratch of head_dim x CHUNK. Meanwhile asks for the prefetcher's
    block. With `dots` (bfloat16 K, see `raw_bf16_q`) q rows hold the raw
    bfloat16 query, two to a float32 slot (row stride still head_dim
    slots)."""
    comptime form = BF16_PAIRS if dots else FLOATS
    transpose_chunk[kv_dtype, form](head_dim, k, rows, n, kt)
    score_transposed[form](
        head_dim, q, head_dim, count, kt, n, scores, prefetcher
    )


def accumulate_chunk[
    kv_dtype: DType
](
    head_dim: Int,
    probs: Ptr[F32],
    count: Int,
    v: Ptr[kv_dtype],
    rows: RowOffsets,
    n: Int,
    vw: Ptr[F32],
    acc: Ptr[F32],
    prefetcher: BlockPrefetch,
):
    """Adds sum_j probs[r * CHUNK + j] * v[row j] over keys j < n to acc[r]
    for the rows r < count of one KV head (acc [count, head_dim], in the order
    `load_block` widens V). vw: scratch of CHUNK x head_dim. Meanwhile asks
    for the prefetcher's block."""
    widen_values[kv_dtype](head_dim, v, rows, n, vw)
    var slices = head_dim // (2 * W)
    var per_tile = fetches_per_tile(prefetcher, slices, count)
    var fetched = 0
    for s in range(slices):
        product_rows[accumulate=True](
            count,
            n,
            probs,
            CHUNK,
            vw.unsafe_offset(s * 2 * W),
            head_dim,
            acc.unsafe_offset(s * 2 * W),
            head_dim,
            prefetcher,
            fetched,
            per_tile,
        )
