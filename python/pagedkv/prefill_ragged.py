"""Batch prefill over contiguous ragged K/V: FlashInfer's
BatchPrefillWithRaggedKVCacheWrapper.

Request b's keys and values are rows kv_indptr[b]:kv_indptr[b + 1] of one
K and one V tensor [nnz_kv, Hkv, D]. Seen as a paged cache of one-token
pages (page i is row i), they run through the paged prefill kernel without
a copy: the page table is kv_indptr itself, pages 0..nnz_kv-1 in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._checks import (
    APPROXIMATIONS,
    as_int32_index,
    check_index_array,
    check_plan_size,
    check_scale,
    host_index_copy,
    host_int_array,
    refuse_gpu_only,
    reject_cuda_graph,
)
from ._ops.tensors import Array, check_array, contiguous, new_like, to_host_numpy
from ._plan.io_dtypes import widened_query
from ._plan.work import PREFILL_BACKENDS, RAGGED_ONLY_BACKENDS, check_backend
from ._wrappers import refuse_jit_variants
from .attention_sinks import q_scale_for, sink_variant
from .nvfp4 import dequantize_ragged_for_attention
from .prefill import BatchPrefillWithPagedKVCacheWrapper


class BatchPrefillWithRaggedKVCacheWrapper:
    """Ragged multi-token attention over contiguous K/V.

    >>> w = BatchPrefillWithRaggedKVCacheWrapper(kv_layout="NHD")
    >>> w.plan(qo_indptr, kv_indptr, 32, 8, 128, causal=True)
    >>> o = w.run(q, k, v)     # q [qo_indptr[-1], 32, 128], k, v [kv_indptr[-1], 8, 128]

    The constructor takes FlashInfer's arguments in FlashInfer's order;
    use_cuda_graph=True raises (not supported here) and the *_buf arguments
    must be None. kv_layout "HND" takes k, v as
    [Hkv, nnz_kv, D] and copies them to NHD on each run(). jit_args may name
    FlashInfer's attention-sink variant (pagedkv.attention_sinks.sink_variant),
    whose run(q, k, v, sink, sm_scale) takes the sinks and the softmax scale.
    """

    def __init__(
        self,
        float_workspace_buffer: Array | None = None,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Array | None = None,
        kv_indptr_buf: Array | None = None,
        custom_mask_buf: Array | None = None,
        mask_indptr_buf: Array | None = None,
        backend: str = "auto",
        jit_args: object = None,
        jit_kwargs: object = None,
        variant_owns_mask: bool = False,
    ) -> None:
        refuse_jit_variants(variant_owns_mask=variant_owns_mask)
        reject_cuda_graph(use_cuda_graph, "BatchPrefillWithRaggedKVCacheWrapper")
        if qo_indptr_buf is not None or kv_indptr_buf is not None:
            raise ValueError("qo_indptr_buf and kv_indptr_buf go with use_cuda_graph=True")
        check_backend(backend, PREFILL_BACKENDS + RAGGED_ONLY_BACKENDS)
        self._sink_variant = sink_variant(jit_args, jit_kwargs)
        # The inner wrapper pages the ragged rows as NHD one-token pages.
        self._paged = BatchPrefillWithPagedKVCacheWrapper(
            float_workspace_buffer,
            "NHD",
            custom_mask_buf=custom_mask_buf,
            mask_indptr_buf=mask_indptr_buf,
            backend="auto" if backend in RAGGED_ONLY_BACKENDS else backend,
        )
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        self._kv_layout = kv_layout
        self._nnz_kv: int | None = None

    def plan(
        self,
        qo_indptr: Array,
        kv_indptr: Array,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int | None = None,
        custom_mask: Array | None = None,
        packed_custom_mask: Array | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: object = None,
        kv_data_type: object = None,
        o_data_type: object = None,
        non_blocking: bool = True,
    ) -> None:
        """Prepares the batch: qo_indptr [B + 1] (request b's queries are rows
        qo_indptr[b]:qo_indptr[b + 1] of q) and kv_indptr [B + 1] (its keys
        and values are those rows of k and v). int32, or an integer dtype
        whose values fit (converted).

        As in FlashInfer, query i of a request with n queries and L keys sits
        at position L - n + i: with causal=True it sees keys 0..L - n + i
        (none, o = 0 and lse = -inf, when n > L and i < n - L); without,
        every key.
        Options otherwise as BatchPrefillWithPagedKVCacheWrapper.plan.

        Example
        -------
        >>> w.plan(qo_indptr, kv_indptr, 32, 8, 128, causal=True, q_data_type=torch.float16)
        """
        kv_indptr = as_int32_index("kv_indptr", kv_indptr)
        check_index_array("kv_indptr", kv_indptr)
        if int(kv_indptr.shape[0]) < 1:
            raise ValueError("kv_indptr must have batch_size + 1 >= 1 entries")
        host = host_index_copy("kv_indptr", kv_indptr).astype(np.int64)
        if host[0] != 0 or (np.diff(host) < 0).any():
            raise ValueError("kv_indptr must start at 0 and never decrease")
        nnz = int(host[-1])
        # The one-token page table below, and its copies while planned.
        check_plan_size("the one-token pages of kv_indptr's keys", nnz, 16)
        # One-token pages: request b holds pages kv_indptr[b]..kv_indptr[b+1]-1,
        # all full (a request without keys has a last page of 0 tokens).
        self._paged.plan(
            qo_indptr,
            kv_indptr,
            new_like(kv_indptr, np.arange(nnz, dtype=np.int32)),
            new_like(kv_indptr, (np.diff(host) > 0).astype(np.int32)),
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            1,
            head_dim_vo=head_dim_vo,
            custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask,
            causal=causal,
            pos_encoding_mode=pos_encoding_mode,
            use_fp16_qk_reduction=use_fp16_qk_reduction,
            sm_scale=sm_scale,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            o_data_type=o_data_type,
            non_blocking=non_blocking,
        )
        self._nnz_kv = nnz

    begin_forward = plan

    def end_forward(self) -> None:
        """FlashInfer's deprecated no-op."""

    def run(
        self,
        q: Array,
        k: Array,
        v: Array,
        *variant_args: Any,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: Array | None = None,
        lse: Array | None = None,
        return_lse: bool = False,
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: Array | None = None,
        kv_cache_sf: Sequence[Array] | None = None,
        lse_base: str = "log2",
        lse_layout: str = "NH",
    ) -> Array | tuple[Array, Array]:
        """Attention of q [qo_indptr[-1], Hq, D] over k, v [kv_indptr[-1], Hkv, D]
        (NHD; [Hkv, kv_indptr[-1], D] for HND). For NVFP4 K/V (uint8, D // 2
        per row), kv_cache_sf is their (k_sf, v_sf) block scales
        (pagedkv.nvfp4).

        Returns o (q's shape and dtype), and lse [rows, Hq] (float32, base 2)
        with return_lse; `out` and `lse` take them in place. sinks, lse_base
        and lse_layout as in BatchPrefillWithPagedKVCacheWrapper.run.
        variant_args: with the attention-sink variant's jit_args, its
        (sink [Hq], sm_scale), which replace sinks and the plan's scale.

        Example
        -------
        >>> o, lse = w.run(q, k, v, return_lse=True)
        """
        if self._nnz_kv is None:
            raise RuntimeError("run() called before plan()")
        if variant_args:
            if not self._sink_variant or len(variant_args) != 2:
                raise TypeError(
                    "run() takes q, k, v, and (sink, sm_scale) only with the attention-sink"
                    " variant's jit_args"
                )
            if sinks is not None or q_scale is not None:
                raise ValueError("the sink variant's (sink, sm_scale) replace sinks and q_scale")
            sinks = variant_args[0]
            q_scale = q_scale_for(variant_args[1], self._paged._plan.options.scale)
        if kv_cache_sf is not None:
            k, v = dequantize_ragged_for_attention(k, v, kv_cache_sf, q)
        pages = []
        for name, x in (("k", k), ("v", v)):
            check_array(name, x)
            if len(x.shape) != 3:
                raise ValueError(f"{name} must be 3-D, got shape {tuple(x.shape)}")
            rows = x.shape[0] if self._kv_layout == "NHD" else x.shape[1]
            if rows != self._nnz_kv:
                raise ValueError(f"{name} has {rows} rows but kv_indptr[-1] is {self._nnz_kv}")
            if self._kv_layout == "HND":
                x = x.transpose(1, 0) if hasattr(x, "dim") else x.transpose(1, 0, 2)
            x = contiguous(x)
            pages.append(x.reshape(x.shape[0], 1, *x.shape[1:]))  # one-token pages
        return self._paged.run(
            q,
            tuple(pages),
            k_scale,
            v_scale,
            return_lse,
            q_scale=q_scale,
            out=out,
            lse=lse,
            enable_pdl=enable_pdl,
            window_left=window_left,
            sinks=sinks,
            lse_base=lse_base,
            lse_layout=lse_layout,
        )

    def run_return_lse(self, q: Array, k: Array, v: Array, **kwargs: object) -> tuple[Array, Array]:
        """run(..., return_lse=True): FlashInfer's deprecated name."""
        return self.run(q, k, v, return_lse=True, **kwargs)

    def forward(
        self,
        q: Array,
        k: Array,
        v: Array,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        return_lse: bool = False,
    ) -> Array | tuple[Array, Array]:
        """FlashInfer's deprecated run(): options with the call, replacing the planned ones."""
        del use_fp16_qk_reduction
        self._paged._replan_with(
            causal=causal,
            pos_encoding_mode=pos_encoding_mode,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
        )
        return self.run(q, k, v, return_lse=return_lse)

    def forward_return_lse(self, *args: object, **kwargs: object) -> tuple[Array, Array]:
        """forward(..., return_lse=True): FlashInfer's deprecated name."""
        return self.forward(*args, return_lse=True, **kwargs)


