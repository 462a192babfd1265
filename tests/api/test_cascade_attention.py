"""Cascade attention against float64 attention over each request's whole
key sequence (shared prefix, then its own keys), and the masked in-place merge.

Tolerances as in test_decode.py for float32.
"""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from conftest import as_f64, to_device, to_numpy
from reference import attention

HQ, HKV, D, PAGE = 8, 2, 64, 4
ATOL, RTOL = 2e-5, 2e-5


def pool_with(rng, num_pages, layout):
    """A pool [pages, 2, ...] of random values and its per-token view [pages * PAGE, ...]."""
    shape = (num_pages, 2, PAGE, HKV, D) if layout == "NHD" else (num_pages, 2, HKV, PAGE, D)
    return rng.standard_normal(shape, dtype=np.float32)


def tokens(pool, pages, length, layout):
    """K and V [length, HKV, D] of the tokens in `pages` (in order)."""
    kv = pool[np.asarray(pages)]  # [n, 2, ...]
    if layout == "HND":
        kv = kv.transpose(0, 1, 3, 2, 4)
    k = kv[:, 0].reshape(-1, HKV, D)[:length]
    v = kv[:, 1].reshape(-1, HKV, D)[:length]
    return k, v


def table(page_lists, lengths):
    indptr = np.concatenate([[0], np.cumsum([len(p) for p in page_lists])]).astype(np.int32)
    indices = np.concatenate([np.asarray(p, np.int32) for p in page_lists])
    pairs = zip(page_lists, lengths, strict=True)
    last = np.array([n - (len(p) - 1) * PAGE for p, n in pairs], np.int32)
    return indptr, indices, last


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True])
def test_two_and_three_levels_equal_attention_over_the_whole_sequence(layout, causal):
    check_levels(layout, causal)


def check_levels(layout: str, causal: bool, device: str = "cpu") -> None:
    """Two and three levels against attention over each whole sequence, with
    every array on `device` ("cpu": NumPy; "cuda": torch)."""
    rng = np.random.default_rng(0)
    pool = pool_with(rng, 40, layout)
    # Level 0: one prefix of 9 tokens shared by all 3 requests; level 1: two
    # requests share 5 more; level 2: each request's own tokens.
    shared, mid, own = [0, 1, 2], [[3, 4], [3, 4], [5]], [[6, 7], [8], [9, 10, 11]]
    shared_len, mid_lens, own_lens = 9, [5, 5, 3], [6, 2, 10]
    qo_lens = [2, 1, 3]  # the last tokens of each request are its queries
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qo[-1]), HQ, D), dtype=np.float32)
    levels = [
        (np.array([0, qo[-1]], np.int32), *table([shared], [shared_len])),
        (np.array([0, qo[2], qo[3]], np.int32), *table([mid[0], mid[2]], [5, 3])),
        (qo, *table(own, own_lens)),
    ]
    for num_levels in (2, 3):
        used = levels[:1] + levels[-1:] if num_levels == 2 else levels
        w = pagedkv.MultiLevelCascadeAttentionWrapper(num_levels, None, layout)
        arrays = (list(to_device(t, device)) for t in zip(*used, strict=True))
        w.plan(*arrays, HQ, HKV, D, PAGE, causal=causal)
        o = as_f64(w.run(to_device(q, device), to_device(pool, device)))
        for r in range(3):
            pages = shared + (mid[r] if num_levels == 3 else []) + own[r]
            k, v = [], []
            for part, n in (
                [(shared, shared_len)]
                + ([(mid[r], mid_lens[r])] if num_levels == 3 else [])
                + [(own[r], own_lens[r])]
            ):
                kp, vp = tokens(pool, part, n, layout)
                k.append(kp)
                v.append(vp)
            k, v = np.concatenate(k), np.concatenate(v)
            total = len(k)
            positions = np.arange(total - qo_lens[r], total)
            want, _ = attention(q[qo[r] : qo[r + 1]], k, v, positions, causal=causal)
            np.testing.assert_allclose(o[qo[r] : qo[r + 1]], want, atol=ATOL, rtol=RTOL)
            assert pages  # every request had keys at every level


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_shared_prefix_decode_and_prefill_equal_attention_over_prefix_and_own_keys(layout):
    check_shared_prefix(layout)


