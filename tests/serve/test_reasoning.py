"""Reasoning models' `<think>` blocks returned as `reasoning_content`, apart
from the answer: split whole and streamed (the split itself, the server's
choices, `LLM.chat` and HTTP), where the answer opens the block and where
the prompt does, left in under reasoning_format "none"; and grammars that
bind only after the block.

SmolLM2 does not reason, and a grammar now lets a model think before it
binds, so no format can make SmolLM2 write a block: a template that speaks
of `<think>` as Qwen 3's does (tests/data/reasoning_chat_template.jinja)
opens one in the prompt, which SmolLM2 never closes, and the split of a
block the answer opens runs through the server's choices on given text.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from chat_server import assembled, openai_client
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.graphs.scheduler import Delta
from pagedkv.graphs.structured import Grammars, after_reasoning, response_format_grammar
from pagedkv.models import ModelError, load
from pagedkv.models.chat import ChatPrompt
from pagedkv.models.reasoning import (
    ReasoningStream,
    prompt_opens_reasoning,
    split_reasoning,
    template_reasons,
)
from pagedkv.models.tool_calls import ToolUse, read_tools, tool_use
from pagedkv.serve import ServerThread
from pagedkv.serve.choices import Choices

WARM_GRAPHS = ("smollm2-gguf",)
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""

MODEL = "smollm2-135m-instruct"
TEMPLATE = Path(__file__).parent.parent / "data" / "reasoning_chat_template.jinja"
ASK = [{"role": "user", "content": "What is two plus two?"}]
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


def test_default_template_variables_and_a_request_over_them():
    """load(chat_template_kwargs=) (`--default-chat-template-kwargs`): every
    chat gets them unless it gives its own."""
    quiet = load(MODEL, chat_template=TEMPLATE.read_text(),
                 chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    closed = "<think>\n\n</think>\n\n"
    generated_prompt = quiet.tokenizer.decode(quiet.prompt_ids("Hi"), skip_special_tokens=False)
    assert generated_prompt.endswith(closed)  # LLM.generate's prompts too
    (answer,) = quiet.chat([ASK], 2)
    assert answer.prompt.endswith(closed)
    (thinking,) = quiet.chat([ASK], 2, chat_template_kwargs={"enable_thinking": True})
    assert not thinking.prompt.endswith(closed)
    with pytest.raises(ModelError, match="may not name"):
        load(MODEL, chat_template_kwargs={"messages": []})


def test_a_grammar_binds_after_the_block(llm):
    """Where the model reasons, a format (or a tool call) binds after its
    `<think>` block: one the answer may open, or one the prompt opened and
    the answer must close."""
    grammars = Grammars(llm.tokenizer.tokenizer, llm.config.vocab_size, llm.tokenizer.stop_ids)

    def allows(grammar: str, text: str) -> tuple[bool, bool]:
        state = grammars.start(grammar)
        for token in llm.tokenizer.encode(text):
            if not state.allowed()[token]:
                return False, False
            state.advance(token)
        return True, state.complete

    fmt = response_format_grammar({"type": "json_object"})
    may, opened = after_reasoning(fmt, opened=False), after_reasoning(fmt, opened=True)
    assert grammars.error(may) is None and grammars.error(opened) is None
    assert allows(may, '{"a": 1}') == (True, True)
    assert allows(may, '<think>\nIs it {"a"?\n</think>\n\n{"a": 1}') == (True, True)
    assert allows(may, "Hello")[0] is False
    assert allows(may, "<think>\nok\n</think>\n\nHello")[0] is False
    assert allows(opened, 'so {"a": 1}\n</think>\n{"a": 1}') == (True, True)
    assert allows(opened, '{"a": 1}') == (True, False)  # still thinking
    assert allows(opened, "so\n</think>\nHello")[0] is False


def test_choices_split_a_streamed_and_a_whole_answer():
    """The server's choices (no model): a block the answer opens goes to
    reasoning_content deltas, then the content's; the whole answer alike."""
    prompt = ChatPrompt("", [1], tool_use(None), reasoning="may")
    pieces = ["<thi", "nk>\nIt is", " 4.\n</th", "ink>\n\nFour", "."]
    choices = Choices(prompt, 1, [("", [1])], False, False, True, str)
    deltas = []
    for k, piece in enumerate(pieces):
        finish = "stop" if k == len(pieces) - 1 else None
        for chunk in choices.on_delta(0, Delta(0, piece, (k,), finish)):
            deltas.append(chunk["delta"])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "It is 4."
    assert "".join(d.get("content", "") for d in deltas) == "Four."
    reasoning_at = [i for i, d in enumerate(deltas) if d.get("reasoning_content")]
    content_at = [i for i, d in enumerate(deltas) if d.get("content")]
    assert max(reasoning_at) < min(content_at)
    (answer,) = choices.answers()
    assert answer["message"]["reasoning_content"] == "It is 4."
    assert answer["message"]["content"] == "Four." and answer["finish_reason"] == "stop"
    unsplit = Choices(replace(prompt, split=False), 1, [("", [1])], False, False, True, str)
    for k, piece in enumerate(pieces):
        unsplit.on_delta(0, Delta(0, piece, (k,), "stop" if k == len(pieces) - 1 else None))
    assert unsplit.answers()[0]["message"] == {"role": "assistant", "content": "".join(pieces)}


