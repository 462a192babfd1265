"""MLA (multi-head latent attention, DeepSeek-V2/V3) over the paged latent cache.

Mirrors ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` in its absorbed form:
W_UK is folded into the query (``q_nope`` lives in the latent space, ckv_dim
wide) and W_UV into the output projection, so every query head attends over
one shared latent per token, the caches ``append_paged_mla_kv_cache`` writes:
ckv [pages, page_size, ckv_dim] and kpe [pages, page_size, kpe_dim].

For query row (token t, head h) and cached token j::

    s = (q_nope[t, h] . ckv[j] + q_pe[t, h] . kpe[j]) * sm_scale
    o[t, h] = sum_j softmax(s)_j ckv[j]                       # [ckv_dim]
    lse[t, h] = log2(sum_j 2^(s_j log2 e))                    # base 2

Query i of a request with n queries and L cached tokens sits at position
L - n + i; causal attention sees keys up to there. fp8 caches carry
per-tensor scales (``ckv_scale``, ``kpe_scale``: real = stored * scale).
FlashInfer 0.7.2's packed cache [pages, page_size, ckv_dim + kpe_dim] (or
the halves of one) is read where it lies (pagedkv.mla_inputs).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from max.dtype import DType

from ._checks import (
    as_int32_index,
    check_float,
    check_index_array,
    check_int,
    check_output,
    host_index_copy,
)
from ._ops.contract import (
    F_MLA_CKV_SCALE,
    F_MLA_KPE_SCALE,
    F_MLA_SM_SCALE,
    FP8_FORMATS,
    INT_MLA_CAUSAL,
    INT_MLA_KV_SPLIT,
    INT_MLA_MAX_QUERIES,
    MIN_HEAD_DIM,
    MLA_DIM_GRANULE,
    MLA_FLOAT_PARAMS,
    MLA_GPU_DIM_GRANULE,
    MLA_GPU_MAX_CKV,
    MLA_GPU_MAX_QK,
    MLA_INT_PARAMS,
    MLA_OP,
    mla_operands,
)
from ._ops.kernels import Operand, OpSpec, compiled_op, run_model
from ._ops.tensors import (
    Array,
    Device,
    check_array,
    contiguous,
    device_of,
    dtype_of,
    empty,
    empty_like,
    new_like,
    storage_dtype,
    storage_view,
    to_buffer,
)
from ._plan.plan import (
    F32,
    FP8_DTYPES,
    Q_DTYPES,
    _workspace_view,
    output_operands,
    plan_operands,
)
from ._plan.work import AttentionOptions, as_dtype, check_backend, decode_work, prefill_work
from .attention_sinks import merge_sinks, sink_log2_lse
from .fixed_buffers import FixedIndexBuffers
from .mla_inputs import (
    MLAPlanMetadata,
    MLARunContract,
    cache_operands,
    split_parts,
    structural_input,
)

__all__ = ["BatchMLAPagedAttentionWrapper", "MLAPlanMetadata"]

MLA_BACKENDS = ("auto", "fa2")
"""One MLA kernel per device: FlashInfer's "auto" and "fa2" name it."""

MLA_MAX_CKV_DIM = 1024
"""The largest ckv_dim the CPU kernel takes (its scratch grows with it)."""


def mla_spec(q_dtype: DType, kv_dtype: DType) -> OpSpec:
    """The MLA op's operands (see MLA_OPERANDS) for q and cache dtypes: the
    outputs and plan's operands as the batch attention op's (`output_operands`,
    `plan_operands`); fp8 caches enter as uint8 with kv_format naming them."""
    cache = Operand(storage_dtype(kv_dtype), 3, mutable=True)
    return OpSpec.of(
        MLA_OP,
        mla_operands(
            **output_operands(q_dtype),
            q_nope=Operand(q_dtype, 3),
            q_pe=Operand(q_dtype, 3),
            ckv_cache=cache,
            kpe_cache=cache,
            **plan_operands(),
        ),
        kv_format=FP8_FORMATS.get(kv_dtype, 0),
    )


