"""Batch prefill attention (ragged, causal or not) against the float64 reference.

Request b's queries are its last qo_len tokens (already appended), so the same
call covers a whole prompt, a chunk of a long one (chunked prefill) and a few
draft tokens (speculative decoding). Tolerances as in test_decode.py.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from prefill_helpers import assert_rows_match, ragged_prefill, request_rows, run_prefill

import pagedkv
import reference
from conftest import PREFILL_CONFIGS, as_f64, cast

# (cached tokens after the append, queries) per request.
SHAPES = {
    "prompts": [(9, 9), (40, 40), (1, 1), (0, 0), (130, 130)],
    "chunked": [(300, 64), (64, 64), (17, 5)],
    "speculative": [(500, 4), (33, 1), (80, 3), (7, 7)],
}
OPTIONS = [
    dict(),
    dict(window_left=17),
    dict(logits_soft_cap=30.0, sm_scale=0.05),
    dict(pos_encoding_mode="ROPE_LLAMA"),
    dict(pos_encoding_mode="ALIBI", window_left=0),
]


CASES = [
    (config, shape, options, causal, page_size)
    for i, (config, shape, options, causal, page_size) in enumerate(
        [
            (
                PREFILL_CONFIGS[i % len(PREFILL_CONFIGS)],
                shape,
                OPTIONS[i % len(OPTIONS)],
                i % 3 != 2,
                [1, 16, 5][i % 3],
            )
            for i, shape in enumerate(list(SHAPES) * 3)
        ]
    )
]


@pytest.mark.parametrize(
    "config,shape,options,causal,page_size",
    CASES,
    ids=[
        f"{c[0]}-{c[1]}-{s}-{'causal' if k else 'full'}-P{p}-{sorted(o)}" for c, s, o, k, p in CASES
    ],
)
def test_prefill_matches_reference(config, shape, options, causal, page_size):
    check_prefill_case(config, shape, options, causal, page_size)


@pytest.mark.parametrize("config", PREFILL_CONFIGS[:2], ids=lambda c: f"{c[0]}-{c[2]}")
@pytest.mark.parametrize("options", [dict(), dict(pos_encoding_mode="ROPE_LLAMA")], ids=str)
def test_prefill_product_tiles(config, options):
    """GQA group 3 and head_dim 64: a CPU task's 12 to 63 rows of one KV head
    take the matrix products (mojo_ops/attention/cpu/products.mojo) in tiles of 6 with the
    remainders of 2 and 1 rows, over chunks of 32 keys or fewer, and with two
    queries (6 rows), decode's steps."""
    shape = [(30, 5), (70, 7), (12, 4), (100, 22), (9, 2)]
    check_prefill_case(config, shape, options, True, 5, heads=(6, 2, 64))


