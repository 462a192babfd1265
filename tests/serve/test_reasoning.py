"""Reasoning models' `<think>` blocks returned as `reasoning_content`, apart
from the answer: split whole and streamed, from `LLM.chat` and over HTTP,
where the answer opens the block and where the prompt does, and left in
under reasoning_format "none".

SmolLM2 does not reason; a regular expression (`response_format`) makes it
write a block, and a template that speaks of `<think>` as Qwen 3's does
(tests/data/reasoning_chat_template.jinja) makes pagedkv read it as one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from chat_server import openai_client

from pagedkv.models import load
from pagedkv.models.reasoning import (
    ReasoningStream,
    prompt_opens_reasoning,
    split_reasoning,
    template_reasons,
)
from pagedkv.serve import ServerThread

MODEL = "smollm2-135m-instruct"
TEMPLATE = Path(__file__).parent.parent / "data" / "reasoning_chat_template.jinja"
ASK = [{"role": "user", "content": "What is two plus two?"}]
THINKS = r"<think>\n([a-z ]{1,30})\n</think>\n\n([A-Z][a-z ]{1,30}\.)"
"""An answer that reasons: the block, a blank line, one sentence."""
ANSWERS = r"[A-Z][a-z ]{1,30}\."
HANG_GUARD = 600.0


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("<think>\nIt is 4.\n</think>\n\nFour.", False, ("It is 4.", "Four.")),
        ("  <think>a\n\nb</think>c ", False, ("a\n\nb", "c ")),
        ("Four.", False, (None, "Four.")),
        ("\n\nFour.", False, (None, "\n\nFour.")),
        ("<thinking>x", False, (None, "<thinking>x")),
        ("a </think> b", False, (None, "a </think> b")),
        ("<think>\ncut short ", False, ("cut short", "")),
        ("<think>\n\n</think>\n\nFour.", False, ("", "Four.")),
        ("It is 4.\n</think>\n\nFour.", True, ("It is 4.", "Four.")),
        ("still thinking", True, ("still thinking", "")),
    ],
)
def test_split_whole_and_streamed_alike(text, opened, expected):
    assert split_reasoning(text, opened) == expected
    for size in (1, 2, 3, 5):
        stream = ReasoningStream(opened)
        pieces = [stream.push(text[i : i + size]) for i in range(0, len(text), size)]
        pieces.append(stream.finish())
        reasoning = "".join(r for r, _ in pieces) if stream.reasoned else None
        assert (reasoning, "".join(c for _, c in pieces)) == expected, size


def test_which_templates_and_prompts_reason():
    assert template_reasons(TEMPLATE.read_text())
    assert not template_reasons(load(MODEL).tokenizer.chat_template)
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def llm():
    return load(MODEL, chat_template=TEMPLATE.read_text())


def regex(expression: str) -> dict:
    return {"type": "regex", "regex": expression}


def test_llm_chat_returns_the_block_apart(llm):
    (answer,) = llm.chat([ASK], max_new_tokens=48, response_format=regex(THINKS))
    thought, sentence = re.fullmatch(THINKS, llm.tokenizer.decode(answer.token_ids)).groups()
    assert (answer.reasoning_content, answer.text) == (thought, sentence)
    assert answer.as_json()["reasoning_content"] == thought
    (kept,) = llm.chat([ASK], 48, response_format=regex(THINKS), reasoning_format="none")
    assert kept.reasoning_content is None and re.fullmatch(THINKS, kept.text)
    (plain,) = llm.chat(
        [ASK], 48, response_format=regex(ANSWERS), chat_template_kwargs={"enable_thinking": False}
    )
    assert plain.prompt.endswith("<think>\n\n</think>\n\n")
    assert plain.reasoning_content is None and re.fullmatch(ANSWERS, plain.text)
    with pytest.raises(ValueError, match="reasoning_format"):
        llm.chat([ASK], reasoning_format="deepseek")
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat([ASK], chat_template_kwargs={"messages": []})


def test_over_http_whole_streamed_and_opened_by_the_prompt(llm):
    with ServerThread(llm) as server:
        client = openai_client(server)

        def ask(**fields):
            return client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=48, temperature=0, **fields
            )

        r = ask(extra_body={"response_format": regex(THINKS)})
        message = r.choices[0].message
        assert re.fullmatch(r"[a-z ]{1,30}", message.reasoning_content)
        assert re.fullmatch(ANSWERS, message.content)
        whole = (message.reasoning_content, message.content)
        chunks = [
            chunk.choices[0].delta
            for chunk in ask(stream=True, extra_body={"response_format": regex(THINKS)})
            if chunk.choices
        ]
        streamed = (
            "".join(getattr(d, "reasoning_content", None) or "" for d in chunks),
            "".join(d.content or "" for d in chunks),
        )
        assert streamed == whole
        first = next(i for i, d in enumerate(chunks) if d.content)
        assert all(not getattr(d, "reasoning_content", None) for d in chunks[first:])
        opened = (
            ask(
                extra_body={
                    "response_format": regex(r"([a-z ]{1,30})\n</think>\n\n" + ANSWERS),
                    "chat_template_kwargs": {"open_think": True},
                }
            )
            .choices[0]
            .message
        )
        assert re.fullmatch(r"[a-z ]{1,30}", opened.reasoning_content)
        assert re.fullmatch(ANSWERS, opened.content)
        kept = ask(extra_body={"response_format": regex(THINKS), "reasoning_format": "none"})
        assert re.fullmatch(THINKS, kept.choices[0].message.content)
        assert getattr(kept.choices[0].message, "reasoning_content", None) is None
        assert server.engine.wait_idle(HANG_GUARD)
