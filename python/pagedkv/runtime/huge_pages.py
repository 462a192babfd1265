"""Host memory for KV page pools on 2 MiB pages.

Decode reads a pool's pages in the order of the page tables, which after a
while of serving is no order at all. On 4 KiB pages every few tokens of a
page are a TLB miss whose page-table walk goes to memory too. On 2 MiB pages
one TLB entry covers hundreds of tokens; decode on such a pool took up to
15% less time (docs/design.md). NumPy already
advises its own large arrays onto huge pages. torch does not, and bfloat16
pools are torch tensors.
"""

from __future__ import annotations

import mmap
import numbers
from collections.abc import Sequence

import numpy as np
from max.dtype import DType

from .._ops.tensors import FP8_FORMATS, Array
from .._plan.work import as_dtype

HUGE_PAGE_BYTES = 2 << 20
"""An x86-64 (and 4 KiB-granule Arm) transparent huge page."""


def huge_page_zeros(
    shape: int | Sequence[int], dtype: object = "float32", use_torch: bool = False
) -> Array:
    """A zeroed, C-contiguous host array of `shape` whose memory starts on a
    2 MiB boundary and is advised onto transparent huge pages.

    dtype: a MAX DType, a torch or NumPy dtype, or a name ("bfloat16").
    Returns a NumPy array, or a torch tensor (CPU) with use_torch; bfloat16
    and fp8 need torch. The memory is an anonymous mapping, zero until
    written, and lives as long as the array (or any view of it). Where the
    system cannot advise (not Linux) or the array is smaller than a huge
    page, this is a plain zeroed array.
    """
    dims = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
    if not all(isinstance(n, numbers.Integral) and n >= 0 for n in dims):
        raise ValueError(f"shape must be integers >= 0, got {shape!r}")
    dims = tuple(int(n) for n in dims)
    dtype = as_dtype(dtype, "dtype")
    if not use_torch and dtype in (DType.bfloat16, *FP8_FORMATS):
        raise TypeError(f"NumPy has no {dtype.name}: pass use_torch=True")
    nbytes = int(np.prod(dims)) * dtype.size_in_bytes
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return _plain_zeros(dims, dtype, use_torch)
    # Private: a shared anonymous mapping is shmem, whose huge pages are a
    # separate setting that is usually off.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    # A page's worth more than asked, so that the array can start on a huge
    # page's boundary: only whole aligned 2 MiB extents can be huge pages.
    raw = np.frombuffer(region, np.uint8)  # holds the mapping open
    start = -raw.ctypes.data % HUGE_PAGE_BYTES
    data = raw[start : start + nbytes]
    if use_torch:
        import torch

        return torch.from_numpy(data).view(getattr(torch, dtype.name)).view(dims)
    return data.view(dtype.to_numpy()).reshape(dims)


def _plain_zeros(shape: tuple[int, ...], dtype: DType, use_torch: bool) -> Array:
    if use_torch:
        import torch

        return torch.zeros(shape, dtype=getattr(torch, dtype.name))
    return np.zeros(shape, dtype.to_numpy())
