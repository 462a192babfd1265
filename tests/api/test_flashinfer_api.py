"""FlashInfer's calling conventions that pagedkv accepts: the
deprecated names, FlashInfer's positional orders, decode plan options,
int64 page tables and several query tokens per decode request, each checked
against the float64 reference in tests/reference.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pagedkv
import reference
from conftest import flashinfer_serves, parameter_names


def decode_case(seed: int = 0, lens=(70, 3, 33)):
    rng = np.random.default_rng(seed)
    batch = reference.paged_batch(rng, 16, list(lens), [0] * len(lens))
    pool = rng.standard_normal((batch.num_pages, 2, 16, 2, 64), dtype=np.float32)
    q = rng.standard_normal((len(lens), 8, 64), dtype=np.float32)
    return batch, pool, q


def decode_reference(batch, pool, q, **options):
    outs, lses = [], []
    gathered = reference.gather(
        pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD"
    )
    for b, (k, v) in enumerate(gathered):
        o, lse = reference.attention(q[b : b + 1], k, v, np.array([len(k) - 1]), **options)
        outs.append(o[0])
        lses.append(lse[0])
    return np.stack(outs), np.stack(lses)


def table(batch):
    return batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len


def test_int64_page_tables_are_narrowed_after_a_range_check():
    """torch.cumsum of int32 is int64: FlashInfer's own helpers produce such tables."""
    batch, pool, q = decode_case()
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(*(torch.from_numpy(x.astype(np.int64)) for x in table(batch)), 8, 2, 64, 16)
    o = w.run(torch.from_numpy(q), torch.from_numpy(pool))
    want, _ = decode_reference(batch, pool, q)
    np.testing.assert_allclose(o.numpy(), want, rtol=1e-5, atol=1e-5)
    too_big = batch.kv_indices.astype(np.int64)
    too_big[1] = 2**32 + 1  # would wrap to page 1
    with pytest.raises(ValueError, match=r"indices\[1\] = 4294967297 does not fit in int32"):
        w.plan(batch.kv_indptr, too_big, batch.kv_last_page_len, 8, 2, 64, 16)


def test_deprecated_decode_names():
    """plan(data_type=), run_return_lse, begin_forward / forward (whose options
    replace the planned ones), end_forward and the use_tensor_cores attribute."""
    batch, pool, q = decode_case(1)
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", False, True)
    assert w.use_tensor_cores
    assert not pagedkv.BatchDecodeWithPagedKVCacheWrapper().use_tensor_cores
    w.plan(*table(batch), 8, 2, 64, 16, data_type="float32", q_data_type=np.float32)
    o, lse = w.run_return_lse(q, pool)
    want_o, want_lse = decode_reference(batch, pool, q)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    w.begin_forward(*table(batch), 8, 2, 64, 16)
    o = w.forward(q, pool, logits_soft_cap=5.0, window_left=20)
    want_o, _ = decode_reference(batch, pool, q, logits_soft_cap=5.0, window_left=20)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    w.end_forward()
    # float16 q and K/V: a pair the suite compiles anyway.
    w.plan(*table(batch), 8, 2, 64, 16, data_type=torch.float16, q_data_type=torch.float16)
    with pytest.raises(TypeError, match="the cache is float32 but the plan has float16"):
        w.run(q.astype(np.float16), pool)


@pytest.mark.parametrize("split", [{"disable_split_kv": True}, {"fixed_split_size": 1}])
def test_decode_split_options_keep_the_result(split):
    batch, pool, q = decode_case(2, lens=(300, 17, 64))
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(*table(batch), 8, 2, 64, 16, non_blocking=True, **split)
    want_o, want_lse = decode_reference(batch, pool, q)
    o, lse = w.run(q, pool, return_lse=True)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    items = w._plan.buffers["request_items"].to_numpy()
    # One work item a request, or one a page (16 tokens).
    want_items = [1, 1, 1] if "disable_split_kv" in split else [19, 2, 4]
    assert np.diff(items).tolist() == want_items


