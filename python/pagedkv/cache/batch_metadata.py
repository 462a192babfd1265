"""The batch metadata the kernels take: one layer group's page tables of a
batch of requests (FlashInfer's CSR form and a padded block table) and
the rows it appends."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

PAD_PAGE = -1
"""The block table's value past the end of a request's pages."""


@dataclass(frozen=True)
class BatchMetadata:
    """A batch's page table and append indices, all int32 NumPy arrays.

    Every array describes the batch after the append (FlashInfer's convention):
    the appended tokens are the last ``append_indptr[b + 1] - append_indptr[b]``
    of request b.
    """

    kv_indptr: np.ndarray
    """[B + 1]: request b's pages are kv_indices[kv_indptr[b]:kv_indptr[b + 1]]."""
    kv_indices: np.ndarray
    """[kv_indptr[-1]] page ids."""
    kv_last_page_len: np.ndarray
    """[B]: tokens in each request's last page, in [1, page_size]; 0 with no pages."""
    seq_lens: np.ndarray
    """[B] tokens per request."""
    append_indptr: np.ndarray
    """[B + 1]: request b appends rows append_indptr[b]:append_indptr[b + 1]."""
    batch_indices: np.ndarray
    """[nnz]: the request of each appended row."""
    positions: np.ndarray
    """[nnz]: the sequence position of each appended row."""
    window_left: int = -1
    """The wrappers' window_left for the layer group the page table is of:
    window - 1 for a sliding-window group, -1 (no window) otherwise."""

    @cached_property
    def block_table(self) -> np.ndarray:
        """[B, max pages of a request]: the same pages, one row per request,
        padded with PAD_PAGE (-1). Made on first read: a decode step reads
        only the CSR form."""
        page_counts = np.diff(self.kv_indptr)
        width = int(page_counts.max()) if len(page_counts) else 0
        table = np.full((len(page_counts), width), PAD_PAGE, np.int32)
        # Row-major order of the mask is CSR order.
        table[np.arange(width) < page_counts[:, None]] = self.kv_indices
        return table

    @property
    def batch_size(self) -> int:
        """B: the number of requests in the batch."""
        return int(self.seq_lens.shape[0])

    @property
    def nnz(self) -> int:
        """Rows appended by the whole batch."""
        return int(self.append_indptr[-1])
