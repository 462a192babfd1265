"""FlashInfer's POD wrappers (pagedkv.pod): a prefill and a decode in one
run(), each side against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
import reference

HEADS, KV_HEADS, DIM, PAGE = 8, 2, 64, 16


def paged_side(rng, lens, q_lens):
    """A page table over a fresh pool and the queries of each request."""
    batch = reference.paged_batch(rng, PAGE, list(lens), [0] * len(lens))
    pool = rng.standard_normal((batch.num_pages, 2, PAGE, KV_HEADS, DIM), dtype=np.float32)
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qo_indptr[-1]), HEADS, DIM), dtype=np.float32)
    return batch, pool, qo_indptr, q


def paged_reference(batch, pool, qo_indptr, q, causal):
    """float64 attention of each request's queries, the last ones of its keys."""
    outs, lses = [], []
    gathered = reference.gather(
        pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD"
    )
    for b, (k, v) in enumerate(gathered):
        rows = q[qo_indptr[b] : qo_indptr[b + 1]]
        positions = np.arange(len(k) - len(rows), len(k))
        o, lse = reference.attention(rows, k, v, positions, causal=causal)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


@pytest.mark.parametrize("causal", [True, False])
def test_pod_runs_one_prefill_beside_a_batch_decode(causal):
    rng = np.random.default_rng(1)
    q_p = rng.standard_normal((37, HEADS, DIM), dtype=np.float32)
    k_p, v_p = rng.standard_normal((2, 37, KV_HEADS, DIM), dtype=np.float32)
    batch, pool, _, q_d = paged_side(rng, (70, 3, 33), (1, 1, 1))
    pod = pagedkv.PODWithPagedKVCacheWrapper(None, "NHD")
    pod.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HEADS, KV_HEADS, DIM, PAGE)
    o_p, o_d = pod.run(q_p, k_p, v_p, q_d, pool, causal_p=causal)
    want_p, _ = reference.attention(q_p, k_p, v_p, np.arange(37), causal=causal)
    want_d, _ = paged_reference(batch, pool, np.arange(4, dtype=np.int32), q_d, True)
    np.testing.assert_allclose(o_p, want_p, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o_d, want_d, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="causal_d is not supported"):
        pod.run(q_p, k_p, v_p, q_d, pool, causal_d=True)
    with pytest.raises(RuntimeError, match="before plan"):
        pagedkv.PODWithPagedKVCacheWrapper().run(q_p, k_p, v_p, q_d, pool)


def test_batch_pod_runs_paged_prefill_beside_paged_decode():
    """Both sides over pages of one pool; the prefill side causal or not as
    run() says (planned once each), the decode side's queries seeing all
    their keys; return_lse gives ((out_p, out_d), (lse_p, lse_d))."""
    rng = np.random.default_rng(2)
    pre, pool_p, qo_p, q_p = paged_side(rng, (40, 21), (9, 21))
    dec, pool_d, qo_d, q_d = paged_side(rng, (50, 5, 17), (1, 2, 1))
    pod = pagedkv.BatchPODWithPagedKVCacheWrapper(None, "NHD")
    pod.plan(
        qo_p, pre.kv_indptr, pre.kv_indices, pre.kv_last_page_len,
        qo_d, dec.kv_indptr, dec.kv_indices, dec.kv_last_page_len,
        HEADS, KV_HEADS, DIM, PAGE,
    )  # fmt: skip
    for causal in (True, False, True):
        (o_p, o_d), (lse_p, lse_d) = pod.run(
            q_p, pool_p, q_d, pool_d, causal_p=causal, return_lse=True
        )
        want_p, want_lse_p = paged_reference(pre, pool_p, qo_p, q_p, causal)
        want_d, want_lse_d = paged_reference(dec, pool_d, qo_d, q_d, False)
        np.testing.assert_allclose(o_p, want_p, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(o_d, want_d, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse_p, want_lse_p, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse_d, want_lse_d, rtol=1e-5, atol=1e-5)
    o_p, o_d = pod.run(q_p, pool_p, q_d, pool_d)
    np.testing.assert_allclose(o_p, paged_reference(pre, pool_p, qo_p, q_p, False)[0], atol=1e-5)
    with pytest.raises(RuntimeError, match="before plan"):
        pagedkv.BatchPODWithPagedKVCacheWrapper().run(q_p, pool_p, q_d, pool_d)


def test_flashinfer_pod_module_names_them():
    from pagedkv.flashinfer_compat import pod

    assert pod.PODWithPagedKVCacheWrapper is pagedkv.PODWithPagedKVCacheWrapper
    assert pod.BatchPODWithPagedKVCacheWrapper is pagedkv.BatchPODWithPagedKVCacheWrapper
