"""Prefill/decode page transfer over NIXL (pagedkv.distributed.nixl_transfer),
two managers in one process on loopback UCX: pages read bitwise, only
those the decode side lacks, kept pages released on the reader's notice or
after their time; a peer that cannot be reached or read fails the request
with a clear error, and nothing half-read stays cached."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("nixl", reason="nixl is not installed")

from pagedkv.cache.manager import PagedKVCacheManager  # noqa: E402
from pagedkv.distributed.nixl_transfer import (  # noqa: E402
    NixlPageTransfer,
    check_kv_transfer_params,
)
from pagedkv.graphs.kv_connector import KVTransferError  # noqa: E402
from pagedkv.graphs.scheduler import Request  # noqa: E402

WARM_GRAPHS = ("demo",)
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""

PAGE = 4
LAYERS = 3


def manager() -> PagedKVCacheManager:
    return PagedKVCacheManager(24, PAGE, 2, 8, num_layers=LAYERS, dtype="float16")


def fill(m: PagedKVCacheManager, rid, rng) -> None:
    for pool in m.pools:
        for page in m.pages(rid):
            pool[page] = rng.standard_normal(pool.shape[1:]).astype(pool.dtype)


@pytest.fixture
def pair():
    """(prefill connector, decode connector) over fresh managers."""
    prefill = NixlPageTransfer(manager(), "prefill", "demo", port=1234)
    decode = NixlPageTransfer(manager(), "decode", "demo", peer_metadata=lambda h, p: meta(h, p))

    def meta(host, port):
        assert (host, port) == ("127.0.0.1", 1234)
        return prefill.metadata()

    return prefill, decode


def prefilled(prefill: NixlPageTransfer, prompt: list[int], rng) -> tuple[Request, dict]:
    """The prefill side's half: the prompt computed (random pages), the
    request ended, its pages kept; returns the request and the params."""
    m = prefill.manager
    req = Request("r1", tuple(prompt), 1, kv_transfer={"do_remote_decode": True})
    m.add("r1-0", prompt[:-1])
    m.reserve(["r1-0"], len(prompt))
    fill(m, "r1-0", rng)
    params = prefill.on_finish(req, "r1-0")
    m.release("r1-0")
    return req, params


def wait_released(prefill: NixlPageTransfer) -> None:
    deadline = time.monotonic() + 10
    while prefill.busy:
        assert time.monotonic() < deadline, "the reader's notice never arrived"
        prefill.poll()
        time.sleep(0.01)


def remote_prefill_params(**changes) -> dict:
    """A decode request's kv_transfer params, as a prefill instance at
    127.0.0.1:1234 hands them over for a prompt of three pages, with changes."""
    return {
        "do_remote_prefill": True,
        "remote_block_ids": [0, 1, 2],
        "remote_engine_id": "e",
        "remote_host": "127.0.0.1",
        "remote_port": 1234,
        "remote_request_id": "r",
        **changes,
    }


def assert_fetch_fails_cleanly(decode: NixlPageTransfer, prompt, params, message) -> None:
    """decode.fetch of prompt[:-1] (nothing cached) raises KVTransferError
    matching message; once released, no page is used and none serves the
    prompt as a cached prefix."""
    m = decode.manager
    m.add("d-0", prompt[:-1])
    with pytest.raises(KVTransferError, match=message):
        decode.fetch("d-0", prompt[:-1], 0, Request("d", tuple(prompt), 4, kv_transfer=params))
    m.release("d-0")
    m.validate()
    assert m.num_used_pages == 0 and m.cached_prefix_length(prompt) == 0


def test_decode_reads_the_prompts_pages_bitwise(pair):
    """The decode side reads every full page of prompt[:-1] in one READ;
    each layer's page equals the prefill side's bit for bit; the notice
    releases the prefill side's kept pages."""
    prefill, decode = pair
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 500, 5 * PAGE + 2).tolist()
    req, params = prefilled(prefill, prompt, rng)
    assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == 5
    assert prefill.busy and prefill.manager.num_used_pages >= 5

    m = decode.manager
    request = Request("d1", tuple(prompt), 8, kv_transfer=params)
    cached = m.add("d1-0", prompt[:-1])
    assert decode.fetch("d1-0", prompt[:-1], cached, request) == 5 * PAGE
    for layer in range(LAYERS):
        for slot, remote in enumerate(params["remote_block_ids"]):
            got = m.pools[layer][int(m.pages("d1-0")[slot])]
            assert got.tobytes() == prefill.manager.pools[layer][remote].tobytes()
    page_bytes = m.pools[0][0].nbytes
    assert decode.stats.pulled_pages == 5
    assert decode.stats.pulled_bytes == 5 * page_bytes * LAYERS
    wait_released(prefill)
    assert prefill.stats.handed_over == 1 and prefill.manager.num_used_pages == 0
    m.release("d1-0")
    assert m.cached_prefix_length(prompt) == 5 * PAGE  # read pages serve later hits


