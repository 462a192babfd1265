"""FlashInfer's ``flashinfer.attention`` wrappers on pagedkv's kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._checks import host_int_array
from ._ops.tensors import Array
from ._plan.workspace import check_prewarm
from .attention_sinks import q_scale_for
from .prefill import BatchPrefillWithPagedKVCacheWrapper


class BatchAttentionWithAttentionSinkWrapper(BatchPrefillWithPagedKVCacheWrapper):
    """Paged prefill or decode with gpt-oss's attention sinks, FlashInfer's
    wrapper: ``run(q, paged_kv_cache, sink, sm_scale)`` takes the sink
    logits [num_qo_heads] (float32) and the softmax scale with each call.

    The constructor takes FlashInfer's arguments; q_data_type,
    kv_data_type, head_dim_qk, head_dim_vo and window_left name the JIT
    variant there and are read from plan() here (plan's window_left
    applies). pos_encoding_mode must be "NONE" and use_fp16_qk_reduction is
    ignored, as in the base wrapper.

    Examples
    --------
    >>> w = BatchAttentionWithAttentionSinkWrapper(workspace, "NHD")
    >>> w.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, 32, 8, 64, 16, causal=True)
    >>> o = w.run(q, paged_kv_cache, sink, 64 ** -0.5)   # sink float32 [32]
    """

    def __init__(
        self,
        float_workspace_buffer: Array | None,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Array | None = None,
        paged_kv_indptr_buf: Array | None = None,
        paged_kv_indices_buf: Array | None = None,
        paged_kv_last_page_len_buf: Array | None = None,
        custom_mask_buf: Array | None = None,
        mask_indptr_buf: Array | None = None,
        backend: str = "auto",
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        q_data_type: Any = None,
        kv_data_type: Any = None,
        head_dim_qk: int = 128,
        head_dim_vo: int = 128,
        window_left: int = -1,
    ) -> None:
        if pos_encoding_mode != "NONE":
            raise ValueError("BatchAttentionWithAttentionSinkWrapper takes pos_encoding_mode NONE")
        super().__init__(
            float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf,
            paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf,
            custom_mask_buf, mask_indptr_buf, backend,
        )  # fmt: skip

    def run(
        self,
        q: Array,
        paged_kv_cache: Array | Sequence[Array],
        sink: Array,
        sm_scale: float,
        *,
        out: Array | None = None,
        lse: Array | None = None,
        return_lse: bool = False,
        enable_pdl: bool | None = None,
    ) -> Array | tuple[Array, Array]:
        """Attention of q [qo_indptr[-1], Hq, D] with the sinks sink [Hq] and
        scores scaled by sm_scale (the plan's scale is replaced, not
        compounded). Returns o, and lse (base 2, counting the sinks) with
        return_lse, as the base wrapper's run()."""
        if self._plan is None:
            raise RuntimeError("run() called before plan()")
        q_scale = q_scale_for(sm_scale, self._plan.options.scale)
        return super().run(
            q, paged_kv_cache, q_scale=q_scale, out=out, lse=lse, return_lse=return_lse,
            enable_pdl=enable_pdl, sinks=sink,
        )  # fmt: skip


