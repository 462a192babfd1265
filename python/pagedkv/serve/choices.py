"""The choices of one API response, built from its engine requests' events:
text, logprobs and finish reason per choice, as whole answers and as the
streamed chunks' choice objects.

Choice `index` = prompt `p` x n + sample; every choice of prompt p shares
its prompt (echo) and its prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.graphs.scheduler import Delta, PromptLogprobs
from pagedkv.models.chat import ChatDelta, ChatPrompt, ChatStream

from .logprobs import CompletionLogprobs, TokenText, chat_entries


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    chat_logprobs: list[dict] = field(default_factory=list)
    completion_logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    started: bool = False
    """Streamed: whether its first chunk went out (the role, or echo's prompt)."""
    answer: ChatStream | None = None
    """Chat: the answer read as it streams (reasoning, calls, content)."""


class Choices:
    """Builds the choices of one response.

    Parameters
    ----------
    chat : ChatPrompt or None
        Chat's shapes (message / delta, logprobs.content), each answer read
        as the rendered chat request says (reasoning, tool calls), or (None)
        completions'.
    n : int
        Samples per prompt.
    prompts : list of (text, token ids)
        Each prompt as echo returns it.
    logprobs : bool
        Whether choices carry logprobs.
    echo : bool
        Completions: the prompt comes first in each choice's text.
    completion : bool
        False when max_tokens is 0 with echo: generated tokens are dropped.
    token_text : callable(int) -> str
        A token id's text (logprobs' `token`).
    """

    def __init__(
        self,
        chat: ChatPrompt | None,
        n: int,
        prompts: list[tuple[str, list[int]]],
        logprobs: bool,
        echo: bool,
        completion: bool,
        token_text: TokenText,
    ) -> None:
        self.chat, self.n, self.prompts = chat is not None, n, prompts
        self.logprobs, self.echo, self.completion = logprobs, echo, completion
        self.token_text = token_text
        self.prompt = chat
        self.choices = [_Choice() for _ in range(len(prompts) * n)]
        for c in self.choices:
            if logprobs and not self.chat:
                c.completion_logprobs = CompletionLogprobs(token_text)
            if chat is not None:
                c.answer = chat.stream()

    def on_event(self, p: int, event: PromptLogprobs | Delta) -> list[dict]:
        """Prompt p's event; returns the chunks' choice objects (streamed)."""
        if isinstance(event, PromptLogprobs):
            return self.on_prompt(p, event)
        return self.on_delta(p, event)

    def on_prompt(self, p: int, event: PromptLogprobs) -> list[dict]:
        """Echo's prompt logprobs for prompt p's choices; returns the chunks'
        choice objects that carry the prompt (streamed)."""
        out = []
        _, ids = self.prompts[p]
        for index in range(p * self.n, (p + 1) * self.n):
            c = self.choices[index]
            if c.completion_logprobs is not None:
                for token, entry in zip(ids, event.entries, strict=True):
                    c.completion_logprobs.add(token, entry)
            out += self._start(index)
        return out

    def on_delta(self, p: int, event: Delta) -> list[dict]:
        """A sample's new token; returns the chunks' choice objects (streamed)."""
        index = p * self.n + event.index
        c = self.choices[index]
        out = self._start(index)
        if event.finish_reason is not None:
            c.finish_reason = event.finish_reason
        if not self.completion:
            if event.finish_reason is not None:
                out.append(self._chunk(index, "", None, "length"))
            return out
        c.text.append(event.text)
        logprobs = None
        if self.logprobs and event.logprobs is not None:
            if self.chat:
                entries = chat_entries([event.logprobs], self.token_text)
                c.chat_logprobs += entries
                logprobs = {"content": entries}
            else:
                start = len(c.completion_logprobs.tokens)
                c.completion_logprobs.add(event.token_ids[0], event.logprobs)
                logprobs = c.completion_logprobs.as_json(start)
        if not self.chat:  # one chunk a delta, the last one with its reason
            out.append(self._chunk(index, event.text, logprobs, event.finish_reason))
            return out
        out += self._delta_chunks(index, c.answer.push(event.text), logprobs)
        if event.finish_reason is not None:
            out += self._delta_chunks(index, c.answer.finish(), None)
            if c.answer.tool_calls:
                c.finish_reason = "tool_calls"
            out.append(self._chunk(index, "", None, c.finish_reason))
        return out

    def _delta_chunks(self, index: int, delta: ChatDelta, logprobs) -> list[dict]:
        """A chat delta's chunks: its text (and logprobs, if any), then its
        calls' deltas."""
        out = []
        if delta.content or delta.reasoning or logprobs is not None:
            out.append(self._chunk(index, delta.content, logprobs, None, delta.reasoning))
        if delta.tool_calls:
            out.append({"index": index, "delta": {"tool_calls": delta.tool_calls},
                        "logprobs": None, "finish_reason": None})  # fmt: skip
        return out

    def _start(self, index: int) -> list[dict]:
        """The choice's first chunk, once: chat's role, or echo's prompt."""
        c = self.choices[index]
        if c.started:
            return []
        c.started = True
        if self.chat:
            return [{"index": index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}]  # fmt: skip
        if not self.echo:
            return []
        text = self.prompts[index // self.n][0]
        c.text.insert(0, text)
        logprobs = c.completion_logprobs.as_json() if c.completion_logprobs else None
        return [self._chunk(index, text, logprobs, None)]

    def _chunk(self, index: int, text: str, logprobs, finish_reason, reasoning="") -> dict:
        if self.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            if reasoning:
                delta = {"reasoning_content": reasoning, **({"content": text} if text else {})}
            return {"index": index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish_reason}  # fmt: skip
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def answers(self) -> list[dict]:
        """The whole choices of a non-streamed response."""
        out = []
        for index, c in enumerate(self.choices):
            self._start(index)
            text = "".join(c.text)
            if self.chat:
                answer = self.prompt.read(text)
                message = {"role": "assistant", "content": answer.content}
                if answer.reasoning is not None:
                    message["reasoning_content"] = answer.reasoning
                if answer.tool_calls:
                    message["tool_calls"] = [call.as_openai() for call in answer.tool_calls]
                    c.finish_reason = "tool_calls"
                choice = {"index": index, "message": message}
                logprobs = {"content": c.chat_logprobs} if self.logprobs else None
            else:
                choice = {"index": index, "text": text}
                logprobs = c.completion_logprobs.as_json() if c.completion_logprobs else None
            choice.update(finish_reason=c.finish_reason or "length", logprobs=logprobs)
            out.append(choice)
        return out
