"""Batch decode attention over the paged cache, FlashInfer's wrapper API.

``plan()`` does the per-batch work once: it checks the page table, splits long
requests across cores (flash-decoding), builds the kernel metadata and
compiles the op. ``run()``, called once per layer with that layer's q and
cache, only checks shapes and launches the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from max.dtype import DType

from ._checks import as_int32_index, check_int, checked_scales
from ._ops.kernels import OpSpec
from ._ops.tensors import Array, device_of, dtype_of, new_like
from ._plan.block_tables import check_trtllm_table
from ._plan.io_dtypes import kernel_out, kernel_q_dtype, output_dtype, output_in
from ._plan.one_page import attention_of_nothing, one_page_kv
from ._plan.plan import AttentionPlan, FixedWork, PageTable, attention_spec
from ._plan.work import (
    HOPPER_BACKENDS,
    PLAN_OPTIONS,
    AttentionOptions,
    as_dtype,
    check_heads,
    decode_alibi_lse_shift,
    decode_kernel,
    decode_split_cap,
    decode_work,
    heads_per_task,
)
from ._wrappers import PagedWrapper, fixed_index_buffers, refuse_jit_variants
from .attention_sinks import merge_sinks, sink_log2_lse
from .nvfp4 import attention_cache, plan_kv_dtype
from .prefill import BatchPrefillWithPagedKVCacheWrapper

FIXED_DECODE_BUFFERS = (
    "paged_kv_indptr_buffer",
    "paged_kv_indices_buffer",
    "paged_kv_last_page_len_buffer",
)
"""The constructor's fixed buffers (use_cuda_graph), in page-table order."""


def decode_spec(q_dtype: DType, kv_dtype: DType, layout: int) -> OpSpec:
    """The compiled decode op for these dtypes and layout."""
    return attention_spec(q_dtype, kv_dtype, layout)


