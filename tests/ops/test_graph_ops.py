"""pagedkv's graph ops inside a user's max.graph graph: append then decode on
one pool buffer, compiled once with symbolic batch, token and page counts
(in the suite's module: suite_graphs.py)."""

from __future__ import annotations

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, Module, TensorType

import pagedkv
import reference
from pagedkv import graph_ops
from suite_graphs import suite_graph, suite_model

P, HQ, HKV, D = 16, 8, 2, 64


@suite_graph("append_then_decode")
def build_step_graph(module: Module) -> None:
    cpu = DeviceRef.CPU()
    i32 = DType.int32

    def index(name):
        return TensorType(i32, [name], device=cpu)

    with Graph(
        "append_then_decode",
        input_types=[
            BufferType(DType.float32, ["pages", 2, P, HKV, D], device=cpu),
            TensorType(DType.float32, ["nnz", HKV, D], device=cpu),
            TensorType(DType.float32, ["nnz", HKV, D], device=cpu),
            index("nnz"),
            index("nnz"),
            index("used_pages"),
            index("batch_plus_1"),
            index("batch"),
            TensorType(DType.float32, ["batch", HQ, D], device=cpu),
            TensorType(i32, ["items", 6], device=cpu),
            index("batch_plus_1"),
        ],
        custom_extensions=graph_ops.custom_extensions(),
        module=module,
    ) as g:
        pool, k, v, bi, pos, indices, indptr, last, q, items, request_items = g.inputs
        graph_ops.append_paged_kv_cache(
            pool,
            k.tensor,
            v.tensor,
            bi.tensor,
            pos.tensor,
            indices.tensor,
            indptr.tensor,
            last.tensor,
        )
        o, lse = graph_ops.batch_decode(
            q.tensor,
            pool,
            indices.tensor,
            indptr.tensor,
            last.tensor,
            items.tensor,
            request_items.tensor,
            num_kv_heads=HKV,
            logits_soft_cap=30.0,
        )
        g.output(o, lse)


def test_append_then_decode_in_one_graph_matches_eager():
    model = suite_model("append_then_decode")
    rng = np.random.default_rng(0)
    # Two different steps through the same compiled graph.
    for lens, new in (([30, 1, 70], [1, 1, 1]), ([5, 200], [5, 2])):
        batch = reference.paged_batch(rng, P, lens, new)
        pool = rng.standard_normal((batch.num_pages, 2, P, HKV, D), dtype=np.float32)
        eager_pool = pool.copy()
        k = rng.standard_normal((batch.nnz, HKV, D), dtype=np.float32)
        v = rng.standard_normal((batch.nnz, HKV, D), dtype=np.float32)
        bi, pos = reference.batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)
        q = rng.standard_normal((batch.batch_size, HQ, D), dtype=np.float32)
        items, request_items = graph_ops.decode_work(
            batch.kv_indptr, batch.kv_last_page_len, P, HQ, HKV, D, gpu=False
        )
        table = (batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len)
        o, lse = model.execute(
            *[Buffer.from_numpy(x) for x in (pool, k, v, bi, pos, *table, q, items, request_items)]
        )
        pagedkv.append_paged_kv_cache(k, v, bi, pos, eager_pool, *table)
        np.testing.assert_array_equal(pool, eager_pool)
        w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
        w.plan(
            batch.kv_indptr,
            batch.kv_indices,
            batch.kv_last_page_len,
            HQ,
            HKV,
            D,
            P,
            logits_soft_cap=30.0,
        )
        want_o, want_lse = w.run(q, eager_pool, return_lse=True)
        np.testing.assert_allclose(o.to_numpy(), want_o, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(lse.to_numpy(), want_lse, rtol=1e-6, atol=1e-6)
