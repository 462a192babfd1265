"""POST /v1/responses (OpenAI's Responses API) through OpenAI's own client:
the same answers as the chat endpoint, whole and streamed (the events in
order, their deltas adding up to the items), function calls and their
outputs, `text.format`, a reasoning model's block as a reasoning item,
stored responses continued by `previous_response_id` and their input items
listed a page at a time, and refusals naming the Responses field."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from chat_server import MODEL, chat_server, openai_client

from conftest import Gate
from pagedkv.serve.response_store import ResponseStore
from pagedkv.serve.responses import cursor_page, stream_events

WARM_GRAPHS = ("smollm2-gguf",)
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 32}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
HANG_GUARD = 600.0


@pytest.fixture(scope="module")
def server():
    with chat_server("reasoning_chat_template.jinja") as s:
        yield s


def streamed(events) -> tuple[list, object]:
    """(the events, the final response), checking their order: numbered
    from 0, created first, one final event last, every item's deltas adding
    up to its text."""
    events = list(events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    texts: dict[str, str] = {}
    for e in events:
        if e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            texts[e.item_id] = texts.get(e.item_id, "") + e.delta
    for item in final.output:
        if item.type in ("message", "reasoning"):
            assert texts.pop(item.id) == item.content[0].text
    assert not texts
    return events, final


def test_text_answers_whole_and_streamed(server):
    """The request is the chat endpoint's (instructions as its system
    message: the same prompt tokens); the answer comes back as one message
    item, whole or as events. (Greedy answers are not compared across
    requests: a prompt read back from the int8 cache's pages and one just
    prefilled differ at near-ties.)"""
    c = openai_client(server)
    question = "What is the capital of France?"
    instructions = "Answer briefly."
    chat = c.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": instructions},
            {"role": "user", "content": question},
        ],
        max_tokens=2,
    )
    for stream in (False, True):
        answer = c.responses.create(
            model=MODEL,
            instructions=instructions,
            input=question,
            max_output_tokens=24,
            temperature=0,
            stream=stream,
        )
        events, r = streamed(answer) if stream else ([], answer)
        assert r.usage.input_tokens == chat.usage.prompt_tokens
        (item,) = r.output
        assert item.type == "message" and item.content[0].text == r.output_text != ""
        if r.status == "incomplete":
            assert r.incomplete_details.reason == "max_output_tokens"
            assert r.usage.output_tokens == 24
        else:
            assert r.status == "completed" and r.incomplete_details is None
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]


def test_function_calls_and_their_outputs(server):
    c = openai_client(server)
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    r = c.responses.create(
        model=MODEL, input=[ask], tools=[WEATHER], tool_choice="required", temperature=0
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    assert all(set(json.loads(call.arguments)) == {"city"} for call in calls)
    call = calls[0]
    history = [
        ask,
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"},
    ]  # fmt: skip
    after = c.responses.create(model=MODEL, input=history, tools=[WEATHER], max_output_tokens=48)
    assert after.output and after.status in ("completed", "incomplete")
    events, final = streamed(
        c.responses.create(
            model=MODEL,
            input=[ask],
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            temperature=0,
            stream=True,
        )
    )
    (item,) = final.output
    assert item.type == "function_call" and json.loads(item.arguments)["city"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [item.arguments]
    # Tools beside text.format (an agent with an output type): a call, or
    # a message whose text follows the format.
    shaped = {"type": "json_schema", "name": "weather", "schema": {
        "type": "object", "properties": {"degrees": {"type": "integer", "minimum": -100,
                                                     "maximum": 100}},
        "required": ["degrees"], "additionalProperties": False}}  # fmt: skip
    for given in ([ask], history):
        answer = c.responses.create(model=MODEL, input=given, tools=[WEATHER],
                                    text={"format": shaped}, temperature=0)  # fmt: skip
        items = [item for item in answer.output if item.type != "reasoning"]
        assert answer.status == "completed" and items, answer
        if items[0].type == "function_call":
            assert all(set(json.loads(item.arguments)) == {"city"} for item in items)
        else:
            assert set(json.loads(answer.output_text)) == {"degrees"}, answer


def test_previous_response_id_continues_a_stored_conversation(server):
    """A response continues a stored one: the earlier input and answer come
    first (the instructions do not carry over), whole or streamed; stored
    responses are fetched back; "store": false keeps none."""
    c = openai_client(server)
    first = c.responses.create(model=MODEL, instructions="Be brief.", input="My name is Ada.",
                               max_output_tokens=8, temperature=0)  # fmt: skip
    assert first.store and c.responses.retrieve(first.id).output_text == first.output_text
    conversation = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    chat = c.chat.completions.create(model=MODEL, messages=conversation, max_tokens=1)
    for stream in (False, True):
        answer = c.responses.create(model=MODEL, previous_response_id=first.id,
                                    input="What is my name?", max_output_tokens=4,
                                    temperature=0, stream=stream)  # fmt: skip
        _, second = streamed(answer) if stream else ([], answer)
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens == chat.usage.prompt_tokens, stream
        assert c.responses.retrieve(second.id).id == second.id
    third = c.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks.",
                               max_output_tokens=2, store=False)  # fmt: skip
    assert not third.store
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(third.id)
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):  # its conversation is gone with it
        c.responses.create(model=MODEL, previous_response_id=second.id, input="Hi.")
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(first.id)


def test_the_response_store_keeps_the_most_recently_used():
    store = ResponseStore(3)
    say = [{"type": "message", "content": [{"type": "output_text", "text": "Hi."}]}]
    call = {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}", "id": "f"}
    store.put({"id": "a", "output": say}, None, [{"role": "user", "content": "1"}])
    store.put({"id": "b", "output": [call]}, "a", [{"role": "user", "content": "2"}])
    store.put({"id": "x", "output": []}, None, [])
    assert store.conversation("b") == [
        {"role": "user", "content": "1"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "2"},
        {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"},
    ]
    store.put({"id": "c", "output": []}, "b", [])  # drops "x": "a" and "b" were just read
    assert store.get("x") is None and len(store) == 3
    store.put({"id": "d", "output": []}, None, [])  # drops "a": "c" can no longer be continued
    assert store.conversation("c") is None and store.get("c") is not None
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(0)


def test_input_items_list_what_a_response_was_generated_from():
    """A response's input items: each earlier response's input and output
    (its reasoning left out), then its own input, every item with an id and
    a message's string content as a text part of its role's kind."""
    store = ResponseStore(4)
    thought = {"type": "reasoning", "id": "rs_1", "content": []}
    said = {"type": "message", "id": "msg_out", "role": "assistant",
            "content": [{"type": "output_text", "text": "Hi."}]}  # fmt: skip
    store.put({"id": "a", "output": [thought, said]}, None, [{"role": "user", "content": "1"}])
    answer = {"type": "function_call_output", "call_id": "c0", "output": "42"}
    mine = {"role": "user", "content": [{"type": "input_text", "text": "2"}], "id": "mine"}
    call = {"type": "function_call", "id": "fc_9", "call_id": "c1", "name": "f", "arguments": "{}"}
    store.put({"id": "b", "output": [call]}, "a", [answer, mine])
    first, out, output, own = store.input_items("b")
    assert first["id"].startswith("msg_") and first["type"] == "message"
    assert first["content"] == [{"type": "input_text", "text": "1"}]
    assert out is said
    assert output["id"].startswith("fco_") and output["output"] == "42"
    assert own["id"] == "mine" and own["status"] == "completed"
    assert store.input_items("b")[0]["id"] == first["id"]  # ids are kept, not drawn anew
    assert [i["id"] for i in store.input_items("a")] == [first["id"]]
    assert store.input_items("z") is None


def test_input_item_pages_follow_their_cursors():
    items = [{"id": name} for name in "abcde"]

    def ids(limit, order="asc", after=None, before=None):
        page = cursor_page(items, limit, order, after, before)
        listed = "".join(i["id"] for i in page["data"])
        assert (page["first_id"], page["last_id"]) == (listed[:1] or None, listed[-1:] or None)
        return listed, page["has_more"]

    assert ids(2) == ("ab", True) and ids(2, "desc") == ("ed", True)
    assert ids(2, after="b") == ("cd", True) and ids(5, after="b") == ("cde", False)
    assert ids(2, "desc", after="c") == ("ba", False)
    assert ids(2, before="d") == ("bc", True) and ids(2, after="a", before="d") == ("bc", False)
    assert ids(3, after="e") == ("", False)
    with pytest.raises(ValueError, match="after"):
        cursor_page(items, 2, "asc", "z", None)


def test_input_items_of_a_stored_response(server):
    """GET /v1/responses/{id}/input_items through OpenAI's client: the
    conversation's items in either order, a page at a time; 404 for a
    response not stored, 400 naming a bad limit."""
    c = openai_client(server)
    first = c.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4,
                               temperature=0)  # fmt: skip
    second = c.responses.create(model=MODEL, previous_response_id=first.id, input="Hi.",
                                max_output_tokens=2, temperature=0)  # fmt: skip
    listed = c.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "message", "message"]
    assert listed.data[0].content[0].text == "My name is Ada."
    assert listed.data[1].id == first.output[-1].id
    assert listed.data[2].content[0].text == "Hi." and not listed.has_more
    newest = c.responses.input_items.list(second.id, limit=1)
    assert newest.data[0].id == listed.data[2].id and newest.has_more
    rest = c.responses.input_items.list(second.id, limit=2, after=newest.data[0].id)
    assert [i.id for i in rest.data] == [listed.data[1].id, listed.data[0].id]
    with pytest.raises(openai.NotFoundError):
        c.responses.input_items.list("resp_nothing")
    r = httpx.get(f"{server.url}/v1/responses/{second.id}/input_items?limit=0",
                  timeout=HANG_GUARD)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text


def test_text_format_and_reasoning(server):
    c = openai_client(server)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = c.responses.create(
        model=MODEL,
        input="Name a city.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
        temperature=0,
    )
    assert set(json.loads(r.output_text)) == {"city"}
    events, final = streamed(
        c.responses.create(
            model=MODEL,
            input="What is two plus two?",
            max_output_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"chat_template_kwargs": {"open_think": True}},
        )
    )
    # The prompt opened a <think> block SmolLM2 never closes: all reasoning.
    (reasoning,) = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    assert final.status == "incomplete"
    assert "response.reasoning_text.delta" in {e.type for e in events}


def test_a_client_leaving_a_stream_cancels_its_request(server):
    # Decode steps wait at a gate: the request is still running when the
    # client leaves, however fast the engine.
    gate = server.engine.engine = Gate(server.engine.engine)
    try:
        before = server.engine.cancels_received
        body = {"model": MODEL, "input": "Count to a thousand.", "max_output_tokens": 400,
                "stream": True, "ignore_eos": True}  # fmt: skip
        url = server.url + "/v1/responses"
        with httpx.stream("POST", url, json=body, timeout=HANG_GUARD) as r:
            for line in r.iter_lines():
                if "response.output_text.delta" in line:  # the prefill's token
                    break
        deadline = time.monotonic() + 60  # a hang guard: the loop sees it at once
        while server.engine.cancels_received == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.engine.cancels_received > before
    finally:
        gate.opened.set()
        server.engine.engine = gate.inner
    assert server.engine.wait_idle(HANG_GUARD)


def call_delta(call: dict) -> dict:
    """A chat chunk whose delta holds one tool-call delta."""
    return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}


def test_the_events_of_a_reasoned_answer_that_calls_a_tool():
    """The event writer on given chat chunks: a reasoning item, a message
    item and a function call streamed in pieces, each added, filled and done
    in turn."""
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "Rain? "}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "Check."}}]},
        {"choices": [{"index": 0, "delta": {"content": "Let me look."}}]},
        call_delta(
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ),
        call_delta({"index": 0, "function": {"arguments": '{"city": '}}),
        call_delta({"index": 0, "function": {"arguments": '"Oslo"}'}}),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {
            "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
        },  # fmt: skip
    ]

    async def lines():
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    async def collect():
        return [event async for event in stream_events(lines(), {"id": "resp_1"})]

    events = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(collect())]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Rain? Check."
    assert final["output"][2]["call_id"] == "call_1" and final["status"] == "completed"
    assert final["output"][2]["arguments"] == '{"city": "Oslo"}'
    added = next(e for e in events if e["type"] == "response.output_item.added"
                 and e["item"]["type"] == "function_call")  # fmt: skip
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert final["usage"]["output_tokens"] == 7


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"previous_response_id": "resp_1"}, 404, "previous_response_id"),
        ({"input": [{"type": "image_generation_call"}]}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, 400, "input"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"text": {"format": {"type": "xml"}}}, 400, "text"),
        ({"text": {"format": "json"}}, 400, "text"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"model": "gpt-5"}, 404, "model"),
    ],
)
def test_refusals_name_the_responses_field(server, fields, status, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=HANG_GUARD)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text
