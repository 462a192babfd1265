"""No input may crash the process, corrupt a cache or be silently ignored.

One section per class of defect: plans own their index arrays, read-only
targets raise, NaN is data, no silent narrowing, sizes from checked values;
then FlashInfer parity details. References are float64 (reference.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedkv
import reference
from conftest import bits

PAGE, HKV, HQ, DIM = 4, 2, 4, 64
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def decode_setup(seed: int = 0):
    """A 3-request batch (lengths 6, 1, 9) over a float32 NHD pool."""
    rng = np.random.default_rng(seed)
    batch = reference.paged_batch(rng, PAGE, [6, 1, 9], [0, 0, 0], spare_pages=2)
    pool = rng.standard_normal((batch.num_pages, 2, PAGE, HKV, DIM), dtype=np.float32)
    q = rng.standard_normal((3, HQ, DIM), dtype=np.float32)
    return batch, pool, q


def planned_decode(batch, **options):
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    table = [batch.kv_indptr.copy(), batch.kv_indices.copy(), batch.kv_last_page_len.copy()]
    w.plan(*table, HQ, HKV, DIM, PAGE, **options)
    return w, table


def decode_reference(batch, pool, q, **options):
    outs, lses = [], []
    for b, (k, v) in enumerate(
        reference.gather(
            pool.astype(np.float64),
            batch.kv_indices,
            batch.kv_indptr,
            batch.kv_last_page_len,
            "NHD",
        )
    ):
        o, lse = reference.attention(
            q[b : b + 1].astype(np.float64), k, v, np.array([len(k) - 1]), **options
        )
        outs.append(o[0])
        lses.append(lse[0])
    return np.stack(outs), np.stack(lses)


# 1. A plan owns what it planned.


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_decode_plan_ignores_later_edits_of_its_index_arrays(kind, which):
    batch, pool, q = decode_setup()
    w, table = planned_decode(batch)
    if kind == "torch":
        import torch

        # Tensor.numpy() shares memory: the plan must not keep that view.
        table = [torch.from_numpy(x) for x in table]
        w.plan(*table, HQ, HKV, DIM, PAGE)
    want = w.run(q, pool)
    table[which][:] = 2**30  # out of every pool: read, it would crash
    np.testing.assert_array_equal(bits(w.run(q, pool)), bits(want))


def test_prefill_plan_ignores_later_edits_of_its_index_arrays():
    batch, pool, _ = decode_setup()
    q = np.random.default_rng(1).standard_normal((5, HQ, DIM), dtype=np.float32)
    qo_indptr = np.array([0, 2, 3, 5], np.int32)
    table = [batch.kv_indptr.copy(), batch.kv_indices.copy(), batch.kv_last_page_len.copy()]
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper()
    w.plan(qo_indptr, *table, HQ, HKV, DIM, PAGE, causal=True)
    want = w.run(q, pool)
    for x in (qo_indptr, *table):
        x[:] = 2**30
    np.testing.assert_array_equal(bits(w.run(q, pool)), bits(want))


# 2. A target that cannot be written is an error, not a silent no-op.


def read_only(x: np.ndarray) -> np.ndarray:
    x = x.copy()
    x.flags.writeable = False
    return x


def test_read_only_append_pool_raises():
    batch, pool, _ = decode_setup()
    pool = read_only(pool)
    key = np.ones((1, HKV, DIM), np.float32)
    with pytest.raises(ValueError, match="read-only"):
        pagedkv.append_paged_kv_cache(
            key,
            key,
            np.array([0], np.int32),
            np.array([0], np.int32),
            pool,
            batch.kv_indices,
            batch.kv_indptr,
            batch.kv_last_page_len,
        )


@pytest.mark.parametrize("target", ["out", "lse"])
def test_read_only_attention_outputs_raise(target):
    batch, pool, q = decode_setup()
    w, _ = planned_decode(batch)
    buffers = {"out": np.zeros_like(q), "lse": np.zeros((3, HQ), np.float32)}
    buffers[target] = read_only(buffers[target])
    with pytest.raises(ValueError, match=f"{target} is read-only"):
        w.run(q, pool, return_lse=True, **buffers)


def test_read_only_copy_pages_target_raises():
    _, pool, _ = decode_setup()
    before = pool.copy()
    with pytest.raises(ValueError, match="read-only"):
        pagedkv.copy_pages(read_only(pool), np.array([0], np.int32), np.array([1], np.int32))
    np.testing.assert_array_equal(pool, before)


def test_read_only_mla_cache_raises_before_writing_the_other():
    batch = reference.paged_batch(np.random.default_rng(0), PAGE, [3], [3])
    ckv = np.zeros((batch.num_pages, PAGE, 8), np.float32)
    kpe = read_only(np.zeros((batch.num_pages, PAGE, 4), np.float32))
    bi, pos = reference.batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)
    with pytest.raises(ValueError, match="kpe_cache is read-only"):
        pagedkv.append_paged_mla_kv_cache(
            np.ones((3, 8), np.float32),
            np.ones((3, 4), np.float32),
            bi,
            pos,
            ckv,
            kpe,
            batch.kv_indices,
            batch.kv_indptr,
            batch.kv_last_page_len,
        )
    assert not ckv.any()


@pytest.mark.parametrize("which", ["v", "s"])
def test_read_only_merge_state_in_place_raises_before_writing_half(which):
    rng = np.random.default_rng(0)
    state = {
        "v": rng.standard_normal((2, 2, 8), dtype=np.float32),
        "s": rng.standard_normal((2, 2), dtype=np.float32),
    }
    state[which] = read_only(state[which])
    before = {k: x.copy() for k, x in state.items()}
    with pytest.raises(ValueError, match=f"{which} is read-only"):
        pagedkv.merge_state_in_place(state["v"], state["s"], state["v"] + 1, state["s"] + 1)
    for k in state:
        np.testing.assert_array_equal(state[k], before[k])


# 3. NaN is data, not a mask; invalid scalar options raise ValueError.


def check_nan_rows(got_o, got_lse, clean_o, clean_lse, nan_rows, lse_too=True):
    """Rows (request, head) in nan_rows are NaN in o (and in lse with
    lse_too: a NaN in V leaves the scores, so the lse, as they were); the
    others are bit-for-bit the clean run's."""
    mask = np.zeros(got_lse.shape, bool)
    for r in nan_rows:
        mask[r] = True
    lse_mask = mask if lse_too else np.zeros_like(mask)
    assert np.isnan(got_o[mask]).all() and np.isnan(got_lse[lse_mask]).all()
    np.testing.assert_array_equal(bits(got_o[~mask]), bits(clean_o[~mask]))
    np.testing.assert_array_equal(bits(got_lse[~lse_mask]), bits(clean_lse[~lse_mask]))


