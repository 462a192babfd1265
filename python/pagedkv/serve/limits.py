"""What one client may ask of the server: body size, prompt and completion
lengths, streams in flight per API key; and how many Responses API
responses the server keeps. Each limit is a flag of `pagedkv serve`; a
request over one gets a 4xx with OpenAI's error body before anything
reaches the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .response_store import DEFAULT_CAPACITY


@dataclass(frozen=True)
class ServeLimits:
    """The server's per-request limits (None: only the model's context and
    the pool bound it).

    max_body_bytes: a request body over this gets 413.
    max_prompt_tokens: a prompt (after the chat template) over this gets 400.
    max_tokens: a `max_tokens` (or `max_completion_tokens`) over this gets
    400; a request that names none is capped at it.
    max_streams_per_key: requests in flight per `Authorization` header (per
    client address without one) over this get 429.
    max_stored_responses: Responses API responses kept in memory for
    `previous_response_id` (the most recently used).
    """

    max_body_bytes: int = 8 << 20
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_streams_per_key: int | None = None
    max_stored_responses: int = DEFAULT_CAPACITY

    def __post_init__(self) -> None:
        names = ("max_body_bytes", "max_prompt_tokens", "max_tokens", "max_streams_per_key")
        for name in (*names, "max_stored_responses"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")


class BodySizeLimit:
    """ASGI middleware: a body over `limit` bytes is answered 413 without
    reaching the app: by its Content-Length, or, sent in chunks without one,
    once the chunks read so far pass the limit (the body is read here first,
    then handed on whole)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.limit:
                return await self._too_large(send)
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body was complete
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        # Imported here: protocol.py needs pydantic (the serve extra), and
        # the `pagedkv` command reads ServeLimits' defaults without it.
        from .protocol import error_body

        body = json.dumps(
            error_body(f"the request body is over {self.limit} bytes", "invalid_request_error")
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class StreamSlots:
    """Requests in flight per key, at most `limit` each (None: no limit).
    Used from the server's one event loop, so it needs no lock."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.counts: dict[str, int] = {}

    def take(self, key: str):
        """A release function for a new request of `key`, or None when `key`
        has `limit` in flight. Releasing twice releases once."""
        if self.limit is None:
            return lambda: None
        if self.counts.get(key, 0) >= self.limit:
            return None
        self.counts[key] = self.counts.get(key, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.counts[key] -= 1
            if self.counts[key] == 0:
                del self.counts[key]

        return release