def test_pages_held_locally_are_not_read(pair):
    """With the prompt's first 3 pages cached on the decode side, only the
    last 2 move; a prompt held whole moves nothing but the notice."""
    prefill, decode = pair
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 500, 5 * PAGE + 1).tolist()
    m = decode.manager
    m.add("local", prompt[: 3 * PAGE])
    m.reserve(["local"], 3 * PAGE)
    m.release("local")
    _, params = prefilled(prefill, prompt, rng)
    cached = m.add("d1-0", prompt[:-1])
    assert cached == 3 * PAGE
    request = Request("d1", tuple(prompt), 8, kv_transfer=params)
    assert decode.fetch("d1-0", prompt[:-1], cached, request) == 5 * PAGE
    assert decode.stats.pulled_pages == 2 and decode.stats.skipped_pages == 3
    for layer in range(LAYERS):
        for slot in (3, 4):
            got = m.pools[layer][int(m.pages("d1-0")[slot])]
            want = prefill.manager.pools[layer][params["remote_block_ids"][slot]]
            assert got.tobytes() == want.tobytes()
    wait_released(prefill)

    _, params = prefilled(prefill, prompt, rng)
    cached = m.add("d2-0", prompt[:-1])
    request = Request("d2", tuple(prompt), 8, kv_transfer=params)
    assert decode.fetch("d2-0", prompt[:-1], cached, request) == 5 * PAGE
    assert decode.stats.pulled_pages == 2
    wait_released(prefill)


def test_a_resumed_sample_recomputes(pair):
    """A preempted decode-side sample comes back with its tokens so far: the
    peer released its pages at the first read, so nothing is read again."""
    _, decode = pair
    prompt = list(range(3 * PAGE + 1))
    params = remote_prefill_params()
    resumed = prompt + [7, 8]  # prompt and two generated tokens
    decode.manager.add("d-0", resumed[:-1])
    request = Request("d", tuple(prompt), 4, kv_transfer=params)
    assert decode.fetch("d-0", resumed[:-1], 0, request) == 0
    assert decode.stats.pulled_pages == 0 and decode.stats.failures == 0


def test_unread_pages_are_released_in_time(pair):
    prefill, _ = pair
    prefill.hold_seconds = 0.0
    prefilled(prefill, list(range(3 * PAGE)), np.random.default_rng(2))
    prefill.poll()
    assert not prefill.busy and prefill.stats.expired == 1
    assert prefill.manager.num_used_pages == 0


def test_an_unreachable_peer_fails_the_request_cleanly():
    """A peer nobody answers for: a clear error before any page is reserved."""

    def unreachable(host, port):
        raise ConnectionRefusedError(f"{host}:{port}")

    decode = NixlPageTransfer(manager(), "decode", "demo", peer_metadata=unreachable)
    params = remote_prefill_params(remote_engine_id="gone", remote_port=9, remote_request_id="x")
    prompt = list(range(3 * PAGE + 1))
    message = "cannot reach the prefill instance at 127.0.0.1:9"
    assert_fetch_fails_cleanly(decode, prompt, params, message)


