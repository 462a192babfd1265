"""RoPE and append in one pass: a layer's fused Q|K|V rows in, its keys
rotated and stored with its values in their pages, its rotated queries out.

Row i of qkv [nnz, (Hq + 2 Hkv) D] holds token i's query heads, key heads
and value heads side by side. The token sits at `positions[i]` of request
`batch_indices[i]` (as in append.mojo); its query and key heads are rotated
by rotate-half RoPE at that position,

    x'[j]       = x[j] cos[pos, j] - x[j + D/2] sin[pos, j]
    x'[j + D/2] = x[j + D/2] cos[pos, j] + x[j] sin[pos, j]      j < D/2

with cos and sin [max_positions, D/2] float32 tables, in float32; keys and
values are rounded to the pool's dtype as they are stored (an int8 pool's
rows quantized, with their scales: cache/int8_rows.mojo), queries to
qkv's. The page table and the targets are checked first (append.mojo's
`check_append`), so a bad call raises before anything is written. What a
step graph spent in a dozen split, multiply, concat and cast ops per layer
is one pass over the rows. CPU only.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext

from std.memory.alloc import unsafe_alloc

from ..cache.cache_tensors import cache_from_tensors
from ..cache.int8_rows import store_int8_head
from ..cache.paged_kv_cache import KV, KVLayout, PagedKVCache, Ptr
from ..cache.tensor_access import ptr_of
from ..simd.widen import F32, load_f32, narrow
from ..work_queue import parallel_dynamic, row_block, row_blocks
from .append import check_append

comptime ROWS_PER_TASK = 32
"""Tokens a core takes at a time: a task moves tens of KiB, more than its
dispatch costs."""


@always_inline
def rotate_head[
    src_dtype: DType, dst_dtype: DType
](
    src: Ptr[src_dtype],
    dst: Ptr[dst_dtype],
    cos: Ptr[F32],
    sin: Ptr[F32],
    half: Int,
):
    """Writes the rotation of one head's src [2 * half] into dst."""
    comptime V = 8
    var j = 0
    while j + V <= half:
        var lo = load_f32[src_dtype, V](src, j)
        var hi = load_f32[src_dtype, V](src, j + half)
        var c = cos.unsafe_offset(j).unsafe_load[width=V]()
        var s = sin.unsafe_offset(j).unsafe_load[width=V]()
        dst.unsafe_offset(j).unsafe_store(narrow[dst_dtype, V](lo * c - hi * s))
        dst.unsafe_offset(j + half).unsafe_store(
            narrow[dst_dtype, V](hi * c + lo * s)
        )
        j += V
    while j < half:
        var lo = load_f32[src_dtype, 1](src, j)
        var hi = load_f32[src_dtype, 1](src, j + half)
        var c = cos[unsafe_offset=j]
        var s = sin[unsafe_offset=j]
        dst[unsafe_offset=j] = narrow[dst_dtype, 1](lo * c - hi * s)
        dst[unsafe_offset=j + half] = narrow[dst_dtype, 1](hi * c + lo * s)
        j += 1


@always_inline
def convert_head[
    src_dtype: DType, dst_dtype: DType
](src: Ptr[src_dtype], dst: Ptr[dst_dtype], n: Int):
    """Writes src [n] into dst, rounded to dst's dtype."""
    comptime V = 8
    var j = 0
    while j + V <= n:
        dst.unsafe_offset(j).unsafe_store(
            narrow[dst_dtype, V](load_f32[src_dtype, V](src, j))
        )
        j += V
    while j < n:
        dst[unsafe_offset=j] = narrow[dst_dtype, 1](
            load_f32[src_dtype, 1](src, j)
        )
        j += 1