@pytest.mark.parametrize("where", ["q", "k", "v", "k_first", "k_last"])
def test_decode_nan_in_reaches_the_rows_it_touches(where):
    batch, pool, q = decode_setup()
    w, _ = planned_decode(batch)
    clean_o, clean_lse = w.run(q, pool, return_lse=True)
    want_o, want_lse = decode_reference(batch, pool, q)
    np.testing.assert_allclose(clean_o, want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(clean_lse, want_lse, rtol=1e-5, atol=1e-5)
    q, pool = q.copy(), pool.copy()
    # Request 2 (9 tokens on pages kv_indices[3:6]); KV head 1 = query heads 2, 3.
    page_of = batch.kv_indices[batch.kv_indptr[2] :]
    if where == "q":
        q[2, 3, 5] = np.nan
        rows = [(2, 3)]
    else:
        token = {"k": 4, "v": 4, "k_first": 0, "k_last": 8}[where]
        kv = 1 if where == "v" else 0
        # A NaN in V reaches the output elements it feeds: make the row NaN.
        element = slice(None) if where == "v" else 7
        pool[page_of[token // PAGE], kv, token % PAGE, 1, element] = np.nan
        rows = [(2, 2), (2, 3)]
    o, lse = w.run(q, pool, return_lse=True)
    check_nan_rows(o, lse, clean_o, clean_lse, rows, lse_too=where != "v")


def test_decode_nan_q_scale_gives_nan_everywhere():
    batch, pool, q = decode_setup()
    w, _ = planned_decode(batch)
    o, lse = w.run(q, pool, q_scale=float("nan"), return_lse=True)
    assert np.isnan(o).all() and np.isnan(lse).all()


def test_decode_nan_in_a_key_outside_the_window_changes_nothing():
    batch, pool, q = decode_setup()
    w, _ = planned_decode(batch, window_left=2)
    clean_o, clean_lse = w.run(q, pool, return_lse=True)
    pool = pool.copy()
    pool[batch.kv_indices[batch.kv_indptr[2]], 0, 0] = np.nan  # token 0 of request 2
    o, lse = w.run(q, pool, return_lse=True)
    check_nan_rows(o, lse, clean_o, clean_lse, [])


def test_prefill_nan_query_row_stays_in_its_row():
    batch, pool, _ = decode_setup()
    q = np.random.default_rng(2).standard_normal((5, HQ, DIM), dtype=np.float32)
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper()
    w.plan(
        np.array([0, 2, 3, 5], np.int32),
        batch.kv_indptr,
        batch.kv_indices,
        batch.kv_last_page_len,
        HQ,
        HKV,
        DIM,
        PAGE,
        causal=True,
    )
    clean_o, clean_lse = w.run(q, pool, return_lse=True)
    q = q.copy()
    q[3, 1, 0] = np.nan
    o, lse = w.run(q, pool, return_lse=True)
    check_nan_rows(o, lse, clean_o, clean_lse, [(3, 1)])


def test_merge_states_nan_reaches_only_its_row():
    rng = np.random.default_rng(0)
    v = rng.standard_normal((3, 2, 2, 8), dtype=np.float32)
    s = rng.standard_normal((3, 2, 2), dtype=np.float32)
    clean_v, clean_s = pagedkv.merge_states(v, s)
    s = s.copy()
    s[1, 0, 1] = np.nan
    got_v, got_s = pagedkv.merge_states(v, s)
    check_nan_rows(got_v, got_s, clean_v, clean_s, [(1, 1)])


BAD_OPTIONS = [
    ("logits_soft_cap", float("nan")),
    ("logits_soft_cap", float("inf")),
    ("logits_soft_cap", -1.0),
    ("sm_scale", float("nan")),
    ("sm_scale", float("inf")),
    ("rope_theta", 0.0),
    ("window_left", 2**31),
    ("window_left", -2),
    ("window_left", 2.5),
    ("num_qo_heads", 0),
    ("num_qo_heads", -4),
    ("num_kv_heads", 0),
    ("head_dim", 2**40),
    ("page_size", 2**31),
    ("page_size", 0),
]


@pytest.mark.parametrize("wrapper", ["decode", "prefill"])
@pytest.mark.parametrize(("name", "value"), BAD_OPTIONS)
def test_invalid_scalar_options_raise_value_or_type_error(wrapper, name, value):
    batch, _, _ = decode_setup()
    args = dict(num_qo_heads=HQ, num_kv_heads=HKV, page_size=PAGE)
    args[name] = value
    table = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    with pytest.raises((ValueError, TypeError), match=name) as caught:
        if wrapper == "decode":
            pagedkv.BatchDecodeWithPagedKVCacheWrapper().plan(
                *table, head_dim=args.pop("head_dim", DIM), **args
            )
        else:
            pagedkv.BatchPrefillWithPagedKVCacheWrapper().plan(
                np.array([0, 1, 2, 3], np.int32),
                *table,
                head_dim_qk=args.pop("head_dim", DIM),
                **args,
            )
    assert type(caught.value) in (ValueError, TypeError)


@SETTINGS
@given(
    cap=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    window=st.integers(-(2**40), 2**40),
    # Valid head counts stay small: a plan for 2**30 heads would rightly
    # allocate gigabytes.
    heads=st.one_of(st.integers(-3, 64), st.integers(2**31 - 1, 2**40)),
)
def test_plan_options_never_raise_anything_but_value_or_type_error(cap, window, heads):
    batch, _, _ = decode_setup()
    try:
        pagedkv.BatchDecodeWithPagedKVCacheWrapper().plan(
            batch.kv_indptr,
            batch.kv_indices,
            batch.kv_last_page_len,
            heads,
            HKV,
            DIM,
            PAGE,
            window_left=window,
            logits_soft_cap=cap,
        )
    except (ValueError, TypeError):
        pass


# 4. No silent narrowing of indices.


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
@pytest.mark.parametrize("which", ["positions", "batch_indices"])
def test_append_kv_rejects_indices_that_do_not_fit_int32(dtype, which):
    cache = pagedkv.init_paged_kv_cache(8, PAGE, HKV, DIM)
    table = pagedkv.allocate_blocks(cache, ["a"], [6])
    before = bits(cache.pools[0])
    key = np.ones((2, HKV, DIM), np.float32)
    args = {"batch_indices": np.array([0, 0], dtype), "positions": np.array([0, 1], dtype)}
    args[which] = args[which] + np.array(2**32, dtype)  # wraps to 0, 1 in int32
    with pytest.raises(ValueError, match=f"{which}\\[0\\] = 4294967296 does not fit"):
        pagedkv.append_kv(cache, table, key, key, **args)
    np.testing.assert_array_equal(bits(cache.pools[0]), before)


@SETTINGS
@given(offset=st.integers(2**31, 2**63 - 1 - 8))
def test_append_kv_never_wraps_a_position(offset):
    cache = pagedkv.init_paged_kv_cache(4, PAGE, HKV, DIM)
    table = pagedkv.allocate_blocks(cache, ["a"], [3])
    key = np.ones((1, HKV, DIM), np.float32)
    with pytest.raises(ValueError):
        pagedkv.append_kv(cache, table, key, key, np.array([0]), np.array([offset], np.int64))
    assert not cache.pools[0].any()


# 5. Sizes come from validated values.


@pytest.mark.parametrize(
    ("name", "value", "pattern"),
    [
        ("kv_last_page_len", 2**30, "kv_last_page_len\\[2\\] = 1073741824"),
        ("kv_indptr", 2**30, "kv_indptr|kv_indices holds only|more than an int32 length holds"),
    ],
)
def test_gather_kv_checks_the_table_before_sizing_its_output(name, value, pattern):
    batch, pool, _ = decode_setup()
    table = {
        "kv_indices": batch.kv_indices,
        "kv_indptr": batch.kv_indptr.copy(),
        "kv_last_page_len": batch.kv_last_page_len.copy(),
    }
    table[name][-1] = value
    with pytest.raises(ValueError, match=pattern):
        pagedkv.gather_kv(pool, **table)


# Also in scope: FlashInfer parity.


def test_batch_indices_positions_pad_past_append_indptr_end():
    b, p = pagedkv.get_batch_indices_positions(
        np.array([0, 2, 3], np.int32), np.array([7, 1], np.int32), 6
    )
    np.testing.assert_array_equal(b, [0, 0, 1, -1, -1, -1])
    np.testing.assert_array_equal(p, [5, 6, 0, 0, 0, 0])


def test_merge_states_of_one_state_copies_it():
    rng = np.random.default_rng(0)
    v = rng.standard_normal((3, 1, 2, 8), dtype=np.float32)
    s = rng.standard_normal((3, 1, 2), dtype=np.float32)
    s[0, 0, 1] = -np.inf
    got_v, got_s = pagedkv.merge_states(v, s)
    np.testing.assert_array_equal(bits(got_v), bits(np.ascontiguousarray(v[:, 0])))
    np.testing.assert_array_equal(bits(got_s), bits(np.ascontiguousarray(s[:, 0])))


def test_decode_lse_under_alibi_is_flashinfer_decode_kernels():
    batch, pool, q = decode_setup()
    w, _ = planned_decode(batch, pos_encoding_mode="ALIBI")
    o, lse = w.run(q, pool, return_lse=True)
    want_o, want_lse = decode_reference(
        batch, pool, q, pos_encoding_mode="ALIBI", alibi_from_zero=True
    )
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
