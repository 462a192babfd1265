"""get_seq_lens and get_batch_indices_positions: property tests against NumPy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv
import reference
from conftest import to_device


@st.composite
def page_tables(draw):
    page_size = draw(st.integers(1, 64))
    lens = draw(st.lists(st.integers(0, 300), min_size=0, max_size=12))
    pages = [-(-n // page_size) for n in lens]
    indptr = np.concatenate([[0], np.cumsum(pages, dtype=np.int64)]).astype(np.int32)
    last = np.array(
        [n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages, strict=True)], np.int32
    )
    return page_size, np.array(lens, np.int32), indptr, last


@settings(max_examples=60, deadline=None)
@given(page_tables())
def test_seq_lens_match_flashinfer_formula(table):
    page_size, lens, indptr, last = table
    got = pagedkv.get_seq_lens(indptr, last, page_size)
    np.testing.assert_array_equal(got, lens)
    np.testing.assert_array_equal(got, reference.seq_lens(indptr, last, page_size))


@st.composite
def appends(draw):
    lens = draw(st.lists(st.integers(0, 200), min_size=0, max_size=12))
    appended = [draw(st.integers(0, n)) for n in lens]
    indptr = np.concatenate([[0], np.cumsum(appended, dtype=np.int64)]).astype(np.int32)
    return np.array(lens, np.int32), indptr


@settings(max_examples=60, deadline=None)
@given(appends())
def test_batch_indices_positions_match_reference(case):
    lens, append_indptr = case
    nnz = int(append_indptr[-1])
    batch_indices, positions = pagedkv.get_batch_indices_positions(append_indptr, lens, nnz)
    want_b, want_p = reference.batch_indices_positions(append_indptr, lens, nnz)
    np.testing.assert_array_equal(batch_indices, want_b)
    np.testing.assert_array_equal(positions, want_p)
    # The appended tokens are the last ones of each request.
    if nnz:
        assert (positions < lens[batch_indices]).all()


def test_outputs_have_the_kind_of_the_inputs():
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32)
    last = torch.tensor([3, 1], dtype=torch.int32)
    lens = pagedkv.get_seq_lens(indptr, last, 4)
    assert isinstance(lens, torch.Tensor) and lens.tolist() == [7, 1]
    b, p = pagedkv.get_batch_indices_positions(torch.tensor([0, 2, 3], dtype=torch.int32), lens, 3)
    assert isinstance(b, torch.Tensor) and b.tolist() == [0, 0, 1] and p.tolist() == [5, 6, 0]


def test_index_helpers_reject_bad_input():
    indptr = np.array([0, 2, 3], np.int32)
    last = np.array([3, 1], np.int32)
    with pytest.raises(TypeError, match="kv_indptr must be int32"):
        pagedkv.get_seq_lens(indptr.astype(np.float32), last, 4)
    with pytest.raises(ValueError, match=r"kv_indptr\[2\] = 4294967299 does not fit"):
        pagedkv.get_seq_lens(indptr.astype(np.int64) + np.array([0, 0, 2**32]), last, 4)
    with pytest.raises(ValueError, match="kv_indptr must have 3 entries"):
        pagedkv.get_seq_lens(indptr[:2], last, 4)
    with pytest.raises(ValueError, match="page_size"):
        pagedkv.get_seq_lens(indptr, last, 0)
    # Values a page table may not hold: the kernels' own check.
    for bad_indptr, bad_last, match in [
        ([1, 2, 3], [3, 1], r"kv_indptr\[0\] = 1 must be 0"),
        ([0, 3, 2], [3, 1], r"must not decrease: kv_indptr\[2\] = 2 < kv_indptr\[1\] = 3"),
        ([0, 2, 3], [0, 1], r"kv_last_page_len\[0\] = 0 is outside \[1, page_size = 4\]"),
        ([0, 2, 3], [3, 5], r"kv_last_page_len\[1\] = 5 is outside \[1, page_size = 4\]"),
        ([0, 0, 3], [2, 1], r"request 0 owns no pages but kv_last_page_len\[0\] = 2"),
        ([0, 2**31 - 1], [1], "request 0 holds 8589934585 tokens, more than an int32"),
    ]:
        with pytest.raises(ValueError, match=match):
            pagedkv.get_seq_lens(np.array(bad_indptr, np.int32), np.array(bad_last, np.int32), 4)
    lens = np.array([7, 1], np.int32)
    with pytest.raises(ValueError, match="append_indptr\\[-1\\] = 3 exceeds nnz = 2"):
        pagedkv.get_batch_indices_positions(indptr, lens, 2)
    with pytest.raises(ValueError, match="appends 2 tokens but seq_lens"):
        pagedkv.get_batch_indices_positions(np.array([0, 1, 3], np.int32), lens, 3)


def test_batch_indices_positions_fill_given_buffers():
    """FlashInfer's pre-allocated outputs: written in place and returned;
    wrong ones refused before anything is written."""
    append_indptr = np.array([0, 1, 3, 6, 10], np.int32)
    seq_lens = np.array([5, 5, 5, 5], np.int32)
    b_out, p_out = np.full(10, -1, np.int32), np.full(10, -1, np.int32)
    b, p = pagedkv.get_batch_indices_positions(append_indptr, seq_lens, 10, b_out, p_out)
    assert b is b_out and p is p_out
    np.testing.assert_array_equal(b_out, [0, 1, 1, 2, 2, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(p_out, [4, 3, 4, 2, 3, 4, 1, 2, 3, 4])
    keep = np.full(10, -1, np.int32)
    for bad, match in [
        (np.zeros(10, np.int64), "int32"),
        (np.zeros(9, np.int32), r"\[10\]"),
        (np.zeros(20, np.int32)[::2], "contiguous"),
    ]:
        with pytest.raises(ValueError, match=match):
            pagedkv.get_batch_indices_positions(append_indptr, seq_lens, 10, bad, keep)
        assert (keep == -1).all()


@pytest.mark.gpu
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
