"""PagedKVCacheManager's fixed cases through the real kernels: the prefix
cache, forks and copy-on-write, bad calls, metadata, validation, pools of
each kind, and the functional API."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pagedkv
from conftest import bits
from manager_helpers import (
    BASE,
    DIM,
    HEADS,
    LAYERS,
    PAGE,
    append_tokens,
    assert_same_state,
    check_reads_back,
    kv_of,
    prefilled,
    state_of,
)
from pagedkv.cache.manager import (
    PAD_PAGE,
    CacheStateError,
    OutOfPagesError,
    PagedKVCacheManager,
)
from pagedkv.functional import (
    BlockTable,
    allocate_blocks,
    append_kv,
    gather_kv,
    init_paged_kv_cache,
    release_blocks,
)


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


def test_forget_drops_prefix_keys_from_start_to_stop():
    """Forgotten pages serve no prefix hit, and a hit stops at the first of
    them; pages before `start` stay cached."""
    prompt = BASE[: 2 * PAGE] + [1] * PAGE + [2]
    for (start, stop), cached in (((PAGE, 2 * PAGE), PAGE), ((2 * PAGE, None), 2 * PAGE)):
        manager = PagedKVCacheManager(10, PAGE, HEADS, DIM, num_layers=LAYERS)
        prefilled(manager, "a", prompt)
        manager.forget("a", start, stop)
        manager.release("a")
        assert manager.cached_prefix_length(prompt) == cached
        assert manager.add("b", prompt) == cached
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


def test_a_page_that_matches_in_part_is_copied_and_read_back():
    """copy_partial_hit serves the ids a cached page starts with (a system
    prompt ending mid-page): a copy of that page, which the request's own
    appends then complete. The source stays as it was, even when it is the
    next page the pool would evict: the copy evicts another."""
    manager = PagedKVCacheManager(5, PAGE, HEADS, DIM, num_layers=LAYERS)
    a = BASE[: 2 * PAGE]
    prefilled(manager, "a", a)
    source = int(manager.pages("a")[1])
    source_bits = [bits(pool[source]) for pool in manager.pools]
    manager.release("a")  # evicted tail first: the source, then a's page 0
    prefilled(manager, "y", [2] * PAGE)
    manager.release("y")  # released last, evicted last
    prefilled(manager, "x", [0] * (2 * PAGE), hashed=False)  # no unused page left
    b = BASE[: PAGE + 3] + [0]  # a's page 0 whole, 3 ids of its page 1
    assert manager.cached_prefix_length(b, partial=True) == PAGE + 3
    assert manager.add("b", b) == PAGE
    assert manager.copy_partial_hit("b") == 3
    assert manager.seq_len("b") == PAGE + 3 and manager.stats.partial_hit_tokens == 3
    assert manager.stats.evictions == 1 and manager.cached_prefix_length([2] * PAGE) == 0
    copy = int(manager.pages("b")[1])
    assert copy != source and manager.refcounts()[copy] == 1
    # The rest of the prompt goes into the copy's free slot.
    manager.reserve(["b"], 1)
    append_tokens(manager, ["b"], [b[PAGE + 3 :]], [b[: PAGE + 3]])
    check_reads_back(manager, {"b": b, "x": [0] * (2 * PAGE)})
    for pool, before in zip(manager.pools, source_bits, strict=True):
        np.testing.assert_array_equal(bits(pool[source]), before)
    assert manager.cached_prefix_length(a) == 2 * PAGE
    # b's copy, full now, is cached under b's own ids (the copied 3 and its 1).
    assert manager.cached_prefix_length(b) == 2 * PAGE
    # b's copy, now full, is cached under its own ids: a third request hits it.
    assert manager.add("c", b + [1]) == 2 * PAGE
    # A call with no match, or a second call, changes nothing and serves 0.
    manager.add("d", [5, 5, 5])
    for rid in ("d", "b"):
        before = state_of(manager)
        assert manager.copy_partial_hit(rid) == 0
        assert_same_state(manager, before)
    manager.validate()


def test_a_partial_hit_keeps_to_its_tenant_and_its_room():
    manager = PagedKVCacheManager(3, PAGE, HEADS, DIM, num_layers=LAYERS)
    prompt = BASE[: PAGE + 2]
    manager.add("a", prompt, salt="tenant-a")
    manager.reserve(["a"], len(prompt))
    append_tokens(manager, ["a"], [prompt], [[]])
    # Another tenant's request matches nothing.
    manager.add("b", prompt[:3], salt="tenant-b")
    assert manager.copy_partial_hit("b") == 0
    # Its own tenant's does, while a page is free; with none, it serves 0.
    manager.add("c", prompt[:3], salt="tenant-a")
    assert manager.copy_partial_hit("c") == 3
    check_reads_back(manager, {"a": prompt, "b": [], "c": prompt[:3]})
    manager.add("d", prompt[:3], salt="tenant-a")
    assert manager.num_free_pages == 0
    before = state_of(manager)
    assert manager.copy_partial_hit("d") == 0
    assert_same_state(manager, before)
    with pytest.raises(KeyError):
        manager.copy_partial_hit("nobody")


def test_validate_catches_a_partial_match_index_out_of_step():
    manager = PagedKVCacheManager(4, PAGE, HEADS, DIM, num_layers=LAYERS)
    prefilled(manager, "a", BASE[: 2 * PAGE])
    manager.validate()
    children = manager.page_pool.children
    parent = next(iter(children))
    page = next(iter(children[parent]))
    children[parent][page] = children[parent][page][::-1].copy()
    with pytest.raises(CacheStateError, match="partial matches"):
        manager.validate()


def test_fork_copies_a_shared_partial_page_on_first_write():
    manager = PagedKVCacheManager(8, PAGE, HEADS, DIM, num_layers=LAYERS)
    manager.add("empty", [])
    assert manager.pages_needed(["empty"]) == 1
    manager.release("empty")
    parent = BASE[: PAGE + 2]  # the last page holds 2 of 4 tokens
    prefilled(manager, "p", parent)
    manager.fork("p", "c")
    shared = manager.pages("p")
    np.testing.assert_array_equal(manager.pages("c"), shared)
    assert manager.refcounts()[shared].tolist() == [2, 2]

    # A writer copies the shared page, but when both write, one keeps it.
    assert [manager.pages_needed(r) for r in (["p"], ["c"], ["p", "c"])] == [1, 1, 1]

    free = manager.num_free_pages
    manager.reserve(["c"], 1, [[9]])
    assert manager.stats.cow_copies == 1
    assert free - manager.num_free_pages == 1
    assert manager.pages_needed(["p", "c"]) == 0
    # p holds 2 tokens of its last page, c 3 of its copy's (pages of 4).
    assert manager.pages_needed(["p", "c"], [2, 1]) == 0
    assert manager.pages_needed(["p", "c"], [3, 2]) == 2
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
        (ValueError, "start must be a multiple of page_size", lambda: manager.forget("a", 1)),
        (ValueError, r"stop must be in \[4, ", lambda: manager.forget("a", PAGE, PAGE - 1)),
        (TypeError, "start must be an integer", lambda: manager.forget("a", True)),
        (TypeError, "stop must be an integer", lambda: manager.forget("a", 0, 5.0)),
        (KeyError, "request_id 'zz'", lambda: manager.forget("zz", 0)),
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
    with pytest.raises(ValueError, match=r"page_size must be in \[1, 2147483647\], got 0"):
        PagedKVCacheManager(4, 0, HEADS, DIM)
    with pytest.raises(TypeError, match="page_size must be an integer, got True"):
        PagedKVCacheManager(4, True, HEADS, DIM)
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, "):
        PagedKVCacheManager(4, PAGE, HEADS, DIM, num_layers=0)
    with pytest.raises(TypeError, match="num_layers must be an integer, got 2.0"):
        PagedKVCacheManager(4, PAGE, HEADS, DIM, num_layers=2.0)
    with pytest.raises(ValueError, match=r"max_pinned_pages must be in \[0, "):
        PagedKVCacheManager(4, PAGE, HEADS, DIM, max_pinned_pages=-1)
    with pytest.raises(TypeError, match="max_frequency must be an integer, got 2.5"):
        pagedkv.cache.eviction.LFUPolicy(2.5)
    with pytest.raises(ValueError, match="num_pages must be in .*got 2147483648"):
        PagedKVCacheManager(2**31, PAGE, HEADS, DIM)  # past the kernels' int32 page ids
    # More bytes than any address space: a MemoryError that says how many.
    with pytest.raises(MemoryError, match=r"KV pools of 281474976579584 bytes"):
        PagedKVCacheManager(2**31 - 1, 16, 8, 128)


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


@pytest.mark.gpu
def test_manager_copies_on_write_on_gpu():
    check_copy_on_write_of_torch_pools("cuda")