def test_llm_chat_and_http_where_the_prompt_opens_the_block(llm):
    """The prompt opens the block (as DeepSeek-R1's do); SmolLM2 never closes
    it, so its whole answer is reasoning, whole and streamed alike."""
    opened = {"open_think": True}
    (answer,) = llm.chat([ASK], 12, chat_template_kwargs=opened)
    assert answer.prompt.endswith("<think>\n") and answer.finish_reason == "length"
    whole_text = llm.tokenizer.decode(answer.token_ids)
    assert answer.reasoning_content == whole_text.strip() != "" and answer.text == ""
    assert answer.as_json()["reasoning_content"] == answer.reasoning_content
    (kept,) = llm.chat([ASK], 12, chat_template_kwargs=opened, reasoning_format="none")
    assert kept.reasoning_content is None and kept.text
    (plain,) = llm.chat([ASK], 12, chat_template_kwargs={"enable_thinking": False})
    assert plain.prompt.endswith("<think>\n\n</think>\n\n")
    assert plain.reasoning_content is None and plain.text
    with pytest.raises(ValueError, match="reasoning_format"):
        llm.chat([ASK], reasoning_format="deepseek")
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat([ASK], chat_template_kwargs={"messages": []})
    with ServerThread(llm) as server:
        client = openai_client(server)
        fields = {"model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 0}
        body = {"chat_template_kwargs": opened}
        message = client.chat.completions.create(**fields, extra_body=body).choices[0].message
        assert message.reasoning_content and not message.content
        chunks = client.chat.completions.create(**fields, stream=True, extra_body=body)
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        assert streamed == message.reasoning_content
        assert not "".join(d.content or "" for d in deltas)
        kept = (
            client.chat.completions.create(
                **fields, extra_body={**body, "reasoning_format": "none"}
            )
            .choices[0]
            .message
        )
        assert kept.content and getattr(kept, "reasoning_content", None) is None
        assert server.engine.wait_idle(HANG_GUARD)


def test_the_default_reasoning_format_and_a_request_over_it():
    """load(reasoning_format="none") (`pagedkv serve --reasoning-format
    none`): the block stays in the content of every chat that does not say
    otherwise, in process and over HTTP."""
    kept = load(MODEL, chat_template=TEMPLATE.read_text(), reasoning_format="none")
    opened = {"open_think": True}
    (answer,) = kept.chat([ASK], 8, chat_template_kwargs=opened)
    assert answer.reasoning_content is None and answer.text
    (split,) = kept.chat([ASK], 8, chat_template_kwargs=opened, reasoning_format="auto")
    assert split.reasoning_content and not split.text
    with ServerThread(kept) as server:
        client = openai_client(server)
        fields = {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0}
        for asked, in_content in ((None, True), ("auto", False)):
            body = {"chat_template_kwargs": opened, "reasoning_format": asked}
            message = client.chat.completions.create(**fields, extra_body=body).choices[0].message
            assert bool(message.content) == in_content, asked
            assert (getattr(message, "reasoning_content", None) is None) == in_content, asked
        assert server.engine.wait_idle(HANG_GUARD)
    with pytest.raises(ModelError, match="reasoning_format"):
        load(MODEL, reasoning_format="deepseek")


PIECES = ["<think>", "</think>", "<thi", "nk>", "</", "a", "b c", " ", "\n", "<", ">"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=14),
    st.booleans(),
    st.lists(st.integers(1, 6), min_size=1, max_size=8),
)
def test_a_stream_splits_as_the_whole_answer_does(pieces, opened, sizes):
    """Any text, cut anywhere: what the stream sends adds up to the whole
    answer's split, and no reasoning is sent after content."""
    text = "".join(pieces)
    stream, sent, at, k = ReasoningStream(opened), [], 0, 0
    while at < len(text):
        size = sizes[k % len(sizes)]
        sent.append(stream.push(text[at : at + size]))
        at, k = at + size, k + 1
    sent.append(stream.finish())
    reasoning = "".join(r for r, _ in sent) if stream.reasoned else None
    assert (reasoning, "".join(c for _, c in sent)) == split_reasoning(text, opened)
    first_content = next((i for i, (_, c) in enumerate(sent) if c), len(sent))
    assert not any(r for r, _ in sent[first_content + 1 :])


CHAT_PIECES = [*PIECES[:4], "Let me look.", "<tool_call>",
               '\n{"name": "now", "arguments": {}}\n', "</tool_call>", "{"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(CHAT_PIECES), max_size=12),
    st.lists(st.integers(1, 9), min_size=1, max_size=8),
)
def test_a_chat_stream_reads_as_the_whole_answer(pieces, sizes):
    """A reasoning model's answer with hermes tool calls, cut anywhere: the
    stream's reasoning is the whole answer's, its calls are the whole
    answer's (built by their deltas, under the ids they streamed), and
    where no call began its content is the whole answer's."""
    now = read_tools([{"type": "function", "function": {"name": "now"}}])
    prompt = ChatPrompt("", [], ToolUse(now, "auto", True, "hermes"), reasoning="may")
    text = "".join(pieces)
    stream, deltas, at, k = prompt.stream(), [], 0, 0
    while at < len(text):
        size = sizes[k % len(sizes)]
        deltas.append(stream.push(text[at : at + size]))
        at, k = at + size, k + 1
    deltas.append(stream.finish())
    whole = prompt.read(text)
    assert "".join(d.reasoning for d in deltas) == (whole.reasoning or "")
    calls = [(c.name, c.arguments) for c in stream.tool_calls]
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]
    built = assembled(call for d in deltas for call in d.tool_calls)
    assert [(c["name"], c["arguments"]) for c in built[: len(calls)]] == calls
    if not built:
        assert "".join(d.content for d in deltas) == (whole.content or "")
