"""Running paged attention (decode or prefill) on the CPU or a GPU.

`plan()` in Python turns a batch into work items (attention_work.mojo); the
registered op (batch_attention.mojo) reads its tensors and calls
`run_attention`, which runs the items on all CPU cores or as GPU thread
blocks, then merges the states of key-split requests.
"""

from extensibility import InputTensor, ManagedTensorSlice
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext
from max.gpu.host.info import H100

from .attention_cpu import MIN_HEAD_DIM, attention_task, merge_split_head
from .attention_gpu import (
    GPU_THREADS,
    attention_gpu_kernel,
    merge_split_gpu_kernel,
    row_tiles,
)
from .attention_params import (
    F_QK_SCALE,
    F_ROPE_SCALE,
    F_ROPE_THETA,
    F_SM_SCALE,
    F_SOFT_CAP,
    F_V_SCALE,
    INT_CAUSAL,
    INT_GPU_KERNEL,
    INT_HEADS_PER_TASK,
    INT_MAX_ROWS,
    INT_POS_ENCODING,
    INT_WINDOW_LEFT,
    AttentionParams,
)
from .attention_work import AttentionWork
from .decode_sm90 import launch_decode_sm90, tma_decode_applies
from .paged_kv_cache import DYNAMIC, KVLayout, PagedKVCache, Ptr
from .tensor_access import ptr_of
from .work_queue import parallel_dynamic

comptime HEAD_DIMS = (64, 128, 256)
"""Head dims of the GPU kernel (a lane holds head_dim / 32 elements)."""

comptime GPU_KERNEL_GENERIC = 0
comptime GPU_KERNEL_TMA = 1
comptime GPU_KERNEL_AUTO = 2
"""Values of int_params[INT_GPU_KERNEL], the GPU decode kernel plan() chose: "tma" must
run the Hopper kernel of decode_sm90.mojo, "auto" runs it where it applies
(an sm_90 GPU, the batch's dtypes and shape) and the generic one elsewhere."""

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
    """AttentionParams from the op's host-side parameter tensors (layout in
    attention_params.mojo)."""
    return AttentionParams(
        sm_scale=float_params[F_SM_SCALE],
        soft_cap=float_params[F_SOFT_CAP],
        rope_scale=float_params[F_ROPE_SCALE],
        rope_theta=float_params[F_ROPE_THETA],
        qk_scale=float_params[F_QK_SCALE],
        v_scale=float_params[F_V_SCALE],
        window_left=Int(int_params[INT_WINDOW_LEFT]),
        pos_encoding=Int(int_params[INT_POS_ENCODING]),
        causal=Int(int_params[INT_CAUSAL]) != 0,
    )


