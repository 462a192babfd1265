"""The HTTP layer: a FastAPI app speaking OpenAI's API over a `ServingEngine`.

Handlers only check, enqueue and stream: every request becomes one engine
request per prompt, whose events arrive on an asyncio queue (the engine
thread puts them there with `call_soon_threadsafe`). A client that goes away
(a closed stream, or a dropped connection while a non-streamed answer is
computed) cancels its engine requests, which frees their pages at the next
step.

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}:
400 for malformed JSON or fields, a prompt over the context or a request
that can never fit the pool; 401 for a wrong or missing key (with
--api-key; /health and /metrics stay open); 404 for an unknown model; 503
with Retry-After when the waiting queue is full or the engine is down.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.graphs.sampling import LogitAdjustments, SamplingParams

from .choices import Choices
from .engine import Done, Failed, GenerationRequest, QueueFullError, RequestError
from .limits import BodySizeLimit, ServeLimits, StreamSlots
from .metrics import ServeMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, error_body

RETRY_AFTER_SECONDS = 1
DISCONNECT_POLL_SECONDS = 0.5
"""How often a non-streamed request checks whether its client is still there."""


@dataclass(frozen=True)
class Asked:
    """What one API request asks of each of its engine requests beyond the
    prompt: how to choose tokens, which logprobs to report, and the
    completions endpoint's echo."""

    sampling: SamplingParams
    adjustments: LogitAdjustments
    logprobs: int | None
    """Top logprobs per generated token (None: no logprobs)."""
    echo: bool = False
    prompt_logprobs: int | None = None
    completion: bool = True
    """False: max_tokens 0 with echo, the one generated token is dropped."""


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str, param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.headers = headers


