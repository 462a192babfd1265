"""Batch decode attention over the paged cache, FlashInfer's wrapper API.

``plan()`` does the per-batch work once: it checks the page table, splits long
requests across cores (flash-decoding), builds the kernel metadata and
compiles the op. ``run()``, called once per layer with that layer's q and
cache, only checks shapes and launches the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from max.driver import Buffer
from max.dtype import DType

from ._attention import (
    AttentionOptions,
    as_dtype,
    heads_per_task,
    parallel_slots,
    split_work,
)
from ._checks import CacheGeometry, cache_geometry, check_index_array, layout_code
from ._kernels import Operand, OpSpec, prepare, run_op
from ._tensors import (
    CPU,
    FP8_FORMATS,
    Array,
    Device,
    check_array,
    contiguous,
    device_of,
    dtype_of,
    empty,
    is_torch,
    new_like,
    storage_dtype,
    to_buffer,
    to_host_numpy,
)
from .page import INDEX

Q_DTYPES = (DType.float32, DType.float16, DType.bfloat16)
FP8_DTYPES = (DType.float8_e4m3fn, DType.float8_e5m2)
KV_DTYPES = Q_DTYPES + FP8_DTYPES

F32 = DType.float32
GPU_MAX_GROUP = 8
"""Query heads per GPU thread block (MAX_GROUP in mojo_ops/decode_gpu.mojo)."""
HOST_F32 = Operand(F32, 1, on_host=True)
HOST_INDEX = Operand(DType.int32, 1, on_host=True)

CHECK_PAGE_TABLE = OpSpec.of(
    "pagedkv_check_page_table",
    [Operand(DType.int32, 1, mutable=True, on_host=True), INDEX, INDEX, INDEX, HOST_INDEX],
)


def decode_spec(q_dtype: DType, kv_dtype: DType, layout: int) -> OpSpec:
    """out, lse, partial_o, partial_lse, q, k_cache, v_cache
    (CacheGeometry.kernel_operands), page table, work, params. fp8 pools enter
    as uint8 with kv_format naming them."""
    pool = Operand(storage_dtype(kv_dtype), 5, mutable=True)
    return OpSpec.of(
        "pagedkv_batch_decode",
        [
            Operand(q_dtype, 3, mutable=True),
            Operand(F32, 2, mutable=True),
            Operand(F32, 3, mutable=True),
            Operand(F32, 2, mutable=True),
            Operand(q_dtype, 3),
            pool,
            pool,
            INDEX,
            INDEX,
            INDEX,
            Operand(DType.int32, 2),
            INDEX,
            HOST_F32,
            HOST_INDEX,
        ],
        layout=layout,
        kv_format=FP8_FORMATS.get(kv_dtype, 0),
    )


def check_dtypes(q_dtype: DType, kv_dtype: DType) -> None:
    if q_dtype not in Q_DTYPES:
        raise TypeError(f"q dtype must be float32, float16 or bfloat16, got {q_dtype.name}")
    if kv_dtype not in KV_DTYPES:
        raise TypeError(f"KV dtype {kv_dtype.name} is not supported")
    if kv_dtype in FP8_DTYPES and q_dtype == DType.float32:
        raise TypeError("an fp8 KV cache needs a 16-bit q (float16 or bfloat16)")


def check_page_table_on_host(
    kv_indptr: np.ndarray,
    kv_indices: np.ndarray,
    kv_last_page_len: np.ndarray,
    page_size: int,
    num_pages: int = 2**31 - 1,
) -> tuple[int, int]:
    """Runs the kernels' own page-table check on host copies (raises ValueError).

    Returns (largest page id used or -1, tokens cached in the batch).
    """
    summary = np.zeros(2, np.int32)
    run_op(
        CHECK_PAGE_TABLE,
        [
            summary,
            kv_indptr,
            kv_indices,
            kv_last_page_len,
            np.array([page_size, num_pages], np.int32),
        ],
        CPU,
    )
    return int(summary[0]), int(summary[1])


class BatchDecodeWithPagedKVCacheWrapper:
    """Decode attention for a batch of requests with one query token each.

    >>> w = BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    >>> w.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16)
    >>> o = w.run(q, paged_kv_cache)              # per layer: q [B, 32, 128]
    """

    def __init__(self, float_workspace_buffer: Array | None = None, kv_layout: str = "NHD") -> None:
        self._layout = layout_code(kv_layout)
        self._kv_layout = kv_layout
        self._workspace = float_workspace_buffer
        self._plan: _DecodePlan | None = None

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
        """
        self._plan = _DecodePlan.build(
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            page_size,
            self._layout,
            AttentionOptions(
                head_dim=int(head_dim),
                pos_encoding_mode=pos_encoding_mode,
                window_left=int(window_left),
                logits_soft_cap=logits_soft_cap or None,
                sm_scale=sm_scale,
                rope_scale=rope_scale,
                rope_theta=rope_theta,
            ),
            None if q_data_type is None else as_dtype(q_data_type, "q_data_type"),
            None if kv_data_type is None else as_dtype(kv_data_type, "kv_data_type"),
            self._workspace,
        )

    def run(
        self,
        q: Array,
        paged_kv_cache: Array | Sequence[Array],
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        return_lse: bool = False,
    ) -> Array | tuple[Array, Array]:
        """Attention of q [B, num_qo_heads, head_dim] over the planned batch.

        paged_kv_cache: [pages, 2, ...page...] or a (k_cache, v_cache) pair, in
        the wrapper's layout. Returns o [B, Hq, D] (q's dtype), and lse [B, Hq]
        (float32, base 2) with return_lse.
        """
        if self._plan is None:
            raise RuntimeError("run() called before plan()")
        o, lse = self._plan.run(q, paged_kv_cache, self._kv_layout, q_scale, k_scale, v_scale)
        return (o, lse) if return_lse else o

    forward = run


