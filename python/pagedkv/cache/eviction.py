"""Eviction policies of the prefix cache: which cached page a new allocation
reclaims first.

A policy only orders the *evictable* pages: full pages with a prefix hash that
no request owns and that are not pinned. The page pool
(:class:`pagedkv.cache.page_pool.PagePool`) tells it when a page enters that set
(:meth:`EvictionPolicy.insert`), leaves it because a prompt reused it
(:meth:`EvictionPolicy.remove`), is read by a prefix hit while owned
(:meth:`EvictionPolicy.touch`), and loses its hash for good
(:meth:`EvictionPolicy.forget`). The pool evicts the pages
:meth:`EvictionPolicy.victims` names, in that order, and calls ``remove`` then
``forget`` on each.

NOTE: ``victims`` must not change the policy: the pool peeks at victims
before it knows an operation will succeed (all-or-nothing operations).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from .._checks import check_int


@runtime_checkable
class EvictionPolicy(Protocol):
    """The interface PagePool drives; see the module docstring.

    Invariants the pool relies on: ``len(policy)`` and ``page in policy``
    describe exactly the evictable set; iteration yields it in eviction order;
    ``victims(n)`` is the first n pages of that order and changes nothing.
    """

    def insert(self, page: int) -> None:
        """The page became evictable (its last owner released it)."""

    def remove(self, page: int) -> None:
        """The page stops being evictable (reused, pinned or evicted)."""

    def touch(self, page: int) -> None:
        """A prefix hit read the page (owned or evictable)."""

    def forget(self, page: int) -> None:
        """The page lost its prefix hash: drop any history kept for it."""

    def victims(self, count: int) -> list[int]:
        """The first ``count`` pages to evict, in order (count <= len(self))."""

    def state(self) -> object:
        """A comparable copy of the policy's bookkeeping (for snapshots)."""

    def __len__(self) -> int: ...

    def __contains__(self, page: object) -> bool: ...

    def __iter__(self) -> Iterator[int]: ...


class LRUPolicy:
    """Least recently released first (the manager's behaviour before policies).

    A request's pages are released tail first, so the tail of a prefix is
    evicted before its head.

    Examples
    --------
    >>> p = LRUPolicy()
    >>> for page in (3, 1, 2):
    ...     p.insert(page)
    >>> p.victims(2)
    [3, 1]
    """

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, page: int) -> None:
        self._order[page] = None

    def remove(self, page: int) -> None:
        self._order.pop(page, None)

    def touch(self, page: int) -> None:
        # Recency counts from the release: an owned page is not in the order.
        pass

    def forget(self, page: int) -> None:
        pass

    def victims(self, count: int) -> list[int]:
        return list(itertools.islice(self._order, count))

    def state(self) -> object:
        return list(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, page: object) -> bool:
        return page in self._order

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)


class LFUPolicy:
    """Least frequently used first, least recently released among equals.

    A page's frequency counts the prefix hits it served since it was cached
    (a system prompt reused by every request outlives a one-off prompt's pages
    released after it); ``forget`` resets it when the page loses its hash.
    Frequencies are capped at ``max_frequency`` so that a once-hot page whose
    traffic stopped ages out after a bounded number of newer hot pages.

    Examples
    --------
    >>> p = LFUPolicy()
    >>> p.insert(1); p.insert(2)
    >>> p.touch(1)
    >>> p.victims(2)
    [2, 1]
    """

    def __init__(self, max_frequency: int = 8) -> None:
        self.max_frequency = check_int("max_frequency", max_frequency, 1)
        self._frequency: dict[int, int] = {}
        # page -> release tick; the order key is (frequency, tick).
        self._released: dict[int, int] = {}
        self._tick = 0

    def insert(self, page: int) -> None:
        self._tick += 1
        self._released[page] = self._tick

    def remove(self, page: int) -> None:
        self._released.pop(page, None)

    def touch(self, page: int) -> None:
        self._frequency[page] = min(self._frequency.get(page, 0) + 1, self.max_frequency)

    def forget(self, page: int) -> None:
        self._frequency.pop(page, None)

    def _key(self, page: int) -> tuple[int, int]:
        return self._frequency.get(page, 0), self._released[page]

    def victims(self, count: int) -> list[int]:
        return heapq.nsmallest(count, self._released, key=self._key)

    def state(self) -> object:
        return dict(self._frequency), list(self)

    def __len__(self) -> int:
        return len(self._released)

    def __contains__(self, page: object) -> bool:
        return page in self._released

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._released, key=self._key))


POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy}
"""The names PagedKVCacheManager(eviction=...) accepts."""


def make_policy(eviction: str | EvictionPolicy) -> EvictionPolicy:
    """A policy from its name ("lru", "lfu") or a policy object (used as is;
    it must be empty)."""
    if isinstance(eviction, str):
        try:
            return POLICIES[eviction]()
        except KeyError:
            names = sorted(POLICIES)
            raise ValueError(f"eviction must be one of {names}, got {eviction!r}") from None
    if not isinstance(eviction, EvictionPolicy):
        raise TypeError(f"eviction must be a policy name or an EvictionPolicy, got {eviction!r}")
    if len(eviction):
        raise ValueError("eviction: the policy object must be empty")
    return eviction
