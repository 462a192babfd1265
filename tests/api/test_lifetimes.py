"""Ops keep no reference to the arrays they were given.

A serving loop calls append and decode millions of times: an op that kept its
inputs, outputs or the caller's pool alive would leak memory with every call.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import pagedkv


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_append_and_decode_release_their_arrays(kind):
    rng = np.random.default_rng(0)
    pages, page_size, heads, head_dim = 4, 16, 2, 64
    pool = rng.standard_normal((pages, 2, page_size, heads, head_dim), dtype=np.float32)
    key = rng.standard_normal((3, heads, head_dim), dtype=np.float32)
    q = rng.standard_normal((1, 2 * heads, head_dim), dtype=np.float32)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        pool, key, q = (torch.from_numpy(x) for x in (pool, key, q))
    indptr = np.array([0, 2], np.int32)
    indices = np.array([3, 1], np.int32)
    last = np.array([3], np.int32)

    pagedkv.append_paged_kv_cache(
        key,
        key,
        np.zeros(3, np.int32),
        np.array([16, 17, 18], np.int32),
        pool,
        indices,
        indptr,
        last,
    )
    wrapper = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    wrapper.plan(indptr, indices, last, 2 * heads, heads, head_dim, page_size)
    o, lse = wrapper.run(q, pool, return_lse=True)

    arrays = {"pool": pool, "key": key, "q": q, "o": o, "lse": lse}
    refs = {name: weakref.ref(x) for name, x in arrays.items()}
    del arrays, pool, key, q, o, lse
    gc.collect()
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert alive == [], f"still referenced after the calls: {alive}"