def check_mla_dtypes(q_dtype: DType, kv_dtype: DType) -> None:
    """Raises TypeError unless the kernels take this pair: q float32, float16
    or bfloat16; the caches q's dtype, or fp8 beside a 16-bit q."""
    if q_dtype not in Q_DTYPES:
        raise TypeError(f"q dtype must be float32, float16 or bfloat16, got {q_dtype.name}")
    if kv_dtype in FP8_DTYPES:
        if q_dtype == DType.float32:
            raise TypeError("an fp8 MLA cache needs a 16-bit q (float16 or bfloat16)")
    elif kv_dtype != q_dtype:
        raise TypeError(
            f"the MLA caches must be q's dtype ({q_dtype.name}) or fp8, got {kv_dtype.name}"
        )


def check_mla_dims(head_dim_ckv: int, head_dim_kpe: int, is_gpu: bool) -> tuple[int, int]:
    """Raises unless the kernels take these latent dims; returns them as ints."""
    ckv = check_int("head_dim_ckv", head_dim_ckv, 1)
    kpe = check_int("head_dim_kpe", head_dim_kpe, 0)
    if ckv % MLA_DIM_GRANULE or kpe % MLA_DIM_GRANULE or ckv > MLA_MAX_CKV_DIM:
        raise ValueError(
            f"head_dim_ckv and head_dim_kpe must be multiples of {MLA_DIM_GRANULE}"
            f" (head_dim_ckv up to {MLA_MAX_CKV_DIM}, head_dim_kpe may be 0),"
            f" got {ckv} and {kpe}"
        )
    gpu_granule = ckv % MLA_GPU_DIM_GRANULE or kpe % MLA_GPU_DIM_GRANULE
    if is_gpu and (ckv > MLA_GPU_MAX_CKV or ckv + kpe > MLA_GPU_MAX_QK or gpu_granule):
        raise ValueError(
            f"on a GPU head_dim_ckv is at most {MLA_GPU_MAX_CKV} and head_dim_ckv +"
            f" head_dim_kpe at most {MLA_GPU_MAX_QK}, both multiples of"
            f" {MLA_GPU_DIM_GRANULE}, got {ckv} and {kpe}"
        )
    return ckv, kpe


def mla_work(
    qo_indptr: np.ndarray,
    kv_lens: np.ndarray,
    page_size: int,
    num_heads: int,
    causal: bool,
    is_gpu: bool,
    decode: bool | None = None,
) -> tuple[np.ndarray, np.ndarray, bool, int]:
    """Work items of an MLA call (host NumPy): (items [I, 6], request_items
    [B + 1], whether they split keys (decode), most queries in an item).

    MLA is attention with one KV head of num_heads query heads. A batch of
    one query per request is a decode: each request's keys may split into
    page-aligned chunks (flash-decoding), merged afterwards. Otherwise
    (decode=False, or any request with other than one query) items are tiles
    of a request's queries with all the keys they see.
    """
    qo_lens = np.diff(qo_indptr.astype(np.int64))
    is_decode = bool(len(qo_lens)) and bool((qo_lens == 1).all()) if decode is None else decode
    # Only window_left of the options matters to the work split: MLA has none.
    options = AttentionOptions(MIN_HEAD_DIM)
    if is_decode:
        if not (qo_lens == 1).all():
            raise ValueError("a decode has one query per request (qo_indptr = 0, 1, .., B)")
        items, request_items = decode_work(kv_lens, page_size, num_heads, 1, 1, options, is_gpu)
        return items, request_items, True, 1
    items, request_items, most = prefill_work(
        kv_lens, qo_indptr, num_heads, options, causal, is_gpu
    )
    return items, request_items, False, most


def mla_int_params(causal: bool, kv_split: bool, max_queries: int) -> np.ndarray:
    """The MLA op's int_params (slots named in _op_contract)."""
    params = np.zeros(MLA_INT_PARAMS, np.int32)
    params[INT_MLA_CAUSAL] = causal
    params[INT_MLA_KV_SPLIT] = kv_split
    params[INT_MLA_MAX_QUERIES] = max_queries
    return params


