"""KV events over ZeroMQ in vLLM's wire format: the frames and payloads a
subscriber reads, replay, and Dynamo's real KV indexer following two
replicas and naming the one that holds a prompt's prefix."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

zmq = pytest.importorskip("zmq", reason="the distributed extra (pyzmq) is not installed")
pytest.importorskip("msgpack", reason="the distributed extra (msgpack) is not installed")

from pagedkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from pagedkv.cache.manager import PagedKVCacheManager  # noqa: E402
from pagedkv.distributed.kv_event_publisher import ZmqKvEventPublisher  # noqa: E402
from pagedkv.distributed.kv_event_wire import block_hash_int, decode_batch  # noqa: E402
from pagedkv.serve.server import free_port  # noqa: E402

PAGE = 4
TIMEOUT_MS = 30000  # a hang guard: events arrive in milliseconds


def subscriber(endpoint: str):
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


SENTINEL = BlockRemoved([bytes(16)], medium="sentinel")
"""The last event `connected` publishes: no manager sends its like."""


def connected(publisher, sock) -> None:
    """Waits until the SUB socket receives (a PUB drops messages sent before
    a subscriber's connection completes): probe events are published until
    one arrives, then a sentinel, and what comes up to it is read, so the
    next message is the first event published after this returns."""
    for _ in range(100):
        publisher(AllBlocksCleared())
        if sock.poll(50):
            break
    else:
        pytest.fail("the subscriber never connected")
    publisher(SENTINEL)  # after every probe: one queue, sent in order
    while True:  # each receive waits at most TIMEOUT_MS
        events = decode_batch(sock.recv_multipart()[2])[1]
        if events[-1][0] == "BlockRemoved":
            return


def test_wire_form_follows_vllm_structs():
    """Each event encodes as vLLM's tagged array-like struct: hashes as the
    keys' low 64 bits, parents chained, the page's token ids."""
    m = PagedKVCacheManager(4, PAGE, 1, 8)
    seen = []
    m.subscribe(seen.append)
    m.add("a", list(range(9)))
    m.reserve(["a"], 9)
    m.release("a")
    m.add("b", [50 + i for i in range(16)])
    m.reserve(["b"], 16)  # the pool has 4 pages: "a"'s two cached pages go
    m.reset_prefix_cache()
    from pagedkv.distributed.kv_event_wire import encode_batch

    batch = decode_batch(encode_batch(seen, data_parallel_rank=3, ts=7.5))
    assert batch[0] == 7.5 and batch[2] == 3
    wire = batch[1]
    assert [e[0] for e in wire] == [type(e).__name__ for e in seen]
    first = seen[0]
    assert isinstance(first, BlockStored)
    assert wire[0] == [
        "BlockStored",
        [block_hash_int(k) for k in first.block_hashes],
        None,
        list(range(8)),
        PAGE,
        None,
        "CPU",
        None,
    ]
    # The low 64 bits of each 16-byte key, read here on their own.
    assert wire[0][1] == [int.from_bytes(k[8:], "big") for k in first.block_hashes]
    removed = [w for w, e in zip(wire, seen, strict=True) if isinstance(e, BlockRemoved)]
    assert removed and sorted(h for w in removed for h in w[1]) == sorted(wire[0][1])
    assert wire[-1] == ["AllBlocksCleared"]


def test_publisher_sends_numbered_batches_and_replays_them():
    """A subscriber reads (topic, seq, payload) frames with seq counting up by
    one; the replay socket sends every kept batch from a given number, then
    the end marker."""
    m = PagedKVCacheManager(16, PAGE, 1, 8)
    publisher = ZmqKvEventPublisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="kv"
    )
    sock = subscriber(publisher.endpoint)
    try:
        connected(publisher, sock)
        seen = []
        m.subscribe(seen.append)
        m.subscribe(publisher)
        for i in range(3):
            m.add(i, [10 * i + t for t in range(8)])
            m.reserve([i], 8)
        got, numbers = [], []
        while len(got) < len(seen):
            topic, seq, payload = sock.recv_multipart()
            assert topic == b"kv"
            numbers.append(int.from_bytes(seq, "big"))
            got += decode_batch(payload)[1]
        assert [e[1] for e in got] == [[block_hash_int(k) for k in e.block_hashes] for e in seen]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))

        # vLLM's replay client: a DEALER sends (b"", first number).
        req = zmq.Context.instance().socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        req.connect(publisher.replay_endpoint)
        req.send_multipart((b"", numbers[0].to_bytes(8, "big")))
        replayed = []
        while True:
            _, seq, payload = req.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.append(int.from_bytes(seq, "big"))
        req.close(0)
        assert replayed == numbers
    finally:
        sock.close(0)
        publisher.close()


PUBLISH_THEN_END = """
import os, signal, sys
from pagedkv.cache.kv_events import AllBlocksCleared, BlockStored
from pagedkv.distributed.kv_event_publisher import ZmqKvEventPublisher

publisher = ZmqKvEventPublisher(sys.argv[1], bind=False)
while not sys.stdin.readline().strip():  # an empty line: the test wants a probe
    publisher(AllBlocksCleared())
tokens = list(range(1 << 22))  # more than loopback sockets buffer
publisher(BlockStored([bytes(16)], None, tokens, len(tokens)))
publisher(BlockStored([bytes(16)], None, [1], 1))
publisher.close(timeout=60)  # ample for a busy machine: it returns once all has left
os.kill(os.getpid(), signal.SIGTERM)  # as a server ends on SIGTERM
"""


def test_events_published_before_close_outlive_the_process():
    """A process that publishes, closes its publisher and ends at once (a
    server on SIGTERM) still delivers every event, a batch of megabytes
    included (one larger than the sockets buffer): close() waits until
    they have left."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    command = [sys.executable, "-c", PUBLISH_THEN_END, f"tcp://127.0.0.1:{port}"]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, text=True)
    try:
        for _ in range(200):  # probes until one arrives (PUB drops them before)
            process.stdin.write("\n")
            process.stdin.flush()
            if sock.poll(50):
                break
        else:
            pytest.fail("the publisher never connected")
        process.stdin.write("go\n")
        process.stdin.flush()
        got = []
        while not got or got[-1][0] != "BlockStored" or len(got[-1][3]) != 1:
            got += decode_batch(sock.recv_multipart()[2])[1]  # waits TIMEOUT_MS at most
        assert [len(e[3]) for e in got if e[0] == "BlockStored"] == [1 << 22, 1]
        assert process.wait(30) == -signal.SIGTERM
    finally:
        sock.close(0)
        if process.poll() is None:
            process.kill()
            process.wait()


def test_only_the_full_attention_group_is_published():
    """A manager with a window group: its events (pages given back as the
    window passes) stay home unless asked for; group 0's go out."""
    m = PagedKVCacheManager(16, PAGE, 1, 8, num_layers=2, layer_groups=[((0,), None), ((1,), 4)])
    publisher = ZmqKvEventPublisher("tcp://127.0.0.1:0")
    everything = ZmqKvEventPublisher("tcp://127.0.0.1:0", groups=None)
    try:
        seen = []
        m.subscribe(seen.append)
        m.add("a", list(range(12)))
        m.reserve(["a"], 12)
        m.reserve(["a"], 4)  # the window gives pages back
        assert {e.group_idx for e in seen} == {0, 1}
        assert all(everything.wants(e) for e in seen)
        assert [publisher.wants(e) for e in seen] == [e.group_idx == 0 for e in seen]
    finally:
        publisher.close()
        everything.close()


def test_a_bad_endpoint_is_a_clear_error():
    with pytest.raises(ValueError, match="ZeroMQ address"):
        ZmqKvEventPublisher("127.0.0.1:5557")
    with pytest.raises(ValueError, match="cannot open"):
        ZmqKvEventPublisher("tcp://256.0.0.1:1")


@pytest.fixture
def dynamo_indexer():
    """Starts Dynamo's standalone KV indexer; yields (start, query)."""
    pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime is not installed")
    procs = []
    port = free_port()

    def start(workers: dict[int, str]) -> None:
        spec = ",".join(f"{w}={endpoint}" for w, endpoint in workers.items())
        cmd = [sys.executable, "-m", "dynamo.indexer", "--block-size", str(PAGE)]
        cmd += ["--port", str(port), "--threads", "1", "--workers", spec]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                workers_seen = json.loads(get("/workers"))
                if len(workers_seen) == len(workers):
                    return
            except OSError:
                pass
            time.sleep(0.1)
        pytest.fail("Dynamo's indexer did not start")

    def get(path: str) -> bytes:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).read()

    def query(tokens: list[int]) -> dict[int, int]:
        body = json.dumps({"token_ids": tokens, "model_name": "default"}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/query", body, {"Content-Type": "application/json"}
        )
        answer = json.loads(urllib.request.urlopen(request, timeout=5).read())
        return {int(w): v["longest_matched"] for w, v in answer["instances"].items()}

    yield start, query
    for p in procs:
        p.terminate()
        p.wait(10)


