"""FlashInfer's paged-cache functions: append, MLA append, index helpers, gather.

Mirrors ``flashinfer.page``: the same names, arguments and meanings. Inputs are
NumPy arrays or torch tensors; caches are written in place, never copied.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import numpy as np
from max.dtype import DType

from ._checks import (
    CacheGeometry,
    as_int32_index,
    cache_geometry,
    check_device,
    check_index_array,
    check_int,
    check_page_table_arrays,
    check_rows,
    check_writable,
    host_index_copy,
)
from ._ops.contract import (
    APPEND_MLA_OP,
    APPEND_OP,
    BATCH_INDICES_OP,
    CHECK_PAGE_TABLE_OP,
    COPY_PAGES_OP,
    GATHER_OP,
    SEQ_LENS_OP,
)
from ._ops.kernels import Operand, OpSpec, run_op
from ._ops.tensors import (
    CPU,
    Array,
    Device,
    check_array,
    contiguous,
    device_of,
    dtype_of,
    empty,
    is_contiguous,
    new_like,
    storage_dtype,
    storage_view,
)

INDEX = Operand(DType.int32, 1)
INDEX_OUT = Operand(DType.int32, 1, mutable=True)
HOST_INDEX = Operand(DType.int32, 1, on_host=True)

SEQ_LENS = OpSpec.of(SEQ_LENS_OP, [INDEX_OUT, INDEX, INDEX, HOST_INDEX])
BATCH_INDICES_POSITIONS = OpSpec.of(BATCH_INDICES_OP, [INDEX_OUT, INDEX_OUT, INDEX, INDEX])
CHECK_PAGE_TABLE = OpSpec.of(
    CHECK_PAGE_TABLE_OP,
    [Operand(DType.int32, 1, mutable=True, on_host=True), INDEX, INDEX, INDEX, HOST_INDEX],
)


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


def append_spec(dtype: DType, layout: int, rows_dtype: DType | None = None) -> OpSpec:
    """k_cache, v_cache (CacheGeometry.kernel_operands), key, value,
    batch_indices, positions, page table. A copy moves bytes: fp8 data enters
    as uint8 (see storage_view). rows_dtype: the rows', where they are not the
    pool's (float rows into an int8 pool, which quantizes them)."""
    pool = Operand(storage_dtype(dtype), 5, mutable=True)
    rows = Operand(storage_dtype(rows_dtype or dtype), 3)
    return OpSpec.of(APPEND_OP, [pool, pool, rows, rows, *[INDEX] * 5], layout=layout, checked=1)


def mla_append_spec(dtype: DType) -> OpSpec:
    """ckv_cache, kpe_cache, ckv, kpe, batch_indices, positions, page table."""
    pool = Operand(storage_dtype(dtype), 3, mutable=True)
    rows = Operand(storage_dtype(dtype), 2)
    return OpSpec.of(APPEND_MLA_OP, [pool, pool, rows, rows, *[INDEX] * 5])


def gather_spec(dtype: DType, layout: int) -> OpSpec:
    """out_k, out_v, k_cache, v_cache (CacheGeometry.kernel_operands), page
    table, seq_indptr. An int8 pool's rows come out as float32 values."""
    rows = Operand(storage_dtype(gathered_dtype(dtype)), 3, mutable=True)
    pool = Operand(storage_dtype(dtype), 5)
    return OpSpec.of(GATHER_OP, [rows, rows, pool, pool, *[INDEX] * 4], layout=layout)


def gathered_dtype(dtype: DType) -> DType:
    """What `gather_kv` gives for a pool of dtype: its rows as stored, an
    int8 pool's as float32 values (codes times scales)."""
    return DType.float32 if dtype == DType.int8 else dtype


