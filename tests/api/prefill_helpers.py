"""What the prefill tests share: a random ragged batch over shuffled pages,
one planned and run prefill over it on the CPU or a GPU, and each request's
rows checked against the float64 reference."""

from __future__ import annotations

import numpy as np

import pagedkv
import reference
from conftest import as_f64, cast, to_device


def ragged_prefill(rng, config, shape, heads, page_size):
    """(batch, pool, q): the page table of requests shape [(cached tokens
    after the append, queries)], a pool [pages, 2, page in `layout`] of
    kv dtype and queries [nnz, Hq, D] of q dtype (torch for 16-bit and fp8
    dtypes); config (q dtype, kv dtype, layout), heads (Hq, Hkv, D)."""
    q_dtype, kv_dtype, layout = config
    lens, queries = zip(*shape, strict=True)
    batch = reference.paged_batch(rng, page_size, list(lens), list(queries))
    hq, hkv, d = heads
    page = (page_size, hkv, d) if layout == "NHD" else (hkv, page_size, d)
    pool = cast(rng.standard_normal((batch.num_pages, 2, *page), dtype=np.float32), kv_dtype)
    q = cast(rng.standard_normal((batch.nnz, hq, d), dtype=np.float32), q_dtype)
    return batch, pool, q


def run_prefill(config, batch, pool, q, device, **plan_options):
    """(o, lse) of a BatchPrefillWithPagedKVCacheWrapper planned for batch,
    the heads and page size of q and pool and plan_options, and run on
    device ("cpu": the arrays as made; "cuda": torch CUDA tensors of them)."""
    q_dtype, kv_dtype, layout = config
    if layout == "NHD":
        _, _, page_size, kv_heads, _ = pool.shape
    else:
        _, _, kv_heads, page_size, _ = pool.shape
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout)
    w.plan(
        *to_device(
            (batch.append_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len),
            device,
        ),
        q.shape[1],
        kv_heads,
        q.shape[2],
        page_size,
        q_data_type=q_dtype,
        kv_data_type=kv_dtype,
        **plan_options,
    )
    return w.run(to_device(q, device), to_device(pool, device), return_lse=True)


def request_rows(batch, pool, layout):
    """Per request: its rows lo:hi of the queries (its last hi - lo tokens),
    its cached K and V [L, Hkv, D] in float64 and its queries' positions."""
    refs = reference.gather(
        as_f64(pool), batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, layout
    )
    for b, (k, v) in enumerate(refs):
        lo, hi = batch.append_indptr[b], batch.append_indptr[b + 1]
        yield lo, hi, k, v, np.arange(len(k) - (hi - lo), len(k))


def assert_rows_match(o, lse, want_o, want_lse, tol) -> None:
    """o and lse of some rows against the reference's: lse where it is
    finite, -inf where it is not (a row that sees no key)."""
    np.testing.assert_allclose(as_f64(o), want_o, rtol=tol, atol=tol)
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(as_f64(lse)[finite], want_lse[finite], rtol=tol, atol=tol)
    assert (as_f64(lse)[~finite] == -np.inf).all()
