"""append_paged_kv_cache and append_paged_mla_kv_cache against a NumPy reference.

Appends are copies, so the check is exact: the whole pool, bit for bit, which
also proves that every slot the append did not target is untouched.
"""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
import reference
from conftest import bits, like, random_array, to_device, to_numpy

# (dtype, kind, layout, pool form, page size, call form): a sampled grid that
# covers each value of each axis while compiling only a few graphs.
CASES = [
    ("float32", "numpy", "NHD", "pool", 16, "positions"),
    ("float32", "numpy", "HND", "pool", 5, "indptr"),
    ("float32", "torch", "NHD", "pair", 1, "positions"),
    ("float32", "numpy", "HND", "pair", 64, "indptr"),
    ("float16", "numpy", "NHD", "pool", 5, "indptr"),
    ("bfloat16", "torch", "HND", "pair", 16, "positions"),
    ("bfloat16", "torch", "HND", "pair", 1, "indptr"),
]


def scenario(page_size: int) -> tuple[list[int], list[int]]:
    """Lengths after the append, and tokens appended, per request.

    0: fills a page exactly from empty; 1: opens a fresh page; 2: ragged run
    across pages; 3: appends nothing; 4: fills its last page exactly; 5: owns
    no pages at all; 6: long request.
    """
    p = page_size
    after = [p, p + 1, 3 * p + 2, 7, 2 * p, 0, 4 * p + 3]
    appended = [p, 1, min(5, 3 * p + 2), 0, 1, 0, 2 * p + 1]
    return after, appended


def check_append_case(rng, dtype, kind, layout, form, page_size, call, device="cpu") -> None:
    """One append on device ("cpu", or "cuda" with torch tensors), checked bit
    for bit over the whole pool."""
    heads, head_dim = 3, 16
    batch = reference.paged_batch(rng, page_size, *scenario(page_size))
    page = (page_size, heads, head_dim) if layout == "NHD" else (heads, page_size, head_dim)
    pool = random_array(rng, (batch.num_pages, 2, *page), dtype, kind)
    key = random_array(rng, (batch.nnz, heads, head_dim), dtype, kind)
    value = random_array(rng, (batch.nnz, heads, head_dim), dtype, kind)
    bi, pos = reference.batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)

    expected = reference.append(
        bits(pool), bits(key), bits(value), bi, pos, batch.kv_indices, batch.kv_indptr, layout
    )
    pool, key, value = to_device((pool, key, value), device)
    cache = (
        pool[:, 0].clone() if kind == "torch" else pool[:, 0].copy(),
        pool[:, 1].clone() if kind == "torch" else pool[:, 1].copy(),
    )
    target = cache if form == "pair" else pool
    table = [like(pool, x) for x in (batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len)]
    if call == "positions":
        pagedkv.append_paged_kv_cache(
            key, value, like(pool, bi), like(pool, pos), target, *table, kv_layout=layout
        )
    else:
        pagedkv.append_paged_kv_cache(
            key, value, like(pool, batch.append_indptr), target, *table, kv_layout=layout
        )
    got = np.stack([bits(cache[0]), bits(cache[1])], 1) if form == "pair" else bits(pool)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype,kind,layout,form,page_size,call", CASES)
def test_append_matches_reference(rng, dtype, kind, layout, form, page_size, call):
    check_append_case(rng, dtype, kind, layout, form, page_size, call)


