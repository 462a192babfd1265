"""The HTTP layer: a FastAPI app speaking OpenAI's API over a `ServingEngine`.

The app holds what is not generation: errors in OpenAI's body, the API key,
/health, /metrics, /v1/models, the body-size limit. The generation
endpoints are completions.py's: every request becomes one engine request
per prompt, whose events arrive on an asyncio queue (the engine thread puts
them there through a `LoopMailbox`, one wake-up for a step's events).

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}:
400 for malformed JSON or fields, a prompt over the context or a request
that can never fit the pool; 401 for a wrong or missing key (with
--api-key; /health and /metrics stay open); 404 for an unknown model; 503
with Retry-After when the waiting queue is full or the engine is down.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .completions import ApiError, Completions
from .limits import BodySizeLimit, ServeLimits
from .metrics import ServeMetrics
from .protocol import error_body
from .response_store import ResponseStore
from .responses import Responses


def create_app(
    engine,
    model_name: str | Sequence[str],
    api_key: str | None = None,
    metrics=None,
    limits: ServeLimits | None = None,
    allowed_origins: Sequence[str] = (),
) -> FastAPI:
    """The server's ASGI app over a started `ServingEngine`.

    Parameters
    ----------
    engine : ServingEngine
        Started; the app only submits to it and cancels.
    model_name : str or sequence of str
        The model's id, or its ids (vLLM's `--served-model-name`): what
        /v1/models lists and requests must name (answers echo the one
        named).
    api_key : str, optional
        When given, /v1/* requires `Authorization: Bearer <api_key>`.
    metrics : ServeMetrics, optional
        The engine's observer (a new one bound to the engine when None).
    limits : ServeLimits, optional
        Per-request limits (the defaults when None).
    allowed_origins : sequence of str
        Origins whose browser pages may call the server (CORS; "*" for
        any); none by default.

    Examples
    --------
    >>> app = create_app(engine, "smollm2-135m-instruct")  # doctest: +SKIP
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)  # doctest: +SKIP
    """
    if metrics is None:
        metrics = ServeMetrics()
        metrics.bind(engine)
    limits = limits or ServeLimits()
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    if not names:
        raise ValueError("the server needs at least one model name")
    app = FastAPI(title="pagedkv", docs_url=None, redoc_url=None)
    add_middleware(app, limits, allowed_origins)
    created = int(time.time())

    def reject(status: int, message: str, kind: str, **kw) -> ApiError:
        metrics.http_rejections.labels(str(status)).inc()
        return ApiError(status, message, kind, **kw)

    add_error_handlers(app, metrics)

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise reject(401, "invalid or missing API key", "authentication_error")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    add_operator_routes(app, engine, metrics)

    @v1.get("/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": created, "owned_by": "pagedkv"}
                for name in names
            ],
        }

    completions = Completions(engine, names, limits, reject)
    v1.post("/chat/completions")(completions.chat_completions)
    v1.post("/completions")(completions.completions)
    responses = Responses(completions, ResponseStore(limits.max_stored_responses))
    v1.post("/responses")(responses.create)
    v1.get("/responses/{response_id}")(responses.retrieve)
    v1.get("/responses/{response_id}/input_items")(responses.input_items)
    v1.delete("/responses/{response_id}")(responses.delete)
    app.include_router(v1)
    # vLLM's and llama.cpp's tokenizer endpoints sit outside /v1.
    tokens = APIRouter(dependencies=[Depends(authorize)])
    tokens.post("/tokenize")(completions.tokenize)
    tokens.post("/detokenize")(completions.detokenize)
    app.include_router(tokens)
    return app


def add_middleware(app: FastAPI, limits: ServeLimits, allowed_origins: Sequence[str]) -> None:
    """The body-size limit, and CORS where origins are allowed."""
    app.add_middleware(BodySizeLimit, limit=limits.max_body_bytes)
    if allowed_origins:
        # Browser clients (a chat UI on another origin) read the answers;
        # the API key, not the origin, is what authorizes a request.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["*"],
        )


def add_operator_routes(app: FastAPI, engine, metrics) -> None:
    """What operators and peers read, without the API key: /health,
    /metrics and, where the engine keeps pages for decode instances,
    /kv_transfer/*."""

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "error", "reason": engine.fatal}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    if engine.kv_transfer is not None:

        @app.get("/kv_transfer/metadata")
        async def kv_transfer_metadata():
            """What a decode instance needs to read this instance's pages."""
            return engine.kv_transfer.metadata()

        @app.get("/kv_transfer/stats")
        async def kv_transfer_stats():
            """Pages kept, handed over and read since the server started."""
            return dataclasses.asdict(engine.kv_transfer.stats)


def add_error_handlers(app: FastAPI, metrics) -> None:
    """Answers every error with OpenAI's body: an ApiError as it says, a
    malformed request 400 naming the field, a routing error 404/405, and
    anything unexpected 500 (never a traceback); 4xx are counted."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        body = error_body(str(e), e.kind, e.param, e.code)
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        metrics.http_rejections.labels("400").inc()
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x not in ("body", "query"))
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg")
        return JSONResponse(
            error_body(message or "invalid request", "invalid_request_error", where or None),
            status_code=400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(e.detail), kind), status_code=e.status_code, headers=e.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        return JSONResponse(
            error_body(f"internal error: {type(e).__name__}: {e}", "server_error"),
            status_code=500,
        )