def seq_lens_from_page_table(
    kv_indptr: np.ndarray, kv_last_page_len: np.ndarray, page_size: int
) -> np.ndarray:
    """Sequence lengths of a CSR page table, computed on the host in NumPy.

    Parameters
    ----------
    kv_indptr : array_like of int, shape (B + 1,)
        Request b holds the pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``.
    kv_last_page_len : array_like of int, shape (B,)
        Tokens in each request's last page.
    page_size : int
        Tokens in a page.

    Returns
    -------
    seq_lens : np.ndarray of int64, shape (B,)
        ``seq_lens[b] = (pages(b) - 1) * page_size + kv_last_page_len[b]`` for a
        request with pages, ``pages(b) = kv_indptr[b + 1] - kv_indptr[b] > 0``;
        0 for a request without pages, whatever its kv_last_page_len.

    Checks nothing: check the table first where its values come from a caller
    (`check_page_table_on_host`). `get_seq_lens` is the kernel for arrays on a
    device.
    """
    pages = np.diff(np.asarray(kv_indptr, np.int64))
    last = np.asarray(kv_last_page_len, np.int64)
    return np.where(pages > 0, (pages - 1) * page_size + last, 0)


def _request_index_arrays(
    indptr_name: str, indptr: Array, per_request_name: str, per_request: Array
) -> tuple[Array, Array]:
    """(indptr [B + 1], per_request [B]) as int32 index arrays (another
    integer dtype narrowed by `as_int32_index`), checked 1-D and of one B."""
    indptr = as_int32_index(indptr_name, indptr)
    per_request = as_int32_index(per_request_name, per_request)
    check_index_array(per_request_name, per_request)
    check_index_array(indptr_name, indptr, per_request.shape[0] + 1)
    return indptr, per_request


def get_seq_lens(kv_indptr: Array, kv_last_page_len: Array, page_size: int) -> Array:
    """Sequence lengths of a paged batch: ``[B]`` int32.

    ``seq_lens[b] = max(pages(b) - 1, 0) * page_size + kv_last_page_len[b]``
    with ``pages(b) = kv_indptr[b + 1] - kv_indptr[b]``.

    kv_indptr: [B + 1], kv_last_page_len: [B], int32 (another integer dtype
    is narrowed to int32 after checking every value fits). Raises
    ValueError, as the ops taking a page table do (the kernel's own check),
    unless kv_indptr starts at 0 and never decreases, each kv_last_page_len
    is in [1, page_size] (0 for a request with no pages) and each length
    fits int32; for arrays on a GPU the check reads host copies (one
    synchronization).
    """
    kv_indptr, kv_last_page_len = _request_index_arrays(
        "kv_indptr", kv_indptr, "kv_last_page_len", kv_last_page_len
    )
    device = device_of(kv_indptr)
    check_device("kv_last_page_len", kv_last_page_len, device)
    page_size = check_int("page_size", page_size, 1)
    return _seq_lens_op(kv_indptr, kv_last_page_len, page_size, device, checked=True)


def _seq_lens_op(
    kv_indptr: Array, kv_last_page_len: Array, page_size: int, device: Device, checked: bool
) -> Array:
    """`get_seq_lens`'s kernel on int32 arrays of one batch; checked=False
    for a caller whose next op checks the page table itself."""
    seq_lens = empty(kv_last_page_len, kv_last_page_len.shape, DType.int32)
    run_op(
        SEQ_LENS,
        [
            seq_lens,
            contiguous(kv_indptr),
            contiguous(kv_last_page_len),
            np.array([page_size, int(checked)], np.int32),
        ],
        device,
    )
    return seq_lens


