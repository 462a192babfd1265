"""The Responses API's stored responses: kept in the server's memory for
`previous_response_id` and GET /v1/responses/{id}, the most recently used
`capacity` of them.

Each entry keeps its response object, the id of the response it
continued, the input items it added (its request's input, then its own
output as input items: an assistant message for its text, its function
calls as they were; reasoning is not carried over, as OpenAI carries
none), and its request's input as the Responses API lists it (each item
with an id, for GET /v1/responses/{id}/input_items). A conversation is its
chain of entries walked back to the first; reading one makes its whole
chain the most recently used, so a conversation in use is not the one
dropped. A chain with a dropped entry cannot be continued.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_CAPACITY = 1024
"""Responses kept unless the server is told otherwise."""


ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
"""The id prefix of each input item type (OpenAI's); other types take "item"."""


@dataclass(frozen=True)
class _Entry:
    response: dict
    previous: str | None
    items: list[dict]
    listed: list[dict]


class ResponseStore:
    """The stored responses, the least recently used dropped first.

    Args:
        capacity: how many responses are kept.

    Examples
    --------
    >>> store = ResponseStore(2)
    >>> store.put({"id": "r1", "output": []}, None, [{"role": "user", "content": "Hi"}])
    >>> store.conversation("r1")
    [{'role': 'user', 'content': 'Hi'}]
    >>> store.conversation("r0") is None
    True
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, previous: str | None, input_items: list[dict]) -> None:
        """Keeps a finished response that continued `previous` (or None)
        after the input items its request added."""
        items = [*input_items, *output_items(response["output"])]
        listed = [listed_item(item) for item in input_items]
        self._entries[response["id"]] = _Entry(response, previous, items, listed)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> dict | None:
        """The stored response object, or None."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry.response

    def delete(self, response_id: str) -> bool:
        """Drops a stored response (a conversation that went through it can
        no longer be continued); whether it was stored."""
        return self._entries.pop(response_id, None) is not None

    def conversation(self, response_id: str) -> list[dict] | None:
        """Every input item of the conversation up to and including the
        response, oldest first; None where it or an earlier response of
        its chain is not stored."""
        chain = self._chain(response_id)
        if chain is None:
            return None
        return [item for entry in chain for item in entry.items]

    def input_items(self, response_id: str) -> list[dict] | None:
        """The items the response was generated from, oldest first, as the
        Responses API lists them: each earlier response's input items and
        output items (its reasoning left out, as the conversation carries
        none), then its own input items; None where it or an earlier
        response of its chain is not stored."""
        chain = self._chain(response_id)
        if chain is None:
            return None
        items = []
        for entry in chain[:-1]:
            items += entry.listed
            items += [item for item in entry.response["output"] if item["type"] != "reasoning"]
        return items + chain[-1].listed

    def _chain(self, response_id: str) -> list[_Entry] | None:
        """The entries from the conversation's first to the response's,
        made the most recently used; None where one is not stored."""
        chain = []
        at: str | None = response_id
        while at is not None:
            entry = self._entries.get(at)
            if entry is None:
                return None
            chain.append(at)
            at = entry.previous
        for at in reversed(chain):
            self._entries.move_to_end(at)
        return [self._entries[at] for at in reversed(chain)]


def listed_item(item: dict) -> dict:
    """An input item as the Responses API lists it: with an id (its own, or
    a new one), a message's string content as one text part (input_text,
    or output_text for the assistant's), and status "completed"."""
    kind = item.get("type", "message")
    new_id = f"{ITEM_ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}"
    listed = {**item, "id": item.get("id") or new_id, "type": kind}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        listed["content"] = [{"type": part, "text": item["content"]}]
    listed.setdefault("status", "completed")
    return listed


def output_items(output: list[dict]) -> list[dict]:
    """A response's output as the input items that continue it: its
    messages' text as assistant messages, its function calls as they are."""
    items = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part.get("text", "") for part in item["content"])
            items.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            keys = ("type", "call_id", "name", "arguments")
            items.append({k: item[k] for k in keys})
    return items
