"""The page tables of live requests over a page pool: allocation, prefix
caching, copy-on-write forks, and the batch metadata the kernels take.

FlashInfer leaves page allocation to its caller; :class:`PagedKVCacheManager`
is that caller's half. It hands out page ids that name the same slot in every
layer's pool, so one page table serves the whole model.

The manager is the top of three layers (as vLLM's ``KVCacheManager`` sits on
its ``BlockPool``):

- :class:`pagedkv.page_pool.PagePool`: page ids, refcounts, the free and
  evictable lists, the prefix-hash table, pins and KV events; no tensors.
- :class:`pagedkv.page_tensors.PageTensors`: every layer's pool and the
  copy-on-write page copies.
- :class:`PagedKVCacheManager` (here): the requests: their page tables,
  prefix hashes and reservations, and the batch metadata.

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
see pagedkv.eviction) unless pin() keeps it. A salt given to add() enters the
first page's key, so tenants never share pages; subscribe() reports cached and
evicted pages as vLLM's KV events (pagedkv.kv_events). Forks: a
child shares all its parent's pages; reserve() copies a shared, partially
filled last page (pagedkv.copy_pages, every layer) before the first write
into it. Writes only ever go to a request's partial last page or new pages.

Reserved tokens count as written from the moment reserve() returns (their
pages may serve a later prefix hit): the caller appends them before it runs
attention over any request that could read them.

Not thread-safe: one scheduler thread owns a manager.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._kernels import debug_enabled
from ._tensors import Array
from .eviction import EvictionPolicy
from .kv_events import MEDIUM_CPU, MEDIUM_GPU, KVCacheEvent
from .page_pool import (
    ROOT_HASH,
    CacheStateError,
    OutOfPagesError,
    PagePool,
    fail,
    page_hash,
    salt_root,
)
from .page_tensors import POOL_DTYPES, PageTensors

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

PAD_PAGE = -1
"""The block table's value past the end of a request's pages."""


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
    """Shared pages copied on write (each counts once, however many layers)."""


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
    block_table: np.ndarray
    """[B, max pages of a request]: the same pages, one row per request, padded
    with PAD_PAGE (-1)."""

    @property
    def batch_size(self) -> int:
        """B: the number of requests in the batch."""
        return int(self.seq_lens.shape[0])

    @property
    def nnz(self) -> int:
        """Rows appended by the whole batch."""
        return int(self.append_indptr[-1])


class _Request:
    """One live request's page list and prefix-hash state."""

    __slots__ = (
        "pages",
        "num_pages",
        "seq_len",
        "reserved",
        "generation",
        "chain",
        "tail",
        "pending",
        "ahead",
    )

    def __init__(self) -> None:
        self.pages = np.empty(4, np.int32)
        """pages[:num_pages] are the request's pages; the rest is spare capacity."""
        self.num_pages = 0
        self.seq_len = 0
        self.reserved = 0
        """Tokens reserved by the reserve() call numbered `generation`."""
        self.generation = -1
        self.chain: bytes | None = ROOT_HASH
        """Hash of the last full page; None once some page's tokens are unknown."""
        self.tail = np.empty(0, np.int64)
        """Token ids in the partial last page (meaningful while chain is not None)."""
        self.pending = np.empty(0, np.int64)
        """Prompt ids given to add() that no reserve() has counted yet: the ids
        of the next tokens, used when reserve() is not given them."""
        self.ahead: list[int] = []
        """Pages reserve(num_steps=k) took for later steps: owned (refcount 1,
        no hash), not yet in the page table; later reserves use them first."""

    def page_list(self) -> np.ndarray:
        return self.pages[: self.num_pages]

    def push(self, new_pages: Sequence[int]) -> None:
        need = self.num_pages + len(new_pages)
        if need > len(self.pages):
            grown = np.empty(max(need, 2 * len(self.pages)), np.int32)
            grown[: self.num_pages] = self.page_list()
            self.pages = grown
        self.pages[self.num_pages : need] = new_pages
        self.num_pages = need

    def copy(self) -> _Request:
        other = _Request()
        other.pages = self.pages.copy()
        other.num_pages = self.num_pages
        other.seq_len = self.seq_len
        other.chain = self.chain
        other.tail = self.tail.copy()
        other.pending = self.pending.copy()
        return other