def get_batch_indices_positions(
    append_indptr: Array,
    seq_lens: Array,
    nnz: int,
    batch_indices: Array | None = None,
    positions: Array | None = None,
) -> tuple[Array, Array]:
    """The request and position of each appended token: two ``[nnz]`` int32 arrays.

    Token j of request b (``append_indptr[b] <= j < append_indptr[b + 1]``) gets
    ``batch_indices[j] = b`` and ``positions[j] = seq_lens[b] - append_len(b) +
    (j - append_indptr[b])``; ``seq_lens`` are lengths after the append.

    append_indptr: [B + 1], seq_lens: [B], int32 (or narrowed to it, as in
    :func:`get_seq_lens`). batch_indices, positions: optional contiguous,
    writable int32 [nnz] outputs on seq_lens' device, written in place and
    returned (FlashInfer's pre-allocated buffers); new arrays otherwise.
    """
    append_indptr, seq_lens = _request_index_arrays(
        "append_indptr", append_indptr, "seq_lens", seq_lens
    )
    device = device_of(seq_lens)
    check_device("append_indptr", append_indptr, device)
    nnz = check_int("nnz", nnz, 0)
    outputs = []
    for name, given in (("batch_indices", batch_indices), ("positions", positions)):
        if given is None:
            outputs.append(empty(seq_lens, (nnz,), DType.int32))
            continue
        check_array(name, given)
        if dtype_of(given) != DType.int32 or tuple(given.shape) != (nnz,):
            raise ValueError(
                f"{name} must be int32 [{nnz}], got {dtype_of(given)} {tuple(given.shape)}"
            )
        check_device(name, given, device)
        check_writable(name, given)
        if not is_contiguous(given):
            raise ValueError(f"{name} must be contiguous: it is written in place")
        outputs.append(given)
    batch_indices, positions = outputs
    run_op(
        BATCH_INDICES_POSITIONS,
        [batch_indices, positions, contiguous(append_indptr), contiguous(seq_lens)],
        device,
    )
    return batch_indices, positions


_APPEND_POSITIONS_FORM = (
    "batch_indices",
    "positions",
    "paged_kv_cache",
    "kv_indices",
    "kv_indptr",
    "kv_last_page_len",
    "kv_layout",
)
"""append_paged_kv_cache's parameters after (append_key, append_value), in
the batch_indices / positions form (FlashInfer >= 0.2)."""

_APPEND_INDPTR_FORM = (
    "append_indptr",
    "paged_kv_cache",
    "kv_indices",
    "kv_indptr",
    "kv_last_page_len",
    "kv_layout",
)
"""The same in the append_indptr form (FlashInfer's older docs)."""


_INDEX_ARGUMENTS = (
    "append_indptr",
    "batch_indices",
    "positions",
    "kv_indices",
    "kv_indptr",
    "kv_last_page_len",
)
"""The appends' index arrays: int32, or another integer dtype narrowed to it
after checking every value fits (FlashInfer's helpers give int64)."""


def _is_cache(x: object) -> bool:
    return isinstance(x, (tuple, list)) or len(getattr(x, "shape", ())) >= 4


def _is_append_indptr_form(args: tuple, kwargs: dict) -> bool:
    """Whether a call of append_paged_kv_cache, with args and kwargs after
    (append_key, append_value), is in the append_indptr form.

    It is if ``append_indptr`` is a keyword; otherwise, if ``batch_indices``
    is not a keyword and the fourth argument in all (``args[1]``) is given
    by position and is a cache (`_is_cache`: a tuple or list, or an array of
    4 or more dims), where the other form has ``positions`` (1 dim). Any
    other call is in the batch_indices / positions form.
    """
    if "append_indptr" in kwargs:
        return True
    return "batch_indices" not in kwargs and len(args) >= 2 and _is_cache(args[1])


def _append_arguments(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, object]:
    """args and kwargs named by one form's parameters (names; the last,
    kv_layout, defaults to "NHD"), by Python's rules for a call."""
    parameters = [
        inspect.Parameter(
            name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default="NHD" if name == "kv_layout" else inspect.Parameter.empty,
        )
        for name in names
    ]
    try:
        bound = inspect.Signature(parameters).bind(*args, **kwargs)
    except TypeError as e:
        # Which form the call was read in decides which arguments it lacks.
        form = "append_indptr" if names is _APPEND_INDPTR_FORM else "batch_indices / positions"
        raise TypeError(
            f"append_paged_kv_cache: {e}, reading the call in the {form} form (append_key, "
            f"append_value, {', '.join(names)}); a call is in the append_indptr form when its "
            "fourth argument is a cache (an array of 4 or more dims, or a (K, V) pair) or "
            "append_indptr is a keyword"
        ) from None
    bound.apply_defaults()
    return dict(bound.arguments)