@pytest.mark.parametrize("config", PREFILL_CONFIGS[:2], ids=lambda c: f"{c[0]}-{c[2]}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("window", [40, 95])
def test_windows_longer_than_a_chunk(config, causal, window):
    """Windows past a chunk of keys (32): a chunk that each of a task's rows
    sees whole takes the softmax without masks, one that a row's window
    cuts the masked one; with GQA group 3, rows of many queries (matrix
    products) whose windows start at different keys, and one query."""
    shape = [(300, 64), (130, 130), (200, 3), (45, 1)]
    check_prefill_case(config, shape, dict(window_left=window), causal, 16, heads=(6, 2, 64))


@pytest.mark.parametrize("config", PREFILL_CONFIGS[:2], ids=lambda c: f"{c[0]}-{c[2]}")
@pytest.mark.parametrize("head_dim", [192, 512])
def test_prefill_large_and_odd_head_dims(config, head_dim):
    """head_dim 512 (FlashInfer's largest) and 192 (three granules): the CPU
    kernel's one compiled variant, with its row tiles and key chunks."""
    check_prefill_case(config, [(40, 40), (70, 9), (5, 5)], {}, True, 16, heads=(4, 2, head_dim))


@pytest.mark.parametrize("config", PREFILL_CONFIGS[:2], ids=lambda c: f"{c[0]}-{c[2]}")
def test_causal_prefill_with_more_queries_than_keys(config):
    """FlashInfer's convention: the first qo_len - kv_len causal queries sit
    before position 0 and see no key (o = 0, lse = -inf); the rest as usual."""
    check_prefill_case(config, [(10, 25), (40, 40), (3, 70)], {}, True, 16, heads=(6, 2, 64))


def check_prefill_case(
    config, shape, options, causal, page_size, device="cpu", heads=(8, 2, 128)
) -> None:
    """One ragged prefill on device ("cpu" or "cuda") against the reference:
    shape a name in SHAPES or its list of (cached tokens, queries);
    heads (query heads, KV heads, head_dim)."""
    # A stable seed: hash() of a str changes from process to process.
    rng = np.random.default_rng(zlib.crc32(repr((shape, causal, page_size)).encode()))
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    batch, pool, q = ragged_prefill(rng, config, shape, heads, page_size)
    o, lse = run_prefill(config, batch, pool, q, device, causal=causal, **options)
    tol = 1e-5 if config[0] == "float32" else 1e-2
    o, lse = as_f64(o), as_f64(lse)
    for lo, hi, k, v, positions in request_rows(batch, pool, config[2]):
        if hi == lo:
            continue
        want_o, want_lse = reference.attention(
            as_f64(q)[lo:hi], k, v, positions, causal=causal, **options
        )
        assert_rows_match(o[lo:hi], lse[lo:hi], want_o, want_lse, tol)


def test_prefill_then_decode_agree_on_last_token():
    """The last query of a prompt is exactly a decode query."""
    rng = np.random.default_rng(4)
    batch = reference.paged_batch(rng, 16, [37, 90], [37, 90])
    pool = rng.standard_normal((batch.num_pages, 2, 16, 2, 64), dtype=np.float32)
    q = rng.standard_normal((batch.nnz, 8, 64), dtype=np.float32)
    table = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    prefill = pagedkv.BatchPrefillWithPagedKVCacheWrapper()
    prefill.plan(batch.append_indptr, *table, 8, 2, 64, 16, causal=True)
    o = prefill.run(q, pool)
    decode = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    decode.plan(*table, 8, 2, 64, 16)
    last = batch.append_indptr[1:] - 1
    np.testing.assert_allclose(decode.run(q[last], pool), o[last], rtol=1e-5, atol=1e-6)
    # The same prefill into the caller's arrays (out=, lse=).
    out = np.full_like(o, np.nan)
    lse = np.full(q.shape[:2], np.nan, np.float32)
    got = prefill.run(q, pool, return_lse=True, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    np.testing.assert_array_equal(out, o)
    assert np.isfinite(lse).all()


@pytest.mark.parametrize("config", PREFILL_CONFIGS[:2], ids=lambda c: f"{c[0]}-{c[2]}")
@pytest.mark.parametrize(
    "causal,options",
    [
        (True, dict(pos_encoding_mode="ROPE_LLAMA")),
        (False, dict(window_left=9, logits_soft_cap=30.0)),
    ],
    ids=["causal-rope", "full-window-cap"],
)
def test_single_prefill_matches_reference(config, causal, options):
    """One request over contiguous K/V ([L, Hkv, D] or [Hkv, L, D]): its
    23 queries are the last of 70 tokens, as FlashInfer places them."""
    q_dtype, kv_dtype, layout = config
    rng = np.random.default_rng(13)
    k, v = rng.standard_normal((2, 70, 2, 64), dtype=np.float32)
    q = cast(rng.standard_normal((23, 8, 64), dtype=np.float32), q_dtype)
    kk, vv = (cast(x if layout == "NHD" else x.transpose(1, 0, 2).copy(), kv_dtype) for x in (k, v))
    o, lse = pagedkv.single_prefill_with_kv_cache(
        q, kk, vv, causal=causal, kv_layout=layout, return_lse=True, **options
    )
    assert tuple(o.shape) == (23, 8, 64) and tuple(lse.shape) == (23, 8)
    want_o, want_lse = reference.attention(
        as_f64(q),
        *(as_f64(cast(x, kv_dtype)) for x in (k, v)),
        np.arange(47, 70),
        causal=causal,
        **options,
    )
    tol = 1e-5 if q_dtype == "float32" else 1e-2
    np.testing.assert_allclose(as_f64(o), want_o, rtol=tol, atol=tol)
    np.testing.assert_allclose(as_f64(lse), want_lse, rtol=tol, atol=tol)


def test_single_prefill_edges_and_bad_input():
    rng = np.random.default_rng(14)
    k, v = rng.standard_normal((2, 30, 2, 64), dtype=np.float32)
    q = rng.standard_normal((30, 8, 64), dtype=np.float32)
    # A whole prompt, causal: row i is a decode of query i over keys 0..i.
    o = pagedkv.single_prefill_with_kv_cache(q, k, v, causal=True)
    for i in (0, 17, 29):
        np.testing.assert_allclose(
            o[i],
            pagedkv.single_decode_with_kv_cache(q[i], k[: i + 1], v[: i + 1]),
            rtol=1e-5,
            atol=1e-6,
        )
    none, lse = pagedkv.single_prefill_with_kv_cache(q[:0], k, v, return_lse=True)
    assert none.shape == (0, 8, 64) and lse.shape == (0, 8)
    none, lse = pagedkv.single_prefill_with_kv_cache(q[:0], k[:0], v[:0], return_lse=True)
    assert none.shape == (0, 8, 64) and lse.shape == (0, 8)
    # More causal queries than keys, as FlashInfer allows: query i sits at
    # kv_len - qo_len + i, so the first sees nothing (o = 0, lse = -inf).
    o, lse = pagedkv.single_prefill_with_kv_cache(q, k[:29], v[:29], causal=True, return_lse=True)
    want, want_lse = reference.attention(q, k[:29], v[:29], np.arange(-1, 29))
    np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)
    assert (o[0] == 0).all() and (lse[0] == -np.inf).all()
    np.testing.assert_allclose(lse[1:], want_lse[1:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"q must be \[qo_len, Hq, D\]"):
        pagedkv.single_prefill_with_kv_cache(q[0], k, v)
    with pytest.raises(ValueError, match="k, v the same"):
        pagedkv.single_prefill_with_kv_cache(q, k, v[:29])
    with pytest.raises(ValueError, match="custom_mask has 870 elements"):
        pagedkv.single_prefill_with_kv_cache(q, k, v, custom_mask=np.ones((30, 29), bool))


def test_prefill_bad_input():
    rng = np.random.default_rng(2)
    batch = reference.paged_batch(rng, 16, [10, 5], [10, 5])
    table = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    with pytest.raises(ValueError, match="use_cuda_graph=True needs"):
        pagedkv.BatchPrefillWithPagedKVCacheWrapper(None, "NHD", True)
    with pytest.raises(ValueError, match="no cudnn kernel"):
        pagedkv.BatchPrefillWithPagedKVCacheWrapper(backend="cudnn")
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper(None, "NHD", False, backend="fa2")
    with pytest.raises(ValueError, match="never decrease"):
        w.plan(np.array([0, 11, 10], np.int32), *table, 4, 2, 64, 16)
    with pytest.raises(ValueError, match="custom_mask has 3 elements"):
        w.plan(batch.append_indptr, *table, 4, 2, 64, 16, custom_mask=np.ones(3, bool))
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(np.zeros((15, 4, 64), np.float32), np.zeros((2, 2, 16, 2, 64), np.float32))
    w.plan(batch.append_indptr, *table, 4, 2, 64, 16, q_data_type="float32")
    with pytest.raises(ValueError, match="q must be"):
        w.run(
            np.zeros((14, 4, 64), np.float32), np.zeros((batch.num_pages, 2, 16, 2, 64), np.float32)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("config,shape,options,causal,page_size", CASES)
def test_prefill_on_gpu(config, shape, options, causal, page_size):
    check_prefill_case(config, shape, options, causal, page_size, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 2, 64), (9, 3, 64)], ids=["group4", "group3"])
@pytest.mark.parametrize("shape", ["prompts", "chunked"])
def test_step_graph_prefill_on_gpu(shape, heads):
    """The step graphs' prefill on a GPU: bfloat16 NHD pools of page 16 and
    head dim 64 with the demo model's and SmolLM2's groups (the cases above
    run bfloat16 only in HND, at head dim 128)."""
    config = ("bfloat16", "bfloat16", "NHD")
    check_prefill_case(config, shape, {}, True, 16, device="cuda", heads=heads)


QK, VO = 192, 128
"""DeepSeek's non-absorbed MLA prefill: 192-lane queries and keys, 128-lane values."""


def test_value_rows_shorter_than_the_queries():
    """head_dim_vo 128 under head_dim_qk 192, in single_prefill, the ragged
    wrapper (torch bfloat16 too) and the paged wrapper over a (K, V) pair:
    o has 128 lanes and equals float64 attention with the 192-lane scale."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((20, 4, QK), dtype=np.float32)
    k = rng.standard_normal((30, 2, QK), dtype=np.float32)
    v = rng.standard_normal((30, 2, VO), dtype=np.float32)
    want_single, _ = reference.attention(q, k, v, np.arange(10, 30), causal=True)
    o = pagedkv.single_prefill_with_kv_cache(q, k, v, causal=True)
    np.testing.assert_allclose(o, want_single, rtol=1e-5, atol=1e-5)

    qo, kv = np.array([0, 8, 20], np.int32), np.array([0, 10, 30], np.int32)
    want = np.concatenate(
        [
            reference.attention(q[0:8], k[0:10], v[0:10], np.arange(2, 10), causal=True)[0],
            reference.attention(q[8:20], k[10:30], v[10:30], np.arange(8, 20), causal=True)[0],
        ]
    )
    ragged = pagedkv.BatchPrefillWithRaggedKVCacheWrapper()
    ragged.plan(qo, kv, 4, 2, QK, VO, causal=True)
    np.testing.assert_allclose(ragged.run(q, k, v), want, rtol=1e-5, atol=1e-5)
    # A caller's lse buffer is filled without return_lse (FlashInfer's tests read it).
    _, lse = ragged.run(q, k, v, return_lse=True)
    buffer = np.full_like(lse, np.nan)
    ragged.run(q, k, v, lse=buffer)
    np.testing.assert_array_equal(buffer, lse)
    # FlashInfer's ragged-only backends name the same kernel (its tests take
    # "cutlass" as their reference); the paged wrapper has no such backend.
    cutlass = pagedkv.BatchPrefillWithRaggedKVCacheWrapper(backend="cutlass")
    cutlass.plan(qo, kv, 4, 2, QK, VO, causal=True)
    np.testing.assert_allclose(cutlass.run(q, k, v), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="backend"):
        pagedkv.BatchPrefillWithPagedKVCacheWrapper(backend="cutlass")
    ragged_bf16 = pagedkv.BatchPrefillWithRaggedKVCacheWrapper()
    ragged_bf16.plan(qo, kv, 4, 2, QK, VO, causal=True)
    o_bf16 = ragged_bf16.run(*(cast(x, "bfloat16") for x in (q, k, v)))
    assert tuple(o_bf16.shape) == (20, 4, VO)
    np.testing.assert_allclose(as_f64(o_bf16), want, rtol=2e-2, atol=2e-2)

    # The same K/V as a paged (K, V) pair: 8 pages of 4 tokens in order;
    # request 0 reads tokens 0..9 (pages 0-2), request 1 tokens 8..29 (2-7).
    k_pages = np.concatenate([k, np.zeros((2, 2, QK), np.float32)]).reshape(8, 4, 2, QK)
    v_pages = np.concatenate([v, np.zeros((2, 2, VO), np.float32)]).reshape(8, 4, 2, VO)
    paged = pagedkv.BatchPrefillWithPagedKVCacheWrapper()
    indptr, last = np.array([0, 3, 9], np.int32), np.array([2, 2], np.int32)
    indices = np.array([0, 1, 2, 2, 3, 4, 5, 6, 7], np.int32)
    # Two spare pages the plan never reads (not copied when V is widened).
    k_pages = np.concatenate([k_pages, np.full((2, 4, 2, QK), np.nan, np.float32)])
    v_pages = np.concatenate([v_pages, np.full((2, 4, 2, VO), np.nan, np.float32)])
    want1 = reference.attention(q[8:20], k[8:30], v[8:30], np.arange(10, 22), causal=True)[0]
    paged.plan(qo, indptr, indices, last, 4, 2, QK, 4, head_dim_vo=VO, causal=True)
    out = np.empty((20, 4, VO), np.float32)
    got = paged.run(q, (k_pages, v_pages), out=out)
    assert got is out
    np.testing.assert_allclose(got[:8], want[:8], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[8:], want1, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"\(K, V\) pair"):
        paged.run(q, np.zeros((7, 2, 4, 2, QK), np.float32))
    with pytest.raises(ValueError, match="head_dim_vo"):
        paged.plan(qo, indptr, indices, last, 4, 2, VO, 4, head_dim_vo=QK)