RAGGED_DEEPSEEK_BACKENDS = ("trtllm-gen", "cute-dsl", "trtllm-native")
"""FlashInfer's kernels for trtllm_ragged_attention_deepseek; pagedkv's ragged
prefill plays each."""


def trtllm_ragged_attention_deepseek(
    query: Array,
    key: Array,
    value: Array,
    workspace_buffer: Array | None,
    seq_lens: Array,
    max_q_len: int,
    max_kv_len: int,
    bmm1_scale: Any,
    bmm2_scale: Any,
    o_sf_scale: float,
    batch_size: int,
    window_left: int,
    cum_seq_lens_q: Array,
    cum_seq_lens_kv: Array,
    enable_pdl: bool | None,
    is_causal: bool,
    return_lse: bool,
    attention_sinks: Array | None = None,
    skip_softmax_threshold_scale_factor: float | None = None,
    out: Array | None = None,
    lse: Array | None = None,
    sage_attn_sfs: tuple = (None, None, None, None),
    num_elts_per_sage_attn_blk: tuple = (0, 0, 0, 0),
    backend: str = "trtllm-gen",
    q_seq_lens_cpu: Array | None = None,
    kv_seq_lens_cpu: Array | None = None,
    use_fp16_softmax: bool | None = None,
    uses_spcompress: bool | None = None,
    skip_all_rows_active_check: bool = True,
) -> Any:
    """FlashInfer 0.7.2's ragged prefill of DeepSeek's non-absorbed MLA (or
    any head dims, the value's up to the query's) on the ragged wrapper.

    Request b's queries are rows cum_seq_lens_q[b]:[b + 1] of query [tokens,
    Hq, head_dim_qk], its keys and values rows cum_seq_lens_kv[b]:[b + 1] of
    key [kv_tokens, Hkv, head_dim_qk] and value [kv_tokens, Hkv,
    head_dim_vo]; seq_lens (B values, [B] or FlashInfer's tests' [B, 1, 1,
    1]) must be their counts. bmm1_scale is the
    softmax scale, bmm2_scale the output's factor (numbers or one-element
    tensors); is_causal aligns each request's queries to its last keys.
    attention_sinks are gpt-oss's (pagedkv.attention_sinks);
    skip_softmax_threshold_scale_factor is taken and nothing skipped (exact
    attention). An fp8 query is widened to bfloat16. NVFP4 output
    (o_sf_scale other than -1 or None), SageAttention scales, float16
    softmax and spcompress are refused. max_q_len, max_kv_len, enable_pdl,
    the CPU length mirrors and skip_all_rows_active_check are accepted and
    read no further; workspace_buffer is neither read nor written.

    Returns
    -------
    o [tokens, Hq, head_dim_vo] (out when given), and with return_lse its lse
    [tokens, Hq] float32 base 2 (lse when given, filled either way).

    Examples
    --------
    >>> import torch, pagedkv
    >>> q, k, v = torch.randn(5, 4, 192), torch.randn(9, 4, 192), torch.randn(9, 4, 128)
    >>> o = pagedkv.trtllm_ragged_attention_deepseek(
    ...     q, k, v, None, torch.tensor([4, 5]), 3, 5, 192 ** -0.5, 1.0, -1, 2, -1,
    ...     torch.tensor([0, 2, 5]), torch.tensor([0, 4, 9]), None, True, False)
    >>> o.shape
    torch.Size([5, 4, 128])
    """
    function = "trtllm_ragged_attention_deepseek"
    options = {
        "use_fp16_softmax": bool(use_fp16_softmax),
        "uses_spcompress": bool(uses_spcompress),
        "skip_softmax_threshold_scale_factor": skip_softmax_threshold_scale_factor,
    }
    refuse_gpu_only(function, options, APPROXIMATIONS)
    if o_sf_scale not in (None, -1, -1.0):
        raise ValueError(f"{function}: NVFP4 output (o_sf_scale) is not supported by pagedkv")
    if any(x is not None for x in sage_attn_sfs):
        raise ValueError(f"{function}: SageAttention scales are not supported by pagedkv")
    if backend not in RAGGED_DEEPSEEK_BACKENDS:
        raise ValueError(f"{function}: backend must be one of {RAGGED_DEEPSEEK_BACKENDS}")
    # FlashInfer's tests give seq_lens as [B, 1, 1, 1]: B values in any shape.
    lens = host_int_array("seq_lens", to_host_numpy(seq_lens).reshape(-1), 1)
    kv_indptr = host_int_array("cum_seq_lens_kv", cum_seq_lens_kv, 1)
    if len(lens) != batch_size or not np.array_equal(np.diff(kv_indptr), lens):
        raise ValueError(f"{function}: batch_size and cum_seq_lens_kv must agree with seq_lens")
    scales = [check_scale("bmm1_scale", bmm1_scale, positive=True),
              check_scale("bmm2_scale", bmm2_scale, positive=True)]  # fmt: skip
    query = widened_query(query)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(None, "NHD")
    wrapper.plan(
        cum_seq_lens_q, kv_indptr.astype(np.int32), int(query.shape[1]), int(key.shape[1]),
        int(query.shape[2]), int(value.shape[2]), causal=is_causal, sm_scale=scales[0],
        window_left=window_left, q_data_type=query.dtype, kv_data_type=key.dtype,
    )  # fmt: skip
    o, lse = wrapper.run(
        query, key, value, v_scale=scales[1], out=out, lse=lse, return_lse=True,
        sinks=attention_sinks,
    )  # fmt: skip
    return (o, lse) if return_lse else o
