"""The two generation endpoints, /v1/chat/completions and /v1/completions:
a request checked against the served model and the limits, turned into one
engine request per prompt, and its events turned back into OpenAI's
response, streamed (server-sent events) or whole.

A client that goes away (a closed stream, or a dropped connection while a
non-streamed answer is computed) cancels its engine requests, which frees
their pages at the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from pagedkv.graphs.sampling import LogitAdjustments, SamplingParams
from pagedkv.graphs.structured import request_format, response_format_grammar
from pagedkv.models.chat import ChatPrompt, chat_prompt
from pagedkv.models.errors import ChatRequestError

from .choices import Choices
from .engine import Done, Failed, GenerationRequest, QueueFullError, RequestError
from .limits import ServeLimits, StreamSlots
from .mailbox import LoopMailbox
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)

RETRY_AFTER_SECONDS = 1
DISCONNECT_POLL_SECONDS = 0.5
"""How often a non-streamed request checks whether its client is still there."""


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str, param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.headers = headers


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
    grammar: str | None = None
    """What the text must follow (`response_format`), or None."""


class Completions:
    """The generation endpoints over a started `ServingEngine`.

    Parameters
    ----------
    engine : ServingEngine
        Started; requests are submitted to it and cancelled.
    model_names : sequence of str
        The names requests may give the served model (the first is its own).
    limits : ServeLimits
        Per-request limits.
    reject : callable(status, message, kind, **kw) -> ApiError
        Makes (and counts) a refusal.
    """

    def __init__(self, engine, model_names: Sequence[str], limits: ServeLimits, reject) -> None:
        self.engine = engine
        self.model_names = tuple(model_names)
        self.limits = limits
        self.slots = StreamSlots(limits.max_streams_per_key)
        self.reject = reject
        self._mailboxes: dict[asyncio.AbstractEventLoop, LoopMailbox] = {}

    def mailbox(self, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        """The one mailbox that hands engine events to `loop`."""
        box = self._mailboxes.get(loop)
        if box is None:
            box = self._mailboxes[loop] = LoopMailbox(loop)
        return box

    def check_model(self, model: str | None) -> None:
        """404 unless `model` names the served model (None: not named)."""
        if model is not None and model not in self.model_names:
            served = ", ".join(f"`{name}`" for name in self.model_names)
            raise self.reject(
                404,
                f"The model `{model}` does not exist (this server serves {served})",
                "not_found_error",
                param="model",
                code="model_not_found",
            )

    def check(self, body, chat: bool) -> Asked:
        self.check_model(body.model)
        name = body.unsupported()
        if name is not None:
            raise self.reject(
                400, f"{name} is not supported by pagedkv", "invalid_request_error", param=name
            )
        vocab = self.engine.llm.config.vocab_size
        bias = tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items())
        if any(not 0 <= token < vocab for token, _ in bias):
            raise self.reject(
                400,
                f"logit_bias keys must be token ids in [0, {vocab})",
                "invalid_request_error",
                param="logit_bias",
            )
        if body.kv_transfer_params:
            from ..distributed.nixl_transfer import check_kv_transfer_params

            role = self.engine.kv_transfer.transfer_role if self.engine.kv_transfer else None
            problem = check_kv_transfer_params(body.kv_transfer_params, role, body.n)
            if problem is None and body.stream and body.kv_transfer_params.get("do_remote_decode"):
                problem = "do_remote_decode answers with kv_transfer_params: stream must be false"
            if problem is not None:
                raise self.reject(400, problem, "invalid_request_error", param="kv_transfer_params")
        if any(not 0 <= token < vocab for token in body.stop_token_ids or ()):
            raise self.reject(
                400,
                f"stop_token_ids must be token ids in [0, {vocab})",
                "invalid_request_error",
                param="stop_token_ids",
            )
        limit = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if limit is not None and body.min_tokens > limit:
            raise self.reject(
                400,
                f"min_tokens ({body.min_tokens}) is above max_tokens ({limit})",
                "invalid_request_error",
                param="min_tokens",
            )
        adjustments = LogitAdjustments(
            bias, body.presence_penalty, body.frequency_penalty, body.repetition_penalty
        )
        sampling = SamplingParams(
            body.temperature, body.top_p, body.seed, top_k=body.top_k, min_p=body.min_p
        )
        if chat:
            if body.top_logprobs is not None and not body.logprobs:
                raise self.reject(
                    400,
                    "top_logprobs needs logprobs: true",
                    "invalid_request_error",
                    param="top_logprobs",
                )
            top = (body.top_logprobs or 0) if body.logprobs else None
            return Asked(sampling, adjustments, top)
        if body.max_tokens == 0 and not body.echo:
            raise self.reject(
                400,
                "max_tokens may be 0 only with echo",
                "invalid_request_error",
                param="max_tokens",
            )
        prompt_top = body.logprobs if body.echo else None
        completion = body.max_tokens != 0
        return Asked(
            sampling,
            adjustments,
            body.logprobs,
            body.echo,
            prompt_top,
            completion,
        )

    async def grammar(self, body, chat: ChatPrompt | None = None) -> str | None:
        """The grammar of a request's output format (`structured.request_format`:
        one of OpenAI's, vLLM's or llama.cpp's fields; 400 naming the field
        where it has none or it cannot be followed), or of its tool calls.
        Checked off the event loop: the first check builds the grammar
        engine's tables (seconds for a large vocabulary), and a large schema
        takes a while to compile."""
        others = ("structured_outputs", "json_schema", "grammar")
        param = next((name for name in others if getattr(body, name)), "response_format")
        try:
            _, fmt = request_format(
                body.response_format, body.structured_outputs, body.json_schema, body.grammar
            )
            # Raises ValueError for a format that cannot be taken (beside
            # tools too): the field that names it is at fault.
            grammar = response_format_grammar(fmt) if chat is None else chat.grammar(fmt)
            if chat is not None and chat.tools.active:
                # A grammar the engine cannot follow: a tool's parameters
                # are the likelier culprit.
                param = "tools"
            grammars = self.engine.llm.grammars
            error = None if grammar is None else await asyncio.to_thread(grammars.error, grammar)
        except ValueError as e:
            grammar, error = None, str(e)
        if error is not None:
            raise self.reject(
                400,
                f"the output format cannot be followed: {error}",
                "invalid_request_error",
                param=param,
            )
        return grammar

    def submit_all(
        self, prompts: list[list[int]], max_tokens, body, asked, queue, loop
    ) -> list[str]:
        """Submits one engine request per prompt; returns their ids."""
        ids = []
        mailbox = self.mailbox(loop)
        try:
            for p, prompt in enumerate(prompts):
                room = self.engine.context - len(prompt)
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
                    frozenset(body.stop_token_ids or ()),
                    min(body.min_tokens, limit),
                    priority=body.priority,
                    logprobs=asked.logprobs,
                    prompt_logprobs=asked.prompt_logprobs,
                    adjustments=asked.adjustments,
                    grammar=asked.grammar,
                    kv_transfer=body.kv_transfer_params,
                )

                def sink(event, p=p):
                    mailbox.post(queue.put_nowait, (p, event))

                self.engine.submit(req, sink)
                ids.append(rid)
        except (RequestError, QueueFullError, RuntimeError) as e:
            for rid in ids:
                self.engine.cancel(rid)
            if isinstance(e, RequestError):
                raise self.reject(400, str(e), "invalid_request_error", param="messages") from None
            raise self.reject(
                503,
                f"the server is busy: {e}",
                "server_overloaded" if isinstance(e, QueueFullError) else "server_error",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from None
        return ids

    async def events(self, request: Request, queue: asyncio.Queue, ids: list[str], watch: bool):
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
                    self.engine.cancel(rid)

    async def serve(
        self,
        request: Request,
        body,
        prompts: list[list[int]],
        max_tokens,
        chat: ChatPrompt | None,
        texts=None,
    ):
        """Submits the prompts, then streams or gathers their choices;
        `chat`: the chat request rendered, whose answers are read as it says
        (None: completions); `texts`: the prompts as echo returns them
        (default: decoded)."""
        asked = replace(self.check(body, chat is not None), grammar=await self.grammar(body, chat))
        max_tokens = self.within_limits(prompts, max_tokens, chat is not None)
        await self.reach_prefill_peer(body)
        key = request.headers.get("authorization") or (
            request.client.host if request.client else ""
        )
        release = self.slots.take(key)
        if release is None:
            raise self.reject(
                429,
                f"{self.limits.max_streams_per_key} requests of this key are in flight already",
                "rate_limit_error",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        handed_off = False
        try:
            response = await self.answer(
                request, body, prompts, max_tokens, chat, texts, asked, release
            )
            handed_off = isinstance(response, StreamingResponse)
            return response
        finally:
            if not handed_off:
                release()

    async def reach_prefill_peer(self, body) -> None:
        """A request whose pages a prefill instance keeps: its metadata is
        fetched here, off the engine's thread (502 when it cannot be)."""
        params = body.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        problem = await asyncio.to_thread(self.engine.kv_transfer.prefetch, params)
        if problem is not None:
            raise self.reject(502, problem, "bad_gateway", param="kv_transfer_params")

    def within_limits(self, prompts: list[list[int]], max_tokens, chat: bool):
        """max_tokens as the limits allow it (400 beyond them)."""
        if self.limits.max_prompt_tokens is not None:
            longest = max(len(p) for p in prompts)
            if longest > self.limits.max_prompt_tokens:
                raise self.reject(
                    400,
                    f"the prompt has {longest} tokens; this server takes at most "
                    f"{self.limits.max_prompt_tokens}",
                    "invalid_request_error",
                    param="messages" if chat else "prompt",
                )
        if self.limits.max_tokens is None:
            return max_tokens
        if max_tokens is None:
            return self.limits.max_tokens
        if max_tokens > self.limits.max_tokens:
            raise self.reject(
                400,
                f"max_tokens is {max_tokens}; this server generates at most "
                f"{self.limits.max_tokens}",
                "invalid_request_error",
                param="max_tokens",
            )
        return max_tokens

    async def answer(self, request, body, prompts, max_tokens, chat, texts, asked, release):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        ids = self.submit_all(prompts, max_tokens, body, asked, queue, loop)
        is_chat = chat is not None
        prefix = "chatcmpl" if is_chat else "cmpl"
        response_id = f"{prefix}-{ids[0]}"
        common = {"id": response_id, "created": int(time.time()), "model": body.model}
        tokenizer = self.engine.tokenizer
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
                self.events(request, queue, ids, False),
                common,
                choices,
                is_chat,
                include_usage,
                release,
            )
            return StreamingResponse(
                stream, media_type="text/event-stream", background=BackgroundTask(release)
            )
        usage, kept = [0, 0, 0], None
        async for p, event in self.events(request, queue, ids, True):
            if isinstance(event, Done):
                usage = _add(usage, _counts(event, asked.completion))
                kept = event.kv_transfer_params or kept
            else:
                choices.on_event(p, event)
        answer = {
            **common,
            "object": "chat.completion" if is_chat else "text_completion",
            "choices": choices.answers(),
            "usage": _usage(*usage),
        }
        if kept is not None:
            answer["kv_transfer_params"] = kept
        return answer

    async def chat_completions(self, request: Request, body: ChatCompletionRequest):
        chat = self.chat_prompt(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self.serve(request, body, [chat.ids], max_tokens, chat=chat)

    def chat_prompt(self, body) -> ChatPrompt:
        """A chat request's messages, tools and template variables rendered
        (`models.chat.chat_prompt`); 400 naming the field at fault."""
        try:
            return chat_prompt(
                self.engine.tokenizer,
                [m.model_dump(exclude_none=True) for m in body.messages],
                body.tools,
                body.tool_choice,
                body.parallel_tool_calls,
                body.chat_template_kwargs,
                body.reasoning_format or self.engine.llm.reasoning_format,
            )
        except ValueError as e:
            param = e.param if isinstance(e, ChatRequestError) else "messages"
            raise self.reject(400, str(e), "invalid_request_error", param=param) from None

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """The token ids a prompt or a chat is served as: {"tokens", "count",
        "max_model_len"} (vLLM's answer; llama.cpp's `tokens` among it)."""
        self.check_model(body.model)
        texts = [t for t in (body.prompt, body.content) if t is not None]
        if len(texts) + (body.messages is not None) != 1:
            raise self.reject(
                400, "give one of prompt, content or messages", "invalid_request_error"
            )
        if body.messages is not None:
            tokens = self.chat_prompt(body).ids
        else:
            special = body.add_special_tokens
            if special is None:
                special = body.add_special if body.add_special is not None else True
            tokenizer = self.engine.tokenizer
            encode = tokenizer.prompt_ids if special else tokenizer.encode
            try:
                tokens = encode(texts[0])
            except ValueError as e:
                raise self.reject(400, str(e), "invalid_request_error", param="prompt") from None
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.context}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """The text of token ids: {"prompt"} (vLLM's) and {"content"} (llama.cpp's)."""
        self.check_model(body.model)
        vocab = self.engine.llm.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise self.reject(
                400, f"token ids must be in [0, {vocab})", "invalid_request_error", param="tokens"
            )
        text = self.engine.tokenizer.decode(body.tokens)
        return {"prompt": text, "content": text}

    async def completions(self, request: Request, body: CompletionRequest):
        texts = None
        try:
            if isinstance(body.prompt, str):
                texts = [body.prompt]
            elif all(isinstance(x, str) for x in body.prompt):
                texts = list(body.prompt)
            prompts = [self.engine.tokenizer.prompt_ids(t) for t in texts] if texts else []
        except ValueError as e:
            raise self.reject(400, str(e), "invalid_request_error", param="prompt") from None
        if texts is None:
            # Token ids: one list, or a list of lists (one prompt each).
            given = body.prompt if isinstance(body.prompt[0], list) else [body.prompt]
            vocab = self.engine.llm.config.vocab_size
            if any(not 0 <= x < vocab for ids in given for x in ids):
                raise self.reject(
                    400,
                    f"token ids must be in [0, {vocab})",
                    "invalid_request_error",
                    param="prompt",
                )
            prompts = [list(ids) for ids in given]
        if any(not p for p in prompts):
            raise self.reject(400, "the prompt is empty", "invalid_request_error", param="prompt")
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        return await self.serve(request, body, prompts, max_tokens, chat=None, texts=texts)


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
