"""`pagedkv serve` ended by SIGTERM, as a supervisor ends it: a stream in
flight finishes (`--shutdown-timeout`), then the process runs its cleanup
(the engine stops, the KV event publisher sends what is queued) and its
routers hear that its cache is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import warm_graphs

httpx = pytest.importorskip("httpx", reason="the test extra (httpx) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")
zmq = pytest.importorskip("zmq", reason="the distributed extra (pyzmq) is not installed")

from conftest import wait_until_serving  # noqa: E402
from pagedkv.distributed.kv_event_wire import decode_batch  # noqa: E402
from pagedkv.serve.server import free_port  # noqa: E402

MODEL = "smollm2-135m-instruct"
STREAMED_TOKENS = 128


def test_a_terminated_server_finishes_its_streams_and_tells_its_routers_its_cache_is_gone():
    warm_graphs.wait("smollm2-gguf")
    port, events = free_port(), f"tcp://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "pagedkv", "serve", "--model", MODEL]
    command += ["--port", str(port), "--kv-events", events, "--shutdown-timeout", "60"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 20000)  # a hang guard: events come in milliseconds
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(events)
    try:
        wait_until_serving(server, f"http://127.0.0.1:{port}", 600)
        # Chats of new prompts until their cached pages are heard of (a PUB
        # drops what it sends before the subscription has reached it).
        for i in range(50):
            prompt = f"Chat {i}: " + "tell me about pages of keys and values. " * 8
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
            answer = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={**body, "max_tokens": 1},
                timeout=60,
            )
            answer.raise_for_status()
            if sock.poll(200):
                break
        else:
            pytest.fail("no KV event reached the subscriber")
        stream = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": STREAMED_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        with httpx.stream("POST", url, json=stream, timeout=60) as answer:
            lines = answer.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            server.send_signal(signal.SIGTERM)  # the stream has begun
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert chunks[-1]["usage"]["completion_tokens"] == STREAMED_TOKENS
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        kinds = []
        while "AllBlocksCleared" not in kinds:  # each receive waits 20 s at most
            kinds += [e[0] for e in decode_batch(sock.recv_multipart()[2])[1]]
        assert kinds[0] == "BlockStored" and kinds[-1] == "AllBlocksCleared"
        assert server.wait(30) == -signal.SIGTERM
    finally:
        sock.close(0)
        if server.poll() is None:
            os.kill(server.pid, signal.SIGKILL)
            server.wait()
