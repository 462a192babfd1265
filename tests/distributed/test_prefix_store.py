"""The prefix cache shared through Redis (pagedkv.distributed.prefix_store):
pages copied bitwise between managers, salts and layouts kept apart,
truncated or altered values refused, an unreachable store a miss; then the
demo model served by a second instance from the first one's pages, its
tokens and logits those of an instance that computed everything."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

pytest.importorskip("redis", reason="the distributed extra (redis) is not installed")

from conftest import DEMO_CONFIG, assert_reference_tokens, engine_with_pool  # noqa: E402
from pagedkv.cache.manager import PagedKVCacheManager  # noqa: E402
from pagedkv.distributed.prefix_store import (  # noqa: E402
    RedisPageStore,
    SharedPrefixCache,
)
from pagedkv.graphs.scheduler import Request, Scheduler  # noqa: E402

WARM_GRAPHS = ("demo",)
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""

PAGE = 4
GROUPS = [((0, 2), None), ((1,), 2 * PAGE)]


def manager(groups=None) -> PagedKVCacheManager:
    return PagedKVCacheManager(16, PAGE, 2, 8, num_layers=3, dtype="float16", layer_groups=groups)


def shared(m, url, namespace, model="demo", salt_free=True) -> SharedPrefixCache:
    return SharedPrefixCache(m, RedisPageStore(url), model, namespace=namespace)


def fill(m: PagedKVCacheManager, rid, rng) -> None:
    """Writes random values into every page a request holds, as the kernels would."""
    for layer, pool in enumerate(m.pools):
        for page in m.pages(rid, m.group_of_layer[layer]):
            pool[page] = rng.standard_normal(pool.shape[1:]).astype(pool.dtype)


def page_bits(m: PagedKVCacheManager, rid, slot: int) -> list[bytes]:
    return [
        pool[int(m.pages(rid, m.group_of_layer[layer])[slot])].tobytes()
        for layer, pool in enumerate(m.pools)
    ]


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize("groups", [None, GROUPS], ids=["one group", "window group"])
def test_pages_move_bitwise_between_managers(redis_url, namespace, groups):
    """A page published by one manager arrives in another's pool bit for bit,
    in every layer (and every layer group); the fetched pages are cached there
    too, and nothing leaks when the requests end."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 500, 3 * PAGE + 1).tolist()
    one, two = manager(groups), manager(groups)
    first, second = shared(one, redis_url, namespace), shared(two, redis_url, namespace)
    one.add("a", prompt)
    one.reserve(["a"], len(prompt))
    fill(one, "a", rng)
    assert first.publish() == 3 and first.stats.published == 3
    assert first.publish() == 0  # published once

    other = prompt[: 2 * PAGE] + rng.integers(500, 900, 2 * PAGE).tolist()
    cached = two.add("b", other)
    assert cached == 0
    assert second.fetch("b", other, cached) == 2 * PAGE
    assert two.seq_len("b") == 2 * PAGE and second.stats.fetched == 2
    for slot in range(2):
        assert page_bits(two, "b", slot) == page_bits(one, "a", slot)
    assert two.cached_prefix_length(other) == 2 * PAGE
    assert second.publish() == 0  # pages from the store are not sent back
    for m, rid in ((one, "a"), (two, "b")):
        m.release(rid)
        m.validate()
        assert m.num_used_pages == 0


