"""vLLM's and llama.cpp's /tokenize and /detokenize: what a prompt or a
chat request (its tools in the prompt included) is served as, and back."""

from __future__ import annotations

import httpx
import pytest
from chat_server import MODEL, chat_server

from pagedkv.models.chat import chat_prompt

WARM_GRAPHS = ("smollm2-gguf",)
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""

ASK = [{"role": "user", "content": "What time is it?"}]
TOOLS = [{"type": "function", "function": {"name": "now"}}]
HANG_GUARD = 600.0


@pytest.fixture(scope="module")
def server():
    with chat_server() as s:
        yield s


def test_tokenize_and_detokenize(server):
    """/tokenize counts what a chat request would be served as (tools in
    its prompt included); /detokenize inverts it."""

    def post(path: str, **body) -> httpx.Response:
        return httpx.post(server.url + path, json=body, timeout=HANG_GUARD)

    llm = server.engine.llm
    chat = post("/tokenize", model=MODEL, messages=ASK, tools=TOOLS).json()
    expected = chat_prompt(llm.tokenizer, ASK, TOOLS).ids
    assert chat["tokens"] == expected and chat["count"] == len(expected)
    assert chat["max_model_len"] == server.engine.context
    plain = post("/tokenize", messages=ASK).json()["tokens"]
    assert plain == llm.tokenizer.prompt_ids(llm.tokenizer.render_chat(ASK)) != expected
    assert post("/tokenize", prompt="Hello world").json()["tokens"] == llm.tokenizer.encode(
        "Hello world"
    )
    assert post("/tokenize", content="Hi", add_special=False).json()["tokens"] == (
        llm.tokenizer.encode("Hi")
    )
    text = post("/detokenize", tokens=expected).json()
    assert text["prompt"] == text["content"] == llm.tokenizer.decode(expected)
    for path, body, status in (
        ("/tokenize", {"prompt": "a", "messages": ASK}, 400),
        ("/tokenize", {}, 400),
        ("/tokenize", {"messages": ASK, "tools": [*TOOLS, *TOOLS]}, 400),
        ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404),
        ("/detokenize", {"tokens": [10**9]}, 400),
        ("/detokenize", {"tokens": "abc"}, 400),
    ):
        assert post(path, **body).status_code == status, (path, body)
