"""MLA attention over the paged latent cache (DeepSeek's absorbed form): the
registered op, decode and prefill, CPU and GPU.

Every query head attends over the one shared latent: for query row (token
t, head h) and key j,

    s = (q_nope[t, h] . ckv[j] * ckv_scale + q_pe[t, h] . kpe[j] * kpe_scale) * sm_scale
    o[t, h] = ckv_scale * sum_j softmax(s)_j ckv[j]          (ckv_dim wide)

with the base-2 log-sum-exp of s (times log2(e)) in lse. Query i of a
request of n queries and L keys sits at position L - n + i; causal
attention lets it see keys up to there. The work items are attention's
(attention/work.mojo) over one "KV head": decode items (one query) may split
a request's keys, merged afterwards by the split-K merge of the other
decode kernels; prefill items are tiles of a request's queries.
"""

import extensibility
from extensibility import InputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext
from max.algorithm import sync_parallelize

from ..attention.cpu.dispatch import merge_split_head
from ..attention.run import kv_element_type
from ..attention.work import AttentionWork
from ..cache.paged_kv_cache import Ptr
from ..cache.tensor_access import ptr_of
from ..simd.widen import F32
from ..work_queue import parallel_dynamic
from .cpu_task import MLA_TASK_ROWS, mla_task
from .gpu_kernel import (
    MLA_GPU_MAX_CKV,
    MLA_GPU_MAX_QK,
    MLA_GPU_ROWS,
    MLA_GPU_THREADS,
    mla_gpu_kernel,
    mla_merge_gpu_kernel,
)
from .mla_pages import (
    F_MLA_CKV_SCALE,
    F_MLA_KPE_SCALE,
    F_MLA_SM_SCALE,
    INT_MLA_CAUSAL,
    INT_MLA_KV_SPLIT,
    INT_MLA_MAX_QUERIES,
    MLAPages,
    MLAScales,
)

comptime MLA_DIM_GRANULE = 16
"""The granule of ckv_dim and kpe_dim on the CPU (kpe_dim may be 0): whole
float32 vectors on every CPU; the task pads its scratch rows to whole
widening blocks (`padded_dim`)."""

comptime MLA_GPU_DIM_GRANULE = 64
"""The granule of ckv_dim and kpe_dim on a GPU."""


