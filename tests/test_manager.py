"""PagedKVCacheManager and the functional API, through the real kernels.

The state machine drives random adds (salted or not), reserves + appends
(token ids given, remembered from add(), or unknown), forks, releases, pins,
unpins and prefix-cache resets against a plain model (each live request's
token ids and tenant) and after every step reads every request back with
pagedkv.gather_kv: the K/V of token i is a pure function of the request's
tokens 0..i, so a page served from the prefix cache or shared by a fork reads
back right only if it really holds that prefix. A subscriber replays the KV
events into a router's view, which must equal the manager's cached hashes.
Its window-and-offload configurations add a sliding-window layer group (the
model predicts which slots it gave back) and a host tier: every keyed page,
in the pools and in the host tiers, must hold its prefix's K/V bit for bit,
so a page copied out and back is checked whenever a request reads it.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import pagedkv
from conftest import bits, to_device
from pagedkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.cache.manager import (
    PAD_PAGE,
    CacheStateError,
    OutOfPagesError,
    PagedKVCacheManager,
    page_hash,
    salt_root,
)
from pagedkv.functional import (
    BlockTable,
    allocate_blocks,
    append_kv,
    gather_kv,
    init_paged_kv_cache,
    release_blocks,
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


SALTS = [None, None, "tenant-a", b"tenant-b"]
"""Tenants of the machine's requests (None, the unsalted cache, most often)."""