def test_append_keyword_call_and_gather_roundtrip(rng):
    """FlashInfer's keyword names work, and gather_kv reads back what was written."""
    page_size, heads, head_dim = 4, 2, 8
    batch = reference.paged_batch(rng, page_size, [9, 0, 4], [9, 0, 4])
    pool = np.zeros((batch.num_pages, 2, page_size, heads, head_dim), np.float32)
    key = random_array(rng, (batch.nnz, heads, head_dim), "float32")
    value = random_array(rng, (batch.nnz, heads, head_dim), "float32")
    pagedkv.append_paged_kv_cache(
        append_key=key,
        append_value=value,
        append_indptr=batch.append_indptr,
        paged_kv_cache=pool,
        kv_indices=batch.kv_indices,
        kv_indptr=batch.kv_indptr,
        kv_last_page_len=batch.kv_last_page_len,
        kv_layout="NHD",
    )
    k, v, seq_indptr = pagedkv.gather_kv(
        pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len
    )
    np.testing.assert_array_equal(seq_indptr, [0, 9, 9, 13])
    np.testing.assert_array_equal(k, key)
    np.testing.assert_array_equal(v, value)
    k2, v2 = pagedkv.gather_kv(
        pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, request=2
    )
    np.testing.assert_array_equal(k2, key[9:])
    for (rk, rv), b in zip(
        reference.gather(pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD"),
        range(3),
        strict=True,
    ):
        np.testing.assert_array_equal(rk, k[seq_indptr[b] : seq_indptr[b + 1]])
        np.testing.assert_array_equal(rv, v[seq_indptr[b] : seq_indptr[b + 1]])


def test_gather_hnd_pair_matches_reference(rng):
    check_gather(rng, "float32", "numpy", "HND", "pair")


def check_gather(rng, dtype: str, kind: str, layout: str, form: str, device: str = "cpu"):
    """gather_kv of a ragged batch (an empty request included) over shuffled
    pages equals the reference's gather, bitwise (a copy), in `layout` and
    pool `form` ("pool": one [pages, 2, ...] array; "pair": K and V apart)."""
    page_size, heads, head_dim = 5, 3, 8
    batch = reference.paged_batch(rng, page_size, [12, 3, 0, 5], [0, 0, 0, 0])
    inner = (heads, page_size) if layout == "HND" else (page_size, heads)
    pool = random_array(rng, (batch.num_pages, 2, *inner, head_dim), dtype, kind)
    pool = to_device(pool, device)
    cache = pool
    if form == "pair":
        cache = tuple(
            x.copy() if isinstance(x, np.ndarray) else x.contiguous()
            for x in (pool[:, 0], pool[:, 1])
        )
    table = to_device((batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len), device)
    k, v, seq_indptr = pagedkv.gather_kv(cache, *table, kv_layout=layout)
    seq_indptr = to_numpy(seq_indptr)
    refs = reference.gather(
        bits(pool), batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, layout
    )
    for b, (rk, rv) in enumerate(refs):
        np.testing.assert_array_equal(bits(k)[seq_indptr[b] : seq_indptr[b + 1]], rk)
        np.testing.assert_array_equal(bits(v)[seq_indptr[b] : seq_indptr[b + 1]], rv)


@pytest.mark.parametrize("dtype,kind", [("float32", "numpy"), ("bfloat16", "torch")])
def test_mla_append_matches_reference(rng, dtype, kind):
    check_mla_append(rng, dtype, kind)


def check_mla_append(rng, dtype, kind, device="cpu") -> None:
    """One MLA append on device, checked bit for bit over both caches."""
    page_size, ckv_dim, kpe_dim = 16, 40, 24  # dims need not be powers of two
    batch = reference.paged_batch(rng, page_size, *scenario(page_size))
    ckv_cache = random_array(rng, (batch.num_pages, page_size, ckv_dim), dtype, kind)
    kpe_cache = random_array(rng, (batch.num_pages, page_size, kpe_dim), dtype, kind)
    ckv = random_array(rng, (batch.nnz, ckv_dim), dtype, kind)
    kpe = random_array(rng, (batch.nnz, kpe_dim), dtype, kind)
    bi, pos = reference.batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)

    want_ckv, want_kpe = bits(ckv_cache), bits(kpe_cache)
    for i in range(batch.nnz):
        page, t = reference.slot(
            int(pos[i]), int(bi[i]), batch.kv_indptr, batch.kv_indices, page_size
        )
        want_ckv[page, t] = bits(ckv)[i]
        want_kpe[page, t] = bits(kpe)[i]
    ckv, kpe, ckv_cache, kpe_cache = to_device((ckv, kpe, ckv_cache, kpe_cache), device)
    pagedkv.append_paged_mla_kv_cache(
        ckv,
        kpe,
        like(ckv, bi),
        like(ckv, pos),
        ckv_cache,
        kpe_cache,
        like(ckv, batch.kv_indices),
        like(ckv, batch.kv_indptr),
        like(ckv, batch.kv_last_page_len),
    )
    np.testing.assert_array_equal(bits(ckv_cache), want_ckv)
    np.testing.assert_array_equal(bits(kpe_cache), want_kpe)


