"""The Responses API's stored responses: kept in the server's memory for
`previous_response_id` and GET /v1/responses/{id}, the most recently used
`capacity` of them.

Each entry keeps its response object, the id of the response it
continued, and the input items it added: its request's input, then its
own output as input items (an assistant message for its text, its
function calls as they were; reasoning is not carried over, as OpenAI
carries none). A conversation is its chain of entries walked back to the
first; reading one makes its whole chain the most recently used, so a
conversation in use is not the one dropped. A chain with a dropped entry
cannot be continued.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_CAPACITY = 1024
"""Responses kept unless the server is told otherwise."""


@dataclass(frozen=True)
class _Entry:
    response: dict
    previous: str | None
    items: list[dict]


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
        self._entries[response["id"]] = _Entry(response, previous, items)
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
        return [item for at in reversed(chain) for item in self._entries[at].items]


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
