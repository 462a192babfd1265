"""The GPU decode kernels held to each other and to the float64 reference on
long, split, ragged requests: the Hopper TMA kernel and the generic one,
the tensor-core kernel ("mma"), and the ordering of run() against torch's
current stream. Each CPU suite's own cases run on a GPU beside the CPU test
they mirror (marked `gpu`); these have no CPU counterpart.
"""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
import reference
from conftest import as_f64, cast, to_device


def random_decode(rng, kv_heads, head_dim, page_size, lengths, group):
    """A decode batch over shuffled pages: its page table, a float32 NHD pool
    [pages, 2, page_size, kv_heads, head_dim] and float32 queries
    [len(lengths), group * kv_heads, head_dim]."""
    batch = reference.paged_batch(rng, page_size, lengths, [0] * len(lengths))
    pool = rng.standard_normal((batch.num_pages, 2, page_size, kv_heads, head_dim), np.float32)
    q = rng.standard_normal((len(lengths), group * kv_heads, head_dim), np.float32)
    return batch, pool, q


def decode_outputs(backends, batch, q, pool, page_size, options) -> dict:
    """Each backend's (o, lse), float64 NumPy, of one GPU decode of q
    [B, Hq, D] over the NHD pool [pages, 2, page_size, Hkv, D], planned for
    batch's page table with options."""
    table = to_device((batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len), "cuda")
    num_qo_heads, (kv_heads, head_dim) = q.shape[1], pool.shape[-2:]
    outputs = {}
    for backend in backends:
        w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(backend=backend)
        w.plan(*table, num_qo_heads, kv_heads, head_dim, page_size, **options)
        o, lse = w.run(to_device(q, "cuda"), to_device(pool, "cuda"), return_lse=True)
        outputs[backend] = as_f64(o), as_f64(lse)
    return outputs


def assert_rows_match_reference(o, q, pool, batch, options, tol) -> None:
    """o [B, Hq, D]: each request's row equals the float64 reference's over
    its keys, or 0 for a request without any."""
    refs = reference.gather(
        as_f64(pool), batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD"
    )
    for b, (k, v) in enumerate(refs):
        if len(k) == 0:
            assert (o[b] == 0).all()
            continue
        last = np.array([len(k) - 1])
        want_o, _ = reference.attention(as_f64(q)[b : b + 1], k, v, last, **options)
        np.testing.assert_allclose(o[b], want_o[0], rtol=tol, atol=tol)


