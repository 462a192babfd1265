"""fp8 queries and an output dtype of the caller's on the decode and prefill
wrappers (pagedkv._plan.io_dtypes).

An fp8 query is widened to bfloat16 for the kernel, which is exact, so its
output is bitwise the output of the same query given in bfloat16, cast to
the output dtype; without o_data_type the output takes the query's dtype as
given (fp8 too), as FlashInfer's. The float32 outputs are also held to a
float64 reference of the fp8 values. Bad output dtypes raise before anything
is written.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pagedkv
import reference

E4M3 = torch.float8_e4m3fn
PAGE, HQ, HKV, D = 16, 4, 2, 64
LENS = [5, 33, 17]


def batch_and_cache(rng):
    batch = reference.paged_batch(rng, PAGE, LENS, [1] * len(LENS))
    pool = torch.from_numpy(
        rng.standard_normal((batch.num_pages, 2, PAGE, HKV, D), dtype=np.float32)
    ).to(torch.bfloat16)
    return batch, pool


def float64_reference(batch, pool, q_rows, causal_rows):
    """o [rows, Hq, D] in float64 from the cache's and the query's values."""
    k, v = pool.float().numpy()[:, 0], pool.float().numpy()[:, 1]
    out = []
    for b, rows in enumerate(causal_rows):
        pages = batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]]
        n = int(batch.seq_lens[b])
        kb = k[pages].reshape(-1, HKV, D)[:n].astype(np.float64)
        vb = v[pages].reshape(-1, HKV, D)[:n].astype(np.float64)
        q = q_rows[rows].astype(np.float64)
        positions = np.arange(n - len(q), n)
        out.append(reference.attention(q, kb, vb, positions)[0])
    return np.concatenate(out)


def decode(batch, **plan):
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    w.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE, **plan)
    return w


def prefill(batch, qo_indptr, **plan):
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD")
    w.plan(
        qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
        causal=True, **plan,
    )  # fmt: skip
    return w


@pytest.mark.parametrize("o_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_decode_fp8_query_is_the_bfloat16_one_cast(o_dtype):
    rng = np.random.default_rng(1)
    batch, pool = batch_and_cache(rng)
    q = torch.from_numpy(rng.standard_normal((len(LENS), HQ, D), dtype=np.float32)).to(E4M3)
    o = decode(batch, q_data_type=E4M3, kv_data_type=torch.bfloat16, o_data_type=o_dtype).run(
        q, pool
    )
    widened = decode(batch, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16).run(
        q.to(torch.bfloat16), pool
    )
    assert o.dtype == (o_dtype or E4M3)
    assert torch.equal(o.view(torch.uint8) if o.dtype == E4M3 else o, _cast(widened, o.dtype))
    if o_dtype == torch.float32:
        want = float64_reference(batch, pool, q.float().numpy(), [[b] for b in range(len(LENS))])
        np.testing.assert_allclose(o.numpy(), want, rtol=2e-2, atol=2e-2)


def test_prefill_fp8_query_into_a_float32_out():
    rng = np.random.default_rng(2)
    batch, pool = batch_and_cache(rng)
    qo_indptr = np.array([0, 2, 5, 6], np.int32)
    q = torch.from_numpy(rng.standard_normal((6, HQ, D), dtype=np.float32)).to(E4M3)
    out = torch.full((6, HQ, D), float("nan"))
    w = prefill(batch, qo_indptr, q_data_type=E4M3, kv_data_type=torch.bfloat16,
                o_data_type=torch.float32)  # fmt: skip
    o = w.run(q, pool, out=out)
    assert o is out
    widened = prefill(batch, qo_indptr, q_data_type=torch.bfloat16).run(q.to(torch.bfloat16), pool)
    assert torch.equal(out, widened.float())
    rows = [list(range(qo_indptr[b], qo_indptr[b + 1])) for b in range(len(LENS))]
    want = float64_reference(batch, pool, q.float().numpy(), rows)
    np.testing.assert_allclose(out.numpy(), want, rtol=2e-2, atol=2e-2)


def test_an_out_of_another_dtype_is_refused_before_anything_is_written():
    rng = np.random.default_rng(3)
    batch, pool = batch_and_cache(rng)
    q = torch.from_numpy(rng.standard_normal((len(LENS), HQ, D), dtype=np.float32)).to(E4M3)
    w = decode(batch, q_data_type=E4M3, kv_data_type=torch.bfloat16, o_data_type=torch.float32)
    out = torch.full((len(LENS), HQ, D), 7.0, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="out must be float32"):
        w.run(q, pool, out=out)
    assert (out == 7).all()
    with pytest.raises(TypeError, match="o_data_type must be one of"):
        decode(batch, q_data_type=torch.bfloat16, o_data_type=torch.int32)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = x.to(dtype)
    return y.view(torch.uint8) if dtype == E4M3 else y