def test_decode_backend_trtllm_gen_is_auto():
    """Code written for sm_100 asks the decode wrapper for "trtllm-gen": the
    same kernel and numbers as "auto", skip-softmax taken there and nothing
    skipped; other backends refuse it."""
    batch, pool, q = decode_case(3, lens=(70, 5))
    outs = []
    for backend in ("auto", "trtllm-gen"):
        w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", backend=backend)
        w.plan(*table(batch), 8, 2, 64, 16)
        skip = 0.1 if backend == "trtllm-gen" else None
        outs.append(w.run(q, pool, skip_softmax_threshold_scale_factor=skip))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[1], decode_reference(batch, pool, q)[0], rtol=1e-5, atol=1e-5)
    auto = pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    auto.plan(*table(batch), 8, 2, 64, 16)
    with pytest.raises(ValueError, match="skip_softmax_threshold_scale_factor"):
        auto.run(q, pool, skip_softmax_threshold_scale_factor=0.1)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_one_token_pages_may_leave_out_the_page_dim(kv_layout):
    """FlashInfer's page_size-1 caches without their page dim: a (K, V) pair
    of [pages, H, D], or [pages, 2, H, D]; the same numbers as with it."""
    rng = np.random.default_rng(8)
    pages = rng.standard_normal((30, 2, 2, 64), dtype=np.float32)
    full = np.expand_dims(pages, 2 if kv_layout == "NHD" else 3)
    q = rng.standard_normal((5, 8, 64), dtype=np.float32)
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper(None, kv_layout)
    w.plan(np.array([0, 2, 5], np.int32), np.array([0, 12, 30], np.int32),
           np.arange(30, dtype=np.int32), np.array([1, 1], np.int32), 8, 2, 64, 1,
           causal=True)  # fmt: skip
    want = w.run(q, full)
    np.testing.assert_array_equal(w.run(q, pages), want)
    pair = tuple(np.ascontiguousarray(pages[:, i]) for i in (0, 1))
    np.testing.assert_array_equal(w.run(q, pair), want)


def test_decode_with_several_query_tokens_per_request():
    """q_len_per_req = 3: each request's last 3 tokens attend causally."""
    batch, pool, _ = decode_case(3, lens=(40, 5))
    rng = np.random.default_rng(4)
    q = rng.standard_normal((6, 8, 64), dtype=np.float32)
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", use_tensor_cores=True)
    w.plan(*table(batch), 8, 2, 64, 16, q_len_per_req=3)
    o, lse = w.run(q, pool, return_lse=True, q_len_per_req=3)
    gathered = reference.gather(
        pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD"
    )
    for b, (k, v) in enumerate(gathered):
        rows = slice(3 * b, 3 * b + 3)
        want_o, want_lse = reference.attention(q[rows], k, v, np.arange(len(k) - 3, len(k)))
        np.testing.assert_allclose(o[rows], want_o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse[rows], want_lse, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="q_len_per_req=2 differs from the planned 3"):
        w.run(q, pool, q_len_per_req=2)
    # FlashInfer's messages (its test_tensor_core_decode_rejects_mismatched_q_len).
    with pytest.raises(ValueError, match="q_len_per_req"):
        w.run(q[:4], pool)
    cuda_cores = pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    with pytest.raises(ValueError, match="use_tensor_cores"):
        cuda_cores.plan(*table(batch), 8, 2, 64, 16, q_len_per_req=3)


def test_trtllm_gen_decode_takes_the_query_length_at_run_time():
    """backend='trtllm-gen' (as FlashInfer's) takes q_len_per_req in run()
    other than the planned one, without tensor cores; each run is the causal
    attention of its own query length."""
    batch, pool, _ = decode_case(3, lens=(40, 5))
    rng = np.random.default_rng(6)
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", backend="trtllm-gen")
    w.plan(*table(batch), 8, 2, 64, 16)
    gathered = reference.gather(
        pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD"
    )
    for q_len in (3, 1, 2):
        q = rng.standard_normal((2 * q_len, 8, 64), dtype=np.float32)
        o = w.run(q, pool, q_len_per_req=q_len)
        for b, (k, v) in enumerate(gathered):
            rows = slice(q_len * b, q_len * (b + 1))
            positions = np.arange(len(k) - q_len, len(k))
            want = reference.attention(q[rows], k, v, positions)[0]
            np.testing.assert_allclose(o[rows], want, rtol=1e-5, atol=1e-5)


def test_single_decode_takes_flashinfer_positional_order():
    """(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale,
    k_scale, v_scale, window_left, logits_soft_cap, sm_scale, ...)."""
    rng = np.random.default_rng(5)
    k, v = rng.standard_normal((2, 90, 2, 64), dtype=np.float32)
    q = rng.standard_normal((8, 64), dtype=np.float32)
    o = pagedkv.single_decode_with_kv_cache(
        q, k, v, "NHD", "NONE", True, 2.0, 0.5, 3.0, 30, 7.0, 0.1
    )
    want, _ = reference.attention(
        q[None],
        k,
        v,
        np.array([89]),
        window_left=30,
        logits_soft_cap=7.0,
        sm_scale=0.1,
        qk_scale=1.0,
        v_scale=3.0,
    )
    np.testing.assert_allclose(o, want[0], rtol=1e-5, atol=1e-5)