class ManagerMachine(RuleBasedStateMachine):
    """Random traffic on a 16-page pool; the model is each request's tokens
    and tenant, the pins and the router's view of the events, and with layer
    groups the slots each window group has given back."""

    layout = "NHD"
    num_pages = 16
    eviction = "lru"
    max_pinned_pages = 4
    layer_groups = None
    offload = 0

    def __init__(self) -> None:
        super().__init__()
        self.manager = PagedKVCacheManager(
            self.num_pages,
            PAGE,
            HEADS,
            DIM,
            num_layers=LAYERS,
            kv_layout=self.layout,
            eviction=self.eviction,
            max_pinned_pages=self.max_pinned_pages,
            layer_groups=self.layer_groups,
            offload=self.offload,
        )
        self.windows = [w for _, w in self.manager.layer_groups]
        self.model: dict[int, list[int]] = {}
        self.room: dict[int, int] = {}
        """Slots each request has: its page table and its set-aside pages."""
        self.first: dict[int, list[int]] = {}
        """Per request and group, the slots given back (window groups)."""
        self.salt: dict[int, str | bytes | None] = {}
        self.pending: dict[int, list[int]] = {}
        """The prompt ids add() remembered that no reserve() has used yet."""
        self.pinned: list[dict[int, bytes]] = [{} for _ in self.windows]
        """Per group, pinned page -> its hash at pin time: it must keep both."""
        self.prefix_of_key: dict[bytes, tuple[int, ...]] = {}
        """Every page key seen -> the tokens up to the end of its page."""
        self.router = Router()
        self.manager.subscribe(self.router)
        self.next_id = 0
        self.hits_seen = 0
        self.copies_seen = 0
        self.remembered_seen = 0
        self.set_aside_seen = 0
        self.pins_seen = 0
        self.salted_hits = 0
        self.given_back = 0

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def first_slot(self, group: int, start: int) -> int:
        """The model's rule: a query at start sees start - window + 1 on."""
        window = self.windows[group]
        return 0 if window is None else max(0, (start - window + 1) // PAGE)

    def reserve_and_append(
        self, ids: list[int], new_tokens: list[list[int]], hashed: bool, num_steps: int = 1
    ) -> bool:
        if not hashed:
            # Without ids, reserve() takes the remembered prompt's: append those.
            new_tokens = [
                self.pending[rid][: len(t)] + t[len(self.pending[rid]) :]
                for rid, t in zip(ids, new_tokens, strict=True)
            ]
        before = state_of(self.manager)
        events = self.router.count
        counts = [len(t) for t in new_tokens]
        try:
            self.manager.reserve(ids, counts, new_tokens if hashed else None, num_steps=num_steps)
        except OutOfPagesError as e:
            pool = self.manager.page_pools[e.group_idx or 0]
            assert e.requested > e.available == pool.num_free
            assert f"{e.requested} asked for, {e.available} free" in str(e)
            assert_same_state(self.manager, before)
            assert self.router.count == events, "a failed call emitted events"
            return False
        histories = [self.model[rid] for rid in ids]
        append_tokens(self.manager, ids, new_tokens, histories)
        for rid, tokens in zip(ids, new_tokens, strict=True):
            if tokens:
                # Pages owned: the table's plus those set aside for later steps.
                steps = -(-(len(self.model[rid]) + len(tokens) * num_steps) // PAGE)
                self.room[rid] = max(self.room[rid], steps)
                self.set_aside_seen += len(self.manager.ahead_pages(rid, 0))
                # Window groups give back what this step's first query cannot see.
                start = len(self.model[rid])
                first = [max(f, self.first_slot(g, start)) for g, f in enumerate(self.first[rid])]
                self.given_back += sum(first) - sum(self.first[rid])
                self.first[rid] = first
            self.model[rid] = self.model[rid] + tokens
            self.pending[rid] = self.pending[rid][len(tokens) :]
        return True

    @rule(
        shared=st.integers(0, len(BASE)),
        extra=st.lists(st.integers(0, 1), max_size=6),
        hashed=st.sampled_from(["given", "remembered", "unknown"]),
        salt=st.sampled_from(SALTS),
    )
    def add(self, shared: int, extra: list[int], hashed: str, salt) -> None:
        self.start(BASE[:shared] + extra, hashed, salt)

    @precondition(lambda self: self.model)
    @rule(
        data=st.data(),
        extra=st.lists(st.integers(0, 1), max_size=3),
        hashed=st.sampled_from(["given", "remembered"]),
        other_tenant=st.booleans(),
    )
    def next_turn(self, data: st.DataObject, extra: list[int], hashed: str, other_tenant) -> None:
        """A conversation's next turn: a live request's tokens and more, from
        its tenant (hits) or another one (no shared page, checked below)."""
        rid = data.draw(st.sampled_from(sorted(self.model)))
        salt = self.salt[rid]
        if other_tenant:
            salt = data.draw(st.sampled_from([s for s in SALTS if s != salt]))
        self.start(self.model[rid] + extra, hashed, salt)

    def start(self, prompt: list[int], hashed: str, salt) -> None:
        rid = self.new_id()
        hits_before = self.manager.stats.prefix_hits
        cached = self.manager.add(rid, None if hashed == "unknown" else prompt, salt=salt)
        assert cached % PAGE == 0 and 0 <= cached <= len(prompt)
        assert self.manager.stats.prefix_hits - hits_before == cached // PAGE
        if hashed == "unknown":
            assert cached == 0
        self.hits_seen += cached // PAGE
        self.salted_hits += cached // PAGE if salt is not None else 0
        self.model[rid] = prompt[:cached]
        self.room[rid] = cached // PAGE
        self.first[rid] = [self.first_slot(g, cached) for g in range(len(self.windows))]
        self.salt[rid] = salt
        self.pending[rid] = [] if hashed == "unknown" else prompt[cached:]
        # "remembered": reserve() is not given the ids; add() kept them.
        if self.reserve_and_append([rid], [prompt[cached:]], hashed == "given"):
            self.remembered_seen += hashed == "remembered" and len(prompt) >= cached + PAGE

    @precondition(lambda self: self.model)
    @rule(data=st.data(), hashed=st.booleans(), num_steps=st.sampled_from([2, 1, 4]))
    def append(self, data: st.DataObject, hashed: bool, num_steps: int) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        new_tokens = [data.draw(st.lists(st.integers(0, 1), max_size=6)) for _ in ids]
        copies = self.manager.stats.cow_copies
        if self.reserve_and_append(ids, new_tokens, hashed, num_steps):
            self.copies_seen += self.manager.stats.cow_copies - copies

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.model)))
        child = self.new_id()
        free = self.manager.num_free_pages
        self.manager.fork(parent, child)
        assert self.manager.num_free_pages == free
        self.model[child] = list(self.model[parent])
        self.room[child] = -(-len(self.model[child]) // PAGE)  # set-aside pages stay
        self.first[child] = list(self.first[parent])
        self.salt[child] = self.salt[parent]
        self.pending[child] = list(self.pending[parent])
        # Beam search writes into the child at once: copy-on-write of a
        # shared partial page, whatever else the run's other rules do.
        if data.draw(st.booleans()):
            copies = self.manager.stats.cow_copies
            tokens = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=3))
            if self.reserve_and_append([child], [tokens], data.draw(st.booleans())):
                self.copies_seen += self.manager.stats.cow_copies - copies

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.end(data.draw(st.sampled_from(sorted(self.model))))

    def end(self, rid: int) -> None:
        self.manager.release(rid)
        del self.model[rid]
        del self.room[rid]
        del self.first[rid]
        del self.salt[rid]
        del self.pending[rid]

    @precondition(lambda self: self.offload and self.model)
    @rule(data=st.data())
    def crowd(self, data: st.DataObject) -> None:
        """A request ends, one without token ids takes some free pages and
        leaves (the pools evict cached pages into the host tiers), and the
        first one's conversation comes back: its prefix hit copies them back."""
        rid = data.draw(st.sampled_from(sorted(self.model)))
        tokens, salt = self.model[rid], self.salt[rid]
        self.end(rid)
        pools = self.manager.page_pools
        free = min(pool.num_free for pool in pools)
        unused = max(len(pool.free) for pool in pools)
        if free:
            # Past the unused pages, so that it evicts.
            pages = data.draw(st.integers(min(unused + 1, free), free))
            crowd = self.new_id()
            self.start([0] * (pages * PAGE), "unknown", None)
            if crowd in self.model:
                self.end(crowd)
        self.start(tokens + data.draw(st.lists(st.integers(0, 1), max_size=2)), "given", salt)

    @rule(data=st.data(), salt=st.sampled_from(SALTS), unpin=st.booleans())
    def pin(self, data: st.DataObject, salt, unpin: bool) -> None:
        tokens = data.draw(
            st.sampled_from([BASE, *self.model.values()]) if self.model else st.just(BASE)
        )
        manager = self.manager
        ids = np.array(tokens, np.int64)
        pools = manager.page_pools
        if unpin:
            # Walk the prompt's keys while any group's pool holds one.
            walked: list[list[int]] = [[] for _ in pools]
            chain = salt_root(salt)
            for start in range(0, len(ids) - PAGE + 1, PAGE):
                chain = page_hash(chain, ids[start : start + PAGE])
                found = [pool.page_of_hash.get(chain) for pool in pools]
                if all(p is None for p in found):
                    break
                for g, page in enumerate(found):
                    if page is not None:
                        walked[g].append(page)
            want = max(sum(p in self.pinned[g] for p in walked[g]) for g in range(len(pools)))
            assert manager.unpin(tokens, salt) == PAGE * want
            for g, pages in enumerate(walked):
                for page in pages:
                    self.pinned[g].pop(page, None)
            return
        # A pin takes, in each group, the pages a prefix hit would reuse.
        count, hit, _ = manager._find_hit(ids, salt_root(salt), reload=False)
        new = [
            {p: pool.hash_of_page[p] for p in hit[g][0] if p not in self.pinned[g]}
            for g, pool in enumerate(pools)
        ]
        if any(len(self.pinned[g]) + len(n) > self.max_pinned_pages for g, n in enumerate(new)):
            before = state_of(manager)
            with pytest.raises(ValueError, match="max_pinned_pages"):
                manager.pin(tokens, salt)
            assert_same_state(manager, before)
            return
        assert manager.pin(tokens, salt) == PAGE * count
        for g, n in enumerate(new):
            self.pinned[g].update(n)
            self.pins_seen += len(n)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.manager.reset_prefix_cache()
        for pinned in self.pinned:
            pinned.clear()
        assert self.manager.num_cached_pages == 0

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def exhaust(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        before = state_of(self.manager)
        with pytest.raises(OutOfPagesError):
            self.manager.reserve(ids, self.num_pages * PAGE + 1)
        assert_same_state(self.manager, before)

    @invariant()
    def pages_match_model(self) -> None:
        manager = self.manager
        manager.validate()
        assert sorted(manager.request_ids) == sorted(self.model)
        for rid, tokens in self.model.items():
            assert manager.seq_len(rid) == len(tokens)
            # Every page key of a live request names its prefix from now on.
            chain = salt_root(self.salt[rid])
            for start in range(0, len(tokens) - PAGE + 1, PAGE):
                chain = page_hash(chain, np.array(tokens[start : start + PAGE], np.int64))
                self.prefix_of_key[chain] = tuple(tokens[: start + PAGE])
        for g, pool in enumerate(manager.page_pools):
            self.check_group(g, pool)
        # The events told the router exactly which hashes are cached, where.
        assert self.router.held == Router.expected(manager)
        check_reads_back(manager, self.model)
        self.check_keyed_pages()

    def check_group(self, g: int, pool) -> None:
        manager = self.manager
        owners = np.zeros(self.num_pages, np.int64)
        holders: dict[int, list[tuple[int, int]]] = {}
        for rid, tokens in self.model.items():
            pages = manager.pages(rid, g)
            assert len(pages) == -(-len(tokens) // PAGE)
            first = self.first[rid][g]
            # Given-back slots hold the null page; the window's pages are the request's.
            assert null_slots(manager, rid, g) == first, (rid, g, pages)
            live = pages[first:]
            owners[live] += 1
            ahead = manager.ahead_pages(rid, g)
            assert len(pages) + len(ahead) == self.room[rid]
            owners[ahead] += 1
            for slot, page in enumerate(live.tolist(), start=first):
                holders.setdefault(page, []).append((rid, slot))
        np.testing.assert_array_equal(manager.refcounts(g), owners)
        # Free + used (+ cached, counted among free) + idle pinned = pool: no page leaks.
        pinned = self.pinned[g]
        idle_pinned = sum(owners[p] == 0 for p in pinned)
        assert pool.num_free + int((owners > 0).sum()) + idle_pinned == self.num_pages
        assert pool.num_used == int((owners > 0).sum())
        # Pins hold: every pinned page keeps the hash it had when pinned.
        assert set(pool.pinned) == set(pinned)
        assert all(pool.hash_of_page[p] == key for p, key in pinned.items())
        assert len(pool.pinned) <= self.max_pinned_pages
        # A page held by several requests holds the same tokens for each.
        for page, held in holders.items():
            contents = {
                tuple(self.model[rid][slot * PAGE : (slot + 1) * PAGE]) for rid, slot in held
            }
            prefixes = {tuple(self.model[rid][: slot * PAGE]) for rid, slot in held}
            assert len(contents) == 1 and len(prefixes) == 1, f"page {page}: {held}"
            # Tenant isolation: only one tenant's requests share a page.
            tenants = {self.salt[rid] for rid, _ in held}
            assert len(tenants) == 1, f"page {page} shared by tenants {tenants}: {held}"

    def check_keyed_pages(self) -> None:
        """Every keyed page, in each group's pool and host tier, holds the
        K/V of its key's prefix bit for bit (copies out and back included)."""
        manager = self.manager
        for layer, group in enumerate(manager.group_of_layer):
            tiers = [(manager.page_pools[group], manager.pools[layer])]
            if manager.host_page_pools[group] is not None:
                tiers.append((manager.host_page_pools[group], manager.host_pools[layer]))
            for pool, tensor in tiers:
                for page, key in pool.hash_of_page.items():
                    prefix = self.prefix_of_key[key]
                    want = kv_of(list(prefix), len(prefix) - PAGE)[layer]  # [2, PAGE, H, D]
                    got = tensor[page]
                    if self.layout == "HND":
                        got = got.transpose(0, 2, 1, 3)
                    np.testing.assert_array_equal(got, want, err_msg=f"page {page} of {key!r}")


class ManagerMachineHND(ManagerMachine):
    layout = "HND"
    num_pages = 12
    eviction = "lfu"


class ManagerMachineWindows(ManagerMachine):
    """A window group (window 6: not a multiple of the page) beside a full
    one, in 12-page pools with 6-page host tiers."""

    num_pages = 12
    layer_groups = [([1], 6), ([0], None)]
    offload = 6


class ManagerMachineWindowsHND(ManagerMachine):
    """The same in HND pools with LFU eviction, a window of one page and a
    smaller host tier, so that it evicts host pages too."""

    layout = "HND"
    num_pages = 12
    eviction = "lfu"
    layer_groups = [([0], None), ([1], PAGE)]
    offload = 3


MACHINE_SETTINGS = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def run_machine(machine, machine_settings) -> dict[str, int]:
    names = ["hits", "copies", "remembered", "salted_hits", "pins", "events", "set_aside"]
    if machine.layer_groups is not None:
        names.append("given_back")
    if machine.offload:
        names += ["offloads", "reloads"]
    totals = dict.fromkeys(names, 0)

    class Counted(machine):
        def teardown(self) -> None:
            totals["hits"] += self.hits_seen
            totals["copies"] += self.copies_seen
            totals["remembered"] += self.remembered_seen
            totals["salted_hits"] += self.salted_hits
            totals["pins"] += self.pins_seen
            totals["events"] += self.router.count
            totals["set_aside"] += self.set_aside_seen
            if "given_back" in totals:
                totals["given_back"] += self.given_back
            if "offloads" in totals:
                totals["offloads"] += self.manager.stats.offloads
                totals["reloads"] += self.manager.stats.reloads

    run_state_machine_as_test(Counted, settings=machine_settings)
    return totals


MACHINES = [ManagerMachine, ManagerMachineHND, ManagerMachineWindows, ManagerMachineWindowsHND]
MACHINE_IDS = ["NHD-lru", "HND-lfu", "windows-offload-NHD-lru", "windows-offload-HND-lfu"]


@pytest.mark.parametrize("machine", MACHINES, ids=MACHINE_IDS)
def test_state_machine(machine):
    totals = run_machine(machine, MACHINE_SETTINGS)
    # The traffic really exercised prefix hits (salted ones too), copy-on-write,
    # remembered prompts, pins and events (and pages given back by a window
    # group, copied to a host tier and back).
    assert all(totals.values()), totals


@pytest.mark.slow
@pytest.mark.parametrize("machine", MACHINES, ids=MACHINE_IDS)
def test_state_machine_long(machine):
    """5 x 10^4 operations per machine (200 runs of 250 steps): minutes, so slow."""
    long_settings = settings(MACHINE_SETTINGS, max_examples=200, stateful_step_count=250)
    totals = run_machine(machine, long_settings)
    assert all(totals.values()), totals


# --------------------------------------------------------------- fixed cases


def prefilled(manager: PagedKVCacheManager, rid, tokens: list[int], hashed: bool = True) -> int:
    """add + reserve + append of a whole prompt; returns the cached tokens."""
    cached = manager.add(rid, tokens if hashed else None)
    history = tokens[:cached]
    manager.reserve([rid], len(tokens) - cached, [tokens[cached:]] if hashed else None)
    append_tokens(manager, [rid], [tokens[cached:]], [history])
    return cached


def test_prefix_cache_serves_a_repeated_prompt_without_new_pages():
    manager = PagedKVCacheManager(10, PAGE, HEADS, DIM, num_layers=LAYERS)
    prompt = BASE[: 3 * PAGE]
    assert prefilled(manager, "a", prompt) == 0
    assert (manager.stats.prefix_hits, manager.stats.prefix_misses) == (0, 3)
    free = manager.num_free_pages
    assert manager.add("b", prompt) == 3 * PAGE
    assert manager.num_free_pages == free
    assert (manager.stats.prefix_hits, manager.stats.prefix_misses) == (3, 3)
    np.testing.assert_array_equal(manager.pages("b"), manager.pages("a"))
    assert manager.refcounts()[manager.pages("a")].tolist() == [2, 2, 2]
    check_reads_back(manager, {"a": prompt, "b": prompt})
    # A prompt that diverges inside page 2 reuses pages 0 and 1 only.
    other = prompt[: 2 * PAGE] + [1] * PAGE
    assert manager.add("c", other) == 2 * PAGE
    assert manager.stats.prefix_misses == 4
    manager.validate()


def test_pages_filled_piecemeal_are_cached_and_unknown_tokens_stop_caching():
    """Chunked prefill and decode steps (token ids given) fill pages across
    calls; each page is cached once full. A step without token ids ends the
    caching of that request's later pages."""
    manager = PagedKVCacheManager(16, PAGE, HEADS, DIM, num_layers=LAYERS)
    history: list[int] = []
    manager.add("a", [])
    for chunk in ([7, 3], [5, 1, 2], [8, 6, 4, 9, 0], [3], [3]):  # 12 tokens
        manager.reserve(["a"], len(chunk), [chunk])
        append_tokens(manager, ["a"], [chunk], [history])
        history = history + chunk
    assert manager.add("b", history + [1]) == 3 * PAGE
    manager.reserve(["b"], 1, [[1]])
    append_tokens(manager, ["b"], [[1]], [history])
    check_reads_back(manager, {"a": history, "b": history + [1]})

    manager.reserve(["a"], 2)  # no token ids: a's page 3 will not be cached
    append_tokens(manager, ["a"], [[5, 5]], [history])
    manager.reserve(["a"], 2, [[5, 5]])
    append_tokens(manager, ["a"], [[5, 5]], [history + [5, 5]])
    longer = history + [5, 5, 5, 5]
    hits = manager.stats.prefix_hits
    assert manager.add("c", longer + [1]) == 3 * PAGE
    assert manager.stats.prefix_hits - hits == 3
    manager.validate()


def test_released_prompt_stays_cached_and_is_evicted_tail_first():
    manager = PagedKVCacheManager(6, PAGE, HEADS, DIM, num_layers=LAYERS)
    prompt = BASE[: 3 * PAGE]
    prefilled(manager, "a", prompt)
    manager.release("a")
    assert (manager.num_cached_pages, manager.num_free_pages) == (3, 6)
    manager.validate()
    # Fill the 3 unused pages and one more: the prompt's last page goes first.
    filler = [1] * (4 * PAGE)
    prefilled(manager, "x", filler, hashed=False)
    assert manager.stats.evictions == 1 and manager.num_cached_pages == 2
    check_reads_back(manager, {"x": filler})
    manager.release("x")
    assert manager.add("b", prompt) == 2 * PAGE
    rest = prompt[2 * PAGE :]
    manager.reserve(["b"], PAGE, [rest])
    append_tokens(manager, ["b"], [rest], [prompt[: 2 * PAGE]])
    check_reads_back(manager, {"b": prompt})
    # b cached its last page again: a third request gets the whole prompt.
    assert manager.add("c", prompt) == 3 * PAGE
    check_reads_back(manager, {"b": prompt, "c": prompt})
    manager.validate()


def test_fork_copies_a_shared_partial_page_on_first_write():
    manager = PagedKVCacheManager(8, PAGE, HEADS, DIM, num_layers=LAYERS)
    parent = BASE[: PAGE + 2]  # the last page holds 2 of 4 tokens
    prefilled(manager, "p", parent)
    manager.fork("p", "c")
    shared = manager.pages("p")
    np.testing.assert_array_equal(manager.pages("c"), shared)
    assert manager.refcounts()[shared].tolist() == [2, 2]

    manager.reserve(["c"], 1, [[9]])
    assert manager.stats.cow_copies == 1
    child_pages = manager.pages("c")
    assert child_pages[0] == shared[0] and child_pages[1] != shared[1]
    np.testing.assert_array_equal(manager.pages("p"), shared)
    assert manager.refcounts()[shared].tolist() == [2, 1]
    for pool in manager.pools:  # the copy holds the parent's 2 tokens, on every layer
        meta = manager.metadata(["p"], 0)
        k_parent, _ = pagedkv.gather_kv(
            pool, meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len, request=0
        )
        page_copy = pool[child_pages[1], :, :2]
        np.testing.assert_array_equal(page_copy[0], k_parent[PAGE:])
    append_tokens(manager, ["c"], [[9]], [parent])
    check_reads_back(manager, {"p": parent, "c": parent + [9]})

    # The parent's page is private now: its next write copies nothing.
    manager.reserve(["p"], 1, [[4]])
    append_tokens(manager, ["p"], [[4]], [parent])
    assert manager.stats.cow_copies == 1
    check_reads_back(manager, {"p": parent + [4], "c": parent + [9]})
    manager.validate()


def check_copy_on_write_of_torch_pools(device: str) -> None:
    """A fork's first write into its shared partial page copies that page,
    in every layer's torch pool on `device`, and leaves every other page as
    it was."""
    manager = PagedKVCacheManager(8, 4, 2, 64, num_layers=2, dtype="bfloat16", device=device)
    assert all(pool.device.type == device for pool in manager.pools)
    for pool in manager.pools:
        pool.copy_(torch.randn_like(pool))
    manager.add("parent")
    manager.reserve(["parent"], 6)  # its second page holds 2 of 4 tokens
    manager.fork("parent", "child")
    before = [pool.clone() for pool in manager.pools]
    manager.reserve(["child"], 1)
    source, copy = int(manager.pages("parent")[1]), int(manager.pages("child")[1])
    assert source != copy and manager.stats.cow_copies == 1
    others = [p for p in range(manager.num_pages) if p != copy]
    for pool, old in zip(manager.pools, before, strict=True):
        assert torch.equal(pool[copy], old[source])
        assert torch.equal(pool[others], old[others])
    manager.validate()


def test_copy_on_write_of_torch_pools():
    check_copy_on_write_of_torch_pools("cpu")


def test_fork_of_full_pages_copies_nothing():
    manager = PagedKVCacheManager(8, PAGE, HEADS, DIM)
    prefilled(manager, "p", BASE[: 2 * PAGE])
    manager.fork("p", "c")
    free = manager.num_free_pages
    manager.reserve(["p", "c"], 1)
    assert manager.stats.cow_copies == 0 and manager.num_free_pages == free - 2


def test_copy_on_write_counts_pages_exactly():
    """Two owners of a partial page writing in one call need one copy, not two;
    with one page too few the call fails and changes nothing."""
    manager = PagedKVCacheManager(4, PAGE, HEADS, DIM)
    prefilled(manager, "p", BASE[:2])
    manager.fork("p", "c")
    manager.fork("p", "d")
    filler = [1] * (2 * PAGE)
    prefilled(manager, "x", filler, hashed=False)
    assert manager.num_free_pages == 1
    before = state_of(manager)
    with pytest.raises(OutOfPagesError, match="2 asked for, 1 free"):
        manager.reserve(["c", "d"], 1)  # 3 owners, 2 writers: 2 copies
    assert_same_state(manager, before)
    manager.release("d")
    manager.reserve(["p", "c"], 1, [[4], [5]])  # 2 owners, 2 writers: 1 copy
    assert manager.stats.cow_copies == 1 and manager.num_free_pages == 0
    append_tokens(manager, ["p", "c"], [[4], [5]], [BASE[:2], BASE[:2]])
    check_reads_back(manager, {"p": BASE[:2] + [4], "c": BASE[:2] + [5], "x": filler})
    manager.validate()


def test_bad_calls_raise_and_change_nothing():
    manager = PagedKVCacheManager(6, PAGE, HEADS, DIM, num_layers=LAYERS)
    prefilled(manager, "a", BASE[:6])
    manager.fork("a", "b")
    prefilled(manager, "c", BASE[:8])
    manager.release("c")  # leaves cached pages
    prefilled(manager, "d", [1, 2, 3])
    assert manager.num_cached_pages > 0
    before = state_of(manager)
    calls = [
        (OutOfPagesError, "asked for", lambda: manager.reserve(["a"], 6 * PAGE)),
        (OutOfPagesError, "asked for", lambda: manager.reserve(["a", "d"], [1, 5 * PAGE])),
        (KeyError, "request_ids entry 'zz'", lambda: manager.reserve(["a", "zz"], 1)),
        (ValueError, "twice", lambda: manager.reserve(["a", "a"], 1)),
        (ValueError, "num_new_tokens must be >= 0", lambda: manager.reserve(["a", "d"], [1, -1])),
        (
            ValueError,
            "num_new_tokens must be an int or 2",
            lambda: manager.reserve(["a", "d"], [1]),
        ),
        (ValueError, "tokens holds 1 ids", lambda: manager.reserve(["a", "d"], 1, [5])),
        (ValueError, r"tokens\[1\] holds 2", lambda: manager.reserve(["a", "d"], 1, [[5], [5, 6]])),
        (ValueError, "tokens must have one entry", lambda: manager.reserve(["a"], 1, [[1], [2]])),
        (TypeError, "request_ids must be a sequence", lambda: manager.reserve("a", 1)),
        (ValueError, "already live", lambda: manager.add("a")),
        (ValueError, "tokens must be a 1-D", lambda: manager.add("n", [[1, 2]])),
        (ValueError, "already live", lambda: manager.fork("a", "d")),
        (KeyError, "parent_id 'zz'", lambda: manager.fork("zz", "n")),
        (KeyError, "request_id 'zz'", lambda: manager.release("zz")),
        (KeyError, "request_id 'zz'", lambda: manager.seq_len("zz")),
        (ValueError, "exceeds the 6 tokens", lambda: manager.metadata(["a"], 7)),
    ]
    for error, pattern, call in calls:
        with pytest.raises(error, match=pattern):
            call()
        assert_same_state(manager, before)
    # The same state takes a fitting reservation: the checks above are not vacuous.
    manager.reserve(["a", "d"], [1, 2])
    assert manager.snapshot() != before[0]
    manager.validate()


def test_out_of_pages_error_is_a_runtime_error_naming_the_counts():
    manager = PagedKVCacheManager(3, PAGE, HEADS, DIM)
    manager.add("a")
    with pytest.raises(RuntimeError, match="4 asked for, 3 free"):
        manager.reserve(["a"], 3 * PAGE + 1)


def test_metadata_is_flashinfer_csr_and_a_padded_block_table():
    manager = PagedKVCacheManager(20, PAGE, HEADS, DIM)
    lens = {"a": 9, "b": 0, "c": 4, "d": 13}
    for rid in lens:
        manager.add(rid)
    manager.reserve(list(lens), list(lens.values()))
    manager.reserve(["a", "d"], [3, 1])
    order = ["d", "b", "a", "c"]
    meta = manager.metadata(order)
    after = np.array([14, 0, 12, 4])
    appended = np.array([1, 0, 3, 0])  # the latest reserve(): b and c were not in it
    np.testing.assert_array_equal(meta.seq_lens, after)
    np.testing.assert_array_equal(np.diff(meta.append_indptr), appended)
    pages = [manager.pages(rid) for rid in order]
    np.testing.assert_array_equal(meta.kv_indptr, np.cumsum([0] + [len(p) for p in pages]))
    np.testing.assert_array_equal(meta.kv_indices, np.concatenate(pages))
    np.testing.assert_array_equal(meta.kv_last_page_len, [2, 0, 4, 4])
    np.testing.assert_array_equal(
        pagedkv.get_seq_lens(meta.kv_indptr, meta.kv_last_page_len, PAGE), after
    )
    want_b, want_p = pagedkv.get_batch_indices_positions(meta.append_indptr, meta.seq_lens, 4)
    np.testing.assert_array_equal(meta.batch_indices, want_b)
    np.testing.assert_array_equal(meta.positions, want_p)
    np.testing.assert_array_equal(meta.positions, [13, 9, 10, 11])
    assert meta.block_table.shape == (4, 4)
    for b, p in enumerate(pages):
        np.testing.assert_array_equal(meta.block_table[b, : len(p)], p)
        assert (meta.block_table[b, len(p) :] == PAD_PAGE).all()
    for x in (meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, meta.positions):
        assert x.dtype == np.int32
    explicit = manager.metadata(order, [0, 0, 2, 4])
    np.testing.assert_array_equal(explicit.positions, [10, 11, 0, 1, 2, 3])
    assert manager.metadata([]).kv_indptr.tolist() == [0]


def test_debug_mode_validates_after_every_mutation(monkeypatch):
    manager = PagedKVCacheManager(4, PAGE, HEADS, DIM)
    manager.add("a")
    manager.reserve(["a"], 5)
    manager._refcount[manager.pages("a")[0]] += 1  # corrupt on purpose
    monkeypatch.setenv("PAGEDKV_DEBUG", "0")
    manager.add("b")  # not checked
    monkeypatch.setenv("PAGEDKV_DEBUG", "1")
    with pytest.raises(CacheStateError, match="refcount 2 but 1 owners"):
        manager.add("c")
    with pytest.raises(CacheStateError):
        manager.validate()


def test_validate_catches_a_double_free():
    manager = PagedKVCacheManager(4, PAGE, HEADS, DIM)
    manager.add("a")
    manager.reserve(["a"], 2)
    manager.validate()
    manager._free.append(int(manager.pages("a")[0]))
    with pytest.raises(CacheStateError, match="has owners"):
        manager.validate()


@pytest.mark.parametrize(
    "dtype,kind",
    [("float16", np.ndarray), ("bfloat16", "torch"), ("float32", np.ndarray)],
)
def test_pool_shapes_and_kinds(dtype, kind):
    import torch

    nhd = PagedKVCacheManager(5, PAGE, HEADS, DIM, num_layers=3, dtype=dtype)
    hnd = PagedKVCacheManager(5, PAGE, HEADS, DIM, dtype=getattr(torch, dtype), kv_layout="HND")
    assert len(nhd.pools) == 3
    assert tuple(nhd.pools[0].shape) == (5, 2, PAGE, HEADS, DIM)
    assert tuple(hnd.pools[0].shape) == (5, 2, HEADS, PAGE, DIM)
    want = torch.Tensor if kind == "torch" else np.ndarray
    assert all(isinstance(pool, want) for pool in nhd.pools + hnd.pools)
    forced = PagedKVCacheManager(2, PAGE, HEADS, DIM, dtype=dtype, use_torch=True)
    assert isinstance(forced.pools[0], torch.Tensor)


def test_bad_construction_is_refused():
    with pytest.raises(ValueError, match="device must be 'cpu'"):
        PagedKVCacheManager(4, PAGE, HEADS, DIM, device="tpu")
    with pytest.raises(TypeError, match="dtype must be"):
        PagedKVCacheManager(4, PAGE, HEADS, DIM, dtype="int32")
    with pytest.raises(ValueError, match="kv_layout"):
        PagedKVCacheManager(4, PAGE, HEADS, DIM, kv_layout="HDN")
    with pytest.raises(ValueError, match="page_size must be an integer >= 1"):
        PagedKVCacheManager(4, 0, HEADS, DIM)


def test_torch_bfloat16_pools_round_trip():
    import torch

    manager = PagedKVCacheManager(6, PAGE, HEADS, DIM, dtype="bfloat16")
    manager.add("a")
    manager.reserve(["a"], 6)
    manager.fork("a", "b")
    manager.reserve(["b"], 1)
    assert manager.stats.cow_copies == 1
    rows = torch.arange(7 * HEADS * DIM, dtype=torch.float32).reshape(7, HEADS, DIM)
    rows = rows.to(torch.bfloat16)
    meta = manager.metadata(["a"], 6)
    pool = manager.pools[0]
    pagedkv.append_paged_kv_cache(
        rows[:6], -rows[:6], meta.batch_indices, meta.positions, pool,
        meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len,
    )  # fmt: skip
    k, v = pagedkv.gather_kv(
        pool, meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len, request=0
    )
    assert torch.equal(k, rows[:6]) and torch.equal(v, -rows[:6])


# --------------------------------------------------------------- functional


def test_functional_round_trip_and_unallocated_writes():
    cache = init_paged_kv_cache(8, PAGE, HEADS, DIM, num_layers=2, kv_layout="HND")
    table = allocate_blocks(cache, ["a", "b"], [6, 3])
    assert isinstance(table, BlockTable) and table.seq_ids == ("a", "b")
    np.testing.assert_array_equal(table.seq_lens, [6, 3])
    assert table.table.shape == (2, 2) and table.table[1, 1] == PAD_PAGE
    kv = np.concatenate([kv_of(BASE[:6]), kv_of([1, 2, 3])], axis=2)
    rows = np.array([0] * 6 + [1] * 3, np.int32)
    pos = np.array([0, 1, 2, 3, 4, 5, 0, 1, 2], np.int32)
    for layer in range(2):
        append_kv(cache, table, kv[layer, 0], kv[layer, 1], rows, pos, layer=layer)
    for layer in range(2):
        k, v = gather_kv(cache, table, layer=layer, request=0)
        np.testing.assert_array_equal(k, kv[layer, 0, :6])
        np.testing.assert_array_equal(v, kv[layer, 1, :6])
        k_all, _, indptr = gather_kv(cache, table, layer=layer)
        np.testing.assert_array_equal(k_all, kv[layer, 0])
        assert indptr.tolist() == [0, 6, 9]

    before = [bits(p) for p in cache.pools]
    one = kv[0, 0, :1]
    bad_writes = [
        # block 1 of row b is -1
        ([1], [PAGE], "block 1 of row 1 in block_table is unallocated"),
        # past the 2 columns of the table
        ([0], [40], "block 10 of row 0 in block_table is unallocated"),
        # inside b's page but past its 3 tokens
        ([1], [3], "past the sequence's seq_lens"),
        ([2], [0], "outside the 2 rows"),
        ([0], [-1], "negative"),
    ]
    for r, p, pattern in bad_writes:
        with pytest.raises(ValueError, match=pattern):
            append_kv(cache, table, one, one, np.array(r, np.int32), np.array(p, np.int32))
    for got, want in zip(before, cache.pools, strict=True):
        np.testing.assert_array_equal(got, bits(want))

    # Growing b by 2 tokens allocates its block 1; the write then goes through.
    table = allocate_blocks(cache, ["b"], 2)
    np.testing.assert_array_equal(table.seq_lens, [5])
    append_kv(cache, table, one, one, np.array([0], np.int32), np.array([PAGE], np.int32))

    # A block shared with a fork is refused until allocate_blocks copies it.
    cache.manager.fork("a", "a2")
    shared = BlockTable(("a2",), cache.manager.metadata(["a2"], 0).block_table, np.array([6]))
    with pytest.raises(ValueError, match="share"):
        append_kv(cache, shared, one, one, np.array([0], np.int32), np.array([5], np.int32))
    table = allocate_blocks(cache, ["a2"], 1)
    append_kv(cache, table, one, one, np.array([0], np.int32), np.array([5], np.int32))
    k, _ = gather_kv(cache, table, request=0)
    np.testing.assert_array_equal(k[5], one[0])
    k_a, _ = gather_kv(cache, allocate_blocks(cache, ["a"], 0), request=0)
    np.testing.assert_array_equal(k_a, kv[0, 0, :6])  # the parent is untouched

    # An allocation that does not fit changes nothing, new ids included.
    snapshot = cache.manager.snapshot()
    with pytest.raises(OutOfPagesError):
        allocate_blocks(cache, ["a", "new"], [1, 8 * PAGE])
    assert cache.manager.snapshot() == snapshot and "new" not in cache.manager
    release_blocks(cache, ["a", "a2", "b"])
    assert cache.manager.num_free_pages == 8
    cache.manager.validate()
    with pytest.raises(KeyError, match="not a live sequence"):
        release_blocks(cache, ["a"])


def test_functional_rejects_an_inconsistent_block_table():
    cache = init_paged_kv_cache(4, PAGE, HEADS, DIM)
    table = allocate_blocks(cache, ["a"], 5)
    holey = BlockTable(("a",), np.array([[table.table[0, 0], PAD_PAGE]], np.int32), np.array([5]))
    with pytest.raises(ValueError, match="block_table row 0 must hold 2 pages"):
        gather_kv(cache, holey)
    with pytest.raises(ValueError, match="layer must be in"):
        gather_kv(cache, table, layer=1)


# ------------------------------------------------------------------- decode


def softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """float64 decode attention of q [Hq, D] over k, v [L, Hkv, D] (GQA)."""
    group = q.shape[0] // k.shape[1]
    k64 = np.repeat(k.astype(np.float64), group, axis=1)
    v64 = np.repeat(v.astype(np.float64), group, axis=1)
    scores = np.einsum("hd,lhd->hl", q.astype(np.float64), k64) / np.sqrt(q.shape[1])
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    return np.einsum("hl,lhd->hd", p / p.sum(axis=1, keepdims=True), v64)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_metadata_drives_batch_decode(layout):
    head_dim, kv_heads, qo_heads, page = 64, 2, 4, 4
    rng = np.random.default_rng(7)
    manager = PagedKVCacheManager(24, page, kv_heads, head_dim, kv_layout=layout)
    prompt = list(range(9))
    for rid, tokens in (("a", prompt), ("b", prompt + [1, 2]), ("c", [5] * 3)):
        cached = manager.add(rid, tokens)
        manager.reserve([rid], len(tokens) - cached, [tokens[cached:]])
        meta = manager.metadata([rid])
        rows = rng.standard_normal((2, meta.nnz, kv_heads, head_dim), dtype=np.float32)
        pagedkv.append_paged_kv_cache(
            rows[0], rows[1], meta.batch_indices, meta.positions, manager.pools[0],
            meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len, layout,
        )  # fmt: skip
    assert manager.stats.prefix_hits == 2  # b reuses a's two full pages
    manager.fork("a", "a2")
    # One decode step: every request appends its new token, then attends.
    batch = ["a", "b", "c", "a2"]
    manager.reserve(batch, 1)
    meta = manager.metadata(batch)
    rows = rng.standard_normal((2, len(batch), kv_heads, head_dim), dtype=np.float32)
    pool = manager.pools[0]
    pagedkv.append_paged_kv_cache(
        rows[0], rows[1], meta.batch_indices, meta.positions, pool,
        meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len, layout,
    )  # fmt: skip
    wrapper = pagedkv.BatchDecodeWithPagedKVCacheWrapper(kv_layout=layout)
    wrapper.plan(
        meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
        qo_heads, kv_heads, head_dim, page, q_data_type="float32", kv_data_type="float32",
    )  # fmt: skip
    q = rng.standard_normal((len(batch), qo_heads, head_dim), dtype=np.float32)
    out = wrapper.run(q, pool)
    np.testing.assert_array_equal(meta.seq_lens, [10, 12, 4, 10])
    for b in range(len(batch)):
        k, v = pagedkv.gather_kv(
            pool, meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len, layout, request=b
        )
        np.testing.assert_array_equal(k[-1], rows[0, b])  # the step's own token is seen
        np.testing.assert_allclose(out[b], softmax_attention(q[b], k, v), rtol=1e-5, atol=1e-5)
    # a and a2 forked with a partial page, then wrote different tokens.
    assert manager.stats.cow_copies == 1
    assert not np.array_equal(out[0], out[3])


# ------------------------------------------- salts, events, policies, pins


def test_salts_isolate_tenants_and_equal_salts_share():
    manager = PagedKVCacheManager(16, PAGE, HEADS, DIM, num_layers=LAYERS)
    prompt = BASE[: 2 * PAGE + 1]
    manager.add("a", prompt, salt="alice")
    manager.reserve(["a"], len(prompt), [prompt])
    append_tokens(manager, ["a"], [prompt], [[]])
    assert manager.add("a2", prompt, salt="alice") == 2 * PAGE
    assert manager.add("b", prompt, salt="bob") == 0
    assert manager.add("n", prompt) == 0  # the unsalted cache is a tenant too
    assert manager.add("b2", prompt, salt=b"bob") == 0  # bob has cached nothing
    check_reads_back(manager, {"a": prompt, "a2": prompt[: 2 * PAGE], "b": [], "n": []})
    before = state_of(manager)
    with pytest.raises(TypeError, match="salt must be str, bytes or None"):
        manager.add("x", prompt, salt=7)
    assert_same_state(manager, before)


def test_kv_events_follow_vllm_schema():
    manager = PagedKVCacheManager(4, PAGE, HEADS, DIM)
    events: list = []
    stop = manager.subscribe(events.append)
    prompt = BASE[: 2 * PAGE + 1]
    manager.add("a", prompt)
    manager.reserve(["a"], len(prompt))  # ids remembered from add()
    (stored,) = events
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash is None and stored.block_size == PAGE
    assert stored.token_ids == prompt[: 2 * PAGE] and stored.medium == "CPU"
    first = page_hash(b"", np.array(prompt[:PAGE], np.int64))
    assert stored.block_hashes == [first, page_hash(first, np.array(prompt[PAGE : 2 * PAGE]))]
    # Filling page 2 later chains it on page 1.
    manager.reserve(["a"], PAGE - 1, [[0] * (PAGE - 1)])
    assert events[-1].parent_block_hash == stored.block_hashes[-1]
    assert events[-1].token_ids == prompt[2 * PAGE :] + [0] * (PAGE - 1)
    # A failed call emits nothing; an eviction emits BlockRemoved.
    count = len(events)
    with pytest.raises(OutOfPagesError):
        manager.reserve(["a"], 2 * PAGE)
    assert len(events) == count
    manager.release("a")
    manager.add("b")
    manager.reserve(["b"], 2 * PAGE)  # 1 unused page + the LRU cached one
    assert events[-1] == BlockRemoved([events[-2].block_hashes[0]], "CPU")
    manager.reset_prefix_cache()
    assert events[-1] == AllBlocksCleared()
    stop()
    manager.reset_prefix_cache()
    assert len(events) == count + 2


def cached_prompt(manager: PagedKVCacheManager, rid, prompt: list[int]) -> None:
    manager.add(rid, prompt)
    manager.reserve([rid], len(prompt) - manager.seq_len(rid))
    manager.release(rid)


@pytest.mark.parametrize("eviction,kept", [("lru", "cold"), ("lfu", "hot")])
def test_lfu_keeps_a_hot_prefix_that_lru_evicts(eviction, kept):
    manager = PagedKVCacheManager(3, PAGE, HEADS, DIM, eviction=eviction)
    hot, cold = [1] * PAGE, [2] * PAGE
    cached_prompt(manager, "h", hot)
    for i in range(3):  # three hits on the hot page
        cached_prompt(manager, f"h{i}", hot)
    cached_prompt(manager, "c", cold)  # released after the hot page
    manager.add("x")
    manager.reserve(["x"], 2 * PAGE)  # 1 unused page + 1 cached
    survivor = hot if kept == "hot" else cold
    victim = cold if kept == "hot" else hot
    assert manager.add("s", survivor) == PAGE
    assert manager.add("v", victim) == 0
    manager.validate()


def test_a_custom_policy_plugs_in():
    """Most recently released first: a policy is any object of the protocol."""

    class MRU(pagedkv.cache.eviction.LRUPolicy):
        def victims(self, count: int) -> list[int]:
            return list(reversed(list(self)))[:count]

    manager = PagedKVCacheManager(3, PAGE, HEADS, DIM, eviction=MRU())
    cached_prompt(manager, "a", [1] * PAGE)
    cached_prompt(manager, "b", [2] * PAGE)
    manager.add("x")
    manager.reserve(["x"], 2 * PAGE)
    assert manager.add("a2", [1] * PAGE) == PAGE
    with pytest.raises(ValueError, match="eviction must be one of"):
        PagedKVCacheManager(3, PAGE, HEADS, DIM, eviction="fifo")


def test_pinned_prompt_survives_eviction_and_pins_are_capped():
    manager = PagedKVCacheManager(4, PAGE, HEADS, DIM, max_pinned_pages=2)
    system = BASE[: 2 * PAGE]
    cached_prompt(manager, "s", system)
    assert manager.pin(system + [1]) == 2 * PAGE
    assert (manager.num_pinned_pages, manager.num_free_pages, manager.num_used_pages) == (2, 2, 0)
    manager.add("x")
    with pytest.raises(OutOfPagesError):
        manager.reserve(["x"], 3 * PAGE)  # pinned pages are not free
    manager.reserve(["x"], 2 * PAGE)
    manager.release("x")
    assert manager.add("s2", system) == 2 * PAGE  # nothing evicted it
    manager.release("s2")  # pinned pages stay out of the evictable set
    assert (manager.num_cached_pages, manager.num_free_pages) == (0, 2)
    cached_prompt(manager, "o", [1] * PAGE)
    before = state_of(manager)
    with pytest.raises(ValueError, match="max_pinned_pages = 2"):
        manager.pin([1] * PAGE)
    assert_same_state(manager, before)
    assert manager.unpin(system) == 2 * PAGE
    assert (manager.num_pinned_pages, manager.num_cached_pages) == (0, 3)
    manager.validate()


def test_prompt_remembered_by_add_caches_its_pages_without_ids():
    """Chunked prefill with no token ids: add() kept them, so every full page
    is cached; past the prompt, unknown ids stop caching as before."""
    manager = PagedKVCacheManager(16, PAGE, HEADS, DIM, num_layers=LAYERS)
    prompt = BASE[:11]
    manager.add("a", prompt)
    history: list[int] = []
    for chunk in (prompt[:3], prompt[3:9], prompt[9:] + [4, 4]):  # the last runs past it
        manager.reserve(["a"], len(chunk))
        append_tokens(manager, ["a"], [chunk], [history])
        history = history + chunk
    assert manager.add("b", prompt) == 2 * PAGE
    assert manager.add("c", history) == 2 * PAGE  # page 2 holds unknown ids
    check_reads_back(manager, {"a": history, "b": prompt[: 2 * PAGE], "c": history[: 2 * PAGE]})
    manager.validate()


def test_reserve_for_several_steps_sets_pages_aside():
    manager = PagedKVCacheManager(6, PAGE, HEADS, DIM)
    manager.add("a", [1, 2, 3])
    manager.reserve(["a"], 3, num_steps=1)
    manager.add("b")
    before = state_of(manager)
    with pytest.raises(OutOfPagesError, match="6 asked for, 5 free"):
        manager.reserve(["a", "b"], 1, num_steps=3 * PAGE)  # a: 4 pages, b: 3 pages
    assert_same_state(manager, before)
    manager.reserve(["a", "b"], 1, num_steps=2 * PAGE)  # a: 2 more pages, b: 2
    assert manager.seq_len("a") == 4 and manager.seq_len("b") == 1
    assert (len(manager.ahead_pages("a")), len(manager.ahead_pages("b"))) == (2, 1)
    assert manager.num_free_pages == 1
    np.testing.assert_array_equal(np.diff(manager.metadata(["a", "b"]).append_indptr), [1, 1])
    manager.fork("a", "c")  # the child shares the table, not the set-aside pages
    assert manager.ahead_pages("c") == []
    for _ in range(2 * PAGE - 1):  # the pool is never asked again
        manager.reserve(["a", "b"], 1)
        assert manager.num_free_pages == 1
    assert manager.ahead_pages("a") == manager.ahead_pages("b") == []
    manager.reserve(["b"], 1, num_steps=3)  # room for 11 tokens: a third page
    manager.release("b")
    assert manager.num_free_pages == 3
    with pytest.raises(ValueError, match="num_steps must be an integer >= 1"):
        manager.reserve(["a"], 1, num_steps=0)
    manager.validate()


# ------------------------------------------- layer groups, windows, host tier


def test_layer_groups_are_checked():
    def make(groups, **kwargs):
        return PagedKVCacheManager(8, PAGE, HEADS, DIM, num_layers=3, layer_groups=groups, **kwargs)

    for groups, pattern in (
        ([([0, 1], None)], "no group holds \\[2\\]"),
        ([([0, 1], None), ([1, 2], 8)], "in two groups"),
        ([([0, 1, 2, 2], None)], "twice"),
        ([([0, 1, 3], None)], "layer indices in \\[0, 3\\)"),
        ([([], None), ([0, 1, 2], 4)], "non-empty"),
        ([([0], 0), ([1, 2], None)], "window must be None or an int >= 1"),
        ([(0, None)], "layers must be a sequence"),
        ([[0, 1, 2]], "a \\(layers, window\\) pair"),
    ):
        with pytest.raises(ValueError, match=pattern):
            make(groups)
    with pytest.raises(ValueError, match="one per layer group"):
        PagedKVCacheManager([8, 8, 8], PAGE, HEADS, DIM, num_layers=2)
    with pytest.raises(ValueError, match="one EvictionPolicy object per layer group"):
        make([([0], 8), ([1, 2], None)], eviction=pagedkv.cache.eviction.LRUPolicy())
    manager = make([([0, 2], 8), ([1], None)], offload=[2, 0])
    assert manager.group_of_layer == (0, 1, 0)
    assert manager.null_pages == (8, PAD_PAGE) and len(manager.host_pools) == 2
    assert manager.pools[2] is manager.group_tensors[0].pools[1]
    manager.add("a")
    with pytest.raises(ValueError, match="name a layer group"):
        manager.metadata(["a"])
    with pytest.raises(ValueError, match="group must be in"):
        manager.pages("a", 2)


def test_window_group_gives_back_pages_and_window_left_attention_matches():
    """Decode and chunked prefill over a window group's table (given-back
    slots on the null page) with the wrappers' window_left = window - 1 equal
    attention over the last `window` keys of the whole sequence."""
    from reference import attention

    window, hq, hkv, d = 6, 4, 2, 64
    rng = np.random.default_rng(11)
    manager = PagedKVCacheManager(
        12, PAGE, hkv, d, num_layers=2, layer_groups=[([0], None), ([1], window)]
    )
    keys: list[np.ndarray] = []  # layer 1's true K/V rows, [2, Hkv, D] each

    def step(n: int, prefill: bool) -> None:
        start = manager.seq_len("a")
        manager.reserve(["a"], n)
        rows = rng.standard_normal((2, n, hkv, d), dtype=np.float32)
        keys.extend(rows.transpose(1, 0, 2, 3))
        meta = manager.metadata(["a"], group=1)
        assert meta.window_left == window - 1
        pagedkv.append_paged_kv_cache(
            rows[0], rows[1], meta.batch_indices, meta.positions, manager.pools[1],
            meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len,
        )  # fmt: skip
        # Given back: exactly the pages wholly before this step's first query's window.
        gone = max(0, (start - window + 1) // PAGE)
        assert (meta.kv_indices[:gone] == manager.null_pages[1]).all()
        assert (meta.kv_indices[gone:] != manager.null_pages[1]).all()
        q = rng.standard_normal((n, hq, d), dtype=np.float32)
        table = (meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)
        if prefill:
            w = pagedkv.BatchPrefillWithPagedKVCacheWrapper()
            w.plan(meta.append_indptr, *table, hq, hkv, d, PAGE, causal=True,
                   window_left=meta.window_left)  # fmt: skip
        else:
            w = pagedkv.BatchDecodeWithPagedKVCacheWrapper()
            w.plan(*table, hq, hkv, d, PAGE, window_left=meta.window_left,
                   q_data_type="float32", kv_data_type="float32")  # fmt: skip
        out = w.run(q, manager.pools[1])
        k, v = np.stack(keys, axis=1)
        want, _ = attention(q, k, v, np.arange(start, start + n), window_left=window - 1)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)

    manager.add("a")
    step(9, prefill=True)
    step(7, prefill=True)  # starts at 9: slot 0 (tokens 0-3) is given back
    for _ in range(6):
        step(1, prefill=False)
    assert manager.seq_len("a") == 22 and (manager.pages("a", 0) >= 0).all()
    assert null_slots(manager, "a", 1) == (21 - window + 1) // PAGE == 4
    # The full group holds 6 pages, the window group 2; the null page stays zero.
    assert (manager.page_pools[0].num_used, manager.page_pools[1].num_used) == (6, 2)
    assert not manager.pools[1][manager.null_pages[1]].any()
    manager.validate()


@pytest.mark.parametrize("offload", [0, 4])
def test_window_prefix_hit_needs_only_the_window(offload):
    """A hit needs every page in a full group but only the window's pages in
    a window group; without them it stops short, unless the host tier has
    them (then they are copied back)."""
    manager = PagedKVCacheManager(
        [16, 8], PAGE, HEADS, DIM, num_layers=2,
        layer_groups=[([0], None), ([1], PAGE + 1)], offload=[0, offload],
    )  # fmt: skip
    prompt = BASE[: 3 * PAGE] + [1]
    prefilled(manager, "a", prompt)
    manager.reserve(["a"], 1, [[2]])  # starts at 13: its window is 9.., slots 0-1 go
    append_tokens(manager, ["a"], [[2]], [prompt])
    assert null_slots(manager, "a", 1) == 2 and manager.page_pools[1].num_used == 2
    manager.release("a")
    # A request without ids takes the window group's 5 unused pages and its 2
    # least recently released cached ones: slots 0 and 1; the full group evicts none.
    manager.add("x")
    manager.reserve(["x"], 7 * PAGE)
    manager.release("x")
    assert manager.stats.evictions == 2 and manager.stats.offloads == (2 if offload else 0)
    # 3 pages: the next query (at 12) sees 8..12: slot 2 on, still cached.
    assert manager.add("b", prompt) == 3 * PAGE
    assert null_slots(manager, "b", 1) == 2
    check_reads_back(manager, {"b": prompt[: 3 * PAGE]})
    # 2 pages need slot 1 (the query at 8 sees 4..8), 1 page slot 0: evicted.
    reloads = manager.stats.reloads
    cached = manager.add("c", prompt[: 2 * PAGE] + [5])
    if offload:
        assert cached == 2 * PAGE and manager.stats.reloads - reloads == 1
        check_reads_back(manager, {"b": prompt[: 3 * PAGE], "c": prompt[: 2 * PAGE]})
    else:
        assert cached == 0
    manager.validate()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_tier_copies_evicted_pages_out_and_back_bitwise(dtype):
    check_host_tier(dtype)


def check_host_tier(dtype: str, device: str = "cpu") -> None:
    """Evicted cached pages go to the host tier and come back on a prefix
    hit bit for bit, with the KV events that say so, for pools on `device`."""
    manager = PagedKVCacheManager(
        4, PAGE, HEADS, DIM, num_layers=LAYERS, dtype=dtype, kv_layout="HND", offload=3,
        device=device,
    )  # fmt: skip
    events: list = []
    manager.subscribe(events.append)
    rng = np.random.default_rng(5)
    prompt = BASE[: 2 * PAGE + 1]

    def fill(rid, tokens, ids):
        manager.add(rid, ids)
        manager.reserve([rid], len(tokens))
        meta = manager.metadata([rid])
        table = (meta.batch_indices, meta.positions, meta.kv_indices, meta.kv_indptr)
        table = to_device((*table, meta.kv_last_page_len), device)
        for pool in manager.pools:
            rows = torch.from_numpy(rng.standard_normal((2, len(tokens), HEADS, DIM), np.float32))
            if isinstance(pool, torch.Tensor):
                rows = rows.to(dtype=pool.dtype, device=pool.device)
            else:
                rows = rows.numpy()
            batch_indices, positions, kv_indices, kv_indptr, last = table
            pagedkv.append_paged_kv_cache(
                rows[0], rows[1], batch_indices, positions, pool, kv_indices, kv_indptr, last,
                "HND",
            )  # fmt: skip

    fill("a", prompt, prompt)
    pages = manager.pages("a")[:2]
    saved = [bits(pool)[pages] for pool in manager.pools]
    stored = events[-1]
    manager.release("a")
    # Three unknown pages: the unused one, then both cached pages, evicted
    # to the host tier (the partial page was never cached).
    fill("x", [0] * (3 * PAGE + 1), None)
    assert (manager.stats.evictions, manager.stats.offloads) == (2, 2)
    host = manager.host_page_pools[0]
    removed, *copied = events[-3:]
    # Tail first, as the pool evicted them; each copy names its parent.
    tail_first = stored.block_hashes[::-1]
    assert removed == BlockRemoved(tail_first, "CPU")
    assert [e.medium for e in copied] == ["CPU_OFFLOAD"] * 2
    assert [e.block_hashes[0] for e in copied] == tail_first
    assert [e.parent_block_hash for e in copied] == [tail_first[1], None]
    assert copied[1].token_ids + copied[0].token_ids == stored.token_ids
    host_pages = [host.page_of_hash[k] for k in stored.block_hashes]
    for pool, want in zip(manager.host_pools, saved, strict=True):
        np.testing.assert_array_equal(bits(pool)[host_pages], want)
    manager.release("x")
    # A prefix hit copies both back into pool pages, bit for bit; the host
    # tier keeps its copies (one key, two tiers).
    assert manager.add("b", prompt) == 2 * PAGE
    assert manager.stats.reloads == 2
    back = manager.pages("b")
    for pool, want in zip(manager.pools, saved, strict=True):
        np.testing.assert_array_equal(bits(pool)[back], want)
    assert [e.medium for e in events[-2:]] == ["CPU", "CPU"]
    assert set(host.page_of_hash) == set(stored.block_hashes)
    assert manager.page_pool.hash_of_page[int(back[1])] == stored.block_hashes[1]
    manager.validate()
    # A hit that no longer fits in the pool stops short instead of failing.
    manager.release("b")
    fill("y", [0] * (4 * PAGE), None)  # every pool page: both cached pages evicted again
    before = manager.stats.reloads
    assert manager.add("c", prompt) == 0 and manager.stats.reloads == before
    manager.validate()
