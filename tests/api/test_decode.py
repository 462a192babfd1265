"""Batch decode attention against a float64 NumPy reference (tests/reference.py).

A sampled grid: every value of every axis appears in some case, cycled with
different strides so that values meet in many combinations, while the suite
compiles only the (q dtype, kv dtype, layout, pool form) graphs it needs.
Tolerances: 1e-5 in float32; 1e-2 in 16-bit (the output's own rounding);
1e-2 for fp8 caches too, since the reference reads the same fp8 values
(FlashInfer checks fp8 at 1e-3 against its own fp16 kernel on those values).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from decode_helpers import (
    Case,
    build,
    check_decode_case,
    mma_applies,
    planned,
    references,
    sampled_grid,
    tma_applies,
)

import pagedkv
import reference
from conftest import COMPILED_DECODE_CONFIGS, as_f64, cast, to_device


@pytest.mark.parametrize("case", sampled_grid(), ids=str)
def test_decode_matches_reference(case: Case):
    check_decode_case(case)


# How a CPU task walks its KV heads depends on the heads it holds and their
# query rows: heads of one row go 4 (float32) or 8 (16-bit, fp8) at a time,
# of two rows half as many, the rest one by one in tiles of 8, 4, 3, 2, 1 rows,
# heads of three or more rows over sub-blocks of a block's tokens; blocks of
# tokens are sized to the heads' bytes, and wide blocks skip the software
# prefetch. Each case takes a different mix of these paths.
TASK_SHAPES = [
    Case("float16", "float16", 7, 1, 8, 128, 16, "NHD", "pool", "NONE", -1, None, None, 51),
    Case("float32", "float32", 7, 1, 6, 64, 16, "NHD", "pool", "NONE", -1, None, None, 52),
    Case("bfloat16", "bfloat16", 7, 2, 6, 128, 16, "HND", "pair", "NONE", -1, None, None, 53),
    Case("float32", "float32", 7, 3, 4, 64, 1, "NHD", "pair", "NONE", 17, 30.0, None, 54),
    Case("float32", "float32", 3, 1, 32, 128, 16, "NHD", "pool", "NONE", -1, None, None, 55),
    Case("float16", "float8_e4m3fn", 7, 2, 8, 64, 16, "NHD", "pool", "ALIBI", -1, None, None, 56),
    Case("float32", "float32", 7, 1, 8, 64, 64, "HND", "pool", "ROPE_LLAMA", -1, None, None, 57),
    # Group 4 over 8 heads: bfloat16 blocks of 8 tokens, in sub-blocks of 4
    # with AVX-512, whole with AVX2.
    Case("bfloat16", "bfloat16", 3, 4, 8, 128, 16, "NHD", "pool", "NONE", -1, None, None, 58),
    # Group 4: sub-blocks that do not divide their block, in requests of 16
    # and 17 tokens too, where a token lost or counted twice moves o far
    # past the tolerance. With AVX2, 9 float32 heads of dim 256 (9 KiB a
    # token) take streamed blocks of 4 tokens in sub-blocks of 3 and 1;
    # with AVX-512, 3 bfloat16 heads of dim 128 take blocks of 24 in
    # sub-blocks of 10, 10 and 4 (short requests: 10 and 6 or 7).
    Case("float32", "float32", 7, 4, 9, 256, 16, "NHD", "pool", "NONE", -1, None, None, 59),
    Case("bfloat16", "bfloat16", 7, 4, 3, 128, 16, "NHD", "pool", "NONE", -1, None, None, 60),
    # Groups 3 (SmolLM2's) and 7: a head's rows in a tile of 3, and in tiles
    # of 4 and 3, whose scoring steps reduce 6 or 12 dots (padded to 8, 16).
    Case("float16", "float16", 7, 3, 3, 64, 16, "NHD", "pool", "NONE", -1, None, None, 61),
    Case("float32", "float32", 7, 7, 2, 128, 16, "HND", "pool", "NONE", -1, None, None, 62),
]


@pytest.mark.parametrize("case", TASK_SHAPES, ids=str)
def test_task_head_mixes_match_reference(case: Case):
    check_decode_case(case)


# bfloat16 q against bfloat16 K: every product of two bfloat16 values is
# exact in float32, whether K is widened for FMAs or taken by AVX512_BF16's
# dot products (q then unscaled, the scale applied to the scores), so lse,
# in float32, holds to float32 sums, far inside the 1e-2 of the bfloat16
# output; q rounded or scaled twice would move it by about that much. Groups
# 1, 2, 3, 4 and 8 take each scoring tile.
LSE_CASES = [
    Case("bfloat16", "bfloat16", 3, g, h, 128, 16, "NHD", "pool", "NONE", -1, None, s, 70 + g)
    for g, h, s in [(1, 8, None), (2, 4, 0.05), (3, 3, None), (4, 8, None), (8, 2, 0.3)]
]


@pytest.mark.parametrize("case", LSE_CASES, ids=str)
def test_bfloat16_scores_keep_float32_accuracy(case: Case):
    batch, pool, cache = build(case)
    wrapper = planned(case, batch)
    rng = np.random.default_rng(case.seed)
    shape = (batch.batch_size, case.group * case.kv_heads, case.head_dim)
    # Scores of a few units: a relative error of q's rounding (2^-9) would
    # show in lse as about 1e-2.
    q = cast(3 * rng.standard_normal(shape, dtype=np.float32), case.q_dtype)
    o, lse = wrapper.run(q, cache, return_lse=True)
    want_o, want_lse = references(case, batch, pool, q)
    np.testing.assert_allclose(as_f64(o), want_o, rtol=1e-2, atol=1e-2)
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(as_f64(lse)[finite], want_lse[finite], rtol=2e-5, atol=2e-5)


def test_every_task_shape_is_compiled_with_the_suite():
    """A TASK_SHAPES config outside the suite's one compiled module would
    cost a compile of its own (~30 s)."""
    shapes = {(c.q_dtype, c.kv_dtype, c.layout) for c in TASK_SHAPES}
    assert shapes <= set(COMPILED_DECODE_CONFIGS)


def test_empty_and_single_token_requests():
    rng = np.random.default_rng(7)
    batch = reference.paged_batch(rng, 16, [0, 1, 0, 3], [0] * 4)
    pool = rng.standard_normal((batch.num_pages, 2, 16, 2, 64), dtype=np.float32)
    q = rng.standard_normal((4, 4, 64), dtype=np.float32)
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 4, 2, 64, 16)
    o, lse = w.run(q, pool, return_lse=True)
    assert (o[[0, 2]] == 0).all() and (lse[[0, 2]] == -np.inf).all()
    # One token: the output is its V row exactly (up to float32 rounding).
    page = batch.kv_indices[batch.kv_indptr[1]]
    np.testing.assert_allclose(o[1], np.repeat(pool[page, 1, 0], 2, axis=0), rtol=1e-6)


def test_a_strided_torch_q_gets_a_contiguous_o():
    """q a transposed view (dense, not contiguous): run() reads it through a
    contiguous copy and returns o [B, Hq, D] in row-major order."""
    rng = np.random.default_rng(11)
    batch = reference.paged_batch(rng, 16, [40, 7, 19], [0] * 3)
    pool = rng.standard_normal((batch.num_pages, 2, 16, 2, 64), dtype=np.float32)
    q_heads_first = rng.standard_normal((8, 3, 64), dtype=np.float32)  # [Hq, B, D]
    q = torch.from_numpy(q_heads_first).transpose(0, 1)
    assert not q.is_contiguous()
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, 16)
    o = w.run(q, torch.from_numpy(pool))
    assert o.shape == (3, 8, 64) and o.is_contiguous()
    for b, (k, v) in enumerate(
        reference.gather(pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD")
    ):
        want_o, _ = reference.attention(q.numpy()[b : b + 1], k, v, np.array([len(k) - 1]))
        np.testing.assert_allclose(o[b].numpy(), want_o[0], rtol=1e-5, atol=1e-5)


def test_extreme_logits_stay_finite_and_correct():
    """Scores around 1e4: the running max keeps exp2 in range."""
    rng = np.random.default_rng(3)
    batch = reference.paged_batch(rng, 16, [700, 45], [0, 0])
    pool = rng.standard_normal((batch.num_pages, 2, 16, 1, 128), dtype=np.float32) * 30
    q = rng.standard_normal((2, 4, 128), dtype=np.float32) * 30
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 4, 1, 128, 16, sm_scale=1.0)
    o, lse = w.run(q, pool, return_lse=True)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    assert np.abs(lse).max() > 5e3
    for b, (k, v) in enumerate(
        reference.gather(pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD")
    ):
        want_o, want_lse = reference.attention(
            q[b : b + 1], k, v, np.array([len(k) - 1]), sm_scale=1.0
        )
        np.testing.assert_allclose(o[b], want_o[0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(lse[b], want_lse[0], rtol=1e-6)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_decode_matches_reference(layout):
    rng = np.random.default_rng(11)
    k = rng.standard_normal((300, 2, 64), dtype=np.float32)
    v = rng.standard_normal((300, 2, 64), dtype=np.float32)
    q = rng.standard_normal((8, 64), dtype=np.float32)
    kk, vv = (
        (k, v) if layout == "NHD" else (k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy())
    )
    o, lse = pagedkv.single_decode_with_kv_cache(
        q, kk, vv, kv_layout=layout, logits_soft_cap=20.0, return_lse=True
    )
    want_o, want_lse = reference.attention(q[None], k, v, np.array([299]), logits_soft_cap=20.0)
    np.testing.assert_allclose(o, want_o[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse[0], rtol=1e-5, atol=1e-5)
    empty = pagedkv.single_decode_with_kv_cache(
        q,
        kk[:0] if layout == "NHD" else kk[:, :0],
        vv[:0] if layout == "NHD" else vv[:, :0],
        kv_layout=layout,
    )
    assert (empty == 0).all()
    # With no keys the kernel does not run; bad arguments still raise.
    no_k, no_v = np.zeros((0, 2, 64), np.float32), np.zeros((0, 2, 64), np.float32)
    with pytest.raises(ValueError, match="head_dim"):
        pagedkv.single_decode_with_kv_cache(q[:, :32], no_k, no_v)
    with pytest.raises(ValueError, match="multiple"):
        pagedkv.single_decode_with_kv_cache(q[:7], no_k, no_v)
    with pytest.raises(TypeError, match="q dtype"):
        pagedkv.single_decode_with_kv_cache(q.astype(np.int32), no_k, no_v)


def test_single_decode_takes_flashinfer_scales():
    """float8 K/V with FlashInfer's q_scale, k_scale and v_scale, passed by
    name as FlashInfer callers do; use_tensor_cores changes nothing."""
    rng = np.random.default_rng(12)
    k, v = (
        cast(rng.standard_normal((150, 2, 128), dtype=np.float32), "float8_e4m3fn")
        for _ in range(2)
    )
    q = cast(rng.standard_normal((8, 128), dtype=np.float32), "float16")
    scales = {"q_scale": 1.5, "k_scale": 0.5, "v_scale": 2.0}
    o, lse = pagedkv.single_decode_with_kv_cache(q, k, v, return_lse=True, **scales)
    want_o, want_lse = reference.attention(
        as_f64(q)[None], as_f64(k), as_f64(v), np.array([149]), qk_scale=0.75, v_scale=2.0
    )
    np.testing.assert_allclose(as_f64(o), want_o[0], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(as_f64(lse), want_lse[0], rtol=1e-2, atol=1e-2)
    same = pagedkv.single_decode_with_kv_cache(q, k, v, use_tensor_cores=True, **scales)
    np.testing.assert_array_equal(as_f64(same), as_f64(o))
    # A scale may be a one-element array; a bad one raises naming it.
    as_arrays = {name: np.float32([value]) for name, value in scales.items()}
    again = pagedkv.single_decode_with_kv_cache(q, k, v, **as_arrays)
    np.testing.assert_array_equal(as_f64(again), as_f64(o))
    for name, bad, error in [("v_scale", np.ones(2), ValueError), ("k_scale", "two", TypeError)]:
        with pytest.raises(error, match=name):
            pagedkv.single_decode_with_kv_cache(q, k, v, **{**scales, name: bad})


def test_flashinfer_style_construction_runs_the_same_decode():
    """FlashInfer's positional (workspace, layout, use_cuda_graph,
    use_tensor_cores) construction and its backend name "fa2": neither
    changes the output."""
    rng = np.random.default_rng(9)
    batch = reference.paged_batch(rng, 16, [40, 3], [0, 0])
    pool = rng.standard_normal((batch.num_pages, 2, 16, 2, 64), dtype=np.float32)
    table = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    q = rng.standard_normal((2, 8, 64), dtype=np.float32)
    outputs = []
    for wrapper in (
        pagedkv.BatchDecodeWithPagedKVCacheWrapper(),
        pagedkv.BatchDecodeWithPagedKVCacheWrapper(np.empty(1 << 20, np.uint8), "NHD", False, True),
        pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", use_tensor_cores=True),
        pagedkv.BatchDecodeWithPagedKVCacheWrapper(backend="fa2"),
    ):
        wrapper.plan(*table, 8, 2, 64, 16)
        outputs.append(wrapper.run(q, pool))
    for output in outputs[1:]:
        np.testing.assert_array_equal(output, outputs[0])


def test_decode_bad_input():
    rng = np.random.default_rng(5)
    batch = reference.paged_batch(rng, 16, [40, 3], [0, 0])
    pool = rng.standard_normal((batch.num_pages, 2, 16, 2, 64), dtype=np.float32)
    table = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    q = rng.standard_normal((2, 4, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="backend must be one of"):
        pagedkv.BatchDecodeWithPagedKVCacheWrapper(backend="fast")
    with pytest.raises(ValueError, match="no cudnn kernel"):
        pagedkv.BatchDecodeWithPagedKVCacheWrapper(backend="cudnn")
    with pytest.raises(ValueError, match="use_cuda_graph=True needs"):
        pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", True)
    with pytest.raises(ValueError, match="page table is on the CPU"):
        pagedkv.BatchDecodeWithPagedKVCacheWrapper(backend="tma").plan(*table, 4, 2, 64, 16)
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(q, pool)
    with pytest.raises(ValueError, match="multiple of"):
        w.plan(*table, 6, 4, 64, 16)
    with pytest.raises(ValueError, match="head_dim"):
        w.plan(*table, 4, 2, 96, 16)
    # Wider integers are narrowed (tests/api/test_flashinfer_api.py); floats are refused.
    float_indices = (batch.kv_indptr, batch.kv_indices.astype(np.float32), batch.kv_last_page_len)
    with pytest.raises(TypeError, match="indices must be int32"):
        w.plan(*float_indices, 4, 2, 64, 16)
    bad = batch.kv_indptr.copy()
    bad[1] = bad[2] + 1
    with pytest.raises(ValueError, match="kv_indptr"):
        w.plan(bad, batch.kv_indices, batch.kv_last_page_len, 4, 2, 64, 16)
    w.plan(*table, 4, 2, 64, 16, q_data_type="float32")
    with pytest.raises(ValueError, match="q must be"):
        w.run(q[:1], pool)
    with pytest.raises(ValueError, match="page_size, num_kv_heads, head_dim"):
        w.run(q, pool.reshape(batch.num_pages, 2, 8, 4, 64))
    with pytest.raises(TypeError, match="the cache is float16"):
        w.run(q, pool.astype(np.float16))
    with pytest.raises(TypeError, match="q is float16"):
        w.run(q.astype(np.float16), pool)
    with pytest.raises(ValueError, match="holds"):
        w.run(q, pool[: int(batch.kv_indices.max())])
    # The same call, corrected, runs.
    assert np.isfinite(w.run(q, pool)).all()


def test_decode_backends_choose_gpu_kernels():
    """The kernel code plan() passes: "auto" leaves the choice to the GPU
    kernel, "tma" insists on the Hopper kernel, "mma" on the tensor-core one,
    the CPU has only one."""
    from pagedkv._plan.work import (
        GPU_KERNEL_AUTO,
        GPU_KERNEL_GENERIC,
        GPU_KERNEL_MMA,
        GPU_KERNEL_TMA,
        decode_kernel,
    )

    def kernel(backend, is_gpu=True, layout="NHD", page_size=16, group=4, pos="NONE"):
        return decode_kernel(backend, is_gpu, layout, page_size, group, pos)

    assert kernel("auto") == GPU_KERNEL_AUTO
    assert kernel("auto", is_gpu=False) == GPU_KERNEL_GENERIC
    assert kernel("generic") == GPU_KERNEL_GENERIC
    assert kernel("fa2") == GPU_KERNEL_GENERIC
    assert kernel("tma") == GPU_KERNEL_TMA
    assert kernel("tma", page_size=None) == GPU_KERNEL_TMA  # a symbolic page size
    assert kernel("mma", group=16) == GPU_KERNEL_MMA
    for backend, bad, why in [
        ("tma", {"layout": "HND"}, "needs NHD"),
        ("tma", {"page_size": 24}, "multiple of 16"),
        ("tma", {"group": 16}, "at most 8"),
        ("mma", {"group": 17}, "at most 16"),
        ("mma", {"pos": "ROPE_LLAMA"}, "RoPE"),
    ]:
        with pytest.raises(ValueError, match=why):
            kernel(backend, **bad)


@pytest.mark.parametrize(
    "lens,window_left",
    [([65536], -1), ([4096] * 16, -1), ([0, 1, 17, 4100], -1), ([3000, 64, 65], 700), ([5, 0], 0)],
)
def test_gpu_decode_work_tiles_requests_in_even_waves(lens, window_left, monkeypatch):
    """GPU work items (planned on the CPU): each request's visible keys tiled
    once, in order, by page-aligned chunks at most a page apart in length,
    and a long lone request split to fill exactly one wave of thread blocks."""
    from pagedkv._plan import work
    from pagedkv._plan.work import decode_work

    monkeypatch.setattr(work, "gpu_sm_count", lambda: 132)
    options = type("Options", (), {"window_left": window_left})()
    items, request_items = decode_work(np.array(lens), 16, 32, 8, 1, options, is_gpu=True)
    for b, length in enumerate(lens):
        first, end = items[request_items[b] : request_items[b + 1], 4:6].T
        visible_from = 0 if window_left < 0 else max(length - 1 - window_left, 0)
        assert first[0] == visible_from and end[-1] == length
        np.testing.assert_array_equal(first[1:], end[:-1])
        assert (first[1:] % 16 == 0).all()
        if len(first) > 1:
            pages = -(-(end - first // 16 * 16) // 16)
            assert pages.max() - pages.min() <= 1
    if lens == [65536]:
        # 8 KV heads x 33 chunks = 264 blocks: 2 per SM of 132.
        assert len(items) == 33


@pytest.mark.parametrize(
    "batch,length,splits",
    [(64, 8192, 1), (64, 4096, 1), (16, 4096, 2), (8, 2048, 4), (1, 65536, 33)],
)
def test_gpu_decode_work_splits_only_to_fill_the_gpu(batch, length, splits, monkeypatch):
    """On 132 SMs, requests whose blocks already fill two waves keep one
    chunk each (a block's start outweighs a fuller last wave), and shorter
    batches split until a wave is full: the splits that ran fastest in the
    H100 sweep of docs/gpu.md."""
    from pagedkv._plan import work
    from pagedkv._plan.work import decode_work

    monkeypatch.setattr(work, "gpu_sm_count", lambda: 132)
    options = type("Options", (), {"window_left": -1})()
    items, _ = decode_work(np.full(batch, length), 16, 32, 8, 1, options, is_gpu=True)
    assert len(items) == batch * splits


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_decode_writes_into_out_and_lse(kind):
    """run(out=, lse=) fills the caller's arrays with what run() returns."""
    rng = np.random.default_rng(11)
    batch = reference.paged_batch(rng, 16, [40, 3, 0], [0, 0, 0])
    pool = rng.standard_normal((batch.num_pages, 2, 16, 2, 64), dtype=np.float32)
    q = rng.standard_normal((3, 4, 64), dtype=np.float32)
    table = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    full = np.full
    if kind == "torch":
        pool, q = torch.from_numpy(pool), torch.from_numpy(q)
        table = tuple(torch.from_numpy(x) for x in table)

        def full(shape, value, dtype):
            return torch.full(shape, value, dtype=getattr(torch, np.dtype(dtype).name))

    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(*table, 4, 2, 64, 16)
    want_o, want_lse = w.run(q, pool, return_lse=True)
    out, lse = full((3, 4, 64), np.nan, np.float32), full((3, 4), np.nan, np.float32)
    got_o, got_lse = w.run(q, pool, return_lse=True, out=out, lse=lse)
    assert got_o is out and got_lse is lse
    np.testing.assert_array_equal(as_f64(out), as_f64(want_o))
    np.testing.assert_array_equal(as_f64(lse), as_f64(want_lse))
    # Without return_lse the caller's lse is not written.
    out, lse = full((3, 4, 64), np.nan, np.float32), full((3, 4), np.nan, np.float32)
    assert w.run(q, pool, out=out, lse=lse) is out
    np.testing.assert_array_equal(as_f64(out), as_f64(want_o))
    assert np.isnan(as_f64(lse)).all()
    # Outputs that cannot take the results are refused before the kernel runs.
    bad = {
        "must be \\[3, 4, 64\\]": (full((2, 4, 64), np.nan, np.float32), None),
        "out must be float32": (full((3, 4, 64), np.nan, np.float16), None),
        "contiguous": (full((3, 4, 128), np.nan, np.float32)[..., ::2], None),
        "lse must be \\[3, 4\\]": (full((3, 4, 64), np.nan, np.float32), full((4,), 0, np.float32)),
    }
    for pattern, (bad_out, bad_lse) in bad.items():
        with pytest.raises((ValueError, TypeError), match=pattern):
            w.run(q, pool, return_lse=True, out=bad_out, lse=bad_lse)
        assert np.isnan(as_f64(bad_out)).all(), pattern


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["generic", "tma", "mma", "auto"])
@pytest.mark.parametrize("case", sampled_grid(), ids=str)
def test_decode_on_gpu(case: Case, backend: str):
    """Each case with each kernel ("auto" picks one: the test above).
    A head dim the GPU kernels are not built for is refused at plan()."""
    if case.head_dim not in (64, 128, 256):
        if backend != "auto":
            pytest.skip("a CPU-only head dim: the 'auto' case checks its refusal")
        with pytest.raises(ValueError, match="runs on the CPU only"):
            check_decode_case(case, device="cuda", backend=backend)
        return
    if backend == "tma" and not tma_applies(case):
        pytest.skip("the TMA kernel does not serve this case")
    if backend == "mma" and not mma_applies(case):
        pytest.skip("the tensor-core kernel does not serve this case")
    check_decode_case(case, device="cuda", backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize(("group", "kernel"), [(4, "tma"), (8, "mma"), (16, "mma")])
def test_auto_runs_the_kernel_its_group_asks_for(group: int, kernel: str):
    """ "auto" runs the tensor-core kernel from 8 query heads per KV head and
    the TMA kernel below: its output is that kernel's, bit for bit (one
    plan, one kernel, the same inputs)."""
    case = Case("bfloat16", "bfloat16", 5, group, 2, 128, 16, "NHD", "pool", "NONE", -1,
                None, None, 70 + group)  # fmt: skip
    batch, _, cache = build(case)
    cache = to_device(cache, "cuda")
    rng = np.random.default_rng(case.seed)
    q = cast(rng.standard_normal((batch.batch_size, group * 2, 128), dtype=np.float32), "bfloat16")
    outputs = [
        as_f64(planned(case, batch, "cuda", backend).run(to_device(q, "cuda"), cache))
        for backend in ("auto", kernel)
    ]
    np.testing.assert_array_equal(outputs[0], outputs[1])


STEP_GRAPH_CASES = [
    Case(
        "bfloat16", "bfloat16", 7, group, kv_heads, 64, 16, "NHD", "pool", "NONE", -1, None, None, 3
    )
    for group, kv_heads in ((4, 2), (3, 3))
]
"""The step graphs' decode on a GPU: bfloat16 NHD pools of page 16 and head
dim 64, the demo model's and SmolLM2's groups (the sampled grid has no
bfloat16 case at head dim 64)."""


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["generic", "tma", "auto"])
@pytest.mark.parametrize("case", STEP_GRAPH_CASES, ids=str)
def test_step_graph_decode_on_gpu(case: Case, backend: str):
    check_decode_case(case, device="cuda", backend=backend)
