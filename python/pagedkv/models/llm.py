"""A real model served from pagedkv's paged cache: `load(name)` and
`LLM.generate(prompts)`.

`load` fetches the model's GGUF on first use (fetch.py), reads its weights
and tokenizer (gguf_model.py, tokenizer.py), allocates one page pool per
layer in a `PagedKVCacheManager` and compiles the prefill and decode step
graphs once per process (MAX keeps the compile on disk for later
processes). `generate` serves every prompt together: continuous batching,
the prefix cache (chat prompts share their system prompt's pages), greedy or
seeded temperature / top-p sampling, stopping after EOS.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from pagedkv._checks import check_int
from pagedkv._ops.contract import pool_row_width
from pagedkv._ops.kernels import build_kernel_package_in_background
from pagedkv._ops.quantized_panels import PACKED_AS
from pagedkv._plan.work import as_dtype
from pagedkv.cache.manager import PagedKVCacheManager
from pagedkv.graphs.engine import DecoderEngine, page_manager_for
from pagedkv.graphs.model import DecoderConfig
from pagedkv.graphs.sampling import SamplingParams
from pagedkv.graphs.scheduler import Request, RunStats, Scheduler
from pagedkv.graphs.scheduler import Sequence as GeneratedSequence
from pagedkv.graphs.structured import Grammars, response_format_grammar

from .catalog import DEFAULT_MODEL, model_spec
from .chat import ChatDelta, ChatPrompt, ChatStream, chat_prompt
from .errors import ChatRequestError, ModelError
from .fetch import fetch_gguf
from .forms import check_forms, default_weights
from .gguf_model import GGUFModel
from .reasoning import FORMATS as REASONING_FORMATS
from .tokenizer import TEMPLATE_VARIABLES, ChatTokenizer, TextStream
from .tool_calls import ToolCall
from .unpacked import read_unpacked

DEFAULT_KV_MEMORY = 512 << 20
"""Bytes of KV cache (all layers) `load` allocates unless told otherwise."""


@dataclass
class Completion:
    """One prompt's answer."""

    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    """The generated ids only, up to and including a stop token (EOS)."""
    text: str
    """The generated text, special tokens left out."""
    finish_reason: str
    """"stop" (EOS), "length" (max_new_tokens), "tool_calls" or "error"."""
    error: str | None = None
    """Why the prompt was not served (finish_reason "error")."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """`LLM.chat`: the tools the answer calls (finish_reason "tool_calls")."""
    reasoning_content: str | None = None
    """`LLM.chat` of a reasoning model: its `<think>` block, apart from `text`."""

    def as_json(self) -> dict:
        """The `pagedkv generate --json` record of this completion."""
        record = {
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
        }
        if self.error is not None:
            record["error"] = self.error
        if self.tool_calls:
            record["tool_calls"] = [call.as_openai() for call in self.tool_calls]
        if self.reasoning_content is not None:
            record["reasoning_content"] = self.reasoning_content
        return record


class LLM:
    """A loaded model: its tokenizer, page manager and compiled step graphs.

    Attributes:
        name: the catalogue name.
        config: the model's shape (`pagedkv.graphs.model.DecoderConfig`).
        weights: float32 weights by name (as the step graphs name them).
        quantized: the packed GGUF matrices the step graphs multiply
            (weights="gguf"), or None.
        tokenizer: `ChatTokenizer` (encode, decode, chat template).
        manager: the `PagedKVCacheManager` owning one pool per layer.
        engine: the `DecoderEngine` running prefill and decode steps.
        stats: the `RunStats` of the last `generate` call.
        model_id: what computes the KV pages (name, weights form, GGUF
            file): instances share cached pages only when theirs agree.
        reasoning_format: how a chat answer's `<think>` block comes back
            where a request does not say ("auto": apart; "none": in the
            content).
    """

    def __init__(
        self,
        name: str,
        model: GGUFModel,
        manager: PagedKVCacheManager,
        quantized: bool = False,
        batch_invariant: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        reasoning_format: str = "auto",
    ) -> None:
        self.name = name
        self.reasoning_format = reasoning_format
        self.config: DecoderConfig = model.config
        self.weights = model.weights
        self.quantized = model.quantized if quantized else None
        self.tokenizer = ChatTokenizer.from_gguf_metadata(model.metadata)
        if chat_template is not None:
            self.tokenizer = replace(self.tokenizer, chat_template=chat_template)
        if chat_template_kwargs:
            self.tokenizer = replace(self.tokenizer, template_defaults=dict(chat_template_kwargs))
        self.grammars = Grammars(
            self.tokenizer.tokenizer, model.config.vocab_size, self.tokenizer.stop_ids
        )
        self.manager = manager
        t0 = time.perf_counter()
        self.engine = DecoderEngine(
            model.config, model.weights, manager, self.quantized, batch_invariant
        )
        self.compile_seconds = time.perf_counter() - t0
        self.stats: RunStats | None = None
        self.model_id = name
        self._next_id = 0

    def prompt_ids(
        self, prompt: str, chat: bool = True, system_prompt: str | None = None
    ) -> list[int]:
        """The token ids a prompt is served as: the chat template applied to
        one user turn (after `system_prompt` when given), or the raw text."""
        if not chat:
            return self.tokenizer.prompt_ids(prompt)
        return self.tokenizer.chat_prompt(prompt, system_prompt)

    def generate(
        self,
        prompts: Sequence[str],
        max_new_tokens: int = 64,
        chat: bool = True,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        system_prompt: str | None = None,
        on_text: Callable[[int, str, bool], None] | None = None,
        top_k: int = 0,
        min_p: float = 0.0,
        response_format: Mapping | None = None,
    ) -> list[Completion]:
        """Serves every prompt together and returns their completions in order.

        Parameters
        ----------
        prompts : list of str
            The user's messages (chat=True) or raw texts (chat=False).
        max_new_tokens : int
            At most this many generated tokens per prompt (EOS ends sooner).
        chat : bool
            Apply the model's chat template (its default system prompt unless
            `system_prompt` is given).
        temperature, top_p, seed : float, float, int or None
            Greedy when temperature is 0 (the default); otherwise sampling
            with nucleus `top_p`, reproducible for a given `seed`.
        top_k, min_p : int, float
            Sampling keeps the top_k most likely tokens (0: all) and those at
            least min_p times as likely as the most likely
            (pagedkv.graphs.sampling.SamplingParams).
        on_text : callable(index, text, finished), optional
            Called with each prompt's newly decoded text as tokens arrive
            (streaming; text is held back while it ends inside a UTF-8
            character), and with finished=True once for each prompt when it
            ends (at once for a prompt that cannot be served).
        response_format : dict, optional
            OpenAI's: {"type": "json_object"} (any JSON object) or
            {"type": "json_schema", "json_schema": {"schema": {...}}}: every
            answer's text follows it (pagedkv.graphs.structured); a schema
            that cannot be followed raises ValueError.

        Returns
        -------
        list of Completion
            One per prompt. A prompt that cannot be served (longer than the
            context, larger than the pool) gets finish_reason "error" and a
            message; the others are served.

        Examples
        --------
        >>> import pagedkv.models
        >>> llm = pagedkv.models.load("smollm2-135m-instruct", weights="f32")
        >>> llm.generate(["What is the capital of France?"], max_new_tokens=16)[0].text
        'The capital of France is Paris.'
        """
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings, not one string")
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise TypeError(f"prompts[{i}] must be a string, got {type(prompt).__name__}")
        grammar = self._format_grammar(response_format)
        ids = [self.prompt_ids(p, chat, system_prompt) for p in prompts]
        sampling = SamplingParams(temperature, top_p, seed, top_k=top_k, min_p=min_p)
        sequences = self._run(ids, max_new_tokens, sampling, grammar, on_text)
        return [
            Completion(
                prompt=p,
                prompt_token_ids=list(pi),
                token_ids=list(s.tokens),
                text=self.tokenizer.decode(s.tokens),
                finish_reason=s.finish_reason or "length",
                error=s.error,
            )
            for p, pi, s in zip(prompts, ids, sequences, strict=True)
        ]

    def chat(
        self,
        conversations: Sequence[Sequence[Mapping]],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        top_k: int = 0,
        min_p: float = 0.0,
        response_format: Mapping | None = None,
        tools: Sequence[Mapping] | None = None,
        tool_choice: str | Mapping | None = None,
        parallel_tool_calls: bool = True,
        chat_template_kwargs: Mapping | None = None,
        reasoning_format: str | None = None,
        on_delta: Callable[[int, ChatDelta, bool], None] | None = None,
    ) -> list[Completion]:
        """Answers every conversation together, as `generate` answers prompts.

        Parameters
        ----------
        conversations : list of list of dict
            Each one OpenAI's chat messages ({"role": "system" | "user" |
            "assistant" | "tool", "content": ...}; an assistant's earlier
            `tool_calls`, a tool result's `tool_call_id`), rendered by the
            model's chat template.
        max_new_tokens, temperature, top_p, seed, top_k, min_p, response_format
            As `generate`'s.
        tools, tool_choice, parallel_tool_calls
            OpenAI's: the functions the answers may call, "none", "auto"
            (the default with tools), "required" or {"type": "function",
            "function": {"name": ...}}, and whether an answer may hold more
            than one call (pagedkv.models.tool_calls; not with
            response_format).
        chat_template_kwargs : dict, optional
            More variables for the chat template (Qwen 3's
            {"enable_thinking": False}).
        reasoning_format : str, optional
            "auto": a reasoning model's `<think>` block goes to
            `reasoning_content`, apart from `text` (pagedkv.models.reasoning);
            "none": it stays in `text`; None: the model's default
            (`load(reasoning_format=...)`, "auto" unless told).
        on_delta : callable(index, delta, finished), optional
            Streaming: called with each conversation's `ChatDelta` as its
            answer grows (its content, its reasoning, and its tool calls as
            OpenAI streams them: index, id and name once a call begins, then
            the arguments' pieces), and with finished=True once for each
            conversation when it ends (at once for one that cannot be
            served). The completions' calls keep the ids streamed.

        Returns
        -------
        list of Completion
            One per conversation; an answer that calls tools has them in
            `tool_calls`, its other text in `text`, and finish_reason
            "tool_calls".

        Raises
        ------
        ValueError
            Malformed messages or tools (`errors.ChatRequestError`), or a
            format or tool schema that cannot be followed.

        Examples
        --------
        >>> import pagedkv.models
        >>> llm = pagedkv.models.load("smollm2-135m-instruct", weights="f32")
        >>> weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        ...     "type": "object", "properties": {"city": {"type": "string"}},
        ...     "required": ["city"], "additionalProperties": False}}}
        >>> answer = llm.chat([[{"role": "user", "content": "Weather in Paris?"}]], tools=[weather],
        ...                   tool_choice="required", parallel_tool_calls=False)[0]
        >>> answer.finish_reason, answer.tool_calls[0].arguments
        ('tool_calls', '{"city": "Paris"}')
        """
        if isinstance(conversations, Mapping) or not all(
            isinstance(c, Sequence) and not isinstance(c, str) for c in conversations
        ):
            raise TypeError("conversations must be a list of message lists")
        if on_delta is not None and not callable(on_delta):
            raise TypeError("on_delta must be a callable (index, delta, finished)")
        reasoning_format = reasoning_format or self.reasoning_format
        fields = (tools, tool_choice, parallel_tool_calls, chat_template_kwargs, reasoning_format)
        prompts = [chat_prompt(self.tokenizer, c, *fields) for c in conversations]
        grammar = self._chat_grammar(prompts[0], response_format) if prompts else None
        sampling = SamplingParams(temperature, top_p, seed, top_k=top_k, min_p=min_p)
        streams = [p.stream() for p in prompts] if on_delta is not None else None
        on_text = None if streams is None else _chat_deltas(streams, on_delta)
        sequences = self._run([p.ids for p in prompts], max_new_tokens, sampling, grammar, on_text)
        return [
            self._chat_completion(p, s, streams[i] if streams is not None else None)
            for i, (p, s) in enumerate(zip(prompts, sequences, strict=True))
        ]

    def _chat_completion(
        self, prompt: ChatPrompt, s: GeneratedSequence, stream: ChatStream | None
    ) -> Completion:
        """A chat answer read as its request says (reasoning, tool calls);
        its calls under the ids `stream` gave them, where it streamed."""
        answer = prompt.read(self.tokenizer.decode(s.tokens))
        calls = stream.tool_calls if stream is not None else answer.tool_calls
        reason = "tool_calls" if calls else s.finish_reason or "length"
        return Completion(
            prompt.text,
            prompt.ids,
            list(s.tokens),
            answer.content or "",
            reason,
            s.error,
            calls,
            answer.reasoning,
        )

    def _chat_grammar(self, prompt: ChatPrompt, response_format: Mapping | None) -> str | None:
        """The grammar of a chat's answers (`ChatPrompt.grammar`); raises
        ChatRequestError naming the field at fault where it cannot be
        followed (the tools where they are offered)."""
        try:
            grammar = prompt.grammar(response_format)
        except ChatRequestError:
            raise
        except ValueError as e:
            raise ChatRequestError("response_format", str(e)) from None
        if grammar is not None and (error := self.grammars.error(grammar)) is not None:
            param = "tools" if prompt.tools.active else "response_format"
            raise ChatRequestError(param, f"the answer's grammar cannot be followed: {error}")
        return grammar

    def _format_grammar(self, response_format: Mapping | None) -> str | None:
        """The grammar of `response_format` (None for free text); raises
        ValueError where it cannot be followed."""
        grammar = response_format_grammar(response_format)
        if grammar is not None and (error := self.grammars.error(grammar)) is not None:
            raise ValueError(f"the response format cannot be followed: {error}")
        return grammar

    def _run(
        self,
        ids: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingParams,
        grammar: str | None,
        on_text: Callable[[int, str, bool], None] | None,
    ) -> list[GeneratedSequence]:
        """Serves the prompts `ids` together (one scheduler run); returns
        their sequences in order."""
        check_int("max_new_tokens", max_new_tokens, 1)
        stop = self.tokenizer.stop_ids
        requests = []
        for prompt_ids in ids:
            requests.append(
                Request(
                    f"gen{self._next_id}",
                    tuple(prompt_ids),
                    max_new_tokens,
                    sampling=sampling,
                    stop_token_ids=stop,
                    grammar=grammar,
                )
            )
            self._next_id += 1
        index = {r.request_id: i for i, r in enumerate(requests)}
        streams = [TextStream(self.tokenizer) for _ in requests]

        def on_token(s: GeneratedSequence, token: int) -> None:
            i = index[s.request.request_id]
            text = streams[i].push(token)
            if on_text is not None and (text or s.done):
                on_text(i, text, s.done)

        scheduler = Scheduler(
            self.engine, max_num_seqs=max(len(requests), 1), grammars=self.grammars
        )
        if on_text is not None:
            for i, r in enumerate(requests):
                if scheduler.rejection(scheduler.capped(r)) is not None:
                    on_text(i, "", True)
        sequences, self.stats = scheduler.run(requests, on_token=on_token)
        return sequences


def _chat_deltas(
    streams: list[ChatStream], on_delta: Callable[[int, ChatDelta, bool], None]
) -> Callable[[int, str, bool], None]:
    """The `on_text` that reads each answer's text through its stream and
    calls on_delta with what it adds (once with finished=True at its end)."""

    def on_text(i: int, text: str, finished: bool) -> None:
        delta = streams[i].push(text)
        if finished:
            delta = delta.then(streams[i].finish())
        if delta or finished:
            on_delta(i, delta, finished)

    return on_text


def _check_load(
    weights: str | None,
    kv_dtype: str | None,
    device: str,
    page_size: int,
    chat_template_kwargs: Mapping[str, object] | None,
    reasoning_format: str,
) -> None:
    """Raises ModelError for `load` arguments it cannot serve, before any
    file is read."""
    if reasoning_format not in REASONING_FORMATS:
        raise ModelError(f"reasoning_format must be one of {REASONING_FORMATS}")
    if any(not isinstance(k, str) or k in TEMPLATE_VARIABLES for k in chat_template_kwargs or {}):
        raise ModelError(f"chat_template_kwargs may not name {sorted(TEMPLATE_VARIABLES)}")
    if device not in ("cpu", "gpu"):
        raise ModelError(f"device must be cpu or gpu, got {device!r}")
    check_forms(weights or default_weights(device), kv_dtype, device)
    if page_size < 1:
        raise ModelError(f"page_size must be at least 1, got {page_size}")


@functools.lru_cache(maxsize=1)
def _read(path: Path) -> GGUFModel:
    """The GGUF's contents (from its unpacked copy), kept for the process:
    loading the same model again reuses its weights and so its compiled
    step graphs."""
    return read_unpacked(path)


def _manager(
    c: DecoderConfig, kv_memory: int, page_size: int, kv_dtype: str, device: str
) -> PagedKVCacheManager:
    """The page manager of a model: one pool per layer, in the model's layer
    groups (a sliding-window group gives back the pages its window has
    passed), `kv_memory` bytes over every layer.

    Every group gets as many pages: a sequence never holds more pages in a
    window group than in a global one, so admission by the global group's
    free pages never runs a window group dry."""
    dtype = as_dtype(kv_dtype, "kv_dtype")
    row_bytes = pool_row_width(dtype, c.head_dim) * dtype.size_in_bytes
    page_bytes = 2 * page_size * c.num_kv_heads * row_bytes * c.num_layers
    num_pages = kv_memory // page_bytes
    if num_pages < 1:
        raise ModelError(f"kv_memory {kv_memory} bytes holds no page of {page_bytes} bytes")
    return page_manager_for(c, int(num_pages), page_size, kv_dtype, device)


def load(
    name: str = DEFAULT_MODEL,
    weights: str | None = None,
    kv_dtype: str | None = None,
    device: str = "cpu",
    page_size: int = 16,
    kv_memory: int = DEFAULT_KV_MEMORY,
    gguf: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    batch_invariant: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, object] | None = None,
    reasoning_format: str = "auto",
) -> LLM:
    """Loads model `name` to serve from a paged cache.

    Parameters
    ----------
    name : str
        A name from `pagedkv.models.MODELS` (default "smollm2-135m-instruct").
    weights : str, optional
        "gguf": the GGUF's own quantized blocks, multiplied in place (CPU;
        the default there); "f32" or "bf16": dequantized, with activations
        in the same dtype ("f32" is the default on a GPU). See `WEIGHTS`.
    kv_dtype : str, optional
        The KV cache's dtype (`KV_DTYPES`; the 8-bit caches' accuracy in
        docs/performance.md): any with "gguf" weights (default "int8": a
        byte per element, a float32 scale per token and head); the
        weights' dtype otherwise.
    device : str
        "cpu", or "gpu" (pools are torch CUDA tensors; needs a GPU).
    page_size, kv_memory : int
        Tokens per page; bytes of KV cache over all layers (the page count).
    gguf : path, optional
        Read the weights from this file instead of the cache directory.
    progress : callable(str), optional
        Receives one-line progress messages (fetching, compiling).
    batch_invariant : bool
        A request's logits are bitwise the same whatever else runs in its
        batch and on however many cores. Off by default: decode then reads a
        prefix that requests share once for all (costs: docs/performance.md).
    chat_template : str, optional
        A Jinja chat template in place of the GGUF's own (one that renders tools, say).
    chat_template_kwargs : dict, optional
        Variables the chat template gets unless a request gives its own
        (Qwen 3's {"enable_thinking": False} for every chat).
    reasoning_format : str
        A reasoning model's `<think>` block where a chat does not say:
        "auto" (apart, as `reasoning_content`) or "none" (in the content).

    Returns
    -------
    LLM

    Raises
    ------
    ModelError
        Unknown name, failed fetch, unreadable GGUF, bad weights, kv_dtype,
        device or reasoning_format.
    """
    spec = model_spec(name)
    _check_load(weights, kv_dtype, device, page_size, chat_template_kwargs, reasoning_format)
    say = progress or (lambda line: None)
    build_kernel_package_in_background()  # overlaps reading the model
    path = Path(gguf) if gguf is not None else fetch_gguf(spec.name, progress=progress)
    if not path.is_file():
        raise ModelError(f"no GGUF file at {path}")
    model = _read(path.resolve())
    if weights is None:
        # A model with no product in a format the quantized product takes
        # is served from its float32 weights by default.
        weights = default_weights(device) if model.quantized else "f32"
    kv_dtype = check_forms(weights, kv_dtype, device)
    if weights == "gguf" and not model.quantized:
        raise ModelError(
            f"{path.name} ({model.config.family}) holds matrices the quantized product does not "
            f"take (it multiplies {', '.join(PACKED_AS)}); use "
            "weights='f32' or 'bf16'"
        )
    c = model.config
    manager = _manager(c, kv_memory, page_size, kv_dtype, device)
    say(
        "compiling the prefill and decode graphs of "
        f"{spec.title if gguf is None else path.name} ({c.num_layers} layers, "
        f"{weights} weights, {kv_dtype} cache) ..."
    )
    llm = LLM(
        spec.name,
        model,
        manager,
        weights == "gguf",
        batch_invariant,
        chat_template,
        chat_template_kwargs,
        reasoning_format,
    )
    llm.model_id = f"{spec.name}|{weights}|{path.name}"
    say(f"compiled in {llm.compile_seconds:.1f} s (MAX caches it on disk)")
    return llm
