"""The page tables of live requests over a page pool: allocation, prefix
caching, copy-on-write forks, and the batch metadata the kernels take.

FlashInfer leaves page allocation to its caller; :class:`PagedKVCacheManager`
is that caller's half. It hands out page ids that name the same slot in every
layer's pool, so one page table serves the whole model.

The manager is the top of three layers (as vLLM's ``KVCacheManager`` sits on
its ``BlockPool``):

- :class:`pagedkv.cache.page_pool.PagePool`: page ids, refcounts, the free and
  evictable lists, the prefix-hash table, pins and KV events; no tensors.
- :class:`pagedkv.cache.page_tensors.PageTensors`: every layer's pool and the
  copy-on-write page copies.
- :class:`PagedKVCacheManager` (here): the requests: their page tables
  (request_pages.py), prefix hashes and reservations, per layer group
  (layer_groups.py), and the batch metadata (batch_metadata.py); its
  consistency check is validation.py, its host-tier plans offload.py.

A step of an engine::

    m = PagedKVCacheManager(num_pages, page_size, num_kv_heads, head_dim, num_layers)
    cached = m.add("a", tokens=prompt)            # leading tokens already cached
    m.reserve(["a"], len(prompt) - cached, tokens=[prompt[cached:]])
    meta = m.metadata(["a"])                      # the batch after the append
    for layer, pool in enumerate(m.pools):
        pagedkv.append_paged_kv_cache(k[layer], v[layer], meta.batch_indices,
            meta.positions, pool, meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len)
    wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, ...)

Pages are shared read-only in two ways, both refcounted. Prefix caching: a
full page whose token ids are known is keyed by a chained hash (its parent
page's key and its own ids); add() reuses the cached pages a prompt starts
with, and a page no request owns keeps its key until an allocation evicts it
(by default least recently released first, a prompt's tail before its head;
see pagedkv.cache.eviction) unless pin() keeps it; copy_partial_hit() then
copies the first slots of a cached page that the prompt's next ids match
only in part. A salt given to add() enters the first page's key, so tenants
never share pages; subscribe() reports cached and evicted pages as vLLM's KV
events (pagedkv.cache.kv_events). Forks: a
child shares all its parent's pages; reserve() copies a shared, partially
filled last page (pagedkv.copy_pages, every layer) before the first write
into it. Writes only ever go to a request's partial last page or new pages.

Reserved tokens count as written from the moment reserve() returns (their
pages may serve a later prefix hit): the caller appends them before it runs
attention over any request that could read them.

Layer groups (``layer_groups=[(layers, window), ...]``): each group has its
own page pool and page tables, and a group with a sliding window gives back
the pages no later query can see (see :meth:`PagedKVCacheManager.metadata`
for the placeholder page that keeps their slots). A host tier
(``offload=host_pages``) keeps copies of the cached pages the pool evicts and
copies them back on a prefix hit (see the class docstring).

Not thread-safe: one scheduler thread owns a manager.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._checks import INT64_MAX, check_int
from .._ops.kernels import debug_enabled
from .._ops.tensors import Array
from .batch_metadata import PAD_PAGE, BatchMetadata
from .eviction import EvictionPolicy
from .kv_events import (
    AllBlocksCleared,
    EventHub,
    KVCacheEvent,
)
from .layer_groups import (
    LayerGroup,
    PagePoolOptions,
    PoolGeometry,
    make_group,
    parse_layer_groups,
    per_group,
)
from .offload import OffloadPlan
from .page_pool import (
    ROOT_HASH,
    CacheStateError,
    OutOfPagesError,
    PagePool,
    chain_keys,
    page_hash,
    salt_root,
)
from .page_tensors import POOL_DTYPES
from .request_pages import RequestPages
from .validation import validate_manager

__all__ = [
    "PAD_PAGE",
    "POOL_DTYPES",
    "ROOT_HASH",
    "BatchMetadata",
    "CacheStateError",
    "CacheStats",
    "OutOfPagesError",
    "PagedKVCacheManager",
    "page_hash",
    "salt_root",
]


@dataclass
class CacheStats:
    """Counters since the manager was made.

    prefix_hits / prefix_misses count full pages of the prompts given to add():
    a hit is served from the cache, a miss is a full page the lookup did not
    find (the lookup stops at the first miss, so every later full page misses
    too). A prompt's partial last page is never looked up.
    """

    prefix_hits: int = 0
    prefix_misses: int = 0
    evictions: int = 0
    """Cached pages (refcount 0) reclaimed for new allocations."""
    cow_copies: int = 0
    """Shared pages copied on write (once per layer group, however many layers)."""
    partial_hit_tokens: int = 0
    """Tokens copy_partial_hit() served from cached pages that matched in part."""
    offloads: int = 0
    """Evicted pages copied to the host tier (once per layer group)."""
    reloads: int = 0
    """Pages of prefix hits copied back from the host tier (once per layer group)."""


class PagedKVCacheManager:
    """The page tables of the live requests over a page pool for every layer.

    Parameters
    ----------
    num_pages : int or sequence of int
        Pages in each layer's pool (one count per layer group, or one for all).
    page_size : int
        Tokens per page.
    num_kv_heads, head_dim : int
        The pools' geometry.
    num_layers : int
        Pools, one per layer; a page id names the same slot in each pool of
        a layer group.
    dtype : str or dtype
        "float32", "float16", "bfloat16", "float8_e4m3fn" (torch pools) or
        "int8" (CPU only), or a torch / NumPy / MAX dtype.
    kv_layout : str
        "NHD" pools are [num_pages, 2, page_size, num_kv_heads, head_dim],
        "HND" pools [num_pages, 2, num_kv_heads, page_size, head_dim]:
        FlashInfer's one-tensor form, ready for append_paged_kv_cache and the
        decode wrapper. An int8 pool's last axis is head_dim + 4: each page
        holds its rows' codes, then their float32 scales.
    device : str
        "cpu", or "cuda[:i]" / "gpu[:i]" for torch pools on that GPU
        (copy-on-write copies then run there).
    use_torch : bool
        ``pools[layer]`` is a NumPy array, or a torch tensor for bfloat16
        (NumPy has none) or when use_torch is set. Host pools lie on 2 MiB
        pages (`pagedkv.runtime.huge_page_zeros`). The page tables and all
        metadata stay in host memory, as plan() wants them.
    eviction : str or EvictionPolicy or sequence of EvictionPolicy
        Which cached page an allocation reclaims first: "lru" (least
        recently released, the default), "lfu" (fewest prefix hits, then
        least recently released) or an :class:`pagedkv.cache.eviction.EvictionPolicy`
        (one per layer group).
    max_pinned_pages : int, optional
        The most pages pin() may hold in each group (default num_pages // 2).
    layer_groups : list of (layers, window), optional
        Layer groups, each a sequence of layer indices and a sliding window
        (an int: a query at position p sees the keys p - window + 1 .. p,
        FlashInfer's ``window_left = window - 1``) or None (full attention);
        every layer in exactly one group. Each group has its own page pool,
        page tables, prefix cache and (with offload) host tier. Default: one
        full-attention group of every layer, as before groups existed.
    offload : int or sequence of int
        Pages of the host tier in each group (one count per group, or one for
        all); 0, the default, keeps none. Cached pages the pool evicts are
        copied there (pinned host memory when the pools are on a GPU; host
        memory as well on a CPU-only machine, where the pool itself is the
        bounded hot tier) and copied back on a prefix hit.

    Attributes
    ----------
    pools : list of arrays
        One pool per layer, written in place by the kernels.
    host_pools : list of arrays
        With offload, the host tier's pool of each layer (else empty).
    page_pool : PagePool
        Layer group 0's page ids, refcounts, free and evictable pages,
        prefix-hash table, pins and events (read it; change it through the
        manager); ``page_pools[g]`` and ``host_page_pools[g]`` for each group.
    page_tensors : PageTensors
        Group 0's pools and their page copies (``group_tensors[g]``).
    layer_groups : list of (tuple of int, int or None)
        The groups' layers and windows.
    stats : CacheStats
        Counters since the manager was made.

    Notes
    -----
    Request ids are any hashable values. Every call checks its arguments and
    the pool's capacity before changing anything; a call that raises leaves
    the manager as it was (pools included) and emits no event.

    NOTE: in each layer group every page is in exactly one of four states:
    unused (on the free list, no hash), cached (hash, no owner, not pinned:
    the policy's evictable set), pinned (hash, may or may not have owners,
    never evicted) or owned (refcount > 0). A page's refcount is the number of
    page tables holding it plus the requests that set it aside
    (reserve(num_steps=k)); a page with a hash is full; a shared page is
    written by no one (a writer copies it first). Host-tier pages are unused
    or cached, never owned. validate() checks all of this.

    Sliding windows: every group's table has a slot for every page of the
    sequence; a window group puts its null page (``null_pages[g]``, one zero
    page past the pool's, never written) in the slots of the pages it has
    given back, so the wrappers see whole sequences and their
    ``window_left`` (``metadata(...).window_left``) masks those slots. At
    the end of each reserve() a window group gives back the request's pages
    that lie wholly before ``s - window + 1``, s the request's length before
    that call: no query of that step or later sees them, and the previous
    step's attention has run. Prefix hits take, in a window group, only the
    pages the hit's window needs; a hit is as long as every group can serve.

    Host tier: a page the pool evicts keeps its key, token ids and parent in
    the host tier (one key across tiers; a key may be in both), and a prefix
    hit whose page is only there claims a pool page and copies it back. The
    host tier evicts least recently used first; its events' medium is
    "CPU" (or "CPU_OFFLOAD" when the pool itself is in host memory). Copies
    to and from a GPU are asynchronous on torch's current stream, which
    orders them against the kernels (see PageTensors.copy_to).
    """

    def __init__(
        self,
        num_pages: int | Sequence[int],
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        dtype: object = "float32",
        kv_layout: str = "NHD",
        device: object = "cpu",
        use_torch: bool = False,
        eviction: str | EvictionPolicy | Sequence[EvictionPolicy] = "lru",
        max_pinned_pages: int | None = None,
        layer_groups: Sequence[tuple[Sequence[int], int | None]] | None = None,
        offload: int | Sequence[int] = 0,
    ) -> None:
        num_layers = check_int("num_layers", num_layers, 1)
        specs = parse_layer_groups(layer_groups, num_layers)
        count = len(specs)
        page_counts = per_group("num_pages", num_pages, count, 1)
        host_counts = per_group("offload", offload, count, 0)
        if isinstance(eviction, (str, EvictionPolicy)):
            if count > 1 and not isinstance(eviction, str):
                raise ValueError("eviction: give one EvictionPolicy object per layer group")
            policies = [eviction] * count
        else:
            policies = list(eviction)
            if len(policies) != count:
                raise ValueError(f"eviction: give one policy per layer group ({count})")
        self._events = EventHub()
        geometry = PoolGeometry(
            page_size, num_kv_heads, head_dim, dtype, kv_layout, device, use_torch
        )
        self._groups: list[LayerGroup] = [
            make_group(
                g,
                spec,
                pages,
                host_pages,
                geometry,
                PagePoolOptions(policy, max_pinned_pages, self._events, layer_groups is not None),
            )
            for g, (spec, pages, host_pages, policy) in enumerate(
                zip(specs, page_counts, host_counts, policies, strict=True)
            )
        ]
        first = self._groups[0]
        self.page_tensors = first.tensors
        self.group_tensors = [g.tensors for g in self._groups]
        self.page_pool = first.pool
        self.page_pools = [g.pool for g in self._groups]
        self.host_page_pools = [g.host for g in self._groups]
        self.layer_groups = specs
        self.num_pages = page_counts[0] if len(set(page_counts)) == 1 else tuple(page_counts)
        """Pages in each group's pool (a tuple when the groups differ)."""
        self.page_size = first.tensors.page_size
        self.num_kv_heads = first.tensors.num_kv_heads
        self.head_dim = first.tensors.head_dim
        self.num_layers = int(num_layers)
        self.dtype = first.tensors.dtype
        self.kv_layout = first.tensors.kv_layout
        self.null_pages = tuple(g.null_page for g in self._groups)
        """Each group's null page (PAD_PAGE for a full-attention group)."""
        self.group_of_layer = tuple(
            next(g.index for g in self._groups if layer in g.layers)
            for layer in range(self.num_layers)
        )
        """The layer group of each layer."""
        self.pools: list[Array] = [
            self._groups[g].tensors.pools[self._groups[g].layers.index(layer)]
            for layer, g in enumerate(self.group_of_layer)
        ]
        """One pool per layer, written in place by the kernels."""
        self.host_pools: list[Array] = [
            self._groups[g].host_tensors.pools[self._groups[g].layers.index(layer)]
            for layer, g in enumerate(self.group_of_layer)
            if self._groups[g].host_tensors is not None
        ]
        """With offload, the host tier's pool of each layer (else empty)."""
        self._windows = [g for g in self._groups if g.window is not None]
        self._offload = any(g.host is not None for g in self._groups)
        # One group, no window, no host tier: the paths of a plain manager.
        self._simple = count == 1 and not self._windows and not self._offload
        self._requests: dict[Hashable, RequestPages] = {}
        self._generation = 0
        self.stats = CacheStats()

    @property
    def max_pinned_pages(self) -> int:
        """The most pages pin() may hold (in each layer group)."""
        return self.page_pool.max_pinned_pages

    @max_pinned_pages.setter
    def max_pinned_pages(self, value: int) -> None:
        for group in self._groups:
            group.pool.max_pinned_pages = value

    # The pool's state under the names earlier versions kept it (tests
    # corrupt it on purpose to exercise validate()).

    @property
    def _refcount(self) -> np.ndarray:
        return self.page_pool.refcount

    @property
    def _free(self) -> list[int]:
        return self.page_pool.free

    # ----------------------------------------------------------- inspection

    def _tightest(self) -> PagePool:
        """The pool with the fewest free pages: a reservation takes as many
        pages in every group, so this one runs out first."""
        if len(self._groups) == 1:
            return self.page_pool
        return min(self.page_pools, key=lambda pool: pool.num_free)

    @property
    def num_free_pages(self) -> int:
        """Pages a reservation can take: unused ones plus cached, evictable
        ones (with layer groups, in the group with the fewest; the other
        counts are of that group too, and page_pools[g] has each group's)."""
        return self._tightest().num_free

    @property
    def num_cached_pages(self) -> int:
        """Pages no request owns that keep their contents for prefix hits and
        that an allocation may evict (pinned ones are not counted here)."""
        return len(self._tightest().evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages owned by at least one live request."""
        return self._tightest().num_used

    @property
    def num_pinned_pages(self) -> int:
        """Pages pin() keeps cached (owned by requests or not)."""
        return len(self._tightest().pinned)

    @property
    def request_ids(self) -> list[Hashable]:
        """The live requests' ids, in the order they were added."""
        return list(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def seq_len(self, request_id: Hashable) -> int:
        """Tokens of the request, reserved ones included."""
        return self._request("request_id", request_id).seq_len

    def pages(self, request_id: Hashable, group: int | None = None) -> np.ndarray:
        """The request's page ids in sequence order ([pages] int32, a copy),
        in layer group `group` (needed with several groups): a window group's
        given-back slots hold its null page."""
        g = self._group_index(group)
        return self._request("request_id", request_id).page_list(g).copy()

    def ahead_pages(self, request_id: Hashable, group: int | None = None) -> list[int]:
        """Pages reserve(num_steps=k) set aside for the request's later steps
        (owned by it, not yet in its page table), in layer group `group`."""
        g = self._group_index(group)
        return list(self._request("request_id", request_id).ahead[g])

    def refcounts(self, group: int | None = None) -> np.ndarray:
        """Owners of each page ([num_pages] int32, a copy), in layer group `group`."""
        return self._groups[self._group_index(group)].pool.refcount.copy()

    def pages_needed(
        self, request_ids: Sequence[Hashable], num_new_tokens: int | Sequence[int] = 1
    ) -> int:
        """Pages that reserve(request_ids, num_new_tokens) would take from
        the pool of the group that needs most: new pages past each
        request's last (less its set-aside ones) and copies of the shared
        partial last pages it writes (a fork's; when every owner of such a
        page writes, the last keeps the original). Changes nothing:
        reserve() succeeds when this is at most ``num_free_pages``.

        Examples
        --------
        >>> m = PagedKVCacheManager(8, 4, 1, 8)
        >>> _ = m.add("a"); m.reserve(["a"], 6); m.fork("a", "b")
        >>> m.pages_needed(["a"]), m.pages_needed(["a", "b"])
        (1, 1)
        """
        requests = self._batch(request_ids)
        counts = self._counts("num_new_tokens", num_new_tokens, len(requests)).tolist()
        return int(max(need for need, _ in self._claim_sizes(requests, counts, 1)))

    def snapshot(self) -> dict[str, Any]:
        """A deep copy of the bookkeeping (not the pools): equal snapshots mean
        equal states. For tests and debugging."""
        return {
            "requests": {
                rid: (
                    r.pages[:, : r.num_pages].tolist(),
                    list(r.first),
                    r.seq_len,
                    r.reserved,
                    r.generation,
                    r.chain,
                    r.tail.tolist(),
                    r.pending.tolist(),
                    [list(a) for a in r.ahead],
                )
                for rid, r in self._requests.items()
            },
            **self.page_pool.snapshot(),
            "groups": [
                (g.pool.snapshot(), None if g.host is None else g.host.snapshot())
                for g in self._groups
            ],
            "generation": self._generation,
            "stats": CacheStats(**vars(self.stats)),
        }

    # ------------------------------------------------------------- requests

    def add(
        self,
        request_id: Hashable,
        tokens: Sequence[int] | np.ndarray | None = None,
        salt: str | bytes | None = None,
    ) -> int:
        """Starts a request; returns how many leading tokens of `tokens` (its
        prompt ids, 1-D ints) were served from the prefix cache, a multiple of
        page_size. Those tokens are the request's first seq_len(request_id);
        the caller reserves and appends the rest. Allocates no pages, except
        in a host tier's manager, where the hit's pages found only in the host
        tier are copied back into pool pages (as many as the pools have free:
        a hit stops short rather than fail).

        The rest of the prompt is remembered: reserve() calls that are not
        given token ids take them from it, so the pages they fill are cached.

        salt: a tenant's key (str or bytes). It enters the first page's hash,
        so requests with different salts never share a cached page (a shared
        prefix is a timing side channel between tenants); equal salts share
        as usual, and None is the unsalted cache of earlier versions.

        With layer groups, a hit of h pages needs pages 0 .. h - 1 in every
        full-attention group and, in a window group, the pages holding the
        last `window` tokens before position h * page_size (the window of the
        next query); the earlier slots get the group's null page.

        Examples
        --------
        >>> m = PagedKVCacheManager(8, 4, 1, 8)
        >>> m.add("a", [1, 2, 3, 4, 5], salt="tenant-1")
        0
        >>> m.reserve(["a"], 5)  # the ids come from add(): page 0 is cached
        >>> m.add("b", [1, 2, 3, 4, 9], salt="tenant-1")
        4
        >>> m.add("c", [1, 2, 3, 4, 9], salt="tenant-2")
        0
        """
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already live")
        prompt = None if tokens is None else _token_ids("tokens", tokens)
        root = salt_root(salt)
        request = RequestPages(len(self._groups))
        request.chain = root
        if prompt is not None:
            if self._simple:
                hits, chain = self.page_pool.lookup(prompt, root)
                if hits:
                    self.page_pool.reuse(hits)
                    request.push([hits])
                count = len(hits)
            else:
                count, chain = self._take_hit(request, prompt, root)
            self.stats.prefix_hits += count
            self.stats.prefix_misses += len(prompt) // self.page_size - count
            if count:
                request.seq_len = count * self.page_size
                request.chain = chain
            request.pending = prompt[request.seq_len :].copy()
        self._requests[request_id] = request
        self._after_mutation()
        return request.seq_len

    def cached_prefix_length(
        self,
        tokens: Sequence[int] | np.ndarray,
        salt: str | bytes | None = None,
        partial: bool = False,
    ) -> int:
        """How many leading tokens of `tokens` add() would serve from the
        prefix cache now (pool or host tier), a multiple of page_size; with
        `partial`, plus those copy_partial_hit() would then copy, a free page
        permitting. Changes nothing.

        Examples
        --------
        >>> m = PagedKVCacheManager(8, 4, 1, 8)
        >>> _ = m.add("a", [1, 2, 3, 4, 5, 6, 7, 8]); m.reserve(["a"], 8)
        >>> m.cached_prefix_length([1, 2, 3, 4, 9]), m.cached_prefix_length([7, 2, 3, 4])
        (4, 0)
        >>> m.cached_prefix_length([1, 2, 3, 4, 5, 6, 9, 9], partial=True)  # 5, 6 in part
        6
        """
        prompt = _token_ids("tokens", tokens)
        root = salt_root(salt)
        size = self.page_size
        if self._simple:
            hits, chain = self.page_pool.lookup(prompt, root)
            count = len(hits)
        else:
            count, _, keys = self._find_hit(prompt, root)
            chain = keys[count - 1] if count else root
        if not partial:
            return count * size
        start = count * size
        wanted = prompt[start : start + size - 1]
        return start + self.page_pool.partial_match(chain, wanted)[1]

    def copy_partial_hit(self, request_id: Hashable) -> int:
        """Extends a request by the next ids of its prompt that a cached page
        holds in part; returns how many (0 .. page_size - 1).

        A prefix hit ends where a prompt's page differs from every cached one,
        though a cached page chained on the same prefix may hold the page's
        first k ids (a system prompt ending mid-page, its questions after it).
        This copies that page into a new one of the request, every layer, so
        that the request holds those k tokens and prefills only the rest; its
        own appends then overwrite the copy's later slots. Among the pages
        chained on the request's last one, the 64 most recently cached are
        looked at. Call it after add() (and a connector's pages) or between
        reserves; it serves 0 tokens where the request's length is not a
        whole number of pages, its prompt ids are unknown or used up, it has
        pages set aside, no page matches, a layer group's pool lacks the
        page, or a pool has no page to spare.

        The copy is made now, so every token that reserve() counted before
        this call must already have been appended: a scheduler finds a step's
        prefix hits before it reserves the step's tokens.

        Examples
        --------
        >>> m = PagedKVCacheManager(8, 4, 1, 8)
        >>> _ = m.add("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]); m.reserve(["a"], 9)
        >>> m.add("b", [1, 2, 3, 4, 5, 6, 0, 0])  # page 0 is cached
        4
        >>> m.copy_partial_hit("b"), m.seq_len("b")  # 5 and 6 from a's page 1
        (2, 6)
        """
        request = self._request("request_id", request_id)
        size = self.page_size
        if request.seq_len % size or request.chain is None or request.ahead[0]:
            return 0
        wanted = request.pending[: size - 1]
        page, k = self.page_pool.partial_match(request.chain, wanted)  # (-1, 0) if none
        if not k:
            return 0
        key = self.page_pool.hash_of_page[page]
        sources = [group.pool.page_of_hash.get(key, -1) for group in self._groups]
        if min(sources) < 0:
            return 0
        plans = []
        for group, source in zip(self._groups, sources, strict=True):
            pool = group.pool
            if pool.num_free - (source in pool.evictable) < 1:
                return 0
            fresh = pool.peek_except(1, [source])
            offload = self._plan_offload(group, fresh, ()) if group.host is not None else None
            plans.append((fresh, offload))
        # Offloads first: they read the evicted page the copy overwrites.
        for group, source, (fresh, offload) in zip(self._groups, sources, plans, strict=True):
            if offload is not None:
                group.tensors.copy_to(group.host_tensors, offload.pages, offload.dests)
            group.tensors.copy_pages([source], fresh)
        # Nothing below can fail: commit.
        for group, source, (fresh, offload) in zip(self._groups, sources, plans, strict=True):
            self.stats.evictions += group.pool.claim(fresh)
            if offload is not None:
                self._commit_offload(group, offload)
            if source in group.pool.evictable:
                group.pool.touch([source])
        request.push([fresh for fresh, _ in plans])
        request.seq_len += k
        request.tail = wanted[:k].copy()
        request.pending = request.pending[k:]
        self.stats.partial_hit_tokens += k
        self._after_mutation()
        return k

    def reserve(
        self,
        request_ids: Sequence[Hashable],
        num_new_tokens: int | Sequence[int] | np.ndarray,
        tokens: Any = None,
        num_steps: int = 1,
    ) -> None:
        """Allocates the pages that appending num_new_tokens (an int for all, or
        one per request) to each listed request needs, all or nothing, and
        counts those tokens in the requests' lengths.

        num_steps: k > 1 also sets aside, all or nothing, the pages that k - 1
        further steps of the same num_new_tokens will need (MAX's multistep
        reserve): those later reserve() calls take them without touching the
        pool, so they cannot run out of pages. Only this step's tokens are
        counted; release() returns unused set-aside pages.

        A request whose partial last page is shared (a fork) gets a private
        copy of it first (pagedkv.copy_pages on every layer's pool). tokens:
        the new token ids, for prefix-caching the pages they fill: one entry
        per request (a sequence of its num_new_tokens ids, or None), or all of
        them concatenated in request order. A request without them takes its
        ids from the prompt add() remembered while it lasts; past it, the
        request's later pages are not cached.

        With layer groups, every group allocates; a window group then gives
        back the listed requests' pages that no query of this step or later
        sees (see the class docstring). Evicted cached pages go to the host
        tier, if there is one.

        Raises OutOfPagesError, with nothing changed, when a pool is short.

        Examples
        --------
        >>> m = PagedKVCacheManager(8, 4, 1, 8)
        >>> _ = m.add("a"); m.reserve(["a"], 4)
        >>> m.reserve(["a"], 1, num_steps=8)  # pages for 8 decode steps
        >>> m.seq_len("a"), len(m.pages("a")), m.num_free_pages
        (5, 2, 5)
        >>> for _ in range(7):
        ...     m.reserve(["a"], 1)  # no pool traffic
        >>> m.seq_len("a"), m.num_free_pages
        (12, 5)
        """
        requests = self._batch(request_ids)
        counts = self._counts("num_new_tokens", num_new_tokens, len(requests))
        new_tokens = _split_tokens(tokens, counts)
        num_steps = check_int("num_steps", num_steps, 1)
        count_list = counts.tolist()
        claims = self._plan_claims(
            self._room_needed(requests, count_list, num_steps), requests, count_list
        )
        self._commit_claims(claims)
        self._grow_tables(requests, count_list, new_tokens, claims, num_steps)
        self._after_mutation()

    def _room_needed(
        self, requests: list[RequestPages], count_list: list[int], num_steps: int
    ) -> list[tuple[int, dict[int, int]]]:
        """`_claim_sizes`, after making room for them in each group
        (eviction), or raises OutOfPagesError before anything changes."""
        needs = self._claim_sizes(requests, count_list, num_steps)
        for group, (need, _) in zip(self._groups, needs, strict=True):
            group.pool.ensure_room(need)
        return needs

    def _claim_sizes(
        self, requests: list[RequestPages], count_list: list[int], num_steps: int
    ) -> list[tuple[int, dict[int, int]]]:
        """Per group, the pages a reservation takes (new pages and copies of
        shared last pages about to be written) and the writers of each
        shared page. Changes nothing."""
        size = self.page_size
        groups = self._groups
        # Every group's table grows by as many pages; copies differ by group.
        # (Group 0's shared last pages are counted in the same pass.)
        grow_all = 0
        refcount = groups[0].pool.refcount
        writers: dict[int, int] = {}
        for request, n in zip(requests, count_list, strict=True):
            if n == 0:
                continue
            grow_all += self._new_pages(request, n * num_steps)
            if request.seq_len % size:
                last = int(request.pages[0, request.num_pages - 1])
                if refcount[last] > 1:
                    writers[last] = writers.get(last, 0) + 1
        needs: list[tuple[int, dict[int, int]]] = []
        for group in groups:
            refcount = group.pool.refcount
            g = group.index
            if g:
                writers = {}
                for request, n in zip(requests, count_list, strict=True):
                    if n and request.seq_len % size:
                        last = int(request.pages[g, request.num_pages - 1])
                        if refcount[last] > 1:
                            writers[last] = writers.get(last, 0) + 1
            # Every writer into a shared page copies it, but when all its
            # owners write, the last one keeps the original.
            need = grow_all + sum(c - (c == refcount[p]) for p, c in writers.items())
            needs.append((need, writers))
        return needs

    def _plan_claims(
        self, needs: list[tuple[int, dict[int, int]]], requests, count_list: list[int]
    ) -> list[tuple[list[int], OffloadPlan | None, list[tuple[RequestPages, int, int]]]]:
        """Per group, the pages the reservation will claim, the host tier's
        plan for the keyed pages it evicts, and the copy-on-write copies
        (request, shared page, its copy)."""
        size = self.page_size
        # NOTE: the next claim(need) takes exactly these pages, copies first.
        claims: list[tuple[list[int], OffloadPlan | None, list[tuple[RequestPages, int, int]]]] = []
        for group, (need, writers) in zip(self._groups, needs, strict=True):
            fresh = group.pool.peek(need)
            offload = self._plan_offload(group, fresh, ()) if group.host is not None else None
            copies: list[tuple[RequestPages, int, int]] = []
            if writers:
                g = group.index
                owners = {p: int(group.pool.refcount[p]) for p in writers}
                spare = iter(fresh)
                for request, n in zip(requests, count_list, strict=True):
                    if n == 0 or not request.seq_len % size:
                        continue
                    last = int(request.pages[g, request.num_pages - 1])
                    if owners.get(last, 1) > 1:
                        owners[last] -= 1
                        copies.append((request, last, next(spare)))
            claims.append((fresh, offload, copies))
        return claims

    def _commit_claims(self, claims) -> None:
        """Copies evicted pages to the host tier and shared pages to their
        copies, then claims the pages: nothing after the copies can fail."""
        # Offloads first: they read the evicted pages the copies overwrite.
        for group, (_, offload, copies) in zip(self._groups, claims, strict=True):
            if offload is not None:
                group.tensors.copy_to(group.host_tensors, offload.pages, offload.dests)
            if copies:
                group.tensors.copy_pages([c[1] for c in copies], [c[2] for c in copies])

        # Nothing below can fail: commit. Every claimed page gets one owner.
        for group, (fresh, offload, copies) in zip(self._groups, claims, strict=True):
            self.stats.evictions += group.pool.claim(fresh)
            if offload is not None:
                self._commit_offload(group, offload)
            g = group.index
            for request, _, new in copies:
                request.pages[g, request.num_pages - 1] = new
            if copies:
                group.pool.drop_shared([old for _, old, _ in copies])
            self.stats.cow_copies += len(copies)

    def _grow_tables(self, requests, count_list, new_tokens, claims, num_steps: int) -> None:
        """Pushes the claimed pages onto each request's tables (set-aside
        pages first), fills its prefix hashes and gives back what a window
        no longer shows."""
        size = self.page_size
        taken = [len(c[2]) for c in claims]
        self._generation += 1
        windows = bool(self._windows)
        for request, n, ids in zip(requests, count_list, new_tokens, strict=True):
            request.reserved = n
            request.generation = self._generation
            if n == 0:
                continue
            start = request.seq_len
            grow = -(-(start + n) // size) - request.num_pages
            if num_steps == 1 and not request.ahead[0]:
                # The common decode step: pages for this step only.
                if grow:
                    request.push([c[0][t : t + grow] for c, t in zip(claims, taken, strict=True)])
                    taken = [t + grow for t in taken]
            else:
                extra = self._new_pages(request, n * num_steps)
                columns = []
                for g, (fresh, _, _) in enumerate(claims):
                    # Set-aside pages first (allocated earlier), then this call's.
                    pages = request.ahead[g] + fresh[taken[g] : taken[g] + extra]
                    taken[g] += extra
                    columns.append(pages[:grow])
                    request.ahead[g] = pages[grow:]
                if grow:
                    request.push(columns)
            self._fill(request, n, ids)
            if windows:
                self._drop_outside_windows(request, start)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Starts child_id as a copy of parent_id that shares all its pages.

        Allocates nothing: the first reserve() that writes into a shared,
        partially filled last page copies that page (copy-on-write).
        """
        parent = self._request("parent_id", parent_id)
        if child_id in self._requests:
            raise ValueError(f"child_id {child_id!r} is already live")
        child = parent.copy()
        for group in self._groups:
            group.pool.share(child.live_pages(group.index))
        self._requests[child_id] = child
        self._after_mutation()

    def release(self, request_id: Hashable) -> None:
        """Ends a request. Its pages that no one else owns become free; those
        with a prefix hash stay cached until the pool needs them (the eviction
        policy picks which go first), pinned ones until unpinned."""
        request = self._request("request_id", request_id)
        del self._requests[request_id]
        for group in self._groups:
            group.pool.release(request.ahead[group.index])
            group.pool.release(request.live_pages(group.index))
        self._after_mutation()

    # -------------------------------------------------- pins, events, reset

    def forget(
        self,
        request_id: Hashable,
        start: int,
        stop: int | None = None,
        groups: Sequence[int] | None = None,
    ) -> None:
        """Drops the prefix keys of the request's pages holding tokens `start`
        (a multiple of page_size) up to `stop` (default: its end), in the
        layer groups named (default: all): their contents are not what the
        keys promise (a transfer into them failed, or skipped them), so no
        prefix hit may serve them. The pages stay the request's. Forgetting
        to the end in every group also stops its later pages from being
        cached. Emits BlockRemoved.

        Examples
        --------
        >>> m = PagedKVCacheManager(8, 4, 1, 8)
        >>> _ = m.add("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]); m.reserve(["a"], 9)
        >>> m.forget("a", 4); m.release("a")
        >>> m.cached_prefix_length([1, 2, 3, 4, 5, 6, 7, 8, 9])
        4
        """
        request = self._request("request_id", request_id)
        start = check_int("start", start, 0, INT64_MAX)
        if start % self.page_size:
            raise ValueError(f"start must be a multiple of page_size, got {start}")
        if stop is not None:
            stop = check_int("stop", stop, start, INT64_MAX)
        first = start // self.page_size
        last = request.num_pages if stop is None else -(-stop // self.page_size)
        chosen = [self._groups[self._group_index(g)] for g in groups] if groups else self._groups
        for group in chosen:
            group.pool.forget(request.pages[group.index, first:last].tolist())
        if stop is None and groups is None:
            request.chain = None
        self._after_mutation()

    def pin(self, tokens: Sequence[int] | np.ndarray, salt: str | bytes | None = None) -> int:
        """Keeps the cached pages holding `tokens`' leading full pages cached
        until unpin(): no allocation evicts them. Returns the tokens pinned
        (a multiple of page_size; pages not cached yet are not pinned, so pin
        a system prompt after its first request has filled its pages).

        Raises ValueError, with nothing changed, when the pins would exceed
        max_pinned_pages. Pinning a pinned page again is a no-op (pins do not
        count). With layer groups, each group pins the pages that a prefix hit
        on `tokens` would take there (pages in the host tier are not pinned).

        Examples
        --------
        >>> m = PagedKVCacheManager(8, 4, 1, 8)
        >>> m.add("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
        0
        >>> m.reserve(["a"], 9)
        >>> m.pin([1, 2, 3, 4, 5, 6, 7, 8, 9])
        8
        >>> m.release("a"); m.num_pinned_pages, m.num_free_pages
        (2, 6)
        """
        prompt = _token_ids("tokens", tokens)
        root = salt_root(salt)
        if self._simple:
            pages, _ = self.page_pool.lookup(prompt, root)
            self.page_pool.pin(pages)
            count = len(pages)
        else:
            count, hit, _ = self._find_hit(prompt, root, reload=False)
            per_group = [hit[g.index][0] for g in self._groups]
            for group, pages in zip(self._groups, per_group, strict=True):
                group.pool.check_pin(pages)
            for group, pages in zip(self._groups, per_group, strict=True):
                group.pool.pin(pages)
        self._after_mutation()
        return count * self.page_size

    def unpin(self, tokens: Sequence[int] | np.ndarray, salt: str | bytes | None = None) -> int:
        """Undoes pin() for the pinned pages holding `tokens`' leading full
        pages; those no request owns become evictable (most recently released
        last). Returns the tokens unpinned (with layer groups, in the group
        that unpinned the most).

        Examples
        --------
        >>> m = PagedKVCacheManager(8, 4, 1, 8)
        >>> _ = m.add("a", [1, 2, 3, 4]); m.reserve(["a"], 4)
        >>> m.pin([1, 2, 3, 4]), m.unpin([1, 2, 3, 4]), m.num_pinned_pages
        (4, 4, 0)
        """
        prompt = _token_ids("tokens", tokens)
        root = salt_root(salt)
        size = self.page_size
        per_group: list[list[int]] = [[] for _ in self._groups]
        chain = root
        # A window group may lack a prompt's early pages: walk while any group has one.
        for start in range(0, len(prompt) - size + 1, size):
            chain = page_hash(chain, prompt[start : start + size])
            found = False
            for group in self._groups:
                page = group.pool.page_of_hash.get(chain)
                if page is not None:
                    per_group[group.index].append(page)
                    found = True
            if not found:
                break
        unpinned = max(
            group.pool.unpin(pages) for group, pages in zip(self._groups, per_group, strict=True)
        )
        self._after_mutation()
        return unpinned * size

    def subscribe(self, callback: Callable[[KVCacheEvent], None]) -> Callable[[], None]:
        """Calls callback(event) with every KV event (pagedkv.cache.kv_events:
        BlockStored, BlockRemoved, AllBlocksCleared in vLLM's schema) from now
        on; returns a function that unsubscribes it.

        Events come after the call that caused them has committed, in order; a
        call that raised emits none. An exception from the callback propagates
        to the caller of that call, whose effects stand. With layer groups an
        event's group_idx names its group; a host tier's events have its medium.

        Examples
        --------
        >>> m = PagedKVCacheManager(8, 4, 1, 8)
        >>> seen = []
        >>> stop = m.subscribe(seen.append)
        >>> _ = m.add("a", [1, 2, 3, 4]); m.reserve(["a"], 4)
        >>> [type(e).__name__ for e in seen], seen[0].token_ids
        (['BlockStored'], [1, 2, 3, 4])
        >>> stop()
        """
        return self.page_pool.subscribe(callback)

    def reset_prefix_cache(self) -> None:
        """Forgets every prefix hash (pins and host tiers included): cached
        pages become unused, owned pages stay with their requests but serve no
        later prefix hit. Emits AllBlocksCleared. Live requests go on caching
        the pages they fill (their keys chain on hashes no longer held: only
        their own later prompts could hit them).

        Examples
        --------
        >>> m = PagedKVCacheManager(8, 4, 1, 8)
        >>> _ = m.add("a", [1, 2, 3, 4]); m.reserve(["a"], 4); m.release("a")
        >>> m.num_cached_pages, (m.reset_prefix_cache(), m.num_cached_pages)[1]
        (1, 0)
        """
        for group in self._groups:
            group.pool.reset(emit=False)
            if group.host is not None:
                group.host.reset(emit=False)
        self._events.emit(AllBlocksCleared())
        self._after_mutation()

    # ------------------------------------------------------------- metadata

    def metadata(
        self,
        request_ids: Sequence[Hashable],
        num_new_tokens: int | Sequence[int] | np.ndarray | None = None,
        group: int | None = None,
    ) -> BatchMetadata:
        """The batch's page table and append indices (see BatchMetadata).

        num_new_tokens: tokens each request appends, its last ones (an int or
        one per request); None: what the latest reserve() call reserved for
        each request (0 for requests it did not list). 0 gives decode-only
        metadata. Only tokens that reserve() made room for may be written:
        pages before them can be shared. Changes nothing.

        group: the layer group whose page table to give (needed with several
        groups; ``group_of_layer[layer]`` names a layer's). A window group's
        table holds its null page where it gave pages back; give the wrappers
        ``window_left=meta.window_left`` so that they mask those slots.

        Examples
        --------
        >>> m = PagedKVCacheManager(8, 4, 1, 8, num_layers=2,
        ...                         layer_groups=[([0], None), ([1], 4)])
        >>> _ = m.add("a"); m.reserve(["a"], 9); m.reserve(["a"], 1)
        >>> m.metadata(["a"], group=1).kv_indices, m.metadata(["a"], group=1).window_left
        (array([8, 1, 2], dtype=int32), 3)
        """
        g = self._group_index(group)
        requests = self._batch(request_ids)
        batch = len(requests)
        seq_lens = np.fromiter((r.seq_len for r in requests), np.int64, batch)
        page_counts = np.fromiter((r.num_pages for r in requests), np.int64, batch)
        if num_new_tokens is None:
            generation = self._generation
            appended = np.fromiter(
                (r.reserved if r.generation == generation else 0 for r in requests),
                np.int64,
                batch,
            )
        else:
            appended = self._counts("num_new_tokens", num_new_tokens, batch)
            over = np.flatnonzero(appended > seq_lens)
            if over.size:
                b = int(over[0])
                raise ValueError(
                    f"num_new_tokens[{b}] = {appended[b]} exceeds the {seq_lens[b]} tokens of "
                    f"request {request_ids[b]!r}"
                )
        kv_indptr = np.zeros(batch + 1, np.int32)
        np.cumsum(page_counts, out=kv_indptr[1:])
        kv_indices = (
            np.concatenate([r.pages[g, : r.num_pages] for r in requests])
            if batch
            else np.empty(0, np.int32)
        )
        kv_last_page_len = np.where(
            page_counts > 0, seq_lens - (page_counts - 1) * self.page_size, 0
        ).astype(np.int32)
        append_indptr = np.zeros(batch + 1, np.int32)
        np.cumsum(appended, out=append_indptr[1:])
        nnz = int(append_indptr[-1])
        rows = np.arange(batch, dtype=np.int32)
        batch_indices = np.repeat(rows, appended)
        # Row j of request b sits at seq_len - appended + (j - append_indptr[b]).
        positions = np.arange(nnz, dtype=np.int32) + np.repeat(
            (seq_lens - appended - append_indptr[:-1]).astype(np.int32), appended
        )
        window = self._groups[g].window
        return BatchMetadata(
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_last_page_len=kv_last_page_len,
            seq_lens=seq_lens.astype(np.int32),
            append_indptr=append_indptr,
            batch_indices=batch_indices,
            positions=positions,
            window_left=-1 if window is None else window - 1,
        )

    # ------------------------------------------------------------- checking

    def validate(self) -> None:
        """Checks the page tables against the pools; raises CacheStateError.

        In every layer group: CSR form: indptr monotone, page ids in the pool,
        last_page_len in [1, page_size] for requests with pages (0 without).
        Ownership: each request holds ceil(seq_len / page_size) slots of
        distinct pages (a window group's given-back slots hold its null page,
        only before the window of the request's current step; a full group
        has none); refcounts equal the owners counted from the tables and the
        set-aside pages of reserve(num_steps=k) (which have no hash); a page
        with several owners sits at the same index in each and is filled alike
        in each (shared read-only: prefix-cache pages are full, a fork's
        partial page is everyone's last); a page with a prefix hash is full.
        Pool (PagePool.validate): unused, cached-evictable, pinned-unowned and
        owned pages partition the pool; pinned pages have a hash and are not
        evictable; the hash maps are mutual inverses (and the kept token ids
        follow them). Host tier: the same partition with no owner and no pin.
        """
        validate_manager(self)

    # ------------------------------------------------------------ internals

    def _after_mutation(self) -> None:
        """Every mutating call's last step, once its effects are committed."""
        if debug_enabled():
            self.validate()
        self.page_pool.flush_events()

    def _group_index(self, group: int | None) -> int:
        if group is None:
            if len(self._groups) > 1:
                raise ValueError(
                    f"group: name a layer group (0 .. {len(self._groups) - 1}); "
                    "group_of_layer[layer] gives a layer's"
                )
            return 0
        if not isinstance(group, numbers.Integral) or not 0 <= group < len(self._groups):
            raise ValueError(f"group must be in [0, {len(self._groups)}), got {group!r}")
        return int(group)

    def _request(self, name: str, request_id: Hashable) -> RequestPages:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise KeyError(f"{name} {request_id!r} is not a live request") from None

    def _batch(self, request_ids: Iterable[Hashable]) -> list[RequestPages]:
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable):
            raise TypeError(f"request_ids must be a sequence of ids, got {request_ids!r}")
        ids = list(request_ids)
        requests = [self._request("request_ids entry", rid) for rid in ids]
        if len(set(map(id, requests))) != len(requests):
            raise ValueError(f"request_ids lists a request twice: {ids!r}")
        return requests

    @staticmethod
    def _counts(name: str, value: Any, batch: int) -> np.ndarray:
        """num_new_tokens as [batch] int64 counts >= 0."""
        if isinstance(value, numbers.Integral):
            counts = np.full(batch, int(value), np.int64)
        else:
            counts = np.asarray(value)
            if counts.shape != (batch,) or (batch and counts.dtype.kind not in "iu"):
                raise ValueError(f"{name} must be an int or {batch} ints, got {value!r}")
            counts = counts.astype(np.int64)
        if (counts < 0).any():
            raise ValueError(f"{name} must be >= 0, got {value!r}")
        return counts

    def _lookup_prefix(self, prompt: np.ndarray, root: bytes) -> tuple[list[int], bytes]:
        """The cached pages that hold the prompt's leading full pages (the
        first chained on root), and the hash of the last of them (group 0)."""
        return self.page_pool.lookup(prompt, root)

    def _find_hit(
        self, prompt: np.ndarray, root: bytes, reload: bool = True
    ) -> tuple[int, list[tuple[list[int], list[tuple[int, int, bytes]], int]], list[bytes]]:
        """The longest prefix hit every group can serve: its length h in
        pages; per group, (pool pages reused, (slot, host page, key) of each
        page to copy back, first slot); the keys of the prompt's pages looked
        at. reload=False: pool pages only.
        A group serves h when it holds, in the pool or its host tier, the
        pages from its first_slot(h * page_size) to h - 1, and its pool has
        room for the copies back (the reused pages no longer free). Changes
        nothing."""
        size = self.page_size
        groups = self._groups
        keys: list[bytes] = []
        pool_page: list[list[int]] = [[] for _ in groups]
        host_page: list[list[int]] = [[] for _ in groups]
        chain = root
        for start in range(0, len(prompt) - size + 1, size):
            key = page_hash(chain, prompt[start : start + size])
            found = []
            for group in groups:
                p = group.pool.page_of_hash.get(key, -1)
                h = group.host.page_of_hash.get(key, -1) if reload and group.host else -1
                found.append((p, h))
                if group.window is None and p < 0 and h < 0:
                    break
            else:
                for group, (p, h) in zip(groups, found, strict=True):
                    pool_page[group.index].append(p)
                    host_page[group.index].append(h)
                keys.append(key)
                chain = key
                continue
            break  # a full-attention group misses: no longer hit can be served
        n = len(keys)
        # Per group, running counts over the slots: missing in both tiers,
        # to copy back, and reused pool pages that are evictable now.
        sums = []
        for group in groups:
            pool_ids = np.array(pool_page[group.index], np.int64)
            host_ids = np.array(host_page[group.index], np.int64)
            evictable = group.pool.evictable
            kept = np.fromiter((p >= 0 and p in evictable for p in pool_ids.tolist()), bool, n)
            sums.append(
                tuple(
                    np.concatenate([[0], np.cumsum(flags)])
                    for flags in ((pool_ids < 0) & (host_ids < 0), pool_ids < 0, kept)
                )
            )
        best = 0
        for h in range(n, 0, -1):
            for group, (missing, copies, kept) in zip(groups, sums, strict=True):
                lo = group.first_slot(h * size, size)
                if missing[h] - missing[lo]:
                    break
                back = copies[h] - copies[lo]
                if back > group.pool.num_free - (kept[h] - kept[lo]):
                    break
            else:
                best = h
                break
        hit = []
        for group in groups:
            lo = group.first_slot(best * size, size)
            pool_ids, host_ids = pool_page[group.index], host_page[group.index]
            reused = [p for p in pool_ids[lo:best] if p >= 0]
            back = [(s, host_ids[s], keys[s]) for s in range(lo, best) if pool_ids[s] < 0]
            hit.append((reused, back, lo))
        return best, hit, keys

    def _take_hit(
        self, request: RequestPages, prompt: np.ndarray, root: bytes
    ) -> tuple[int, bytes]:
        """Serves the longest prefix hit into request's tables: reuses pool
        pages and copies host-tier pages back. Returns its length in pages
        and the last page's key. Copies before it commits."""
        count, hit, keys = self._find_hit(prompt, root)
        if not count:
            return 0, root
        plans = []
        for group, (reused, back, _) in zip(self._groups, hit, strict=True):
            fresh = group.pool.peek_except(len(back), reused)
            sources = [h for _, h, _ in back]
            offload = self._plan_offload(group, fresh, sources) if back else None
            plans.append((fresh, sources, offload))
        for group, (fresh, sources, offload) in zip(self._groups, plans, strict=True):
            if offload is not None:
                group.tensors.copy_to(group.host_tensors, offload.pages, offload.dests)
            if sources:
                group.host_tensors.copy_to(group.tensors, sources, fresh)

        # Commit: reuse, claim (offloading what that evicts), key the copies.
        columns = []
        for group, (reused, back, lo), (fresh, sources, offload) in zip(
            self._groups, hit, plans, strict=True
        ):
            pool = group.pool
            pool.reuse(reused)
            if back:
                self.stats.evictions += pool.claim(fresh)
                if offload is not None:
                    self._commit_offload(group, offload)
                host = group.host
                pool.assign(
                    fresh,
                    [key for _, _, key in back],
                    [host.origin[h] for h in sources],
                    [keys[s - 1] if s else root for s, _, _ in back],
                )
                host.touch(sources)
                self.stats.reloads += len(back)
            row = [group.null_page] * lo
            reused_iter, fresh_iter = iter(reused), iter(fresh)
            copied = {s for s, _, _ in back}
            for s in range(lo, count):
                row.append(next(fresh_iter) if s in copied else next(reused_iter))
            request.first[group.index] = lo
            columns.append(row)
        request.push(columns)
        return count, keys[count - 1]

    def _plan_offload(
        self, group: LayerGroup, fresh: list[int], keep: Sequence[int]
    ) -> OffloadPlan | None:
        """What a claim of `fresh` does to the host tier: the evicted keyed
        pages it lacks are copied to host pages (as many as it can take
        without evicting the pages in `keep`, the last evicted first); those
        it holds get fresher. Changes nothing."""
        pool, host = group.pool, group.host
        hash_of_page = pool.hash_of_page
        # Unused pages come first in a claim; only the rest have keys.
        victims = fresh[min(len(fresh), len(pool.free)) :]
        if not victims or host is None:
            return None
        plan = OffloadPlan()
        plan.keep = list(keep)
        moving = []
        for page in victims:
            key = hash_of_page[page]
            held = host.page_of_hash.get(key)
            if held is None:
                moving.append((page, key))
            else:
                plan.keep.append(held)
        room = host.num_free - sum(1 for p in set(plan.keep) if p in host.evictable)
        moving = moving[max(0, len(moving) - room) :] if room > 0 else []
        plan.pages = [p for p, _ in moving]
        plan.keys = [k for _, k in moving]
        plan.origins = [pool.origin[p] for p in plan.pages]
        plan.dests = host.peek_except(len(moving), plan.keep)
        return plan

    def _commit_offload(self, group: LayerGroup, plan: OffloadPlan) -> None:
        """Commits a planned offload once the pool's claim has evicted its
        pages (and the copies ran): the host tier claims and keys the copies;
        the kept pages come last in its eviction order."""
        host = group.host
        kept = [p for p in dict.fromkeys(plan.keep) if p in host.evictable]
        host.reuse(kept)
        if plan.dests:
            host.claim(plan.dests)
            host.assign(plan.dests, plan.keys, plan.origins)
            host.release(plan.dests)
            self.stats.offloads += len(plan.dests)
        host.release(kept)

    def _drop_outside_windows(self, request: RequestPages, start: int) -> None:
        """Gives back, in each window group, the request's pages that lie
        wholly before the window of a query at `start` (its step's first)."""
        size = self.page_size
        for group in self._windows:
            g = group.index
            first = group.first_slot(start, size)
            old = request.first[g]
            if first > old:
                row = request.pages[g]
                group.pool.release(row[old:first].copy())
                row[old:first] = group.null_page
                request.first[g] = first

    def _new_pages(self, request: RequestPages, n: int) -> int:
        """Pool pages that room for n more tokens of request needs, beyond
        its page table and its set-aside pages (in each group)."""
        have = request.num_pages + len(request.ahead[0])
        return max(0, -(-(request.seq_len + n) // self.page_size) - have)

    def _fill(self, request: RequestPages, n: int, ids: np.ndarray | None) -> None:
        """Counts n new tokens in request (pages already pushed), hashing the
        pages they fill with ids, else with the remembered prompt's next ids."""
        pending = request.pending
        if pending.size:
            # Given ids win; either way these n tokens use up the prompt's next n.
            request.pending = pending[n:]
            if ids is None:
                known = pending[:n]
                self._extend_chain(request, known)
                request.seq_len += known.size
                n -= known.size
                if n == 0:
                    return
        self._extend_chain(request, ids)
        request.seq_len += n

    def _extend_chain(self, request: RequestPages, ids: np.ndarray | None) -> None:
        """Hashes and caches (in every group's pool) the pages that request's
        new tokens fill; a pool emits a BlockStored per run of newly cached
        pages."""
        if request.chain is None:
            return
        if ids is None:
            request.chain = None
            request.tail = np.empty(0, np.int64)
            return
        size = self.page_size
        run = np.concatenate([request.tail, ids]) if request.tail.size else ids
        filled = len(run) // size
        if not filled:
            # Most decode steps: the partial page grows, nothing to hash.
            request.tail = run.copy()
            return
        first = request.seq_len // size
        full = run[: filled * size]
        if self._simple:
            request.chain = self.page_pool.cache_full_pages(
                request.chain, request.pages[0, first : first + filled], full, at_start=first == 0
            )
        else:
            # One key per page for every group and tier.
            keys = chain_keys(request.chain, full, size)
            for group in self._groups:
                group.pool.cache_keys(
                    keys,
                    request.chain,
                    request.pages[group.index, first : first + filled],
                    full,
                    at_start=first == 0,
                )
            request.chain = keys[-1]
        request.tail = run[filled * size :].copy()


def _token_ids(name: str, tokens: Any) -> np.ndarray:
    """Token ids as a 1-D int64 array."""
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a 1-D sequence of integer token ids, got {tokens!r}")
    return ids.astype(np.int64)


def _split_tokens(tokens: Any, counts: np.ndarray) -> list[np.ndarray | None]:
    """reserve()'s tokens as one int64 array (or None) per request."""
    batch = len(counts)
    if tokens is None:
        return [None] * batch
    if batch == 0:
        if len(tokens):
            raise ValueError(f"tokens must be empty for an empty batch, got {tokens!r}")
        return []
    flat = isinstance(tokens, np.ndarray) or all(
        isinstance(t, (numbers.Integral, np.integer)) for t in tokens
    )
    if flat:
        ids = _token_ids("tokens", tokens)
        if ids.size != int(counts.sum()):
            raise ValueError(
                f"tokens holds {ids.size} ids but num_new_tokens adds up to {int(counts.sum())}"
            )
        return np.split(ids, np.cumsum(counts)[:-1])
    if len(tokens) != batch:
        raise ValueError(f"tokens must have one entry per request ({batch}), got {len(tokens)}")
    out: list[np.ndarray | None] = []
    for b, entry in enumerate(tokens):
        ids = None if entry is None else _token_ids(f"tokens[{b}]", entry)
        if ids is not None and ids.size != counts[b]:
            raise ValueError(f"tokens[{b}] holds {ids.size} ids but num_new_tokens is {counts[b]}")
        out.append(ids)
    return out
