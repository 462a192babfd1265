"""A `response_format` beside `tools` (OpenAI's agents send both): the
grammar that lets an answer either call a tool or give its content in the
format, in each tool format, and the server's answers under it, whole and
streamed."""

from __future__ import annotations

import json

import pytest
from chat_server import MODEL, assembled, chat_server, openai_client
from tool_helpers import (
    ANSWER,
    ASK,
    HERMES_TEMPLATE,
    LLAMA3_TEMPLATE,
    MAX_TOKENS,
    TOOLS,
    allows,
    follows_tools,
)

from pagedkv.models.errors import ChatRequestError
from pagedkv.models.tool_calls import ToolUse, read_tools

WARM_GRAPHS = ("smollm2-gguf",)
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""


def test_a_content_format_beside_tools(grammars):
    """Under "auto", a response_format binds an answer that calls no tool:
    calls or the content in its format (hermes: any format; the JSON call
    formats: JSON formats, the generic one inside its reply), never free
    text; a required call ignores it."""
    tools = read_tools(TOOLS)
    args = '{"city": "Rome", "unit": "celsius"}'
    hermes = ToolUse(tools, "auto", True, "hermes")
    tagged = '<tool_call>\n{"name": "get_weather", "arguments": ' + args + "}\n</tool_call>"
    for fmt, good, bad in ((ANSWER, '{"answer": 42}', '{"answer": "x"}'),
                           ({"type": "regex", "regex": "[0-9]+"}, "42", "x")):  # fmt: skip
        grammar = hermes.grammar(fmt)
        assert allows(grammars, grammar, tagged) and allows(grammars, grammar, good)
        assert not allows(grammars, grammar, bad) and not allows(grammars, grammar, "Sure. ")
    llama3 = ToolUse(tools, "auto", False, "llama3").grammar(ANSWER)
    assert allows(grammars, llama3, '{"name": "get_weather", "parameters": ' + args + "}")
    assert allows(grammars, llama3, '{"answer": 42}')
    assert not allows(grammars, llama3, '{"answer": "x"}') and not allows(grammars, llama3, "It")
    generic = ToolUse(tools, "auto", True, "generic").grammar({"type": "json_object"})
    assert allows(grammars, generic, '{"response": {"anything": [1]}}')
    assert allows(grammars, generic, '{"tool_calls": [{"name": "now", "arguments": {}}]}')
    assert not allows(grammars, generic, '{"response": "text"}')
    required = ToolUse(tools, "required", True, "generic").grammar({"type": "regex", "regex": "x"})
    assert not allows(grammars, required, '{"response": ')
    for fmt in ("generic", "llama3"):
        with pytest.raises(ChatRequestError) as e:
            ToolUse(tools, "auto", True, fmt).grammar({"type": "regex", "regex": "[0-9]+"})
        assert e.value.param == "response_format"


@pytest.mark.parametrize("template", [None, HERMES_TEMPLATE, LLAMA3_TEMPLATE])
def test_served_answers_call_or_follow_the_format(template):
    """Over HTTP, in each tool format: an answer under tools and a
    json_schema format either calls one tool (well formed) or gives content
    of the schema, greedy or sampled (SmolLM2 mostly calls; sampled, it
    also answers under the hermes template); a greedy stream puts together
    the whole answer."""
    with chat_server(template.name if template else None) as server:
        c = openai_client(server)
        # One call at most: the grammar then ends the answer after it.
        fields = dict(model=MODEL, tools=TOOLS, response_format=ANSWER, max_tokens=MAX_TOKENS,
                      temperature=0, parallel_tool_calls=False)  # fmt: skip
        arithmetic = [{"role": "user", "content": "What is 6 times 7?"}]
        sampled = c.chat.completions.create(messages=arithmetic, **fields | dict(
            temperature=1.5, seed=5, n=8)).choices  # fmt: skip
        for choice in sampled:
            assert_call_or_content(choice)
        for messages in (ASK, arithmetic):
            (whole,) = c.chat.completions.create(messages=messages, **fields).choices
            assert_call_or_content(whole)
            stream = c.chat.completions.create(messages=messages, stream=True, **fields)
            chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
            calls = assembled(d for chunk in chunks for d in chunk.delta.tool_calls or ())
            content = "".join(chunk.delta.content or "" for chunk in chunks)
            assert content == (whole.message.content or "")
            want = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or ()]
            assert [(call["name"], call["arguments"]) for call in calls] == want


def assert_call_or_content(choice) -> None:
    """A choice is one well-formed call, or content holding ANSWER's object."""
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert follows_tools(choice.message.tool_calls[0])
    else:
        assert choice.finish_reason == "stop"
        assert set(json.loads(choice.message.content)) == {"answer"}, choice
