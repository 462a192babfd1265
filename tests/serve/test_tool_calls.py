"""Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`):
the prompt that offers the tools, the grammar a call follows, the calls
read back, and the server's answers, whole and streamed, in both formats
(generic: SmolLM2's own template; hermes: a Qwen 2.5-style template that
writes <tool_call> tags, tests/data/hermes_chat_template.jinja).

A call's arguments are checked here by hand against the tool's schema,
not by the grammar engine that enforced them (tool_helpers.py); a content
format beside the tools is test_tool_format.py's.
"""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest
from chat_server import MODEL, assembled, chat_server, openai_client
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tool_helpers import (
    ANSWER,
    ASK,
    CLOCK,
    HANG_GUARD,
    HERMES_TEMPLATE,
    LLAMA3_TEMPLATE,
    MAX_TOKENS,
    TOOLS,
    UNFOLLOWABLE,
    WEATHER,
    allows,
    call_follows,
    follows_tools,
    streamed,
)

from pagedkv.models import load
from pagedkv.models.chat import chat_messages
from pagedkv.models.errors import ChatRequestError
from pagedkv.models.tokenizer import load_tokenizer
from pagedkv.models.tool_call_stream import ToolCallStream
from pagedkv.models.tool_calls import (
    ToolUse,
    read_tool_choice,
    read_tools,
    template_format,
)

WARM_GRAPHS = ("smollm2-gguf",)
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""

# What is offered, and how a request names it.


@pytest.mark.parametrize(
    "tools",
    [
        [],
        "get_weather",
        [{"type": "function"}],
        [{"type": "retrieval", "function": {"name": "a"}}],
        [{"type": "function", "function": {"name": "has space"}}],
        [{"type": "function", "function": {"name": "x" * 65}}],
        [CLOCK, CLOCK],
        [{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}],
        [{"type": "function", "function": {"name": "a", "description": 3}}],
    ],
)
def test_malformed_tools_raise(tools):
    with pytest.raises(ValueError, match="tools"):
        read_tools(tools)


def test_tool_choice():
    tools = read_tools(TOOLS)
    assert tools[1].parameters == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    assert read_tool_choice(None, tools) == "auto"
    assert read_tool_choice("required", tools) == "required"
    assert read_tool_choice({"type": "function", "function": {"name": "now"}}, tools) is tools[1]
    for bad in ("sometimes", {"type": "function", "function": {"name": "later"}}, {}):
        with pytest.raises(ValueError, match="tool_choice"):
            read_tool_choice(bad, tools)
    assert template_format(HERMES_TEMPLATE.read_text()) == "hermes"
    assert template_format(LLAMA3_TEMPLATE.read_text()) == "llama3"
    assert template_format(load_tokenizer(MODEL).chat_template) == "generic"


# The prompt.


