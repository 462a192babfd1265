"""FlashInfer's use_cuda_graph=True: plan() writes each batch's page table
into the caller's fixed buffers and run() reads it from them alone, so a
step replays with whatever the buffers hold; the batch size is the buffers'.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pagedkv
import reference

B, HQ, HKV, D, P = 3, 8, 2, 64, 16


def batch_and_pool(seed: int, lens):
    rng = np.random.default_rng(seed)
    batch = reference.paged_batch(rng, P, lens, [0] * len(lens))
    pool = rng.standard_normal((40, 2, P, HKV, D), dtype=np.float32)
    return batch, pool


def buffers(capacity: int = 32):
    return (
        torch.zeros(B + 1, dtype=torch.int32),
        torch.zeros(capacity, dtype=torch.int32),
        torch.zeros(B, dtype=torch.int32),
    )


def reference_decode(q, pool, batch):
    gathered = reference.gather(
        pool, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD"
    )
    return np.stack(
        [
            reference.attention(q[b : b + 1], k, v, np.array([len(k) - 1]))[0][0]
            for b, (k, v) in enumerate(gathered)
        ]
    )


@pytest.mark.parametrize("cls", ["wrapper", "CUDAGraph alias"])
def test_decode_reads_the_page_table_from_the_fixed_buffers(cls):
    indptr_buf, indices_buf, last_buf = buffers()
    if cls == "wrapper":
        w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(
            None,
            "NHD",
            use_cuda_graph=True,
            paged_kv_indptr_buffer=indptr_buf,
            paged_kv_indices_buffer=indices_buf,
            paged_kv_last_page_len_buffer=last_buf,
        )
    else:
        w = pagedkv.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
            None, indptr_buf, indices_buf, last_buf
        )
    assert w.is_cuda_graph_enabled
    q = np.random.default_rng(9).standard_normal((B, HQ, D), dtype=np.float32)
    for seed, lens in ((1, [40, 3, 17]), (2, [5, 70, 33])):
        batch, pool = batch_and_pool(seed, lens)
        table = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
        w.plan(*table, HQ, HKV, D, P)
        nnz = int(batch.kv_indptr[-1])
        assert indptr_buf.tolist() == batch.kv_indptr.tolist()
        assert indices_buf[:nnz].tolist() == batch.kv_indices.tolist()
        assert last_buf.tolist() == batch.kv_last_page_len.tolist()
        want = reference_decode(q, pool, batch)
        np.testing.assert_allclose(w.run(q, pool), want, rtol=1e-5, atol=1e-5)
        # run() reads the buffers, not a copy: moving request 0 to other
        # pages there (same lengths, so the plan's work list still holds)
        # changes its output as a replayed graph's would.
        moved = batch.kv_indices.copy()
        moved[: batch.kv_indptr[1]] += 1
        indices_buf[:nnz] = torch.from_numpy(moved)
        batch.kv_indices[:] = moved
        np.testing.assert_allclose(
            w.run(q, pool), reference_decode(q, pool, batch), rtol=1e-5, atol=1e-5
        )


def kernel_operand_addresses(w) -> dict[str, int]:
    """Where each array run() hands the decode kernel lives (the plan's own
    and the fixed ones; q, out and the pool are the caller's)."""
    return {name: b._data_ptr() for name, b in w._plan.buffers.items() if name != "int_params"}


def check_decode_replans_in_place(device: str, capture: bool = False) -> None:
    """A use_cuda_graph decode wrapper's plans write one set of arrays: a
    second plan with longer requests (more key splits) and an empty one
    reads its work list from the addresses the first plan's step read, with
    the unused capacity padded. With capture (CUDA), a step captured in a
    torch CUDA graph after the first plan replays the second plan's batch."""
    bufs = [x.to(device) for x in buffers(capacity=96)]
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(
        None, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
        paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2],
    )  # fmt: skip
    rng = np.random.default_rng(12)
    pool = torch.from_numpy(rng.standard_normal((120, 2, P, HKV, D), dtype=np.float32))
    pool = pool.to(device)
    q = torch.from_numpy(rng.standard_normal((B, HQ, D), dtype=np.float32)).to(device)
    out = torch.empty_like(q)
    first = reference.paged_batch(rng, P, [40, 3, 17], [0] * B)
    w.plan(*(torch.from_numpy(x).to(device) for x in first_table(first)), HQ, HKV, D, P)
    addresses = kernel_operand_addresses(w)
    step = lambda: w.run(q, pool, out=out)  # noqa: E731
    if capture:
        graph = torch.cuda.CUDAGraph()
        step()  # the op compiled and loaded before the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            step()
        step = graph.replay  # noqa: E731
    for lens in ([40, 3, 17], [600, 0, 900]):
        batch = reference.paged_batch(rng, P, lens, [0] * B)
        w.plan(*(torch.from_numpy(x).to(device) for x in first_table(batch)), HQ, HKV, D, P)
        assert kernel_operand_addresses(w) == addresses
        items = w._fixed_work.items.cpu().numpy()
        used = int(w._fixed_work.request_items.cpu()[-1])
        assert (items[used:, 2] == 0).all()  # the padding has no queries
        step()
        if device != "cpu":
            torch.cuda.synchronize()
        want = reference_decode(q.cpu().numpy(), pool.cpu().numpy(), batch)
        np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-5, atol=1e-5)
    assert used > B  # the long requests were split