def test_single_prefill_takes_flashinfer_keywords():
    rng = np.random.default_rng(6)
    k, v = rng.standard_normal((2, 50, 2, 64), dtype=np.float32)
    q = rng.standard_normal((10, 8, 64), dtype=np.float32)
    o = pagedkv.single_prefill_with_kv_cache(
        q, k, v, causal=True, backend="fa2", k_scale=0.5, v_scale=2.0, o_dtype=np.float32
    )
    want, _ = reference.attention(q, k, v, np.arange(40, 50), qk_scale=0.5, v_scale=2.0)
    np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-5)
    many = rng.standard_normal((60, 8, 64), dtype=np.float32)  # more queries than keys
    o = pagedkv.single_prefill_with_kv_cache(many, k, v, causal=False)
    want, _ = reference.attention(many, k, v, np.arange(-10, 50), causal=False)
    np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="backend must be one of"):
        pagedkv.single_prefill_with_kv_cache(q, k, v, backend="cudnn")
    with pytest.raises(ValueError, match="o_dtype must be None or q's dtype"):
        pagedkv.single_prefill_with_kv_cache(q, k, v, o_dtype=torch.float16)


def test_deprecated_prefill_names():
    rng = np.random.default_rng(7)
    batch = reference.paged_batch(rng, 16, [30, 20], [0, 0])
    pool = rng.standard_normal((batch.num_pages, 2, 16, 2, 64), dtype=np.float32)
    q = rng.standard_normal((8, 8, 64), dtype=np.float32)
    qo_indptr = torch.tensor([0, 5, 8]).cumsum(0) * 0 + torch.tensor([0, 5, 8])  # int64
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    w.begin_forward(qo_indptr, *(torch.from_numpy(x) for x in table(batch)), 8, 2, 64, 16)
    o, lse = w.forward_return_lse(torch.from_numpy(q), torch.from_numpy(pool), causal=True)
    gathered = reference.gather(
        pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD"
    )
    for (k, v), rows in zip(gathered, (slice(0, 5), slice(5, 8)), strict=True):
        n = rows.stop - rows.start
        want_o, want_lse = reference.attention(q[rows], k, v, np.arange(len(k) - n, len(k)))
        np.testing.assert_allclose(o[rows].numpy(), want_o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse[rows].numpy(), want_lse, rtol=1e-5, atol=1e-5)
    same = w.run_return_lse(torch.from_numpy(q), torch.from_numpy(pool))[0]
    np.testing.assert_array_equal(same.numpy(), o.numpy())


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True])
def test_ragged_prefill_matches_reference(layout, causal):
    """Contiguous ragged K/V; without a causal mask a request may have more
    queries than keys (the second request: 9 queries, 4 keys)."""
    rng = np.random.default_rng(8)
    kv_lens, qo_lens = [30, 4, 0, 17], [12, 4 if causal else 9, 0, 17]
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int64)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    k, v = rng.standard_normal((2, int(kv_indptr[-1]), 2, 64), dtype=np.float32)
    q = rng.standard_normal((int(qo_indptr[-1]), 8, 64), dtype=np.float32)
    w = pagedkv.BatchPrefillWithRaggedKVCacheWrapper(None, layout)
    w.plan(qo_indptr, kv_indptr, 8, 2, 64, causal=causal, logits_soft_cap=9.0)
    kk, vv = (x if layout == "NHD" else x.transpose(1, 0, 2).copy() for x in (k, v))
    o, lse = w.run(q, kk, vv, return_lse=True)
    for b in range(4):
        rows, keys = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        n, length = qo_lens[b], kv_lens[b]
        if n == 0:
            continue
        want_o, want_lse = reference.attention(
            q[rows],
            k[keys],
            v[keys],
            np.arange(length - n, length),
            causal=causal,
            logits_soft_cap=9.0,
        )
        np.testing.assert_allclose(o[rows], want_o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse[rows], want_lse, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="k has 3 rows but kv_indptr"):
        w.run(q, kk[:3] if layout == "NHD" else kk[:, :3], vv)


