"""FlashInfer's ``flashinfer.attention`` wrappers on pagedkv's kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._checks import check_float
from ._ops.tensors import Array
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
        check_float("sm_scale", sm_scale, positive=True)
        # The kernel multiplies q.k by the plan's scale and by q_scale: the
        # ratio makes the product sm_scale's.
        q_scale = sm_scale / self._plan.options.scale
        return super().run(
            q, paged_kv_cache, q_scale=q_scale, out=out, lse=lse, return_lse=return_lse,
            enable_pdl=enable_pdl, sinks=sink,
        )  # fmt: skip
