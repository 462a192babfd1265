"""Running attention's work items on a GPU: a Hopper decode kernel where one
applies (the tensor-core one of tensor_core.mojo or the TMA one of
sm90.mojo), else the generic kernel (generic.mojo), a thread block per
(item, KV head, tile of query rows); then the partial states of key-split
requests merged (called by run_attention, in attention/run.mojo)."""

from max.gpu.host import DeviceContext
from max.gpu.host.info import H100

from ...cache.paged_kv_cache import DYNAMIC, KVLayout, PagedKVCache, Ptr
from ..custom_mask import CustomMask
from ..params import AttentionParams
from ..work import AttentionWork
from .generic import (
    GPU_THREADS,
    attention_gpu_kernel,
    merge_split_gpu_kernel,
    row_tiles,
)
from .sm90 import launch_decode_sm90, tma_decode_applies
from .tensor_core import (
    launch_decode_tensor_core,
    tensor_core_decode_applies,
    tensor_core_dtypes,
)


comptime HEAD_DIMS = (64, 128, 256)
"""Head dims of the GPU kernel (a lane holds head_dim / 32 elements)."""

comptime GPU_KERNEL_GENERIC = 0
comptime GPU_KERNEL_TMA = 1
comptime GPU_KERNEL_AUTO = 2
comptime GPU_KERNEL_MMA = 3
"""Values of int_params[INT_GPU_KERNEL], the GPU decode kernel plan() chose: "tma" must
run the Hopper kernel of sm90.mojo, "mma" its tensor-core form
(tensor_core.mojo), "auto" runs the tensor-core kernel where it applies and
the group reaches MMA_AUTO_MIN_GROUP, else the Hopper kernel where it
applies (an sm_90 GPU, the batch's dtypes and shape), else the generic one."""

comptime MMA_AUTO_MIN_GROUP = 8
"""Query heads per KV head from which "auto" prefers the tensor-core kernel.
There the TMA kernel's CUDA-core q.K and p.V, not HBM, set its pace; below
it both kernels stream the pages at the same rate, and the TMA kernel is
kept (docs/gpu.md has the timings)."""


def run_attention_gpu[
    q_dtype: DType
](
    cache: PagedKVCache,
    q_ptr: Ptr[q_dtype],
    o_ptr: Ptr[q_dtype],
    lse_ptr: Ptr[DType.float32],
    work: AttentionWork,
    params: AttentionParams,
    mask: CustomMask,
    num_qo_heads: Int,
    head_dim: Int,
    batch_size: Int,
    kv_split: Bool,
    any_split: Bool,
    kernel: Int,
    max_rows: Int,
    ctx: DeviceContext,
) raises:
    """The work items on the GPU: kv_split (decode) items on the kernel that
    `kernel` (a GPU_KERNEL_* value) names, the rest (and any batch with a
    custom mask) on the generic one, whose blocks take tiles of at most
    max_rows query tokens' rows; then, where any_split, the partial states of
    key-split requests merged."""
    if Int(cache.k_pages) % 16 != 0 or Int(cache.v_pages) % 16 != 0:
        raise Error(
            "pagedkv: a GPU cache must start on a 16-byte boundary (its"
            " kernels move 16-byte vectors)"
        )
    var group = num_qo_heads // cache.num_kv_heads()
    if kv_split and kernel != GPU_KERNEL_GENERIC and not mask.enabled:
        comptime if (
            ctx.default_device_info.compute == H100.compute
            and cache.layout == KVLayout.NHD
        ):
            var nhd = rebind[PagedKVCache[cache.dtype, KVLayout.NHD]](cache)
            var launched = False
            comptime if tensor_core_dtypes[q_dtype, cache.dtype]():
                var wanted = kernel == GPU_KERNEL_MMA or (
                    kernel == GPU_KERNEL_AUTO and group >= MMA_AUTO_MIN_GROUP
                )
                if wanted and tensor_core_decode_applies[
                    q_dtype, cache.dtype, cache.layout
                ](cache, group, params):
                    launch_decode_tensor_core[q_dtype, cache.dtype](
                        nhd,
                        q_ptr,
                        o_ptr,
                        lse_ptr,
                        work,
                        params,
                        num_qo_heads,
                        ctx,
                    )
                    launched = True
            if kernel == GPU_KERNEL_MMA and not launched:
                raise Error(
                    "pagedkv: the tensor-core decode kernel needs an sm_90"
                    " GPU, an NHD pool of q's dtype (bfloat16 or float16),"
                    " page sizes that are multiples of 16, head_dim 64 or"
                    " 128, at most 16 query heads per KV head and no RoPE on"
                    " the fly"
                )
            if not launched and tma_decode_applies[cache.dtype, cache.layout](
                cache, group, params
            ):
                launch_decode_sm90[q_dtype, cache.dtype](
                    nhd, q_ptr, o_ptr, lse_ptr, work, params, num_qo_heads, ctx
                )
                launched = True
            if launched:
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
        if kernel == GPU_KERNEL_TMA or kernel == GPU_KERNEL_MMA:
            raise Error(
                "pagedkv: the TMA and tensor-core decode kernels need an"
                " sm_90 GPU, an NHD pool, page sizes that are multiples of"
                " 16, a group of at most 8 (TMA) or 16 (tensor cores) query"
                " heads per KV head and no RoPE on the fly"
            )
    # A GPU lane holds head_dim / 32 elements in registers: one kernel
    # per supported head dim.
    var tiles = row_tiles(max_rows * group)
    comptime for i in range(len(HEAD_DIMS)):
        comptime D = HEAD_DIMS[i]
        if head_dim == D:
            var fixed = cache.specialized[DYNAMIC, DYNAMIC, D]()
            ctx.enqueue_function[
                attention_gpu_kernel[q_dtype, cache.dtype, cache.layout, D]
            ](
                fixed,
                q_ptr,
                o_ptr,
                lse_ptr,
                work,
                params,
                mask,
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
