"""What plan() prepares for decode and prefill alike, and the run it enables.

plan() checks the page table once (with the kernels' own checker, on host
copies), decides the work items, keeps its own device-resident copies of the
metadata as ready MAX buffers and compiles the op; run() then only checks
shapes and launches: no host round-trip, no re-wrapping of metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from max.driver import Buffer
from max.dtype import DType

from .._checks import (
    CacheGeometry,
    cache_geometry,
    check_index_array,
    check_int,
    check_output,
    check_writable,
    checked_scales,
    host_index_copy,
)
from .._ops.contract import ATTENTION_OP, ITEM_FIELDS, attention_operands
from .._ops.kernels import Operand, OpSpec, compiled_op, run_model
from .._ops.tensors import (
    FP8_FORMATS,
    Array,
    Device,
    check_array,
    contiguous,
    device_of,
    dtype_of,
    empty,
    empty_like,
    is_torch,
    new_like,
    storage_dtype,
    to_buffer,
    write_front,
)
from ..custom_mask import NO_MASK, CustomMaskRows
from ..page import CHECK_PAGE_TABLE, INDEX, check_page_table_on_host, seq_lens_from_page_table
from .work import AttentionOptions, as_dtype, check_gpu_head_dim

__all__ = ["CHECK_PAGE_TABLE", "check_page_table_on_host"]

Q_DTYPES = (DType.float32, DType.float16, DType.bfloat16)
FP8_DTYPES = tuple(FP8_FORMATS)
KV_DTYPES = Q_DTYPES + FP8_DTYPES + (DType.int8,)
"""K/V dtypes the attention op reads: int8 pools (rows of codes and a scale,
`pagedkv._ops.contract.pool_row_width`) on the CPU."""

F32 = DType.float32
HOST_F32 = Operand(F32, 1, on_host=True)
HOST_INDEX = Operand(DType.int32, 1, on_host=True)


def output_operands(q_dtype: DType) -> dict[str, Operand]:
    """The operands an attention op writes, the batch attention op's and
    MLA's alike: output [rows, H, D] in q's dtype, its lse [rows, H], and
    the split-K partial states [items, H, D] and [items, H] (float32)."""
    return {
        "output": Operand(q_dtype, 3, mutable=True),
        "lse": Operand(F32, 2, mutable=True),
        "partial_o": Operand(F32, 3, mutable=True),
        "partial_lse": Operand(F32, 2, mutable=True),
    }


def plan_operands() -> dict[str, Operand]:
    """The operands an attention op reads from its plan, the batch attention
    op's and MLA's alike: the page table's kv_indices and kv_indptr, the
    work items [items, ITEM_FIELDS] with each request's first item, and the
    float and int parameters (on the host)."""
    return {
        "kv_indices": INDEX,
        "kv_indptr": INDEX,
        "work_items": Operand(DType.int32, 2),
        "request_items": INDEX,
        "float_params": HOST_F32,
        "int_params": HOST_INDEX,
    }


def attention_spec(q_dtype: DType, kv_dtype: DType, layout: int) -> OpSpec:
    """out, lse, partial_o, partial_lse (`output_operands`), q, k_cache,
    v_cache (CacheGeometry.kernel_operands), kv_last_page_len, the custom
    mask and the rest of the plan's (`plan_operands`): the operands of the
    batch attention op (decode and prefill). fp8 pools enter as uint8 with
    kv_format naming them."""
    pool = Operand(storage_dtype(kv_dtype), 5, mutable=True)
    return OpSpec.of(
        ATTENTION_OP,
        attention_operands(
            **output_operands(q_dtype),
            q=Operand(q_dtype, 3),
            k_cache=pool,
            v_cache=pool,
            kv_last_page_len=INDEX,
            custom_mask=Operand(DType.uint8, 1),
            mask_rows=INDEX,
            **plan_operands(),
        ),
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


@dataclass
class PageTable:
    """A checked CSR page table: host copies, and what plan() derives."""

    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray
    page_size: int
    seq_lens: np.ndarray
    max_page_id: int
    like: Array
    """An array of the caller's kind and device (for resident copies)."""

    @property
    def batch_size(self) -> int:
        return len(self.last_page_len)

    @staticmethod
    def checked(indptr: Array, indices: Array, last_page_len: Array, page_size: int) -> PageTable:
        """Checks the arrays (int32, 1-D, consistent, page ids >= 0, last
        page lengths in range) and reads the sequence lengths.

        The table holds its own host copies, checked after copying: editing
        the caller's arrays later changes nothing that run() reads."""
        page_size = check_int("page_size", page_size, 1)
        check_index_array("last_page_len", last_page_len)
        check_index_array("indptr", indptr, int(last_page_len.shape[0]) + 1)
        check_index_array("indices", indices)
        host = [
            host_index_copy(name, x)
            for name, x in (
                ("indptr", indptr),
                ("indices", indices),
                ("last_page_len", last_page_len),
            )
        ]
        max_page_id, _ = check_page_table_on_host(*host, page_size)
        seq_lens = seq_lens_from_page_table(host[0], host[2], page_size)
        return PageTable(*host, page_size, seq_lens, max_page_id, indptr)


