"""OpenAI's request bodies for /v1/completions and /v1/chat/completions, as
pydantic models: what the server accepts, checks and refuses.

Fields pagedkv does not implement (the deprecated `functions` and
`function_call`) are refused with a 400 naming them rather than silently
ignored; fields that change nothing here (user, ...) are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4
MAX_N = 16
MAX_LOGPROBS = 20
"""Most likely tokens a response lists beside each chosen one (OpenAI's
chat limit; its completions limit is 5, vLLM's 20)."""

UNSUPPORTED = ("functions", "function_call")
"""Fields refused when given a value that asks for something (not null / false / 0)."""


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    """vLLM's and llama.cpp's extension: sample from the k most likely
    tokens only (0 or -1: all)."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    """vLLM's and llama.cpp's extension: drop the tokens less likely than
    min_p times the most likely."""
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    """Token id (as a string) -> bias in [-100, 100], added to the logit
    before a token is chosen (OpenAI's)."""
    ignore_eos: bool = False
    """vLLM's and llama.cpp's extension: EOS does not end a sample (max_tokens
    or a stop string does)."""
    stop_token_ids: list[int] | None = None
    """vLLM's: tokens that end a sample besides EOS (left in its token ids,
    out of its text as EOS is)."""
    min_tokens: int = Field(default=0, ge=0)
    """vLLM's: tokens a sample generates before EOS or a stop token may end
    it."""
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    """vLLM's: a token seen in the prompt or the sample has its logit divided
    by this where positive, multiplied where not (1: off)."""
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    """vLLM's extension: under `--scheduling-policy priority`, lower values
    are admitted first (ignored under fcfs)."""
    response_format: dict[str, Any] | None = None
    """OpenAI's structured outputs: {"type": "text"}, {"type":
    "json_object"} or {"type": "json_schema", "json_schema": {"schema":
    ...}}; pagedkv's {"type": "regex", "regex": ...}, {"type": "choice",
    "choice": [...]} and {"type": "grammar", "grammar": GBNF}
    (pagedkv.graphs.structured). At most one of this, `structured_outputs`,
    `json_schema` and `grammar`."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's: {"json": schema}, {"regex": ...}, {"choice": [...]} or
    {"json_object": true}."""
    json_schema: dict[str, Any] | None = None
    """llama.cpp's: the schema the answer follows."""
    grammar: str | None = None
    """llama.cpp's: a GBNF grammar the answer follows."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's disaggregation handshake: keep this prompt's pages for a
    decode instance (`do_remote_decode`), or read them from the prefill
    instance named (`do_remote_prefill`); needs `serve --role`."""

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values are in [-100, 100], got {bias}")
        return value

    def unsupported(self) -> str | None:
        """The first field given that pagedkv does not implement, or None."""
        extra = self.model_extra or {}
        for name in UNSUPPORTED:
            value = extra.get(name, getattr(self, name, None))
            if value not in (None, False, 0, [], {}):
                return name
        return None


class CompletionRequest(_Common):
    """POST /v1/completions: `prompt` is a string, a list of strings (each its
    own choices), a list of token ids, or a list of such lists (each its own
    choices: what lm-eval's local-completions sends). max_tokens defaults to
    16 (as OpenAI's)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)
    """0 only with echo: the prompt's logprobs, no completion."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """Each token's logprob with this many of the most likely."""
    echo: bool = False
    """The prompt comes back before the completion (with its logprobs when
    `logprobs` is given): how evaluation harnesses score continuations."""

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        if isinstance(value, list) and any(isinstance(x, list) and not x for x in value):
            raise ValueError("prompt must not hold an empty list of token ids")
        return value


class ChatMessage(BaseModel):
    """One message; what its fields must hold together (content, tool
    calls, the call a tool message answers) is checked where it becomes the
    prompt (`pagedkv.models.tool_calls.chat_messages`)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    """None only for an assistant's message that holds `tool_calls`."""
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant's earlier calls (OpenAI's shape, arguments a JSON string)."""
    tool_call_id: str | None = None
    """A tool message's answer to this call."""


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions: the model's chat template over `messages`
    (with its default system prompt unless one is given). max_tokens
    (or max_completion_tokens) defaults to the rest of the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    """OpenAI's functions the model may call (pagedkv.models.tool_calls)."""
    tool_choice: str | dict[str, Any] | None = None
    """"none", "auto" (the default with tools), "required", or one named
    function."""
    parallel_tool_calls: bool = True
    """Whether one answer may call more than one function."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's and llama.cpp's: more variables for the chat template (Qwen
    3's {"enable_thinking": false})."""
    reasoning_format: Literal["auto", "none"] | None = None
    """llama.cpp's: "auto" returns a reasoning model's `<think>` block as
    `reasoning_content`, apart from the content; "none" leaves it in; the
    server's `--reasoning-format` where not given."""
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class ResponsesRequest(BaseModel):
    """POST /v1/responses (OpenAI's Responses API): `input` a
    string or items (messages, function calls and their outputs), flat
    function `tools`, `text.format` for structured outputs
    (pagedkv.serve.responses). vLLM's extensions (seed, top_k, min_p,
    penalties, min_tokens, stop_token_ids, ignore_eos, chat_template_kwargs,
    reasoning_format, structured_outputs) are passed on."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    """{"format": {"type": "text" | "json_object" | "json_schema", ...}}."""
    stream: bool = False
    metadata: dict[str, str] | None = None
    store: bool | None = None
    """False: the response is not kept (kept by default, in the server's
    memory: pagedkv.serve.response_store)."""
    previous_response_id: str | None = None
    """A stored response this one continues."""


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's; llama.cpp's `content` and `add_special`
    taken too): one of `prompt` (a text) or `messages` (a chat, rendered
    with its tools and template variables as /v1/chat/completions would)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    """llama.cpp's name for `prompt`."""
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """A prompt's BOS where the model's prompts start with one (default true)."""
    add_special: bool | None = None
    """llama.cpp's name for `add_special_tokens`."""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_format: Literal["auto", "none"] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's and llama.cpp's): token ids to text."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None):
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
