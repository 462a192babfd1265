"""int8 pools (pagedkv's 8-bit cache: each row's codes and a float32 scale)
through the FlashInfer-style API: float rows appended are quantized, and
decode and prefill read them, against float64 references written from the
format (reference.int8_pages).

Rows of the pool's keys differ in magnitude by up to 200x, so a scale taken
from another row or head, or none, is far outside the tolerances.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from max.dtype import DType

import pagedkv
import reference
from pagedkv.page import append_spec, gather_spec
from pagedkv.precompile import default_pair, op_specs

P, HKV, D = 16, 2, 64


ROWS_OF_LAYOUT = {"NHD": torch.float32, "HND": torch.bfloat16}
"""The rows appended into each layout's pool unless a test says: the appends
the suite compiles in its module (conftest), not one of their own."""


def filled_pool(rng, lens, layout="NHD", rows_dtype=None, pair=False, magnitudes=(0.1, 20)):
    """An int8 pool holding random keys and values for requests of `lens`
    tokens (pages in a shuffled order, two spare), appended by pagedkv from
    rows of `rows_dtype` (ROWS_OF_LAYOUT's by default), each key row scaled
    by a magnitude drawn from `magnitudes`; and the page table and the
    float rows appended."""
    rows_dtype = rows_dtype or ROWS_OF_LAYOUT[layout]
    pages = [-(-n // P) for n in lens]
    num_pages = sum(pages) + 2
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(num_pages)[: indptr[-1]].astype(np.int32)
    last = np.array([(n - 1) % P + 1 for n in lens], np.int32)
    page = (P, HKV, D) if layout == "NHD" else (HKV, P, D)
    # Stale rows in every slot, which no request's keys may reach.
    pool = torch.from_numpy(reference.int8_pages(rng.standard_normal((num_pages, 2, *page))))
    nnz = sum(lens)
    magnitude = rng.uniform(*magnitudes, (nnz, HKV, 1))
    keys = torch.tensor(rng.standard_normal((nnz, HKV, D)) * magnitude).to(rows_dtype)
    values = torch.tensor(rng.standard_normal((nnz, HKV, D))).to(rows_dtype)
    seq = reference.seq_lens(indptr, last, P)
    append_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    bi, pos = reference.batch_indices_positions(append_indptr, seq, nnz)
    cache = (pool[:, 0].clone(), pool[:, 1].clone()) if pair else pool
    pagedkv.append_paged_kv_cache(keys, values, bi, pos, cache, indices, indptr, last, layout)
    if pair:
        pool = torch.stack(cache, dim=1)
    return pool, indices, indptr, last, keys, values


def request_rows(pool, indices, indptr, b, n, layout):
    """Request b's first n keys and values [n, HKV, D] as the pool holds them."""
    pages = reference.int8_page_values(pool.numpy()[indices[indptr[b] : indptr[b + 1]]])
    if layout == "HND":
        pages = pages.transpose(0, 1, 3, 2, 4)
    return pages[:, 0].reshape(-1, HKV, D)[:n], pages[:, 1].reshape(-1, HKV, D)[:n]


@pytest.mark.parametrize(
    "layout,rows_dtype,pair",
    [("NHD", torch.float32, False), ("HND", torch.bfloat16, False), ("NHD", torch.float16, True)],
)
def test_append_quantizes_rows_with_their_scales(layout, rows_dtype, pair):
    lens = [40, 1, 17]
    pool, indices, indptr, _, keys, values = filled_pool(
        np.random.default_rng(1), lens, layout, rows_dtype, pair
    )
    start = 0
    for b, n in enumerate(lens):
        k, v = request_rows(pool, indices, indptr, b, n, layout)
        for got, rows in ((k, keys[start : start + n]), (v, values[start : start + n])):
            rows = rows.to(torch.float64).numpy()
            step = np.abs(rows).max(axis=-1, keepdims=True) / 127
            # Within a code of the exact value: half a code, and float32's
            # rounding of the scaled row on either side of a tie.
            assert (np.abs(got - rows) <= 0.5 * step * (1 + 1e-5)).all()
            np.testing.assert_allclose(got, reference.int8_roundtrip(rows), rtol=0, atol=step.max())
        start += n


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gather_gives_an_int8_pools_values(layout):
    """float32 values, code * scale rounded once: bit for bit the float64
    product rounded to float32."""
    rng = np.random.default_rng(6)
    lens = [40, 1, 17]
    pool, indices, indptr, last, *_ = filled_pool(rng, lens, layout)
    k, v, seq_indptr = pagedkv.gather_kv(pool, indices, indptr, last, layout)
    assert k.dtype == torch.float32 and tuple(k.shape) == (sum(lens), HKV, D)
    for b, n in enumerate(lens):
        want_k, want_v = request_rows(pool, indices, indptr, b, n, layout)
        rows = slice(int(seq_indptr[b]), int(seq_indptr[b + 1]))
        assert k[rows].numpy().tobytes() == want_k.astype(np.float32).tobytes()
        assert v[rows].numpy().tobytes() == want_v.astype(np.float32).tobytes()


def test_append_leaves_other_pages_untouched():
    rng = np.random.default_rng(2)
    pages = 4
    pool = torch.from_numpy(rng.integers(-127, 128, (pages, 2, P, HKV, D + 4), dtype=np.int8))
    before = pool.clone()
    keys = torch.randn(3, HKV, D)
    pagedkv.append_paged_kv_cache(
        keys,
        keys,
        torch.zeros(3, dtype=torch.int32),
        torch.tensor([0, 1, 2], dtype=torch.int32),
        pool,
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
    )
    assert torch.equal(pool[[0, 1, 3]], before[[0, 1, 3]])
    assert not torch.equal(pool[2], before[2])


# Groups 4, 3 (SmolLM2's) and 7: a KV head's rows in one tile of 4, one
# of 3, and tiles of 4 and 3.
@pytest.mark.parametrize("hq", [8, 6, 14])
def test_decode_reads_an_int8_pool(hq):
    rng = np.random.default_rng(3)
    lens = [300, 1, 33]
    pool, indices, indptr, last, *_ = filled_pool(rng, lens)
    q = torch.randn(len(lens), hq, D)
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8))
    w.plan(indptr, indices, last, hq, HKV, D, P, kv_data_type=torch.int8)
    o = w.run(q, pool)
    for b, n in enumerate(lens):
        k, v = request_rows(pool, indices, indptr, b, n, "NHD")
        q_b = q[b : b + 1].to(torch.float64).numpy()
        want, _ = reference.attention(q_b, k, v, np.array([n - 1]))
        np.testing.assert_allclose(o[b].to(torch.float64).numpy(), want[0], rtol=1e-5, atol=1e-5)


