"""A functional API in the style of JAX paged attention, on top of the manager.

The state is a :class:`PagedKVCache` (the per-layer pools and the manager that
owns their pages). Sequences are named by hashable ids; allocation returns a
:class:`BlockTable`, the padded page table that the other calls take::

    cache = init_paged_kv_cache(num_pages=64, page_size=16, num_kv_heads=8, head_dim=128)
    table = allocate_blocks(cache, ["a", "b"], [37, 5])
    append_kv(cache, table, key, value, batch_indices, positions)  # rows [nnz, H, D]
    k_a, v_a = gather_kv(cache, table, request=0)
    release_blocks(cache, ["a", "b"])

Pools are written in place (NumPy arrays and torch tensors are not values as
JAX arrays are); a block table is a snapshot, valid until the next
allocate_blocks or release_blocks on its sequences.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import page
from ._checks import narrow_indices
from ._ops.tensors import Array
from .cache.manager import PAD_PAGE, PagedKVCacheManager


@dataclass(frozen=True)
class PagedKVCache:
    """The functional API's state: the manager, which owns the pools."""

    manager: PagedKVCacheManager

    @property
    def pools(self) -> list[Array]:
        """One pool per layer, [num_pages, 2, page_size, H, D] (NHD) or
        [num_pages, 2, H, page_size, D] (HND)."""
        return self.manager.pools

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.manager.page_size


@dataclass(frozen=True)
class BlockTable:
    """The pages of some sequences, one row each.

    seq_ids: the sequence of each row. table: [B, max_blocks] int32, row b's
    first ceil(seq_lens[b] / page_size) entries are its pages, the rest -1.
    seq_lens: [B] int32, tokens allocated to each sequence.
    """

    seq_ids: tuple[Hashable, ...]
    table: np.ndarray
    seq_lens: np.ndarray


def init_paged_kv_cache(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    num_layers: int = 1,
    dtype: object = "float32",
    kv_layout: str = "NHD",
) -> PagedKVCache:
    """Zeroed pools of num_pages pages for num_layers layers, with no sequences.
    Arguments as in PagedKVCacheManager."""
    return PagedKVCache(
        PagedKVCacheManager(
            num_pages,
            page_size,
            num_kv_heads,
            head_dim,
            num_layers=num_layers,
            dtype=dtype,
            kv_layout=kv_layout,
        )
    )


def allocate_blocks(
    cache: PagedKVCache,
    seq_ids: Sequence[Hashable],
    num_tokens: int | Sequence[int] | np.ndarray,
) -> BlockTable:
    """Allocates the blocks for num_tokens more tokens (an int for all, or one
    per sequence) of each sequence, all or nothing; unknown ids start empty.

    Returns the block table of seq_ids after the allocation. A sequence forked
    through the manager gets its shared partial block copied here. Raises
    OutOfPagesError, changing nothing, when the pool is short.
    """
    manager = cache.manager
    ids = list(seq_ids)
    if len(set(ids)) != len(ids):
        raise ValueError(f"seq_ids lists a sequence twice: {ids!r}")
    new = [sid for sid in ids if sid not in manager]
    for sid in new:
        manager.add(sid)
    try:
        manager.reserve(ids, num_tokens)
    except BaseException:
        # Empty requests leave no trace once released: the state is as before.
        for sid in new:
            manager.release(sid)
        raise
    meta = manager.metadata(ids, num_new_tokens=0)
    return BlockTable(tuple(ids), meta.block_table, meta.seq_lens)


def release_blocks(cache: PagedKVCache, seq_ids: Sequence[Hashable]) -> None:
    """Ends the sequences; their blocks return to the pool."""
    manager = cache.manager
    for sid in seq_ids:
        if sid not in manager:
            raise KeyError(f"seq_ids entry {sid!r} is not a live sequence")
    for sid in seq_ids:
        manager.release(sid)


