"""The page manager's consistency check (`PagedKVCacheManager.validate`):
page tables against the pools in every layer group, and each pool's own
partition of its pages."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from .layer_groups import LayerGroup
from .page_pool import fail

if TYPE_CHECKING:
    from .manager import PagedKVCacheManager


def validate_manager(manager: PagedKVCacheManager) -> None:
    """Raises CacheStateError where `manager`'s bookkeeping is inconsistent
    (see `PagedKVCacheManager.validate` for what is checked)."""
    size = manager.page_size
    ids = list(manager._requests)
    for rid in ids:
        r = manager._requests[rid]
        if r.num_pages != -(-r.seq_len // size):
            fail(f"request {rid!r}: {r.num_pages} pages for {r.seq_len} tokens")
        if r.chain is not None and r.tail.size != r.seq_len % size:
            fail(f"request {rid!r}: {r.tail.size} token ids for its partial last page")
        if len({len(a) for a in r.ahead}) != 1:
            fail(f"request {rid!r}: its groups set aside different numbers of pages")
    for group in manager._groups:
        _validate_group(manager, group, ids)


def _validate_group(manager: PagedKVCacheManager, group: LayerGroup, ids: list[Hashable]) -> None:
    size, g, pool = manager.page_size, group.index, group.pool
    total = pool.num_pages
    where = "" if len(manager._groups) == 1 else f" (layer group {g})"
    firsts = []
    for rid in ids:
        r = manager._requests[rid]
        first = r.first[g]
        firsts.append(first)
        if group.window is None:
            if first != 0:
                fail(f"request {rid!r} has null slots in a full-attention group{where}")
        else:
            # The first query of the request's current step is at `start`.
            start = r.seq_len - (r.reserved if r.generation == manager._generation else 0)
            if not 0 <= first <= group.first_slot(start, size):
                fail(f"request {rid!r} gave back a page its window still sees{where}")
            if (r.pages[g, :first] != group.null_page).any():
                fail(f"request {rid!r}: a given-back slot is not the null page{where}")
        pages = r.live_pages(g)
        if pages.size and (pages.min() < 0 or pages.max() >= total):
            fail(f"request {rid!r} holds a page outside the pool{where}: {pages.tolist()}")
        if np.unique(pages).size != pages.size:
            fail(f"request {rid!r} holds a page twice{where}: {pages.tolist()}")
    meta = manager.metadata(ids, num_new_tokens=0, group=g)
    indptr, indices, last = meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len
    counts = np.diff(indptr.astype(np.int64))
    if indptr[0] != 0 or (counts < 0).any() or indptr[-1] != indices.size:
        fail(f"kv_indptr is not a CSR offset array{where}: {indptr.tolist()}")
    high = total + (group.window is not None)
    if indices.size and (indices.min() < 0 or indices.max() >= high):
        fail(f"kv_indices leaves the pool{where}")
    full = counts > 0
    if ((last < 1) | (last > size))[full].any() or (last[~full] != 0).any():
        fail(f"kv_last_page_len out of range{where}: {last.tolist()}")

    ahead = np.array([p for rid in ids for p in manager._requests[rid].ahead[g]], np.int64)
    if any(p in pool.hash_of_page for p in ahead.tolist()):
        fail(f"a set-aside page has a prefix hash{where}")
    slot = np.arange(indices.size) - np.repeat(indptr[:-1], counts)
    fill = np.where(slot == np.repeat(counts - 1, counts), np.repeat(last, counts), size)
    # Only the slots that hold the requests' own pages (not the null page).
    live = slot >= np.repeat(np.array(firsts, np.int64), counts)
    indices, slot, fill = indices[live], slot[live], fill[live]
    owners = np.bincount(np.concatenate([indices, ahead]), minlength=total)
    wrong = np.flatnonzero(owners != pool.refcount)
    if wrong.size:
        p = int(wrong[0])
        fail(f"page {p}: refcount {pool.refcount[p]} but {owners[p]} owners{where}")
    for name, value in (("index", slot), ("fill", fill)):
        low = np.full(total, np.iinfo(np.int64).max)
        high_value = np.full(total, -1)
        np.minimum.at(low, indices, value)
        np.maximum.at(high_value, indices, value)
        differs = np.flatnonzero((owners > 1) & (low != high_value))
        if differs.size:
            fail(f"shared page {int(differs[0])} differs in {name} between its owners{where}")
    hashed = np.array(sorted(pool.hash_of_page), np.int64)
    if hashed.size:
        low_fill = np.full(total, size)
        np.minimum.at(low_fill, indices, fill)
        partial = hashed[low_fill[hashed] < size]
        if partial.size:
            fail(f"page {int(partial[0])} has a prefix hash but is not full{where}")
    pool.validate()
    if group.host is not None:
        group.host.validate()
        if (group.host.refcount != 0).any() or group.host.pinned:
            fail(f"a host-tier page has an owner or a pin{where}")