def run_attention[
    target: StaticString
](
    cache: PagedKVCache,
    output: ManagedTensorSlice[rank=3, ...],
    lse: ManagedTensorSlice[dtype=DType.float32, rank=2, ...],
    partial_o: ManagedTensorSlice[dtype=DType.float32, rank=3, ...],
    partial_lse: ManagedTensorSlice[dtype=DType.float32, rank=2, ...],
    q: ManagedTensorSlice[dtype=output.dtype, rank=3, ...],
    work_items: InputTensor[dtype=DType.int32, rank=2, ...],
    request_items: InputTensor[dtype=DType.int32, rank=1, ...],
    float_params: InputTensor[dtype=DType.float32, rank=1, ...],
    int_params: InputTensor[dtype=DType.int32, rank=1, ...],
    kv_split: Bool,
    ctx: DeviceContext,
) raises:
    """Attention of q [rows, Hq, D] over the cache, item by item, into
    output [rows, Hq, D] and lse [rows, Hq]."""
    var params = read_params(float_params, int_params)
    var num_qo_heads = q.dim_size(1)
    var head_dim = q.dim_size(2)
    var batch_size = request_items.dim_size(0) - 1
    if head_dim != cache.head_dim() or num_qo_heads % cache.num_kv_heads() != 0:
        raise Error(
            "pagedkv: q [rows, ",
            num_qo_heads,
            ", ",
            head_dim,
            "] does not fit a cache of ",
            cache.num_kv_heads(),
            " KV heads of dim ",
            cache.head_dim(),
        )
    var work = AttentionWork(
        ptr_of(work_items),
        work_items.dim_size(0),
        ptr_of(request_items),
        ptr_of(partial_o),
        ptr_of(partial_lse),
        kv_split,
    )
    # A request with more items than one has split keys, whose partial
    # states need merging (decode); prefill items split queries.
    var any_split = kv_split and work.num_items > batch_size
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
        var heads_per_task = max(Int(int_params[INT_HEADS_PER_TASK]), 1)
        var blocks = (
            cache.num_kv_heads() + heads_per_task - 1
        ) // heads_per_task
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
            attention_task(
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

        parallel_dynamic(run_task, work.num_items * blocks)
        if any_split:
            # A task per request: a batch of one merges inline, on the
            # calling thread (spreading its heads over the cores costs more
            # in wake-ups than the merge itself).
            def merge_task(
                b: Int,
            ) {
                var work, var o_ptr, var lse_ptr, var num_qo_heads, var head_dim
            }:
                for qo in range(num_qo_heads):
                    merge_split_head(
                        work,
                        o_ptr,
                        lse_ptr,
                        num_qo_heads,
                        head_dim,
                        b,
                        qo,
                        0,
                        1,
                    )

            sync_parallelize(merge_task, batch_size)
        return
    else:
        if Int(cache.k_pages) % 16 != 0 or Int(cache.v_pages) % 16 != 0:
            raise Error(
                "pagedkv: a GPU cache must start on a 16-byte boundary (its"
                " kernels move 16-byte vectors)"
            )
        var group = num_qo_heads // cache.num_kv_heads()
        var kernel = Int(int_params[INT_GPU_KERNEL])
        if kv_split and kernel != GPU_KERNEL_GENERIC:
            comptime if (
                ctx.default_device_info.compute == H100.compute
                and cache.layout == KVLayout.NHD
            ):
                if tma_decode_applies[cache.dtype, cache.layout](
                    cache, group, params
                ):
                    launch_decode_sm90[q.dtype, cache.dtype](
                        rebind[PagedKVCache[cache.dtype, KVLayout.NHD]](cache),
                        q_ptr,
                        o_ptr,
                        lse_ptr,
                        work,
                        params,
                        num_qo_heads,
                        ctx,
                    )
                    if any_split:
                        enqueue_merge(
                            work,
                            o_ptr,
                            lse_ptr,
                            num_qo_heads,
                            head_dim,
                            batch_size,
                            ctx,
                        )
                    return
            if kernel == GPU_KERNEL_TMA:
                raise Error(
                    "pagedkv: the TMA decode kernel needs an sm_90 GPU, an NHD"
                    " pool, page sizes that are multiples of 16, a group of"
                    " at most 8 query heads per KV head and no RoPE on the fly"
                )
        # A GPU lane holds head_dim / 32 elements in registers: one kernel
        # per supported head dim.
        var tiles = row_tiles(Int(int_params[INT_MAX_ROWS]) * group)
        comptime for i in range(len(HEAD_DIMS)):
            comptime D = HEAD_DIMS[i]
            if head_dim == D:
                var fixed = cache.specialized[DYNAMIC, DYNAMIC, D]()
                ctx.enqueue_function[
                    attention_gpu_kernel[q.dtype, cache.dtype, cache.layout, D]
                ](
                    fixed,
                    q_ptr,
                    o_ptr,
                    lse_ptr,
                    work,
                    params,
                    Int64(num_qo_heads),
                    Int64(tiles),
                    grid_dim=(work.num_items, fixed.num_kv_heads() * tiles),
                    block_dim=GPU_THREADS,
                )
                if any_split:
                    enqueue_merge(
                        work,
                        o_ptr,
                        lse_ptr,
                        num_qo_heads,
                        head_dim,
                        batch_size,
                        ctx,
                    )
                return
        raise unsupported_gpu_head_dim(head_dim)


def enqueue_merge[
    dtype: DType
](
    work: AttentionWork,
    o_ptr: Ptr[dtype],
    lse_ptr: Ptr[DType.float32],
    num_qo_heads: Int,
    head_dim: Int,
    batch_size: Int,
    ctx: DeviceContext,
) raises:
    """Merges the partial states of key-split requests on the GPU: a block per
    (request, query head)."""
    comptime for i in range(len(HEAD_DIMS)):
        comptime D = HEAD_DIMS[i]
        if head_dim == D:
            ctx.enqueue_function[merge_split_gpu_kernel[dtype, D]](
                work,
                o_ptr,
                lse_ptr,
                Int64(num_qo_heads),
                grid_dim=batch_size * num_qo_heads,
                block_dim=GPU_THREADS,
            )
            return
    raise unsupported_gpu_head_dim(head_dim)


def unsupported_gpu_head_dim(head_dim: Int) -> Error:
    """The error for a head dim outside HEAD_DIMS on a GPU."""
    return Error(
        "pagedkv: head_dim ",
        head_dim,
        " is not supported on GPUs (64, 128, 256)",
    )