@pytest.mark.parametrize("form", ["pool", "pair"])
def test_copy_pages_copies_many_pages_bitwise(form):
    """copy_pages of more pages than one CPU task takes (1 MiB of them): each
    destination holds its source's bytes, every other page is untouched."""
    rng = np.random.default_rng(13)
    pages, page = 10_000, (1, 2, 64)  # page_size 1: 1 KiB f32 pool rows, 256 B bf16 halves
    if form == "pool":
        cache = random_array(rng, (pages, 2, *page), "float32")
        arrays = [cache]
    else:
        cache = tuple(random_array(rng, (pages, *page), "bfloat16") for _ in range(2))
        arrays = list(cache)
    before = [bits(a) for a in arrays]
    perm = rng.permutation(pages).astype(np.int32)
    src, dst = perm[:4500].copy(), perm[4500:9000].copy()
    src[:7] = src[7]  # one parent page copied to several children
    pagedkv.copy_pages(cache, src, dst)
    for array, old in zip(arrays, before, strict=True):
        want = old.copy()
        want[dst] = old[src]
        np.testing.assert_array_equal(bits(array), want)


def test_wider_index_arrays_are_narrowed_after_checking_they_fit():
    """FlashInfer's helpers give int64 page tables (torch.cumsum of int32):
    the appends take them, bit for bit as int32, and refuse a value that
    int32 cannot hold before writing anything."""
    rng = np.random.default_rng(3)
    k, v = rng.standard_normal((2, 29, 2, 64), dtype=np.float32)
    table = {
        "kv_indices": np.array([5, 1, 7], np.int32),
        "kv_indptr": np.array([0, 2, 3], np.int32),
        "kv_last_page_len": np.array([4, 9], np.int32),
    }
    append_indptr = np.array([0, 20, 29], np.int32)
    want = np.zeros((8, 2, 16, 2, 64), np.float32)
    pagedkv.append_paged_kv_cache(k, v, append_indptr, want, *table.values())
    wide = {name: x.astype(np.int64) for name, x in table.items()}
    got = np.zeros_like(want)
    pagedkv.append_paged_kv_cache(k, v, append_indptr.astype(np.int64), got, **wide)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    seq_lens = pagedkv.get_seq_lens(wide["kv_indptr"], wide["kv_last_page_len"], 16)
    assert seq_lens.dtype == np.int32 and seq_lens.tolist() == [20, 9]
    too_wide = dict(wide, kv_indices=np.array([5, 1, 2**32 + 7], np.int64))
    untouched = np.zeros_like(want)
    with pytest.raises(ValueError, match=r"kv_indices\[2\] = 4294967303 does not fit in int32"):
        pagedkv.append_paged_kv_cache(k, v, append_indptr, untouched, **too_wide)
    assert not untouched.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,kind,layout,form,page_size,call", CASES)
def test_append_on_gpu(rng, dtype, kind, layout, form, page_size, call):
    check_append_case(rng, dtype, "torch", layout, form, page_size, call, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mla_append_on_gpu(rng, dtype):
    check_mla_append(rng, dtype, "torch", device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,layout,form", [("bfloat16", "NHD", "pool"), ("float32", "HND", "pair")]
)
def test_gather_on_gpu(rng, dtype, layout, form):
    check_gather(rng, dtype, "torch", layout, form, device="cuda")
