"""The exceptions a user sees: a model that cannot be fetched, read or
served, and a chat request that cannot be rendered."""

from __future__ import annotations


class ModelError(RuntimeError):
    """A model that cannot be loaded: unknown name, failed fetch, unreadable
    GGUF. The message is one line and says what to do; the CLI prints it
    and exits with status 2."""


class ChatRequestError(ValueError):
    """A malformed chat request: its messages, tools, tool_choice or
    reasoning_format; `param` names the field (as OpenAI's error bodies do)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