struct RopeAppendRows[dtype: DType, kv_dtype: DType, layout: KVLayout](
    TrivialRegisterPassable
):
    """The tasks of a rope-and-append phase: blocks of tokens of qkv
    [nnz, (Hq + 2 Hkv) D] rotated into q_out [nnz, Hq, D] and the cache."""

    var cache: PagedKVCache[Self.kv_dtype, Self.layout]
    var qkv: Ptr[Self.dtype]
    var q_out: Ptr[Self.dtype]
    var cos: Ptr[F32]
    var sin: Ptr[F32]
    var batch_indices: Ptr[DType.int32]
    var positions: Ptr[DType.int32]
    var nnz: Int
    var num_qo_heads: Int

    def __init__(
        out self,
        cache: PagedKVCache[Self.kv_dtype, Self.layout],
        qkv: Ptr[Self.dtype],
        q_out: Ptr[Self.dtype],
        cos: Ptr[F32],
        sin: Ptr[F32],
        batch_indices: Ptr[DType.int32],
        positions: Ptr[DType.int32],
        nnz: Int,
        num_qo_heads: Int,
    ):
        self.cache = cache
        self.qkv = qkv
        self.q_out = q_out
        self.cos = cos
        self.sin = sin
        self.batch_indices = batch_indices
        self.positions = positions
        self.nnz = nnz
        self.num_qo_heads = num_qo_heads

    def tasks(self) -> Int:
        return row_blocks(self.nnz, ROWS_PER_TASK)

    def run(self, t: Int):
        var d = self.cache.head_dim()
        var half = d // 2
        var kv_heads = self.cache.num_kv_heads()
        var hq = self.num_qo_heads
        var row = (hq + 2 * kv_heads) * d
        var tokens = row_block(t, self.nnz, ROWS_PER_TASK)
        # One rotated key head in float32, for an int8 pool's rows.
        var head_f32 = rebind[Ptr[F32]](unsafe_alloc[Float32](d))
        for i in range(tokens[0], tokens[1]):
            var b = Int(self.batch_indices[unsafe_offset=i])
            var pos = Int(self.positions[unsafe_offset=i])
            var c = self.cos.unsafe_offset(pos * half)
            var s = self.sin.unsafe_offset(pos * half)
            var src = self.qkv.unsafe_offset(i * row)
            for h in range(hq):
                rotate_head(
                    src.unsafe_offset(h * d),
                    self.q_out.unsafe_offset((i * hq + h) * d),
                    c,
                    s,
                    half,
                )
            var keys = src.unsafe_offset(hq * d)
            var values = keys.unsafe_offset(kv_heads * d)
            for h in range(kv_heads):
                comptime if Self.kv_dtype == DType.int8:
                    # Codes and a scale: the key rotated in float32 first.
                    rotate_head(keys.unsafe_offset(h * d), head_f32, c, s, half)
                    store_int8_head[KV.K](self.cache, head_f32, b, pos, h)
                    store_int8_head[KV.V](
                        self.cache, values.unsafe_offset(h * d), b, pos, h
                    )
                else:
                    rotate_head(
                        keys.unsafe_offset(h * d),
                        self.cache.block_paged_ptr[KV.K](b, pos, h),
                        c,
                        s,
                        half,
                    )
                    convert_head(
                        values.unsafe_offset(h * d),
                        self.cache.block_paged_ptr[KV.V](b, pos, h),
                        d,
                    )
        head_f32.unsafe_free()


def check_rope_append(
    cache: PagedKVCache,
    q_rows: Int,
    q_heads: Int,
    q_dim: Int,
    qkv_rows: Int,
    qkv_width: Int,
    table_rows: Int,
    table_cols: Int,
    positions: Ptr[DType.int32],
    nnz: Int,
) raises:
    """Raises unless qkv, q_out and the tables fit the pool and every
    position has a row in the tables (the page table is append's check)."""
    var d = cache.head_dim()
    if (
        q_rows != nnz
        or q_dim != d
        or qkv_rows != nnz
        or qkv_width != (q_heads + 2 * cache.num_kv_heads()) * d
    ):
        raise Error(
            "pagedkv: rope_append's qkv is not [nnz, (Hq + 2 Hkv) D] for"
            " q_out [nnz, Hq, D] and the pool's heads"
        )
    if d % 2 != 0 or table_cols != d // 2:
        raise Error("pagedkv: rope_append's tables are not [positions, D/2]")
    for i in range(nnz):
        if Int(positions[unsafe_offset=i]) >= table_rows:
            raise Error(
                "pagedkv: position ",
                positions[unsafe_offset=i],
                " is past the RoPE tables' ",
                table_rows,
                " positions",
            )


@extensibility.register("pagedkv_rope_append")
struct RopeAppend:
    """Rotates qkv's queries into q_out [nnz, Hq, D] and appends its rotated
    keys and its values into a pool passed as k_cache, v_cache (see
    cache/cache_tensors.mojo); see the module docstring."""

    @staticmethod
    def execute[
        target: StaticString, layout: Int
    ](
        q_out: OutputTensor[rank=3, ...],
        k_cache: MutableInputTensor[rank=5, ...],
        v_cache: MutableInputTensor[dtype=k_cache.dtype, rank=5, ...],
        qkv: InputTensor[dtype=q_out.dtype, rank=2, ...],
        rope_cos: InputTensor[dtype=DType.float32, rank=2, ...],
        rope_sin: InputTensor[dtype=DType.float32, rank=2, ...],
        batch_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        positions: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("pagedkv: pagedkv_rope_append runs on the CPU")
        var cache = cache_from_tensors[KVLayout(layout)](
            k_cache, v_cache, kv_indices, kv_indptr, kv_last_page_len
        )
        var nnz = batch_indices.dim_size(0)
        if rope_sin.dim_size(0) != rope_cos.dim_size(0) or rope_sin.dim_size(
            1
        ) != rope_cos.dim_size(1):
            raise Error("pagedkv: rope_append's cos and sin differ in shape")
        check_append[target](
            cache,
            batch_indices,
            positions,
            kv_indices,
            kv_indptr,
            kv_last_page_len,
            ctx,
        )
        check_rope_append(
            cache,
            q_out.dim_size(0),
            q_out.dim_size(1),
            q_out.dim_size(2),
            qkv.dim_size(0),
            qkv.dim_size(1),
            rope_cos.dim_size(0),
            rope_cos.dim_size(1),
            ptr_of(positions),
            nnz,
        )
        comptime if target == "cpu":
            var rows = RopeAppendRows[
                qkv.dtype, k_cache.dtype, KVLayout(layout)
            ](
                cache,
                ptr_of(qkv),
                ptr_of(q_out),
                ptr_of(rope_cos),
                ptr_of(rope_sin),
                ptr_of(batch_indices),
                ptr_of(positions),
                nnz,
                q_out.dim_size(1),
            )

            def task(t: Int) {var rows}:
                rows.run(t)

            parallel_dynamic(task, rows.tasks())