def first_table(batch):
    return batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len


def test_decode_replans_its_work_list_in_place():
    check_decode_replans_in_place("cpu")


def test_fixed_work_list_refuses_a_plan_it_cannot_hold():
    bufs = buffers(capacity=96)
    w = pagedkv.BatchDecodeWithPagedKVCacheWrapper(
        None, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
        paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2],
    )  # fmt: skip
    rng = np.random.default_rng(13)
    batch = reference.paged_batch(rng, P, [40, 3, 17], [0] * B)
    w.plan(*first_table(batch), HQ, HKV, D, P)
    capacity = w._fixed_work.capacity
    long = reference.paged_batch(rng, P, [P * capacity] * B, [0] * B)
    with pytest.raises(ValueError, match="fixed work list holds"):
        w.plan(*first_table(long), HQ, HKV, D, P, fixed_split_size=1)


def test_prefill_writes_every_fixed_buffer():
    indptr_buf, indices_buf, last_buf = buffers()
    qo_buf = torch.zeros(B + 1, dtype=torch.int32)
    w = pagedkv.BatchPrefillWithPagedKVCacheWrapper(
        None, "NHD", True, qo_buf, indptr_buf, indices_buf, last_buf
    )
    assert w.is_cuda_graph_enabled
    rng = np.random.default_rng(4)
    batch = reference.paged_batch(rng, P, [20, 9, 33], [20, 4, 1])
    pool = rng.standard_normal((batch.num_pages, 2, P, HKV, D), dtype=np.float32)
    table = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    w.plan(batch.append_indptr, *table, HQ, HKV, D, P, causal=True)
    assert qo_buf.tolist() == batch.append_indptr.tolist()
    assert indptr_buf.tolist() == batch.kv_indptr.tolist()
    q = rng.standard_normal((batch.nnz, HQ, D), dtype=np.float32)
    o = w.run(q, pool)
    plain = pagedkv.BatchPrefillWithPagedKVCacheWrapper()
    plain.plan(batch.append_indptr, *table, HQ, HKV, D, P, causal=True)
    assert np.array_equal(o, plain.run(q, pool))


def test_fixed_buffers_are_checked_before_anything_is_written():
    indptr_buf, indices_buf, last_buf = buffers(capacity=4)
    with pytest.raises(ValueError, match="needs paged_kv_indices_buffer"):
        pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", True, False, indptr_buf)
    with pytest.raises(TypeError, match="int32"):
        pagedkv.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
            None, indptr_buf.long(), indices_buf, last_buf
        )
    with pytest.raises(ValueError, match="go with use_cuda_graph=True"):
        pagedkv.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", False, False, indptr_buf)
    w = pagedkv.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(None, indptr_buf, indices_buf, last_buf)
    batch, _ = batch_and_pool(1, [40, 3, 17])  # 6 pages: more than the buffer holds
    with pytest.raises(ValueError, match="holds 4 entries, fewer than the 6"):
        w.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, P)
    small, _ = batch_and_pool(1, [40, 3])  # another batch size
    with pytest.raises(ValueError, match="batch size is fixed"):
        w.plan(small.kv_indptr, small.kv_indices, small.kv_last_page_len, HQ, HKV, D, P)
    assert not indptr_buf.any() and not indices_buf.any() and not last_buf.any()
    with pytest.raises(ValueError, match="not supported by BatchPrefillWithRaggedKVCacheWrapper"):
        pagedkv.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD", True)


@pytest.mark.gpu
def test_captured_decode_replays_each_plan():
    """use_cuda_graph: a decode step captured in a torch CUDA graph after one
    plan() replays the next plans' batches (longer, split, an empty request)
    right: every array the kernels read stays where the capture saw it."""
    check_decode_replans_in_place("cuda", capture=True)
