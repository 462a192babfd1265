"""The page pool: page ids, reference counts and the prefix cache's hash table.

:class:`PagePool` is the bottom layer of the page manager (vLLM's
``BlockPool``). It hands out page ids and takes them back, counts the owners
of each page, keeps the free list, the evictable pages (cached, unowned) in
an eviction policy's order, the hash table of the prefix cache (page key ->
page and back), the pins, and queues the KV events its changes cause. It
knows nothing of requests or of the tensors a page id names: the request
bookkeeping is :class:`pagedkv.cache.manager.PagedKVCacheManager`'s, the layer
pools and page copies are :class:`pagedkv.cache.page_tensors.PageTensors`'.

Every method either raises before changing anything or cannot fail; a caller
composes all-or-nothing operations by checking (:meth:`PagePool.ensure_room`,
:meth:`PagePool.peek`) before it commits (:meth:`PagePool.claim`, ...).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._checks import check_int
from .eviction import EvictionPolicy, make_policy
from .kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventHub,
    KVCacheEvent,
)

ROOT_HASH = b""
"""The parent hash of a request's first page."""


class OutOfPagesError(RuntimeError):
    """The pool cannot supply the pages a call asked for; nothing was changed."""

    def __init__(
        self,
        requested: int,
        available: int,
        unused: int,
        cached: int,
        group_idx: int | None = None,
    ) -> None:
        where = "" if group_idx is None else f" in layer group {group_idx}"
        super().__init__(
            f"out of KV pages: {requested} asked for, {available} free "
            f"({unused} unused + {cached} cached and evictable){where}"
        )
        self.requested = requested
        self.available = available
        self.group_idx = group_idx
        """The layer group whose pool is short (None without layer groups)."""


class CacheStateError(RuntimeError):
    """validate() found the page tables and the pool out of step (a bug)."""


def fail(message: str) -> None:
    """Raises the CacheStateError of a failed validate() check."""
    raise CacheStateError(f"pagedkv cache state: {message}")


def page_hash(parent: bytes, tokens: np.ndarray) -> bytes:
    """The chained key of a full page: its parent page's key and its token ids.

    128-bit BLAKE2b: equal keys mean equal prefixes, up to a negligible chance.
    """
    return hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest()


def chain_keys(parent: bytes, tokens: np.ndarray, page_size: int) -> list[bytes]:
    """The keys of the full pages ``tokens`` (``len(tokens) // page_size``
    pages, the first chained on ``parent``), computed once for every layer
    group and tier that stores them.

    Examples
    --------
    >>> keys = chain_keys(ROOT_HASH, np.arange(9), 4)
    >>> len(keys), keys[1] == page_hash(keys[0], np.arange(4, 8))
    (2, True)
    """
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = page_hash(parent, tokens[start : start + page_size])
        keys.append(parent)
    return keys


def salt_root(salt: str | bytes | None) -> bytes:
    """The parent key of a request's first page: ROOT_HASH without a salt.

    A salted root is 16 bytes, ROOT_HASH is empty, and every later parent is a
    16-byte page key: the hashed byte strings of a salted and an unsalted
    first page differ in length, so they never collide by construction.
    """
    if salt is None:
        return ROOT_HASH
    if isinstance(salt, str):
        salt = salt.encode()
    if not isinstance(salt, bytes):
        raise TypeError(f"salt must be str, bytes or None, got {salt!r}")
    return hashlib.blake2b(b"pagedkv salt\0" + salt, digest_size=16).digest()


