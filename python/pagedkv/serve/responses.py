"""POST /v1/responses: OpenAI's Responses API over the chat endpoint.

A request's `instructions` and `input` (a string, or items: messages,
earlier `function_call`s and their `function_call_output`s) become chat
messages; its flat function `tools`, `tool_choice`, `text.format` and
`max_output_tokens` the chat request's fields. The chat answer becomes the
response's output items (a `reasoning` item, a `message`, `function_call`s),
and a streamed one's chunks the Responses API's events, from
`response.created` to `response.completed` (or `response.incomplete` where
`max_output_tokens` cut it). Everything the chat endpoint does, limits,
cancellation, tool formats and reasoning, holds unchanged.

Responses are kept in the server's memory (`response_store`, the most
recently used `ServeLimits.max_stored_responses`) unless a request says
`"store": false`: `previous_response_id` continues one (its conversation's
items come before the new input; instructions are not carried over, as in
OpenAI's API), GET /v1/responses/{id} returns one, GET
/v1/responses/{id}/input_items lists the items it was generated from, a
page at a time, and DELETE drops it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Literal

from fastapi import Query, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from pagedkv.models.errors import ChatRequestError

from .completions import ApiError, Completions
from .protocol import ChatCompletionRequest, ResponsesRequest
from .response_store import ResponseStore

PASSED_ON = (
    "seed",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "priority",
    "logit_bias",
    "chat_template_kwargs",
    "reasoning_format",
    "structured_outputs",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
)
"""Chat fields a Responses request may carry as extensions (vLLM's)."""
PARAMS = {
    "messages": "input",
    "response_format": "text",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
}
"""The chat field an error names -> the Responses field it came from."""


class Responses:
    """The Responses endpoint over the chat endpoint (`Completions`), its
    finished responses kept in `store`."""

    def __init__(self, completions: Completions, store: ResponseStore) -> None:
        self.completions = completions
        self.store = store

    async def create(self, request: Request, body: ResponsesRequest):
        reject = self.completions.reject
        given = body.input
        if isinstance(given, str):
            given = [{"role": "user", "content": given}]
        history: list[dict] = []
        if body.previous_response_id is not None:
            history = self.store.conversation(body.previous_response_id)
            if history is None:
                raise reject(
                    404,
                    f"no stored response {body.previous_response_id!r} (a server keeps the "
                    f"{self.store.capacity} most recently used, in its memory)",
                    "invalid_request_error",
                    param="previous_response_id",
                )
        try:
            chat = ChatCompletionRequest.model_validate(chat_fields(body, [*history, *given]))
        except ChatRequestError as e:
            raise reject(400, str(e), "invalid_request_error", param=e.param) from None
        except ValidationError as e:
            first = e.errors()[0]
            where = str(first["loc"][0]) if first["loc"] else "input"
            raise reject(
                400,
                f"{where}: {first['msg']}",
                "invalid_request_error",
                param=PARAMS.get(where, where),
            ) from None
        try:
            answer = await self.completions.chat_completions(request, chat)
        except ApiError as e:
            e.param = PARAMS.get(e.param, e.param)
            raise
        base = _base(body)

        def keep(response: dict) -> None:
            if body.store is not False:
                self.store.put(response, body.previous_response_id, given)

        if isinstance(answer, StreamingResponse):
            stream = stream_events(answer.body_iterator, base, keep)
            return StreamingResponse(
                stream, media_type="text/event-stream", background=answer.background
            )
        response = _response_of(answer, base)
        keep(response)
        return response

    async def retrieve(self, response_id: str) -> dict:
        """GET /v1/responses/{response_id}: a stored response, or 404."""
        response = self.store.get(response_id)
        if response is None:
            raise self.completions.reject(
                404, f"no stored response {response_id!r}", "invalid_request_error"
            )
        return response

    async def input_items(
        self,
        response_id: str,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
        before: str | None = None,
        include: Annotated[list[str] | None, Query()] = None,
    ) -> dict:
        """GET /v1/responses/{response_id}/input_items: a page of the items
        the stored response was generated from (`ResponseStore.input_items`),
        or 404. `include` names output details pagedkv has none of."""
        del include
        items = self.store.input_items(response_id)
        if items is None:
            raise self.completions.reject(
                404, f"no stored response {response_id!r}", "invalid_request_error"
            )
        try:
            return cursor_page(items, limit, order, after, before)
        except ChatRequestError as e:
            raise self.completions.reject(
                400, str(e), "invalid_request_error", param=e.param
            ) from None

    async def delete(self, response_id: str) -> dict:
        """DELETE /v1/responses/{response_id}: drops a stored response, or 404."""
        if not self.store.delete(response_id):
            raise self.completions.reject(
                404, f"no stored response {response_id!r}", "invalid_request_error"
            )
        return {"id": response_id, "object": "response", "deleted": True}


def cursor_page(
    items: list[dict], limit: int, order: str, after: str | None, before: str | None
) -> dict:
    """OpenAI's list page of `items` (oldest first, each with an id) in
    `order` ("asc" or "desc"): the first `limit` items after the item
    `after`, or, with `before` alone, the last `limit` before the item
    `before` (the page that precedes it); both bound the window. Raises
    ChatRequestError naming a cursor that is not one of the items.

    Examples
    --------
    >>> page = cursor_page([{"id": "a"}, {"id": "b"}, {"id": "c"}], 1, "asc", "a", None)
    >>> page["data"], page["has_more"]
    ([{'id': 'b'}], True)
    """
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    bounds = []
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise ChatRequestError(name, f"{name}: no input item {cursor!r} in this response")
        bounds.append(None if cursor is None else ids.index(cursor))
    start = 0 if bounds[0] is None else bounds[0] + 1
    window = ordered[start : bounds[1]]
    page = window[-limit:] if after is None and before is not None else window[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(window) > len(page),
    }


def chat_fields(body: ResponsesRequest, items: list[dict]) -> dict:
    """The chat request a Responses request asks for, over the input
    `items` (the earlier conversation's, then its own). Raises
    ChatRequestError naming the field (input, tools, text) it cannot take."""
    fields = {
        "model": body.model,
        "messages": input_messages(items, body.instructions),
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "stream": body.stream,
        "stream_options": {"include_usage": True} if body.stream else None,
    }
    if body.max_output_tokens is not None:
        fields["max_completion_tokens"] = body.max_output_tokens
    if body.tools is not None:
        fields["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        choice = body.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        fields["tool_choice"] = choice
    fmt = (body.text or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise ChatRequestError("text", 'text.format must be {"type": ...}')
        fields["response_format"] = _chat_format(fmt)
    extra = body.model_extra or {}
    fields.update((name, extra[name]) for name in PASSED_ON if name in extra)
    return fields


def input_messages(given: str | list, instructions: str | None) -> list[dict]:
    """`instructions` and `input` as chat messages: an item's text parts
    (input_text, output_text) joined, consecutive function calls one
    assistant turn, each output a tool message; reasoning items dropped."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif kind != "reasoning":
            raise ChatRequestError("input", f"input[{i}]: items of type {kind!r} are not taken")
    return messages


def _text(content: object, i: int) -> object:
    """A message item's content as chat takes it (its text parts)."""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            raise ChatRequestError("input", f"input[{i}]: only text parts are taken")
        parts.append({"type": "text", "text": part.get("text")})
    return parts


def _chat_tool(tool: dict, i: int) -> dict:
    """A flat function tool {"type": "function", "name", ...} in chat's shape."""
    if tool.get("type") != "function":
        raise ChatRequestError("tools", f"tools[{i}]: only function tools are taken")
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _chat_format(fmt: dict) -> dict:
    """`text.format` as chat's `response_format`."""
    if fmt.get("type") == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")},
        }
    return fmt


def _base(body: ResponsesRequest) -> dict:
    """The fields every response object of this request carries."""
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": body.model,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
        "tools": body.tools or [],
        "text": body.text or {"format": {"type": "text"}},
        "metadata": body.metadata,
        "store": body.store is not False,
        "previous_response_id": body.previous_response_id,
        "error": None,
    }


def _finished(base: dict, output: list, usage: dict | None, cut: bool) -> dict:
    """The whole response object: completed, or incomplete where
    max_output_tokens cut the answer."""
    return {
        **base,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output,
        "usage": None
        if usage is None
        else {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {
        "type": "reasoning",
        "id": f"rs_{uuid.uuid4().hex}",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _message_item(text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call_item(call: dict) -> dict:
    function = call["function"]
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": "completed",
    }


def _response_of(chat: dict, base: dict) -> dict:
    """A whole chat completion as a response object."""
    (choice,) = chat["choices"]
    message = choice["message"]
    output = []
    if message.get("reasoning_content") is not None:
        output.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        output.append(_message_item(message["content"]))
    output += [_call_item(call) for call in message.get("tool_calls") or ()]
    return _finished(base, output, chat["usage"], choice["finish_reason"] == "length")


async def stream_events(
    chunks: AsyncIterator[str], base: dict, on_final: Callable[[dict], None] | None = None
) -> AsyncIterator[str]:
    """A streamed chat answer's server-sent events as the Responses API's:
    each output item added, its text in deltas, done; then the response,
    which `on_final` is given first. Closing it (a client gone) closes the
    chat stream at once, which cancels the request."""
    events = _EventWriter(base)
    yield events.write("response.created", response=events.snapshot("in_progress"))
    yield events.write("response.in_progress", response=events.snapshot("in_progress"))
    try:
        async for line in chunks:
            if not line.startswith("data: ") or line.startswith("data: [DONE]"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                message = chunk["error"]["message"]
                yield events.write("error", message=message, code=None, param=None)
                return
            for event in events.on_chunk(chunk):
                yield event
    finally:
        if hasattr(chunks, "aclose"):
            await chunks.aclose()
    for event in events.close_item():
        yield event
    final = _finished(base, events.output, events.usage, events.finish_reason == "length")
    if on_final is not None:
        on_final(final)
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield events.write(kind, response=final)


class _EventWriter:
    """The events of one streamed response, numbered, and its output items
    as they grow (at most one item open: reasoning, a message or a call)."""

    def __init__(self, base: dict) -> None:
        self.base = base
        self.sequence = 0
        self.output: list[dict] = []
        self.open: dict | None = None
        self.usage: dict | None = None
        self.finish_reason: str | None = None

    def write(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"

    def snapshot(self, status: str) -> dict:
        return {
            **self.base,
            "status": status,
            "output": [],
            "usage": None,
            "incomplete_details": None,
        }

    def on_chunk(self, chunk: dict) -> list[str]:
        self.usage = chunk.get("usage") or self.usage
        if not chunk.get("choices"):
            return []
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        out = []
        if delta.get("reasoning_content"):
            out += self.text(delta["reasoning_content"], "reasoning")
        if delta.get("content"):
            out += self.text(delta["content"], "message")
        for call in delta.get("tool_calls") or ():
            out += self.call(call)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            out += self.close_item()
        return out

    def call(self, delta: dict) -> list[str]:
        """A streamed call's delta: its item opened where the call begins
        (the delta with its id), then its arguments' pieces."""
        out = []
        if "id" in delta:
            out += self.close_item()
            self.open = {**_call_item(delta), "arguments": "", "status": "in_progress"}
            self.output.append(self.open)
            out.append(
                self.write(
                    "response.output_item.added",
                    output_index=len(self.output) - 1,
                    item=dict(self.open),
                )
            )
        arguments = delta["function"].get("arguments") or ""
        if arguments:
            self.open["arguments"] += arguments
            at = {"item_id": self.open["id"], "output_index": len(self.output) - 1}
            out.append(self.write("response.function_call_arguments.delta", **at, delta=arguments))
        return out

    def text(self, delta: str, kind: str) -> list[str]:
        """A text delta of a reasoning or message item (opened first)."""
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self.close_item()
            make = _reasoning_item if kind == "reasoning" else _message_item
            self.open = make("", "in_progress")
            index = len(self.output)
            self.output.append(self.open)
            out.append(
                self.write(
                    "response.output_item.added",
                    output_index=index,
                    item={**self.open, "content": []},
                )
            )
            out.append(
                self.write("response.content_part.added", **self.at(), part=self.open["content"][0])
            )
        self.open["content"][0]["text"] += delta
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.write(f"response.{name}.delta", **self.at(), delta=delta, **extra))
        return out

    def at(self) -> dict:
        return {
            "item_id": self.open["id"],
            "output_index": len(self.output) - 1,
            "content_index": 0,
        }

    def close_item(self) -> list[str]:
        """The open item's done events, if one is open."""
        if self.open is None:
            return []
        item, self.open = self.open, None
        item["status"] = "completed"
        if item["type"] == "function_call":
            at = {"item_id": item["id"], "output_index": len(self.output) - 1}
            return [
                self.write(
                    "response.function_call_arguments.done",
                    **at,
                    arguments=item["arguments"],
                    name=item["name"],
                ),
                self.write("response.output_item.done", output_index=at["output_index"], item=item),
            ]
        part = item["content"][0]
        at = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        name = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        return [
            self.write(f"response.{name}.done", **at, text=part["text"], **extra),
            self.write("response.content_part.done", **at, part=part),
            self.write("response.output_item.done", output_index=at["output_index"], item=item),
        ]
