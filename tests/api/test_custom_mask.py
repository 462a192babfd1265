"""Custom attention masks in prefill (FlashInfer's custom_mask and
packed_custom_mask) against the float64 reference with the same mask: ragged
requests whose masks do not fill whole bytes, rows with nothing visible
(o = 0, lse = -inf), more queries than keys, a window on top, tasks of
matrix products and of steps, and the packing helpers bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prefill_helpers import assert_rows_match, ragged_prefill, request_rows, run_prefill

import pagedkv
import reference
from conftest import PREFILL_CONFIGS, as_f64, to_device
from pagedkv.custom_mask import custom_mask_rows, packbits, segment_packbits

# (cached tokens, queries) per request: odd sizes, a masked row set, qo > kv.
SHAPE = [(13, 5), (40, 40), (3, 9), (70, 17), (1, 1)]


def masks_for(rng, shape, density):
    masks = [rng.random((n, kv)) < density for kv, n in shape]
    masks[0][2] = False  # a row that sees nothing
    return masks


@pytest.mark.parametrize("config", PREFILL_CONFIGS[:2], ids=lambda c: f"{c[0]}-{c[2]}")
@pytest.mark.parametrize("form", ["bool", "packed"])
@pytest.mark.parametrize("heads", [(8, 2, 64), (2, 2, 128)], ids=["products", "steps"])
@pytest.mark.parametrize("window_left", [-1, 6])
def test_custom_mask_matches_reference(config, form, heads, window_left):
    check_custom_mask(config, form, heads, window_left)


def check_custom_mask(config, form: str, heads, window_left: int, device: str = "cpu") -> None:
    """A ragged masked prefill (a row that sees nothing, more queries than
    keys) against the float64 reference with the same mask, every array on
    `device` ("cpu": as made; "cuda": torch CUDA tensors)."""
    rng = np.random.default_rng(len(form) + heads[0] + window_left)
    page_size = 4
    batch, pool, q = ragged_prefill(rng, config, SHAPE, heads, page_size)
    masks = masks_for(rng, SHAPE, 0.6)
    flat = np.concatenate([m.reshape(-1) for m in masks])
    if form == "bool":
        mask_args = dict(custom_mask=to_device(torch.from_numpy(flat), device))
    else:
        sizes = np.array([m.size for m in masks])
        packed, _ = segment_packbits(flat, np.concatenate([[0], np.cumsum(sizes)]), "little")
        mask_args = dict(packed_custom_mask=to_device(packed, device))
    # causal=True is ignored: the mask replaces it.
    o, lse = run_prefill(
        config, batch, pool, q, device, causal=True, window_left=window_left, **mask_args
    )
    tol = 1e-5 if config[0] == "float32" else 1e-2
    o, lse = as_f64(o), as_f64(lse)
    for b, (lo, hi, k, v, positions) in enumerate(request_rows(batch, pool, config[2])):
        want_o, want_lse = reference.attention(
            as_f64(q)[lo:hi], k, v, positions, causal=False, window_left=window_left, mask=masks[b]
        )
        assert_rows_match(o[lo:hi], lse[lo:hi], want_o, want_lse, tol)
        finite = np.isfinite(want_lse)
        assert (~finite).any() or b != 0  # request 0's masked row
        assert (o[lo:hi][~finite] == 0).all()


def test_single_prefill_takes_a_2d_mask():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((6, 4, 64), dtype=np.float32)
    k, v = (rng.standard_normal((11, 2, 64), dtype=np.float32) for _ in range(2))
    mask = rng.random((6, 11)) < 0.5
    o = pagedkv.single_prefill_with_kv_cache(q, k, v, custom_mask=mask)
    want, _ = reference.attention(q, k, v, np.arange(5, 11), causal=False, mask=mask)
    np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-5)


def test_packing_helpers_are_numpys_packbits():
    rng = np.random.default_rng(6)
    bits = rng.random(45) < 0.5
    indptr = np.array([0, 3, 3, 20, 45])
    for order in ("big", "little"):
        packed, starts = segment_packbits(bits, indptr, order)
        segments = zip(indptr[:-1], indptr[1:], strict=True)
        want = [np.packbits(bits[a:b], bitorder=order) for a, b in segments]
        assert packed.tobytes() == np.concatenate(want).tobytes()
        assert starts.tolist() == [0, 1, 1, 4, 8]
        assert packbits(bits, order).tobytes() == np.packbits(bits, bitorder=order).tobytes()
    t_packed, t_starts = segment_packbits(torch.from_numpy(bits), torch.from_numpy(indptr))
    assert isinstance(t_packed, torch.Tensor) and t_starts.dtype == torch.int32


def test_mask_rows_point_at_each_querys_key_zero():
    rows = custom_mask_rows(np.array([2, 3]), np.array([5, 3]), custom_mask=np.ones(19, bool))
    # Request 0: 10 bits (2 bytes); request 1: 9 bits from byte 2, rows of 3 keys.
    assert rows.row_bits.tolist() == [0, 5, 16, 19, 22]
    assert rows.bits.tolist() == [255, 3, 255, 1] + [0] * 8  # then the read padding


def test_bad_masks_are_refused_before_anything_runs():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((4, 2, 64), dtype=np.float32)
    k = v = rng.standard_normal((6, 2, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="custom_mask has 23 elements"):
        pagedkv.single_prefill_with_kv_cache(q, k, v, custom_mask=np.ones(23, bool))
    with pytest.raises(ValueError, match="boolean"):
        pagedkv.single_prefill_with_kv_cache(q, k, v, custom_mask=np.full(24, 0.5))
    with pytest.raises(ValueError, match="pack into 3"):
        pagedkv.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=np.ones(4, np.uint8))
    with pytest.raises(ValueError, match="1-D uint8"):
        pagedkv.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=np.ones(3, np.int32))
    with pytest.raises(ValueError, match="without decreasing"):
        segment_packbits(np.ones(4, bool), np.array([0, 3, 2, 4]))


def multi_item_reference(prefix: int, positions: list[int]) -> np.ndarray:
    """The multi-item mask element by element: query i sees key j of the
    prefix cache always; of the queries' own tokens, j <= i in i's item, or
    j before the first delimiter when i is not; never a delimiter's row or
    column (a delimiter is a token at position 0 of its item)."""
    n = len(positions)
    delim = [p == 0 for p in positions]
    item = np.cumsum(delim)
    first = delim.index(True) if True in delim else n
    mask = np.zeros((n, prefix + n), bool)
    mask[:, :prefix] = True
    for i in range(n):
        for j in range(n):
            seen = (item[i] == item[j] and j <= i) or (i >= first and j < first)
            mask[i, prefix + j] = seen and not delim[i] and not delim[j]
    return mask


def test_multi_item_scoring_is_its_mask():
    """FlashInfer's multi-item scoring (prefix_len_ptr, token_pos_in_items_ptr)
    equals the same prefill with the mask it stands for."""
    rng = np.random.default_rng(11)
    prefix, stride = [5, 3], 12
    positions = [[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 0, 1, 0]]
    qo = [len(p) for p in positions]
    batch = reference.paged_batch(rng, 4, [a + b for a, b in zip(prefix, qo, strict=True)], qo)
    pool = rng.standard_normal((batch.num_pages, 2, 4, 2, 64), dtype=np.float32)
    q = rng.standard_normal((batch.nnz, 4, 64), dtype=np.float32)
    flat_positions = np.zeros(2 * stride, np.uint16)
    for b, p in enumerate(positions):
        flat_positions[b * stride : b * stride + len(p)] = p
    table = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper()
    w.plan(
        batch.append_indptr,
        *table,
        4,
        2,
        64,
        4,
        causal=True,
        prefix_len_ptr=torch.tensor(prefix, dtype=torch.uint32),
        token_pos_in_items_ptr=torch.from_numpy(flat_positions),
        token_pos_in_items_len=stride,
        max_item_len_ptr=torch.tensor([4, 4], dtype=torch.uint16),
    )
    o = w.run(q, pool)
    masks = [multi_item_reference(a, p) for a, p in zip(prefix, positions, strict=True)]
    gathered = reference.gather(
        pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD"
    )
    for b, (k, v) in enumerate(gathered):
        lo, hi = batch.append_indptr[b], batch.append_indptr[b + 1]
        want, _ = reference.attention(
            q[lo:hi], k, v, np.arange(prefix[b], len(k)), causal=False, mask=masks[b]
        )
        np.testing.assert_allclose(o[lo:hi], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"prefix_len 4 \+ 9 queries != its 14"):
        w.plan(
            batch.append_indptr,
            *table,
            4,
            2,
            64,
            4,
            prefix_len_ptr=torch.tensor([4, 3]),
            token_pos_in_items_ptr=torch.from_numpy(flat_positions),
            token_pos_in_items_len=stride,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("config", PREFILL_CONFIGS[:2], ids=lambda c: f"{c[0]}-{c[2]}")
@pytest.mark.parametrize("form", ["bool", "packed"])
@pytest.mark.parametrize("window_left", [-1, 6])
def test_custom_mask_on_gpu(config, form, window_left):
    check_custom_mask(config, form, (8, 2, 64), window_left, device="cuda")