TMA_SHAPES = [
    # (kv dtype, group, KV heads, head dim, page size, lengths, options)
    ("bfloat16", 4, 2, 128, 16, [4100, 1, 17, 900], {}),
    ("bfloat16", 1, 4, 128, 64, [3000, 64, 65], {"window_left": 700}),
    ("bfloat16", 2, 2, 64, 256, [2049, 256, 0], {"logits_soft_cap": 30.0}),
    ("bfloat16", 8, 1, 256, 32, [1500, 33], {"pos_encoding_mode": "ALIBI"}),
    ("bfloat16", 5, 2, 128, 16, [2500, 31, 48], {}),
    ("float32", 4, 2, 128, 16, [2000, 5], {}),
    ("float8_e4m3fn", 4, 2, 128, 16, [2000, 77], {}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", TMA_SHAPES, ids=lambda s: f"{s[0]}-G{s[1]}-D{s[3]}-P{s[4]}")
def test_tma_and_generic_kernels_agree(shape):
    """Long, split, ragged requests over shuffled pages: the two GPU kernels
    agree with each other and with the reference."""
    kv_dtype, group, kv_heads, head_dim, page_size, lengths, options = shape
    q_dtype = "float32" if kv_dtype == "float32" else "bfloat16"
    rng = np.random.default_rng(group * 1000 + head_dim + page_size)
    batch, pool, q = random_decode(rng, kv_heads, head_dim, page_size, lengths, group)
    pool, q = cast(pool, kv_dtype), cast(q, q_dtype)
    outputs = decode_outputs(("generic", "tma"), batch, q, pool, page_size, options)
    tol = 1e-5 if q_dtype == "float32" else 1e-2
    np.testing.assert_allclose(*(outputs[b][0] for b in outputs), rtol=tol, atol=tol)
    np.testing.assert_allclose(*(outputs[b][1] for b in outputs), rtol=tol, atol=tol)
    assert_rows_match_reference(outputs["tma"][0], q, pool, batch, options, tol)


TENSOR_CORE_SHAPES = [
    # (dtype, group, KV heads, head dim, page size, lengths, options)
    ("bfloat16", 8, 2, 128, 16, [4100, 1, 17, 0, 63, 65], {}),
    ("bfloat16", 4, 2, 128, 64, [3000, 64, 65, 1], {"window_left": 700}),
    ("float16", 16, 1, 64, 16, [2049, 16, 33], {"logits_soft_cap": 30.0}),
    ("bfloat16", 5, 2, 64, 32, [1500, 33, 2], {"pos_encoding_mode": "ALIBI"}),
    ("bfloat16", 12, 2, 128, 16, [777, 5, 129], {}),
    ("float16", 1, 4, 128, 16, [900, 31], {}),
    ("bfloat16", 3, 3, 64, 16, [5000, 9], {"sm_scale": 0.05}),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", TENSOR_CORE_SHAPES, ids=lambda s: f"{s[0]}-G{s[1]}-D{s[3]}-P{s[4]}"
)
def test_tensor_core_decode_matches_reference(shape):
    """The tensor-core kernel ("mma") on long, split, ragged requests (an
    empty one, partial first and last stages) over shuffled pages whose
    unwritten slots and unused pages hold NaN: o and lse against the float64
    reference and the generic kernel. A NaN that leaked through a masked
    key's zero probability would poison the row."""
    dtype, group, kv_heads, head_dim, page_size, lengths, options = shape
    rng = np.random.default_rng(group * 100 + head_dim + page_size)
    batch, pool, q = random_decode(rng, kv_heads, head_dim, page_size, lengths, group)
    used = np.zeros((batch.num_pages, page_size), bool)
    for b in range(len(lengths)):
        pages = batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]]
        for i, page in enumerate(pages):
            used[page, : batch.kv_last_page_len[b] if i == len(pages) - 1 else page_size] = True
    pages, slots = np.nonzero(~used)
    pool[pages, :, slots] = np.nan  # K and V of every slot no request holds
    pool, q = cast(pool, dtype), cast(q, dtype)
    outputs = decode_outputs(("generic", "mma"), batch, q, pool, page_size, options)
    tol = 1e-2
    assert np.isfinite(outputs["mma"][0]).all()
    np.testing.assert_allclose(outputs["mma"][0], outputs["generic"][0], rtol=tol, atol=tol)
    np.testing.assert_allclose(outputs["mma"][1], outputs["generic"][1], rtol=tol, atol=tol)
    assert (outputs["mma"][1][np.array(lengths) == 0] == -np.inf).all()
    assert_rows_match_reference(outputs["mma"][0], q, pool, batch, options, tol)


@pytest.mark.gpu
def test_tensor_core_decode_refuses_what_it_cannot_run():
    """backend="mma" on a batch outside the kernel (a float32 q, HND) raises
    a clear error instead of running another kernel."""
    batch = reference.paged_batch(np.random.default_rng(0), 16, [40], [0])
    table = to_device((batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len), "cuda")
    pool = to_device(np.zeros((batch.num_pages, 2, 16, 2, 128), np.float32), "cuda")
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(backend="mma")
    w.plan(*table, 8, 2, 128, 16)
    with pytest.raises(ValueError, match="tensor-core decode kernel needs"):
        w.run(to_device(np.zeros((1, 8, 128), np.float32), "cuda"), pool)
    with pytest.raises(ValueError, match="needs NHD"):
        pagedkv.BatchDecodeWithPagedKVCacheWrapper(kv_layout="HND", backend="mma").plan(
            *table, 8, 2, 128, 16
        )


@pytest.mark.gpu
def test_decode_orders_against_torchs_current_stream():
    """run() on a side stream, its q written there behind a long matmul and
    its o read there right after: MAX's stream waits for torch's current
    stream and torch's for MAX's (run_model exports CUDA tensors as bare
    DLPack capsules, which do no stream handshake of their own)."""
    import torch

    rng = np.random.default_rng(11)
    batch = reference.paged_batch(rng, 16, [700, 33], [0, 0])
    pool = torch.from_numpy(
        rng.standard_normal((batch.num_pages, 2, 16, 2, 128), np.float32)
    ).cuda()
    q_src = torch.from_numpy(rng.standard_normal((2, 8, 128), np.float32)).cuda()
    table = to_device((batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len), "cuda")
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
    w.plan(*table, 8, 2, 128, 16)
    want = w.run(q_src, pool).clone()
    side = torch.cuda.Stream()
    square = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        q = torch.zeros_like(q_src)
        torch.mm(square, square)  # tens of ms of work ahead of q's values
        q.copy_(q_src)
        got = w.run(q, pool).clone()
    torch.cuda.synchronize()
    np.testing.assert_allclose(got.cpu().numpy(), want.cpu().numpy(), rtol=1e-6, atol=1e-6)
