"""BatchAttention (one plan and run for mixed prefill and decode) against
the float64 reference (tests/reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pagedkv
import reference

HQ, HKV, D, PAGE = 8, 2, 64, 16


@pytest.mark.parametrize("causal", [True, False])
def test_mixed_prefill_and_decode_match_reference(causal):
    rng = np.random.default_rng(7)
    lens, q_lens = [50, 33, 1, 17, 64], [50, 1, 1, 9, 1]
    batch = reference.paged_batch(rng, PAGE, lens, q_lens)
    pool = rng.standard_normal((batch.num_pages, 2, PAGE, HKV, D), dtype=np.float32)
    q = rng.standard_normal((sum(q_lens), HQ, D), dtype=np.float32)
    w = pagedkv.BatchAttention(kv_layout="NHD", device="cpu")
    w.plan(
        torch.from_numpy(batch.append_indptr), torch.from_numpy(batch.kv_indptr),
        torch.from_numpy(batch.kv_indices), torch.from_numpy(batch.seq_lens),
        HQ, HKV, D, D, PAGE, causal=causal, sm_scale=0.1,
        q_data_type=torch.float32, kv_data_type=torch.float32,
    )  # fmt: skip
    w.prewarm_paged_kv_stride_variant()
    o, lse = w.run(torch.from_numpy(q), torch.from_numpy(pool), v_scale=torch.tensor(0.5))
    kv = reference.gather(pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD")
    row = 0
    for (k, v), n in zip(kv, q_lens, strict=True):
        positions = np.arange(len(k) - n, len(k))
        want_o, want_lse = reference.attention(
            q[row : row + n], k, v, positions, causal=causal, sm_scale=0.1, v_scale=0.5
        )
        np.testing.assert_allclose(o[row : row + n].numpy(), want_o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse[row : row + n].numpy(), want_lse, rtol=1e-5, atol=1e-5)
        row += n


@pytest.mark.parametrize(
    ("kv_len_arr", "change", "message"),
    [
        ([40, 20], {}, "do not fill"),
        ([33, 16], {"head_dim_vo": 128}, "head_dim_vo"),
        ([33, 16], {"use_profiler": True}, "profiler"),
    ],
)
def test_batch_attention_refusals(kv_len_arr, change, message):
    args = dict(
        qo_indptr=np.array([0, 1, 2], np.int32), kv_indptr=np.array([0, 3, 4], np.int32),
        kv_indices=np.arange(4, dtype=np.int32), kv_len_arr=np.array(kv_len_arr, np.int32),
        num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, head_dim_vo=D, page_size=PAGE,
    ) | change  # fmt: skip
    with pytest.raises(ValueError, match=message):
        pagedkv.BatchAttention().plan(**args)


def test_run_before_plan_and_an_unplanned_soft_cap_raise():
    w = pagedkv.BatchAttention()
    with pytest.raises(RuntimeError):
        w.run(np.zeros((1, HQ, D), np.float32), np.zeros((1, 2, PAGE, HKV, D), np.float32))
    w.plan(
        np.array([0, 1], np.int32), np.array([0, 1], np.int32), np.array([0], np.int32),
        np.array([5], np.int32), HQ, HKV, D, D, PAGE, q_data_type="float32",
        kv_data_type="float32",
    )  # fmt: skip
    with pytest.raises(ValueError, match="logits_soft_cap"):
        w.run(
            np.zeros((1, HQ, D), np.float32), np.zeros((1, 2, PAGE, HKV, D), np.float32),
            logits_soft_cap=30.0,
        )  # fmt: skip