def test_metadata_is_fetched_once_and_off_the_scheduler(pair):
    """prefetch() (the server's thread) fetches and checks a peer's
    metadata; the scheduler's fetch() then finds it ready. An unreachable
    peer is a message, not an exception."""
    prefill, _ = pair
    calls = []

    def metadata(host, port):
        calls.append((host, port))
        return prefill.metadata()

    decode = NixlPageTransfer(manager(), "decode", "demo", peer_metadata=metadata)
    _, params = prefilled(prefill, list(range(3 * PAGE + 1)), np.random.default_rng(9))
    assert decode.prefetch(params) is None and len(calls) == 1
    prompt = list(range(3 * PAGE + 1))
    decode.manager.add("d-0", prompt[:-1])
    request = Request("d", tuple(prompt), 4, kv_transfer=params)
    assert decode.fetch("d-0", prompt[:-1], 0, request) == 3 * PAGE
    assert len(calls) == 1
    wait_released(prefill)
    gone = {**params, "remote_engine_id": "other", "remote_port": 9}

    def refuse(host, port):
        raise ConnectionRefusedError

    decode._peer_metadata = refuse
    assert "cannot reach the prefill instance at 127.0.0.1:9" in decode.prefetch(gone)


def test_a_failed_read_leaves_no_page_cached(pair):
    """Pages the peer does not have: the read fails after the reservation;
    the reserved pages lose their keys, so no later prompt is served them."""
    prefill, decode = pair
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 500, 3 * PAGE + 1).tolist()
    _, params = prefilled(prefill, prompt, rng)
    params = {**params, "remote_block_ids": [0, 1, 10_000]}
    assert_fetch_fails_cleanly(decode, prompt, params, "not in the peer's pool")


def test_a_peer_of_another_layout_is_refused(pair):
    prefill, _ = pair
    other = NixlPageTransfer(
        PagedKVCacheManager(24, PAGE, 2, 8, num_layers=LAYERS),  # float32
        "decode",
        "demo",
        peer_metadata=lambda h, p: prefill.metadata(),
    )
    prompt = list(range(2 * PAGE + 1))
    _, params = prefilled(prefill, prompt, np.random.default_rng(4))
    assert_fetch_fails_cleanly(other, prompt, params, "lays out pages")


@pytest.mark.parametrize(
    "params,role,n,message",
    [
        ({"do_remote_decode": True}, None, 1, "--role prefill or --role decode"),
        ({"do_remote_decode": True}, "decode", 1, "needs a server started with --role prefill"),
        ({"do_remote_decode": True}, "prefill", 2, "n = 1"),
        ({"do_remote_prefill": True, "remote_block_ids": "x"}, "decode", 1, "remote_block_ids"),
        (
            {"do_remote_prefill": True, "remote_block_ids": [1], "remote_host": "h"},
            "decode",
            1,
            "remote_port must be a int",
        ),
        ({"do_remote_decode": False, "do_remote_prefill": False}, None, 1, None),
    ],
)
def test_params_are_checked(params, role, n, message):
    got = check_kv_transfer_params(params, role, n)
    assert (got is None) if message is None else (message in got)