class FixedWork:
    """The work list and scratch a use_cuda_graph decode wrapper keeps for its
    life, so that every array a step's kernels read (with the caller's fixed
    index buffers, pagedkv.fixed_buffers) stays at one address across plans:
    a step captured in a CUDA graph after one plan() replays right after the
    next. plan() writes each batch's work items into the front of `items`
    and fills the rest with items of no queries, which the kernels skip, so
    the captured grid (one block row per item) never changes; the partial
    states, the lse scratch and the ALiBi lse shift are sized for the
    capacity and the batch once.

    A plan of another batch size, head count or head dim needs another
    FixedWork (`sized_for`), and another capture.
    """

    def __init__(
        self,
        like: Array,
        batch_size: int,
        capacity: int,
        num_qo_heads: int,
        head_dim: int,
        workspace: Array | None,
    ) -> None:
        self.shape = (batch_size, num_qo_heads, head_dim)
        self.capacity = capacity
        self.items = empty(like, (capacity, ITEM_FIELDS), DType.int32)
        self.request_items = empty(like, (batch_size + 1,), DType.int32)
        self.partial_o = _workspace_view(workspace, (capacity, num_qo_heads, head_dim), like)
        self.partial_lse = empty(like, (capacity, num_qo_heads), F32)
        self.lse_scratch = empty(like, (batch_size, num_qo_heads), F32)
        self.lse_shift = empty(like, (batch_size, num_qo_heads), F32)
        self.custom_mask = new_like(like, NO_MASK.bits)
        self.mask_rows = new_like(like, NO_MASK.row_bits)

    def sized_for(self, batch_size: int, num_qo_heads: int, head_dim: int) -> bool:
        return self.shape == (batch_size, num_qo_heads, head_dim)

    def write(
        self, items: np.ndarray, request_items: np.ndarray, lse_shift: np.ndarray | None
    ) -> None:
        """Writes a plan's work list (and ALiBi lse shift) in place, after
        checking that it fits."""
        if len(items) > self.capacity:
            raise ValueError(
                f"this batch needs {len(items)} decode work items; the wrapper's fixed "
                f"work list holds {self.capacity} (use_cuda_graph fixes it at the first "
                "plan): plan the batch needing the most splits first, or use another wrapper"
            )
        padded = np.zeros((self.capacity, ITEM_FIELDS), np.int32)  # padding: no queries
        padded[: len(items)] = items
        write_front(self.items, padded)
        write_front(self.request_items, request_items)
        if lse_shift is not None:
            write_front(self.lse_shift, lse_shift)


