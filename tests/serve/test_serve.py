"""`pagedkv serve` through the official `openai` client, on a loopback port.

Greedy answers equal `LLM.generate`'s on the same prompts (chat and
completion, streamed and not); 64 concurrent streaming clients over a pool
small enough to force preemption, 10 of them leaving midway, all get their
full answers and leave no page in use; bad input gets OpenAI's error bodies.
Nothing here measures time: waits are hang guards only, and races are made
deterministic by holding the engine's decode step behind a gate.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest

from conftest import MODEL_DEVICE, Gate
from pagedkv.models import load
from pagedkv.serve import ServerThread

WARM_GRAPHS = ("smollm2-f32",)
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""

MODEL = "smollm2-135m-instruct"
PAGE_BYTES = 2 * 16 * 3 * 64 * 4 * 30
"""One float32 page of SmolLM2-135M (16 tokens, 3 KV heads of 64, 30 layers)."""
WEIGHTS = "f32"
"""The server's model runs the exact float32 path: the tests hold its answers
to generate's token for token whatever the batching, which the quantized
products' per-block activation rounding does not promise (their accuracy is
tools/llamacpp_logits.py's and test_qlinear's)."""
LOGPROB_ABS = 2e-3 if MODEL_DEVICE == "cpu" else 1e-2
"""How far a token's logprob from a decode step may be from the same from a
prefill: other float32 kernels on each side, and MAX's GPU matmuls round
one row and many rows further apart than the CPU's."""
PROMPTS = [
    "Write a haiku about the sea.",
    "Explain in two sentences what a KV cache is.",
    "Give me a tip for learning to play the guitar.",
    "Why is the sky blue?",
    "Name a famous painting by Leonardo da Vinci.",
    "What is the capital of France?",
]
"""Prompts whose first 32 greedy tokens have no near-tie (tests/data's
transformers gaps), so batching and recompute cannot flip them."""
MAX_TOKENS = 32
HANG_GUARD = 600.0


@pytest.fixture(scope="module")
def llm():
    return load(MODEL, WEIGHTS, kv_memory=256 * PAGE_BYTES, device=MODEL_DEVICE)


@pytest.fixture(scope="module")
def reference(llm):
    """LLM.generate's greedy answers (before any server owns the manager)."""
    chat = llm.generate(PROMPTS, max_new_tokens=MAX_TOKENS)
    raw = llm.generate(PROMPTS, max_new_tokens=MAX_TOKENS, chat=False)
    return {"chat": chat, "raw": raw}


@pytest.fixture(scope="module")
def server(llm, reference):
    with ServerThread(llm, max_num_seqs=16) as s:
        yield s
    llm.manager.validate()


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, **kw)


def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=HANG_GUARD
    )


def assert_no_page_in_use(server) -> None:
    assert server.engine.wait_idle(HANG_GUARD)
    manager = server.engine.manager
    manager.validate()
    assert manager.num_used_pages == 0
    assert manager.request_ids == []


def finish(reason: str) -> str:
    return "stop" if reason == "stop" else "length"


@pytest.fixture
def gated(server):
    gate = Gate(server.engine.engine)
    server.engine.engine = gate
    yield gate
    gate.opened.set()
    server.engine.engine = gate.inner
    assert_no_page_in_use(server)


def wait_for(condition) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not condition():
        assert time.monotonic() < deadline, "hang guard"
        time.sleep(0.01)


# ------------------------------------------------------------------- answers


def test_chat_equals_generate_streamed_and_not(server, reference):
    async def ask_all():
        c = aclient(server)

        async def plain(prompt):
            return await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=MAX_TOKENS,
                temperature=0,
            )

        async def streamed(prompt):
            stream = await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, reasons, usage = [], [], None
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    text.append(choice.delta.content or "")
                    reasons.append(choice.finish_reason)
            return "".join(text), [r for r in reasons if r], usage

        return await asyncio.gather(
            asyncio.gather(*(plain(p) for p in PROMPTS)),
            asyncio.gather(*(streamed(p) for p in PROMPTS)),
        )

    plain, streamed = asyncio.run(ask_all())
    for want, got, (text, reasons, usage) in zip(reference["chat"], plain, streamed, strict=True):
        assert got.choices[0].message.content == want.text
        assert got.choices[0].finish_reason == finish(want.finish_reason)
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.token_ids)
        assert text == want.text
        assert reasons == [finish(want.finish_reason)]
        assert usage.completion_tokens == len(want.token_ids)
    assert_no_page_in_use(server)


