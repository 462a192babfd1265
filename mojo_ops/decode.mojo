"""Batch decode attention over the paged cache: the registered ops.

Each of B requests has one query token with num_qo_heads heads attending to
all K/V cached for it (the new token's K/V already appended). `plan()` in
Python splits long requests into work items (decode_work.mojo); this op runs
the items on all CPU cores or as GPU thread blocks, then merges the split
requests' partial states. Output o [B, Hq, D] in q's dtype and the base-2
log-sum-exp lse [B, Hq].
"""

import extensibility
from extensibility import InputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext

from .attention_params import AttentionParams
from .cache_tensors import cache_from_tensors
from .decode_cpu import MIN_HEAD_DIM, decode_task, merge_split_request
from .decode_gpu import GPU_THREADS, decode_gpu_kernel, group_tiles
from .decode_work import DecodeWork
from .paged_kv_cache import DYNAMIC, KVLayout, PagedKVCache, Ptr
from max.gpu import block_dim, block_idx, thread_idx
from .tensor_access import ptr_of

comptime HEAD_DIMS = (64, 128, 256)

comptime KV_AS_STORED = 0
comptime KV_FP8_E4M3 = 1
comptime KV_FP8_E5M2 = 2


def kv_element_type[storage: DType, kv_format: Int]() -> DType:
    """The element type of a pool passed as `storage`: fp8 pools arrive as
    uint8 (MAX has no fp8 tensors on the CPU) with kv_format naming them."""
    comptime if kv_format == KV_FP8_E4M3:
        return DType.float8_e4m3fn
    elif kv_format == KV_FP8_E5M2:
        return DType.float8_e5m2
    return storage


def read_params(
    float_params: InputTensor[dtype=DType.float32, rank=1, ...],
    int_params: InputTensor[dtype=DType.int32, rank=1, ...],
) -> AttentionParams:
    """AttentionParams from the op's host-side parameter tensors."""
    return AttentionParams(
        sm_scale=float_params[0],
        soft_cap=float_params[1],
        rope_scale=float_params[2],
        rope_theta=float_params[3],
        qk_scale=float_params[4],
        v_scale=float_params[5],
        window_left=Int(int_params[0]),
        pos_encoding=Int(int_params[1]),
    )