class PagePool:
    """Page ids ``0 .. num_pages - 1``, their owners and the prefix cache's keys.

    Parameters
    ----------
    num_pages : int
        Pages in the pool.
    page_size : int
        Tokens per page: the length of the token runs a key hashes and the
        ``block_size`` of the events.
    eviction : str or EvictionPolicy
        The order in which :meth:`claim` reclaims evictable pages: "lru",
        "lfu" or a :class:`pagedkv.cache.eviction.EvictionPolicy` (see there).
    max_pinned_pages : int, optional
        The most pages :meth:`pin` may hold (default ``num_pages // 2``).
    medium : str
        The ``medium`` of the events ("CPU" or "GPU": where the pages are).
    group_idx : int, optional
        The ``group_idx`` of the events (the manager's layer group).
    events : EventHub, optional
        The queue of events to join (a manager's groups and tiers share one,
        so that their events keep one order); a new one by default.
    keep_token_ids : bool
        Keep each keyed page's token ids and parent key (``origin``), which
        a second tier needs to announce a copy of it (pages that move between
        tiers keep their key, parent and ids).

    Notes
    -----
    NOTE: every page is in exactly one of four states:

    - unused: on ``free``, refcount 0, no key;
    - evictable: a key, refcount 0, not pinned: in the policy ``evictable``;
    - idle pinned: a key, refcount 0, pinned (never evicted);
    - in use: refcount > 0 (with or without a key, pinned or not).

    NOTE: ``hash_of_page`` and ``page_of_hash`` are mutual inverses; a pinned
    page has a key. A page with a key is full (its owners' page tables, not
    the pool, can check that).

    NOTE: ``children`` lists the keyed pages whose parent key and token ids
    are known (every page keyed by :meth:`cache_keys`, and those
    :meth:`assign` is given parents for), under their parent key; a page
    leaves it when it loses its key. :meth:`partial_match` looks there.

    NOTE: ``peek(n)`` changes nothing and ``claim(peek(n))`` takes exactly
    those pages, so a caller may decide on the pages it will get (and copy
    into them) before it commits.

    NOTE: events are queued as changes happen and delivered by
    :meth:`flush_events`, which the caller runs once its operation has
    committed (see pagedkv.cache.kv_events).

    The attributes are public for reading (the manager's hot paths index
    ``refcount`` directly); only the methods change them.

    Examples
    --------
    >>> import numpy as np
    >>> pool = PagePool(4, page_size=2)
    >>> pages = pool.peek(2); pool.claim(pages)  # unused pages first, low ids first
    0
    >>> key = pool.cache_full_pages(ROOT_HASH, np.array(pages), np.arange(4), at_start=True)
    >>> pool.release(pages); pool.num_free, len(pool.evictable)  # cached, evictable
    (4, 2)
    >>> pool.lookup(np.arange(5), ROOT_HASH)[0]  # a prompt that starts alike
    [0, 1]
    >>> pool.claim(pool.peek(3)), pool.lookup(np.arange(4), ROOT_HASH)[0]  # tail evicted first
    (1, [0])
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        eviction: str | EvictionPolicy = "lru",
        max_pinned_pages: int | None = None,
        medium: str = MEDIUM_CPU,
        group_idx: int | None = None,
        events: EventHub | None = None,
        keep_token_ids: bool = False,
    ) -> None:
        self.num_pages = check_int("num_pages", num_pages, 1)
        self.page_size = check_int("page_size", page_size, 1)
        # pop() hands out low page ids first.
        self.free: list[int] = list(range(self.num_pages - 1, -1, -1))
        """Unused pages; the next claimed is the last."""
        self.refcount = np.zeros(self.num_pages, np.int32)
        """Owners of each page."""
        self.hash_of_page: dict[int, bytes] = {}
        self.page_of_hash: dict[bytes, int] = {}
        if max_pinned_pages is None:
            max_pinned_pages = self.num_pages // 2
        self.max_pinned_pages = check_int("max_pinned_pages", max_pinned_pages, 0)
        self.evictable: EvictionPolicy = make_policy(eviction)
        """Pages with a key, no owner and no pin, in the policy's eviction order."""
        self.pinned: set[int] = set()
        """Pages pin() keeps cached whatever their refcount."""
        self.events = EventHub() if events is None else events
        self.medium = medium
        self.group_idx = group_idx
        self.origin: dict[int, tuple[bytes | None, np.ndarray]] | None = (
            {} if keep_token_ids else None
        )
        """With keep_token_ids: keyed page -> (its event parent: None for a
        sequence's first page, else the previous page's key; its token ids)."""
        self.children: dict[bytes, dict[int, np.ndarray]] = {}
        """Parent key (a root for a first page) -> {keyed page chained on it:
        its token ids}, the most recently keyed last."""
        self._parent_of: dict[int, bytes] = {}

    # ----------------------------------------------------------- counts

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: unused plus evictable."""
        return len(self.free) + len(self.evictable)

    @property
    def num_idle_pinned(self) -> int:
        """Pinned pages no one owns (neither free nor in use)."""
        if not self.pinned:
            return 0
        return int((self.refcount[list(self.pinned)] == 0).sum())

    @property
    def num_used(self) -> int:
        """Pages with at least one owner."""
        return self.num_pages - self.num_free - self.num_idle_pinned

    # ------------------------------------------------------- allocation

    def ensure_room(self, count: int) -> None:
        """Raises OutOfPagesError unless ``count`` pages can be claimed."""
        if count > len(self.free) + len(self.evictable):
            raise OutOfPagesError(
                count, self.num_free, len(self.free), len(self.evictable), self.group_idx
            )

    def peek(self, count: int) -> list[int]:
        """The pages the next ``claim`` of ``count`` pages takes: unused pages
        first, then evictable ones in the policy's order. Changes nothing;
        ``count`` must not exceed :attr:`num_free`."""
        take = min(count, len(self.free))
        pages = self.free[len(self.free) - take :][::-1]
        if count > take:
            pages += self.evictable.victims(count - take)
        return pages

    def peek_except(self, count: int, keep: Sequence[int]) -> list[int]:
        """What ``peek(count)`` returns once the evictable pages ``keep`` are
        reused (taken out of the evictable set): the caller decides on the
        pages before it reuses ``keep`` and claims them. Changes nothing."""
        keep_set = {p for p in keep if p in self.evictable}
        if not keep_set:
            return self.peek(count)
        pages = [p for p in self.peek(count + len(keep_set)) if p not in keep_set]
        return pages[:count]

    def claim(self, pages: list[int]) -> int:
        """Takes ``pages`` (what ``peek(len(pages))`` returned) for one owner
        each: evicted ones lose their key (one BlockRemoved). Returns how
        many were evicted."""
        if not pages:
            return 0
        take = min(len(pages), len(self.free))
        del self.free[len(self.free) - take :]
        removed = []
        for page in pages[take:]:
            self.evictable.remove(page)
            self.evictable.forget(page)
            key = self.hash_of_page.pop(page)
            del self.page_of_hash[key]
            removed.append(key)
            if self.origin is not None:
                del self.origin[page]
            self._unindex(page)
        if removed:
            self.events.emit(
                BlockRemoved(block_hashes=removed, medium=self.medium, group_idx=self.group_idx)
            )
        self.refcount[pages] = 1
        return len(removed)

    def assign(
        self,
        pages: Sequence[int],
        keys: Sequence[bytes],
        origins: Sequence[tuple],
        parents: Sequence[bytes] | None = None,
    ) -> None:
        """Keys ``pages`` (claimed, unkeyed, holding copies of pages another
        tier keyed) with ``keys``, none cached here yet; ``origins`` are the
        (event parent, token ids) of each, as the other tier kept them;
        ``parents``, the key each is chained on, lists them in ``children``.
        Emits one BlockStored per page."""
        for i, (page, key, (parent, ids)) in enumerate(zip(pages, keys, origins, strict=True)):
            self.page_of_hash[key] = page
            self.hash_of_page[page] = key
            if self.origin is not None:
                self.origin[page] = (parent, ids)
            if parents is not None:
                self._index(page, parents[i], ids)
            if self.events.active:
                self._emit_stored([key], parent, ids)

    def reuse(self, pages: Sequence[int]) -> None:
        """Takes one more owner of each cached page a prefix hit found (in
        use, evictable or pinned); evictable ones stop being evictable."""
        for page in pages:
            self.evictable.remove(page)
            self.evictable.touch(page)
        if pages:
            self.refcount[pages] += 1

    def share(self, pages: np.ndarray) -> None:
        """One more owner of each of ``pages`` (distinct pages, all in use)."""
        self.refcount[pages] += 1

    def drop_shared(self, pages: Sequence[int]) -> None:
        """One owner fewer for each entry of ``pages``, which keep at least
        one more (a copy-on-write gave the dropping owner its own copy). A
        page may be listed once per owner that drops it."""
        for page in pages:
            self.refcount[page] -= 1

    def release(self, pages: Sequence[int] | np.ndarray) -> None:
        """One owner fewer for each of ``pages`` (distinct). Those left with
        none become evictable if they have a key (in reverse order: a
        prompt's tail is released, so evicted, before its head), stay out if
        pinned, and are unused otherwise."""
        pages = np.asarray(pages, np.int32)
        refcount = self.refcount
        refcount[pages] -= 1
        for page in reversed(pages[refcount[pages] == 0].tolist()):
            if page in self.pinned:
                continue
            if page in self.hash_of_page:
                self.evictable.insert(page)
            else:
                self.free.append(page)

    # ----------------------------------------------------- prefix cache

    def forget(self, pages: Sequence[int]) -> None:
        """Drops the keys of owned ``pages`` (their contents are not what the
        keys promise): no lookup finds them again; one BlockRemoved."""
        removed = []
        for page in pages:
            key = self.hash_of_page.pop(int(page), None)
            if key is None:
                continue
            del self.page_of_hash[key]
            self.pinned.discard(int(page))
            if self.origin is not None:
                self.origin.pop(int(page), None)
            self._unindex(int(page))
            removed.append(key)
        if removed:
            self.events.emit(
                BlockRemoved(block_hashes=removed, medium=self.medium, group_idx=self.group_idx)
            )

    def touch(self, pages: Sequence[int]) -> None:
        """Marks evictable ``pages`` as just released (a second tier read
        them, or already held what the first tier evicted)."""
        for page in pages:
            self.evictable.remove(page)
            self.evictable.touch(page)
            self.evictable.insert(page)

    def lookup(self, tokens: np.ndarray, root: bytes) -> tuple[list[int], bytes]:
        """The cached pages holding the leading full pages of ``tokens``
        (int64 ids, the first page chained on ``root``), and the key of the
        last of them (``root`` with none). Changes nothing."""
        size = self.page_size
        chain, hits = root, []
        for start in range(0, len(tokens) - size + 1, size):
            key = page_hash(chain, tokens[start : start + size])
            page = self.page_of_hash.get(key)
            if page is None:
                break
            hits.append(page)
            chain = key
        return hits, chain

    def cache_full_pages(
        self, parent: bytes, pages: np.ndarray, tokens: np.ndarray, at_start: bool
    ) -> bytes:
        """Keys the full pages ``pages`` holding ``tokens`` (``len(pages) *
        page_size`` int64 ids), chained on ``parent``, and returns the last
        key. A key already cached keeps its page (two requests prefilled the
        same content together): that page of ``pages`` stays unkeyed. Emits
        one BlockStored per run of newly keyed pages; ``at_start``:
        ``pages[0]`` is a sequence's first page, whose event names no parent.
        """
        return self.cache_keys(
            chain_keys(parent, tokens, self.page_size), parent, pages, tokens, at_start
        )

    def cache_keys(
        self,
        keys: list[bytes],
        parent: bytes,
        pages: np.ndarray,
        tokens: np.ndarray,
        at_start: bool,
    ) -> bytes:
        """:meth:`cache_full_pages` with the pages' keys (``chain_keys`` of
        ``parent`` and ``tokens``) already computed."""
        size = self.page_size
        events = self.events.active
        page_of_hash, hash_of_page = self.page_of_hash, self.hash_of_page
        origin = self.origin
        stored: list[bytes] = []
        event_parent: bytes | None = None
        start = 0
        chain = parent
        for i in range(len(pages)):
            key = keys[i]
            if key not in page_of_hash:
                page = int(pages[i])
                page_of_hash[key] = page
                hash_of_page[page] = key
                ids = tokens[i * size : (i + 1) * size]
                if origin is not None:
                    first = at_start and i == 0
                    origin[page] = (None if first else chain, ids)
                self._index(page, chain, ids)
                if events:
                    if not stored:
                        # A first page's parent is a root (salted or not): None.
                        event_parent = None if at_start and i == 0 else chain
                        start = i
                    stored.append(key)
            elif stored:
                self._emit_stored(stored, event_parent, tokens[start * size : i * size])
                stored = []
            chain = key
        if stored:
            self._emit_stored(stored, event_parent, tokens[start * size : len(pages) * size])
        return chain

    def partial_match(self, parent: bytes, tokens: np.ndarray, limit: int = 64) -> tuple[int, int]:
        """The keyed page chained on ``parent`` whose token ids start with
        the most of ``tokens`` (int64, fewer than page_size), and how many:
        (page, k), or (-1, 0) when none starts with ``tokens[0]``. Looks at
        the ``limit`` most recently keyed such pages, so that a parent of
        many children (a system prompt's page before its questions) costs a
        bounded lookup. Changes nothing."""
        n = len(tokens)
        best, longest = -1, 0
        children = self.children.get(parent)
        if not children or not n:
            return best, longest
        for seen, (page, ids) in enumerate(reversed(children.items())):
            if seen == limit:
                break
            differ = np.flatnonzero(ids[:n] != tokens)
            k = int(differ[0]) if differ.size else n
            if k > longest:
                best, longest = page, k
                if k == n:
                    break
        return best, longest

    def _index(self, page: int, parent: bytes, ids: np.ndarray) -> None:
        self.children.setdefault(parent, {})[page] = ids
        self._parent_of[page] = parent

    def _unindex(self, page: int) -> None:
        parent = self._parent_of.pop(page, None)
        if parent is not None:
            siblings = self.children[parent]
            del siblings[page]
            if not siblings:
                del self.children[parent]

    def _emit_stored(self, hashes: list[bytes], parent: bytes | None, ids: np.ndarray) -> None:
        self.events.emit(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=ids.tolist(),
                block_size=self.page_size,
                medium=self.medium,
                group_idx=self.group_idx,
            )
        )

    def check_pin(self, pages: Sequence[int]) -> list[int]:
        """The pages of ``pages`` not pinned yet; raises ValueError, changing
        nothing, when pinning them would exceed max_pinned_pages."""
        new = [p for p in pages if p not in self.pinned]
        if len(self.pinned) + len(new) > self.max_pinned_pages:
            where = "" if self.group_idx is None else f" in layer group {self.group_idx}"
            raise ValueError(
                f"pin: {len(new)} more pages would exceed max_pinned_pages = "
                f"{self.max_pinned_pages} ({len(self.pinned)} pinned){where}"
            )
        return new

    def pin(self, pages: Sequence[int]) -> None:
        """Pins ``pages`` (keyed pages; pinned ones stay pinned): no claim
        evicts them. Raises ValueError, with nothing changed, past
        max_pinned_pages."""
        for page in self.check_pin(pages):
            self.evictable.remove(page)
            self.pinned.add(page)

    def unpin(self, pages: Sequence[int]) -> int:
        """Unpins the pinned ones of ``pages``; those without owners become
        evictable (the first listed last). Returns how many were pinned."""
        pinned = [p for p in pages if p in self.pinned]
        for page in reversed(pinned):
            self.pinned.discard(page)
            if self.refcount[page] == 0:
                self.evictable.insert(page)
        return len(pinned)

    def reset(self, emit: bool = True) -> None:
        """Forgets every key and pin: unowned keyed pages become unused,
        owned ones stay owned. Emits AllBlocksCleared (unless ``emit`` is
        False: a manager of several pools emits one for all)."""
        idle = [p for p in self.pinned if self.refcount[p] == 0]
        evictable = list(self.evictable)
        for page in evictable:
            self.evictable.remove(page)
        for page in self.hash_of_page:
            self.evictable.forget(page)
        self.free.extend(sorted(evictable + idle, reverse=True))
        self.pinned.clear()
        self.hash_of_page.clear()
        self.page_of_hash.clear()
        if self.origin is not None:
            self.origin.clear()
        self.children.clear()
        self._parent_of.clear()
        if emit:
            self.events.emit(AllBlocksCleared())

    # ----------------------------------------------------------- events

    def subscribe(self, callback: Callable[[KVCacheEvent], None]) -> Callable[[], None]:
        """Adds a subscriber of the events; returns a function removing it."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        subscribers = self.events.subscribers
        subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in subscribers:
                subscribers.remove(callback)

        return unsubscribe

    def flush_events(self) -> None:
        """Delivers the queued events (once the caller's operation committed)."""
        if self.events.pending:
            self.events.flush()

    # --------------------------------------------------------- checking

    def snapshot(self) -> dict[str, Any]:
        """A deep copy of the pool's state: equal snapshots, equal pools."""
        return {
            "free": list(self.free),
            "refcount": self.refcount.tolist(),
            "hash_of_page": dict(self.hash_of_page),
            "page_of_hash": dict(self.page_of_hash),
            "evictable": self.evictable.state(),
            "pinned": sorted(self.pinned),
            "origin": None
            if self.origin is None
            else {p: (parent, ids.tolist()) for p, (parent, ids) in self.origin.items()},
            "children": {
                parent: [(p, ids.tolist()) for p, ids in pages.items()]
                for parent, pages in self.children.items()
            },
        }

    def validate(self) -> None:
        """Checks the four-state partition, the pins and the hash maps;
        raises CacheStateError. (That the refcounts count the real owners is
        for the owners' bookkeeping to check.)"""
        if len(set(self.free)) != len(self.free):
            fail("a page is on the free list twice")
        unused = np.array(self.free, np.int64)
        cached = np.array(list(self.evictable), np.int64)
        for name, group in (("free", unused), ("cached", cached)):
            if group.size and (self.refcount[group] != 0).any():
                fail(f"a {name} page has owners")
        if any(p in self.hash_of_page for p in self.free):
            fail("a free page keeps a prefix hash")
        if any(p not in self.hash_of_page for p in self.evictable):
            fail("a cached page has no prefix hash")
        if len(list(self.evictable)) != len(self.evictable):
            fail("the eviction policy's order and size disagree")
        if any(p not in self.hash_of_page or p in self.evictable for p in self.pinned):
            fail("a pinned page has no prefix hash or is evictable")
        if len(self.pinned) > self.max_pinned_pages:
            fail(f"{len(self.pinned)} pinned pages > max_pinned_pages")
        idle = self.num_idle_pinned
        in_use = int((self.refcount > 0).sum())
        if unused.size + cached.size + idle + in_use != self.num_pages:
            fail(
                f"{unused.size} free + {cached.size} cached + {idle} pinned + {in_use} used "
                f"!= {self.num_pages} pages"
            )
        if len(self.hash_of_page) != len(self.page_of_hash) or any(
            self.page_of_hash.get(h) != p for p, h in self.hash_of_page.items()
        ):
            fail("the page -> hash and hash -> page maps disagree")
        if self.origin is not None and self.origin.keys() != self.hash_of_page.keys():
            fail("the kept token ids and the keyed pages disagree")
        listed = [
            (parent, p, ids) for parent, pages in self.children.items() for p, ids in pages.items()
        ]
        if len(listed) != len(self._parent_of) or any(
            self._parent_of.get(p) != parent for parent, p, _ in listed
        ):
            fail("the partial-match index and its parents disagree")
        for parent, p, ids in listed:
            if p not in self.hash_of_page or page_hash(parent, ids) != self.hash_of_page[p]:
                fail(f"page {p} is listed for partial matches under a key it does not hold")