def test_completion_equals_generate_streamed_and_not(server, reference):
    c = client(server)
    for prompt, want in zip(PROMPTS[:3], reference["raw"][:3], strict=True):
        got = c.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == want.text
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        chunks = list(
            c.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
        )
        assert "".join(ch.choices[0].text for ch in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == finish(want.finish_reason)
    # A batch of prompts: each prompt's choices in order.
    got = c.completions.create(
        model=MODEL, prompt=PROMPTS[:2], max_tokens=MAX_TOKENS, temperature=0
    )
    assert [ch.text for ch in got.choices] == [w.text for w in reference["raw"][:2]]
    assert_no_page_in_use(server)


def test_n_samples_stop_seed_and_cached_prompt_tokens(server, reference):
    c = client(server)
    messages = [{"role": "user", "content": PROMPTS[5]}]
    first = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    again = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, n=3
    )
    # The system prompt's and the question's full pages come from the prefix cache.
    page = server.engine.manager.page_size
    prompt = first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // page * page
    assert [ch.index for ch in again.choices] == [0, 1, 2]
    # Greedy sample k starts from the k-th most likely token; sample 0 is the answer.
    assert again.choices[0].message.content == reference["chat"][5].text
    assert len({ch.message.content for ch in again.choices}) == 3
    stopped = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stop=["Paris"]
    )
    assert stopped.choices[0].message.content == reference["chat"][5].text.split("Paris")[0]
    assert stopped.choices[0].finish_reason == "stop"
    sampled = [
        c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=1.0, top_p=0.9, seed=7, n=2
        )
        for _ in range(2)
    ]
    assert [ch.message.content for ch in sampled[0].choices] == [
        ch.message.content for ch in sampled[1].choices
    ]
    # top_k (vLLM's extension) 1 leaves the most likely token only: greedy.
    only_best = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=1.0, seed=3,
        extra_body={"top_k": 1},
    )  # fmt: skip
    assert only_best.choices[0].message.content == reference["chat"][5].text
    assert_no_page_in_use(server)


def test_ignore_eos_generates_max_tokens(server, reference):
    """With ignore_eos an answer that ends at EOS goes on to exactly
    max_tokens tokens (finish_reason "length"), on both endpoints, streamed
    and not; without it the same request stops at EOS."""
    early = [(p, w) for p, w in zip(PROMPTS, reference["chat"], strict=True)]
    early = [(p, w) for p, w in early if w.finish_reason == "stop"]
    assert early, "no reference answer ends at EOS before max_tokens"
    prompt, want = early[0]
    assert len(want.token_ids) < MAX_TOKENS
    assert want.token_ids[-1] == server.engine.tokenizer.eos_token_id
    c = client(server)
    messages = [{"role": "user", "content": prompt}]
    common = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0}
    ignore = {"extra_body": {"ignore_eos": True}}
    got = c.chat.completions.create(messages=messages, **common, **ignore)
    assert got.usage.completion_tokens == MAX_TOKENS
    assert got.choices[0].finish_reason == "length"
    assert got.choices[0].message.content.startswith(want.text)
    chunks = list(
        c.chat.completions.create(
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **common,
            **ignore,
        )
    )
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    reasons = [ch.finish_reason for chunk in chunks for ch in chunk.choices if ch.finish_reason]
    assert reasons == ["length"]
    text = "".join(ch.delta.content or "" for chunk in chunks for ch in chunk.choices)
    assert text == got.choices[0].message.content
    raw = c.completions.create(prompt=want.prompt_token_ids, **common, **ignore)
    assert raw.usage.completion_tokens == MAX_TOKENS
    assert raw.choices[0].finish_reason == "length"
    plain = c.completions.create(prompt=want.prompt_token_ids, **common)
    assert plain.usage.completion_tokens == len(want.token_ids)
    assert plain.choices[0].finish_reason == "stop"
    assert_no_page_in_use(server)