class _DecodePlan:
    """Everything run() needs, prepared by plan()."""

    def __init__(self) -> None:
        self.options: AttentionOptions
        self.batch_size = 0
        self.num_qo_heads = 0
        self.num_kv_heads = 0
        self.page_size = 0
        self.layout = 0
        self.device: Device = CPU
        self.q_dtype: DType | None = None
        self.kv_dtype: DType | None = None
        self.max_page_id = -1
        self.buffers: dict[str, Buffer] = {}

    @staticmethod
    def build(
        indptr: Array,
        indices: Array,
        last_page_len: Array,
        num_qo_heads: int,
        num_kv_heads: int,
        page_size: int,
        layout: int,
        options: AttentionOptions,
        q_dtype: DType | None,
        kv_dtype: DType | None,
        workspace: Array | None,
    ) -> _DecodePlan:
        plan = _DecodePlan()
        if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
            raise ValueError(
                f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        check_index_array("last_page_len", last_page_len)
        batch_size = int(last_page_len.shape[0])
        check_index_array("indptr", indptr, batch_size + 1)
        check_index_array("indices", indices)
        device = device_of(indptr)
        host_indptr = np.ascontiguousarray(to_host_numpy(indptr))
        host_indices = np.ascontiguousarray(to_host_numpy(indices))
        host_last = np.ascontiguousarray(to_host_numpy(last_page_len))
        max_page_id, _ = check_page_table_on_host(host_indptr, host_indices, host_last, page_size)
        if q_dtype is not None:
            check_dtypes(q_dtype, kv_dtype or q_dtype)

        pages = np.diff(host_indptr.astype(np.int64))
        seq_lens = np.where(pages > 0, (pages - 1) * page_size + host_last, 0)
        first_visible = (
            np.zeros_like(seq_lens)
            if options.window_left < 0
            else np.maximum(seq_lens - 1 - options.window_left, 0)
        )
        # Items run once per head block: on the CPU a block is the KV heads one
        # task covers, on a GPU the query heads one thread block covers.
        per_task = heads_per_task(num_qo_heads, num_kv_heads)
        head_blocks = (
            num_kv_heads * -(-(num_qo_heads // num_kv_heads) // GPU_MAX_GROUP)
            if device.is_gpu
            else -(-num_kv_heads // per_task)
        )
        items, request_items = split_work(
            seq_lens, first_visible, head_blocks, page_size, parallel_slots(device.is_gpu)
        )
        plan.options = options
        plan.batch_size = batch_size
        plan.num_qo_heads = num_qo_heads
        plan.num_kv_heads = num_kv_heads
        plan.page_size = page_size
        plan.layout = layout
        plan.device = device
        plan.q_dtype = q_dtype
        plan.kv_dtype = kv_dtype or q_dtype
        plan.max_page_id = max_page_id

        def resident(values: np.ndarray) -> Buffer:
            return to_buffer(new_like(indptr, np.ascontiguousarray(values)))

        partial_shape = (len(items), num_qo_heads, options.head_dim)
        partial_o = _workspace_view(workspace, partial_shape, indptr)
        # run() reads the plan's own copies: later edits to the caller's arrays
        # cannot desynchronise the metadata from the page table.
        plan.buffers = {
            "indices": resident(host_indices),
            "indptr": resident(host_indptr),
            "last": resident(host_last),
            "items": resident(items),
            "request_items": resident(request_items),
            "partial_o": to_buffer(partial_o),
            "partial_lse": to_buffer(empty(indptr, partial_shape[:2], F32)),
            "int_params": to_buffer(options.int_params(per_task)),
        }
        if plan.q_dtype is not None:
            plan.compile()
        return plan

    def spec(self) -> OpSpec:
        assert self.q_dtype is not None and self.kv_dtype is not None
        return decode_spec(self.q_dtype, self.kv_dtype, self.layout)

    def compile(self) -> None:
        prepare([self.spec()], self.device)

    def check_run(self, q: Array, geometry: CacheGeometry) -> None:
        check_array("q", q)
        want = (self.batch_size, self.num_qo_heads, self.options.head_dim)
        if tuple(q.shape) != want:
            raise ValueError(f"q must be {list(want)} as planned, got {list(q.shape)}")
        if device_of(q) != self.device or geometry.device != self.device:
            raise ValueError(f"q and the cache must be on {self.device}, where plan() ran")
        got = (geometry.page_size, geometry.num_kv_heads, geometry.head_dim)
        planned = (self.page_size, self.num_kv_heads, self.options.head_dim)
        if got != planned:
            raise ValueError(
                f"the cache has (page_size, num_kv_heads, head_dim) = {got}, the plan {planned}"
            )
        if self.max_page_id >= geometry.num_pages:
            raise ValueError(
                f"the page table uses page {self.max_page_id} but the cache holds "
                f"{geometry.num_pages} pages"
            )
        if self.q_dtype is None:
            self.q_dtype, self.kv_dtype = dtype_of(q), geometry.dtype
            check_dtypes(self.q_dtype, self.kv_dtype)
            self.compile()
        if dtype_of(q) != self.q_dtype:
            raise TypeError(f"q is {dtype_of(q).name} but the plan has {self.q_dtype.name}")
        if geometry.dtype != self.kv_dtype:
            raise TypeError(
                f"the cache is {geometry.dtype.name} but the plan has {self.kv_dtype.name}"
            )

    def run(
        self,
        q: Array,
        paged_kv_cache: Array | Sequence[Array],
        kv_layout: str,
        q_scale: float | None,
        k_scale: float | None,
        v_scale: float | None,
    ) -> tuple[Array, Array]:
        geometry = cache_geometry("paged_kv_cache", paged_kv_cache, kv_layout)
        self.check_run(q, geometry)
        o = empty(q, q.shape, q_dtype := self.q_dtype)
        lse = empty(q, q.shape[:2], F32)
        assert q_dtype is not None and self.kv_dtype is not None
        b = self.buffers
        run_op(
            self.spec(),
            [
                o,
                lse,
                b["partial_o"],
                b["partial_lse"],
                contiguous(q),
                *geometry.kernel_operands(),
                b["indices"],
                b["indptr"],
                b["last"],
                b["items"],
                b["request_items"],
                self.options.float_params(q_scale, k_scale, v_scale),
                b["int_params"],
            ],
            self.device,
        )
        return o, lse


def _workspace_view(workspace: Array | None, shape: tuple[int, ...], like: Array) -> Array:
    """float32 scratch of `shape`: the front of the caller's workspace buffer
    (any dtype) when it is large enough, else a new array."""
    need = 4 * int(np.prod(shape))
    if workspace is None or need == 0:
        return empty(like, shape, F32)
    check_array("float_workspace_buffer", workspace)
    if is_torch(workspace):
        import torch

        raw = workspace.reshape(-1).view(torch.uint8)
        if raw.numel() >= need:
            return raw[:need].view(torch.float32).view(shape)
    else:
        raw = workspace.reshape(-1).view(np.uint8)
        if raw.size >= need:
            return raw[:need].view(np.float32).reshape(shape)
    return empty(like, shape, F32)


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
) -> Array | tuple[Array, Array]:
    """Decode attention of one request over contiguous K/V.

    q: [num_qo_heads, head_dim]; k, v: [L, num_kv_heads, head_dim] (NHD) or
    [num_kv_heads, L, head_dim] (HND). The K/V are viewed, without a copy, as
    one page of L tokens and run through the batch kernel. Returns o
    [num_qo_heads, head_dim], and lse [num_qo_heads] with return_lse.
    """
    layout_code(kv_layout)
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x)
    if len(q.shape) != 2 or len(k.shape) != 3 or tuple(k.shape) != tuple(v.shape):
        raise ValueError(
            f"q must be [Hq, D] and k, v the same [L, Hkv, D] / [Hkv, L, D]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    heads, length = (k.shape[1], k.shape[0]) if kv_layout == "NHD" else k.shape[:2]
    num_qo_heads, head_dim = q.shape
    if length == 0:
        o = empty(q, q.shape, dtype_of(q))
        o[...] = 0
        lse = empty(q, (num_qo_heads,), F32)
        lse[...] = -np.inf
        return (o, lse) if return_lse else o
    # One page holding all L tokens: the pair form of the pool, zero-copy.
    cache = (contiguous(k)[None], contiguous(v)[None])
    # plan() is cheap here: the op is compiled once per process.
    wrapper = BatchDecodeWithPagedKVCacheWrapper(kv_layout=kv_layout)
    wrapper.plan(
        new_like(q, np.array([0, 1], np.int32)),
        new_like(q, np.array([0], np.int32)),
        new_like(q, np.array([length], np.int32)),
        num_qo_heads,
        int(heads),
        int(head_dim),
        int(length),
        pos_encoding_mode=pos_encoding_mode,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        q_data_type=dtype_of(q),
        kv_data_type=dtype_of(k),
        sm_scale=sm_scale,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
    )
    out = wrapper.run(q[None], cache, return_lse=return_lse)
    if return_lse:
        return out[0][0], out[1][0]
    return out[0]
