"""Attention sinks (gpt-oss) in decode, paged and ragged prefill, the sink
wrapper and the block-table entry points, against the float64 reference
with its sink term (tests/reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pagedkv
import reference

HQ, HKV, D, PAGE = 8, 2, 64, 16


def case(seed, lens, q_lens):
    rng = np.random.default_rng(seed)
    batch = reference.paged_batch(rng, PAGE, lens, q_lens)
    pool = rng.standard_normal((batch.num_pages, 2, PAGE, HKV, D), dtype=np.float32)
    q = rng.standard_normal((sum(q_lens), HQ, D), dtype=np.float32)
    sinks = (rng.random(HQ) * 5).astype(np.float32)
    return batch, pool, q, sinks


def expected(batch, pool, q, sinks, sm_scale=None, causal=True, window_left=-1):
    kv = reference.gather(pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD")
    outs, lses, row = [], [], 0
    for (k, v), n in zip(kv, batch.append_lens, strict=True):
        positions = np.arange(len(k) - n, len(k))
        o, lse = reference.attention(
            q[row : row + n], k, v, positions, causal=causal, sm_scale=sm_scale,
            window_left=window_left, sinks=sinks,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
        row += n
    return np.concatenate(outs), np.concatenate(lses)


def test_decode_with_sinks_matches_reference():
    batch, pool, q, sinks = case(1, [40, 1, 100], [1, 1, 1])
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE)
    o, lse = w.run(q, pool, return_lse=True, sinks=torch.from_numpy(sinks))
    want_o, want_lse = expected(batch, pool, q, sinks)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    plain = w.run(q, pool)
    assert np.abs(plain - o).max() > 1e-2  # the sinks changed the answer


@pytest.mark.parametrize("causal", [True, False])
def test_paged_prefill_with_sinks_matches_reference(causal):
    batch, pool, q, sinks = case(2, [50, 17, 30], [50, 5, 1])
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper()
    w.plan(
        batch.append_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
        HQ, HKV, D, PAGE, causal=causal, window_left=20,
    )  # fmt: skip
    out = np.empty_like(q)
    o = w.run(q, pool, sinks=sinks, out=out)
    assert o is out
    want_o, _ = expected(batch, pool, q, sinks, causal=causal, window_left=20)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)


def test_ragged_prefill_with_sinks_matches_reference():
    rng = np.random.default_rng(3)
    q_lens, kv_lens = [6, 20], [6, 33]
    qo_indptr = np.array([0, 6, 26], np.int32)
    kv_indptr = np.array([0, 6, 39], np.int32)
    q = rng.standard_normal((26, HQ, D), dtype=np.float32)
    k = rng.standard_normal((39, HKV, D), dtype=np.float32)
    v = rng.standard_normal((39, HKV, D), dtype=np.float32)
    sinks = (rng.random(HQ) * 5).astype(np.float32)
    w = pagedkv.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(qo_indptr, kv_indptr, HQ, HKV, D, causal=True)
    o = w.run(q, k, v, sinks=sinks)
    for b in range(2):
        qs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        positions = np.arange(kv_lens[b] - q_lens[b], kv_lens[b])
        want, _ = reference.attention(q[qs], k[ks], v[ks], positions, sinks=sinks)
        np.testing.assert_allclose(o[qs], want, rtol=1e-5, atol=1e-5)


SINK_JIT_ARGS = (
    "batch_prefill_attention_sink_f32_swa_False_fa2", torch.float32, torch.float32,
    torch.float32, torch.int32, D, D, ["sink"], ["float"], ["sm_scale"], ["double"],
    "AttentionSink", "",
)  # fmt: skip
"""FlashInfer's attention-sink JIT variant as its gpt-oss tests name it."""


