"""What the router and the disaggregation proxy share: the OpenAI routes
they forward, and answers relayed from an upstream server unchanged."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

Forward = Callable[[Request, str, bool], Awaitable[Response]]
"""forward(request, path, chat) -> the answer."""


def proxy_error(status: int, message: str) -> JSONResponse:
    """An OpenAI-style error the proxy itself answers."""
    return JSONResponse({"error": {"message": message, "type": "proxy_error"}}, status)


async def relay(
    upstream: httpx.Response,
    stream: bool,
    headers: dict[str, str],
    on_close: Callable[[], None] | None = None,
    on_first: Callable[[], None] | None = None,
) -> Response:
    """The upstream answer (sent with ``stream=True``) passed on unchanged:
    streamed when the client asked for a stream, else gathered. `on_first`
    is called when its first bytes arrive; the upstream is closed, and
    `on_close` called, once it is read."""
    kept = {"content-type": upstream.headers.get("content-type", "application/json"), **headers}

    async def chunks():
        first = on_first
        try:
            async for chunk in upstream.aiter_raw():
                if first is not None:
                    first()
                    first = None
                yield chunk
        finally:
            await upstream.aclose()
            if on_close is not None:
                on_close()

    if stream:
        return StreamingResponse(chunks(), status_code=upstream.status_code, headers=kept)
    content = b"".join([chunk async for chunk in chunks()])
    return Response(content, status_code=upstream.status_code, headers=kept)


def add_openai_routes(app: FastAPI, forward: Forward, client: httpx.AsyncClient, models: str):
    """POST /v1/chat/completions and /v1/completions through `forward`;
    GET /v1/models from the server at `models`."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward(request, "/v1/chat/completions", True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions", False)

    @app.get("/v1/models")
    async def model_list():
        answer = await client.get(models + "/v1/models")
        return Response(answer.content, answer.status_code, media_type="application/json")