class PagedKVCacheManager:
    """The page tables of the live requests over a page pool for every layer.

    Parameters
    ----------
    num_pages : int
        Pages in each layer's pool.
    page_size : int
        Tokens per page.
    num_kv_heads, head_dim : int
        The pools' geometry.
    num_layers : int
        Pools, one per layer; a page id names the same slot in each.
    dtype : str or dtype
        "float32", "float16" or "bfloat16" (or a torch / NumPy / MAX dtype).
    kv_layout : str
        "NHD" pools are [num_pages, 2, page_size, num_kv_heads, head_dim],
        "HND" pools [num_pages, 2, num_kv_heads, page_size, head_dim]:
        FlashInfer's one-tensor form, ready for append_paged_kv_cache and the
        decode wrapper.
    device : str
        "cpu", or "cuda[:i]" / "gpu[:i]" for torch pools on that GPU
        (copy-on-write copies then run there).
    use_torch : bool
        ``pools[layer]`` is a NumPy array, or a torch tensor for bfloat16
        (NumPy has none) or when use_torch is set. Host pools lie on 2 MiB
        pages (`pagedkv.runtime.huge_page_zeros`). The page tables and all
        metadata stay in host memory, as plan() wants them.
    eviction : str or EvictionPolicy
        Which cached page an allocation reclaims first: "lru" (least
        recently released, the default), "lfu" (fewest prefix hits, then
        least recently released) or an :class:`pagedkv.eviction.EvictionPolicy`.
    max_pinned_pages : int, optional
        The most pages pin() may hold (default num_pages // 2).

    Attributes
    ----------
    pools : list of arrays
        One pool per layer, written in place by the kernels.
    page_pool : PagePool
        The page ids, refcounts, free and evictable pages, prefix-hash
        table, pins and events (read it; change it through the manager).
    page_tensors : PageTensors
        The pools and their page copies.
    stats : CacheStats
        Counters since the manager was made.

    Notes
    -----
    Request ids are any hashable values. Every call checks its arguments and
    the pool's capacity before changing anything; a call that raises leaves
    the manager as it was (pools included) and emits no event.

    NOTE: every page is in exactly one of four states: unused (on the free
    list, no hash), cached (hash, no owner, not pinned: the policy's evictable
    set), pinned (hash, may or may not have owners, never evicted) or owned
    (refcount > 0). A page's refcount is the number of page tables holding it
    plus the requests that set it aside (reserve(num_steps=k)); a page with
    a hash is full; a shared page is written by no one (a writer copies it
    first). validate() checks all of this.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        dtype: object = "float32",
        kv_layout: str = "NHD",
        device: object = "cpu",
        use_torch: bool = False,
        eviction: str | EvictionPolicy = "lru",
        max_pinned_pages: int | None = None,
    ) -> None:
        tensors = PageTensors(
            num_pages,
            page_size,
            num_kv_heads,
            head_dim,
            num_layers,
            dtype=dtype,
            kv_layout=kv_layout,
            device=device,
            use_torch=use_torch,
        )
        self.page_tensors = tensors
        self.num_pages = tensors.num_pages
        self.page_size = tensors.page_size
        self.num_kv_heads = tensors.num_kv_heads
        self.head_dim = tensors.head_dim
        self.num_layers = tensors.num_layers
        self.dtype = tensors.dtype
        self.kv_layout = tensors.kv_layout
        self.pools: list[Array] = tensors.pools
        """One pool per layer, written in place by the kernels."""
        self.page_pool = PagePool(
            self.num_pages,
            self.page_size,
            eviction=eviction,
            max_pinned_pages=max_pinned_pages,
            medium=MEDIUM_GPU if tensors.on_gpu else MEDIUM_CPU,
        )
        self._requests: dict[Hashable, _Request] = {}
        self._generation = 0
        self.stats = CacheStats()

    @property
    def max_pinned_pages(self) -> int:
        """The most pages pin() may hold."""
        return self.page_pool.max_pinned_pages

    @max_pinned_pages.setter
    def max_pinned_pages(self, value: int) -> None:
        self.page_pool.max_pinned_pages = value

    # The pool's state under the names earlier versions kept it (tests
    # corrupt it on purpose to exercise validate()).

    @property
    def _refcount(self) -> np.ndarray:
        return self.page_pool.refcount

    @property
    def _free(self) -> list[int]:
        return self.page_pool.free

    # ----------------------------------------------------------- inspection

    @property
    def num_free_pages(self) -> int:
        """Pages a reservation can take: unused ones plus cached, evictable ones."""
        return self.page_pool.num_free

    @property
    def num_cached_pages(self) -> int:
        """Pages no request owns that keep their contents for prefix hits and
        that an allocation may evict (pinned ones are not counted here)."""
        return len(self.page_pool.evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages owned by at least one live request."""
        return self.page_pool.num_used

    @property
    def num_pinned_pages(self) -> int:
        """Pages pin() keeps cached (owned by requests or not)."""
        return len(self.page_pool.pinned)

    @property
    def request_ids(self) -> list[Hashable]:
        """The live requests' ids, in the order they were added."""
        return list(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def seq_len(self, request_id: Hashable) -> int:
        """Tokens of the request, reserved ones included."""
        return self._request("request_id", request_id).seq_len

    def pages(self, request_id: Hashable) -> np.ndarray:
        """The request's page ids in sequence order ([pages] int32, a copy)."""
        return self._request("request_id", request_id).page_list().copy()

    def ahead_pages(self, request_id: Hashable) -> list[int]:
        """Pages reserve(num_steps=k) set aside for the request's later steps
        (owned by it, not yet in its page table)."""
        return list(self._request("request_id", request_id).ahead)

    def refcounts(self) -> np.ndarray:
        """Owners of each page ([num_pages] int32, a copy)."""
        return self.page_pool.refcount.copy()

    def snapshot(self) -> dict[str, Any]:
        """A deep copy of the bookkeeping (not the pools): equal snapshots mean
        equal states. For tests and debugging."""
        return {
            "requests": {
                rid: (
                    r.page_list().tolist(),
                    r.seq_len,
                    r.reserved,
                    r.generation,
                    r.chain,
                    r.tail.tolist(),
                    r.pending.tolist(),
                    list(r.ahead),
                )
                for rid, r in self._requests.items()
            },
            **self.page_pool.snapshot(),
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
        the caller reserves and appends the rest. Allocates no pages.

        The rest of the prompt is remembered: reserve() calls that are not
        given token ids take them from it, so the pages they fill are cached.

        salt: a tenant's key (str or bytes). It enters the first page's hash,
        so requests with different salts never share a cached page (a shared
        prefix is a timing side channel between tenants); equal salts share
        as usual, and None is the unsalted cache of earlier versions.

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
        request = _Request()
        request.chain = root
        if prompt is not None:
            hits, chain = self.page_pool.lookup(prompt, root)
            self.stats.prefix_hits += len(hits)
            self.stats.prefix_misses += len(prompt) // self.page_size - len(hits)
            if hits:
                self.page_pool.reuse(hits)
                request.push(hits)
                request.seq_len = len(hits) * self.page_size
                request.chain = chain
            request.pending = prompt[request.seq_len :].copy()
        self._requests[request_id] = request
        self._after_mutation()
        return request.seq_len

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

        Raises OutOfPagesError, with nothing changed, when the pool is short.

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
        if not isinstance(num_steps, numbers.Integral) or num_steps < 1:
            raise ValueError(f"num_steps must be an integer >= 1, got {num_steps!r}")
        size = self.page_size
        pool = self.page_pool
        refcount = pool.refcount

        need = 0
        writers: dict[int, int] = {}
        for request, n in zip(requests, counts.tolist(), strict=True):
            if n == 0:
                continue
            need += self._new_pages(request, n * num_steps)
            if request.seq_len % size:
                last = int(request.pages[request.num_pages - 1])
                if refcount[last] > 1:
                    writers[last] = writers.get(last, 0) + 1
        # Every writer into a shared page copies it, but when all its owners
        # write, the last one keeps the original.
        need += sum(c - (c == refcount[p]) for p, c in writers.items())
        pool.ensure_room(need)

        # NOTE: the next claim(need) takes exactly these pages, copies first.
        fresh = pool.peek(need)
        copies: list[tuple[_Request, int, int]] = []
        if writers:
            owners = {p: int(refcount[p]) for p in writers}
            spare = iter(fresh)
            for request, n in zip(requests, counts.tolist(), strict=True):
                if n == 0 or not request.seq_len % size:
                    continue
                last = int(request.pages[request.num_pages - 1])
                if owners.get(last, 1) > 1:
                    owners[last] -= 1
                    copies.append((request, last, next(spare)))
            if copies:
                self.page_tensors.copy_pages([c[1] for c in copies], [c[2] for c in copies])

        # Nothing below can fail: commit. Every claimed page gets one owner.
        self.stats.evictions += pool.claim(fresh)
        for request, _, new in copies:
            request.pages[request.num_pages - 1] = new
        if copies:
            pool.drop_shared([old for _, old, _ in copies])
        self.stats.cow_copies += len(copies)
        taken = len(copies)
        self._generation += 1
        for request, n, ids in zip(requests, counts.tolist(), new_tokens, strict=True):
            request.reserved = n
            request.generation = self._generation
            if n == 0:
                continue
            grow = -(-(request.seq_len + n) // size) - request.num_pages
            if num_steps == 1 and not request.ahead:
                # The common decode step: pages for this step only.
                if grow:
                    request.push(fresh[taken : taken + grow])
                    taken += grow
            else:
                extra = self._new_pages(request, n * num_steps)
                # Set-aside pages first (allocated earlier), then this call's.
                pages = request.ahead + fresh[taken : taken + extra]
                taken += extra
                if grow:
                    request.push(pages[:grow])
                request.ahead = pages[grow:]
            self._fill(request, n, ids)
        self._after_mutation()

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Starts child_id as a copy of parent_id that shares all its pages.

        Allocates nothing: the first reserve() that writes into a shared,
        partially filled last page copies that page (copy-on-write).
        """
        parent = self._request("parent_id", parent_id)
        if child_id in self._requests:
            raise ValueError(f"child_id {child_id!r} is already live")
        child = parent.copy()
        self.page_pool.share(child.page_list())
        self._requests[child_id] = child
        self._after_mutation()

    def release(self, request_id: Hashable) -> None:
        """Ends a request. Its pages that no one else owns become free; those
        with a prefix hash stay cached until the pool needs them (the eviction
        policy picks which go first), pinned ones until unpinned."""
        request = self._request("request_id", request_id)
        del self._requests[request_id]
        self.page_pool.release(request.ahead)
        self.page_pool.release(request.page_list())
        self._after_mutation()

    # -------------------------------------------------- pins, events, reset

    def pin(self, tokens: Sequence[int] | np.ndarray, salt: str | bytes | None = None) -> int:
        """Keeps the cached pages holding `tokens`' leading full pages cached
        until unpin(): no allocation evicts them. Returns the tokens pinned
        (a multiple of page_size; pages not cached yet are not pinned, so pin
        a system prompt after its first request has filled its pages).

        Raises ValueError, with nothing changed, when the pins would exceed
        max_pinned_pages. Pinning a pinned page again is a no-op (pins do not
        count).

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
        pages, _ = self.page_pool.lookup(_token_ids("tokens", tokens), salt_root(salt))
        self.page_pool.pin(pages)
        self._after_mutation()
        return len(pages) * self.page_size

    def unpin(self, tokens: Sequence[int] | np.ndarray, salt: str | bytes | None = None) -> int:
        """Undoes pin() for the pinned pages holding `tokens`' leading full
        pages; those no request owns become evictable (most recently released
        last). Returns the tokens unpinned.

        Examples
        --------
        >>> m = PagedKVCacheManager(8, 4, 1, 8)
        >>> _ = m.add("a", [1, 2, 3, 4]); m.reserve(["a"], 4)
        >>> m.pin([1, 2, 3, 4]), m.unpin([1, 2, 3, 4]), m.num_pinned_pages
        (4, 4, 0)
        """
        pages, _ = self.page_pool.lookup(_token_ids("tokens", tokens), salt_root(salt))
        unpinned = self.page_pool.unpin(pages)
        self._after_mutation()
        return unpinned * self.page_size

    def subscribe(self, callback: Callable[[KVCacheEvent], None]) -> Callable[[], None]:
        """Calls callback(event) with every KV event (pagedkv.kv_events:
        BlockStored, BlockRemoved, AllBlocksCleared in vLLM's schema) from now
        on; returns a function that unsubscribes it.

        Events come after the call that caused them has committed, in order; a
        call that raised emits none. An exception from the callback propagates
        to the caller of that call, whose effects stand.

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
        """Forgets every prefix hash (pins included): cached pages become
        unused, owned pages stay with their requests but serve no later prefix
        hit. Emits AllBlocksCleared. Live requests go on caching the pages they
        fill (their keys chain on hashes no longer held: only their own later
        prompts could hit them).

        Examples
        --------
        >>> m = PagedKVCacheManager(8, 4, 1, 8)
        >>> _ = m.add("a", [1, 2, 3, 4]); m.reserve(["a"], 4); m.release("a")
        >>> m.num_cached_pages, (m.reset_prefix_cache(), m.num_cached_pages)[1]
        (1, 0)
        """
        self.page_pool.reset()
        self._after_mutation()

    # ------------------------------------------------------------- metadata

    def metadata(
        self,
        request_ids: Sequence[Hashable],
        num_new_tokens: int | Sequence[int] | np.ndarray | None = None,
    ) -> BatchMetadata:
        """The batch's page table and append indices (see BatchMetadata).

        num_new_tokens: tokens each request appends, its last ones (an int or
        one per request); None: what the latest reserve() call reserved for
        each request (0 for requests it did not list). 0 gives decode-only
        metadata. Only tokens that reserve() made room for may be written:
        pages before them can be shared. Changes nothing.
        """
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
            np.concatenate([r.pages[: r.num_pages] for r in requests])
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
        width = int(page_counts.max()) if batch else 0
        block_table = np.full((batch, width), PAD_PAGE, np.int32)
        # Row-major order of the mask is CSR order.
        block_table[np.arange(width) < page_counts[:, None]] = kv_indices
        return BatchMetadata(
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_last_page_len=kv_last_page_len,
            seq_lens=seq_lens.astype(np.int32),
            append_indptr=append_indptr,
            batch_indices=batch_indices,
            positions=positions,
            block_table=block_table,
        )

    # ------------------------------------------------------------- checking

    def validate(self) -> None:
        """Checks the page tables against the pool; raises CacheStateError.

        CSR form: indptr monotone, page ids in the pool, last_page_len in
        [1, page_size] for requests with pages (0 without). Ownership: each
        request holds ceil(seq_len / page_size) distinct pages; refcounts equal
        the owners counted from the tables and the set-aside pages of
        reserve(num_steps=k) (which have no hash); a page with several owners sits at
        the same index in each and is filled alike in each (shared read-only:
        prefix-cache pages are full, a fork's partial page is everyone's last);
        a page with a prefix hash is full. Pool (PagePool.validate): unused,
        cached-evictable, pinned-unowned and owned pages partition the pool;
        pinned pages have a hash and are not evictable; the hash maps are
        mutual inverses.
        """
        size, total = self.page_size, self.num_pages
        pool = self.page_pool
        ids = list(self._requests)
        for rid in ids:
            r = self._requests[rid]
            if r.num_pages != -(-r.seq_len // size):
                fail(f"request {rid!r}: {r.num_pages} pages for {r.seq_len} tokens")
            pages = r.page_list()
            if pages.size and (pages.min() < 0 or pages.max() >= total):
                fail(f"request {rid!r} holds a page outside the pool: {pages.tolist()}")
            if np.unique(pages).size != pages.size:
                fail(f"request {rid!r} holds a page twice: {pages.tolist()}")
            if r.chain is not None and r.tail.size != r.seq_len % size:
                fail(f"request {rid!r}: {r.tail.size} token ids for its partial last page")
        meta = self.metadata(ids, num_new_tokens=0)
        indptr, indices, last = meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len
        counts = np.diff(indptr.astype(np.int64))
        if indptr[0] != 0 or (counts < 0).any() or indptr[-1] != indices.size:
            fail(f"kv_indptr is not a CSR offset array: {indptr.tolist()}")
        if indices.size and (indices.min() < 0 or indices.max() >= total):
            fail("kv_indices leaves the pool")
        full = counts > 0
        if ((last < 1) | (last > size))[full].any() or (last[~full] != 0).any():
            fail(f"kv_last_page_len out of range: {last.tolist()}")

        ahead = np.array([p for r in self._requests.values() for p in r.ahead], np.int64)
        if any(p in pool.hash_of_page for p in ahead.tolist()):
            fail("a set-aside page has a prefix hash")
        owners = np.bincount(np.concatenate([indices, ahead]), minlength=total)
        wrong = np.flatnonzero(owners != pool.refcount)
        if wrong.size:
            p = int(wrong[0])
            fail(f"page {p}: refcount {pool.refcount[p]} but {owners[p]} owners")
        slot = np.arange(indices.size) - np.repeat(indptr[:-1], counts)
        fill = np.where(slot == np.repeat(counts - 1, counts), np.repeat(last, counts), size)
        for name, value in (("index", slot), ("fill", fill)):
            low = np.full(total, np.iinfo(np.int64).max)
            high = np.full(total, -1)
            np.minimum.at(low, indices, value)
            np.maximum.at(high, indices, value)
            differs = np.flatnonzero((owners > 1) & (low != high))
            if differs.size:
                fail(f"shared page {int(differs[0])} differs in {name} between its owners")
        hashed = np.array(sorted(pool.hash_of_page), np.int64)
        if hashed.size:
            low_fill = np.full(total, size)
            np.minimum.at(low_fill, indices, fill)
            partial = hashed[low_fill[hashed] < size]
            if partial.size:
                fail(f"page {int(partial[0])} has a prefix hash but is not full")
        pool.validate()

    # ------------------------------------------------------------ internals

    def _after_mutation(self) -> None:
        """Every mutating call's last step, once its effects are committed."""
        if debug_enabled():
            self.validate()
        self.page_pool.flush_events()

    def _request(self, name: str, request_id: Hashable) -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise KeyError(f"{name} {request_id!r} is not a live request") from None

    def _batch(self, request_ids: Iterable[Hashable]) -> list[_Request]:
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
        first chained on root), and the hash of the last of them."""
        return self.page_pool.lookup(prompt, root)

    def _new_pages(self, request: _Request, n: int) -> int:
        """Pool pages that room for n more tokens of request needs, beyond
        its page table and its set-aside pages."""
        have = request.num_pages + len(request.ahead)
        return max(0, -(-(request.seq_len + n) // self.page_size) - have)

    def _fill(self, request: _Request, n: int, ids: np.ndarray | None) -> None:
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

    def _extend_chain(self, request: _Request, ids: np.ndarray | None) -> None:
        """Hashes and caches (in the pool) the pages that request's new tokens
        fill; the pool emits a BlockStored per run of newly cached pages."""
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
        request.chain = self.page_pool.cache_full_pages(
            request.chain,
            request.pages[first : first + filled],
            run[: filled * size],
            at_start=first == 0,
        )
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
