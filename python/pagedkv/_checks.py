"""Argument checks shared by the public entry points.

Static facts (types, dtypes, ranks, shapes, devices, contiguity) are checked
here, before any kernel runs; facts that depend on values (page ids, lengths,
positions) are checked by the kernels themselves on the host before they write
(see mojo_ops/page_ops/page_table.mojo). Either way the caller's cache is untouched
by a rejected call.

Scalars are checked here too: an integer option that the kernels take as
int32 must fit one, a float option must be a number (NaN is refused), and
every array a call writes must be writable (MAX would copy a read-only NumPy
array and drop the write).
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from max.dtype import DType

from ._ops.contract import KV_LAYOUTS, pool_head_dim
from ._ops.tensors import (
    Array,
    Device,
    check_array,
    device_of,
    dtype_of,
    is_contiguous,
    is_torch,
    new_like,
    storage_view,
    to_host_numpy,
)

CACHE_DTYPES = (
    DType.float32,
    DType.float16,
    DType.bfloat16,
    DType.float8_e4m3fn,
    DType.float8_e5m2,
    DType.int8,
)
"""A pool's dtypes. An int8 pool's rows are head_dim codes and a float32
scale (`pool_row_width`): float rows appended to it are quantized, and the
CPU attention kernel reads it."""
ROW_DTYPES_OF_INT8_POOLS = (DType.float32, DType.float16, DType.bfloat16)
"""What `append_paged_kv_cache` quantizes into an int8 pool."""


INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def check_int(name: str, value: Any, lo: int, hi: int = INT32_MAX) -> int:
    """value as a Python int, raising unless it is an integer (not a bool or a
    float) in [lo, hi]: the kernels take such options as int32."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
    if not lo <= number <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {number}")
    return number


def check_float(name: str, value: Any, *, positive: bool = False, finite: bool = True) -> float:
    """value as a float, raising TypeError for a non-number and ValueError
    for NaN or an infinity (unless finite=False) or, with positive, a value
    <= 0."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None
    if (finite and not math.isfinite(number)) or (positive and not number > 0):
        want = "a positive finite number" if positive else "a finite number"
        raise ValueError(f"{name} must be {want}, got {value!r}")
    return number


def check_scale(name: str, value: Any, *, positive: bool = False, finite: bool = True) -> float:
    """check_float of a scale given as a number or a one-element array (the
    fused bmm scales of FlashInfer's block-table and ragged calls)."""
    if hasattr(value, "shape"):
        if int(np.prod(value.shape)) != 1:
            raise ValueError(f"{name} as a tensor must hold one value")
        value = value.reshape(()).item()
    return check_float(name, value, positive=positive, finite=finite)


def checked_scales(
    q_scale: Any, k_scale: Any, v_scale: Any
) -> tuple[float | None, float | None, float | None]:
    """A run's q_scale, k_scale and v_scale (None: 1), each a number or a
    one-element array, as floats (`check_scale`). NaN and infinities pass: a
    scale is data, and NaN in data comes out as NaN
    (tests/api/test_reliability.py)."""
    return tuple(
        s if s is None or type(s) is float else check_scale(name, s, finite=False)
        for name, s in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale))
    )