@extensibility.register("pagedkv_mla_attention")
struct MLAAttention:
    """MLA attention of q_nope [rows, H, ckv_dim] and q_pe [rows, H,
    kpe_dim] over ckv_cache [pages, page_size, >= ckv_dim] and kpe_cache
    [pages, page_size, >= kpe_dim] into output [rows, H, ckv_dim] and lse
    [rows, H]. q's widths are the dims; a cache's last dim is its row
    stride: ckv is the first ckv_dim elements of each ckv_cache row, kpe
    the last kpe_dim of each kpe_cache row, so FlashInfer's packed cache
    [pages, page_size, ckv_dim + kpe_dim] is read in place as both. The
    caches are declared mutable though only read, so that in a graph they
    are the buffer values the MLA append writes (ordered after it, never
    copied)."""

    @staticmethod
    def execute[
        target: StaticString, kv_format: Int
    ](
        output: MutableInputTensor[rank=3, ...],
        lse: MutableInputTensor[dtype=DType.float32, rank=2, ...],
        partial_o: MutableInputTensor[dtype=DType.float32, rank=3, ...],
        partial_lse: MutableInputTensor[dtype=DType.float32, rank=2, ...],
        q_nope: InputTensor[dtype=output.dtype, rank=3, ...],
        q_pe: InputTensor[dtype=output.dtype, rank=3, ...],
        ckv_cache: MutableInputTensor[rank=3, ...],
        kpe_cache: MutableInputTensor[dtype=ckv_cache.dtype, rank=3, ...],
        kv_indices: InputTensor[dtype=DType.int32, rank=1, ...],
        kv_indptr: InputTensor[dtype=DType.int32, rank=1, ...],
        work_items: InputTensor[dtype=DType.int32, rank=2, ...],
        request_items: InputTensor[dtype=DType.int32, rank=1, ...],
        float_params: InputTensor[dtype=DType.float32, rank=1, ...],
        int_params: InputTensor[dtype=DType.int32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime kv_dtype = kv_element_type[ckv_cache.dtype, kv_format]()
        var heads = q_nope.dim_size(1)
        var ckv_dim = q_nope.dim_size(2)
        var kpe_dim = q_pe.dim_size(2)
        var ckv_stride = ckv_cache.dim_size(2)
        var kpe_stride = kpe_cache.dim_size(2)
        if (
            ckv_stride < ckv_dim
            or kpe_stride < kpe_dim
            or output.dim_size(2) != ckv_dim
            or q_pe.dim_size(0) != q_nope.dim_size(0)
            or q_pe.dim_size(1) != heads
            or kpe_cache.dim_size(1) != ckv_cache.dim_size(1)
        ):
            raise Error(
                "pagedkv: q_nope, q_pe, ckv_cache and kpe_cache disagree on",
                " their dims",
            )
        if (
            ckv_dim == 0
            or ckv_dim % MLA_DIM_GRANULE != 0
            or kpe_dim % MLA_DIM_GRANULE != 0
        ):
            raise Error(
                "pagedkv: MLA dims must be multiples of ",
                MLA_DIM_GRANULE,
                ", got ckv ",
                ckv_dim,
                " and kpe ",
                kpe_dim,
            )
        var pages = MLAPages[kv_dtype](
            rebind[Ptr[kv_dtype]](ptr_of(ckv_cache)),
            rebind[Ptr[kv_dtype]](ptr_of(kpe_cache)).unsafe_offset(
                kpe_stride - kpe_dim
            ),
            ptr_of(kv_indices),
            ptr_of(kv_indptr),
            ckv_cache.dim_size(1),
            ckv_dim,
            kpe_dim,
            ckv_stride,
            kpe_stride,
        )
        var scales = MLAScales(
            float_params[F_MLA_SM_SCALE],
            float_params[F_MLA_CKV_SCALE],
            float_params[F_MLA_KPE_SCALE],
            Int(int_params[INT_MLA_CAUSAL]) != 0,
        )
        var kv_split = Int(int_params[INT_MLA_KV_SPLIT]) != 0
        var max_rows = max(Int(int_params[INT_MLA_MAX_QUERIES]), 1) * heads
        var work = AttentionWork(
            ptr_of(work_items),
            work_items.dim_size(0),
            ptr_of(request_items),
            ptr_of(partial_o),
            ptr_of(partial_lse),
            kv_split,
        )
        var batch_size = request_items.dim_size(0) - 1
        # A request with more items than one has split keys (decode).
        var any_split = kv_split and work.num_items > batch_size
        if work.num_items == 0 or heads == 0:
            return
        var q_ptr = ptr_of(q_nope)
        var pe_ptr = ptr_of(q_pe)
        var o_ptr = ptr_of(output)
        var lse_ptr = ptr_of(lse)
        comptime if target == "cpu":
            var blocks = (max_rows + MLA_TASK_ROWS - 1) // MLA_TASK_ROWS

            def run_task(
                t: Int,
            ) {
                var pages,
                var q_ptr,
                var pe_ptr,
                var o_ptr,
                var lse_ptr,
                var work,
                var scales,
                var heads,
                var blocks,
            }:
                mla_task(
                    pages,
                    q_ptr,
                    pe_ptr,
                    o_ptr,
                    lse_ptr,
                    work,
                    scales,
                    heads,
                    blocks,
                    t,
                )

            parallel_dynamic(run_task, work.num_items * blocks)
            if any_split:

                def merge_task(
                    b: Int,
                ) {var work, var o_ptr, var lse_ptr, var heads, var ckv_dim}:
                    for h in range(heads):
                        merge_split_head(
                            work, o_ptr, lse_ptr, heads, ckv_dim, b, h, 0, 1
                        )

                sync_parallelize(merge_task, batch_size)
        else:
            if (
                ckv_dim > MLA_GPU_MAX_CKV
                or ckv_dim + kpe_dim > MLA_GPU_MAX_QK
                or ckv_dim % MLA_GPU_DIM_GRANULE != 0
                or kpe_dim % MLA_GPU_DIM_GRANULE != 0
            ):
                raise Error(
                    "pagedkv: on a GPU MLA takes ckv_dim up to ",
                    MLA_GPU_MAX_CKV,
                    " and ckv_dim + kpe_dim up to ",
                    MLA_GPU_MAX_QK,
                    ", multiples of ",
                    MLA_GPU_DIM_GRANULE,
                )
            var blocks = (max_rows + MLA_GPU_ROWS - 1) // MLA_GPU_ROWS
            ctx.enqueue_function[mla_gpu_kernel[output.dtype, kv_dtype]](
                pages,
                q_ptr,
                pe_ptr,
                o_ptr,
                lse_ptr,
                work,
                scales,
                Int64(heads),
                grid_dim=(work.num_items, blocks),
                block_dim=MLA_GPU_THREADS,
            )
            if any_split:
                ctx.enqueue_function[mla_merge_gpu_kernel[output.dtype]](
                    work,
                    o_ptr,
                    lse_ptr,
                    Int64(heads),
                    Int64(ckv_dim),
                    grid_dim=batch_size * heads,
                    block_dim=MLA_GPU_THREADS,
                )