def create_app(
    engine,
    model_name: str,
    api_key: str | None = None,
    metrics=None,
    limits: ServeLimits | None = None,
) -> FastAPI:
    """The server's ASGI app over a started `ServingEngine`.

    Parameters
    ----------
    engine : ServingEngine
        Started; the app only submits to it and cancels.
    model_name : str
        The one model id /v1/models lists and requests must name.
    api_key : str, optional
        When given, /v1/* requires `Authorization: Bearer <api_key>`.
    metrics : ServeMetrics, optional
        The engine's observer (a new one bound to the engine when None).
    limits : ServeLimits, optional
        Per-request limits (the defaults when None).

    Examples
    --------
    >>> app = create_app(engine, "smollm2-135m-instruct")  # doctest: +SKIP
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)  # doctest: +SKIP
    """
    if metrics is None:
        metrics = ServeMetrics()
        metrics.bind(engine)
    limits = limits or ServeLimits()
    app = FastAPI(title="pagedkv", docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimit, limit=limits.max_body_bytes)
    slots = StreamSlots(limits.max_streams_per_key)
    created = int(time.time())

    def reject(status: int, message: str, kind: str, **kw) -> ApiError:
        metrics.http_rejections.labels(str(status)).inc()
        return ApiError(status, message, kind, **kw)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        body = error_body(str(e), e.kind, e.param, e.code)
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        metrics.http_rejections.labels("400").inc()
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
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

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise reject(401, "invalid or missing API key", "authentication_error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        return JSONResponse(
            error_body(f"internal error: {type(e).__name__}: {e}", "server_error"),
            status_code=500,
        )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "error", "reason": engine.fatal}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @v1.get("/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": model_name, "object": "model", "created": created, "owned_by": "pagedkv"}
            ],
        }

    def check(body, chat: bool) -> Asked:
        if body.model != model_name:
            raise reject(
                404,
                f"The model `{body.model}` does not exist (this server serves `{model_name}`)",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
        name = body.unsupported()
        if name is not None:
            raise reject(
                400, f"{name} is not supported by pagedkv", "invalid_request_error", param=name
            )
        vocab = engine.llm.config.vocab_size
        bias = tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items())
        if any(not 0 <= token < vocab for token, _ in bias):
            raise reject(
                400,
                f"logit_bias keys must be token ids in [0, {vocab})",
                "invalid_request_error",
                param="logit_bias",
            )
        adjustments = LogitAdjustments(bias, body.presence_penalty, body.frequency_penalty)
        sampling = SamplingParams(body.temperature, body.top_p, body.seed)
        if chat:
            if body.top_logprobs is not None and not body.logprobs:
                raise reject(
                    400,
                    "top_logprobs needs logprobs: true",
                    "invalid_request_error",
                    param="top_logprobs",
                )
            top = (body.top_logprobs or 0) if body.logprobs else None
            return Asked(sampling, adjustments, top)
        if body.max_tokens == 0 and not body.echo:
            raise reject(
                400,
                "max_tokens may be 0 only with echo",
                "invalid_request_error",
                param="max_tokens",
            )
        prompt_top = body.logprobs if body.echo else None
        completion = body.max_tokens != 0
        return Asked(sampling, adjustments, body.logprobs, body.echo, prompt_top, completion)

    def submit_all(prompts: list[list[int]], max_tokens, body, asked, queue, loop) -> list[str]:
        """Submits one engine request per prompt; returns their ids."""
        ids = []
        try:
            for p, prompt in enumerate(prompts):
                room = engine.context - len(prompt)
                limit = max_tokens if max_tokens is not None else max(1, room)
                limit = max(limit, 1)  # max_tokens 0 (echo): one token, dropped
                rid = f"{uuid.uuid4().hex}"
                req = GenerationRequest(
                    rid,
                    tuple(prompt),
                    limit,
                    body.n,
                    asked.sampling,
                    tuple(body.stop),
                    body.ignore_eos,
                    priority=body.priority,
                    logprobs=asked.logprobs,
                    prompt_logprobs=asked.prompt_logprobs,
                    adjustments=asked.adjustments,
                )

                def sink(event, p=p):
                    loop.call_soon_threadsafe(queue.put_nowait, (p, event))

                engine.submit(req, sink)
                ids.append(rid)
        except (RequestError, QueueFullError, RuntimeError) as e:
            for rid in ids:
                engine.cancel(rid)
            if isinstance(e, RequestError):
                raise reject(400, str(e), "invalid_request_error", param="messages") from None
            raise reject(
                503,
                f"the server is busy: {e}",
                "server_overloaded" if isinstance(e, QueueFullError) else "server_error",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from None
        return ids

    async def events(request: Request, queue: asyncio.Queue, ids: list[str], watch: bool):
        """Yields (prompt index, event) until every request is Done; cancels
        the rest when the consumer stops early or the client goes away."""
        remaining = len(ids)
        try:
            while remaining:
                if watch:
                    try:
                        p, event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_SECONDS)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return
                        continue
                else:
                    p, event = await queue.get()
                if isinstance(event, Failed):
                    raise ApiError(500, event.message, "server_error")
                if isinstance(event, Done):
                    remaining -= 1
                yield p, event
        finally:
            if remaining:
                for rid in ids:
                    engine.cancel(rid)

    async def serve(
        request: Request, body, prompts: list[list[int]], max_tokens, chat: bool, texts=None
    ):
        """Submits the prompts, then streams or gathers their choices;
        `texts`: the prompts as echo returns them (default: decoded)."""
        asked = check(body, chat)
        max_tokens = within_limits(prompts, max_tokens, chat)
        key = request.headers.get("authorization") or (
            request.client.host if request.client else ""
        )
        release = slots.take(key)
        if release is None:
            raise reject(
                429,
                f"{limits.max_streams_per_key} requests of this key are in flight already",
                "rate_limit_error",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        handed_off = False
        try:
            response = await answer(request, body, prompts, max_tokens, chat, texts, asked, release)
            handed_off = isinstance(response, StreamingResponse)
            return response
        finally:
            if not handed_off:
                release()

    def within_limits(prompts: list[list[int]], max_tokens, chat: bool):
        """max_tokens as the limits allow it (400 beyond them)."""
        if limits.max_prompt_tokens is not None:
            longest = max(len(p) for p in prompts)
            if longest > limits.max_prompt_tokens:
                raise reject(
                    400,
                    f"the prompt has {longest} tokens; this server takes at most "
                    f"{limits.max_prompt_tokens}",
                    "invalid_request_error",
                    param="messages" if chat else "prompt",
                )
        if limits.max_tokens is None:
            return max_tokens
        if max_tokens is None:
            return limits.max_tokens
        if max_tokens > limits.max_tokens:
            raise reject(
                400,
                f"max_tokens is {max_tokens}; this server generates at most {limits.max_tokens}",
                "invalid_request_error",
                param="max_tokens",
            )
        return max_tokens

    async def answer(request, body, prompts, max_tokens, chat, texts, asked, release):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        ids = submit_all(prompts, max_tokens, body, asked, queue, loop)
        prefix = "chatcmpl" if chat else "cmpl"
        response_id = f"{prefix}-{ids[0]}"
        common = {"id": response_id, "created": int(time.time()), "model": model_name}
        tokenizer = engine.tokenizer
        texts = texts or [tokenizer.decode(p) if asked.echo else "" for p in prompts]
        choices = Choices(
            chat,
            body.n,
            list(zip(texts, prompts, strict=True)),
            asked.logprobs is not None,
            asked.echo,
            asked.completion,
            lambda token: tokenizer.decode([token]),
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = _stream(
                events(request, queue, ids, False), common, choices, chat, include_usage, release
            )
            return StreamingResponse(
                stream, media_type="text/event-stream", background=BackgroundTask(release)
            )
        usage = [0, 0, 0]
        async for p, event in events(request, queue, ids, True):
            if isinstance(event, Done):
                usage = _add(usage, _counts(event, asked.completion))
            else:
                choices.on_event(p, event)
        return {
            **common,
            "object": "chat.completion" if chat else "text_completion",
            "choices": choices.answers(),
            "usage": _usage(*usage),
        }

    @v1.post("/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            for m in messages:
                m["role"] = "system" if m["role"] == "developer" else m["role"]
            prompt = engine.tokenizer.encode(engine.tokenizer.render_chat(messages))
        except ValueError as e:
            raise reject(400, str(e), "invalid_request_error", param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await serve(request, body, [prompt], max_tokens, chat=True)

    @v1.post("/completions")
    async def completions(request: Request, body: CompletionRequest):
        texts = None
        try:
            if isinstance(body.prompt, str):
                texts = [body.prompt]
            elif not all(isinstance(x, int) for x in body.prompt):
                texts = list(body.prompt)
            prompts = [engine.tokenizer.encode(t) for t in texts] if texts else []
        except ValueError as e:
            raise reject(400, str(e), "invalid_request_error", param="prompt") from None
        if texts is None:
            vocab = engine.llm.config.vocab_size
            if any(not 0 <= x < vocab for x in body.prompt):
                raise reject(
                    400,
                    f"token ids must be in [0, {vocab})",
                    "invalid_request_error",
                    param="prompt",
                )
            prompts = [list(body.prompt)]
        if any(not p for p in prompts):
            raise reject(400, "the prompt is empty", "invalid_request_error", param="prompt")
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        return await serve(request, body, prompts, max_tokens, chat=False, texts=texts)

    app.include_router(v1)
    return app


def _add(usage: list[int], counts: tuple[int, int, int]) -> list[int]:
    return [a + b for a, b in zip(usage, counts, strict=True)]


def _counts(done: Done, completion: bool) -> tuple[int, int, int]:
    """The usage of one engine request; `completion` False: its one
    generated token was dropped (max_tokens 0 with echo)."""
    completion = done.completion_tokens if completion else 0
    return done.prompt_tokens, completion, done.cached_tokens


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _stream(
    events: AsyncIterator,
    common: dict,
    choices: Choices,
    chat: bool,
    include_usage: bool,
    release: Callable[[], None],
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.

    Chat: each choice's first chunk carries the assistant role; its last one
    an empty delta with finish_reason. Completions with echo: each choice's
    first chunk carries the prompt. With stream_options.include_usage a last
    chunk with no choices carries the usage.
    """
    kind = "chat.completion.chunk" if chat else "text_completion"
    usage = [0, 0, 0]

    def chunk(objects: list, **extra) -> str:
        return f"data: {json.dumps({**common, 'object': kind, 'choices': objects, **extra})}\n\n"

    try:
        async for p, event in events:
            if isinstance(event, Done):
                usage = _add(usage, _counts(event, choices.completion))
                continue
            for obj in choices.on_event(p, event):
                yield chunk([obj])
    except ApiError as e:
        # Headers are gone: the error travels as an event, as OpenAI's does.
        yield f"data: {json.dumps(error_body(str(e), e.kind))}\n\n"
        yield "data: [DONE]\n\n"
        return
    finally:
        # A client gone mid-stream closes this generator: cancel at once.
        release()
        await events.aclose()
    if include_usage:
        yield chunk([], usage=_usage(*usage))
    yield "data: [DONE]\n\n"
