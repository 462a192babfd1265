"""Running paged attention (decode or prefill) on the CPU or a GPU.

`plan()` in Python turns a batch into work items (work.mojo); the
registered op (batch_attention.mojo) reads its tensors and calls
`run_attention`, which checks them and hands the items to the CPU
(cpu/dispatch.mojo: all cores) or the GPU (gpu/dispatch.mojo: thread
blocks); each then merges the states of key-split requests.
"""

from extensibility import InputTensor, ManagedTensorSlice
from max.gpu.host import DeviceContext

from ..cache.paged_kv_cache import PagedKVCache
from ..cache.tensor_access import ptr_of
from .cpu.dispatch import run_attention_cpu
from .custom_mask import CustomMask
from .gpu.dispatch import run_attention_gpu
from .params import (
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
from .work import AttentionWork


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
    params.mojo)."""
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
    mask: CustomMask,
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
        run_attention_cpu(
            cache,
            q_ptr,
            o_ptr,
            lse_ptr,
            work,
            params,
            num_qo_heads,
            head_dim,
            batch_size,
            any_split,
            max(Int(int_params[INT_HEADS_PER_TASK]), 1),
            mask,
        )
    elif cache.dtype == DType.int8:
        raise Error("pagedkv: int8 pools are read on the CPU")
    else:
        run_attention_gpu(
            cache,
            q_ptr,
            o_ptr,
            lse_ptr,
            work,
            params,
            mask,
            num_qo_heads,
            head_dim,
            batch_size,
            kv_split,
            any_split,
            Int(int_params[INT_GPU_KERNEL]),
            Int(int_params[INT_MAX_ROWS]),
            ctx,
        )