def test_salts_and_layouts_are_kept_apart(redis_url, namespace):
    """Pages published under one salt, model id or pool layout are never
    found under another."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 500, 2 * PAGE + 1).tolist()
    source = manager()
    publisher = shared(source, redis_url, namespace)
    source.add("a", prompt, salt="tenant-1")
    source.reserve(["a"], len(prompt))
    fill(source, "a", rng)
    assert publisher.publish() == 2

    cases = [
        ("tenant-1", "demo", manager(), 2 * PAGE),
        ("tenant-2", "demo", manager(), 0),
        (None, "demo", manager(), 0),
        ("tenant-1", "other-model", manager(), 0),
        ("tenant-1", "demo", PagedKVCacheManager(16, PAGE, 2, 8, num_layers=3), 0),  # float32
    ]
    for salt, model, m, expected in cases:
        reader = shared(m, redis_url, namespace, model)
        cached = m.add("b", prompt, salt=salt)
        assert reader.fetch("b", prompt, cached, salt=salt) == expected, (salt, model)
        assert reader.stats.rejected == 0


def test_truncated_or_altered_values_are_recomputed(redis_url, namespace):
    """A value cut short or with one byte changed ends the run of fetched
    pages before it and counts as rejected; the pages before it are served."""
    import redis

    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 500, 4 * PAGE + 1).tolist()
    source = manager()
    publisher = shared(source, redis_url, namespace)
    source.add("a", prompt)
    source.reserve(["a"], len(prompt))
    fill(source, "a", rng)
    publisher.publish()
    client = redis.Redis.from_url(redis_url)
    names = sorted(client.keys(f"{namespace}:*"))
    assert len(names) == 4
    keys = [publisher.name(k) for k in source.page_pool.hash_of_page.values()]
    by_slot = {int(source.pages("a")[i]): i for i in range(4)}
    slot_name = {by_slot[p]: publisher.name(k) for p, k in source.page_pool.hash_of_page.items()}
    assert sorted(keys) == sorted(n.decode() for n in names)

    value = bytearray(client.get(slot_name[1]))
    value[-7] ^= 0x10
    client.set(slot_name[1], bytes(value))
    m = manager()
    reader = shared(m, redis_url, namespace)
    cached = m.add("b", prompt)
    assert reader.fetch("b", prompt, cached) == PAGE
    assert reader.stats.rejected == 1 and reader.stats.fetched == 1

    client.set(slot_name[1], client.get(slot_name[2])[:-1])  # wrong and short
    m2 = manager()
    reader2 = shared(m2, redis_url, namespace)
    assert reader2.fetch("c", prompt, m2.add("c", prompt)) == PAGE
    assert reader2.stats.rejected == 1


def test_an_unreachable_store_is_a_miss():
    """A store nobody listens on: fetch serves nothing, publish drops its
    pages, both count an error, and the manager is unchanged."""
    from pagedkv.serve.server import free_port

    m = manager()
    reader = SharedPrefixCache(
        m, RedisPageStore(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5), "demo"
    )
    prompt = list(range(2 * PAGE + 1))
    assert reader.fetch("a", prompt, m.add("a", prompt)) == 0
    m.reserve(["a"], len(prompt))
    assert reader.publish() == 0
    assert reader.stats.errors == 2
    m.validate()


def serve(weights, requests, url=None, namespace=None):
    engine = engine_with_pool(weights, 64, batch_invariant=True)
    store = (
        None
        if url is None
        else SharedPrefixCache(engine.manager, RedisPageStore(url), "demo", namespace=namespace)
    )
    scheduler = Scheduler(engine, keep_logits=True, connectors=[store] if store else [])
    sequences, _ = scheduler.run(requests)
    engine.manager.validate()
    assert engine.manager.num_used_pages == 0
    return sequences, scheduler.stats, store


def test_a_second_instance_serves_from_the_first_ones_pages(weights, redis_url, namespace):
    """Instance A serves prompts with a 3-page system prompt; instance B,
    with an empty pool, serves new questions after it: B copies the system
    prompt's pages from the store and prefills only the rest, and its tokens
    and logits are those of instance C, which computes everything, and of
    the NumPy model."""
    rng = np.random.default_rng(4)
    system = rng.integers(0, DEMO_CONFIG.vocab_size, 48).tolist()

    def asks(n, seed):
        r = np.random.default_rng(seed)
        return [
            Request(f"q{seed}-{i}", tuple(system + r.integers(0, 100, 9).tolist()), max_tokens=6)
            for i in range(n)
        ]

    _, _, store_a = serve(weights, asks(2, 10), redis_url, namespace)
    assert store_a.stats.published >= 3
    questions = asks(3, 11)
    got, stats_b, store_b = serve(weights, questions, redis_url, namespace)
    want, stats_c, _ = serve(weights, questions)
    assert store_b.stats.fetched >= 3 and store_b.stats.rejected == 0
    assert stats_b.prefill_tokens <= stats_c.prefill_tokens - 48
    assert [s.tokens for s in got] == [s.tokens for s in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), rtol=0, atol=1e-4)
    assert_reference_tokens(DEMO_CONFIG, weights, got)