def prefill_errors(rng, lens, new, hq, layout="NHD", magnitudes=(0.1, 20)):
    """Causal prefill of each request's last `new` tokens over an int8 pool:
    each request's largest absolute difference from float64 attention over
    the pool's values."""
    pool, indices, indptr, last, *_ = filled_pool(rng, lens, layout, magnitudes=magnitudes)
    qo_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = torch.randn(int(qo_indptr[-1]), hq, D, generator=torch.Generator().manual_seed(7))
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(1 << 24, dtype=torch.uint8), kv_layout=layout
    )
    w.plan(qo_indptr, indptr, indices, last, hq, HKV, D, P, causal=True, kv_data_type=torch.int8)
    o = w.run(q, pool)
    errors = []
    for b, n in enumerate(lens):
        k, v = request_rows(pool, indices, indptr, b, n, layout)
        rows = slice(qo_indptr[b], qo_indptr[b + 1])
        positions = np.arange(n - new[b], n)
        want, _ = reference.attention(q[rows].to(torch.float64).numpy(), k, v, positions)
        errors.append(np.abs(o[rows].to(torch.float64).numpy() - want).max())
    return errors


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_prefill_reads_an_int8_pool(layout):
    """Causal prefill of each request's last tokens: 20 queries of a group
    of 4 take the matrix-product path, 1 query the steps. With VNNI the
    products round q and the probabilities to 16-bit codes
    (mojo_ops/attention/cpu/code_products.mojo): relative errors of about
    1e-5 of each row's largest element, which scores of up to ~100 (these
    keys reach 20x the queries' scale) make errors up to ~1e-3 in o; a key
    scale taken from another row or head is off by far more."""
    errors = prefill_errors(np.random.default_rng(4), [50, 20, 7], [20, 20, 1], 8, layout)
    assert max(errors[:2]) < 3e-3, errors
    assert errors[2] < 1e-4, errors  # the steps: float32 throughout


def test_products_read_every_key_of_an_int8_pool_once():
    """The matrix-product path over an int8 pool at a moderate scale of
    keys, where rounding q and the probabilities to codes costs about
    1e-4: chunks of odd lengths that span pages, a group of 3 (SmolLM2's),
    rows of 21 queries to a task and fewer. A key dropped or counted twice
    moves its rows by about its weight, 1e-3 to 1e-2 here."""
    errors = prefill_errors(
        np.random.default_rng(9), [301, 77, 45], [40, 77, 13], 6, magnitudes=(0.5, 1.5)
    )
    assert max(errors) < 3e-4, errors


def test_bad_int8_calls_raise_before_writing():
    pool = torch.zeros(2, 2, P, HKV, D + 4, dtype=torch.int8)
    table = (
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
    )
    where = (torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    codes = torch.ones(1, HKV, D, dtype=torch.int8)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16 rows"):
        pagedkv.append_paged_kv_cache(codes, codes, *where, pool, *table)
    with pytest.raises(ValueError, match="must be \\[nnz, 2, 64\\]"):
        rows = torch.ones(1, HKV, D + 4)
        pagedkv.append_paged_kv_cache(rows, rows, *where, pool, *table)
    with pytest.raises(ValueError, match="4-byte scale"):
        tiny = torch.zeros(2, 2, P, HKV, 4, dtype=torch.int8)
        empty = torch.ones(1, HKV, 0)
        pagedkv.append_paged_kv_cache(empty, empty, *where, tiny, *table)
    assert not pool.any()


def test_the_page_manager_keeps_int8_pages_whole():
    """An int8 manager's pools hold each page's scales ([..., D + 4]); a
    copy-on-write page copy moves codes and scales together."""
    manager = pagedkv.PagedKVCacheManager(4, P, HKV, D, num_layers=2, dtype="int8")
    pool = manager.page_tensors.pools[1]
    assert tuple(pool.shape) == (4, 2, P, HKV, D + 4) and pool.dtype == np.int8
    pool[1] = np.random.default_rng(5).integers(-127, 128, pool[1].shape, dtype=np.int8)
    manager.page_tensors.copy_pages([1], [3])
    assert pool[3].tobytes() == pool[1].tobytes()
    with pytest.raises(ValueError, match="CPU"):
        pagedkv.PagedKVCacheManager(4, P, HKV, D, dtype="int8", device="cuda")


def test_precompile_takes_int8_caches_with_float_rows():
    specs = op_specs(["int8"])
    assert append_spec(DType.int8, 0, DType.bfloat16) in specs
    assert append_spec(DType.int8, 0) not in specs and gather_spec(DType.int8, 0) in specs
    assert default_pair("int8") == ("float32", "int8")
