"""A prefill/decode disaggregation proxy: the OpenAI API in front of prefill
and decode instances (`pagedkv serve --role prefill|decode`), doing what
vLLM's NixlConnector proxy does.

For each request: the prefill instance (in turn) gets it with
``max_tokens: 1``, ``stream: false`` and ``kv_transfer_params:
{"do_remote_decode": true, ...}``; its answer's ``kv_transfer_params`` name
the pages it keeps. The decode instance (in turn) gets the original request
with those params, reads the pages and answers; that answer, streamed or
not, goes back to the client unchanged. A prefill instance's error answer
goes back as it is.
"""

from __future__ import annotations

import itertools
import json
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from .proxying import add_openai_routes, proxy_error, relay

__all__ = ["create_disagg_app", "prefill_body"]

ASK_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What vLLM's proxy sends a prefill instance."""


def prefill_body(body: dict, chat: bool) -> dict:
    """The prefill instance's request: one token, not streamed, pages kept.

    Examples
    --------
    >>> prefill_body({"prompt": "hi", "stream": True, "max_tokens": 9}, chat=False)["max_tokens"]
    1
    """
    body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": ASK_REMOTE_DECODE}
    body.pop("stream_options", None)
    if chat:
        body["max_completion_tokens"] = 1
    return body


def create_disagg_app(prefill: list[str], decode: list[str]) -> FastAPI:
    """The proxy's ASGI app over prefill and decode instances' base URLs."""
    if not prefill or not decode:
        raise ValueError("give at least one prefill and one decode instance")
    prefill = [u.rstrip("/") for u in prefill]
    decode = [u.rstrip("/") for u in decode]
    turns = (itertools.cycle(prefill), itertools.cycle(decode))
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0))

    @asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    app = FastAPI(title="pagedkv disaggregation proxy", lifespan=lifespan)

    async def forward(request: Request, path: str, chat: bool):
        try:
            body = json.loads(await request.body())
        except ValueError:
            return proxy_error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return proxy_error(400, "the body is not a JSON object")
        headers = {k: v for k, v in request.headers.items() if k == "authorization"}
        first = next(turns[0])
        try:
            answer = await client.post(first + path, json=prefill_body(body, chat), headers=headers)
        except httpx.HTTPError as e:
            return proxy_error(502, f"prefill instance {first} did not answer: {type(e).__name__}")
        if answer.status_code != 200:
            return Response(answer.content, answer.status_code, media_type="application/json")
        params = answer.json().get("kv_transfer_params")
        if not params:
            return proxy_error(
                502, f"prefill instance {first} kept no pages (is it --role prefill?)"
            )
        second = next(turns[1])
        try:
            upstream = await client.send(
                client.build_request(
                    "POST",
                    second + path,
                    json={**body, "kv_transfer_params": params},
                    headers=headers,
                ),
                stream=True,
            )
        except httpx.HTTPError as e:
            return proxy_error(502, f"decode instance {second} did not answer: {type(e).__name__}")
        served = {"x-pagedkv-prefill": first, "x-pagedkv-decode": second}
        return await relay(upstream, bool(body.get("stream")), served)

    add_openai_routes(app, forward, client, decode[0])

    @app.get("/health")
    async def health():
        return {"status": "ok", "prefill": prefill, "decode": decode}

    return app