def batch_decode[
    target: StaticString
](
    cache: PagedKVCache,
    output: MutableInputTensor[rank=3, ...],
    lse: MutableInputTensor[dtype=DType.float32, rank=2, ...],
    partial_o: MutableInputTensor[dtype=DType.float32, rank=3, ...],
    partial_lse: MutableInputTensor[dtype=DType.float32, rank=2, ...],
    q: InputTensor[dtype=output.dtype, rank=3, ...],
    work_items: InputTensor[dtype=DType.int32, rank=2, ...],
    request_items: InputTensor[dtype=DType.int32, rank=1, ...],
    float_params: InputTensor[dtype=DType.float32, rank=1, ...],
    int_params: InputTensor[dtype=DType.int32, rank=1, ...],
    ctx: DeviceContext,
) raises:
    var params = read_params(float_params, int_params)
    # Every request has at least one work item: more items than requests
    # means some request was split and needs its partial states merged.
    var any_split = work_items.dim_size(0) > q.dim_size(0)
    var num_qo_heads = q.dim_size(1)
    var head_dim = q.dim_size(2)
    var batch_size = q.dim_size(0)
    if head_dim != cache.head_dim() or num_qo_heads % cache.num_kv_heads() != 0:
        raise Error(
            "pagedkv: q [B, ",
            num_qo_heads,
            ", ",
            head_dim,
            "] does not fit a cache of ",
            cache.num_kv_heads(),
            " KV heads of dim ",
            cache.head_dim(),
        )
    var work = DecodeWork(
        ptr_of(work_items),
        work_items.dim_size(0),
        ptr_of(request_items),
        ptr_of(partial_o),
        ptr_of(partial_lse),
    )
    var q_ptr = ptr_of(q)
    var o_ptr = ptr_of(output)
    var lse_ptr = ptr_of(lse)
    comptime if target == "cpu":
        # One compiled kernel for every head dim (a multiple of 64): the
        # vector loops over head_dim run at run time.
        if head_dim % MIN_HEAD_DIM != 0:
            raise Error(
                "pagedkv: head_dim ", head_dim, " is not a multiple of 64"
            )
        var heads_per_task = max(Int(int_params[2]), 1)
        var blocks = (
            cache.num_kv_heads() + heads_per_task - 1
        ) // heads_per_task
        var tasks = work.num_items * blocks
        var dynamic = cache.specialized[DYNAMIC, DYNAMIC, DYNAMIC]()

        def run_task(
            t: Int,
        ) {
            var dynamic,
            var q_ptr,
            var o_ptr,
            var lse_ptr,
            var work,
            var params,
            var num_qo_heads,
            var heads_per_task,
        }:
            decode_task(
                dynamic,
                q_ptr,
                o_ptr,
                lse_ptr,
                work,
                params,
                num_qo_heads,
                heads_per_task,
                t,
            )

        sync_parallelize(run_task, tasks)
        if any_split:

            def merge_task(
                b: Int,
            ) {
                var work, var o_ptr, var lse_ptr, var num_qo_heads, var head_dim
            }:
                merge_split_request(
                    work, o_ptr, lse_ptr, num_qo_heads, head_dim, b, 0, 1
                )

            sync_parallelize(merge_task, batch_size)
        return
    else:
        # A GPU lane holds head_dim / 32 elements in registers: one kernel
        # per supported head dim.
        comptime for i in range(len(HEAD_DIMS)):
            comptime D = HEAD_DIMS[i]
            if head_dim == D:
                var fixed = cache.specialized[DYNAMIC, DYNAMIC, D]()
                var tiles = group_tiles(num_qo_heads // fixed.num_kv_heads())
                ctx.enqueue_function[
                    decode_gpu_kernel[q.dtype, cache.dtype, cache.layout, D]
                ](
                    fixed,
                    q_ptr,
                    o_ptr,
                    lse_ptr,
                    work,
                    params,
                    Int64(num_qo_heads),
                    grid_dim=(work.num_items, fixed.num_kv_heads() * tiles),
                    block_dim=GPU_THREADS,
                )
                if any_split:

                    def merge_kernel(
                        work: DecodeWork,
                        o_ptr: Ptr[q.dtype],
                        lse_ptr: Ptr[DType.float32],
                        num_qo_heads: Int64,
                    ):
                        merge_split_request(
                            work,
                            o_ptr,
                            lse_ptr,
                            Int(num_qo_heads),
                            D,
                            Int(block_idx.x),
                            Int(thread_idx.x),
                            Int(block_dim.x),
                        )

                    ctx.enqueue_function[merge_kernel](
                        work,
                        o_ptr,
                        lse_ptr,
                        Int64(num_qo_heads),
                        grid_dim=batch_size,
                        block_dim=GPU_THREADS,
                    )
                return
    raise Error(
        "pagedkv: head_dim ", head_dim, " is not supported (64, 128 or 256)"
    )


@extensibility.register("pagedkv_batch_decode")
struct BatchDecode:
    """Decode over a pool passed as k_cache, v_cache [pages, kv, ...page...]
    (see cache_tensors.mojo). The pool is declared mutable though only read,
    so that in a graph it is the same buffer value the appends write: MAX
    then orders this op after them and never copies the pool."""

    @staticmethod
    def execute[
        target: StaticString, layout: Int, kv_format: Int
    ](
        output: MutableInputTensor[rank=3, ...],
        lse: MutableInputTensor[dtype=DType.float32, rank=2, ...],
        partial_o: MutableInputTensor[dtype=DType.float32, rank=3, ...],
        partial_lse: MutableInputTensor[dtype=DType.float32, rank=2, ...],
        q: InputTensor[dtype=output.dtype, rank=3, ...],
        k_cache: MutableInputTensor[rank=5, ...],
        v_cache: MutableInputTensor[dtype=k_cache.dtype, rank=5, ...],
        kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_last_page_len: InputTensor[dtype=DType.int32, rank=1, ...],
        work_items: InputTensor[dtype=DType.int32, rank=2, ...],
        request_items: InputTensor[dtype=DType.int32, rank=1, ...],
        float_params: InputTensor[dtype=DType.float32, rank=1, ...],
        int_params: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var cache = cache_from_tensors[KVLayout(layout)](
            k_cache, v_cache, kv_indices, kv_indptr, kv_last_page_len
        ).bitcast[kv_element_type[k_cache.dtype, kv_format]()]()
        batch_decode[target](
            cache,
            output,
            lse,
            partial_o,
            partial_lse,
            q,
            work_items,
            request_items,
            float_params,
            int_params,
            ctx,
        )
