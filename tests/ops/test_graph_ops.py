"""pagedkv's graph ops inside a user's max.graph graph: append then decode on
one pool buffer, compiled once with symbolic batch, token and page counts
(in the suite's module: suite_graphs.py)."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Module, TensorType

import pagedkv
import reference
from pagedkv import graph_ops
from pagedkv._plan import work as attention_work
from pagedkv._plan.work import CPU_MAX_SHARED_ROWS, AttentionOptions, heads_per_task
from suite_graphs import ops_graph, suite_graph, suite_model

P, HQ, HKV, D = 16, 8, 2, 64
CPU_SHARED_QUERIES = CPU_MAX_SHARED_ROWS // (HQ // HKV)
"""Requests one shared decode item holds at most."""


@suite_graph("append_then_decode")
def build_step_graph(module: Module) -> None:
    cpu = DeviceRef.CPU()
    i32 = DType.int32

    def index(name):
        return TensorType(i32, [name], device=cpu)

    types = [
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
    ]

    with ops_graph(module, "append_then_decode", types) as g:
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
        # The same work from the lengths a caller already has.
        given = graph_ops.decode_work(
            batch.kv_indptr, batch.kv_last_page_len, P, HQ, HKV, D, gpu=False,
            seq_lens=batch.seq_lens,
        )  # fmt: skip
        for got, want in zip(given, (items, request_items), strict=True):
            np.testing.assert_array_equal(got, want)
        with pytest.raises(ValueError, match="seq_lens has shape"):
            graph_ops.decode_work(
                batch.kv_indptr, batch.kv_last_page_len, P, HQ, HKV, D, gpu=False,
                seq_lens=batch.seq_lens[1:],
            )  # fmt: skip
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


@suite_graph("append_unchecked")
def build_unchecked_append(module: Module) -> None:
    cpu = DeviceRef.CPU()

    def index(name):
        return TensorType(DType.int32, [name], device=cpu)

    rows = TensorType(DType.float32, ["nnz", HKV, D], device=cpu)
    types = [
        BufferType(DType.float32, ["pages", 2, P, HKV, D], device=cpu),
        rows,
        rows,
        *(index(n) for n in ("nnz", "nnz", "used_pages", "batch_plus_1", "batch")),
    ]
    with ops_graph(module, "append_unchecked", types) as g:
        pool, k, v, *table = g.inputs
        index = (t.tensor for t in table)
        graph_ops.append_paged_kv_cache(pool, k.tensor, v.tensor, *index, checked=False)
        g.output()


def test_unchecked_append_skips_tokens_without_a_slot():
    """An append that trusts its table (checked=False, the step graphs' on a
    GPU) writes every token that has a slot, bit for bit, and skips the
    others without raising: a position past its request's cached tokens (on
    a page with room), a request outside the batch, a negative position.
    The checked op refuses the same call before writing."""
    model = suite_model("append_unchecked")
    rng = np.random.default_rng(3)
    batch = reference.paged_batch(rng, P, [30, 7], [3, 2])
    pool = rng.standard_normal((batch.num_pages, 2, P, HKV, D), dtype=np.float32)
    k = rng.standard_normal((batch.nnz, HKV, D), dtype=np.float32)
    v = rng.standard_normal((batch.nnz, HKV, D), dtype=np.float32)
    bi, pos = reference.batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)
    table = (batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len)
    want = pool.copy()
    pagedkv.append_paged_kv_cache(k[:3], v[:3], bi[:3], pos[:3], want, *table)
    bad_bi, bad_pos = bi.copy(), pos.copy()
    bad_pos[3] = batch.seq_lens[1]  # one past request 1's tokens, on its last page
    assert bad_pos[3] % P != 0
    bad_bi[4] = 2  # a batch of two requests
    got = pool.copy()
    model.execute(*[Buffer.from_numpy(x) for x in (got, k, v, bad_bi, bad_pos, *table)])
    np.testing.assert_array_equal(got, want)
    bad_pos[:3] = -1
    model.execute(*[Buffer.from_numpy(x) for x in (got, k, v, bad_bi, bad_pos, *table)])
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="outside"):
        pagedkv.append_paged_kv_cache(k, v, bad_bi, bad_pos, got, *table)
    np.testing.assert_array_equal(got, want)


def shared_prefix_table(rng: np.random.Generator, groups, tails):
    """A page table whose requests share prefixes: groups is a list of
    (prefix pages, requests sharing it) (0 pages: private requests), tails
    each request's own tokens after its prefix (at least 1, so its last
    page, which the new token goes to, is its own)."""
    prefix_pages = sum(p for p, _ in groups)
    own_pages = [-(-t // P) for t in tails]
    perm = rng.permutation(prefix_pages + sum(own_pages) + 2).astype(np.int32)
    indices, lens, taken, b = [], [], prefix_pages, 0
    at = 0
    for pages, count in groups:
        prefix = perm[at : at + pages]
        at += pages
        for _ in range(count):
            own = perm[taken : taken + own_pages[b]]
            taken += own_pages[b]
            indices.append(np.concatenate([prefix, own]))
            lens.append(pages * P + tails[b])
            b += 1
    lens = np.array(lens, np.int64)
    kv_indptr = np.concatenate([[0], np.cumsum([len(i) for i in indices])]).astype(np.int32)
    last = (lens - (np.diff(kv_indptr) - 1) * P).astype(np.int32)
    return len(perm), lens, kv_indptr, np.concatenate(indices), last


def test_decode_reads_shared_prefix_pages_once_and_matches_float64():
    """Requests that share a prefix's pages are scored together (one item
    holds the queries of up to 32 requests, or of two, below the rows that
    take matrix products); every request's output still matches float64."""
    model = suite_model("append_then_decode")
    rng = np.random.default_rng(3)
    groups = [(40, 35), (20, 2), (0, 1), (12, 3)]
    tails = rng.integers(1, 60, sum(n for _, n in groups)).tolist()
    num_pages, lens, kv_indptr, kv_indices, last = shared_prefix_table(rng, groups, tails)
    batch = len(lens)
    pool = rng.standard_normal((num_pages, 2, P, HKV, D), dtype=np.float32)
    k = rng.standard_normal((batch, HKV, D), dtype=np.float32)
    v = rng.standard_normal((batch, HKV, D), dtype=np.float32)
    append_indptr = np.arange(batch + 1, dtype=np.int32)
    bi, pos = reference.batch_indices_positions(append_indptr, lens.astype(np.int32), batch)
    q = rng.standard_normal((batch, HQ, D), dtype=np.float32)
    items, request_items = graph_ops.decode_work(
        kv_indptr, last, P, HQ, HKV, D, gpu=False, kv_indices=kv_indices
    )
    shared = items[:, 2]
    assert shared.max() == CPU_SHARED_QUERIES and 2 in shared and (shared == 0).any()
    table = (kv_indices, kv_indptr, last)
    o, lse = model.execute(
        *[Buffer.from_numpy(x) for x in (pool, k, v, bi, pos, *table, q, items, request_items)]
    )
    cached = reference.gather(pool, kv_indices, kv_indptr, last, "NHD")
    # The appended rows, in float64 from what the graph wrote.
    for b, (kb, vb) in enumerate(cached):
        np.testing.assert_array_equal(kb[-1], k[b])
        want_o, want_lse = reference.attention(
            q[b : b + 1], kb, vb, np.array([lens[b] - 1]), logits_soft_cap=30.0
        )
        np.testing.assert_allclose(o.to_numpy()[b], want_o[0], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(lse.to_numpy()[b], want_lse[0], rtol=2e-5, atol=2e-5)


def test_shared_prefix_work_refuses_what_it_cannot_share():
    """A GPU or fixed splits get a clear error, not a wrong plan."""
    rng = np.random.default_rng(4)
    _, _, kv_indptr, kv_indices, last = shared_prefix_table(rng, [(4, 3)], [5, 9, 20])
    args = (kv_indptr, last, P, HQ, HKV, D)
    for bad in ({"gpu": True}, {"fixed_chunk": 64}):
        options = {"gpu": False, **bad}
        with pytest.raises(ValueError, match="shared prefixes"):
            graph_ops.decode_work(*args, kv_indices=kv_indices, **options)
    items, request_items = graph_ops.decode_work(*args, gpu=False, kv_indices=kv_indices)
    # The three requests' 64 prefix keys are one item holding all three
    # queries; each request keeps its own tail.
    assert request_items.tolist() == [0, 2, 4, 6]
    assert items[:, 2].tolist() == [3, 1, 0, 1, 0, 1]
    assert items[:, 4:].tolist() == [[0, 64], [64, 69], [0, 64], [64, 73], [0, 64], [64, 84]]
    # Under a window the shared keys start at the page of each request's
    # first visible key: requests 0 and 1 (keys 38 and 42 on) share [32, 64),
    # request 2 (53 on) reads [48, 64) alone; the kernel masks the rest.
    items, request_items = graph_ops.decode_work(
        *args, window_left=30, gpu=False, kv_indices=kv_indices
    )
    assert request_items.tolist() == [0, 2, 4, 6]
    assert items[:, 2].tolist() == [2, 1, 0, 1, 1, 1]
    assert items[:, 4:].tolist() == [[32, 64], [64, 69], [32, 64], [64, 73], [48, 64], [64, 84]]


@pytest.mark.parametrize(
    ("cores", "prefix", "keys"),
    [(2, 926, 464), (2, 64, 256), (8, 926, 256), (4, 4000, 1008), (1, 926, 928)],
)
def test_a_shared_prefix_is_split_once_per_core_in_pages(monkeypatch, cores, prefix, keys):
    """A shared prefix's decode items: one per core of whole pages, never
    under min_chunk (256) keys, so the setup of the many queries an item
    holds is paid as few times as keeps every core busy."""
    monkeypatch.setattr(attention_work, "cpu_count", lambda: cores)
    lens = np.full(32, prefix + 20)
    shared = np.full(32, prefix)
    assert attention_work.shared_prefix_chunk(shared, P, 256) == keys
    items, request_items = attention_work.decode_work(
        lens, P, HQ, HKV, heads_per_task(HQ, HKV), AttentionOptions(D), False, shared_prefix=shared
    )
    first, end = items[: request_items[1], 4], items[: request_items[1], 5]
    assert (first[1:] == end[:-1]).all() and first[0] == 0 and end[-1] == prefix + 20
    assert (np.diff(first) == keys)[: -(-prefix // keys) - 1].all()


@pytest.mark.parametrize("length", [1, 17, 300, 5000])
def test_one_request_shares_nothing_and_its_work_list_is_the_plain_one(length):
    """A lone request has no neighbour to share a prefix with, so
    `decode_work` skips the shared-prefix plan for it: right only while
    that plan, with no neighbour, is the plain one."""
    kv_indptr = np.array([0, -(-length // P)], np.int32)
    last = np.array([length - (kv_indptr[1] - 1) * P], np.int32)
    kv_indices = np.arange(kv_indptr[1], dtype=np.int32)
    seq_lens = np.array([length])
    common = attention_work.common_prefix_pages(kv_indptr, kv_indices)
    prefix = attention_work.shared_prefix_tokens(common, seq_lens, P)
    options = AttentionOptions(D)
    per_task = heads_per_task(HQ, HKV)
    planned = attention_work.decode_work(
        seq_lens, P, HQ, HKV, per_task, options, False, shared_prefix=prefix
    )
    plain = attention_work.decode_work(seq_lens, P, HQ, HKV, per_task, options, False)
    for got, want in zip(planned, plain, strict=True):
        np.testing.assert_array_equal(got, want)
    args = (kv_indptr, last, P, HQ, HKV, D)
    for got, want in zip(
        graph_ops.decode_work(*args, gpu=False, kv_indices=kv_indices), plain, strict=True
    ):
        np.testing.assert_array_equal(got, want)