def test_ragged_sink_variant_takes_sink_and_scale_with_each_run():
    """jit_args naming FlashInfer's AttentionSink variant: run(q, k, v, sink,
    sm_scale) replaces the plan's scale and adds the sinks; other variants
    and stray run() arguments are refused."""
    rng = np.random.default_rng(7)
    qo_indptr, kv_indptr = np.array([0, 4, 9], np.int32), np.array([0, 10, 15], np.int32)
    q = rng.standard_normal((9, HQ, D), dtype=np.float32)
    k = rng.standard_normal((15, HKV, D), dtype=np.float32)
    v = rng.standard_normal((15, HKV, D), dtype=np.float32)
    sinks = (rng.random(HQ) * 5).astype(np.float32)
    w = pagedkv.BatchPrefillWithRaggedKVCacheWrapper(
        None, "NHD", backend="fa3", jit_args=SINK_JIT_ARGS,
        jit_kwargs={"use_sliding_window": False},
    )  # fmt: skip
    w.plan(qo_indptr, kv_indptr, HQ, HKV, D, causal=True)
    for sm_scale in (0.07, 0.2):
        o = w.run(q, k, v, sinks, sm_scale)
        for b in range(2):
            qs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
            n, length = qs.stop - qs.start, ks.stop - ks.start
            want, _ = reference.attention(q[qs], k[ks], v[ks], np.arange(length - n, length),
                                          sm_scale=sm_scale, sinks=sinks)  # fmt: skip
            np.testing.assert_allclose(o[qs], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attention-sink variant"):
        pagedkv.BatchPrefillWithRaggedKVCacheWrapper(jit_args=SINK_JIT_ARGS[:11] + ("Other", ""))
    plain = pagedkv.BatchPrefillWithRaggedKVCacheWrapper()
    plain.plan(qo_indptr, kv_indptr, HQ, HKV, D)
    with pytest.raises(TypeError, match="sink variant's jit_args|attention-sink"):
        plain.run(q, k, v, sinks, 0.1)


def test_sink_wrapper_takes_sink_and_scale_with_each_run():
    batch, pool, q, sinks = case(4, [33, 64], [3, 64])
    w = pagedkv.BatchAttentionWithAttentionSinkWrapper(None, "NHD", head_dim_qk=D, head_dim_vo=D)
    w.plan(
        batch.append_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
        HQ, HKV, D, PAGE, causal=True,
    )  # fmt: skip
    for sm_scale in (0.05, 0.3):
        o = w.run(torch.from_numpy(q), torch.from_numpy(pool), torch.from_numpy(sinks), sm_scale)
        want_o, _ = expected(batch, pool, q, sinks, sm_scale=sm_scale)
        np.testing.assert_allclose(o.numpy(), want_o, rtol=1e-5, atol=1e-5)


def test_block_table_decode_takes_sinks_as_a_list():
    batch, pool, q, sinks = case(5, [40, 70], [1, 1])
    table = np.zeros((2, 5), np.int32)
    for b in range(2):
        pages = batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]]
        table[b, : len(pages)] = pages
    o = pagedkv.trtllm_batch_decode_with_kv_cache(
        torch.from_numpy(q), torch.from_numpy(pool), None, torch.from_numpy(table),
        torch.from_numpy(batch.seq_lens), 80, bmm1_scale=0.125, kv_layout="NHD",
        sinks=[torch.from_numpy(sinks)],
    )  # fmt: skip
    want_o, _ = expected(batch, pool, q, sinks, sm_scale=0.125)
    np.testing.assert_allclose(o.numpy(), want_o, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("sinks", "message"),
    [(np.zeros(HQ + 1, np.float32), r"\[num_qo_heads\]"), (np.full(HQ, np.nan), "finite")],
)
def test_bad_sinks_raise_before_writing(sinks, message):
    batch, pool, q, _ = case(6, [40], [1])
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE)
    out = np.full_like(q, 7.0)
    with pytest.raises(ValueError, match=message):
        w.run(q, pool, sinks=sinks, out=out)
    assert (out == 7.0).all()