def test_dynamo_indexer_follows_two_replicas(dynamo_indexer):
    """Two managers publish; Dynamo's indexer names, for each prompt, the
    replica holding its longest cached prefix, and forgets evicted pages
    and a replica whose cache was cleared."""
    start, query = dynamo_indexer
    managers = [PagedKVCacheManager(12, PAGE, 1, 8) for _ in range(2)]
    publishers = [ZmqKvEventPublisher("tcp://127.0.0.1:0") for _ in managers]
    try:
        for m, p in zip(managers, publishers, strict=True):
            m.subscribe(p)
        start({1: publishers[0].endpoint, 2: publishers[1].endpoint})
        rng = np.random.default_rng(0)
        shared = rng.integers(0, 1000, 2 * PAGE).tolist()
        one = shared + rng.integers(0, 1000, 4 * PAGE).tolist()
        two = shared + rng.integers(0, 1000, 3 * PAGE).tolist()
        for m, (rid, prompt) in zip(managers, (("a", one), ("b", two)), strict=True):
            m.add(rid, prompt)
            m.reserve([rid], len(prompt))

        def settled(prompt, expected) -> bool:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if query(prompt) == expected:
                    return True
                time.sleep(0.1)
            return False

        assert settled(one, {1: len(one), 2: len(shared)}), query(one)
        assert settled(two, {1: len(shared), 2: len(two)}), query(two)
        # Replica 2 evicts "b"'s pages for a new prompt: the indexer drops them.
        managers[1].release("b")
        other = rng.integers(0, 1000, 12 * PAGE).tolist()
        managers[1].add("c", other)
        managers[1].reserve(["c"], len(other))
        assert settled(two, {1: len(shared)}), query(two)
        # Replica 1 ends (`pagedkv serve` on SIGTERM): the indexer forgets it.
        publishers[0](AllBlocksCleared())
        assert settled(one, {}), query(one)
    finally:
        for p in publishers:
            p.close()