def step_counts(text: str) -> dict[str, float]:
    """The step histogram's counts by phase, from /metrics text."""
    found = re.findall(r'^pagedkv_step_seconds_count\{phase="(\w+)"\} (\S+)$', text, re.M)
    return {phase: float(count) for phase, count in found}


def test_models_health_and_metrics(server):
    assert [m.id for m in client(server).models.list()] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    before = step_counts(httpx.get(server.url + "/metrics").text)
    client(server).completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True}
    )
    text = httpx.get(server.url + "/metrics").text
    # One prefill gives the first token; two decode steps the other two.
    after = step_counts(text)
    assert after["prefill"] - before.get("prefill", 0) == 1
    assert after["decode"] - before.get("decode", 0) == 2
    for name in (
        "pagedkv_requests_running",
        "pagedkv_requests_waiting",
        "pagedkv_requests_prefilling",
        "pagedkv_kv_pages_used",
        "pagedkv_kv_pages_free",
        "pagedkv_kv_pages_cached",
        "pagedkv_prefix_cache_hit_rate",
        "pagedkv_generated_tokens_total",
        "pagedkv_time_to_first_token_seconds_bucket",
        "pagedkv_inter_token_latency_seconds_bucket",
    ):
        assert name in text
    # The engine's thread is named for the OS too (top -H, /proc).
    engine_tid = server.engine._thread.native_id
    with open(f"/proc/self/task/{engine_tid}/comm") as f:
        assert f.read().strip() == "pagedkv-engine"


# ------------------------------------------------------- faults and overload


def test_disconnect_frees_pages(server, gated):
    """A client leaving mid-stream cancels its request; its pages go back."""
    c = client(server)
    stream = c.completions.create(
        model=MODEL, prompt="Count to one thousand: 1, 2, 3,", max_tokens=400, stream=True
    )
    next(iter(stream))  # the prefill's token; the engine now waits in decode
    before = server.engine.cancels_received
    stream.close()
    wait_for(lambda: server.engine.cancels_received > before)
    gated.opened.set()
    assert_no_page_in_use(server)


def test_a_failing_prefill_fails_its_request_and_caches_nothing(server, monkeypatch):
    """A prefill whose graph raises answers its request with a 500; the
    server goes on, and the same prompt next time finds none of the pages
    the failed step was to fill in the prefix cache."""
    engine = server.engine.engine
    run = engine._run

    def failing(model, kind, inputs):
        if kind == "prefill":
            raise RuntimeError("the graph failed")
        return run(model, kind, inputs)

    text = "Describe, page after page, a quiet morning in a small mountain village. " * 6
    messages = [{"role": "user", "content": text}]
    c = client(server, timeout=HANG_GUARD)
    monkeypatch.setattr(engine, "_run", failing)
    with pytest.raises(openai.InternalServerError, match="the graph failed"):
        c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    monkeypatch.setattr(engine, "_run", run)
    again = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    page = server.engine.manager.page_size
    # The template's first pages (its default system prompt) were cached by
    # the tests before; the question's were only ever in the failed step.
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached < again.usage.prompt_tokens - 4 * page
    third = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens > cached + 4 * page
    assert third.choices[0].message.content == again.choices[0].message.content
    assert_no_page_in_use(server)


def test_queue_full_is_503_with_retry_after(server, gated):
    """With the engine held in a decode step and one request waiting, the
    next one is refused at once."""
    engine = server.engine
    limit, engine.max_waiting = engine.max_waiting, 1
    try:
        c = client(server)
        running = c.completions.create(model=MODEL, prompt="Hello", max_tokens=4, stream=True)
        next(iter(running))
        results = []

        def ask():
            try:
                r = httpx.post(
                    server.url + "/v1/completions",
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                    timeout=HANG_GUARD,
                )
                results.append(r)
            except Exception as e:  # pragma: no cover - reported below
                results.append(e)

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: len(results) == 1)  # one waits, the other is refused
        refused = results[0]
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "server_overloaded"
        gated.opened.set()
        for t in threads:
            t.join(HANG_GUARD)
        assert results[1].status_code == 200
        list(running)
    finally:
        engine.max_waiting = limit