def append_paged_kv_cache(append_key: Array, append_value: Array, *args, **kwargs) -> None:
    """Appends ragged K/V into the paged cache, in place.

    Two call forms. A call is in the append_indptr form when it passes
    ``append_indptr`` by keyword, or when it does not pass ``batch_indices``
    by keyword and its fourth argument is positional and a cache (a tuple or
    list, or an array of 4 or more dims); every other call is in the
    batch_indices / positions form:

    - ``(append_key, append_value, batch_indices, positions, paged_kv_cache,
      kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD")``: token i goes
      to request ``batch_indices[i]`` at position ``positions[i]`` (FlashInfer
      >= 0.2; build them with :func:`get_batch_indices_positions`).
    - ``(append_key, append_value, append_indptr, paged_kv_cache, kv_indices,
      kv_indptr, kv_last_page_len, kv_layout="NHD")``: request b appends rows
      ``append_indptr[b]:append_indptr[b + 1]`` at the end of its sequence
      (the older form in FlashInfer's docs).

    append_key, append_value: [nnz, num_kv_heads, head_dim], the cache's dtype
    (float32, float16 or bfloat16 for an int8 cache, which quantizes them).
    paged_kv_cache: [pages, 2, page_size, H, D] (NHD) / [pages, 2, H, page_size,
    D] (HND), or a (k_cache, v_cache) pair of [pages, page_size, H, D] /
    [pages, H, page_size, D]; an int8 cache's last axis is D + 4 (pagedkv's
    own format: a page's row codes, then their float32 scales). Page table
    (int32, or another integer dtype narrowed to it after checking): kv_indptr [B + 1],
    kv_indices [kv_indptr[-1]], kv_last_page_len [B], describing the batch
    after the append.
    """
    indptr_form = _is_append_indptr_form(args, kwargs)
    names = _APPEND_INDPTR_FORM if indptr_form else _APPEND_POSITIONS_FORM
    a = _append_arguments(names, args, kwargs)
    for name in _INDEX_ARGUMENTS:
        if name in a:
            a[name] = as_int32_index(name, a[name])
    geometry = cache_geometry("paged_kv_cache", a["paged_kv_cache"], a["kv_layout"])
    batch_size = check_page_table_arrays(
        geometry, a["kv_indices"], a["kv_indptr"], a["kv_last_page_len"]
    )
    nnz = check_rows("append_key", append_key, geometry)
    check_rows("append_value", append_value, geometry, nnz)
    if indptr_form:
        check_index_array("append_indptr", a["append_indptr"], batch_size + 1)
        check_device("append_indptr", a["append_indptr"], geometry.device)
        # The append op checks the page table's values before it writes.
        seq_lens = _seq_lens_op(
            a["kv_indptr"], a["kv_last_page_len"], geometry.page_size, geometry.device,
            checked=False,
        )  # fmt: skip
        batch_indices, positions = get_batch_indices_positions(a["append_indptr"], seq_lens, nnz)
    else:
        batch_indices, positions = a["batch_indices"], a["positions"]
        check_index_array("batch_indices", batch_indices, nnz)
        check_index_array("positions", positions, nnz)
        check_device("batch_indices", batch_indices, geometry.device)
        check_device("positions", positions, geometry.device)
    _append(
        geometry,
        append_key,
        append_value,
        batch_indices,
        positions,
        a["kv_indices"],
        a["kv_indptr"],
        a["kv_last_page_len"],
    )


def _append(
    geometry: CacheGeometry,
    append_key: Array,
    append_value: Array,
    batch_indices: Array,
    positions: Array,
    kv_indices: Array,
    kv_indptr: Array,
    kv_last_page_len: Array,
) -> None:
    run_op(
        append_spec(geometry.dtype, geometry.layout, dtype_of(append_key)),
        [
            *geometry.kernel_operands(),
            storage_view(contiguous(append_key)),
            storage_view(contiguous(append_value)),
            *_index_operands(batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len),
        ],
        geometry.device,
    )


