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

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from manager_helpers import (
    BASE,
    DIM,
    HEADS,
    LAYERS,
    PAGE,
    Router,
    append_tokens,
    assert_same_state,
    check_reads_back,
    kv_of,
    null_slots,
    state_of,
)
from pagedkv.cache.manager import (
    OutOfPagesError,
    PagedKVCacheManager,
    page_hash,
    salt_root,
)

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
        self.salt_of_key: dict[bytes, str | bytes | None] = {}
        self.router = Router()
        self.manager.subscribe(self.router)
        self.next_id = 0
        self.hits_seen = 0
        self.copies_seen = 0
        self.partial_seen = 0
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
        needed, free = self.manager.pages_needed(ids, counts), self.manager.num_free_pages
        try:
            self.manager.reserve(ids, counts, new_tokens if hashed else None, num_steps=num_steps)
        except OutOfPagesError as e:
            pool = self.manager.page_pools[e.group_idx or 0]
            assert e.requested > e.available == pool.num_free
            assert f"{e.requested} asked for, {e.available} free" in str(e)
            assert_same_state(self.manager, before)
            assert self.router.count == events, "a failed call emitted events"
            if num_steps == 1:
                assert needed > free, "pages_needed promised room that reserve lacked"
            return False
        if num_steps == 1 and self.windows == [None]:
            # One pool, nothing given back: reserve took what it was to take.
            assert free - self.manager.num_free_pages == needed
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
        partial=st.booleans(),
    )
    def add(self, shared: int, extra: list[int], hashed: str, salt, partial: bool) -> None:
        self.start(BASE[:shared] + extra, hashed, salt, partial)

    @precondition(lambda self: self.model)
    @rule(
        data=st.data(),
        extra=st.lists(st.integers(0, 1), max_size=3),
        hashed=st.sampled_from(["given", "remembered"]),
        other_tenant=st.booleans(),
        partial=st.booleans(),
    )
    def next_turn(
        self, data: st.DataObject, extra: list[int], hashed: str, other_tenant, partial: bool
    ) -> None:
        """A conversation's next turn: a live request's tokens and more, from
        its tenant (hits) or another one (no shared page, checked below)."""
        rid = data.draw(st.sampled_from(sorted(self.model)))
        salt = self.salt[rid]
        if other_tenant:
            salt = data.draw(st.sampled_from([s for s in SALTS if s != salt]))
        self.start(self.model[rid] + extra, hashed, salt, partial)

    def start(self, prompt: list[int], hashed: str, salt, partial: bool = False) -> int:
        """Adds a request (its prompt's cached tokens, and with `partial`
        the ids copy_partial_hit serves) and appends the rest; returns the
        tokens served from the cache."""
        rid = self.new_id()
        hits_before = self.manager.stats.prefix_hits
        cached = self.manager.add(rid, None if hashed == "unknown" else prompt, salt=salt)
        assert cached % PAGE == 0 and 0 <= cached <= len(prompt)
        assert self.manager.stats.prefix_hits - hits_before == cached // PAGE
        if hashed == "unknown":
            assert cached == 0
        self.hits_seen += cached // PAGE
        self.salted_hits += cached // PAGE if salt is not None else 0
        self.first[rid] = [self.first_slot(g, cached) for g in range(len(self.windows))]
        if partial:
            # The next ids from a cached page that holds them in part: the
            # K/V read back (below) shows whether the copy holds that prefix.
            before = self.manager.stats.partial_hit_tokens
            k = self.manager.copy_partial_hit(rid)
            assert 0 <= k < PAGE and self.manager.stats.partial_hit_tokens - before == k
            if hashed == "unknown":
                assert k == 0
            cached += k
            self.partial_seen += k
        self.model[rid] = prompt[:cached]
        self.room[rid] = -(-cached // PAGE)
        self.salt[rid] = salt
        self.pending[rid] = [] if hashed == "unknown" else prompt[cached:]
        # "remembered": reserve() is not given the ids; add() kept them.
        if self.reserve_and_append([rid], [prompt[cached:]], hashed == "given"):
            self.remembered_seen += hashed == "remembered" and len(prompt) >= cached + PAGE
        return cached

    def cached_keys(self) -> list[bytes]:
        """The keys seen that every group's pool holds now."""
        pools = self.manager.page_pools
        return sorted(k for k in self.prefix_of_key if all(k in p.page_of_hash for p in pools))

    @precondition(lambda self: self.cached_keys())
    @rule(data=st.data(), cut=st.integers(1, PAGE - 1))
    def question(self, data: st.DataObject, cut: int) -> None:
        """A prompt that leaves a cached page after `cut` of its ids (a
        system prompt ending mid-page, a question after it): where the pools
        hold the pages before it that a hit needs (none to copy back from a
        host tier) and have a page to spare beside it, at least the shared
        tokens are served (a partial hit, or whole pages of a prompt like
        it)."""
        manager = self.manager
        key = data.draw(st.sampled_from(self.cached_keys()))
        prefix = list(self.prefix_of_key[key])
        shared = len(prefix) - PAGE + cut
        salt = self.salt_of_key[key]
        prompt = prefix[:shared] + [prefix[shared] + 1]
        count, hit, _ = manager._find_hit(np.array(prompt, np.int64), salt_root(salt))
        # Evictable pages the hit reuses, and the source, are not room.
        room = (
            count == shared // PAGE
            and not any(back for _, back, _ in hit)
            and all(
                pool.num_free - sum(p in pool.evictable for p in {*reused, pool.page_of_hash[key]})
                >= 1
                for pool, (reused, _, _) in zip(manager.page_pools, hit, strict=True)
            )
        )
        cached = self.start(prompt, "given", salt, True)
        if room:
            assert cached >= shared, (cached, shared)

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
            crowd = self.next_id  # the id start() takes
            self.start([0] * (pages * PAGE), "unknown", None)
            if crowd in self.model:
                self.end(crowd)
        extra = data.draw(st.lists(st.integers(0, 1), max_size=2))
        self.start(tokens + extra, "given", salt, data.draw(st.booleans()))

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
                self.salt_of_key[chain] = self.salt[rid]
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
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def run_machine(machine, machine_settings) -> dict[str, int]:
    names = ["hits", "partial", "copies", "remembered", "salted_hits", "pins", "events"]
    names.append("set_aside")
    if machine.layer_groups is not None:
        names.append("given_back")
    if machine.offload:
        names += ["offloads", "reloads"]
    totals = dict.fromkeys(names, 0)

    class Counted(machine):
        def teardown(self) -> None:
            totals["hits"] += self.hits_seen
            totals["partial"] += self.partial_seen
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
