"""FlashInfer 0.7.2's MLA wrapper API: plan(metadata=MLAPlanMetadata.csr | .dense
| .dual, ...) and run(query=, kv_cache=) with packed [ckv || kpe] tensors or
split pairs, the run contract a plan declares, sinks; against the float64
absorbed-MLA reference (tests/reference.py) on the packed cache's halves."""

from __future__ import annotations

import math

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Module, TensorType

import pagedkv
import reference
from conftest import as_f64, cast
from pagedkv import graph_ops
from pagedkv.mla_inputs import cache_operands
from suite_graphs import ops_graph, suite_graph, suite_model

CKV, KPE, HEADS, PAGE = 64, 32, 8, 16
SM_SCALE = 0.11


class PackedBatch:
    """A ragged batch over a packed cache [pages, PAGE, CKV + KPE] with its
    page table in both forms: CSR and a block table (unread columns hold a
    page past the pool), and packed queries."""

    def __init__(self, seed, qo_lens, kv_lens, dtype="float32"):
        rng = np.random.default_rng(seed)
        need = [-(-n // PAGE) for n in kv_lens]
        total = sum(need) + 2
        order = rng.permutation(total).astype(np.int32)
        self.kv_lens = np.array(kv_lens, np.int32)
        self.qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        self.kv_indptr = np.concatenate([[0], np.cumsum(need)]).astype(np.int32)
        self.kv_indices = order[: sum(need)]
        self.block_tables = np.full((len(kv_lens), max(need) + 1), total + 5, np.int32)
        for b, n in enumerate(need):
            self.block_tables[b, :n] = self.kv_indices[self.kv_indptr[b] : self.kv_indptr[b + 1]]
        rows = int(self.qo_indptr[-1])
        self.cache = cast(rng.standard_normal((total, PAGE, CKV + KPE), np.float32), dtype)
        self.query = cast(rng.standard_normal((rows, HEADS, CKV + KPE), np.float32), dtype)
        self.dtype = dtype

    def csr(self):
        return pagedkv.MLAPlanMetadata.csr(
            self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_lens
        )

    def dense(self):
        return pagedkv.MLAPlanMetadata.dense(self.qo_indptr, self.block_tables, self.kv_lens)

    def plan(self, metadata, causal=True, **options):
        wrapper = pagedkv.BatchMLAPagedAttentionWrapper(np.empty(1 << 22, np.uint8))
        wrapper.plan(
            metadata=metadata, num_heads=HEADS, head_dim_ckv=CKV, head_dim_kpe=KPE,
            page_size=PAGE, causal=causal, sm_scale=SM_SCALE, q_data_type=self.dtype,
            kv_data_type=self.dtype, **options,
        )  # fmt: skip
        return wrapper

    def expected(self, causal=True):
        q, cache = as_f64(self.query), as_f64(self.cache)
        return reference.mla_attention(
            q[..., :CKV], q[..., CKV:], cache[..., :CKV], cache[..., CKV:], self.qo_indptr,
            self.kv_indptr, self.kv_indices, self.kv_lens, causal=causal, sm_scale=SM_SCALE,
        )  # fmt: skip


def assert_matches(o, lse, want_o, want_lse, dtype):
    tol = 2e-5 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(as_f64(o), want_o, rtol=tol, atol=tol)
    np.testing.assert_allclose(as_f64(lse), want_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_query_and_cache_match_reference(dtype, causal):
    """Dense metadata, packed query and cache: a decode-length request,
    ragged prefills and a long one whose keys span many pages."""
    batch = PackedBatch(1, [1, 5, 3], [700, 37, 16], dtype)
    wrapper = batch.plan(batch.dense(), causal, lse_mode="base2")
    o, lse = wrapper.run(query=batch.query, kv_cache=batch.cache, return_lse=True)
    assert_matches(o, lse, *batch.expected(causal), dtype)


def test_decode_splitting_keys_reads_packed_rows():
    """One query a request, long enough that keys split across work items
    (merged by LSE), the cache packed."""
    batch = PackedBatch(2, [1, 1], [2600, 90])
    wrapper = batch.plan(batch.csr(), lse_mode="base2")
    o, lse = wrapper.run(query=batch.query, kv_cache=batch.cache, return_lse=True)
    assert_matches(o, lse, *batch.expected(), "float32")


def test_every_input_form_gives_the_packed_result():
    """Split query pairs, the adjacent halves of the packed cache, separate
    contiguous pools (a "split" plan), and the older positional run: the
    same numbers as the packed form, bit for bit (the kernel reads the same
    values in the same order)."""
    batch = PackedBatch(3, [2, 1], [40, 75])
    packed = batch.plan(batch.csr(), lse_mode="base2")
    want = packed.run(query=batch.query, kv_cache=batch.cache, return_lse=True)[0]
    q, cache = batch.query, batch.cache
    halves = (cache[..., :CKV], cache[..., CKV:])
    copies = tuple(np.ascontiguousarray(h) for h in halves)
    got = [
        packed.run(query=(q[..., :CKV], q[..., CKV:]), kv_cache=halves, return_lse=True)[0],
        packed.run(query=(q, (q[..., :CKV], q[..., CKV:])), kv_cache=(halves, cache),
                   return_lse=True)[0],
    ]  # fmt: skip
    split = batch.plan(batch.csr(), query_layout="split", kv_cache_layout="split")
    got.append(split.run(query=(q[..., :CKV], q[..., CKV:]), kv_cache=copies))
    legacy = pagedkv.BatchMLAPagedAttentionWrapper(np.empty(1 << 22, np.uint8))
    legacy.plan(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_lens, HEADS, CKV,
                KPE, PAGE, True, SM_SCALE, np.float32, np.float32)  # fmt: skip
    got.append(legacy.run(q[..., :CKV], q[..., CKV:], *halves))
    got.append(legacy.run(q[..., :CKV], q[..., CKV:], *copies))
    for o in got:
        np.testing.assert_array_equal(o, want)


def test_cache_operands_are_views_of_the_callers_memory():
    """A packed cache is one operand for both pools; its halves widen back to
    it; separate contiguous pools are themselves; rows that are not one
    stride holding ckv first and kpe last, in the caller's memory, are
    refused (no copy is made)."""
    torch = pytest.importorskip("torch")
    for packed in (np.zeros((3, PAGE, CKV + KPE), np.float32), torch.zeros(3, PAGE, CKV + KPE)):
        ckv, kpe = cache_operands(packed[..., :CKV], packed[..., CKV:])
        assert ckv is kpe and tuple(ckv.shape) == (3, PAGE, CKV + KPE)
        assert np.shares_memory(np.asarray(ckv), np.asarray(packed))
        separate = (packed[..., :CKV].copy() if isinstance(packed, np.ndarray)
                    else packed[..., :CKV].clone(), packed[:, :, :KPE] * 1)  # fmt: skip
        assert all(a is b for a, b in zip(cache_operands(*separate), separate, strict=True))
    wide = np.zeros((3, PAGE, CKV + KPE + 16), np.float32)
    with pytest.raises(ValueError, match="kpe_cache must be contiguous, or rows"):
        cache_operands(wide[..., :CKV], wide[..., CKV : CKV + KPE])
    with pytest.raises(ValueError, match="ckv_cache must be contiguous, or rows"):
        cache_operands(wide[1:, :, 16 : 16 + CKV], wide[1:, :, 16 + CKV :])


@suite_graph("mla_decode_packed")
def mla_decode_packed_graph(module: Module) -> None:
    cpu, f32, i32 = DeviceRef.CPU(), DType.float32, DType.int32
    types = [
        TensorType(f32, ["batch", HEADS, CKV], device=cpu),
        TensorType(f32, ["batch", HEADS, KPE], device=cpu),
        BufferType(f32, ["pages", PAGE, CKV + KPE], device=cpu),
        TensorType(i32, ["used_pages"], device=cpu),
        TensorType(i32, ["batch_plus_1"], device=cpu),
        TensorType(i32, ["items", 6], device=cpu),
        TensorType(i32, ["batch_plus_1"], device=cpu),
    ]
    with ops_graph(module, "mla_decode_packed", types) as g:
        q_nope, q_pe, cache, indices, indptr, items, request_items = g.inputs
        o, lse = graph_ops.mla_attention(
            q_nope.tensor, q_pe.tensor, cache, cache, indices.tensor, indptr.tensor,
            items.tensor, request_items.tensor, sm_scale=SM_SCALE,
        )  # fmt: skip
        g.output(o, lse)


def test_graph_op_reads_one_packed_cache_as_both_pools():
    """graph_ops.mla_attention given one packed buffer as ckv and kpe cache."""
    batch = PackedBatch(9, [1, 1, 1], [30, 1, 500])
    work = graph_ops.mla_work(batch.qo_indptr, batch.kv_lens, PAGE, HEADS)
    q = batch.query
    inputs = (q[..., :CKV], q[..., CKV:], batch.cache, batch.kv_indices, batch.kv_indptr, *work)
    o, lse = suite_model("mla_decode_packed").execute(
        *[Buffer.from_numpy(np.ascontiguousarray(x)) for x in inputs]
    )
    assert_matches(o.to_numpy(), lse.to_numpy(), *batch.expected(), "float32")


def test_csr_dense_and_dual_metadata_plan_the_same_batch():
    batch = PackedBatch(4, [3, 1, 2], [50, 17, 33])
    runs = []
    for metadata in (batch.csr(), batch.dense(), pagedkv.MLAPlanMetadata.dual(
            batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_lens,
            cum_seq_lens_q=batch.qo_indptr, block_tables=batch.block_tables,
            seq_lens=batch.kv_lens, max_q_len=3)):  # fmt: skip
        runs.append(batch.plan(metadata).run(query=batch.query, kv_cache=batch.cache))
    for o in runs[1:]:
        np.testing.assert_array_equal(o, runs[0])


def test_sinks_join_every_rows_denominator():
    """use_sinks: o and the lse are the keys' state merged with a state of
    value 0 and lse the sink (reference values merged by hand)."""
    batch = PackedBatch(5, [2, 1], [40, 9])
    sinks = np.array([0.5, 1.0, -2.0, 3.0, 0.0, 1.5, 2.5, -1.0], np.float32)
    wrapper = batch.plan(batch.dense(), use_sinks=True, lse_mode="basee")
    o, lse = wrapper.run(query=batch.query, kv_cache=batch.cache, sinks=sinks, return_lse=True,
                         return_lse_base_on_e=True)  # fmt: skip
    want_o, want_lse2 = batch.expected()
    keys = np.exp2(want_lse2)
    total = keys + np.exp(sinks.astype(np.float64))[None, :]
    np.testing.assert_allclose(o, want_o * (keys / total)[..., None], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, np.log(total), rtol=1e-4, atol=1e-4)


def test_flat_csr_plan_lets_run_choose_its_lse():
    """FlashInfer's older flat CSR plan: run() may still ask for an lse (base
    2, or base e); a plan with metadata holds run to its lse_mode."""
    batch = PackedBatch(6, [1, 1], [20, 30])
    legacy = pagedkv.BatchMLAPagedAttentionWrapper(np.empty(1 << 20, np.uint8))
    legacy.plan(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_lens, HEADS,
                CKV, KPE, PAGE, True, SM_SCALE, np.float32, np.float32)  # fmt: skip
    halves = (batch.cache[..., :CKV], batch.cache[..., CKV:])
    q = (batch.query[..., :CKV], batch.query[..., CKV:])
    _, lse2 = legacy.run(*q, *halves, return_lse=True)
    _, lse_e = legacy.run(*q, *halves, return_lse=True, return_lse_base_on_e=True)
    np.testing.assert_allclose(lse_e, lse2 * math.log(2), rtol=1e-6)
    planned = batch.plan(batch.csr())
    with pytest.raises(ValueError, match="lse_mode='none'"):
        planned.run(query=batch.query, kv_cache=batch.cache, return_lse=True)


PLAN_ERRORS = [
    (dict(output_scale="per-tensor"), ValueError, "output_scale"),
    (dict(scale_mode="bmm-scalar"), ValueError, "scale_mode"),
    (dict(scale_mode="kv-per-tensor"), ValueError, "fp8"),
    (dict(skip_softmax=True), ValueError, "skip_softmax"),
    (dict(enable_pdl=True), ValueError, "enable_pdl"),
    (dict(output_dtype=np.float16), ValueError, "output_dtype"),
    (dict(lse_mode="base10"), ValueError, "lse_mode"),
    (dict(kv_cache_layout="interleaved"), ValueError, "kv_cache_layout"),
    (dict(qo_indptr=np.array([0, 1, 2], np.int32)), ValueError, "not both"),
    (dict(metadata=None), TypeError, "needs metadata"),
    (dict(metadata={"qo_indptr": 1}), TypeError, "MLAPlanMetadata"),
    (dict(num_heads=None), TypeError, "missing num_heads"),
    (dict(metadata="dual that disagrees"), ValueError, "other pages"),
    (dict(metadata="dense over max_q_len"), ValueError, "max_q_len"),
]


@pytest.mark.parametrize("change,error,message", PLAN_ERRORS, ids=[m for _, _, m in PLAN_ERRORS])
def test_bad_plans_raise(change, error, message):
    batch = PackedBatch(7, [2, 1], [20, 30])
    args = dict(metadata=batch.csr(), num_heads=HEADS, head_dim_ckv=CKV, head_dim_kpe=KPE,
                page_size=PAGE, causal=True, sm_scale=SM_SCALE, q_data_type=np.float32,
                kv_data_type=np.float32)  # fmt: skip
    if change.get("metadata") == "dual that disagrees":
        other = batch.block_tables[::-1].copy()
        change = dict(metadata=pagedkv.MLAPlanMetadata.dual(
            *batch.csr().csr_table(PAGE), cum_seq_lens_q=batch.qo_indptr, block_tables=other,
            seq_lens=batch.kv_lens))  # fmt: skip
    elif change.get("metadata") == "dense over max_q_len":
        change = dict(metadata=pagedkv.MLAPlanMetadata.dense(
            batch.qo_indptr, batch.block_tables, batch.kv_lens, max_q_len=1))  # fmt: skip
    args.update(change)
    wrapper = pagedkv.BatchMLAPagedAttentionWrapper(np.empty(1 << 20, np.uint8))
    with pytest.raises(error, match=message):
        wrapper.plan(**args)


RUN_ERRORS = [
    (dict(return_lse=True), ValueError, "lse_mode"),
    (dict(sinks=np.zeros(HEADS, np.float32)), ValueError, "use_sinks"),
    (dict(bmm1_scale=1.0, bmm2_scale=1.0), ValueError, "bmm1_scale"),
    (dict(skip_softmax_threshold_scale_factor=0.1), ValueError, "skip_softmax"),
    (dict(kv_cache="independent split"), ValueError, "kv_cache_layout='split'"),
    (dict(query="independent split"), ValueError, "query_layout='split'"),
    (dict(kv_cache="too wide"), ValueError, "last dim"),
    (dict(q_nope="both forms"), TypeError, "not both"),
    (dict(query=None), TypeError, "needs query="),
    (dict(query="float16"), TypeError, "float16"),
]


@pytest.mark.parametrize("change,error,message", RUN_ERRORS, ids=[m for _, _, m in RUN_ERRORS])
def test_runs_breaking_the_plan_raise_before_writing(change, error, message):
    batch = PackedBatch(8, [2, 1], [20, 30])
    wrapper = batch.plan(batch.csr())
    q, cache = batch.query, batch.cache
    out = np.full((3, HEADS, CKV), 7.0, np.float32)
    args = dict(query=q, kv_cache=cache, out=out)
    forms = {
        "independent split": lambda x: (np.ascontiguousarray(x[..., :CKV]), x[..., CKV:].copy()),
        "too wide": lambda x: np.zeros((*x.shape[:-1], CKV + KPE + 16), np.float32),
        "both forms": lambda x: q[..., :CKV],
        "float16": lambda x: x.astype(np.float16),
    }
    for name, value in change.items():
        args[name] = forms[value](args.get(name, q)) if isinstance(value, str) else value
    with pytest.raises(error, match=message):
        wrapper.run(**args)
    assert (out == 7.0).all()