def test_a_prefill_and_a_decode_scheduler_answer_as_one(weights):
    """The demo model on three engines (batch-invariant): a prefill
    scheduler computes each prompt and keeps its pages, a decode scheduler
    reads them and generates; its tokens and logits are those of one
    scheduler doing both, and both sides end with every page free."""
    from conftest import DEMO_CONFIG, engine_with_pool
    from pagedkv.graphs.scheduler import Done, Scheduler

    rng = np.random.default_rng(6)
    prompts = [tuple(rng.integers(0, DEMO_CONFIG.vocab_size, n).tolist()) for n in (40, 57, 33)]
    engines = [engine_with_pool(weights, 48, batch_invariant=True) for _ in range(3)]
    prefill = NixlPageTransfer(engines[0].manager, "prefill", "demo")
    decode = NixlPageTransfer(
        engines[1].manager, "decode", "demo", peer_metadata=lambda h, p: prefill.metadata()
    )
    first = Scheduler(engines[0], connectors=[prefill])
    asked = [
        Request(f"r{i}", p, 1, kv_transfer={"do_remote_decode": True})
        for i, p in enumerate(prompts)
    ]
    params = []

    def keep(event) -> None:
        if isinstance(event, Done):
            params.append(event.kv_transfer_params)

    for req in asked:
        first.submit(req, keep)
    while first.has_work:
        first.step()
    assert len(params) == 3 and all(p["do_remote_prefill"] for p in params)

    second = Scheduler(engines[1], keep_logits=True, connectors=[decode])
    got, _ = second.run(
        [
            Request(f"d{i}", p, 8, kv_transfer=k)
            for i, (p, k) in enumerate(zip(prompts, params, strict=True))
        ]
    )
    want, _ = Scheduler(engines[2], keep_logits=True).run(
        [Request(f"o{i}", p, 8) for i, p in enumerate(prompts)]
    )
    assert [s.tokens for s in got] == [s.tokens for s in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), rtol=0, atol=1e-4)
    full_pages = sum((len(p) - 1) // 16 for p in prompts)
    assert decode.stats.pulled_pages == full_pages
    assert decode.stats.pulled_bytes == full_pages * engines[1].manager.pools[0][0].nbytes * len(
        engines[1].manager.pools
    )
    wait_released(prefill)
    for engine in engines[:2]:
        engine.manager.validate()
        assert engine.manager.num_used_pages == 0


def test_a_window_group_reads_the_pages_its_peer_still_holds():
    """Layer groups as Gemma 3's (a full group and an 8-token window): every
    page the prefill side still holds moves, in both groups, so that a later
    prompt sharing a shorter prefix finds its window here; slots the peer's
    window gave back are neither read nor cached. A peer whose window passed
    a page the decode side's first query needs fails the request."""
    groups = [((0, 2), None), ((1,), 2 * PAGE)]

    def grouped():
        return PagedKVCacheManager(24, PAGE, 2, 8, num_layers=LAYERS, dtype="float16",
                                   layer_groups=groups)  # fmt: skip

    prefill = NixlPageTransfer(grouped(), "prefill", "demo", port=1234)
    decode = NixlPageTransfer(
        grouped(), "decode", "demo", peer_metadata=lambda h, p: prefill.metadata()
    )
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, 500, 6 * PAGE + 1).tolist()
    src = prefill.manager
    src.add("r1-0", prompt[:-1])
    src.reserve(["r1-0"], len(prompt))
    for layer, pool in enumerate(src.pools):
        for page in src.pages("r1-0", src.group_of_layer[layer]):
            pool[page] = rng.standard_normal(pool.shape[1:]).astype(pool.dtype)
    asked = Request("r1", tuple(prompt), 1, kv_transfer={"do_remote_decode": True})
    params = prefill.on_finish(asked, "r1-0")
    src.release("r1-0")
    assert len(params["remote_block_ids"]) == 2  # one list per layer group
    null = src.null_pages[1]
    given_back = [null, null] + params["remote_block_ids"][1][2:]  # as if the window passed
    params = {**params, "remote_block_ids": [params["remote_block_ids"][0], given_back]}

    m = decode.manager
    request = Request("d1", tuple(prompt), 8, kv_transfer=params)
    assert decode.fetch("d1-0", prompt[:-1], m.add("d1-0", prompt[:-1]), request) == 6 * PAGE
    for layer, pool in enumerate(m.pools):
        g = m.group_of_layer[layer]
        for slot in range(2 if g == 1 else 0, 6):
            mine = pool[int(m.pages("d1-0", g)[slot])]
            theirs = src.pools[layer][params["remote_block_ids"][g][slot]]
            assert mine.tobytes() == theirs.tobytes(), (layer, slot)
    window_keys = m.page_pools[1].hash_of_page
    assert [int(m.pages("d1-0", 1)[s]) in window_keys for s in range(6)] == [False] * 2 + [True] * 4
    wait_released(prefill)
    m.release("d1-0")
    m.validate()
    # A prompt sharing 5 of the 6 pages hits all 5 here (its window: slots 3-4).
    assert m.cached_prefix_length(prompt[: 5 * PAGE] + [999]) == 5 * PAGE

    gone = [params["remote_block_ids"][0], [null] * 5 + given_back[5:]]
    m.add("d2-0", prompt[:-1])
    bad = Request("d2", tuple(prompt), 8, kv_transfer={**params, "remote_block_ids": gone})
    with pytest.raises(KVTransferError, match="no longer holds the window's pages"):
        decode.fetch("d2-0", prompt[:-1], 0, bad)
    m.release("d2-0")
    m.validate()
