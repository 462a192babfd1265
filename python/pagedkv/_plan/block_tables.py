"""Block tables (FlashInfer's trtllm-gen page tables) as CSR page tables.

A block table ``[B, max_pages]`` with ``seq_lens [B]`` is a CSR page table
with a fixed row stride: request b's pages are the first ``ceil(seq_lens[b]
/ page_size)`` entries of its row. These helpers convert on the host (index
arrays only) and check that both forms, when both are given, agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._checks import check_int, host_int_array, narrow_indices
from .._ops.tensors import Array, check_array, device_of, is_contiguous, is_torch


@dataclass(frozen=True)
class CsrPageTable:
    """A block table's pages as FlashInfer's CSR page table (int32 arrays):
    indptr [B + 1], indices [indptr[-1]], last_page_len [B]."""

    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray


def csr_from_block_tables(block_tables: Array, seq_lens: Array, page_size: int) -> CsrPageTable:
    """The CSR page table holding the same pages as a block table.

    Parameters
    ----------
    block_tables : int array [B, max_pages]
        Request b's pages in order; entries past its last page are not read.
    seq_lens : int array [B]
        Tokens cached for each request (its queries' own included).
    page_size : int
        Tokens a page.

    Returns
    -------
    CsrPageTable
        indptr, indices and last_page_len as `BatchDecodeWithPagedKVCacheWrapper.plan`
        takes them.

    Examples
    --------
    >>> import numpy as np, pagedkv
    >>> t = pagedkv.csr_from_block_tables(np.array([[3, 1, 0], [2, 0, 0]]), np.array([5, 2]), 4)
    >>> t.indptr.tolist(), t.indices.tolist(), t.last_page_len.tolist()
    ([0, 2, 3], [3, 1, 2], [1, 2])
    """
    table = host_int_array("block_tables", block_tables, 2)
    lens = host_int_array("seq_lens", seq_lens, 1)
    page_size = check_int("page_size", page_size, 1)
    if lens.shape[0] != table.shape[0]:
        raise ValueError(f"seq_lens {lens.shape} and block_tables {table.shape} differ in batch")
    if lens.size and lens.min() < 0:
        raise ValueError("seq_lens must not be negative")
    pages = -(-lens // page_size)
    if pages.size and pages.max() > table.shape[1]:
        b = int(np.argmax(pages > table.shape[1]))
        raise ValueError(
            f"request {b} holds {int(lens[b])} tokens, {int(pages[b])} pages of {page_size}, "
            f"past the block table's {table.shape[1]} columns"
        )
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    keep = np.arange(table.shape[1])[None, :] < pages[:, None]
    last = np.where(pages > 0, lens - (pages - 1) * page_size, 0)
    # The pages in use are page ids: int32, never wrapped, never negative
    # (the columns past a request's pages may hold anything, -1 often).
    indices = narrow_indices("block_tables", table[keep])
    if indices.size and indices.min() < 0:
        raise ValueError(f"block_tables names page {int(indices.min())}: page ids are >= 0")
    return CsrPageTable(indptr, indices, last.astype(np.int32))


def check_block_tables_agree(
    block_tables: Array | None,
    seq_lens: Array | None,
    page_size: int,
    indptr: Array,
    indices: Array,
    last_page_len: Array,
) -> None:
    """Raises unless block_tables [B, max_pages] with seq_lens [B] name the
    pages the CSR table names (plan() reads the CSR table; FlashInfer's
    trtllm-gen backend reads the block table in its place)."""
    if block_tables is None or seq_lens is None:
        raise ValueError("block_tables and seq_lens come together")
    table = csr_from_block_tables(block_tables, seq_lens, page_size)
    given = {"indptr": indptr, "indices": indices, "last_page_len": last_page_len}
    if not all(
        np.array_equal(getattr(table, name), host_int_array(name, x, 1))
        for name, x in given.items()
    ):
        raise ValueError("block_tables and seq_lens name other pages than the CSR table")


def check_trtllm_table(
    block_tables: Array | None,
    seq_lens: Array | None,
    page_size: int,
    csr: tuple[Array, Array, Array],
    qo_indptr: Array | None = None,
    seq_lens_q: Array | None = None,
) -> None:
    """Raises unless FlashInfer's trtllm-gen inputs to a plan(), where given,
    describe the batch of the CSR table csr (indptr, indices,
    last_page_len): block_tables with seq_lens its pages, seq_lens_q the
    query counts of qo_indptr."""
    if block_tables is not None or seq_lens is not None:
        check_block_tables_agree(block_tables, seq_lens, page_size, *csr)
    if seq_lens_q is not None and not np.array_equal(
        host_int_array("seq_lens_q", seq_lens_q, 1),
        np.diff(host_int_array("qo_indptr", qo_indptr, 1)),
    ):
        raise ValueError("seq_lens_q must be the query counts qo_indptr gives")


def sm_count(device: Any) -> int:
    """The streaming multiprocessors of a CUDA device; 1 for any other (the
    CPU has no multi-CTA kernels to count). FlashInfer sizes its multi-CTA
    counter buffers by it (`multi_ctas_kv_counter_bytes`)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def multi_ctas_kv_counter_bytes(batch_size: int, num_qo_heads: int, sms: int) -> int:
    """Bytes of FlashInfer's trtllm-gen multi-CTA KV counters: one int32
    semaphore per (request, head), at least one per SM, rounded up to 8."""
    return -(-max(batch_size * num_qo_heads, sms) // 8) * 8 * 4


def check_multi_ctas_kv_counter_buffer(
    buffer: Array | None, batch_size: int, num_qo_heads: int, like: Array
) -> None:
    """Raises ValueError unless buffer (given) is what FlashInfer's trtllm-gen
    calls take: on like's device, contiguous, 16-byte aligned and large
    enough. pagedkv's kernels need no counters, so it is left as it is
    (zeros, as FlashInfer's kernels leave it)."""
    if buffer is None:
        return
    check_array("multi_ctas_kv_counter_buffer", buffer)
    if device_of(buffer) != device_of(like):
        raise ValueError("multi_ctas_kv_counter_buffer must be on the same device as query")
    if not is_contiguous(buffer):
        raise ValueError("multi_ctas_kv_counter_buffer must be contiguous")
    if is_torch(buffer):
        size, address = buffer.numel() * buffer.element_size(), buffer.data_ptr()
    else:
        size, address = buffer.nbytes, buffer.__array_interface__["data"][0]
    if size and address % 16:
        raise ValueError(
            f"multi_ctas_kv_counter_buffer must be 16-byte aligned, got data_ptr % 16 ="
            f" {address % 16}"
        )
    device = like.device if is_torch(like) else "cpu"
    need = multi_ctas_kv_counter_bytes(batch_size, num_qo_heads, sm_count(device))
    if size < need:
        raise ValueError(
            f"multi_ctas_kv_counter_buffer is too small: got {size} bytes, need {need} bytes"
        )