def hi(**fields) -> dict:
    """A chat request saying "hi", with `fields` added."""
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL}, 400, "messages"),
        (hi(max_tokens=0), 400, "max_tokens"),
        (hi(max_tokens=10**6), 400, "messages"),
        (hi(temperature=-1), 400, "temperature"),
        (hi(top_p=0), 400, "top_p"),
        (hi(n=0), 400, "n"),
        (hi(top_k=-2), 400, "top_k"),
        (hi(min_p=1.5), 400, "min_p"),
        (hi(top_logprobs=2), 400, "top_logprobs"),
        (hi(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
        (hi(tools=[{}]), 400, "tools"),
        (hi(functions=[{"name": "f"}]), 400, "functions"),
        (hi(reasoning_format="deepseek"), 400, "reasoning_format"),
        (hi(chat_template_kwargs={"messages": []}), 400, "messages"),
        (hi(logit_bias={"x": 1}), 400, "logit_bias"),
        (hi(logit_bias={"99999999": 1}), 400, "logit_bias"),
        (hi(presence_penalty=3), 400, "presence_penalty"),
        (hi(repetition_penalty=0), 400, "repetition_penalty"),
        (hi(stop_token_ids=[10**9]), 400, "stop_token_ids"),
        (hi(max_tokens=4, min_tokens=5), 400, "min_tokens"),
        (
            {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
            400,
            "messages.0.role",
        ),
        (hi(stop=[""]), 400, "stop"),
        (hi(priority="high"), 400, "priority"),
        (hi(model="gpt-4"), 404, "model"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
    ],
)
def test_bad_chat_requests(server, body, status, param):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    assert error["param"] == param


def test_min_tokens_holds_back_the_end(server):
    """vLLM's min_tokens: a short answer goes on past its EOS."""
    post = server.url + "/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 48}
    short = httpx.post(post, json={**body, "temperature": 0}, timeout=HANG_GUARD).json()
    assert short["usage"]["completion_tokens"] < 30
    held = httpx.post(post, json={**body, "temperature": 0, "min_tokens": 30}, timeout=HANG_GUARD)
    assert held.json()["usage"]["completion_tokens"] >= 30


def test_bad_completion_requests(server):
    post = server.url + "/v1/completions"
    r = httpx.post(post, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(post, json={"model": MODEL, "prompt": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(post, json={"model": MODEL, "prompt": ""})
    assert r.status_code == 400
    long_prompt = "word " * 9000
    r = httpx.post(post, json={"model": MODEL, "prompt": long_prompt}, timeout=HANG_GUARD)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="nope", prompt="hi")
    assert httpx.get(server.url + "/health").status_code == 200
    assert_no_page_in_use(server)


def test_request_larger_than_the_pool_is_400():
    small = load(MODEL, WEIGHTS, kv_memory=4 * PAGE_BYTES, device=MODEL_DEVICE)
    with ServerThread(small) as s:
        r = httpx.post(
            s.url + "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 100},
            timeout=HANG_GUARD,
        )
        assert r.status_code == 400
        assert "the pool holds 4" in r.json()["error"]["message"]


# ----------------------------------------------------------------- load test


def test_load_with_preemption_and_disconnects(reference):
    """64 concurrent streaming chats over 16 pages (each needs up to 5 at full
    length): the scheduler preempts, 10 clients leave after a few chunks,
    every other answer is whole and equal to generate's, and afterwards no
    page is in use but the prefix cache."""
    small = load(MODEL, WEIGHTS, kv_memory=16 * PAGE_BYTES, device=MODEL_DEVICE)
    with ServerThread(small, max_num_seqs=16) as s:
        c = aclient(s)

        async def one(i: int):
            stream = await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": PROMPTS[i % 5]}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
            )
            text, reasons, chunks = [], [], 0
            async for chunk in stream:
                chunks += 1
                for choice in chunk.choices:
                    text.append(choice.delta.content or "")
                    reasons.append(choice.finish_reason)
                if i % 6 == 0 and i < 60 and chunks == 4:
                    await stream.close()  # 10 clients leave midway
                    return None
            return "".join(text), [r for r in reasons if r]

        async def run():
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), HANG_GUARD)

        results = asyncio.run(run())
        assert sum(r is None for r in results) == 10
        for i, result in enumerate(results):
            if result is not None:
                want = reference["chat"][i % 5]
                assert result == (want.text, [finish(want.finish_reason)]), i
        assert s.engine.stats.preemptions > 0
        assert httpx.get(s.url + "/health").status_code == 200
        assert_no_page_in_use(s)
        assert small.manager.num_cached_pages > 0
        metrics = httpx.get(s.url + "/metrics").text
        assert 'pagedkv_sequences_finished_total{reason="cancelled"}' in metrics
        assert json.loads(json.dumps(s.engine.stats.__dict__))["running"] == 0


def test_logprobs_of_a_decode_equal_the_echoed_prompts(server, reference):
    """Two code paths for the same numbers: the logprobs of 8 greedy tokens
    as decode steps chose them, and the same tokens' logprobs as prompt
    tokens of an echo request (one prefill, max_tokens 0, lm-eval's way);
    the greedy token is each step's most likely one."""
    c = client(server)
    want = next(w for w in reference["raw"] if len(w.token_ids) >= 8)
    prompt = list(want.prompt_token_ids)
    got = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3
    ).choices[0]
    assert got.text == server.engine.tokenizer.decode(want.token_ids[:8])
    lp = got.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and max(top.values()) == pytest.approx(logprob)
        assert top[token] == logprob and len(top) == 3

    ids = prompt + list(want.token_ids[:8])
    echo = c.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, temperature=0, logprobs=1, echo=True
    )
    choice = echo.choices[0]
    assert echo.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert choice.text == server.engine.tokenizer.decode(ids)
    elp = choice.logprobs
    assert len(elp.tokens) == len(ids) and elp.token_logprobs[0] is None
    assert elp.top_logprobs[0] is None
    for a, b in zip(elp.token_logprobs[len(prompt) :], lp.token_logprobs, strict=True):
        assert a == pytest.approx(b, abs=LOGPROB_ABS)
    assert all(x <= 0 for x in elp.token_logprobs[1:])
    assert elp.text_offset == sorted(elp.text_offset)

    # max_tokens 1: the prompt's entries, then the one generated token's.
    one = c.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True
    ).choices[0]
    assert len(one.logprobs.token_logprobs) == len(ids) + 1
    assert one.logprobs.token_logprobs[: len(ids)] == elp.token_logprobs
    # Token-id lists, a choice each: what lm-eval's local-completions sends.
    two = c.completions.create(model=MODEL, prompt=[ids[:5], ids], max_tokens=0, logprobs=1,
                               echo=True).choices  # fmt: skip
    assert [len(ch.logprobs.token_logprobs) for ch in two] == [5, len(ids)]
    assert two[1].logprobs.token_logprobs[1:] == pytest.approx(
        elp.token_logprobs[1:], abs=LOGPROB_ABS
    )
    assert_no_page_in_use(server)


