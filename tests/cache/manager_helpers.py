"""What the page manager's tests share: each token's K/V as a pure function
of its prefix (a page served from the prefix cache or shared by a fork reads
back right only if it really holds that prefix), appending and reading back
through the real kernels, state snapshots, and a router that replays KV
events."""

from __future__ import annotations

import hashlib

import numpy as np

import pagedkv
from conftest import bits
from pagedkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.cache.manager import (
    PagedKVCacheManager,
    page_hash,
)

PAGE, HEADS, DIM, LAYERS = 4, 2, 8, 2
BASE = [7, 3, 5, 1, 2, 8, 6, 4, 9, 0, 3, 3, 5]
"""A shared prompt start: prompts built on it hit the prefix cache."""

_rows: dict[tuple[int, ...], np.ndarray] = {}


def token_kv(prefix: tuple[int, ...]) -> np.ndarray:
    """[LAYERS, 2, HEADS, DIM]: the K/V of a prefix's last token, per layer."""
    if prefix not in _rows:
        digest = hashlib.blake2b(np.array(prefix, np.int64).tobytes(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        _rows[prefix] = rng.standard_normal((LAYERS, 2, HEADS, DIM), dtype=np.float32)
    return _rows[prefix]


def kv_of(tokens: list[int], start: int = 0) -> np.ndarray:
    """[LAYERS, 2, len - start, HEADS, DIM]: the K/V of tokens[start:]."""
    if len(tokens) == start:
        return np.zeros((LAYERS, 2, 0, HEADS, DIM), np.float32)
    rows = [token_kv(tuple(tokens[: i + 1])) for i in range(start, len(tokens))]
    return np.ascontiguousarray(np.stack(rows, axis=2))


def state_of(manager: PagedKVCacheManager) -> tuple:
    """Everything a failed call must leave alone: bookkeeping and pool bytes
    (host tiers included)."""
    return manager.snapshot(), [bits(pool) for pool in manager.pools + manager.host_pools]


def assert_same_state(manager: PagedKVCacheManager, before: tuple) -> None:
    snapshot, pools = state_of(manager)
    assert snapshot == before[0]
    for got, want in zip(pools, before[1], strict=True):
        np.testing.assert_array_equal(got, want)


def append_tokens(
    manager: PagedKVCacheManager,
    ids: list,
    new_tokens: list[list[int]],
    histories: list[list[int]],
) -> None:
    """Appends the K/V of new_tokens[b] after histories[b] to each request,
    on every layer (with its layer group's page table), with the metadata of
    the latest reserve()."""
    metas = [manager.metadata(ids, group=g) for g in range(len(manager.layer_groups))]
    meta = metas[0]
    np.testing.assert_array_equal(np.diff(meta.append_indptr), [len(t) for t in new_tokens])
    if meta.nnz == 0:
        return
    kv = np.concatenate(
        [kv_of(h + t, len(h)) for h, t in zip(histories, new_tokens, strict=True)], axis=2
    )
    for layer, pool in enumerate(manager.pools):
        meta = metas[manager.group_of_layer[layer]]
        pagedkv.append_paged_kv_cache(
            np.ascontiguousarray(kv[layer, 0]),
            np.ascontiguousarray(kv[layer, 1]),
            meta.batch_indices,
            meta.positions,
            pool,
            meta.kv_indices,
            meta.kv_indptr,
            meta.kv_last_page_len,
            manager.kv_layout,
        )


def null_slots(manager: PagedKVCacheManager, rid, group: int) -> int:
    """How many leading slots of rid's table in group hold the null page."""
    pages = manager.pages(rid, group)
    return int(np.cumprod(pages == manager.null_pages[group]).sum()) if pages.size else 0


def check_reads_back(manager: PagedKVCacheManager, model: dict) -> None:
    """Every request's gathered K/V, on every layer, is its model's, exactly.

    One gather_kv per layer reads the whole batch (request b's rows are
    seq_indptr[b]:seq_indptr[b + 1]); the fork and decode tests read single
    requests with request=b. In a window group the given-back slots read the
    null page: zeros, whatever was written since."""
    ids = sorted(model)
    metas = [manager.metadata(ids, 0, group=g) for g in range(len(manager.layer_groups))]
    for layer, pool in enumerate(manager.pools):
        group = manager.group_of_layer[layer]
        meta = metas[group]
        k, v, seq_indptr = pagedkv.gather_kv(
            pool, meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len, manager.kv_layout
        )
        np.testing.assert_array_equal(seq_indptr, np.cumsum([0] + [len(model[r]) for r in ids]))
        for b, rid in enumerate(ids):
            want = kv_of(model[rid])[layer].copy()
            want[:, : null_slots(manager, rid, group) * PAGE] = 0
            rows = slice(int(seq_indptr[b]), int(seq_indptr[b + 1]))
            np.testing.assert_array_equal(k[rows], want[0], err_msg=f"K of {rid}, layer {layer}")
            np.testing.assert_array_equal(v[rows], want[1], err_msg=f"V of {rid}, layer {layer}")


class Router:
    """What a KV-aware router learns from a manager's events: the hashes held,
    as (group_idx, medium, hash): each layer group and tier holds its own."""

    def __init__(self) -> None:
        self.held: set[tuple] = set()
        self.count = 0

    def __call__(self, event) -> None:
        self.count += 1
        if isinstance(event, BlockStored):
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            parent = event.parent_block_hash
            # The chain is checkable: each hash is its parent's and its ids'.
            chain = parent
            for i, key in enumerate(event.block_hashes):
                ids = np.array(event.token_ids[i * PAGE : (i + 1) * PAGE], np.int64)
                if chain is not None:
                    assert key == page_hash(chain, ids)
                where = (event.group_idx, event.medium, key)
                assert where not in self.held
                self.held.add(where)
                chain = key
        elif isinstance(event, BlockRemoved):
            removed = {(event.group_idx, event.medium, key) for key in event.block_hashes}
            assert removed <= self.held
            self.held -= removed
        else:
            assert isinstance(event, AllBlocksCleared)
            self.held.clear()

    @staticmethod
    def expected(manager: PagedKVCacheManager) -> set[tuple]:
        """What the router must hold: every group's pool and host-tier keys."""
        held = set()
        for tier in manager.page_pools + manager.host_page_pools:
            if tier is not None:
                held |= {(tier.group_idx, tier.medium, key) for key in tier.page_of_hash}
        return held


def prefilled(manager: PagedKVCacheManager, rid, tokens: list[int], hashed: bool = True) -> int:
    """add + reserve + append of a whole prompt; returns the cached tokens."""
    cached = manager.add(rid, tokens if hashed else None)
    history = tokens[:cached]
    manager.reserve([rid], len(tokens) - cached, [tokens[cached:]] if hashed else None)
    append_tokens(manager, [rid], [tokens[cached:]], [history])
    return cached


def cached_prompt(manager: PagedKVCacheManager, rid, prompt: list[int]) -> None:
    manager.add(rid, prompt)
    manager.reserve([rid], len(prompt) - manager.seq_len(rid))
    manager.release(rid)
