"""Batch decode attention over the paged cache, FlashInfer's wrapper API.

``plan()`` does the per-batch work once: it checks the page table, splits long
requests across cores (flash-decoding), builds the kernel metadata and
compiles the op. ``run()``, called once per layer with that layer's q and
cache, only checks shapes and launches the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

from max.dtype import DType

from ._attention import (
    AttentionOptions,
    as_dtype,
    check_heads,
    decode_alibi_lse_shift,
    decode_kernel,
    decode_work,
    heads_per_task,
)
from ._attention_plan import AttentionPlan, PageTable, attention_spec
from ._checks import INT32_MAX, check_int, layout_code, reject_cuda_graph
from ._kernels import OpSpec
from ._one_page import attention_of_nothing, one_page_kv
from ._tensors import Array, device_of, dtype_of


def decode_spec(q_dtype: DType, kv_dtype: DType, layout: int) -> OpSpec:
    """The compiled decode op for these dtypes and layout."""
    return attention_spec("pagedkv_batch_decode", q_dtype, kv_dtype, layout)


class BatchDecodeWithPagedKVCacheWrapper:
    """Decode attention for a batch of requests with one query token each.

    >>> w = BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    >>> w.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16)
    >>> o = w.run(q, paged_kv_cache)              # per layer: q [B, 32, 128]

    backend: "tma" (the Hopper kernel: sm_90, NHD, page sizes a multiple of
    16, at most 8 query heads per KV head, no RoPE on the fly), "generic" (the
    kernel for every GPU; FlashInfer's "fa2" names it too), or "auto": the
    Hopper kernel where it applies, else the generic one. The CPU ignores it.

    use_cuda_graph and use_tensor_cores stand where FlashInfer's do, so that
    code written for FlashInfer builds the wrapper unchanged: pagedkv picks
    its kernel itself (`backend`) and takes use_tensor_cores as a hint it
    does not need; it does not support CUDA-graph capture of run(), and
    use_cuda_graph=True raises.
    """

    def __init__(
        self,
        float_workspace_buffer: Array | None = None,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        *,
        backend: str = "auto",
    ) -> None:
        reject_cuda_graph(use_cuda_graph)
        self._layout = layout_code(kv_layout)
        self._kv_layout = kv_layout
        decode_kernel(backend, True, kv_layout, None, 1, "NONE")  # validates the name
        self._backend = backend
        self._workspace = float_workspace_buffer
        self._plan: AttentionPlan | None = None

    def plan(
        self,
        indptr: Array,
        indices: Array,
        last_page_len: Array,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type: object = None,
        kv_data_type: object = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
    ) -> None:
        """Prepares the batch described by the CSR page table (int32 arrays:
        indptr [B + 1], indices [indptr[-1]], last_page_len [B]).

        q_data_type / kv_data_type (torch, NumPy or MAX dtypes, or names) fix
        the dtypes and compile now; left None they are taken from the first
        run(). Options as in FlashInfer; logits_soft_cap None or 0 is off.
        Integer options must fit int32 and float options be finite numbers
        (ValueError otherwise).

        Under ALiBi the returned lse is FlashInfer's decode kernels' (key j
        biased by slope * j), slope * (L - 1) * log2(e) above the prefill
        wrapper's for the same query (which biases by slope * (j - (L - 1)),
        as FlashInfer's prefill does); o is the same either way.
        """
        num_qo_heads, num_kv_heads = check_heads(num_qo_heads, num_kv_heads)
        page_size = check_int("page_size", page_size, 1)
        options = AttentionOptions(
            head_dim=check_int("head_dim", head_dim, 1),
            pos_encoding_mode=pos_encoding_mode,
            window_left=check_int("window_left", window_left, -1, INT32_MAX - 1),
            # FlashInfer's 0 is off; NaN is truthy and reaches the check.
            logits_soft_cap=logits_soft_cap or None,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
        )
        is_gpu = device_of(indptr).is_gpu
        gpu_kernel = decode_kernel(
            self._backend,
            is_gpu,
            self._kv_layout,
            page_size,
            num_qo_heads // num_kv_heads,
            pos_encoding_mode,
        )
        table = PageTable.checked(indptr, indices, last_page_len, page_size)
        per_task = heads_per_task(num_qo_heads, num_kv_heads)
        items, request_items = decode_work(
            table, num_qo_heads, num_kv_heads, per_task, options, is_gpu
        )
        self._plan = AttentionPlan(
            "pagedkv_batch_decode",
            table,
            items,
            request_items,
            num_qo_heads,
            num_kv_heads,
            self._layout,
            options,
            options.int_params(per_task, causal=True, max_queries=1, gpu_kernel=gpu_kernel),
            table.batch_size,
            None if q_data_type is None else as_dtype(q_data_type, "q_data_type"),
            None if kv_data_type is None else as_dtype(kv_data_type, "kv_data_type"),
            self._workspace,
            lse_shift=(
                decode_alibi_lse_shift(table.seq_lens, num_qo_heads)
                if pos_encoding_mode == "ALIBI"
                else None
            ),
        )

    def run(
        self,
        q: Array,
        paged_kv_cache: Array | Sequence[Array],
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        return_lse: bool = False,
        *,
        out: Array | None = None,
        lse: Array | None = None,
    ) -> Array | tuple[Array, Array]:
        """Attention of q [B, num_qo_heads, head_dim] over the planned batch.

        paged_kv_cache: [pages, 2, ...page...] or a (k_cache, v_cache) pair, in
        the wrapper's layout. Returns o [B, Hq, D] (q's dtype), and lse [B, Hq]
        (float32, base 2) with return_lse. As in FlashInfer, `out` and `lse`
        (used with return_lse) take the results in place of new arrays: a
        server that keeps them across layers allocates nothing per call. They
        must not overlap q or the cache.
        """
        if self._plan is None:
            raise RuntimeError("run() called before plan()")
        o, lse = self._plan.run(
            q, paged_kv_cache, self._kv_layout, q_scale, k_scale, v_scale, out, lse, return_lse
        )
        return (o, lse) if return_lse else o

    forward = run


def single_decode_with_kv_cache(
    q: Array,
    k: Array,
    v: Array,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    return_lse: bool = False,
    *,
    use_tensor_cores: bool = False,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> Array | tuple[Array, Array]:
    """Decode attention of one request over contiguous K/V.

    q: [num_qo_heads, head_dim]; k, v: [L, num_kv_heads, head_dim] (NHD) or
    [num_kv_heads, L, head_dim] (HND). The K/V are viewed, without a copy, as
    one page of L tokens and run through the batch kernel. Returns o
    [num_qo_heads, head_dim], and lse [num_qo_heads] with return_lse.

    The positional order is the one pagedkv has always had. FlashInfer's
    `use_tensor_cores`, `q_scale`, `k_scale` and `v_scale` come before
    `window_left` in its order, so here they are keyword-only: a FlashInfer
    call that names them runs unchanged. The scales mean what they mean in
    `BatchDecodeWithPagedKVCacheWrapper.run` (q.k scaled by q_scale *
    k_scale, o by v_scale: float8 K/V's calibration). use_tensor_cores
    picks a GPU kernel in FlashInfer, with the same result; it changes
    nothing here.
    """
    del use_tensor_cores
    kv = one_page_kv(q, k, v, kv_layout, q_dims=2)
    if kv.length == 0:
        return attention_of_nothing(q, return_lse)
    num_qo_heads, head_dim = q.shape
    # plan() is cheap here: the op is compiled once per process.
    wrapper = BatchDecodeWithPagedKVCacheWrapper(kv_layout=kv_layout)
    wrapper.plan(
        kv.indptr,
        kv.indices,
        kv.last_page_len,
        num_qo_heads,
        kv.num_kv_heads,
        int(head_dim),
        kv.length,
        pos_encoding_mode=pos_encoding_mode,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        q_data_type=dtype_of(q),
        kv_data_type=dtype_of(k),
        sm_scale=sm_scale,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
    )
    out = wrapper.run(
        q[None], kv.cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse
    )
    if return_lse:
        return out[0][0], out[1][0]
    return out[0]