def test_chat_messages_as_templates_take_them():
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    given = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": parts, "name": "ann"},
        {"role": "assistant", "content": None, "reasoning_content": "Hm.", "tool_calls": [{}]},
        {"role": "tool", "tool_call_id": "c", "content": "1"},
    ]
    out = chat_messages(given)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    assert out[1] == {"role": "user", "content": "Hi there"}
    assert out[2]["content"] == "" and out[2]["reasoning_content"] == "Hm."
    for bad in (
        [],
        [{"role": "robot", "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
        [{"role": "user", "content": "x", "tool_calls": [{}]}],
        [{"role": "tool", "content": "x"}],
    ):
        with pytest.raises(ChatRequestError) as e:
            chat_messages(bad)
        assert e.value.param == "messages"


def test_the_generic_prompt_describes_the_tools_and_renders_the_history():
    use = ToolUse(read_tools(TOOLS), "auto", True, "generic")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    history = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    messages = use.prompt_messages(history)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\nRespond in JSON format")
    assert '"name": "get_weather"' in system and '"name": "now"' in system
    assert json.loads(messages[2]["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    }
    assert json.loads(messages[3]["content"]) == {
        "tool_response": {"tool": "get_weather", "content": "-3 C"}
    }
    tools = read_tools(TOOLS)
    named = ToolUse(tools, tools[1], False, "generic")
    system = named.prompt_messages(ASK)[0]["content"]
    assert '"name": "now"' in system and "get_weather" not in system
    assert ToolUse(read_tools(TOOLS), "none").prompt_messages(ASK) == ASK
    with pytest.raises(ValueError, match="not JSON"):
        bad = {**call, "function": {"name": "now", "arguments": "{oops"}}
        use.prompt_messages([{"role": "assistant", "content": "", "tool_calls": [bad]}])


def test_the_hermes_template_renders_tools_calls_and_results():
    tokenizer = replace(load_tokenizer(MODEL), chat_template=HERMES_TEMPLATE.read_text())
    use = ToolUse(read_tools(TOOLS), "auto", True, "hermes")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "now", "arguments": "{}"}}  # fmt: skip
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]  # fmt: skip
    text = tokenizer.render_chat(use.prompt_messages(history), tools=use.template_tools())
    assert "<tools>\n" + json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    none = ToolUse(read_tools(TOOLS), "none", True, "hermes")
    assert "<tools>" not in tokenizer.render_chat(ASK, tools=none.template_tools())


# Reading calls back.


def test_reading_generic_answers():
    use = ToolUse(read_tools(TOOLS), "auto", True, "generic")
    rome = {"name": "get_weather", "arguments": {"city": "Rome"}}
    both = [{"name": "now", "arguments": {}}, rome]
    content, calls = use.read(json.dumps({"tool_calls": both}))
    assert content is None and [c.name for c in calls] == ["now", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Rome"} and calls[0].id != calls[1].id
    assert use.read('{"response": "Hello!"}') == ("Hello!", [])
    assert use.read('{"tool_call": {"name": "now", "arguments": {}}}')[1][0].name == "now"
    cut = '{"tool_calls": [{"name": "get_weather", "arguments": {"ci'
    assert use.read(cut) == (cut, [])
    assert use.read('{"response": "Caf\\u00e9 \\"Rou') == ('Café "Rou', [])
    reply = json.dumps({"response": 'A "quoted" caf\u00e9, \\ and\nmore.'}, ensure_ascii=True)
    for size in (1, 2, 5):
        assert streamed(use, reply, [size])[:2] == ('A "quoted" caf\u00e9, \\ and\nmore.', [])
    call = json.dumps({"tool_calls": both})
    for sizes in ([3], [1], [100]):
        sent, deltas, calls = streamed(use, call, sizes)
        assert sent == "" and [(c["name"], c["arguments"]) for c in assembled(deltas)] == [
            ("now", "{}"), ("get_weather", '{"city": "Rome"}')]  # fmt: skip
        assert [c["id"] for c in assembled(deltas)] == [c.id for c in calls]
    # A content format's JSON value, as the grammar laid it out, whole or streamed.
    held = '{"response": {"answer": 42, "why": "Caf\\u00e9"}}'
    assert use.read(held) == ('{"answer": 42, "why": "Caf\\u00e9"}', [])
    assert streamed(use, held, [3])[:2] == ('{"answer": 42, "why": "Caf\\u00e9"}', [])
    assert use.read('{"response": [1,2]}') == ("[1,2]", [])  # as written
    assert use.read('{"response":[1,2]}') == ("[1, 2]", [])  # another layout: re-serialized
    # Arguments come back as the model wrote them (here, an escape kept).
    written = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Caf\\u00e9"}}}'
    assert use.read(written)[1][0].arguments == '{"city": "Caf\\u00e9"}'
    assert assembled(streamed(use, written, [2])[1])[0]["arguments"] == '{"city": "Caf\\u00e9"}'


def test_reading_hermes_answers_and_streaming_them():
    use = ToolUse(read_tools(TOOLS), "auto", True, "hermes")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    text = f"Let me look.\n{call}\n{call.replace('Rome', 'Oslo')}"
    content, calls = use.read(text)
    assert content == "Let me look." and len(calls) == 2
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Rome", "Oslo"]
    single = ToolUse(read_tools(TOOLS), "auto", False, "hermes")
    assert len(single.read(text)[1]) == 1
    broken = "Try <tool_call>\n{not json}\n</tool_call>"
    assert use.read(broken) == (broken, [])
    assert use.read("plain words") == ("plain words", [])
    for size in (1, 3, 7):
        sent, deltas, calls = streamed(use, text, [size])
        assert sent == "Let me look.\n", size
        assert [(c["name"], c["arguments"]) for c in assembled(deltas)] == [
            ("get_weather", '{"city": "Rome"}'), ("get_weather", '{"city": "Oslo"}')]  # fmt: skip
        assert len(calls) == 2
    # Arguments stream as they come: the call's head first, then pieces.
    stream = ToolCallStream(use)
    assert stream.push('<tool_call>\n{"name": "get_weather", "arguments": ') == ("", [])
    assert stream.push('{"ci')[1] == [
        {"index": 0, "id": stream.scanner.open.call_id, "type": "function",
         "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"ci'}},
    ]  # fmt: skip
    assert stream.push('ty": "a}b"}}\n</tool')[1] == [
        {"index": 0, "function": {"arguments": 'ty": "a}b"}'}}
    ]
    assert stream.push("_call>")[1] == [] and stream.finish() == ("", [])
    assert [(c.name, c.arguments) for c in stream.calls] == [("get_weather", '{"city": "a}b"}')]
    sent, deltas, _ = streamed(use, "a <tool_cake> b", [5, 2])
    assert (sent, deltas) == ("a <tool_cake> b", [])


def test_reading_llama3_answers_and_streaming_them():
    use = ToolUse(read_tools(TOOLS), "auto", False, "llama3")
    call = '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}'
    for text in (call, " " + call, "<|python_tag|>" + call):
        content, calls = use.read(text)
        assert content is None and [(c.name, c.arguments) for c in calls] == [
            ("get_weather", '{"city": "Rome", "unit": "celsius"}')
        ]
    assert use.read("It is sunny.") == ("It is sunny.", [])
    assert use.read(call[:30]) == (call[:30], [])
    for text, content in ((call, ""), ("It is {sunny}.", "It is {sunny}.")):
        sent, deltas, _ = streamed(use, text, [4])
        assert sent == content
        want = [("get_weather", '{"city": "Rome", "unit": "celsius"}')] if not content else []
        assert [(c["name"], c["arguments"]) for c in assembled(deltas)] == want


# The grammar.


def test_the_generic_grammar(grammars):
    call = '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}'
    tools = read_tools(TOOLS)
    auto = ToolUse(tools, "auto", True, "generic").grammar()
    assert allows(grammars, auto, '{"response": "Hi."}')
    assert allows(grammars, auto, '{"tool_calls": [' + call + "]}")
    assert not allows(grammars, auto, '{"tool_calls": [' + call.replace("unit", "units") + "]}")
    assert not allows(grammars, auto, '{"tool_calls": [{"name": "get_time"')
    assert not allows(grammars, auto, '{"tool_call": ' + call + "}")
    required = ToolUse(tools, "required", False, "generic").grammar()
    assert allows(grammars, required, '{"tool_call": ' + call + "}")
    assert not allows(grammars, required, '{"response": "Hi."}')
    named = ToolUse(tools, tools[1], True, "generic").grammar()
    assert not allows(grammars, named, '{"tool_calls": [' + call)


def test_the_hermes_grammar(grammars):
    call = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
        '"unit": "celsius"}}\n</tool_call>'
    )
    tools = read_tools(TOOLS)
    auto = ToolUse(tools, "auto", True, "hermes").grammar()
    assert allows(grammars, auto, "Some free text, then " + call)
    assert not allows(grammars, auto, "Text " + call.replace("celsius", "kelvin"))
    assert not allows(grammars, auto, '<tool_call>\n{"name": "sleep"')
    required = ToolUse(tools, "required", True, "hermes").grammar()
    assert allows(grammars, required, call + "\n" + call)
    assert not allows(grammars, required, "Some free text")
    single = ToolUse(tools, "required", False, "hermes").grammar()
    assert not allows(grammars, single, call + "\n" + call)


def test_the_llama3_grammar(grammars):
    call = '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}'
    tools = read_tools(TOOLS)
    auto = ToolUse(tools, "auto", False, "llama3").grammar()
    assert allows(grammars, auto, call) and allows(grammars, auto, "It is sunny, {ok}.")
    assert not allows(grammars, auto, call.replace("parameters", "arguments"))
    assert not allows(grammars, auto, call + " " + call)
    required = ToolUse(tools, "required", False, "llama3").grammar()
    assert allows(grammars, required, call) and not allows(grammars, required, "It is")


# In process.


def test_llm_chat_calls_tools_and_answers():
    llm = load(MODEL)
    conversations = [ASK, [{"role": "user", "content": "What time is it?"}]]
    answers = llm.chat(
        conversations, max_new_tokens=MAX_TOKENS, tools=TOOLS, tool_choice="required"
    )
    for answer in answers:
        assert answer.finish_reason == "tool_calls" and answer.text == ""
        assert all(call_follows(call.name, call.arguments) for call in answer.tool_calls)
        assert answer.as_json()["tool_calls"][0]["function"]["name"] == answer.tool_calls[0].name
    named = {"type": "function", "function": {"name": "now"}}
    (answer,) = llm.chat([ASK], tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    assert [(c.name, c.arguments) for c in answer.tool_calls] == [("now", "{}")]
    (free,) = llm.chat([ASK], max_new_tokens=8, tools=TOOLS, tool_choice="none")
    assert not free.tool_calls and free.text and "Respond in JSON" not in free.prompt
    assert free.prompt == llm.tokenizer.render_chat(ASK)
    (either,) = llm.chat([ASK], max_new_tokens=MAX_TOKENS, tools=TOOLS, response_format=ANSWER)
    assert either.tool_calls or set(json.loads(either.text)) == {"answer"}
    for kw, param in (
        ({"tools": [CLOCK], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [CLOCK], "response_format": {"type": "regex", "regex": "a"}}, "response_format"),
        ({"tools": [CLOCK], "response_format": {"type": "xml"}}, "response_format"),
        ({"tools": [UNFOLLOWABLE]}, "tools"),
    ):
        with pytest.raises(ChatRequestError) as e:
            llm.chat([ASK], **kw)
        assert e.value.param == param
    with pytest.raises(ValueError, match="role"):
        llm.chat([[{"role": "robot", "content": "hi"}]])
    with pytest.raises(TypeError):
        llm.chat(ASK)
    with pytest.raises(TypeError, match="on_delta"):
        llm.chat([ASK], on_delta="print")
    llm.manager.validate()
    assert llm.manager.num_used_pages == 0


def test_llm_chat_streams_calls_and_content():
    """on_delta: a call streams as the server streams it, under the ids
    the completion keeps; content streams as the answer's text; each
    conversation finishes once."""
    llm = load(MODEL)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tools, choice in ((TOOLS, named), (None, None)):
        deltas: dict[int, list] = {0: [], 1: []}
        finished: list[int] = []

        def on_delta(i, delta, done, deltas=deltas, finished=finished):
            deltas[i].append(delta)
            finished.extend([i] if done else [])

        conversations = [ASK, [{"role": "user", "content": "What time is it?"}]]
        answers = llm.chat(conversations, max_new_tokens=MAX_TOKENS, tools=tools,
                           tool_choice=choice, on_delta=on_delta)  # fmt: skip
        assert sorted(finished) == [0, 1]
        for i, answer in enumerate(answers):
            calls = assembled(call for d in deltas[i] for call in d.tool_calls)
            want = [(c.id, c.name, c.arguments) for c in answer.tool_calls]
            assert [(c["id"], c["name"], c["arguments"]) for c in calls] == want
            assert "".join(d.content for d in deltas[i]) == answer.text
            if tools:
                assert answer.tool_calls and len(deltas[i]) > 2
    assert llm.manager.num_used_pages == 0


# Over HTTP.


@pytest.fixture(scope="module")
def server():
    with chat_server() as s:
        yield s


@pytest.fixture(scope="module")
def hermes_server():
    with chat_server(HERMES_TEMPLATE.name) as s:
        yield s


@pytest.fixture(scope="module")
def llama3_server():
    with chat_server(LLAMA3_TEMPLATE.name) as s:
        yield s


def required_call(server, **fields):
    """A greedy answer to ASK that must call one of TOOLS."""
    fields = {"tool_choice": "required", "max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    return openai_client(server).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, **fields
    )


@pytest.mark.parametrize("which", ["server", "hermes_server", "llama3_server"])
def test_required_and_named_calls_whole_and_streamed(request, which):
    server = request.getfixturevalue(which)
    c = openai_client(server)
    for choice, names in (
        ("required", {"get_weather", "now"}),
        ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ):
        (answer,) = required_call(server, tool_choice=choice, parallel_tool_calls=False).choices
        assert len(answer.message.tool_calls) == 1
        assert answer.finish_reason == "tool_calls", answer
        assert answer.message.tool_calls and answer.message.content is None
        assert all(follows_tools(call) for call in answer.message.tool_calls)
        assert {call.function.name for call in answer.message.tool_calls} <= names
    stream = c.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        stream=True,
        temperature=0.8,
        seed=1,
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    deltas = [call for chunk in chunks for call in chunk.delta.tool_calls or ()]
    (call,) = assembled(deltas)
    assert call["name"] == "get_weather"
    assert len(deltas) > 2, "the arguments came whole, not as the model wrote them"
    assert call["id"] and call_follows(call["name"], call["arguments"])
    assert chunks[-1].finish_reason == "tool_calls"
    assert not "".join(chunk.delta.content or "" for chunk in chunks)
    free = c.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=16
    )
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content
    assert server.engine.wait_idle(HANG_GUARD)


@pytest.mark.parametrize("which", ["server", "hermes_server", "llama3_server"])
def test_a_conversation_with_calls_and_results(request, which):
    """The client runs the call and sends its result back; the history
    renders in each format, and the next answer (auto: a call or a reply)
    parses."""
    server = request.getfixturevalue(which)
    c = openai_client(server)
    call = required_call(server).choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]
    r = c.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0
    )
    answer = r.choices[0]
    if answer.finish_reason == "tool_calls":
        assert all(follows_tools(call) for call in answer.message.tool_calls)
    else:
        assert answer.message.content and not answer.message.content.startswith('{"')
    # Without tools, the history still renders (the calls as the model wrote them).
    r = c.chat.completions.create(model=MODEL, messages=history, max_tokens=8)
    assert r.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "response_format": {"type": "regex", "regex": "a"}}, "response_format"),
        ({"tools": TOOLS, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"tools": TOOLS, "response_format": {"type": "xml"}}, "response_format"),
        ({"tools": [UNFOLLOWABLE]}, "tools"),
        ({"functions": [{"name": "a"}]}, "functions"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "messages"),
    ],
)
def test_bad_tool_requests(server, fields, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


HERMES_PIECES = ["Let me", " look.", "\n", "<tool", "_call>", "<tool_call>", "</tool_call>",
                 '\n{"name": "now", "arguments": {}}\n', "<", "{", "}"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@example(["<tool_call>", HERMES_PIECES[7], "</tool_call>", "<tool_call>", HERMES_PIECES[7]],
         "hermes", [3])  # fmt: skip
@given(
    st.lists(st.sampled_from(HERMES_PIECES), max_size=12),
    st.sampled_from(["hermes", "llama3", "generic"]),
    st.lists(st.integers(1, 7), min_size=1, max_size=6),
)
def test_a_streamed_answer_reads_as_the_whole_one(pieces, fmt, sizes):
    """Any text, cut anywhere: the stream ends with the whole answer's
    calls, which its deltas built (a call they began and the answer does
    not hold, cut short, may follow them); it sends no call's tag that the
    whole answer's content does not hold; and where no call began it sends
    the whole answer's content."""
    use = ToolUse(read_tools(TOOLS), "auto", True, fmt)
    text = "".join(pieces)
    if fmt == "generic":
        text = json.dumps({"response": text})
    sent, deltas, calls = streamed(use, text, sizes)
    content, whole_calls = use.read(text)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    built = [(c["id"], c["name"], c["arguments"]) for c in assembled(deltas)]
    assert built[: len(calls)] == [(c.id, c.name, c.arguments) for c in calls]
    if not built:
        assert sent == content
    elif fmt == "hermes":  # a tag sent is one the whole answer's content holds
        assert "<tool_call>" not in sent or "<tool_call>" in (content or "")
