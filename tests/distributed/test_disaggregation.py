"""Prefill/decode disaggregation end to end (slow set): `pagedkv serve --role
prefill`, `--role decode` and `pagedkv route --prefill --decode` as three
processes on loopback, beside one `pagedkv serve`, for SmolLM2 and for
Gemma 3 (sliding-window layers): 16 chats answer with
the same greedy tokens, the pages read are the prompts' full pages (bytes =
pages x page bytes), and a decode request whose prefill peer is gone fails
with a clear error and leaks no page."""

from __future__ import annotations

import re
import sys
import time

import httpx
import pytest

pytest.importorskip("nixl", reason="nixl is not installed")

from serve_vs_llamacpp import PROMPTS  # noqa: E402

from llamacpp import Server, pagedkv_serve_command  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer in one or two sentences. " * 6
MODELS = {
    # One page over every layer of the GGUF models' default int8 cache:
    # K and V x 16 tokens x KV heads x (head-dim int8 codes + a float32 scale)
    # x layers.
    "smollm2-135m-instruct": 2 * 16 * 3 * (64 + 4) * 30,
    "gemma3-270m": 2 * 16 * 1 * (256 + 4) * 18,
}


def chat(url: str, question: str, model: str, **extra) -> httpx.Response:
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 24,
        "temperature": 0,
        **extra,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=600)


def pages_used(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(r"^pagedkv_kv_pages_used (\S+)$", text, re.M).group(1))


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_a_disaggregated_pair_answers_as_one_server(model):
    # Batch-invariant: a prompt computed in two pieces (the pages read, then
    # the last partial page) gives the logits of one whole prefill.
    flags = ("--batch-invariant", "--model", model)
    servers = {
        "prefill": Server("prefill", pagedkv_serve_command(*flags, "--role", "prefill")),
        "decode": Server("decode", pagedkv_serve_command(*flags, "--role", "decode")),
        "one": Server("one", pagedkv_serve_command(*flags)),
    }
    proxy = None
    try:
        for s in servers.values():
            s.start()
        command = [sys.executable, "-m", "pagedkv", "route"]
        command += ["--prefill", servers["prefill"].url, "--decode", servers["decode"].url]
        proxy = Server("proxy", command, start_timeout=120).start()
        questions = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(16)]
        prompt_pages = 0
        for q in questions:
            split, whole = chat(proxy.url, q, model), chat(servers["one"].url, q, model)
            assert split.status_code == 200, split.text
            text = split.json()["choices"][0]["message"]["content"]
            assert text == whole.json()["choices"][0]["message"]["content"], q
            prompt_pages += (split.json()["usage"]["prompt_tokens"] - 1) // 16
        stats = httpx.get(servers["decode"].url + "/kv_transfer/stats").json()
        # The first chat reads the system prompt's pages; later ones find
        # them in the decode pool and read only their own.
        assert stats["pulled_pages"] + stats["skipped_pages"] == prompt_pages
        assert stats["skipped_pages"] > 0 and stats["failures"] == 0
        assert stats["pulled_bytes"] == stats["pulled_pages"] * MODELS[model]
        # The last notices reach the prefill side asynchronously (bounded wait).
        deadline = time.monotonic() + 60
        while True:
            kept = httpx.get(servers["prefill"].url + "/kv_transfer/stats").json()
            if kept["held"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert kept["handed_over"] == 16 and kept["held"] == 0

        # The prefill peer named by these params is gone (a question of
        # pages the decode side does not hold, so it must read).
        question = "Tell me about " + ", ".join(f"island number {i}" for i in range(30))
        first = chat(
            servers["prefill"].url,
            question,
            model,
            max_tokens=1,
            kv_transfer_params={"do_remote_decode": True},
        )
        params = first.json()["kv_transfer_params"]
        servers["prefill"].stop()
        used = pages_used(servers["decode"].url)
        lost = chat(servers["decode"].url, question, model, kv_transfer_params=params)
        # 500: the read fails (the decode side knew the peer); an unknown
        # peer that does not answer is refused before submission (502).
        assert lost.status_code in (500, 502)
        assert "the prefill instance" in lost.json()["error"]["message"]
        assert pages_used(servers["decode"].url) == used
    finally:
        if proxy is not None:
            proxy.stop()
        for s in servers.values():
            s.stop()