def available_memory() -> int:
    """Bytes of host memory free for a new allocation: Linux's MemAvailable,
    or the physical memory where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_plan_size(what: str, count: int, bytes_each: int) -> None:
    """Raises ValueError (naming `what`, the entries counted) before a plan
    builds host arrays of `count` entries of `bytes_each` bytes (with their
    NumPy temporaries) that would take more than half of the host's
    available memory. Plans are sized by their index
    arrays' values (a qo_indptr ending near 2^31 asks for 2^31 queries), and
    run() would need data arrays larger still, so only tables no call could
    run get here; without the check they end in a MemoryError, or in the OOM
    killer on a host that overcommits. Plans under 1 MiB, a step's among
    them, are not measured: reading the host's memory costs tens of
    microseconds."""
    need = count * bytes_each
    if need <= 1 << 20:
        return
    have = available_memory()
    if need > have // 2:
        raise ValueError(
            f"{what} ({count}) would take {need / 2**30:.1f} GiB to plan, "
            f"more than half of the host's {have / 2**30:.1f} GiB available"
        )


def check_writable(name: str, x: Array) -> None:
    """Raises unless x can be written in place: MAX copies a read-only NumPy
    array, so a write into one would be lost without an error."""
    if not is_torch(x) and not x.flags.writeable:
        raise ValueError(f"{name} is read-only (flags.writeable is False): it is written in place")


def host_index_copy(name: str, x: Array) -> np.ndarray:
    """A host int32 copy of an index array that the caller's later edits cannot
    reach: `np.ascontiguousarray` and `Tensor.numpy()` may share memory."""
    return np.array(to_host_numpy(x), dtype=np.int32, order="C", copy=True)


def narrow_indices(name: str, x: Any, length: int | None = None) -> np.ndarray:
    """A 1-D integer array (any integer dtype, or a sequence) as a new int32
    array; raises ValueError, never wraps, for a value that int32 cannot hold."""
    values = np.asarray(to_host_numpy(x) if is_torch(x) else x)
    if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {values.shape}")
    if length is not None and values.size != length:
        raise ValueError(f"{name} must have {length} entries, got {values.size}")
    if values.size and values.dtype.itemsize >= 4 and values.dtype != np.int32:
        # Compared before the cast: astype would wrap 2**32 + 5 to 5.
        low, high = values.min(), values.max()
        if (values.dtype.kind == "i" and low < -INT32_MAX - 1) or high > INT32_MAX:
            i = int(np.flatnonzero((values > INT32_MAX) | (values < -INT32_MAX - 1))[0])
            raise ValueError(f"{name}[{i}] = {values[i]} does not fit in int32")
    return values.astype(np.int32)


WIDE_INDEX_DTYPES = (
    DType.int64,
    DType.uint32,
    DType.uint64,
    DType.int16,
    DType.uint16,
    DType.uint8,
)


def host_int_array(name: str, x: Any, ndim: int) -> np.ndarray:
    """x's values as a host int64 array of ndim dimensions (a copy from a
    device), raising ValueError for another rank or a non-integer dtype."""
    values = to_host_numpy(x) if is_torch(x) else np.asarray(x)
    if values.ndim != ndim or values.dtype.kind not in "iu":
        raise ValueError(
            f"{name} must be a {ndim}-D integer array, got {values.dtype} {values.shape}"
        )
    return values.astype(np.int64)


def as_int32_index(name: str, x: Array) -> Array:
    """x itself when it is int32; for another integer dtype (FlashInfer's own
    helpers give int64: `torch.cumsum` of int32 is int64) an int32 copy of x's
    kind and device, after checking every value fits (ValueError, never a
    wrap). Anything else comes back as it is, for check_index_array to refuse."""
    check_array(name, x)
    if dtype_of(x) not in WIDE_INDEX_DTYPES or len(x.shape) != 1:
        return x
    return new_like(x, narrow_indices(name, x))


def check_index_array(name: str, x: Array, length: int | None = None) -> None:
    """Raises unless x is a 1-D int32 array (of `length` entries if given)."""
    check_array(name, x)
    if dtype_of(x) != DType.int32:
        raise TypeError(f"{name} must be int32, got {dtype_of(x).name}")
    if len(x.shape) != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
    if length is not None and x.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries, got {x.shape[0]}")


def check_device(name: str, x: Array, device: Device) -> None:
    if device_of(x) != device:
        raise ValueError(f"{name} is on {device_of(x)} but the cache is on {device}")


def check_output(name: str, x: Array, shape: tuple[int, ...], dtype: DType, device: Device) -> None:
    """Raises unless x can take a kernel's output of this shape and dtype on
    device: written in place, so it must also be contiguous."""
    check_array(name, x)
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {list(x.shape)}")
    if dtype_of(x) != dtype:
        raise TypeError(f"{name} must be {dtype.name}, got {dtype_of(x).name}")
    check_device(name, x, device)
    if not is_contiguous(x):
        raise ValueError(f"{name} must be contiguous: it is written in place")
    check_writable(name, x)


GPU_ONLY_OPTIONS = {
    "o_sf_scale": None,
    "o_sf_vec_size": None,
    "skip_softmax_threshold_scale_factor": None,
    "kv_cache_sf": None,
    "enable_block_sparse_attention": False,
    "cp_world": 1,
    "causal_seqlens_kv_global": None,
    "bf16q_fp8kv_transform_mode": None,
    "request_order": None,
    "request_order_plan": None,
    "use_fp16_softmax": False,
    "uses_spcompress": False,
}
"""Options of FlashInfer's GPU kernels pagedkv has no form of (NVFP4
outputs, skip-softmax sparsity, float16 softmax, block sparsity, context
parallelism, ...), each at the value that leaves it off."""


APPROXIMATIONS = ("skip_softmax_threshold_scale_factor",)
"""GPU_ONLY_OPTIONS that only trade accuracy for speed: a call that takes
them (the block-table calls, as FlashInfer's trtllm-gen kernels do) computes
their exact limit, skipping nothing."""


def refuse_gpu_only(
    function: str, options: dict[str, Any], approximations: tuple[str, ...] = ()
) -> None:
    """Raises ValueError naming the GPU_ONLY_OPTIONS among options that are
    not at their off value (options a call's arguments by name; others are
    ignored). Those named in approximations (from APPROXIMATIONS) are taken
    instead when they are finite non-negative numbers."""
    for name in approximations:
        value = options.get(name)
        if value is not None:
            if check_float(name, value.item() if hasattr(value, "item") else value) < 0:
                raise ValueError(f"{function}: {name} must not be negative, got {value}")
    options = {k: v for k, v in options.items() if k not in approximations}

    def off(name: str, value: Any) -> bool:
        default = GPU_ONLY_OPTIONS[name]
        if default is None:
            return value is None
        return isinstance(value, (bool, int, float)) and value == default

    given = [k for k, v in options.items() if k in GPU_ONLY_OPTIONS and not off(k, v)]
    if given:
        raise ValueError(f"{function}: {', '.join(given)} are not supported by pagedkv")


def reject_cuda_graph(use_cuda_graph: bool, wrapper: str) -> None:
    """Raises for FlashInfer's use_cuda_graph=True on a wrapper that does not
    take fixed buffers (the paged decode and prefill wrappers do)."""
    if use_cuda_graph:
        raise ValueError(
            f"use_cuda_graph=True is not supported by {wrapper}; the paged decode and "
            "prefill wrappers take it with their fixed buffers"
        )


def layout_code(kv_layout: str) -> int:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    return KV_LAYOUTS[kv_layout]


@dataclass(slots=True)
class CacheGeometry:
    """What a paged K/V pool (one tensor or a K, V pair) holds.

    Not frozen: run() builds one per call, and a frozen dataclass's
    constructor costs about twice as much on a cold cache."""

    arrays: tuple[Array, ...]
    """(pool,) or (k_pool, v_pool)."""
    layout: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    device: Device

    @property
    def is_pair(self) -> bool:
        return len(self.arrays) == 2

    def kernel_operands(self) -> list[Array]:
        """The pool as the ops take it: k_cache, v_cache [pages, kv, ...page...].

        A one-tensor pool goes in twice (kv = 2); a (K, V) pair as views with
        kv = 1 (no copy). fp8 pools as bytes (MAX has no fp8 on the CPU).
        """
        if not self.is_pair:
            pool = storage_view(self.arrays[0])
            return [pool, pool]
        return [storage_view(x).reshape(x.shape[0], 1, *x.shape[1:]) for x in self.arrays]


def _one_token_pages(x: Any, layout: int, rank: int) -> Any:
    """x with the page dim of one token inserted (a view) when it has rank - 1
    dims: P goes before H in NHD (layout 0), after it in HND; else x."""
    if not (isinstance(x, np.ndarray) or is_torch(x)) or len(x.shape) != rank - 1:
        return x
    axis = -3 if layout == 0 else -2
    return x.unsqueeze(axis) if is_torch(x) else np.expand_dims(x, axis)


def cache_geometry(
    name: str, paged_kv_cache: Array | Sequence[Array], kv_layout: str, *, written: bool = True
) -> CacheGeometry:
    """Checks a pool and reads its geometry.

    paged_kv_cache: [pages, 2, P, H, D] (NHD) or [pages, 2, H, P, D] (HND), or a
    (K, V) pair of [pages, P, H, D] / [pages, H, P, D] arrays. Pages of one
    token may leave out P, as FlashInfer takes them ([pages, 2, H, D], or
    [pages, H, D] each): they are seen with it (a view). written: the call
    writes the pool, so it must be writable (False for reads alone).
    """
    layout = layout_code(kv_layout)
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"{name} as a sequence must be a (k_cache, v_cache) pair")
        arrays = tuple(_one_token_pages(x, layout, 4) for x in paged_kv_cache)
        for part, x in zip(("k_cache", "v_cache"), arrays, strict=True):
            check_array(f"{name} {part}", x)
            if len(x.shape) != 4:
                raise ValueError(
                    f"{name} {part} must be 4-D [pages, ...page...], got shape {tuple(x.shape)}"
                )
        if tuple(arrays[0].shape) != tuple(arrays[1].shape):
            raise ValueError(
                f"{name}: k_cache {tuple(arrays[0].shape)} and v_cache "
                f"{tuple(arrays[1].shape)} differ in shape"
            )
        if dtype_of(arrays[0]) != dtype_of(arrays[1]):
            raise TypeError(f"{name}: k_cache and v_cache differ in dtype")
        if device_of(arrays[0]) != device_of(arrays[1]):
            raise ValueError(f"{name}: k_cache and v_cache are on different devices")
        page = tuple(arrays[0].shape[1:])
    else:
        check_array(name, paged_kv_cache)
        paged_kv_cache = _one_token_pages(paged_kv_cache, layout, 5)
        arrays = (paged_kv_cache,)
        shape = tuple(paged_kv_cache.shape)
        if len(shape) != 5 or shape[1] != 2:
            raise ValueError(
                f"{name} must be [pages, 2, ...page...] (5-D) or a (k, v) pair, got shape {shape}"
            )
        page = shape[2:]
    for x in arrays:
        if not is_contiguous(x):
            raise ValueError(f"{name} must be contiguous: it is written in place and never copied")
        if written:
            check_writable(name, x)
    dtype = dtype_of(arrays[0])
    if dtype not in CACHE_DTYPES:
        raise TypeError(
            f"{name} dtype {dtype.name} is not supported "
            f"({', '.join(d.name for d in CACHE_DTYPES)})"
        )
    if layout == 0:
        page_size, heads, row_width = page
    else:
        heads, page_size, row_width = page
    head_dim = pool_head_dim(dtype, int(row_width))
    if head_dim < 1:
        raise ValueError(
            f"{name}: an int8 pool's last axis is head_dim + 4 (each row's codes and a "
            f"4-byte scale), got {row_width}"
        )
    if dtype == DType.int8 and device_of(arrays[0]).is_gpu:
        raise ValueError(f"{name}: int8 pools are read and written on the CPU")
    return CacheGeometry(
        arrays=arrays,
        layout=layout,
        num_pages=int(arrays[0].shape[0]),
        page_size=int(page_size),
        num_kv_heads=int(heads),
        head_dim=int(head_dim),
        dtype=dtype,
        device=device_of(arrays[0]),
    )


def check_page_table_arrays(
    geometry: CacheGeometry, kv_indices: Array, kv_indptr: Array, kv_last_page_len: Array
) -> int:
    """Checks the static facts of a CSR page table; returns the batch size."""
    check_index_array("kv_last_page_len", kv_last_page_len)
    batch_size = int(kv_last_page_len.shape[0])
    check_index_array("kv_indptr", kv_indptr, batch_size + 1)
    check_index_array("kv_indices", kv_indices)
    for name, x in (
        ("kv_indices", kv_indices),
        ("kv_indptr", kv_indptr),
        ("kv_last_page_len", kv_last_page_len),
    ):
        check_device(name, x, geometry.device)
    return batch_size


def check_rows(name: str, x: Array, geometry: CacheGeometry, nnz: int | None = None) -> int:
    """Checks new tokens' rows [nnz, num_kv_heads, head_dim] against the cache
    (the cache's dtype, or a float dtype for an int8 cache); returns nnz."""
    check_array(name, x)
    want = (geometry.num_kv_heads, geometry.head_dim)
    if len(x.shape) != 3 or tuple(x.shape[1:]) != want:
        raise ValueError(
            f"{name} must be [nnz, {want[0]}, {want[1]}] to match the cache, got "
            f"shape {tuple(x.shape)}"
        )
    if nnz is not None and x.shape[0] != nnz:
        raise ValueError(f"{name} has {x.shape[0]} rows, expected {nnz}")
    if geometry.dtype == DType.int8:
        if dtype_of(x) not in ROW_DTYPES_OF_INT8_POOLS:
            raise TypeError(
                f"{name} is {dtype_of(x).name}: an int8 cache takes float32, float16 or "
                "bfloat16 rows, which it quantizes"
            )
    elif dtype_of(x) != geometry.dtype:
        raise TypeError(f"{name} is {dtype_of(x).name} but the cache is {geometry.dtype.name}")
    check_device(name, x, geometry.device)
    return int(x.shape[0])
