"""A chat request as the model sees it: OpenAI's messages (and tools)
rendered by the chat template into the prompt, and the answer read back
the same way for `LLM.chat` and the server, whole (`ChatPrompt.read`) or as
it streams (`ChatStream`): a reasoning block apart
(pagedkv.models.reasoning), then the tool calls (pagedkv.models.tool_calls),
then the content.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagedkv.graphs.structured import after_reasoning, response_format_grammar

from .errors import ChatRequestError
from .reasoning import FORMATS as REASONING_FORMATS
from .reasoning import (
    ReasoningStream,
    prompt_opens_reasoning,
    split_reasoning,
    template_reasons,
)
from .tokenizer import ChatTokenizer
from .tool_call_stream import ToolCallStream
from .tool_calls import ToolCall, ToolUse, tool_use


@dataclass(frozen=True)
class ChatAnswer:
    """An answer's text read back: the content (None where the answer only
    calls tools), the reasoning block (None where it does not reason) and
    the calls."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ChatDelta:
    """What a streamed answer adds: content, reasoning (a `<think>` block's
    text) and tool-call deltas (OpenAI's `delta.tool_calls` entries: a
    call's index, id and name when it begins, then its arguments' pieces)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def then(self, later: ChatDelta) -> ChatDelta:
        """This delta followed by a later one, as one."""
        return ChatDelta(
            self.content + later.content,
            self.reasoning + later.reasoning,
            self.tool_calls + later.tool_calls,
        )


@dataclass(frozen=True)
class ChatPrompt:
    """One chat request rendered.

    Args:
        text: the prompt as the chat template wrote it.
        ids: its token ids (after BOS where the model's prompts take one).
        tools: what the answer may call (inactive without tools).
        reasoning: None where the template does not reason; "may" where
            the answer may open a `<think>` block; "opened" where the
            prompt opened it (the answer starts inside it).
        split: whether the block is read apart from the content
            (reasoning_format "auto").
    """

    text: str
    ids: list[int]
    tools: ToolUse
    reasoning: str | None = None
    split: bool = True

    @property
    def reasoning_opened(self) -> bool | None:
        """None where answers are not split into reasoning and content;
        else whether the prompt opened the `<think>` block."""
        if self.reasoning is None or not self.split:
            return None
        return self.reasoning == "opened"

    def grammar(self, response_format: Mapping | None) -> str | None:
        """The answer's grammar: the tool calls' where tools may be called
        (the content of an answer that calls none in `response_format`,
        `ToolUse.grammar`), else the format's (`response_format_grammar`);
        after a reasoning block where the model reasons
        (`structured.after_reasoning`), so that a grammar does not stop it
        thinking. Raises ValueError (a ChatRequestError naming
        response_format where the tool format cannot hold the format) for a
        format that cannot be followed."""
        if self.tools.active:
            grammar = self.tools.grammar(response_format)
        else:
            grammar = response_format_grammar(response_format)
        if grammar is None or self.reasoning is None:
            return grammar
        return after_reasoning(grammar, opened=self.reasoning == "opened")

    def read(self, answer: str) -> ChatAnswer:
        """The whole answer's text read back."""
        reasoning = None
        if self.reasoning_opened is not None:
            reasoning, answer = split_reasoning(answer, self.reasoning_opened)
        content, calls = self.tools.read(answer)
        return ChatAnswer(content, reasoning, calls)

    def stream(self) -> ChatStream:
        """A reader of the answer as it streams (`ChatStream`)."""
        return ChatStream(self)


class ChatStream:
    """An answer read as it streams, as `ChatPrompt.read` reads the whole
    one: `push` each piece of text, then `finish` once at the end; each
    returns the `ChatDelta` that can go out. Text that may be a tag (of a
    reasoning block or a call) is held back until it is known.

    Examples
    --------
    >>> from pagedkv.models.tool_calls import ToolUse
    >>> stream = ChatPrompt("", [], ToolUse((), "none"), reasoning="may").stream()
    >>> stream.push("<think>Paris.</think>It is ")
    ChatDelta(content='It is ', reasoning='Paris.', tool_calls=[])
    >>> stream.push("Paris.").content, stream.finish()
    ('Paris.', ChatDelta(content='', reasoning='', tool_calls=[]))
    """

    def __init__(self, prompt: ChatPrompt) -> None:
        opened = prompt.reasoning_opened
        self.reasoning = None if opened is None else ReasoningStream(opened)
        self.calls = ToolCallStream(prompt.tools) if prompt.tools.active else None

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The answer's calls, under the ids their deltas gave them (known
        once `finish` has run)."""
        return [] if self.calls is None else self.calls.calls

    def push(self, piece: str) -> ChatDelta:
        """Takes the next text; returns what can go out now."""
        reasoning = ""
        if self.reasoning is not None:
            reasoning, piece = self.reasoning.push(piece)
        calls: list[dict] = []
        if self.calls is not None:
            piece, calls = self.calls.push(piece)
        return ChatDelta(piece, reasoning, calls)

    def finish(self) -> ChatDelta:
        """What was held back, once the answer is whole."""
        reasoning = content = ""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
        delta = ChatDelta(reasoning=reasoning)
        if self.calls is not None:
            content, calls = self.calls.push(content) if content else ("", [])
            rest, more = self.calls.finish()
            return delta.then(ChatDelta(content + rest, "", calls + more))
        return delta.then(ChatDelta(content))


def chat_prompt(
    tokenizer: ChatTokenizer,
    messages: object,
    tools: object = None,
    tool_choice: object = None,
    parallel_tool_calls: bool = True,
    template_kwargs: Mapping[str, object] | None = None,
    reasoning_format: str = "auto",
) -> ChatPrompt:
    """A chat request (OpenAI's fields) rendered by the model's template.
    Raises ChatRequestError naming the field at fault (messages, tools,
    tool_choice, reasoning_format), or ValueError where the template
    refuses the messages.

    Examples
    --------
    >>> from pagedkv.models.tokenizer import load_tokenizer
    >>> prompt = chat_prompt(load_tokenizer("smollm2-135m-instruct"),
    ...                      [{"role": "user", "content": "Hi"}])
    >>> prompt.text.endswith("<|im_start|>assistant\\n"), prompt.read("Hello!").content
    (True, 'Hello!')
    """
    if reasoning_format not in REASONING_FORMATS:
        raise ChatRequestError(
            "reasoning_format", f"reasoning_format must be one of {REASONING_FORMATS}"
        )
    template = tokenizer.chat_template
    use = tool_use(tools, tool_choice, parallel_tool_calls, template)
    rendered = use.prompt_messages(chat_messages(messages))
    text = tokenizer.render_chat(
        rendered, tools=use.template_tools(), template_kwargs=template_kwargs
    )
    reasoning = None
    if template_reasons(template):
        reasoning = "opened" if prompt_opens_reasoning(text) else "may"
    ids = tokenizer.prompt_ids(text)
    return ChatPrompt(text, ids, use, reasoning, split=reasoning_format == "auto")


ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(messages: object) -> list[dict]:
    """OpenAI's chat messages as chat templates take them: content as one
    string (a list of text parts joined), the developer role as the
    system's, an assistant's `tool_calls` and `reasoning_content` and a
    tool's `tool_call_id` kept.
    Raises ChatRequestError (param "messages") for anything else."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ChatRequestError("messages", "messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, Mapping) else None
        if role not in ROLES:
            raise ChatRequestError("messages", f"messages[{i}]'s role must be one of {ROLES}")
        calls, call_id = m.get("tool_calls"), m.get("tool_call_id")
        if calls and (role != "assistant" or not isinstance(calls, list)):
            raise ChatRequestError("messages", f"messages[{i}]: tool_calls is an assistant's list")
        if role == "tool" and not isinstance(call_id, str):
            raise ChatRequestError("messages", f"messages[{i}]: a tool message needs tool_call_id")
        message = {"role": "system" if role == "developer" else role}
        message["content"] = _text(m.get("content"), i, may_lack=bool(calls))
        if calls:
            message["tool_calls"] = calls
        if role == "tool":
            message["tool_call_id"] = call_id
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            message["reasoning_content"] = m["reasoning_content"]  # Qwen 3's template reads it
        out.append(message)
    return out


def _text(content: object, i: int, may_lack: bool) -> str:
    if content is None and may_lack:
        return ""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else None
    if parts is None or not all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in parts
    ):
        raise ChatRequestError(
            "messages", f"messages[{i}]'s content must be text (a string or text parts)"
        )
    return "".join(p["text"] for p in parts)
