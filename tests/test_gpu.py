"""The GPU paths against the same float64 references as the CPU suites.

Runs only where torch sees a CUDA GPU and MAX an accelerator (skipped in CI,
which has none; test_gpu_compile.py compiles these paths there). The append,
decode and prefill cases are the CPU suites' own, moved to the GPU; decode
runs each case with the generic kernel, the Hopper TMA kernel where it
applies, and "auto" (the TMA kernel where it applies, else the generic one),
and a second test holds the two kernels to each other on longer,
paged sequences.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cascade_attention import check_levels, check_masked_merge, check_shared_prefix
from test_custom_mask import check_custom_mask
from test_fixed_buffers import check_decode_replans_in_place
from test_manager import check_copy_on_write_of_torch_pools, check_host_tier

import pagedkv
import reference
from conftest import DECODE_CONFIGS, PREFILL_CONFIGS, as_f64, cast, to_device
from test_append import CASES as APPEND_CASES
from test_append import check_append_case, check_gather, check_mla_append
from test_decode import Case, check_decode_case, check_merges, sampled_grid
from test_prefill import CASES as PREFILL_CASES
from test_prefill import check_prefill_case


def cuda_available() -> bool:
    try:
        import torch
        from max.driver import accelerator_count
    except ImportError:
        return False
    return torch.cuda.is_available() and accelerator_count() > 0


pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def experimental_kernels(monkeypatch):
    """The GPU tests hold the experimental kernels to the same references."""
    monkeypatch.setenv("PAGEDKV_EXPERIMENTAL_KERNELS", "1")


@pytest.fixture(scope="module", autouse=True)
def compiled_gpu_ops():
    """Compiles the GPU ops of this module in one MAX module."""
    from max.dtype import DType

    from pagedkv._ops.kernels import prepare
    from pagedkv._ops.tensors import Device
    from pagedkv.decode import decode_spec
    from pagedkv.precompile import op_specs
    from pagedkv.prefill import prefill_spec

    layouts = {"NHD": 0, "HND": 1}
    pairs = sorted({(q, kv) for q, kv, _, _ in DECODE_CONFIGS} | {("bfloat16", "bfloat16")})
    specs = op_specs(("float32", "float16", "bfloat16"), pairs) + [
        prefill_spec(DType[q], DType[kv], layouts[layout]) for q, kv, layout in PREFILL_CONFIGS
    ]
    specs += [decode_spec(DType.bfloat16, DType.bfloat16, 0)]
    prepare(list(dict.fromkeys(specs)), Device("gpu"))


@pytest.mark.parametrize("dtype,kind,layout,form,page_size,call", APPEND_CASES)
def test_append_on_gpu(rng, dtype, kind, layout, form, page_size, call):
    check_append_case(rng, dtype, "torch", layout, form, page_size, call, device="cuda")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mla_append_on_gpu(rng, dtype):
    check_mla_append(rng, dtype, "torch", device="cuda")


def tma_applies(case: Case) -> bool:
    return (
        case.layout == "NHD"
        and case.page_size % 16 == 0
        and case.group <= 8
        and case.pos_mode != "ROPE_LLAMA"
        and not (case.kv_dtype.startswith("float8") and case.head_dim == 64)
    )


def mma_applies(case: Case) -> bool:
    return (
        case.layout == "NHD"
        and case.page_size % 16 == 0
        and case.group <= 16
        and case.pos_mode != "ROPE_LLAMA"
        and case.q_dtype == case.kv_dtype
        and case.q_dtype in ("float16", "bfloat16")
        and case.head_dim in (64, 128)
    )


@pytest.mark.parametrize("backend", ["generic", "tma", "mma", "auto"])
@pytest.mark.parametrize("case", sampled_grid(), ids=str)
def test_decode_on_gpu(case: Case, backend: str):
    """Each case with each kernel; "auto" picks the TMA one where it applies.
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


@pytest.mark.parametrize("config,shape,options,causal,page_size", PREFILL_CASES)
def test_prefill_on_gpu(config, shape, options, causal, page_size):
    check_prefill_case(config, shape, options, causal, page_size, device="cuda")


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


