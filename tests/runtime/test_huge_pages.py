"""Host pools on 2 MiB pages: what `huge_page_zeros` returns, and that the
kernels write and read such a pool in place."""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from max.dtype import DType

import pagedkv.runtime
from conftest import bits
from pagedkv.cache.manager import PagedKVCacheManager
from pagedkv.runtime.huge_pages import HUGE_PAGE_BYTES, huge_page_zeros

PAGE, HEADS, DIM = 16, 4, 64
PAGES = 256
"""Pools of 8 MiB (float32) and 4 MiB (bfloat16): several huge pages."""

LINUX = sys.platform.startswith("linux")


def data_address(x) -> int:
    return x.data_ptr() if isinstance(x, torch.Tensor) else x.ctypes.data


def huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        low, high = (int(x, 16) for x in entry.split()[0].split("-"))
        if low <= address < high:
            return int(re.search(r"AnonHugePages:\s+(\d+) kB", entry).group(1))
    raise AssertionError(f"no mapping holds {address:#x}")


def transparent_huge_pages() -> str:
    """The system's THP mode: always, madvise or never ('' if unknown)."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    found = re.search(r"\[(\w+)\]", path.read_text()) if path.exists() else None
    return found.group(1) if found else ""


@pytest.mark.parametrize("name", ["huge_page_zeros", "demote_max_poller"])
def test_old_top_level_names_warn_and_are_the_runtime_ones(name):
    """pagedkv.huge_page_zeros and pagedkv.demote_max_poller moved to
    pagedkv.runtime; the old names still work, with a DeprecationWarning."""
    assert name not in pagedkv.__all__
    with pytest.warns(DeprecationWarning, match=f"pagedkv.runtime.{name}"):
        old = getattr(pagedkv, name)
    assert old is getattr(pagedkv.runtime, name)
    with pytest.warns(DeprecationWarning):
        exec(f"from pagedkv import {name}", {})
    with pytest.raises(AttributeError):
        pagedkv.no_such_name  # noqa: B018


@pytest.mark.parametrize("dtype,use_torch", [(DType.float32, False), (DType.bfloat16, True)])
def test_zeroed_aligned_writable_arrays(dtype, use_torch):
    shape = (PAGES, 2, PAGE, HEADS, DIM)
    x = huge_page_zeros(shape, dtype, use_torch=use_torch)
    assert isinstance(x, torch.Tensor if use_torch else np.ndarray)
    assert tuple(x.shape) == shape
    assert pagedkv.runtime.huge_page_zeros is huge_page_zeros
    if use_torch:
        assert x.dtype == torch.bfloat16 and x.is_contiguous() and not x.any()
    else:
        assert x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable
        assert not x.any()
    if LINUX:
        assert data_address(x) % HUGE_PAGE_BYTES == 0
    x[-1, 1, -1, -1, -1] = 3
    assert float(x[-1, 1, -1, -1, -1]) == 3


def test_small_arrays_are_plain_zeros():
    x = huge_page_zeros((2, 3), "float16")
    assert x.dtype == np.float16 and x.shape == (2, 3) and not x.any()
    assert huge_page_zeros(4, torch.bfloat16, use_torch=True).dtype == torch.bfloat16


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="shape must be integers >= 0"):
        huge_page_zeros((4, -1), "float32")
    with pytest.raises(ValueError, match="shape must be integers >= 0"):
        huge_page_zeros((4, 2.5), "float32")
    with pytest.raises(TypeError, match="NumPy has no bfloat16: pass use_torch=True"):
        huge_page_zeros((1 << 20,), "bfloat16")
    with pytest.raises(TypeError, match="not a dtype"):
        huge_page_zeros((4,), "float33")


def test_memory_outlives_the_array_through_its_views():
    view = huge_page_zeros((PAGES, 2, PAGE, HEADS, DIM), DType.float32)[3]
    gc.collect()
    view[...] = 7
    assert np.all(view == 7)
    tensor = huge_page_zeros((PAGES, 2, PAGE, HEADS, DIM), DType.bfloat16, use_torch=True)[5]
    gc.collect()
    tensor.fill_(2)
    assert bool((tensor == 2).all())


@pytest.mark.skipif(not LINUX, reason="/proc/self/smaps is Linux's")
def test_written_memory_lies_on_huge_pages():
    if transparent_huge_pages() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {transparent_huge_pages() or 'unknown'}")
    x = huge_page_zeros((4 * HUGE_PAGE_BYTES // 4,), DType.float32)
    x[:] = 1  # the pages exist once written
    assert huge_kib(data_address(x)) >= HUGE_PAGE_BYTES >> 10


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_manager_pools_take_appends_in_place(dtype, rng):
    manager = PagedKVCacheManager(PAGES, PAGE, HEADS, DIM, dtype=dtype)
    pool = manager.pools[0]
    if LINUX:
        assert data_address(pool) % HUGE_PAGE_BYTES == 0
    tokens = 300
    manager.add("a")
    manager.reserve(["a"], tokens)
    meta = manager.metadata(["a"], tokens)
    k = torch.from_numpy(rng.standard_normal((tokens, HEADS, DIM), np.float32))
    v = torch.from_numpy(rng.standard_normal((tokens, HEADS, DIM), np.float32))
    if dtype == "bfloat16":
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    else:
        k, v = k.numpy(), v.numpy()
    pagedkv.append_paged_kv_cache(
        k, v, meta.batch_indices, meta.positions, pool,
        meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len,
    )  # fmt: skip
    got_k, got_v = pagedkv.gather_kv(
        pool, meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len, request=0
    )
    assert np.array_equal(bits(got_k), bits(k)) and np.array_equal(bits(got_v), bits(v))
    # In place: the pool's own memory holds the rows, at the page table's slots.
    page, slot = int(meta.kv_indices[-1]), (tokens - 1) % PAGE
    assert np.array_equal(bits(pool[page, 1, slot]), bits(v[-1]))
