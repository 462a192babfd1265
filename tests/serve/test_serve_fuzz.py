"""`pagedkv serve` under hostile input: its own OpenAPI schema fuzzed with
schemathesis (valid and invalid bodies for every operation), and the limits
a client runs into (body size, prompt tokens, max_tokens, requests in
flight per key). Every answer is a correct 200 or a 4xx with OpenAI's error
body; nothing leaks a page. Loopback only; bounded example counts."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import MODEL_DEVICE, Gate
from pagedkv.models import load
from pagedkv.serve import ServerThread
from pagedkv.serve.limits import ServeLimits

WARM_GRAPHS = ("smollm2-f32",)
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""

# The test extra holds it; a lent GPU machine's staged packages do not.
schemathesis = pytest.importorskip("schemathesis", reason="the test extra is not installed")

MODEL = "smollm2-135m-instruct"
PAGE_BYTES = 2 * 16 * 3 * 64 * 4 * 30
LIMITS = ServeLimits(
    max_body_bytes=1 << 16, max_prompt_tokens=96, max_tokens=4, max_streams_per_key=2
)
HANG_GUARD = 120.0


@pytest.fixture(scope="module")
def fuzz_server():
    llm = load(MODEL, "f32", kv_memory=128 * PAGE_BYTES, device=MODEL_DEVICE)
    with ServerThread(llm, max_num_seqs=16, limits=LIMITS) as server:
        yield server
    llm.manager.validate()


def assert_error_body(response) -> None:
    body = response.json()
    assert set(body) == {"error"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["type"], str)


def assert_idle(server) -> None:
    assert server.engine.wait_idle(HANG_GUARD)
    server.engine.manager.validate()
    assert server.engine.manager.num_used_pages == 0


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_every_fuzzed_request_gets_a_200_or_an_openai_4xx(fuzz_server, mode):
    """Each operation of the server's OpenAPI schema, with bodies that fit
    it (positive) and bodies that break it (negative): never a 5xx, every
    4xx with OpenAI's error body, no page left in use."""
    api = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    statuses: list[int] = []
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
    for operation in operations:
        if mode == "negative" and operation.method.upper() != "POST":
            continue  # no parameters to break
        strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

        @given(case=strategy, served=st.booleans())
        @settings(
            max_examples=20,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def check(case, served: bool) -> None:
            # Half the bodies name the served model, so that they get past
            # the 404 and into the checks behind it.
            if served and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL
            response = case.call(timeout=HANG_GUARD)
            assert response.status_code < 500, (response.status_code, response.text[:300])
            if response.status_code >= 400:
                assert_error_body(response)
            statuses.append(response.status_code)

        check()
    assert_idle(fuzz_server)
    # The fuzzing reached the engine and its refusals, not only the 404.
    assert 200 in statuses or mode == "negative"
    assert 400 in statuses


def post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=HANG_GUARD, **kw)


def test_limits_answer_4xx_before_the_engine(fuzz_server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    huge = {**chat, "messages": [{"role": "user", "content": "x" * (2 << 16)}]}
    r = post(fuzz_server, "/v1/chat/completions", huge)
    assert r.status_code == 413
    assert_error_body(r)

    def chunks():
        data = json.dumps(huge).encode()
        for i in range(0, len(data), 4096):
            yield data[i : i + 4096]

    r = httpx.post(
        fuzz_server.url + "/v1/chat/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=HANG_GUARD,
    )
    assert r.status_code == 413

    long_prompt = {**chat, "messages": [{"role": "user", "content": "word " * 200}]}
    r = post(fuzz_server, "/v1/chat/completions", long_prompt)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(fuzz_server, "/v1/chat/completions", {**chat, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = post(fuzz_server, "/v1/chat/completions", {**chat, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
    # A lone surrogate, NUL and the last code point, as JSON escapes.
    odd = json.dumps({"model": MODEL, "prompt": "\udcff\u0000\U0010ffff", "max_tokens": 2})
    r = httpx.post(
        fuzz_server.url + "/v1/completions",
        content=odd,
        headers={"content-type": "application/json"},
        timeout=HANG_GUARD,
    )
    assert r.status_code in (200, 400), r.text
    assert_idle(fuzz_server)


def test_requests_in_flight_per_key_are_bounded(fuzz_server):
    """Two streams of one key held mid-answer (their decode steps wait on a
    gate): a third request of that key gets 429 at once, another key's is
    served, and the slots come back when the streams end."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "stream": True,
        "max_tokens": 4,
    }
    gate = Gate(fuzz_server.engine.engine, HANG_GUARD)
    fuzz_server.engine.engine = gate

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=fuzz_server.url, timeout=HANG_GUARD) as c:

            def send(key: str):
                return c.post("/v1/chat/completions", json=body, headers={"authorization": key})

            streams = [
                c.stream("POST", "/v1/chat/completions", json=body, headers={"authorization": "a"})
                for _ in range(2)
            ]
            opened = [await s.__aenter__() for s in streams]
            third = await send("a")
            other = asyncio.create_task(send("b"))
            gate.opened.set()
            for s, r in zip(streams, opened, strict=True):
                await r.aread()
                await s.__aexit__(None, None, None)
            again = await send("a")
            return [r.status_code for r in opened] + [
                third.status_code,
                (await other).status_code,
                again.status_code,
            ]

    try:
        assert asyncio.run(run()) == [200, 200, 429, 200, 200]
    finally:
        gate.opened.set()
        fuzz_server.engine.engine = gate.inner
    assert_idle(fuzz_server)