@pytest.mark.parametrize("shape", TMA_SHAPES, ids=lambda s: f"{s[0]}-G{s[1]}-D{s[3]}-P{s[4]}")
def test_tma_and_generic_kernels_agree(shape):
    """Long, split, ragged requests over shuffled pages: the two GPU kernels
    agree with each other and with the reference."""
    kv_dtype, group, kv_heads, head_dim, page_size, lengths, options = shape
    q_dtype = "float32" if kv_dtype == "float32" else "bfloat16"
    rng = np.random.default_rng(group * 1000 + head_dim + page_size)
    batch = reference.paged_batch(rng, page_size, lengths, [0] * len(lengths))
    pool = cast(
        rng.standard_normal((batch.num_pages, 2, page_size, kv_heads, head_dim), np.float32),
        kv_dtype,
    )
    q = cast(rng.standard_normal((len(lengths), group * kv_heads, head_dim), np.float32), q_dtype)
    table = to_device((batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len), "cuda")
    outputs = {}
    for backend in ("generic", "tma"):
        w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(backend=backend)
        w.plan(*table, group * kv_heads, kv_heads, head_dim, page_size, **options)
        o, lse = w.run(to_device(q, "cuda"), to_device(pool, "cuda"), return_lse=True)
        outputs[backend] = as_f64(o), as_f64(lse)
    tol = 1e-5 if q_dtype == "float32" else 1e-2
    np.testing.assert_allclose(*(outputs[b][0] for b in outputs), rtol=tol, atol=tol)
    np.testing.assert_allclose(*(outputs[b][1] for b in outputs), rtol=tol, atol=tol)
    refs = reference.gather(
        as_f64(pool), batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD"
    )
    for b, (k, v) in enumerate(refs):
        if len(k) == 0:
            assert (outputs["tma"][0][b] == 0).all()
            continue
        last = np.array([len(k) - 1])
        want_o, _ = reference.attention(as_f64(q)[b : b + 1], k, v, last, **options)
        np.testing.assert_allclose(outputs["tma"][0][b], want_o[0], rtol=tol, atol=tol)


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
    batch = reference.paged_batch(rng, page_size, lengths, [0] * len(lengths))
    pool = rng.standard_normal((batch.num_pages, 2, page_size, kv_heads, head_dim), np.float32)
    used = np.zeros((batch.num_pages, page_size), bool)
    for b in range(len(lengths)):
        pages = batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]]
        for i, page in enumerate(pages):
            used[page, : batch.kv_last_page_len[b] if i == len(pages) - 1 else page_size] = True
    pages, slots = np.nonzero(~used)
    pool[pages, :, slots] = np.nan  # K and V of every slot no request holds
    pool = cast(pool, dtype)
    q = cast(rng.standard_normal((len(lengths), group * kv_heads, head_dim), np.float32), dtype)
    table = to_device((batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len), "cuda")
    outputs = {}
    for backend in ("generic", "mma"):
        w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(backend=backend)
        w.plan(*table, group * kv_heads, kv_heads, head_dim, page_size, **options)
        o, lse = w.run(to_device(q, "cuda"), to_device(pool, "cuda"), return_lse=True)
        outputs[backend] = as_f64(o), as_f64(lse)
    tol = 1e-2
    assert np.isfinite(outputs["mma"][0]).all()
    np.testing.assert_allclose(outputs["mma"][0], outputs["generic"][0], rtol=tol, atol=tol)
    np.testing.assert_allclose(outputs["mma"][1], outputs["generic"][1], rtol=tol, atol=tol)
    refs = reference.gather(
        as_f64(pool), batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD"
    )
    for b, (k, v) in enumerate(refs):
        if len(k) == 0:
            assert (outputs["mma"][0][b] == 0).all() and (outputs["mma"][1][b] == -np.inf).all()
            continue
        last = np.array([len(k) - 1])
        want_o, _ = reference.attention(as_f64(q)[b : b + 1], k, v, last, **options)
        np.testing.assert_allclose(outputs["mma"][0][b], want_o[0], rtol=tol, atol=tol)


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


def test_captured_decode_replays_each_plan():
    """use_cuda_graph: a decode step captured in a torch CUDA graph after one
    plan() replays the next plans' batches (longer, split, an empty request)
    right: every array the kernels read stays where the capture saw it."""
    check_decode_replans_in_place("cuda", capture=True)


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