def _index_operands(*arrays: Array) -> list[Array]:
    """The ops' int32 index operands (batch_indices, positions, the page
    table), each contiguous: the kernels index them as dense arrays."""
    return [contiguous(x) for x in arrays]


def append_paged_mla_kv_cache(
    append_ckv: Array,
    append_kpe: Array,
    batch_indices: Array,
    positions: Array,
    ckv_cache: Array,
    kpe_cache: Array,
    kv_indices: Array,
    kv_indptr: Array,
    kv_last_page_len: Array,
) -> None:
    """Appends MLA's compressed KV and rope part into their paged caches, in place.

    append_ckv: [nnz, ckv_dim]; append_kpe: [nnz, kpe_dim]; ckv_cache: [pages,
    page_size, ckv_dim]; kpe_cache: [pages, page_size, kpe_dim]; the page table
    as in :func:`append_paged_kv_cache`.
    """
    for name, x in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        check_array(name, x)
        if len(x.shape) != 3:
            raise ValueError(f"{name} must be [pages, page_size, dim], got {tuple(x.shape)}")
    if tuple(ckv_cache.shape[:2]) != tuple(kpe_cache.shape[:2]):
        raise ValueError("ckv_cache and kpe_cache must have the same pages and page size")
    # Each MLA pool is a one-head NHD pool: reuse the K/V checks on that view.
    ckv = cache_geometry("ckv_cache", (ckv_cache[:, :, None], ckv_cache[:, :, None]), "NHD")
    kpe = cache_geometry("kpe_cache", (kpe_cache[:, :, None], kpe_cache[:, :, None]), "NHD")
    if ckv.dtype != kpe.dtype or ckv.device != kpe.device:
        raise TypeError("ckv_cache and kpe_cache must share dtype and device")
    batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len = (
        as_int32_index(name, x)
        for name, x in zip(
            _INDEX_ARGUMENTS[1:],
            (batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len),
            strict=True,
        )
    )
    check_page_table_arrays(ckv, kv_indices, kv_indptr, kv_last_page_len)
    check_array("append_ckv", append_ckv)
    nnz = int(append_ckv.shape[0]) if len(append_ckv.shape) == 2 else -1
    for name, x, cache in (
        ("append_ckv", append_ckv, ckv_cache),
        ("append_kpe", append_kpe, kpe_cache),
    ):
        check_array(name, x)
        if tuple(x.shape) != (nnz, cache.shape[2]):
            raise ValueError(f"{name} must be [nnz, {cache.shape[2]}], got {tuple(x.shape)}")
        if dtype_of(x) != ckv.dtype:
            raise TypeError(f"{name} is {dtype_of(x).name} but the cache is {ckv.dtype.name}")
        check_device(name, x, ckv.device)
    check_index_array("batch_indices", batch_indices, nnz)
    check_index_array("positions", positions, nnz)
    check_device("batch_indices", batch_indices, ckv.device)
    check_device("positions", positions, ckv.device)
    run_op(
        mla_append_spec(ckv.dtype),
        [
            storage_view(ckv_cache),
            storage_view(kpe_cache),
            storage_view(contiguous(append_ckv)),
            storage_view(contiguous(append_kpe)),
            *_index_operands(batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len),
        ],
        ckv.device,
    )


