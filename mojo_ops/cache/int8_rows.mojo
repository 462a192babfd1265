"""Int8 K/V pages: each (token, head) row of an int8 pool is head_dim
signed codes with a float32 scale s, value[i] ~ s * code[i]. A page's K
half (and its V half) holds its rows as a float pool's page does, [P, H, D]
(NHD) or [H, P, D] (HND), and then their scales, [P, H] or [H, P] float32
(`PagedKVCache.row_scales`): P * H * (D + 4) bytes, which is why an int8
pool's last axis is D + 4 wide.

A row is quantized as the quantized products' activations are
(quantized/activations.mojo, llama.cpp's Q8_0): s = max |x| / 127 and
code = round(x / s), ties to even, so every code is in [-127, 127]; a row
of zeros has s = 0 and codes 0. One scale per row keeps a row at head_dim
+ 4 bytes (53% of float16's at head_dim 64); attention applies it once per
token and head, to the score q . k before the softmax and to the token's
probability before it weights V. Rows stay as aligned as a float pool's,
and a chunk's scales lie together in a few cache lines of each page.
"""

from std.sys import llvm_intrinsic

from ..simd.widen import load_f32
from .paged_kv_cache import KV, PagedKVCache, Ptr

comptime I8 = DType.int8
comptime F32 = DType.float32
comptime QUANT_WIDTH = 8
"""Lanes quantized together."""


@always_inline
def store_int8_row[
    src_dtype: DType
](src: Ptr[src_dtype], codes: Ptr[I8], scale: Ptr[F32], head_dim: Int):
    """Quantizes the float row src [head_dim] into codes [head_dim] and
    scale[0] (see the module docstring)."""
    comptime V = QUANT_WIDTH
    var amax_v = SIMD[F32, V](0)
    var amax = Float32(0)
    var j = 0
    while j + V <= head_dim:
        amax_v = max(amax_v, abs(load_f32[src_dtype, V](src, j)))
        j += V
    while j < head_dim:
        amax = max(amax, abs(load_f32[src_dtype, 1](src, j)[0]))
        j += 1
    amax = max(amax, amax_v.reduce_max())
    var inverse = Float32(127) / amax if amax > 0 else Float32(0)
    j = 0
    while j + V <= head_dim:
        var code = llvm_intrinsic["llvm.roundeven", SIMD[F32, V]](
            load_f32[src_dtype, V](src, j) * inverse
        )
        codes.unsafe_offset(j).unsafe_store(code.cast[DType.int32]().cast[I8]())
        j += V
    while j < head_dim:
        var code = llvm_intrinsic["llvm.roundeven", SIMD[F32, 1]](
            load_f32[src_dtype, 1](src, j) * inverse
        )
        codes[unsafe_offset=j] = code.cast[DType.int32]().cast[I8]()
        j += 1
    scale[unsafe_offset=0] = amax / 127


@always_inline
def store_int8_head[
    kv: KV, src_dtype: DType
](cache: PagedKVCache, src: Ptr[src_dtype], b: Int, pos: Int, head: Int):
    """Quantizes src [head_dim] into the K (or V) row of `head` at position
    pos of request b in an int8 pool, with its scale."""
    var t = pos % cache.page_size()
    store_int8_row(
        src,
        rebind[Ptr[I8]](cache.block_paged_ptr[kv](b, pos, head)),
        cache.row_scales[kv](cache.page_id(b, pos)).unsafe_offset(
            cache.scale_index(t, head)
        ),
        cache.head_dim(),
    )


@always_inline
def load_int8_head[
    kv: KV
](cache: PagedKVCache, dst: Ptr[F32], b: Int, pos: Int, head: Int):
    """Writes the values [head_dim] of the K (or V) row of `head` at
    position pos of request b in an int8 pool into dst: code * scale."""
    var t = pos % cache.page_size()
    var codes = rebind[Ptr[I8]](cache.block_paged_ptr[kv](b, pos, head))
    var scale = cache.row_scales[kv](cache.page_id(b, pos))[
        unsafe_offset=cache.scale_index(t, head)
    ]
    for j in range(cache.head_dim()):
        dst[unsafe_offset=j] = codes[unsafe_offset=j].cast[F32]() * scale