def test_fast_decode_plan_is_plan():
    from pagedkv.fast_decode_plan import fast_decode_plan

    batch, pool, q = decode_case(9)
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    with pytest.raises(ValueError, match="prior plan"):  # as FlashInfer's
        fast_decode_plan(w, *table(batch), 8, 2, 64, 16)
    w.plan(*table(batch), 8, 2, 64, 16)
    fast_decode_plan(w, *table(batch), 8, 2, 64, 16, window_left=10)
    want, _ = decode_reference(batch, pool, q, window_left=10)
    np.testing.assert_allclose(w.run(q, pool), want, rtol=1e-5, atol=1e-5)


def test_several_query_tokens_per_request_keep_flashinfers_contracts():
    """What FlashInfer's test_tensor_core_decode_rejects_mismatched_q_len
    holds its decode to: the Hopper backend refuses q_len_per_req > 1, a
    request shorter than its queries is an empty KV range, and with fixed
    buffers the first plan freezes q_len_per_req (and runs from them)."""
    batch, pool, _ = decode_case(3, lens=(40, 5))
    q = np.random.default_rng(8).standard_normal((4, 8, 64), dtype=np.float32)
    hopper = pagedkv.BatchDecodeWithPagedKVCacheWrapper(
        None, "NHD", use_tensor_cores=True, backend="fa3"
    )
    with pytest.raises(NotImplementedError, match="fa2"):
        hopper.plan(*table(batch), 8, 2, 64, 16, q_len_per_req=2)
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", use_tensor_cores=True)
    with pytest.raises(ValueError, match="empty KV range"):
        w.plan(*table(batch), 8, 2, 64, 16, q_len_per_req=6)
    buffers = [np.zeros(n, np.int32) for n in (3, 8, 2)]
    graph = pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", True, True, *buffers)
    graph.plan(*table(batch), 8, 2, 64, 16, q_len_per_req=2)
    assert buffers[0].tolist() == batch.kv_indptr.tolist()
    plain = pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", use_tensor_cores=True)
    plain.plan(*table(batch), 8, 2, 64, 16, q_len_per_req=2)
    assert np.array_equal(graph.run(q, pool), plain.run(q, pool))
    graph.plan(*table(batch), 8, 2, 64, 16, q_len_per_req=2)  # the same value re-plans
    with pytest.raises(ValueError, match="frozen"):
        graph.plan(*table(batch), 8, 2, 64, 16, q_len_per_req=3)


def test_flashinfer_compat_serves_import_flashinfer():
    for module, name in [
        ("flashinfer.decode", "BatchDecodeWithPagedKVCacheWrapper"),
        ("flashinfer", "BatchPrefillWithRaggedKVCacheWrapper"),
        ("flashinfer.mla", "BatchMLAPagedAttentionWrapper"),
        ("flashinfer", "nvfp4_quantize_append_paged_kv_cache"),
    ]:
        assert flashinfer_serves(module, name), f"{module}.{name}"


FLASHINFER_PAGED_PREFILL_PLAN = (
    "qo_indptr paged_kv_indptr paged_kv_indices paged_kv_last_page_len num_qo_heads "
    "num_kv_heads head_dim_qk page_size head_dim_vo custom_mask packed_custom_mask causal "
    "pos_encoding_mode use_fp16_qk_reduction sm_scale window_left logits_soft_cap rope_scale "
    "rope_theta q_data_type kv_data_type o_data_type non_blocking prefix_len_ptr "
    "token_pos_in_items_ptr token_pos_in_items_len max_item_len_ptr seq_lens seq_lens_q "
    "block_tables max_token_per_sequence max_sequence_kv fixed_split_size disable_split_kv"
).split()
"""BatchPrefillWithPagedKVCacheWrapper.plan's parameters in FlashInfer 0.6.17's
order (flashinfer/prefill.py), so that positional calls land where they do there."""


def test_paged_prefill_plan_takes_flashinfers_positional_order():
    params = parameter_names(pagedkv.BatchPrefillWithPagedKVCacheWrapper.plan)
    assert params[1:] == FLASHINFER_PAGED_PREFILL_PLAN