def check_shared_prefix(layout: str, device: str = "cpu") -> None:
    """The shared-prefix decode and prefill wrappers against attention over
    prefix and own keys, with every array on `device`."""
    rng = np.random.default_rng(1)
    pool = pool_with(rng, 12, layout)
    prefix = 11
    k_shared = rng.standard_normal((prefix, HKV, D), dtype=np.float32)
    v_shared = rng.standard_normal((prefix, HKV, D), dtype=np.float32)
    if layout == "HND":
        k_in, v_in = k_shared.transpose(1, 0, 2).copy(), v_shared.transpose(1, 0, 2).copy()
    else:
        k_in, v_in = k_shared, v_shared
    own, own_lens = [[3, 1], [7], [0, 2, 5]], [5, 1, 12]
    indptr, indices, last = to_device(table(own, own_lens), device)
    k_dev, v_dev, pool_dev = to_device((k_in, v_in, pool), device)

    decode = pagedkv.BatchDecodeWithSharedPrefixPagedKVCacheWrapper(None, layout)
    decode.begin_forward(indptr, indices, last, HQ, HKV, D, PAGE, data_type="float32")
    q = rng.standard_normal((3, HQ, D), dtype=np.float32)
    o = as_f64(decode.forward(to_device(q, device), k_dev, v_dev, pool_dev))
    for r in range(3):
        k, v = tokens(pool, own[r], own_lens[r], layout)
        k, v = np.concatenate([k_shared, k]), np.concatenate([v_shared, v])
        want, _ = attention(q[r : r + 1], k, v, np.array([len(k) - 1]))
        np.testing.assert_allclose(o[r : r + 1], want, atol=ATOL, rtol=RTOL)

    qo_lens = [3, 1, 4]
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    prefill = pagedkv.BatchPrefillWithSharedPrefixPagedKVCacheWrapper(None, layout)
    prefill.begin_forward(to_device(qo, device), indptr, indices, last, HQ, HKV, D, PAGE)
    q = rng.standard_normal((int(qo[-1]), HQ, D), dtype=np.float32)
    for causal in (False, True):
        o = as_f64(prefill.forward(to_device(q, device), k_dev, v_dev, pool_dev, causal=causal))
        for r in range(3):
            k, v = tokens(pool, own[r], own_lens[r], layout)
            k, v = np.concatenate([k_shared, k]), np.concatenate([v_shared, v])
            positions = np.arange(len(k) - qo_lens[r], len(k))
            want, _ = attention(q[qo[r] : qo[r + 1]], k, v, positions, causal=causal)
            np.testing.assert_allclose(o[qo[r] : qo[r + 1]], want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_masked_merge_changes_only_the_masked_rows(kind):
    check_masked_merge(kind)


def check_masked_merge(kind: str, device: str = "cpu") -> None:
    """merge_state_in_place with a row mask: masked rows merged, bitwise as
    merge_state on the same device (the same kernel on the same row), the
    others untouched; kind "torch" puts the arrays on `device`."""
    rng = np.random.default_rng(2)
    v, v_other = rng.standard_normal((2, 6, 4, 64), dtype=np.float32)
    s, s_other = rng.standard_normal((2, 6, 4), dtype=np.float32)
    mask = np.array([True, False, False, True, True, False])
    if kind == "torch":
        import torch

        def fresh():
            return [torch.from_numpy(x.copy()).to(device) for x in (v, s, v_other, s_other)]

        mask_in = torch.from_numpy(mask).to(device)
    else:

        def fresh():
            return [x.copy() for x in (v, s, v_other, s_other)]

        mask_in = mask
    want_v, want_s = (to_numpy(x) for x in pagedkv.merge_state(*fresh()))
    arrays = fresh()
    pagedkv.merge_state_in_place(*arrays, mask=mask_in)
    got_v, got_s = (to_numpy(x) for x in arrays[:2])
    assert np.array_equal(got_v[~mask], v[~mask]) and np.array_equal(got_s[~mask], s[~mask])
    assert np.array_equal(got_v[mask], want_v[mask]) and np.array_equal(got_s[mask], want_s[mask])
    none = fresh()
    pagedkv.merge_state_in_place(*none, mask=np.zeros(6, bool))
    assert np.array_equal(to_numpy(none[0]), v) and np.array_equal(to_numpy(none[1]), s)


def test_bad_cascade_input_raises_before_writing():
    rng = np.random.default_rng(0)
    v, v_other = rng.standard_normal((2, 3, 2, 64)).astype(np.float32)
    s, s_other = rng.standard_normal((2, 3, 2)).astype(np.float32)
    before = v.copy(), s.copy()  # a merge with the other states would change every row
    with pytest.raises(ValueError, match="mask must be bool"):
        pagedkv.merge_state_in_place(v, s, v_other, s_other, mask=np.ones(4, bool))
    with pytest.raises(ValueError, match="mask must be bool"):
        pagedkv.merge_state_in_place(v, s, v_other, s_other, mask=np.ones(3, np.int32))
    assert np.array_equal(v, before[0]) and np.array_equal(s, before[1])
    with pytest.raises(ValueError, match="num_levels"):
        pagedkv.MultiLevelCascadeAttentionWrapper(0)
    with pytest.raises(ValueError, match="use_cuda_graph"):
        pagedkv.MultiLevelCascadeAttentionWrapper(2, None, "NHD", True)
    w = pagedkv.MultiLevelCascadeAttentionWrapper(2)
    one = np.array([0, 1], np.int32)
    with pytest.raises(ValueError, match="one page table per level"):
        w.plan([one], [one], [one[:1]], [one[1:]], HQ, HKV, D, PAGE)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True])
def test_cascade_levels_on_gpu(layout, causal):
    check_levels(layout, causal, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_shared_prefix_wrappers_on_gpu(layout):
    check_shared_prefix(layout, device="cuda")


@pytest.mark.gpu
def test_masked_merge_on_gpu():
    check_masked_merge("torch", device="cuda")