def split_chunk(table: PageTable, disable_split_kv: bool, fixed_split_size) -> int | None:
    """Tokens per key split that FlashInfer's split-KV controls ask for: one
    split per request (disable_split_kv), chunks of fixed_split_size pages,
    or None (splits sized to the batch)."""
    if disable_split_kv:
        longest = max(int(table.seq_lens.max(initial=0)), 1)
        return -(-longest // table.page_size) * table.page_size
    if fixed_split_size is not None:
        return check_int("fixed_split_size", fixed_split_size, 1) * table.page_size
    return None


class BatchDecodeWithPagedKVCacheWrapper(PagedWrapper):
    """Decode attention for a batch of requests with one query token each.

    >>> w = BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    >>> w.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16)
    >>> o = w.run(q, paged_kv_cache)              # per layer: q [B, 32, 128]

    backend: "tma" (the Hopper kernel: sm_90, NHD, page sizes a multiple of
    16, at most 8 query heads per KV head, no RoPE on the fly), "mma" (its
    tensor-core form: 16-bit q and cache of one dtype, head dims 64 and 128,
    up to 16 query heads per KV head), "generic" (the kernel for every GPU;
    FlashInfer's "fa2" names it too), or "auto": the tensor-core kernel at 8
    or more query heads per KV head, the Hopper kernel below, each where it
    applies, else the generic one. The CPU ignores it.

    The constructor takes FlashInfer's arguments in FlashInfer's order.
    use_tensor_cores picks a kernel in FlashInfer with the same result; here
    it is kept as the `use_tensor_cores` attribute and changes nothing.
    use_cuda_graph=True takes the three paged_kv_*_buffer arrays (int32, the
    caller's, kept for the wrapper's life): plan() writes each batch's page
    table into them and run() reads it from them alone, so a captured step
    replays with new contents; the batch size is fixed by the buffers
    (pagedkv.fixed_buffers). The work list and scratch are the wrapper's own,
    sized at the first plan and rewritten in place by each plan (at most as
    many key splits per request as fill the device), so a step captured once
    stays right across plans; a plan needing more items (a small
    fixed_split_size) raises. Options and scales are captured with the step.
    jit_args (FlashInfer's JIT variants) must be None.

    Under ALiBi the lse run() returns is FlashInfer's decode kernels' (key j
    biased by slope * j), slope * (L - 1) * log2(e) above the prefill
    wrapper's for the same query (which biases by slope * (j - (L - 1)), as
    FlashInfer's prefill does); o is the same either way.
    """

    def __init__(
        self,
        float_workspace_buffer: Array | None = None,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: Array | None = None,
        paged_kv_indices_buffer: Array | None = None,
        paged_kv_last_page_len_buffer: Array | None = None,
        backend: str = "auto",
        jit_args: object = None,
    ) -> None:
        given = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        fixed = fixed_index_buffers(
            use_cuda_graph,
            dict(zip(FIXED_DECODE_BUFFERS, given, strict=True)),
            ("paged_kv_indptr_buffer", "paged_kv_last_page_len_buffer"),
            "paged_kv_*_buffer",
        )
        refuse_jit_variants(jit_args)
        super().__init__(float_workspace_buffer, kv_layout, backend, fixed)
        decode_kernel(backend, True, kv_layout, None, 1, "NONE")  # validates the name
        self._use_tensor_cores = bool(use_tensor_cores)
        self._multi: BatchPrefillWithPagedKVCacheWrapper | None = None
        """A plan of several queries a request: the prefill wrapper running it."""
        self._frozen_q_len: int | None = None
        """use_cuda_graph: the first plan's q_len_per_req, which later plans keep."""
        self._fixed_work: FixedWork | None = None
        """use_cuda_graph: the work list and scratch every plan writes in place."""

    @property
    def use_tensor_cores(self) -> bool:
        """What the constructor was given (FlashInfer's kernel choice)."""
        return self._use_tensor_cores

    def _plain(self) -> BatchDecodeWithPagedKVCacheWrapper:
        """A wrapper of the same layout and backend without fixed buffers."""
        return BatchDecodeWithPagedKVCacheWrapper(None, self._kv_layout, backend=self._backend)

    def plan(
        self,
        indptr: Array, indices: Array, last_page_len: Array, num_qo_heads: int, num_kv_heads: int,
        head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
        logits_soft_cap: float | None = None, q_data_type: object = None,
        kv_data_type: object = None, o_data_type: object = None, data_type: object = None,
        sm_scale: float | None = None, rope_scale: float | None = None,
        rope_theta: float | None = None, non_blocking: bool = True,
        block_tables: Array | None = None, seq_lens: Array | None = None,
        fixed_split_size: int | None = None, disable_split_kv: bool = False,
        q_len_per_req: int = 1,
        *,
        window_right: int = 0, is_causal: bool | None = None,
    ) -> None:  # fmt: skip
        """Prepares the batch described by the CSR page table.

        Parameters
        ----------
        indptr : [B + 1], indices : [indptr[-1]], last_page_len : [B]
            The page table: int32, or any integer dtype whose values fit int32
            (converted after checking; FlashInfer's helpers give int64).
        q_data_type, kv_data_type
            torch, NumPy or MAX dtypes, or names: fix the dtypes and compile
            now; left None they are taken from the first run(). data_type is
            FlashInfer's deprecated name for kv_data_type. An fp8 query is
            widened to bfloat16 for the kernel (pagedkv._plan.io_dtypes).
        o_data_type
            The output's dtype (None: the query's, as given).
        fixed_split_size, disable_split_kv
            FlashInfer's split-KV controls: chunks of fixed_split_size pages,
            or one chunk per request. Results agree with the default split
            to rounding.
        q_len_per_req
            Query tokens per request (speculative decoding): run() then takes
            q [B * q_len_per_req, Hq, D], each request's tokens attending
            causally to its cache, whose last q_len_per_req tokens are theirs.
        non_blocking
            Accepted and ignored: plan() copies the table to the host anyway.
        block_tables, seq_lens, window_right, is_causal
            trtllm-gen's form of the table ([B, max_pages], [B]: it must name
            the same pages), cute-dsl's window_right (0), fa2's is_causal
            (None or what q_len_per_req implies).

        Options as in FlashInfer; logits_soft_cap None or 0 is off. Integer
        options must fit int32 and float options be finite numbers
        (ValueError otherwise).

        Example
        -------
        >>> w.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16,
        ...        data_type=torch.float16, disable_split_kv=True)
        """
        del non_blocking
        q_kernel = kernel_q_dtype(q_data_type, as_dtype)  # run() widens an fp8 query
        kv_data_type = plan_kv_dtype(  # uint8: NVFP4
            kv_data_type if kv_data_type is not None else data_type, q_kernel
        )
        q_len_per_req = self._check_plan_contract(window_right, q_len_per_req, is_causal)
        self._o_dtype = output_dtype(o_data_type, as_dtype)
        check_trtllm_table(block_tables, seq_lens, page_size, (indptr, indices, last_page_len))
        self._planned = dict(
            indptr=as_int32_index("indptr", indptr),
            indices=as_int32_index("indices", indices),
            last_page_len=as_int32_index("last_page_len", last_page_len),
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            pos_encoding_mode=pos_encoding_mode,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            q_data_type=q_kernel,
            kv_data_type=kv_data_type,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            fixed_split_size=fixed_split_size,
            disable_split_kv=disable_split_kv,
            q_len_per_req=q_len_per_req,
        )
        self._plan = self._multi = None
        if q_len_per_req > 1:
            self._plan_multi_token(self._planned)
        else:
            self._plan_one_token(self._planned)
        self._frozen_q_len = q_len_per_req if self._fixed is not None else None

    def _check_plan_contract(self, window_right, q_len_per_req, is_causal) -> int:
        """Refuses what plan() does not take (cute-dsl's window_right, an
        is_causal other than q_len_per_req's, FlashInfer's contracts for
        several queries per request, kept so that code written here runs
        there); returns q_len_per_req checked."""
        if window_right != 0:
            raise ValueError("window_right != 0 is FlashInfer's cute-dsl input; it must be 0")
        q_len_per_req = check_int("q_len_per_req", q_len_per_req, 1)
        if is_causal is not None and bool(is_causal) != (q_len_per_req > 1):
            raise NotImplementedError(
                "the decode mask follows q_len_per_req (causal when > 1); "
                "an explicit is_causal override is not supported, as in FlashInfer's fa2"
            )
        if q_len_per_req > 1 and not (self._use_tensor_cores or self._backend == "trtllm-gen"):
            raise ValueError(
                "q_len_per_req > 1 needs use_tensor_cores=True (or backend='trtllm-gen'), "
                "as in FlashInfer"
            )
        if q_len_per_req > 1 and self._backend in HOPPER_BACKENDS:
            raise NotImplementedError(
                f"q_len_per_req > 1 runs on the fa2 (generic) backend, not {self._backend!r}"
            )
        frozen = self._frozen_q_len
        if self._fixed is not None and frozen is not None and q_len_per_req != frozen:
            raise ValueError(
                f"q_len_per_req is frozen at {frozen} by the first plan() in "
                f"use_cuda_graph mode, got {q_len_per_req}"
            )
        return q_len_per_req

    def _plan_one_token(self, p: dict) -> None:
        """The plan of one query per request (p: plan()'s arguments, as
        `_planned` keeps them): the checked page table, the work list (split
        as asked), the kernel and its parameters."""
        num_qo_heads, num_kv_heads = check_heads(p["num_qo_heads"], p["num_kv_heads"])
        page_size = check_int("page_size", p["page_size"], 1)
        options = AttentionOptions.of_plan(check_int("head_dim", p["head_dim"], 1), p)
        is_gpu = device_of(p["indptr"]).is_gpu
        group = num_qo_heads // num_kv_heads
        gpu_kernel = decode_kernel(
            self._backend, is_gpu, self._kv_layout, page_size, group, options.pos_encoding_mode
        )
        table = PageTable.checked(p["indptr"], p["indices"], p["last_page_len"], page_size)
        fixed_chunk = split_chunk(table, p["disable_split_kv"], p["fixed_split_size"])
        views = None
        if self._fixed is not None:
            views = self._fixed.write_all(table.indptr, table.indices, table.last_page_len)
        per_task = heads_per_task(num_qo_heads, num_kv_heads)
        split_cap = None
        if self._fixed is not None:
            split_cap = decode_split_cap(
                table.batch_size, num_qo_heads, num_kv_heads, per_task, is_gpu
            )
        items, request_items = decode_work(
            table.seq_lens,
            table.page_size,
            num_qo_heads,
            num_kv_heads,
            per_task,
            options,
            is_gpu,
            fixed_chunk=fixed_chunk,
            max_splits=split_cap if fixed_chunk is None else None,
        )
        fixed_work = None
        if split_cap is not None:
            fixed_work = self._fixed_work_for(table, split_cap, len(items), num_qo_heads, options)
        self._plan = AttentionPlan(
            table,
            items=items,
            request_items=request_items,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            layout=self._layout,
            options=options,
            int_params=options.int_params(
                per_task, causal=True, max_queries=1, kv_split=True, gpu_kernel=gpu_kernel
            ),
            q_rows=table.batch_size,
            q_data_type=p["q_data_type"],
            kv_data_type=p["kv_data_type"],
            workspace=self._workspace,
            lse_shift=(
                decode_alibi_lse_shift(table.seq_lens, num_qo_heads)
                if options.pos_encoding_mode == "ALIBI"
                else None
            ),
            table_views=views,
            fixed_work=fixed_work,
        )

    def _fixed_work_for(
        self, table: PageTable, split_cap: int, items: int, num_qo_heads: int, options
    ) -> FixedWork:
        """The fixed work-list buffers (use_cuda_graph), sized once, at the
        first plan (the captured grid): the split cap bounds every later
        default plan of this batch size."""
        shape = (table.batch_size, num_qo_heads, options.head_dim)
        if self._fixed_work is None or not self._fixed_work.sized_for(*shape):
            capacity = max(table.batch_size * split_cap, items)
            self._fixed_work = FixedWork(
                table.like, table.batch_size, capacity, num_qo_heads, options.head_dim,
                self._workspace,
            )  # fmt: skip
        return self._fixed_work

    def _plan_multi_token(self, p: dict) -> None:
        """q_len_per_req > 1: causal prefill of each request's last q_len
        tokens (with fixed buffers, a prefill wrapper over the same ones);
        p: plan()'s arguments, as `_planned` keeps them."""
        q_len = p["q_len_per_req"]
        batch = int(p["last_page_len"].shape[0])
        qo_indptr = new_like(p["indptr"], np.arange(batch + 1, dtype=np.int32) * q_len)
        csr = (p["indptr"], p["indices"], p["last_page_len"])
        table = PageTable.checked(*csr, p["page_size"])
        short = np.nonzero(table.seq_lens < q_len)[0]
        if len(short):
            b = int(short[0])
            raise ValueError(
                f"q_len_per_req={q_len} leaves an empty KV range: request {b} holds "
                f"{int(table.seq_lens[b])} tokens (its queries must be cached)"
            )
        fixed = () if self._fixed is None else (True, qo_indptr, *self._fixed.buffers.values())
        self._multi = BatchPrefillWithPagedKVCacheWrapper(self._workspace, self._kv_layout, *fixed)
        shape = (p["num_qo_heads"], p["num_kv_heads"], p["head_dim"], p["page_size"])
        options = {name: p[name] for name in (*PLAN_OPTIONS, "q_data_type", "kv_data_type")}
        self._multi.plan(qo_indptr, *csr, *shape, causal=True, **options)

    begin_forward = plan

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
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        q_len_per_req: int | None = None,
        sinks: Array | None = None,
        kv_cache_sf: Array | Sequence[Array] | None = None,
        skip_softmax_threshold_scale_factor: float | None = None,
    ) -> Array | tuple[Array, Array]:
        """Attention of q [B, num_qo_heads, head_dim] over the planned batch.

        paged_kv_cache: [pages, 2, ...page...] or a (k_cache, v_cache) pair, in
        the wrapper's layout. Returns o [B, Hq, D] (the planned o_data_type,
        else q's dtype; an fp8 q is widened for the kernel), and lse [B, Hq]
        (float32, base 2) with return_lse. As in FlashInfer, `out` and `lse`
        (used with return_lse) take the results in place of new arrays: a
        server that keeps them across layers allocates nothing per call. They
        must not overlap q or the cache. window_left and q_len_per_req, if
        given, must be the planned ones; enable_pdl (a CUDA launch detail) is
        ignored. sinks: float [Hq], a logit a head added to each
        softmax's denominator (pagedkv.attention_sinks). kv_cache_sf: an NVFP4 cache's block
        scales (pagedkv.nvfp4, planned with kv_data_type=uint8; k_scale /
        v_scale its global scales). skip_softmax_threshold_scale_factor
        must stay None, except with backend "trtllm-gen" (whose FlashInfer
        kernel takes it): nothing is skipped there, the attention is exact.
        With backend "trtllm-gen", q_len_per_req may differ from the planned
        one, as in FlashInfer (run() then plans again).

        Example
        -------
        >>> o, lse = w.run(q, paged_kv_cache, return_lse=True)
        """
        del enable_pdl
        if self._planned is None:
            raise RuntimeError("run() called before plan()")
        q, o_dtype = self._run_query(
            q, out, {"skip_softmax_threshold_scale_factor": skip_softmax_threshold_scale_factor}
        )
        if kv_cache_sf is not None:
            plan = self._plan if self._multi is None else self._multi._plan
            assert plan is not None
            paged_kv_cache = attention_cache(
                paged_kv_cache, kv_cache_sf, self._kv_layout, q, plan.table
            )
        sink_lse = None
        if sinks is not None:
            sink_lse = sink_log2_lse(sinks, int(self._planned["num_qo_heads"]))
        if (
            self._backend == "trtllm-gen"
            and q_len_per_req is not None
            and q_len_per_req != self._planned["q_len_per_req"]
        ):
            # FlashInfer's trtllm-gen wrapper takes the query length at run
            # time; here it is a plan of its own.
            self.plan(
                **{**self._planned, "q_len_per_req": q_len_per_req}, o_data_type=self._o_dtype
            )
        for name, given in (("window_left", window_left), ("q_len_per_req", q_len_per_req)):
            if given is not None and given != self._planned[name]:
                raise ValueError(f"{name}={given} differs from the planned {self._planned[name]}")
        if self._multi is not None:
            planned = self._planned["q_len_per_req"]
            rows = planned * int(self._planned["last_page_len"].shape[0])
            if int(q.shape[0]) != rows:
                raise ValueError(
                    f"q has {int(q.shape[0])} rows; the plan's batch at q_len_per_req="
                    f"{planned} takes {rows}"
                )
            # The prefill kernel takes q's scale folded into k's (both scale q.k).
            q_scale, k_scale, v_scale = checked_scales(q_scale, k_scale, v_scale)
            qk = None
            if q_scale is not None or k_scale is not None:
                qk = (1.0 if q_scale is None else q_scale) * (1.0 if k_scale is None else k_scale)
            o, lse = self._multi.run(
                q, paged_kv_cache, qk, v_scale, True, out=kernel_out(out, q), lse=lse, sinks=sinks
            )
            o = output_in(o, o_dtype, out)
            return (o, lse) if return_lse else o
        assert self._plan is not None
        o, lse = self._plan.run(
            q, paged_kv_cache, self._kv_layout, q_scale, k_scale, v_scale, kernel_out(out, q),
            lse, return_lse or sink_lse is not None,
        )  # fmt: skip
        if sink_lse is not None:
            merge_sinks(o, lse, sink_lse)
        o = output_in(o, o_dtype, out)
        return (o, lse) if return_lse else o

    def forward(
        self,
        q: Array,
        paged_kv_cache: Array | Sequence[Array],
        pos_encoding_mode: str = "NONE",
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        return_lse: bool = False,
    ) -> Array | tuple[Array, Array]:
        """FlashInfer's deprecated run(): the attention options come with the
        call, as in FlashInfer before plan() took them, and replace the
        planned ones (plan() runs again when they differ)."""
        self._replan_with(
            pos_encoding_mode=pos_encoding_mode,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
        )
        return self.run(q, paged_kv_cache, q_scale, k_scale, v_scale, return_lse)


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """BatchDecodeWithPagedKVCacheWrapper with use_cuda_graph=True: FlashInfer's
    name, in its argument order.

    >>> w = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(None, indptr_buf, indices_buf, last_buf)
    >>> w.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16)  # writes the buffers
    >>> o = w.run(q, paged_kv_cache)  # reads the page table from the buffers
    """

    def __init__(
        self,
        workspace_buffer: Array | None,
        indptr_buffer: Array,
        indices_buffer: Array,
        last_page_len_buffer: Array,
        kv_layout: str = "NHD",
        use_tensor_cores: bool = False,
    ) -> None:
        super().__init__(
            workspace_buffer,
            kv_layout,
            use_cuda_graph=True,
            use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=indptr_buffer,
            paged_kv_indices_buffer=indices_buffer,
            paged_kv_last_page_len_buffer=last_page_len_buffer,
        )


def single_decode_with_kv_cache(
    q: Array,
    k: Array,
    v: Array,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_tensor_cores: bool = False,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    return_lse: bool = False,
) -> Array | tuple[Array, Array]:
    """Decode attention of one request over contiguous K/V, in FlashInfer's
    positional order.

    Parameters
    ----------
    q : [num_qo_heads, head_dim]
    k, v : [L, num_kv_heads, head_dim] (NHD) or [num_kv_heads, L, head_dim] (HND)
    q_scale, k_scale, v_scale
        As in `BatchDecodeWithPagedKVCacheWrapper.run`: q.k scaled by
        q_scale * k_scale, o by v_scale (float8 K/V's calibration).
    use_tensor_cores
        Picks a GPU kernel in FlashInfer, with the same result; ignored.

    Returns
    -------
    o [num_qo_heads, head_dim] (q's dtype), and lse [num_qo_heads] (float32,
    base 2) with return_lse. The K/V are viewed, without a copy, as one page
    of L tokens and run through the batch kernel.

    Example
    -------
    >>> o = single_decode_with_kv_cache(q, k, v, "NHD", "NONE", False, None, None, None, 64)
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