@pytest.mark.parametrize("agree", [True, False])
def test_plan_takes_a_block_table_that_names_the_same_pages(agree):
    """plan(block_tables=, seq_lens=) (FlashInfer's trtllm-gen form of the
    table) is checked against the CSR table: the same pages plan, others
    raise before anything is planned."""
    indptr, indices = np.array([0, 2, 3], np.int32), np.array([5, 1, 4], np.int32)
    last = np.array([3, 16], np.int32)
    table = np.array([[5, 1, 0], [4, 0, 0]], np.int32)
    seq_lens = np.array([19, 16 if agree else 15], np.int32)
    decode = pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    prefill = pagedkv.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    qo_indptr = np.array([0, 1, 2], np.int32)
    calls = [
        lambda: decode.plan(indptr, indices, last, 4, 4, 64, 16, block_tables=table,
                            seq_lens=seq_lens),
        lambda: prefill.plan(qo_indptr, indptr, indices, last, 4, 4, 64, 16, block_tables=table,
                             seq_lens=seq_lens, seq_lens_q=np.array([1, 1])),
    ]  # fmt: skip
    for call in calls:
        if agree:
            call()
        else:
            with pytest.raises(ValueError, match="other pages than the CSR table"):
                call()
    assert (prefill._planned is None) != agree
    with pytest.raises(ValueError, match="seq_lens_q"):
        prefill.plan(qo_indptr, indptr, indices, last, 4, 4, 64, 16, seq_lens_q=np.array([2, 0]))


def test_decode_plan_is_causal_follows_q_len_per_req():
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", use_tensor_cores=True)
    indptr, indices, last = np.array([0, 1]), np.array([0]), np.array([9])
    w.plan(indptr, indices, last, 4, 4, 64, 16, is_causal=False)
    w.plan(indptr, indices, last, 4, 4, 64, 16, q_len_per_req=2, is_causal=True)
    with pytest.raises(NotImplementedError, match="is_causal"):
        w.plan(indptr, indices, last, 4, 4, 64, 16, is_causal=True)


@pytest.mark.parametrize(
    "wrapper",
    [pagedkv.BatchPrefillWithPagedKVCacheWrapper, pagedkv.BatchPrefillWithRaggedKVCacheWrapper],
)
def test_deprecated_forward_is_not_causal_by_default(wrapper):
    """FlashInfer's deprecated forward() defaults causal to False (run()
    takes the planned mask; forward() takes it with the call)."""
    import inspect

    assert inspect.signature(wrapper.forward).parameters["causal"].default is False


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_prefill_lse_base_and_layout(kind):
    """lse_base="ln" is the base-2 lse times ln 2; lse_layout="HN" its
    transpose, into the caller's [Hq, rows] buffer when given."""
    rng = np.random.default_rng(5)
    qo_indptr, kv_indptr = np.array([0, 3, 7], np.int32), np.array([0, 5, 9], np.int32)
    q = rng.standard_normal((7, 4, 64), dtype=np.float32)
    k = rng.standard_normal((9, 2, 64), dtype=np.float32)
    v = rng.standard_normal((9, 2, 64), dtype=np.float32)
    if kind == "torch":
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    w = pagedkv.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(qo_indptr, kv_indptr, 4, 2, 64, causal=True)
    _, lse2 = w.run(q, k, v, return_lse=True)
    _, lse_ln = w.run(q, k, v, return_lse=True, lse_base="ln")
    into = np.empty((4, 7), np.float32) if kind == "numpy" else torch.empty(4, 7)
    _, lse_hn = w.run(q, k, v, return_lse=True, lse_base="ln", lse_layout="HN", lse=into)
    assert lse_hn is into
    np.testing.assert_allclose(np.asarray(lse_ln), np.asarray(lse2) * np.log(2), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(lse_hn), np.asarray(lse_ln).T)
    with pytest.raises(ValueError, match="lse_layout"):
        w.run(q, k, v, return_lse=True, lse_layout="NHD")
    with pytest.raises(ValueError, match=r'lse \(lse_layout="HN"\) must be \[4, 7\]'):
        w.run(q, k, v, return_lse=True, lse_layout="HN", lse=into[:, :5])


