"""PagedKVCacheManager's metadata driving decode, salts, KV events, eviction
policies, pins, reservations ahead, and layer groups: sliding windows and
the host tier, through the real kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pagedkv
from conftest import bits, to_device
from manager_helpers import (
    BASE,
    DIM,
    HEADS,
    LAYERS,
    PAGE,
    append_tokens,
    assert_same_state,
    cached_prompt,
    check_reads_back,
    null_slots,
    prefilled,
    state_of,
)
from pagedkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.cache.manager import (
    PAD_PAGE,
    OutOfPagesError,
    PagedKVCacheManager,
    page_hash,
)

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
    with pytest.raises(ValueError, match="num_steps must be in \\[1, "):
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
        ([([0], 0), ([1, 2], None)], "window must be in \\[1, "),
        ([(0, None)], "layers must be a sequence"),
        ([[0, 1, 2]], "a \\(layers, window\\) pair"),
    ):
        with pytest.raises(ValueError, match=pattern):
            make(groups)
    with pytest.raises(ValueError, match="one per layer group"):
        PagedKVCacheManager([8, 8, 8], PAGE, HEADS, DIM, num_layers=2)
    two_groups = {"num_layers": 3, "layer_groups": [([0], 8), ([1, 2], None)]}
    with pytest.raises(ValueError, match="num_pages\\[1\\] must be in \\[1, "):
        PagedKVCacheManager([8, 0], PAGE, HEADS, DIM, **two_groups)
    # A bool or a float is not a count, alone or in a list.
    for pages, offload in ((True, 0), (8, 2.0), ([8, 8.5], 0)):
        with pytest.raises(TypeError, match="must be an integer"):
            PagedKVCacheManager(pages, PAGE, HEADS, DIM, offload=offload, **two_groups)
    with pytest.raises(TypeError, match="window must be an integer"):
        make([([0], 4.0), ([1, 2], None)])
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
    medium = "CPU" if device == "cpu" else "GPU"  # where the pool's pages are
    # The host tier: "CPU" under a GPU pool, "CPU_OFFLOAD" beside a CPU one.
    host_medium = "CPU_OFFLOAD" if device == "cpu" else "CPU"

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
    assert removed == BlockRemoved(tail_first, medium)
    assert [e.medium for e in copied] == [host_medium] * 2
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
    assert [e.medium for e in events[-2:]] == [medium, medium]
    assert set(host.page_of_hash) == set(stored.block_hashes)
    assert manager.page_pool.hash_of_page[int(back[1])] == stored.block_hashes[1]
    manager.validate()
    # A hit that no longer fits in the pool stops short instead of failing.
    manager.release("b")
    fill("y", [0] * (4 * PAGE), None)  # every pool page: both cached pages evicted again
    before = manager.stats.reloads
    assert manager.add("c", prompt) == 0 and manager.stats.reloads == before
    manager.validate()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_tier_on_gpu(dtype):
    """Evicted GPU pages out to the host tier and back, bit for bit."""
    check_host_tier(dtype, "cuda")
