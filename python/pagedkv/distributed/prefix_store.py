"""A prefix cache shared by several instances through a page store (Redis).

Every page that becomes cached in one instance's pool is published, once
its step has written it, under the manager's chained page key (salt
included: tenants never share); the value is the page's bytes in every
layer. Another instance (or the same one after a restart) whose prompt
misses its own pool looks the following pages up in the store before it
prefills, copies the pages it finds into fresh pool pages, and prefills
only the rest. Since every cached page is published, the pages a pool
evicts stay findable; the store's own limit (Redis ``maxmemory`` with an
LRU policy, or ``ttl_seconds``) bounds it.

A value carries a header: a magic, the layout fingerprint (model id, page
geometry, dtype, layers; pages of another model or layout are never
read), the payload's length and its BLAKE2b digest. A value that is
truncated, altered or foreign stops the lookup there and counts in
``stats.rejected``: those pages are recomputed, never served. A store that
cannot be reached is a miss (``stats.errors``), never a failed request.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from ..cache.kv_events import BlockStored, KVCacheEvent
from ..cache.manager import PagedKVCacheManager
from ..cache.page_pool import OutOfPagesError, chain_keys, salt_root
from ..graphs.kv_connector import KVConnector
from .page_layout import page_layout

__all__ = ["PageCodec", "PrefixStoreStats", "RedisPageStore", "SharedPrefixCache"]

log = logging.getLogger("pagedkv.distributed")

_MAGIC = b"PKVP\x01"
_HEADER = struct.Struct(">5s16sQ16s")  # magic, fingerprint, payload length, digest


class PageCodec:
    """Pages' bytes to checked store values and back, for one layout.

    Examples
    --------
    >>> codec = PageCodec("model-a")
    >>> value = codec.encode(b"page bytes")
    >>> codec.decode(value), codec.decode(value[:-1]), PageCodec("model-b").decode(value)
    (b'page bytes', None, None)
    """

    def __init__(self, layout: str) -> None:
        self.fingerprint = hashlib.blake2b(layout.encode(), digest_size=16).digest()

    @staticmethod
    def _digest(payload: bytes) -> bytes:
        return hashlib.blake2b(payload, digest_size=16).digest()

    def encode(self, payload: bytes) -> bytes:
        header = _HEADER.pack(_MAGIC, self.fingerprint, len(payload), self._digest(payload))
        return header + payload

    def decode(self, value: bytes | None) -> bytes | None:
        """The payload, or None for a missing, truncated, altered or foreign value."""
        if value is None or len(value) < _HEADER.size:
            return None
        magic, fingerprint, length, digest = _HEADER.unpack_from(value)
        payload = value[_HEADER.size :]
        if magic != _MAGIC or fingerprint != self.fingerprint or length != len(payload):
            return None
        return payload if self._digest(payload) == digest else None


class RedisPageStore:
    """Page values by name in Redis: MGET to find, pipelined SET NX to publish.

    Parameters
    ----------
    url : str
        The server, e.g. ``"redis://127.0.0.1:6379/0"``.
    ttl_seconds : int, optional
        Each value's lifetime (None: until Redis evicts it).
    timeout : float
        Seconds a command may take before it counts as an error.
    """

    def __init__(self, url: str, ttl_seconds: int | None = None, timeout: float = 2.0) -> None:
        import redis

        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        self.url = url
        self.ttl_seconds = ttl_seconds

    def get(self, names: Sequence[str]) -> list[bytes | None]:
        return self.client.mget(names) if names else []

    def put(self, items: Sequence[tuple[str, bytes]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name, value in items:
            pipe.set(name, value, nx=True, ex=self.ttl_seconds)
        pipe.execute()


@dataclass
class PrefixStoreStats:
    """Counters since the shared cache was made (pages count once for all
    layers)."""

    fetched: int = 0
    """Pages copied from the store into the pool instead of prefilled."""
    published: int = 0
    """Pages written to the store."""
    rejected: int = 0
    """Store values refused (truncated, altered, foreign): recomputed."""
    errors: int = 0
    """Store calls that failed (unreachable, timed out): treated as misses."""


class SharedPrefixCache(KVConnector):
    """One manager's prefix cache extended through a page store: a
    scheduler connector (pagedkv.graphs.kv_connector).

    Parameters
    ----------
    manager : PagedKVCacheManager
        The instance's pages (host pools: NumPy arrays or CPU torch tensors).
    store : RedisPageStore
        Where pages are published and found (anything with ``get(names)`` and
        ``put([(name, value)])``).
    model_id : str
        What computed the pages (model and weights form): instances share
        pages only when it and the pool layout agree.
    namespace : str
        The first part of every name in the store.

    Notes
    -----
    The scheduler calls :meth:`fetch` right after ``manager.add`` and
    :meth:`after_step` after every step: it publishes what a step that ran
    cached, and forgets what a failed one cached (it may hold nothing valid).

    Examples
    --------
    >>> shared = SharedPrefixCache(manager, RedisPageStore(url), "smollm2:gguf")  # doctest: +SKIP
    >>> cached = manager.add("r1", prompt)  # doctest: +SKIP
    >>> cached = shared.fetch("r1", prompt, cached)  # plus the store's  # doctest: +SKIP
    """

    def __init__(
        self,
        manager: PagedKVCacheManager,
        store,
        model_id: str,
        namespace: str = "pagedkv",
    ) -> None:
        self.manager = manager
        self.store = store
        self.codec = PageCodec(page_layout(manager, model_id))
        self.prefix = f"{namespace}:{self.codec.fingerprint.hex()}:"
        self.stats = PrefixStoreStats()
        self._pending: list[bytes] = []
        self._fetched: set[bytes] = set()
        self.unsubscribe = manager.subscribe(self._on_event)

    def _on_event(self, event: KVCacheEvent) -> None:
        # Group 0 names every key: the groups cache the same keys together.
        if isinstance(event, BlockStored) and not event.group_idx:
            self._pending.extend(event.block_hashes)

    def name(self, key: bytes) -> str:
        return self.prefix + key.hex()

    # -------------------------------------------------------------- reading

    def fetch(
        self,
        request_id: Hashable,
        tokens: Sequence[int] | np.ndarray,
        cached_tokens: int,
        request=None,
        salt: str | bytes | None = None,
    ) -> int:
        """Extends a just-added request by the store's pages that follow its
        pool hit; returns its cached tokens (cached_tokens plus page_size for
        each page fetched). `tokens` and `salt` are those given to add().
        Fetches no more pages than the pool has free; a short pool, a miss
        or a refused value ends the run of pages there."""
        m = self.manager
        size = m.page_size
        ids = np.asarray(tokens, dtype=np.int64)
        first = cached_tokens // size
        count = min(len(ids) // size - first, m.num_free_pages)
        if count <= 0 or m.seq_len(request_id) != cached_tokens:
            return cached_tokens
        keys = chain_keys(salt_root(salt), ids[: (first + count) * size], size)[first:]
        try:
            values = self.store.get([self.name(k) for k in keys])
        except Exception as e:  # the store is an optimisation: a failure is a miss
            self._error("find pages", e)
            return cached_tokens
        payloads = []
        for value in values:
            payload = self.codec.decode(value)
            if payload is None:
                self.stats.rejected += value is not None
                break
            payloads.append(payload)
        if not payloads:
            return cached_tokens
        n = len(payloads)
        try:
            m.reserve([request_id], n * size)  # hashes them with the add()'s ids
        except OutOfPagesError:  # a window group short of pages: prefill instead
            return cached_tokens
        for i, payload in enumerate(payloads):
            self._write_page(request_id, first + i, payload)
        self._fetched.update(keys[:n])
        self.stats.fetched += n
        return cached_tokens + n * size

    def _write_page(self, request_id: Hashable, slot: int, payload: bytes) -> None:
        m = self.manager
        pages = [int(m.pages(request_id, g)[slot]) for g in range(len(m.layer_groups))]
        at = 0
        for layer, pool in enumerate(m.pools):
            target = _page_view(pool, pages[m.group_of_layer[layer]])
            target[...] = np.frombuffer(payload, np.uint8, target.size, at).reshape(target.shape)
            at += target.size

    # -------------------------------------------------------------- writing

    def publish(self) -> int:
        """Writes the pages cached since the last call (their step has run)
        to the store, except those it came from; returns how many."""
        keys, self._pending = self._pending, []
        m = self.manager
        items = []
        for key in dict.fromkeys(keys):
            if key in self._fetched:
                self._fetched.discard(key)
                continue
            pages = [pool.page_of_hash.get(key) for pool in m.page_pools]
            if any(p is None for p in pages):
                continue  # evicted again within the step
            payload = b"".join(
                _page_view(pool, pages[m.group_of_layer[layer]]).tobytes()
                for layer, pool in enumerate(m.pools)
            )
            items.append((self.name(key), self.codec.encode(payload)))
        if not items:
            return 0
        try:
            self.store.put(items)
        except Exception as e:
            self._error("publish pages", e)
            return 0
        self.stats.published += len(items)
        return len(items)

    def discard(self) -> None:
        """Forgets the pages cached since the last publish (a failed step)."""
        self._pending = []

    def after_step(self, ran: bool) -> None:
        if ran:
            self.publish()
        else:
            self.discard()

    def _error(self, what: str, error: Exception) -> None:
        if not self.stats.errors:
            log.warning("prefix store: cannot %s (%s: %s)", what, type(error).__name__, error)
        self.stats.errors += 1


def _page_view(pool, page: int) -> np.ndarray:
    """A page of one layer's host pool as writable bytes (NumPy or CPU torch)."""
    if isinstance(pool, np.ndarray):
        return pool[page].view(np.uint8)
    import torch

    return pool[page].view(torch.uint8).numpy()