def mla_float_params(sm_scale: float, ckv_scale: float, kpe_scale: float) -> np.ndarray:
    """The MLA op's float_params (slots named in _op_contract)."""
    params = np.zeros(MLA_FLOAT_PARAMS, np.float32)
    params[F_MLA_SM_SCALE] = sm_scale
    params[F_MLA_CKV_SCALE] = ckv_scale
    params[F_MLA_KPE_SCALE] = kpe_scale
    return params


def _host_index(name: str, x: Array, length: int | None = None) -> np.ndarray:
    x = as_int32_index(name, x)
    check_index_array(name, x, length)
    return host_index_copy(name, x)


def _checked_table(qo_indptr, kv_indptr, kv_indices, kv_len_arr, page_size: int):
    """The plan's page table on the host, checked: (qo_indptr [B + 1],
    kv_indptr [B + 1], kv_indices, kv_len_arr [B], the page ids the
    requests use); ValueError names what is wrong."""
    kv_lens = _host_index("kv_len_arr", kv_len_arr)
    batch = len(kv_lens)
    qo = _host_index("qo_indptr", qo_indptr, batch + 1)
    # As in FlashInfer, kv_indptr's first B + 1 entries are the table.
    kv_ptr = _host_index("kv_indptr", kv_indptr)
    if len(kv_ptr) < batch + 1:
        raise ValueError(
            f"kv_indptr must have at least {batch + 1} entries (kv_len_arr has {batch}),"
            f" got {len(kv_ptr)}"
        )
    kv_ptr = kv_ptr[: batch + 1]
    indices = _host_index("kv_indices", kv_indices)
    for name, ptr in (("qo_indptr", qo), ("kv_indptr", kv_ptr)):
        if ptr[0] != 0 or (np.diff(ptr) < 0).any():
            raise ValueError(f"{name} must start at 0 and never decrease")
    if kv_ptr[-1] > len(indices):
        raise ValueError(
            f"kv_indptr ends at {kv_ptr[-1]} but kv_indices has {len(indices)} entries"
        )
    if (kv_lens < 0).any():
        raise ValueError("kv_len_arr must not be negative")
    pages = np.diff(kv_ptr.astype(np.int64))
    need = -(-kv_lens.astype(np.int64) // page_size)
    short = np.flatnonzero(need > pages)
    if len(short):
        b = int(short[0])
        raise ValueError(
            f"request {b} caches {kv_lens[b]} tokens, {need[b]} pages of {page_size},"
            f" but kv_indptr gives it {pages[b]}"
        )
    used = np.concatenate(
        [indices[s : s + n] for s, n in zip(kv_ptr[:-1], need, strict=True)] + [[]]
    ).astype(np.int64)
    if (used < 0).any():
        raise ValueError("kv_indices holds a negative page id")
    return qo, kv_ptr, indices, kv_lens, used


def _cache_scales(kv_dtype, ckv_scale, kpe_scale) -> tuple[float | None, float | None]:
    """The caches' per-tensor scales: required (finite, positive) with fp8
    caches, refused otherwise."""
    if kv_dtype in FP8_DTYPES:
        if ckv_scale is None or kpe_scale is None:
            raise ValueError("fp8 MLA caches need ckv_scale and kpe_scale")
        ckv_scale = check_float("ckv_scale", ckv_scale, positive=True)
        kpe_scale = check_float("kpe_scale", kpe_scale, positive=True)
    elif ckv_scale is not None or kpe_scale is not None:
        raise ValueError("ckv_scale and kpe_scale are only valid with fp8 caches")
    return ckv_scale, kpe_scale


class BatchMLAPagedAttentionWrapper:
    """MLA attention over the paged latent cache: decode and ragged prefill.

    FlashInfer's ``flashinfer.mla.BatchMLAPagedAttentionWrapper``: plan()
    once per batch (it checks the page table and splits the work), then
    run() once per layer. On a CPU the kernel takes each chunk of keys as two
    register-blocked matrix products for all of a request's heads; on a GPU a
    CUDA-core kernel runs it (no tensor cores yet).

    Parameters
    ----------
    float_workspace_buffer : numpy.ndarray or torch.Tensor
        Scratch for the split-K partial states (any dtype; used when large
        enough, else plan() allocates). Its device is where run() runs.
    use_cuda_graph : bool, optional
        With the four buffers below: each plan() writes its batch's index
        arrays into them and run() reads the page table from them, so a
        captured step replays with the last plan's table
        (pagedkv.fixed_buffers). The batch size is fixed by the buffers.
    qo_indptr, kv_indptr, kv_indices, kv_len_arr : int32 arrays, optional
        FlashInfer's fixed buffers for use_cuda_graph (kv_indices a
        capacity, the others [B + 1] or [B]).
    backend : {"auto", "fa2"}
        The one kernel of each device.

    Examples
    --------
    >>> import numpy as np, pagedkv
    >>> rng = np.random.default_rng(0)
    >>> heads, page_size = 16, 16
    >>> ckv = rng.standard_normal((4, page_size, 512), dtype=np.float32)
    >>> kpe = rng.standard_normal((4, page_size, 64), dtype=np.float32)
    >>> mla = pagedkv.BatchMLAPagedAttentionWrapper(np.empty(1 << 20, np.uint8))
    >>> mla.plan(
    ...     np.array([0, 1, 2], np.int32),      # qo_indptr: one query each (decode)
    ...     np.array([0, 3, 4], np.int32),      # kv_indptr: pages 0-2, then page 3
    ...     np.array([0, 1, 2, 3], np.int32),   # kv_indices
    ...     np.array([40, 7], np.int32),        # kv_len_arr: tokens cached per request
    ...     heads, 512, 64, page_size, False, 1 / np.sqrt(192), np.float32, np.float32,
    ... )
    >>> q_nope = rng.standard_normal((2, heads, 512), dtype=np.float32)
    >>> q_pe = rng.standard_normal((2, heads, 64), dtype=np.float32)
    >>> o, lse = mla.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    >>> o.shape, lse.shape
    ((2, 16, 512), (2, 16))
    """

    def __init__(
        self,
        float_workspace_buffer: Array,
        use_cuda_graph: bool = False,
        qo_indptr: Array | None = None,
        kv_indptr: Array | None = None,
        kv_indices: Array | None = None,
        kv_len_arr: Array | None = None,
        backend: str = "auto",
    ) -> None:
        check_array("float_workspace_buffer", float_workspace_buffer)
        check_backend(backend, MLA_BACKENDS)
        self._workspace = float_workspace_buffer
        self.device: Device = device_of(float_workspace_buffer)
        self._fixed: FixedIndexBuffers | None = None
        if use_cuda_graph:
            self._fixed = FixedIndexBuffers(
                {
                    "qo_indptr": qo_indptr,
                    "kv_indptr": kv_indptr,
                    "kv_indices": kv_indices,
                    "kv_len_arr": kv_len_arr,
                },
                exact=("qo_indptr", "kv_indptr", "kv_len_arr"),
            )
            if device_of(kv_indptr) != self.device:
                raise ValueError("the fixed index buffers must be on the workspace's device")
        self._planned = False

    def plan(
        self,
        qo_indptr: Array | None = None, kv_indptr: Array | None = None,
        kv_indices: Array | None = None, kv_len_arr: Array | None = None,
        num_heads: int | None = None, head_dim_ckv: int | None = None,
        head_dim_kpe: int | None = None, page_size: int | None = None,
        causal: bool | None = None, sm_scale: float | None = None, q_data_type: Any = None,
        kv_data_type: Any = None, use_profiler: bool = False,
        *,
        metadata: MLAPlanMetadata | None = None, cum_seq_lens_q: Array | None = None,
        block_tables: Array | None = None, seq_lens: Array | None = None,
        max_q_len: int | None = None, query_layout: str | None = None,
        kv_cache_layout: str | None = None, lse_mode: str = "none", output_dtype: Any = None,
        output_scale: str = "none", scale_mode: str = "default", skip_softmax: bool = False,
        enable_pdl: bool | None = None, use_sinks: bool = False,
    ) -> None:  # fmt: skip
        """Checks a batch's page table and prepares its run.

        FlashInfer 0.7.2's plan(): the page table as ``metadata=``
        (`MLAPlanMetadata.csr`, ``.dense`` or ``.dual``), or in the older flat
        forms. The options after ``metadata`` declare what run() will be
        given; run() raises on a call that breaks them.

        Parameters
        ----------
        qo_indptr, kv_indptr, kv_indices, kv_len_arr : int arrays
            The CSR page table: request b's queries are rows
            qo_indptr[b]:qo_indptr[b + 1] of the query, its pages
            kv_indices[kv_indptr[b]:kv_indptr[b + 1]] (entries of kv_indptr
            past B + 1 not read, as in FlashInfer), its tokens kv_len_arr[b]
            (its queries' included).
        num_heads, page_size : int
            Query heads (128 in DeepSeek-V3) and tokens per page.
        head_dim_ckv, head_dim_kpe : int
            Latent and rope widths (512 and 64 in DeepSeek); multiples of 16,
            head_dim_kpe may be 0.
        causal, sm_scale : bool, float
            Whether query i of n sees only keys up to position L - n + i; the
            softmax scale, usually 1 / sqrt(128 + 64).
        q_data_type, kv_data_type : dtype
            float32, float16 or bfloat16 queries; caches of q's dtype, or
            float8_e4m3fn / float8_e5m2 beside a 16-bit q. use_profiler: False.
        metadata : MLAPlanMetadata; or cum_seq_lens_q, block_tables, seq_lens, max_q_len
            The page table in place of the CSR arrays (the latter: dense, flat).
        query_layout, kv_cache_layout : {"packed", "split"}, keyword-only
            The form run() is given (default "packed" with metadata,
            "split" with the flat forms). "packed" also takes split parts
            that are the adjacent halves of one tensor's rows.
        lse_mode : {"none", "base2", "basee"}, keyword-only
            Whether run() returns an lse and in which base. A flat CSR plan
            with "none" lets each run() decide, as FlashInfer's does.
        use_sinks : bool, keyword-only
            run() is given sinks (a logit a head, gpt-oss's).
        output_dtype, output_scale, scale_mode, skip_softmax, enable_pdl
            FlashInfer's other declarations: q's dtype, "none",
            "default" (or "kv-per-tensor" with fp8 caches, implied), False
            and None or False are what the kernel takes; others raise.

        Examples
        --------
        >>> import numpy as np, pagedkv
        >>> mla = pagedkv.BatchMLAPagedAttentionWrapper(np.empty(1 << 20, np.uint8))
        >>> table = pagedkv.MLAPlanMetadata.dense(
        ...     np.array([0, 1]), np.array([[2, 0]]), np.array([20]))
        >>> mla.plan(metadata=table, num_heads=16, head_dim_ckv=512, head_dim_kpe=64,
        ...          page_size=16, causal=True, sm_scale=0.07, q_data_type=np.float32,
        ...          kv_data_type=np.float32, lse_mode="base2")
        >>> cache = np.zeros((3, 16, 576), np.float32)    # packed [ckv | kpe] rows
        >>> o, lse = mla.run(query=np.ones((1, 16, 576), np.float32), kv_cache=cache,
        ...                  return_lse=True)
        >>> o.shape, lse.shape
        ((1, 16, 512), (1, 16))
        """
        flat = MLAPlanMetadata(
            qo_indptr, kv_indptr, kv_indices, kv_len_arr, cum_seq_lens_q, block_tables,
            seq_lens, max_q_len,
        )  # fmt: skip
        table = MLAPlanMetadata.of_plan(metadata, flat)
        if use_profiler:
            raise ValueError("use_profiler=True is not supported: pagedkv has no kernel profiler")
        num_heads, (ckv_dim, kpe_dim), page_size, sm_scale, (q_dtype, kv_dtype) = _plan_geometry(
            dict(
                num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe,
                page_size=page_size, causal=causal, sm_scale=sm_scale,
                q_data_type=q_data_type, kv_data_type=kv_data_type,
            ),
            self.device.is_gpu,
        )  # fmt: skip
        same_dtype = output_dtype is None or as_dtype(output_dtype, "output_dtype") == q_dtype
        contract = MLARunContract.planned(
            flat=metadata is None, flat_csr=metadata is None and flat.has_csr(),
            lse_mode=lse_mode, query_layout=query_layout, kv_cache_layout=kv_cache_layout,
            output_matches_q=same_dtype, output_scale=output_scale, scale_mode=scale_mode,
            fp8_cache=kv_dtype in FP8_DTYPES, skip_softmax=skip_softmax, enable_pdl=enable_pdl,
            use_sinks=use_sinks,
        )  # fmt: skip
        self._prepare(table.csr_table(page_size), num_heads, (ckv_dim, kpe_dim), page_size,
                      bool(causal), sm_scale, (q_dtype, kv_dtype))  # fmt: skip
        self._contract = contract
        self._planned = True

    def _prepare(
        self,
        csr: tuple[Array, Array, Array, Array],
        num_heads: int,
        dims: tuple[int, int],
        page_size: int,
        causal: bool,
        sm_scale: float,
        dtypes: tuple[DType, DType],
    ) -> None:
        """plan()'s work on checked options: the CSR table (qo_indptr,
        kv_indptr, kv_indices, kv_len_arr) checked, the work split, the
        buffers run() passes the kernel, the compiled op."""
        qo, kv_ptr, indices, kv_lens, used = _checked_table(*csr, page_size)
        items, request_items, kv_split, most = mla_work(
            qo, kv_lens, page_size, num_heads, causal, self.device.is_gpu
        )
        like = self._workspace

        def resident(values: np.ndarray) -> Any:
            return to_buffer(new_like(like, np.ascontiguousarray(values)))

        # Prefill items write final rows only: a one-row placeholder.
        states = max(len(items), 1) if kv_split else 1
        if self._fixed is not None:
            # The page table lives in the caller's buffers, which run() reads.
            _, fixed_indptr, fixed_indices, _ = self._fixed.write_all(qo, kv_ptr, indices, kv_lens)
            table = {"kv_indices": to_buffer(fixed_indices), "kv_indptr": to_buffer(fixed_indptr)}
        else:
            table = {"kv_indices": resident(indices), "kv_indptr": resident(kv_ptr)}
        # The operands the plan fixes, by the op's operand names (MLA_OPERANDS).
        self._buffers = {
            **table,
            "work_items": resident(items),
            "request_items": resident(request_items),
            "partial_o": to_buffer(
                _workspace_view(self._workspace, (states, num_heads, dims[0]), like)
            ),
            "partial_lse": to_buffer(empty(like, (states, num_heads), F32)),
            "int_params": to_buffer(mla_int_params(causal, kv_split, most)),
        }
        self._rows = int(qo[-1])
        self._num_heads = num_heads
        self._dims = dims
        self._page_size = page_size
        self._max_page_id = int(used.max()) if len(used) else -1
        self._sm_scale = sm_scale
        self._dtypes = dtypes
        self._model = compiled_op(mla_spec(*dtypes), self.device)

    def _check_inputs(self, q_nope, q_pe, ckv_cache, kpe_cache) -> None:
        """Checks run()'s queries and caches against the plan (shapes,
        dtypes, device, pages the table names); the caches' layout is
        `cache_operands`' to check."""
        q_dtype, kv_dtype = self._dtypes
        ckv_dim, kpe_dim = self._dims
        rows, heads = self._rows, self._num_heads
        for name, x, width in (("q_nope", q_nope, ckv_dim), ("q_pe", q_pe, kpe_dim)):
            check_array(name, x)
            want = (rows, heads, width)
            if tuple(x.shape) != want:
                raise ValueError(f"{name} must be {list(want)} as planned, got {list(x.shape)}")
            if dtype_of(x) != q_dtype:
                raise TypeError(f"{name} is {dtype_of(x).name} but the plan has {q_dtype.name}")
            if device_of(x) != self.device:
                raise ValueError(f"{name} is on {device_of(x)}, the plan on {self.device}")
        num_pages = None
        caches = (("ckv_cache", ckv_cache, ckv_dim), ("kpe_cache", kpe_cache, kpe_dim))
        for name, x, width in caches:
            check_array(name, x)
            shape = tuple(x.shape)
            if len(shape) != 3 or shape[1:] != (self._page_size, width):
                raise ValueError(
                    f"{name} must be [pages, {self._page_size}, {width}] as planned,"
                    f" got {list(shape)}"
                )
            if num_pages is not None and shape[0] != num_pages:
                raise ValueError("ckv_cache and kpe_cache must hold the same number of pages")
            num_pages = shape[0]
            if dtype_of(x) != kv_dtype:
                raise TypeError(f"{name} is {dtype_of(x).name} but the plan has {kv_dtype.name}")
            if device_of(x) != self.device:
                raise ValueError(f"{name} is on {device_of(x)}, the plan on {self.device}")
        if self._max_page_id >= num_pages:
            raise ValueError(
                f"the page table uses page {self._max_page_id} but the caches hold"
                f" {num_pages} pages"
            )

    def run(
        self,
        q_nope: Array | None = None,
        q_pe: Array | None = None,
        ckv_cache: Array | None = None,
        kpe_cache: Array | None = None,
        out: Array | None = None,
        lse: Array | None = None,
        return_lse: bool = False,
        profiler_buffer: Array | None = None,
        kv_len: Array | None = None,
        page_table: Array | None = None,
        return_lse_base_on_e: bool = False,
        o_scale: float | None = None,
        *,
        query: Any = None,
        kv_cache: Any = None,
        ckv_scale: float | None = None,
        ckv_scale_arr: Array | None = None,
        kpe_scale: float | None = None,
        sinks: Any = None,
        skip_softmax_threshold_scale_factor: float | None = None,
        bmm1_scale: Any = None,
        bmm2_scale: Any = None,
    ) -> Array | tuple[Array, Array]:
        """MLA attention of the planned batch.

        FlashInfer 0.7.2's run(): the queries as ``query=`` and the caches as
        ``kv_cache=``, each a packed tensor (``[..., ckv_dim + kpe_dim]``)
        or a split pair, in the layout plan() declared; or in the older form,
        q_nope, q_pe, ckv_cache, kpe_cache. A packed cache, or the two halves
        of one, is read where it lies (rows of one stride); queries are
        copied when not contiguous.

        Parameters
        ----------
        query : array or (q_nope, q_pe), keyword-only
            [nnz_qo, num_heads, head_dim_ckv + head_dim_kpe], or the parts.
        kv_cache : array or (ckv_cache, kpe_cache), keyword-only
            [pages, page_size, head_dim_ckv + head_dim_kpe], or the pools.
        q_nope : array, shape (nnz_qo, num_heads, head_dim_ckv)
            Queries in the latent space (W_UK absorbed).
        q_pe : array, shape (nnz_qo, num_heads, head_dim_kpe)
            Their rope part.
        ckv_cache : array, shape (pages, page_size, head_dim_ckv)
        kpe_cache : array, shape (pages, page_size, head_dim_kpe)
            The caches ``append_paged_mla_kv_cache`` fills: contiguous, or
            the halves of one packed cache.
        out, lse : arrays, optional
            Where to write o [nnz_qo, num_heads, head_dim_ckv] (q's dtype) and
            lse [nnz_qo, num_heads] (float32, filled even without return_lse).
        return_lse : bool
            Return (o, lse) rather than o.
        return_lse_base_on_e : bool
            The lse in base e rather than base 2.
        ckv_scale, kpe_scale : float, keyword-only
            Per-tensor scales of fp8 caches (real = stored * scale); required
            with fp8 caches, refused otherwise.
        sinks : array [num_heads], keyword-only
            Each head's sink logit (a plan with use_sinks=True): it joins every
            row's softmax denominator, and the lse counts it.
        profiler_buffer, kv_len, page_table, o_scale, ckv_scale_arr,
        skip_softmax_threshold_scale_factor, bmm1_scale, bmm2_scale
            FlashInfer's profiler, cutlass-backend, per-group fp8,
            skip-softmax and BMM-scale arguments: not supported (None).

        Returns
        -------
        o, or (o, lse) with return_lse.
        """
        if not self._planned:
            raise RuntimeError("plan() must be called before run()")
        query = structural_input("query", query, q_nope, q_pe, "q_nope and q_pe")
        kv_cache = structural_input("kv_cache", kv_cache, ckv_cache, kpe_cache,
                                    "ckv_cache and kpe_cache")  # fmt: skip
        unsupported = dict(profiler_buffer=profiler_buffer, kv_len=kv_len, page_table=page_table)
        unsupported |= dict(o_scale=o_scale, ckv_scale_arr=ckv_scale_arr, bmm1_scale=bmm1_scale)
        unsupported |= dict(
            bmm2_scale=bmm2_scale,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
        )
        for name, value in unsupported.items():
            if value is not None:
                raise ValueError(f"{name} is not supported by pagedkv's MLA kernel")
        contract = self._contract
        lse_mode = contract.lse_wanted(return_lse, lse, return_lse_base_on_e)
        contract.check_sinks(sinks)
        ckv_scale, kpe_scale = _cache_scales(self._dtypes[1], ckv_scale, kpe_scale)
        out, lse = self.run_scaled(
            split_parts("query", query, self._dims, contract.query_layout),
            split_parts("kv_cache", kv_cache, self._dims, contract.kv_cache_layout),
            out,
            lse,
            (self._sm_scale, ckv_scale or 1.0, kpe_scale or 1.0),
            sinks,
        )
        if lse_mode == "basee":
            lse *= math.log(2.0)
        return (out, lse) if return_lse else out

    def run_scaled(
        self,
        query: tuple[Array, Array],
        kv_cache: tuple[Array, Array],
        out: Array | None,
        lse: Array | None,
        scales: tuple[float, float, float],
        sinks: Any = None,
    ) -> tuple[Array, Array]:
        """The planned batch's (o, base-2 lse) for query (q_nope, q_pe) over
        kv_cache (ckv, kpe) with scales (sm_scale, ckv_scale, kpe_scale) as
        the kernel applies them: scores (q_nope . ckv * ckv_scale + q_pe .
        kpe * kpe_scale) * sm_scale, o scaled by ckv_scale; sinks merged in.
        run()'s checked options arrive here, and the block-table entry
        points' fused scales (pagedkv.mla_block_tables)."""
        q_nope, q_pe = query
        self._check_inputs(q_nope, q_pe, *kv_cache)
        ckv_rows, kpe_rows = cache_operands(*kv_cache)
        q_dtype, (ckv_dim, _) = self._dtypes[0], self._dims
        rows, heads = self._rows, self._num_heads
        sink_lse = None if sinks is None else sink_log2_lse(sinks, heads)
        if out is None:
            out = empty_like(q_nope)
        else:
            check_output("out", out, (rows, heads, ckv_dim), q_dtype, self.device)
        if lse is None:
            lse = empty(q_nope, (rows, heads), F32)
        else:
            check_output("lse", lse, (rows, heads), F32, self.device)
        ckv_operand = storage_view(ckv_rows)
        # One packed cache is one operand twice (wrapped once).
        kpe_operand = ckv_operand if kpe_rows is ckv_rows else storage_view(kpe_rows)
        run_model(
            self._model,
            mla_operands(
                output=out,
                lse=lse,
                q_nope=contiguous(q_nope),
                q_pe=contiguous(q_pe),
                ckv_cache=ckv_operand,
                kpe_cache=kpe_operand,
                float_params=mla_float_params(*scales),
                **self._buffers,
            ),
            self.device,
        )
        if sink_lse is not None:
            merge_sinks(out, lse, sink_lse)
        return out, lse


def _plan_geometry(
    required: dict[str, Any], is_gpu: bool
) -> tuple[int, tuple[int, int], int, float, tuple[DType, DType]]:
    """plan()'s required arguments checked: (num_heads, (ckv, kpe dims),
    page_size, sm_scale, (q dtype, kv dtype)); TypeError names the missing."""
    missing = [name for name, value in required.items() if value is None]
    if missing:
        raise TypeError(f"plan() is missing {', '.join(missing)}")
    q_dtype = as_dtype(required["q_data_type"], "q_data_type")
    kv_dtype = as_dtype(required["kv_data_type"], "kv_data_type")
    check_mla_dtypes(q_dtype, kv_dtype)
    return (
        check_int("num_heads", required["num_heads"], 1),
        check_mla_dims(required["head_dim_ckv"], required["head_dim_kpe"], is_gpu),
        check_int("page_size", required["page_size"], 1),
        check_float("sm_scale", required["sm_scale"], positive=True),
        (q_dtype, kv_dtype),
    )