@pytest.mark.parametrize("head_dim", [64, 300])
def test_merges_on_gpu(head_dim):
    check_merges(head_dim, device="cuda")


def test_index_helpers_on_gpu():
    """get_seq_lens and get_batch_indices_positions on CUDA tensors, ragged
    with an empty request, against the references."""
    batch = reference.paged_batch(np.random.default_rng(3), 16, [37, 0, 16, 1], [5, 0, 11, 1])
    table = (batch.kv_indptr, batch.kv_last_page_len)
    got = pagedkv.get_seq_lens(*to_device(table, "cuda"), batch.page_size)
    assert got.is_cuda
    np.testing.assert_array_equal(got.cpu().numpy(), batch.seq_lens)
    nnz = int(batch.append_indptr[-1])
    b, positions = pagedkv.get_batch_indices_positions(
        *to_device((batch.append_indptr, batch.seq_lens), "cuda"), nnz
    )
    want_b, want_p = reference.batch_indices_positions(batch.append_indptr, batch.seq_lens, nnz)
    np.testing.assert_array_equal(b.cpu().numpy(), want_b)
    np.testing.assert_array_equal(positions.cpu().numpy(), want_p)


def test_manager_copies_on_write_on_gpu():
    check_copy_on_write_of_torch_pools("cuda")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_tier_on_gpu(dtype):
    """Evicted GPU pages out to the host tier and back, bit for bit."""
    check_host_tier(dtype, "cuda")


@pytest.mark.parametrize(
    "dtype,layout,form", [("bfloat16", "NHD", "pool"), ("float32", "HND", "pair")]
)
def test_gather_on_gpu(rng, dtype, layout, form):
    check_gather(rng, dtype, "torch", layout, form, device="cuda")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True])
def test_cascade_levels_on_gpu(layout, causal):
    check_levels(layout, causal, device="cuda")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_shared_prefix_wrappers_on_gpu(layout):
    check_shared_prefix(layout, device="cuda")


def test_masked_merge_on_gpu():
    check_masked_merge("torch", device="cuda")


@pytest.mark.parametrize("config", PREFILL_CONFIGS[:2], ids=lambda c: f"{c[0]}-{c[2]}")
@pytest.mark.parametrize("form", ["bool", "packed"])
@pytest.mark.parametrize("window_left", [-1, 6])
def test_custom_mask_on_gpu(config, form, window_left):
    check_custom_mask(config, form, (8, 2, 64), window_left, device="cuda")


def test_demo_serves_and_checks_itself_on_gpu(capsys):
    """The main job on the GPU: graphs, pools and copy-on-write there."""
    from pagedkv.graphs.demo import DemoOptions, run_demo

    status = run_demo(
        DemoOptions(device="gpu", model="random", requests=5, layers=2, max_new_tokens=8)
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "PASS" in out and "(none leaked)" in out


@pytest.mark.parametrize("q_dtype,kv_dtype", [("bfloat16", "bfloat16"), ("float32", "float32")])
@pytest.mark.parametrize(
    "qo_lens,kv_lens,causal",
    [([1] * 4, [0, 1, 300, 5000], False), ([5, 0, 9], [40, 3, 9], True)],
    ids=["decode", "prefill"],
)
def test_mla_on_gpu(rng, q_dtype, kv_dtype, qo_lens, kv_lens, causal):
    """The MLA kernel on a GPU, 128 heads, against the CPU suite's reference."""
    import torch
    from test_mla import MLABatch, plan_and_run, tolerance

    batch = MLABatch(rng, qo_lens, kv_lens, 128, 16, q_dtype, kv_dtype)
    want_o, want_lse = batch.reference(causal)
    for name in ("q_nope", "q_pe", "ckv", "kpe"):
        setattr(batch, name, to_device(getattr(batch, name), "cuda"))
    workspace = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
    o, lse = plan_and_run(batch, q_dtype, kv_dtype, causal, workspace=workspace)
    tol = tolerance(q_dtype)
    np.testing.assert_allclose(as_f64(o), want_o, rtol=tol, atol=tol)
    finite = np.isfinite(want_lse)
    assert (np.isfinite(as_f64(lse)) == finite).all()
    np.testing.assert_allclose(as_f64(lse)[finite], want_lse[finite], rtol=1e-3, atol=1e-3)