def test_chat_logprobs_streamed_and_not(server, reference):
    c = client(server)
    messages = [{"role": "user", "content": PROMPTS[5]}]
    common = {"model": MODEL, "max_tokens": 6, "temperature": 0, "logprobs": True}
    whole = c.chat.completions.create(messages=messages, top_logprobs=2, **common)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    for e in content:
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert bytes(e.bytes).decode() == e.token
    want = reference["chat"][5]
    assert whole.choices[0].message.content == server.engine.tokenizer.decode(want.token_ids[:6])
    chunks = list(
        c.chat.completions.create(messages=messages, stream=True, top_logprobs=2, **common)
    )
    streamed = [
        e
        for ch in chunks
        for choice in ch.choices
        if choice.logprobs
        for e in choice.logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert_no_page_in_use(server)


def test_logit_bias_and_penalties_over_http(server):
    c = client(server)
    prompt = server.engine.tokenizer.encode("Count: one, two, three,")
    forced = server.engine.tokenizer.encode(" banana")[0]
    biased = c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100}, logprobs=0).choices[0]  # fmt: skip
    assert biased.text == server.engine.tokenizer.decode([forced] * 3)
    plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    penalized = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, frequency_penalty=2.0
    )
    assert penalized.choices[0].text != plain.choices[0].text
    assert_no_page_in_use(server)