def append_kv(
    cache: PagedKVCache,
    block_table: BlockTable,
    key: Array,
    value: Array,
    batch_indices: Any,
    positions: Any,
    layer: int = 0,
) -> None:
    """Writes key[i], value[i] ([nnz, num_kv_heads, head_dim], the pool's dtype)
    at position positions[i] of the sequence in row batch_indices[i] of
    block_table, in layer's pool, in place.

    Raises ValueError, writing nothing, when a position is outside its
    sequence's allocated tokens (its block is -1 or past seq_lens) or lands in
    a block another sequence shares (allocate_blocks copies those first).
    """
    pool = _pool(cache, layer)
    size = cache.page_size
    table, seq_lens = _check_table(block_table)
    rows = narrow_indices("batch_indices", batch_indices)
    pos = narrow_indices("positions", positions, rows.size)
    batch, width = table.shape
    if rows.size and (rows.min() < 0 or rows.max() >= batch):
        i = int(np.flatnonzero((rows < 0) | (rows >= batch))[0])
        raise ValueError(f"batch_indices[{i}] = {rows[i]} is outside the {batch} rows")
    if (pos < 0).any():
        i = int(np.flatnonzero(pos < 0)[0])
        raise ValueError(f"positions[{i}] = {pos[i]} is negative")
    block = pos // size
    padded = np.concatenate([table, np.full((batch, 1), PAD_PAGE, np.int32)], axis=1)
    target = padded[rows, np.minimum(block, width)]
    for bad, why in (
        (target < 0, "is unallocated (-1)"),
        (pos >= seq_lens[rows], "is allocated but past the sequence's seq_lens"),
    ):
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"positions[{i}] = {pos[i]}: block {block[i]} of row {rows[i]} in block_table {why}"
            )
    shared = cache.manager.refcounts()[target] > 1
    if shared.any():
        i = int(np.flatnonzero(shared)[0])
        raise ValueError(
            f"positions[{i}] = {pos[i]} lands in page {target[i]}, which other sequences "
            "share: allocate_blocks copies it before a write"
        )
    indptr, indices, last = _csr(table, seq_lens, size)
    page.append_paged_kv_cache(
        key, value, rows, pos, pool, indices, indptr, last, kv_layout=cache.manager.kv_layout
    )


def gather_kv(
    cache: PagedKVCache, block_table: BlockTable, layer: int = 0, request: int | None = None
) -> tuple[Array, Array, Array] | tuple[Array, Array]:
    """The K and V of block_table's sequences in layer's pool, as
    pagedkv.gather_kv returns them: (k, v, seq_indptr) with k, v [sum(seq_lens),
    H, D], or (k, v) of row `request` alone."""
    pool = _pool(cache, layer)
    table, seq_lens = _check_table(block_table)
    indptr, indices, last = _csr(table, seq_lens, cache.page_size)
    return page.gather_kv(pool, indices, indptr, last, cache.manager.kv_layout, request=request)


def _pool(cache: PagedKVCache, layer: int) -> Array:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    if not 0 <= layer < len(cache.pools):
        raise ValueError(f"layer must be in [0, {len(cache.pools)}), got {layer}")
    return cache.pools[layer]


def _check_table(block_table: BlockTable) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(block_table, BlockTable):
        raise TypeError(f"block_table must be a BlockTable, got {type(block_table).__name__}")
    table, seq_lens = block_table.table, block_table.seq_lens
    if table.ndim != 2 or seq_lens.shape != (table.shape[0],):
        raise ValueError(
            f"block_table must be [B, max_blocks] with seq_lens [B], got {table.shape} "
            f"and {seq_lens.shape}"
        )
    table = np.asarray(table)
    seq_lens = np.asarray(seq_lens)
    for name, x in (("block_table.table", table), ("block_table.seq_lens", seq_lens)):
        # Narrowed checked: a wrapped int64 page id would name another page.
        narrow_indices(name, x.reshape(-1))
    return table.astype(np.int32, copy=False), seq_lens.astype(np.int32, copy=False)


def _csr(
    table: np.ndarray, seq_lens: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The padded block table as FlashInfer's (kv_indptr, kv_indices,
    kv_last_page_len); raises unless each row is its pages then -1s."""
    counts = -(-seq_lens.astype(np.int64) // page_size)
    owned = np.arange(table.shape[1]) < counts[:, None]
    if (counts > table.shape[1]).any() or ((table >= 0) != owned).any():
        b = int(np.flatnonzero((counts > table.shape[1]) | ((table >= 0) != owned).any(1))[0])
        raise ValueError(
            f"block_table row {b} must hold {counts[b]} pages for seq_lens[{b}] = "
            f"{seq_lens[b]} and then -1s, got {table[b].tolist()}"
        )
    indptr = np.zeros(table.shape[0] + 1, np.int32)
    np.cumsum(counts, out=indptr[1:])
    last = np.where(counts > 0, seq_lens - (counts - 1) * page_size, 0).astype(np.int32)
    return indptr, np.ascontiguousarray(table[owned]), last