class BatchAttention:
    """FlashInfer's holistic attention: one plan() and run() for a batch
    mixing prefill and decode requests, on pagedkv's prefill kernel (which
    already takes any query count a request, one included).

    plan() takes kv_len_arr [B], each request's cached tokens, where the
    other wrappers take the last page's fill. run() returns (o, lse), lse
    [rows, Hq] float32 base 2. device names FlashInfer's workspace device
    and is not read: the arrays given to run() say where it runs.

    Examples
    --------
    >>> w = BatchAttention(kv_layout="NHD")
    >>> w.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, 32, 8, 128, 128, 16, causal=True)
    >>> o, lse = w.run(q, paged_kv_cache)
    """

    def __init__(self, kv_layout: str = "NHD", device: Any = "cuda") -> None:
        del device
        self._wrapper = BatchPrefillWithPagedKVCacheWrapper(None, kv_layout)
        self._logits_soft_cap = 0.0
        self._planned = False

    def plan(
        self,
        qo_indptr: Array,
        kv_indptr: Array,
        kv_indices: Array,
        kv_len_arr: Array,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int,
        page_size: int,
        causal: bool = False,
        sm_scale: float | None = None,
        logits_soft_cap: float | None = None,
        q_data_type: Any = None,
        kv_data_type: Any = None,
        use_profiler: bool = False,
    ) -> None:
        """Prepares the batch: qo_indptr [B + 1], the CSR page table
        kv_indptr [B + 1] / kv_indices, and kv_len_arr [B] (tokens cached
        per request, the queries' own included). use_profiler must be False."""
        if use_profiler:
            raise ValueError("use_profiler is FlashInfer's CUDA profiler; pagedkv has none")
        if head_dim_vo != head_dim_qk:
            raise ValueError("head_dim_vo must equal head_dim_qk")
        last_page_len = last_page_lens(kv_indptr, kv_len_arr, page_size)
        self._planned = False
        self._wrapper.plan(
            qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads,
            head_dim_qk, page_size, causal=causal, sm_scale=sm_scale,
            logits_soft_cap=logits_soft_cap, q_data_type=q_data_type, kv_data_type=kv_data_type,
        )  # fmt: skip
        self._logits_soft_cap = logits_soft_cap or 0.0
        self._planned = True

    def prewarm_paged_kv_stride_variant(self, variant: str = "independent") -> None:
        """Checks the call, as FlashInfer 0.7's (pagedkv._plan.workspace.check_prewarm)."""
        check_prewarm(variant, self._planned)

    def run(
        self,
        q: Array,
        kv_cache: Array | Sequence[Array],
        out: Array | None = None,
        lse: Array | None = None,
        k_scale: Any = None,
        v_scale: Any = None,
        logits_soft_cap: float = 0.0,
        profiler_buffer: Array | None = None,
        kv_cache_sf: Any = None,
    ) -> tuple[Array, Array]:
        """(o, lse) of q [qo_indptr[-1], Hq, D] over the planned batch; out
        and lse, given, take them. A logits_soft_cap here needs one in plan()
        (the planned cap applies)."""
        del profiler_buffer
        if not self._planned:
            raise RuntimeError("run() called before plan()")
        if logits_soft_cap > 0.0 and self._logits_soft_cap <= 0.0:
            raise ValueError("logits_soft_cap used in run() but not given to plan()")
        scales = [None if s is None else float(s) for s in (k_scale, v_scale)]
        return self._wrapper.run(
            q, kv_cache, *scales, True, out=out, lse=lse, kv_cache_sf=kv_cache_sf
        )


def last_page_lens(kv_indptr: Array, kv_len_arr: Array, page_size: int) -> np.ndarray:
    """Each request's last-page fill [B] (int32) from its page count and its
    tokens; a request's tokens must fill its pages but the last, and that one
    at least partly (none when it has no pages)."""
    indptr = host_int_array("kv_indptr", kv_indptr, 1)
    lens = host_int_array("kv_len_arr", kv_len_arr, 1)
    if indptr.shape != (lens.shape[0] + 1,):
        raise ValueError(f"kv_indptr {indptr.shape} must be [len(kv_len_arr) + 1]")
    pages = np.diff(indptr)
    last = lens - np.maximum(pages - 1, 0) * page_size
    fits = np.where(pages > 0, (last >= 1) & (last <= page_size), lens == 0)
    if not fits.all():
        b = int(np.argmin(fits))
        raise ValueError(
            f"request {b}: {int(lens[b])} tokens do not fill {int(pages[b])} pages of {page_size}"
        )
    return last.astype(np.int32)