def gather_kv(
    paged_kv_cache: Array | Sequence[Array],
    kv_indices: Array,
    kv_indptr: Array,
    kv_last_page_len: Array,
    kv_layout: str = "NHD",
    request: int | None = None,
) -> tuple[Array, Array, Array] | tuple[Array, Array]:
    """The contiguous K and V cached for a batch, or for one request of it.

    Returns ``(k, v, seq_indptr)`` with k, v ``[sum(seq_lens), H, D]`` (NHD
    order, whatever the pool's layout; the pool's dtype, float32 values for
    an int8 pool) and request b's tokens in rows
    ``seq_indptr[b]:seq_indptr[b + 1]``; with ``request=b``, ``(k, v)`` of that
    request alone, ``[seq_len(b), H, D]``. A debugging and reference tool: it
    reads the page table on the host.
    """
    geometry = cache_geometry("paged_kv_cache", paged_kv_cache, kv_layout, written=False)
    batch_size = check_page_table_arrays(geometry, kv_indices, kv_indptr, kv_last_page_len)
    indptr = host_index_copy("kv_indptr", kv_indptr)
    last = host_index_copy("kv_last_page_len", kv_last_page_len)
    # The output's size comes from these values: check them before sizing it.
    check_page_table_on_host(
        indptr,
        host_index_copy("kv_indices", kv_indices),
        last,
        geometry.page_size,
        geometry.num_pages,
    )
    indptr, last = indptr.astype(np.int64), last.astype(np.int64)
    if request is not None:
        request = check_int("request", request, 0)
        if not request < batch_size:
            raise ValueError(f"request {request} is outside the batch of {batch_size}")
        lo, hi = int(indptr[request]), int(indptr[request + 1])
        k, v, _ = gather_kv(
            paged_kv_cache,
            kv_indices[lo:hi],
            new_like(kv_indptr, np.array([0, hi - lo], np.int32)),
            new_like(kv_last_page_len, np.array([last[request]], np.int32)),
            kv_layout,
        )
        return k, v
    seq_lens = seq_lens_from_page_table(indptr, last, geometry.page_size)
    seq_indptr = new_like(kv_indptr, np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32))
    shape = (int(seq_lens.sum()), geometry.num_kv_heads, geometry.head_dim)
    k = empty(geometry.arrays[0], shape, gathered_dtype(geometry.dtype))
    v = empty(geometry.arrays[0], shape, gathered_dtype(geometry.dtype))
    run_op(
        gather_spec(geometry.dtype, geometry.layout),
        [
            storage_view(k),
            storage_view(v),
            *geometry.kernel_operands(),
            *_index_operands(kv_indices, kv_indptr, kv_last_page_len),
            seq_indptr,
        ],
        geometry.device,
    )
    return k, v, seq_indptr


COPY_PAGES = OpSpec.of(COPY_PAGES_OP, [Operand(DType.uint8, 2, mutable=True), INDEX, INDEX])


def copy_pages(
    paged_kv_cache: Array | Sequence[Array],
    src_pages: Array,
    dst_pages: Array,
    kv_layout: str = "NHD",
) -> None:
    """Copies whole pages (K and V) in place: page src_pages[i] onto
    dst_pages[i]. The copy-on-write step of forked requests.

    paged_kv_cache: a one-tensor pool or a (k_cache, v_cache) pair, any dtype.
    src_pages, dst_pages: [n] int32. Raises before copying anything if an id
    is outside the pool, a destination repeats, or a page is both read and
    written.
    """
    geometry = cache_geometry("paged_kv_cache", paged_kv_cache, kv_layout)  # checks it writable
    check_index_array("src_pages", src_pages)
    check_index_array("dst_pages", dst_pages, src_pages.shape[0])
    check_device("src_pages", src_pages, geometry.device)
    check_device("dst_pages", dst_pages, geometry.device)
    for pool in geometry.arrays:
        # Pages as rows of bytes: one compiled op for every dtype and layout.
        rows = _byte_view(pool)
        run_op(COPY_PAGES, [rows, contiguous(src_pages), contiguous(dst_pages)], geometry.device)


def _byte_view(pool: Array) -> Array:
    """A contiguous pool viewed (no copy) as [num_pages, page_bytes] uint8."""
    from ._ops.tensors import is_torch

    flat = pool.reshape(pool.shape[0], -1)
    if is_torch(flat):
        import torch

        return flat.view(torch.uint8)
    return flat.view(np.uint8)