def test_flashinfer_0_7_small_names():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((3, 4, 64), dtype=np.float32)
    k = rng.standard_normal((5, 4, 64), dtype=np.float32)
    o, lse = pagedkv.prefill.single_prefill_with_kv_cache_return_lse(q, k, k, causal=True)
    want_o, want_lse = pagedkv.single_prefill_with_kv_cache(q, k, k, causal=True, return_lse=True)
    np.testing.assert_array_equal(o, want_o)
    np.testing.assert_array_equal(lse, want_lse)
    for wrapper in (
        pagedkv.BatchPrefillWithPagedKVCacheWrapper,
        pagedkv.BatchPrefillWithRaggedKVCacheWrapper,
    ):
        with pytest.raises(ValueError, match="variant_owns_mask"):
            wrapper(None, "NHD", variant_owns_mask=True)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_workspace_methods_of_0_7(kind):
    """workspace_size names the float32 split scratch plan() keeps; after
    reset_workspace_buffer a plan keeps it inside the new buffer (and the
    wrapper measured is unchanged); resolved_backend says "cpu" once planned."""
    pages = np.arange(64, dtype=np.int32)
    indptr, last = np.array([0, 3, 64], np.int32), np.array([5, 16], np.int32)
    if kind == "decode":
        w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
        args = (indptr, pages, last, 8, 2, 64, 16)
    else:
        w = pagedkv.BatchPrefillWithPagedKVCacheWrapper()
        args = (np.array([0, 4, 9], np.int32), indptr, pages, last, 8, 2, 64, 16)
    assert w.resolved_backend == "auto"
    size, int_size = w.workspace_size(*args)
    assert int_size == 0 and size > 0 and size % (4 * 8 * 64) == 0
    assert w._plan is None  # measuring planned nothing here
    workspace = np.zeros(size + 64, np.uint8)
    w.reset_workspace_buffer(workspace, np.zeros(8, np.uint8))
    w.plan(*args)
    assert w._plan.float_workspace_bytes == size
    assert np.shares_memory(w._plan.buffers["partial_o"].to_numpy(), workspace)
    assert w.resolved_backend == "cpu"
    with pytest.raises(TypeError):
        w.reset_workspace_buffer([0, 1, 2])


def test_names_flashinfers_0_7_tests_import():
    """The helpers and stand-ins FlashInfer's trtllm-gen, XQA, MLA and sink
    tests import: what they answer on the CPU, and that a missing kernel
    says so when called (never a wrong number)."""
    torch = pytest.importorskip("torch")
    import pagedkv.flashinfer_compat as compat

    compat.install()
    import flashinfer
    import flashinfer.cute_dsl.utils
    import flashinfer.fp4_quantization
    import flashinfer.jit.attention
    import flashinfer.jit.attention.variants
    import flashinfer.jit.utils
    import flashinfer.prefill
    import flashinfer.utils

    assert flashinfer.jit.utils.filename_safe_dtype_map[torch.bfloat16] == "bf16"
    assert not flashinfer.cute_dsl.utils.is_cute_dsl_arch_supported(10, 0)
    assert flashinfer.utils.get_device_sm_count(torch.device("cpu")) == 1
    # FlashInfer's size: one int32 a (request, head), at least one an SM, a multiple of 8.
    assert flashinfer.utils.get_trtllm_gen_multi_ctas_kv_counter_bytes(3, 5, 1) == 16 * 4
    assert flashinfer.utils.get_trtllm_gen_multi_ctas_kv_counter_bytes(1, 1, 132) == 136 * 4
    assert flashinfer.SfLayout.layout_linear.name == "layout_linear"
    flashinfer.jit.build_jit_specs(
        [flashinfer.jit.attention.gen_batch_prefill_attention_sink_module()]
    )
    with pytest.raises(NotImplementedError, match="not implemented by pagedkv"):
        flashinfer.BatchDecodeMlaWithPagedKVCacheWrapper()


def test_prewarm_paged_kv_stride_variant_checks_the_call_on_every_wrapper():
    """FlashInfer 0.7's decode, prefill, cascade wrappers and BatchAttention
    take it after plan(); pagedkv's kernels read any strides, so it loads
    nothing and only refuses a call before plan() or another variant."""
    batch, pool, _ = decode_case(3, lens=(40, 5))
    decode = pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    prefill = pagedkv.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    cascade = pagedkv.MultiLevelCascadeAttentionWrapper(1, None, "NHD")
    for w in (decode, prefill, cascade):
        with pytest.raises(RuntimeError, match="plan"):
            w.prewarm_paged_kv_stride_variant()
    decode.plan(*table(batch), 8, 2, 64, 16)
    prefill.plan(np.array([0, 1, 2], np.int32), *table(batch), 8, 2, 64, 16)
    cascade.plan([np.array([0, 1, 2], np.int32)], *([t] for t in table(batch)), 8, 2, 64, 16)
    for w in (decode, prefill, cascade):
        w.prewarm_paged_kv_stride_variant()
        with pytest.raises(ValueError, match="independent"):
            w.prewarm_paged_kv_stride_variant("shared")