class AttentionPlan:
    """Everything run() needs: metadata buffers, options, the compiled op."""

    def __init__(
        self,
        table: PageTable,
        *,
        items: np.ndarray,
        request_items: np.ndarray,
        num_qo_heads: int,
        num_kv_heads: int,
        layout: int,
        options: AttentionOptions,
        int_params: np.ndarray,
        q_rows: int,
        q_data_type: object,
        kv_data_type: object,
        workspace: Array | None,
        lse_shift: np.ndarray | None = None,
        custom_mask: CustomMaskRows | None = None,
        table_views: tuple[Array, Array, Array] | None = None,
        fixed_work: FixedWork | None = None,
    ) -> None:
        # The plan's dtypes (any form as_dtype reads); None: the first run()'s.
        q_dtype = None if q_data_type is None else as_dtype(q_data_type, "q_data_type")
        kv_dtype = None if kv_data_type is None else as_dtype(kv_data_type, "kv_data_type")
        self.table = table
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.layout = layout
        self.options = options
        self.q_rows = q_rows
        self.device: Device = device_of(table.like)
        if self.device.is_gpu:
            check_gpu_head_dim(options.head_dim)
        self.q_dtype = q_dtype
        self.kv_dtype = kv_dtype or q_dtype
        if q_dtype is not None:
            check_dtypes(q_dtype, self.kv_dtype)

        def resident(values: np.ndarray) -> Buffer:
            return to_buffer(new_like(table.like, np.ascontiguousarray(values)))

        partial_shape = (max(len(items), 1), num_qo_heads, options.head_dim)
        self.float_workspace_bytes = 4 * partial_shape[0] * num_qo_heads * options.head_dim
        """The float32 split scratch run() keeps in the caller's workspace buffer."""
        # run() reads the plan's own copies: later edits to the caller's arrays
        # cannot desynchronise the metadata from the page table.
        # table_views: the caller's fixed buffers holding the table
        # (pagedkv.fixed_buffers), which run() then reads in place.
        indptr, indices, last = table_views or (
            resident(table.indptr),
            resident(table.indices),
            resident(table.last_page_len),
        )
        if fixed_work is None:
            work = {
                "items": resident(items),
                "request_items": resident(request_items),
                "custom_mask": resident((custom_mask or NO_MASK).bits),
                "mask_rows": resident((custom_mask or NO_MASK).row_bits),
                "partial_o": _workspace_view(workspace, partial_shape, table.like),
                "partial_lse": empty(table.like, partial_shape[:2], F32),
                # Where lse goes when the caller does not ask for it: the kernel
                # always writes one, and this spares run() an allocation.
                "lse_scratch": empty(table.like, (q_rows, num_qo_heads), F32),
            }
            shift = None if lse_shift is None else new_like(table.like, lse_shift)
        else:
            assert custom_mask is None, "a fixed work list is decode's"
            fixed_work.write(items, request_items, lse_shift)
            work = {
                name: getattr(fixed_work, name)
                for name in (
                    "items", "request_items", "custom_mask", "mask_rows", "partial_o",
                    "partial_lse", "lse_scratch",
                )
            }  # fmt: skip
            shift = None if lse_shift is None else fixed_work.lse_shift
        self.buffers = {
            "indices": to_buffer(indices),
            "indptr": to_buffer(indptr),
            "last": to_buffer(last),
            **{name: to_buffer(array) for name, array in work.items()},
            "int_params": to_buffer(int_params),
        }
        self.lse_shift_resident = shift
        """lse_shift on the table's device and kind (None without it)."""
        self.lse_shift = lse_shift
        """[rows, Hq] (host) added to a returned lse (decode under ALiBi, see
        decode_alibi_lse_shift); None: nothing."""
        self.model = None
        """The compiled op, kept so that run() skips the lookup."""
        self._scales: tuple | None = None
        self._float_params: Buffer | None = None
        if self.q_dtype is not None:
            self.compile()

    def spec(self) -> OpSpec:
        assert self.q_dtype is not None and self.kv_dtype is not None
        return attention_spec(self.q_dtype, self.kv_dtype, self.layout)

    def compile(self) -> None:
        self.model = compiled_op(self.spec(), self.device)

    def float_params(
        self, q_scale: float | None, k_scale: float | None, v_scale: float | None
    ) -> Buffer:
        """The op's float parameters for these scales (the last call's, reused:
        a server passes the same scales to every layer)."""
        scales = checked_scales(q_scale, k_scale, v_scale)
        if self._float_params is None or scales != self._scales:
            self._float_params = to_buffer(self.options.float_params(*scales))
            self._scales = scales
        return self._float_params

    def check_run(self, q: Array, geometry: CacheGeometry) -> None:
        check_array("q", q)
        want = (self.q_rows, self.num_qo_heads, self.options.head_dim)
        if tuple(q.shape) != want:
            raise ValueError(f"q must be {list(want)} as planned, got {list(q.shape)}")
        if device_of(q) != self.device or geometry.device != self.device:
            raise ValueError(f"q and the cache must be on {self.device}, where plan() ran")
        got = (geometry.page_size, geometry.num_kv_heads, geometry.head_dim)
        planned = (self.table.page_size, self.num_kv_heads, self.options.head_dim)
        if got != planned:
            raise ValueError(
                f"the cache has (page_size, num_kv_heads, head_dim) = {got}, the plan {planned}"
            )
        if self.table.max_page_id >= geometry.num_pages:
            raise ValueError(
                f"the page table uses page {self.table.max_page_id} but the cache holds "
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
        out: Array | None = None,
        lse: Array | None = None,
        return_lse: bool = False,
    ) -> tuple[Array, Array | None]:
        """o [rows, Hq, D] (q's dtype), into `out` if given, and with
        return_lse lse [rows, Hq] (float32, base 2), into `lse` if given;
        else None."""
        geometry = cache_geometry("paged_kv_cache", paged_kv_cache, kv_layout, written=False)
        self.check_run(q, geometry)
        assert self.q_dtype is not None
        if out is None:
            out = empty_like(q)  # check_run: q has the plan's dtype
        else:
            check_output("out", out, tuple(q.shape), self.q_dtype, self.device)
        b = self.buffers
        if not return_lse:
            lse_operand = b["lse_scratch"]
        elif lse is None:
            lse = lse_operand = empty(q, q.shape[:2], F32)
        else:
            check_output("lse", lse, tuple(q.shape[:2]), F32, self.device)
            lse_operand = lse
        k_cache, v_cache = geometry.kernel_operands()
        run_model(
            self.model,
            attention_operands(
                output=out,
                lse=lse_operand,
                partial_o=b["partial_o"],
                partial_lse=b["partial_lse"],
                q=contiguous(q),
                k_cache=k_cache,
                v_cache=v_cache,
                kv_indices=b["indices"],
                kv_indptr=b["indptr"],
                kv_last_page_len=b["last"],
                work_items=b["items"],
                request_items=b["request_items"],
                custom_mask=b["custom_mask"],
                mask_rows=b["mask_rows"],
                float_params=self.float_params(q_scale, k_scale, v_scale),
                int_params=b["int_params"],
            ),
            self.device,
        )
        if not return_lse:
            return out, None
        shift = self.lse_shift_resident
        if shift is not None:
            # The plan's arrays may be NumPy and q torch: then a copy of lse's kind.
            if is_torch(shift) != is_torch(lse) or device_of(shift) != device_of(lse):
                shift = new_like(lse, self.lse_shift)
            lse += shift
        return out, lse


def _workspace_view(workspace: Array | None, shape: tuple[int, ...], like: Array) -> Array:
    """float32 scratch of `shape`: the front of the caller's workspace buffer
    (any dtype) when it is large enough, else a new array."""
    need = 4 * int(np.prod(shape))
    if workspace is None:
        return empty(like, shape, F32)
    check_array("float_workspace_buffer", workspace)
    check_writable("float_workspace_buffer", workspace)
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
