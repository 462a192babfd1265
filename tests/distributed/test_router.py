"""The KV-aware router (pagedkv.distributed.router): its choice by cost,
Dynamo's real KV indexer feeding it from two managers' published events,
and (slow set) two `pagedkv serve` replicas behind it answering as they do
directly."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("zmq", reason="the distributed extra (pyzmq) is not installed")

from conftest import wait_until_serving  # noqa: E402
from pagedkv.cache.manager import PagedKVCacheManager  # noqa: E402
from pagedkv.distributed.kv_event_publisher import ZmqKvEventPublisher  # noqa: E402
from pagedkv.distributed.route_cli import indexer_command, wait_for_indexer  # noqa: E402
from pagedkv.distributed.router import PrefixRouter, Route, prompt_token_ids  # noqa: E402
from pagedkv.serve.server import free_port  # noqa: E402

PAGE = 4


def test_the_cheapest_replica_wins():
    """Cost = pages to prefill + pages the requests in flight added (one
    each once prefilled): the holder of a prefix wins until its load
    outweighs the prefix, and equals take turns."""
    router = PrefixRouter(["http://a", "http://b"], PAGE)
    prompt = list(range(8 * PAGE))  # 9 pages with the partial last one
    assert router.decide(prompt, {1: 6 * PAGE}) == Route(1, 6 * PAGE, 3)
    # Replica 1 holds 8 pages now (remembered): 1 to prefill + 3 in flight.
    assert router.decide(prompt, {}) == Route(1, 8 * PAGE, 1)
    assert router.in_flight == [0, 2] and router.active_pages == [0, 4]
    router.active_pages[1] += 20  # busy: 1 + 24 against 9 at the idle replica
    busy = router.decide(prompt, {})
    assert busy == Route(0, 0, 9)
    router.prefilled(busy)  # its first token came back: it weighs one page now
    assert router.active_pages[0] == 1
    router.done(busy)
    assert router.active_pages[0] == 0 and router.in_flight[0] == 0
    # Idle replicas with nothing cached: equals take turns.
    idle = PrefixRouter(["http://a", "http://b"], PAGE)
    picks = []
    for i in range(4):
        route = idle.decide([1000 + i] * 3, {})
        idle.done(route)
        picks.append(route.replica)
    assert picks == [0, 1, 0, 1]


def test_round_robin_ignores_prefixes():
    router = PrefixRouter(["http://a", "http://b", "http://c"], PAGE, policy="round-robin")
    picks = [router.decide(list(range(16)), {2: 16}).replica for _ in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match="policy"):
        PrefixRouter(["http://a"], PAGE, policy="random")
    with pytest.raises(ValueError, match="indexer_timeout"):
        PrefixRouter(["http://a"], PAGE, indexer_timeout=0.0)


def test_prompts_are_read_as_the_replicas_read_them():
    class Tokenizer:
        def prompt_ids(self, text):
            return [len(text)]

        def render_chat(self, turns):
            return "|".join(f"{t['role']}:{t['content']}" for t in turns)

    t = Tokenizer()
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_token_ids(chat, True, t) == [len("user:hi")]
    assert prompt_token_ids({"prompt": "abc"}, False, t) == [3]
    assert prompt_token_ids({"prompt": [5, 6, 7]}, False, t) == [5, 6, 7]
    assert prompt_token_ids({"prompt": [[5, 6], [7]]}, False, t) == [5, 6]
    assert prompt_token_ids({"prompt": 3}, False, t) == []


def test_dynamo_indexer_steers_the_router(tmp_path):
    """Two managers publish their events; Dynamo's indexer, started as
    `pagedkv route --kv-events` starts it, tells the router which replica
    holds each prompt's prefix, and the router sends it there."""
    pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime is not installed")
    managers = [PagedKVCacheManager(32, PAGE, 1, 8) for _ in range(2)]
    publishers = [ZmqKvEventPublisher("tcp://127.0.0.1:0") for _ in managers]
    port = free_port()
    indexer = subprocess.Popen(
        indexer_command([p.endpoint for p in publishers], PAGE, port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    # A slow answer would fall back to memory: the timeout only guards a hang.
    router = PrefixRouter(["http://a", "http://b"], PAGE, indexer_url=url, indexer_timeout=30.0)
    try:
        wait_for_indexer(url, indexer)
        for m, p in zip(managers, publishers, strict=True):
            m.subscribe(p)
        deadline = time.monotonic() + 20
        while len(json.loads(httpx.get(url + "/workers").text)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        rng = np.random.default_rng(5)
        prompts = [rng.integers(0, 1000, 6 * PAGE).tolist() for _ in range(2)]
        for i, (m, prompt) in enumerate(zip(managers, prompts, strict=True)):
            m.add(i, prompt)
            m.reserve([i], len(prompt))
        # The events reach the indexer asynchronously: ask until it knows.
        deadline = time.monotonic() + 20
        while router.indexed(prompts[1]).get(1, 0) < 6 * PAGE:
            assert time.monotonic() < deadline, router.indexed(prompts[1])
            time.sleep(0.1)
        for replica in (1, 0):
            route = router.choose(prompts[replica] + [7, 7])
            assert route.replica == replica and route.held_tokens == 6 * PAGE
            router.done(route)
        assert router.stats.indexer_errors == 0
    finally:
        indexer.terminate()
        indexer.wait(10)
        router.close()
        for p in publishers:
            p.close()


@pytest.mark.skipif(sys.platform != "linux", reason="reads the router's children in /proc")
def test_a_terminated_route_command_stops_the_indexer_it_started():
    """A SIGTERM (what a supervisor sends) to `pagedkv route --kv-events`
    ends the Dynamo indexer it started too, and the router itself as a
    SIGTERM ends a process (uvicorn raises it again once shut down)."""
    pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime is not installed")
    port = free_port()
    command = [sys.executable, "-m", "pagedkv", "route", "--replica", "http://127.0.0.1:1"]
    command += ["--kv-events", f"tcp://127.0.0.1:{free_port()}", "--port", str(port)]
    command += ["--indexer-port", str(free_port())]
    route = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_serving(route, f"http://127.0.0.1:{port}", 120)
        children = Path(f"/proc/{route.pid}/task/{route.pid}/children").read_text().split()
        (indexer,) = children
        route.terminate()
        assert route.wait(30) == -signal.SIGTERM
        assert not Path(f"/proc/{indexer}").exists(), "the indexer outlived the router"
    finally:
        if route.poll() is None:
            route.kill()
            route.wait()


def test_an_indexer_that_is_down_leaves_routing_to_memory():
    router = PrefixRouter(["http://a", "http://b"], PAGE, f"http://127.0.0.1:{free_port()}")
    first = router.choose(list(range(4 * PAGE)))
    router.done(first)
    again = router.choose(list(range(4 * PAGE)) + [1])
    assert again == Route(first.replica, 4 * PAGE, 1) and router.stats.indexer_errors == 2
    router.close()


@pytest.mark.slow
def test_two_replicas_behind_the_router_answer_as_one(tmp_path):
    """`pagedkv serve --kv-events` twice and `pagedkv route --kv-events` in
    front: chats sent through the router get the replicas' own greedy
    answers, and a second chat on a system prompt goes where the first went
    and finds it cached. Batch-invariant, so that the replica that reads the
    prompt's prefix from its cache computes what the other computes whole."""
    from llamacpp import Server, pagedkv_serve_command

    events = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    flags = ("--weights", "f32", "--batch-invariant")
    replicas = [
        Server(f"replica-{i}", pagedkv_serve_command(*flags, "--kv-events", e))
        for i, e in enumerate(events)
    ]
    router = None
    try:
        for r in replicas:
            r.start()
        command = [sys.executable, "-m", "pagedkv", "route", "--kv-events", ",".join(events)]
        command += ["--indexer-port", str(free_port())]
        for r in replicas:
            command += ["--replica", r.url]
        router = Server("router", command, start_timeout=120).start()
        system = "You answer in one short sentence about the sea. " * 12

        def ask(url, question):
            body = {
                "model": "smollm2-135m-instruct",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
                "max_tokens": 12,
                "temperature": 0,
            }
            answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
            assert answer.status_code == 200, answer.text
            return answer

        first = ask(router.url, "What is a wave?")
        replica = int(first.headers["x-pagedkv-replica"])
        second = ask(router.url, "What is a tide?")
        assert int(second.headers["x-pagedkv-replica"]) == replica
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        direct = ask(replicas[1 - replica].url, "What is a tide?")
        text = second.json()["choices"][0]["message"]["content"]
        assert text == direct.json()["choices"][0]["message"]["content"]
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()


def test_remembered_routes_expire():
    """Past remember_seconds only the indexer says where a prefix is: a
    replica that evicted it since stops drawing its prompts."""
    router = PrefixRouter(["http://a", "http://b"], PAGE, remember_seconds=-1.0)
    prompt = list(range(4 * PAGE))
    first = router.decide(prompt, {})
    router.done(first)
    assert router.decide(prompt, {}).held_tokens == 0
