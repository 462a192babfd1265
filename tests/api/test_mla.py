"""MLA attention over the paged latent cache against float64 NumPy: the absorbed
form directly (reference.mla_attention), and ordinary multi-head attention with
the up-projections applied, which absorbed MLA must equal."""

from __future__ import annotations

import math

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Module, TensorType

import pagedkv
import reference
from conftest import MLA_CONFIGS, as_f64, cast, to_device
from pagedkv import graph_ops
from suite_graphs import ops_graph, suite_graph, suite_model

CKV, KPE = 512, 64
SM_SCALE = 1 / math.sqrt(128 + 64)  # the head dim before absorption, as DeepSeek's


class MLABatch:
    """A ragged batch over shuffled pages (and spare ones) of MLA caches,
    values rounded to the cache and q dtypes; float32 copies for the
    reference."""

    def __init__(
        self, rng, qo_lens, kv_lens, heads, page_size, q_dtype, kv_dtype, spare=3, dims=(CKV, KPE)
    ):
        self.kv_lens = np.array(kv_lens, np.int32)
        pages = -(-self.kv_lens // page_size)
        total = int(pages.sum()) + spare
        self.kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        self.kv_indices = rng.permutation(total)[: int(pages.sum())].astype(np.int32)
        self.qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        rows = int(self.qo_indptr[-1])
        self.heads, self.page_size = heads, page_size
        self.dims = ckv, kpe = dims
        self.ckv = rounded(rng.standard_normal((total, page_size, ckv), np.float32), kv_dtype)
        self.kpe = rounded(rng.standard_normal((total, page_size, kpe), np.float32), kv_dtype)
        self.q_nope = rounded(rng.standard_normal((rows, heads, ckv), np.float32), q_dtype)
        self.q_pe = rounded(rng.standard_normal((rows, heads, kpe), np.float32), q_dtype)

    def table(self):
        return self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_lens

    def reference(self, causal, ckv_scale=1.0, kpe_scale=1.0):
        o, lse = reference.mla_attention(
            as_f64(self.q_nope),
            as_f64(self.q_pe) * (kpe_scale / ckv_scale),
            as_f64(self.ckv),
            as_f64(self.kpe),
            *self.table(),
            causal=causal,
            sm_scale=SM_SCALE * ckv_scale,
        )
        return o * ckv_scale, lse


def rounded(values: np.ndarray, dtype: str):
    """values rounded to dtype: NumPy for float32, torch otherwise."""
    return cast(values, dtype) if dtype != "float32" else values


def tolerance(q_dtype: str) -> float:
    return 2e-5 if q_dtype == "float32" else 1e-2


def plan_and_run(batch: MLABatch, q_dtype, kv_dtype, causal, workspace=None, **run_kwargs):
    """Plans batch on the workspace's device (a NumPy one: the CPU) and runs it."""
    if workspace is None:
        workspace = np.empty(1 << 22, np.uint8)
    wrapper = pagedkv.BatchMLAPagedAttentionWrapper(workspace)
    wrapper.plan(
        *batch.table(),
        batch.heads,
        *batch.dims,
        batch.page_size,
        causal,
        SM_SCALE,
        q_dtype,
        kv_dtype,
    )
    return wrapper.run(
        batch.q_nope, batch.q_pe, batch.ckv, batch.kpe, return_lse=True, **run_kwargs
    )


def check(batch, q_dtype, kv_dtype, causal, lse_tol=1e-3, **scales):
    o, lse = plan_and_run(batch, q_dtype, kv_dtype, causal, **scales)
    want_o, want_lse = batch.reference(causal, **scales)
    tol = tolerance(q_dtype)
    np.testing.assert_allclose(as_f64(o), want_o, rtol=tol, atol=tol)
    finite = np.isfinite(want_lse)
    assert (np.isfinite(as_f64(lse)) == finite).all()
    np.testing.assert_allclose(as_f64(lse)[finite], want_lse[finite], rtol=lse_tol, atol=lse_tol)
    assert (as_f64(o)[~finite] == 0).all()


@pytest.mark.parametrize("q_dtype,kv_dtype", MLA_CONFIGS)
def test_decode_matches_reference(rng, q_dtype, kv_dtype):
    """One query per request: empty, one-token and multi-page requests, and
    one long enough that its keys split across items (merged by LSE)."""
    batch = MLABatch(rng, [1] * 5, [0, 1, 37, 300, 2500], 16, 16, q_dtype, kv_dtype)
    check(batch, q_dtype, kv_dtype, causal=False)


@pytest.mark.parametrize("q_dtype,kv_dtype", MLA_CONFIGS)
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_prefill_matches_reference(rng, q_dtype, kv_dtype, causal):
    """Ragged queries, each request's last tokens; a request with no
    queries, one with as many queries as keys, and a causal request with
    more queries than keys (its first queries see none)."""
    batch = MLABatch(rng, [5, 0, 1, 9, 6], [40, 3, 17, 9, 4], 16, 16, q_dtype, kv_dtype)
    check(batch, q_dtype, kv_dtype, causal)


@pytest.mark.parametrize("q_dtype,kv_dtype", MLA_CONFIGS)
@pytest.mark.parametrize(
    ("dims", "heads"), [((256, 32), 40), ((128, 32), 3), ((48, 16), 5), ((80, 0), 7)]
)
def test_any_latent_and_rope_dims_of_16(rng, q_dtype, kv_dtype, dims, heads):
    """Latent and rope dims that are multiples of 16 but not of the widening
    block (MiniCPM3's 256 and 32, small test models' 128 and 32, 48 and 16,
    a rope part of 0) and head counts that are not powers of two, decode and
    prefill, keys split in the long request."""
    batch = MLABatch(rng, [1, 4, 1], [33, 20, 2500], heads, 16, q_dtype, kv_dtype, dims=dims)
    check(batch, q_dtype, kv_dtype, causal=True)


def test_absorbed_mla_equals_attention_with_up_projections(rng):
    """MLA's reason to be: with W_UK [H, 128, 512] folded into q and W_UV
    [H, 512, 128] applied to the output, the latent attention is ordinary
    attention with per-head keys k = [W_UK ckv, kpe] and values v = ckv
    W_UV, computed here in float64 without any absorption."""
    heads, nope = 4, 128
    batch = MLABatch(rng, [3, 1, 4], [50, 20, 33], heads, 16, "float32", "float32")
    scale = 1 / math.sqrt(CKV)
    w_uk = rng.standard_normal((heads, nope, CKV)) * scale
    w_uv = rng.standard_normal((heads, CKV, nope)) * scale
    q_n = rng.standard_normal((int(batch.qo_indptr[-1]), heads, nope))
    # Absorbed: q_nope [t, h] = q_n [t, h] @ W_UK[h], in the latent space.
    batch.q_nope = np.einsum("thn,hnc->thc", q_n, w_uk).astype(np.float32)
    o_latent, lse = plan_and_run(batch, "float32", "float32", causal=True)
    o_mla = np.einsum("thc,hcn->thn", o_latent.astype(np.float64), w_uv)
    for b in range(len(batch.kv_lens)):
        first, end = batch.qo_indptr[b], batch.qo_indptr[b + 1]
        length = int(batch.kv_lens[b])
        ckv = reference.mla_gather(batch.ckv, batch.kv_indptr, batch.kv_indices, b, length)
        kpe = reference.mla_gather(batch.kpe, batch.kv_indptr, batch.kv_indices, b, length)
        k_nope = np.einsum("hnc,jc->jhn", w_uk, ckv)
        k = np.concatenate([k_nope, np.repeat(kpe[:, None], heads, axis=1)], axis=-1)
        v = np.einsum("jc,hcn->jhn", ckv, w_uv)
        q = np.concatenate([q_n[first:end], batch.q_pe[first:end].astype(np.float64)], axis=-1)
        want_o, want_lse = reference.attention(
            q, k, v, length - (end - first) + np.arange(end - first), sm_scale=SM_SCALE
        )
        np.testing.assert_allclose(o_mla[first:end], want_o, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse[first:end], want_lse, rtol=1e-5, atol=1e-5)


def test_decode_after_mla_append_with_out_and_natural_lse(rng):
    """The caches append_paged_mla_kv_cache fills are the ones decode reads;
    out= and lse= are written in place, and return_lse_base_on_e gives
    FlashInfer's natural-log lse."""
    page, heads, lens = 16, 16, np.array([20, 33], np.int32)
    pages = -(-lens // page)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    kv_indices = np.array([4, 0, 2, 1, 3][: pages.sum()], np.int32)
    last = (lens - (pages - 1) * page).astype(np.int32)
    ckv = np.zeros((5, page, CKV), np.float32)
    kpe = np.zeros((5, page, KPE), np.float32)
    new_ckv = rng.standard_normal((int(lens.sum()), CKV), np.float32)
    new_kpe = rng.standard_normal((int(lens.sum()), KPE), np.float32)
    append_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    bi, pos = reference.batch_indices_positions(append_indptr, lens, int(lens.sum()))
    pagedkv.append_paged_mla_kv_cache(
        new_ckv, new_kpe, bi, pos, ckv, kpe, kv_indices, kv_indptr, last
    )
    qo_indptr = np.arange(3, dtype=np.int32)
    q_nope = rng.standard_normal((2, heads, CKV), np.float32)
    q_pe = rng.standard_normal((2, heads, KPE), np.float32)
    wrapper = pagedkv.BatchMLAPagedAttentionWrapper(np.empty(0, np.float32))
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, lens, heads, CKV, KPE, page, True, SM_SCALE,
                 "float32", "float32")  # fmt: skip
    out = np.empty((2, heads, CKV), np.float32)
    lse = np.empty((2, heads), np.float32)
    got = wrapper.run(q_nope, q_pe, ckv, kpe, out, lse, True, return_lse_base_on_e=True)
    assert got[0] is out and got[1] is lse
    for b in range(2):
        rows = slice(append_indptr[b], append_indptr[b + 1])
        s = (new_ckv[rows] @ q_nope[b].T + new_kpe[rows] @ q_pe[b].T).T * SM_SCALE
        p = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(out[b], p @ new_ckv[rows] / p.sum(-1)[:, None], atol=2e-5)
        want_lse = np.log(p.sum(-1)) + s.max(-1)
        np.testing.assert_allclose(lse[b], want_lse, rtol=2e-5, atol=2e-5)


def test_fixed_buffers_hold_the_table_run_reads(rng):
    """use_cuda_graph=True: plan() writes the table into the caller's
    buffers and run() reads the pages from them alone; a kv_indptr longer
    than B + 1 (FlashInfer reads its front) plans as its front."""
    batch = MLABatch(rng, [1] * 3, [20, 33, 5], 8, 16, "float32", "float32")
    qo, kv_indptr, kv_indices, kv_lens = batch.table()
    buffers = {
        "qo_indptr": np.zeros(4, np.int32),
        "kv_indptr": np.zeros(4, np.int32),
        "kv_indices": np.full(64, -1, np.int32),
        "kv_len_arr": np.zeros(3, np.int32),
    }
    w = pagedkv.BatchMLAPagedAttentionWrapper(
        np.empty(1 << 22, np.uint8), use_cuda_graph=True, **buffers
    )
    longer = np.concatenate([kv_indptr, [kv_indptr[-1]] * 2]).astype(np.int32)
    w.plan(qo, longer, kv_indices, kv_lens, 8, CKV, KPE, 16, False, SM_SCALE, "float32", "float32")
    np.testing.assert_array_equal(buffers["kv_indptr"], kv_indptr)
    np.testing.assert_array_equal(buffers["kv_indices"][: len(kv_indices)], kv_indices)
    np.testing.assert_array_equal(buffers["kv_len_arr"], kv_lens)
    o = w.run(batch.q_nope, batch.q_pe, batch.ckv, batch.kpe)
    np.testing.assert_allclose(o, batch.reference(causal=False)[0], rtol=2e-5, atol=2e-5)
    # Request 0's pages, swapped in the buffer alone, move its output.
    first, second = buffers["kv_indices"][0], buffers["kv_indices"][1]
    buffers["kv_indices"][0], buffers["kv_indices"][1] = second, first
    batch.kv_indices[0], batch.kv_indices[1] = second, first
    o = w.run(batch.q_nope, batch.q_pe, batch.ckv, batch.kpe)
    np.testing.assert_allclose(o, batch.reference(causal=False)[0], rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="fixed by the buffers"):
        w.plan(qo[:3], kv_indptr[:3], kv_indices, kv_lens[:2], 8, CKV, KPE, 16, False,
               SM_SCALE, "float32", "float32")  # fmt: skip


PAGE, GRAPH_HEADS = 16, 16


@suite_graph("mla_decode")
def mla_decode_graph(module: Module) -> None:
    cpu, f32, i32 = DeviceRef.CPU(), DType.float32, DType.int32
    types = [
        TensorType(f32, ["batch", GRAPH_HEADS, CKV], device=cpu),
        TensorType(f32, ["batch", GRAPH_HEADS, KPE], device=cpu),
        BufferType(f32, ["pages", PAGE, CKV], device=cpu),
        BufferType(f32, ["pages", PAGE, KPE], device=cpu),
        TensorType(i32, ["used_pages"], device=cpu),
        TensorType(i32, ["batch_plus_1"], device=cpu),
        TensorType(i32, ["items", 6], device=cpu),
        TensorType(i32, ["batch_plus_1"], device=cpu),
    ]
    with ops_graph(module, "mla_decode", types) as g:
        q_nope, q_pe, ckv, kpe, indices, indptr, items, request_items = g.inputs
        o, lse = graph_ops.mla_attention(
            q_nope.tensor,
            q_pe.tensor,
            ckv,
            kpe,
            indices.tensor,
            indptr.tensor,
            items.tensor,
            request_items.tensor,
            sm_scale=SM_SCALE,
        )
        g.output(o, lse)


def test_mla_graph_op_matches_reference(rng):
    """mla_attention inside a max.graph graph (in the suite's module), work
    from mla_work: two decode steps through one compiled graph (symbolic
    batch, pages and items)."""
    model = suite_model("mla_decode")
    for lens in ([30, 1, 700], [2000]):
        batch = MLABatch(rng, [1] * len(lens), lens, GRAPH_HEADS, PAGE, "float32", "float32")
        work = graph_ops.mla_work(batch.qo_indptr, batch.kv_lens, PAGE, GRAPH_HEADS)
        inputs = (batch.q_nope, batch.q_pe, batch.ckv, batch.kpe, batch.kv_indices,
                  batch.kv_indptr, *work)  # fmt: skip
        o, lse = model.execute(*[Buffer.from_numpy(np.ascontiguousarray(x)) for x in inputs])
        want_o, want_lse = batch.reference(causal=True)
        np.testing.assert_allclose(o.to_numpy(), want_o, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(lse.to_numpy(), want_lse, rtol=2e-5, atol=2e-5)


# The slow set: other dtypes (a compile each), DeepSeek-V3's 128 heads over
# long contexts, one request of 64k tokens split across items.


@pytest.mark.slow
@pytest.mark.parametrize(
    "q_dtype,kv_dtype",
    [("float16", "float16"), ("bfloat16", "float8_e4m3fn"), ("float16", "float8_e5m2")],
)
def test_other_dtypes_match_reference(rng, q_dtype, kv_dtype):
    batch = MLABatch(rng, [1, 3, 1], [70, 40, 1000], 16, 16, q_dtype, kv_dtype)
    if kv_dtype.startswith("float8"):
        # Scales reach the reference through the caches' stored values.
        check(batch, q_dtype, kv_dtype, True, lse_tol=1e-2, ckv_scale=0.5, kpe_scale=2.0)
    else:
        check(batch, q_dtype, kv_dtype, causal=True)


@pytest.mark.slow
def test_128_heads_long_contexts(rng):
    """DeepSeek-V3's 128 heads: two CPU tasks a query, decode and prefill."""
    decode = MLABatch(rng, [1, 1, 1], [4096, 3000, 17], 128, 64, "bfloat16", "bfloat16")
    check(decode, "bfloat16", "bfloat16", causal=False)
    prefill = MLABatch(rng, [7, 2], [4096, 300], 128, 64, "bfloat16", "bfloat16")
    check(prefill, "bfloat16", "bfloat16", causal=True)


@pytest.mark.slow
def test_one_request_of_64k_tokens_splits_and_merges(rng):
    batch = MLABatch(rng, [1], [65536], 128, 64, "bfloat16", "bfloat16")
    items, _, kv_split, _ = pagedkv.mla.mla_work(
        batch.qo_indptr, batch.kv_lens, 64, 128, False, False
    )
    assert kv_split and len(items) > 1
    check(batch, "bfloat16", "bfloat16", causal=False)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype,kv_dtype", [("bfloat16", "bfloat16"), ("float32", "float32")])
@pytest.mark.parametrize(
    "qo_lens,kv_lens,causal",
    [([1] * 4, [0, 1, 300, 5000], False), ([5, 0, 9], [40, 3, 9], True)],
    ids=["decode", "prefill"],
)
def test_mla_on_gpu(rng, q_dtype, kv_dtype, qo_lens, kv_lens, causal):
    """The MLA kernel on a GPU, 128 heads, against the CPU suite's reference."""
    import torch

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
