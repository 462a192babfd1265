"""Token log-probabilities in OpenAI's two response shapes.

Chat completions list one entry per generated token under
``logprobs.content``: ``{"token", "logprob", "bytes", "top_logprobs"}``.
Completions (the legacy shape evaluation harnesses read) hold parallel lists
under ``logprobs``: ``tokens``, ``token_logprobs`` (None for a prompt's first
token), ``top_logprobs`` (token text -> logprob, None for that first token)
and ``text_offset`` (each token's character offset in the choice's text).

A token's text is the tokenizer's decoding of that token alone, so a token
that holds part of a UTF-8 character shows as U+FFFD (its ``bytes`` are the
text's, as vLLM's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.graphs.sampling import TokenLogprob

TokenText = Callable[[int], str]
"""A token id's text (the tokenizer's decoding of it alone)."""


def chat_entries(entries: Sequence[TokenLogprob], text: TokenText) -> list[dict]:
    """``logprobs.content`` of a chat choice (or of one streamed chunk)."""

    def entry(token: int, logprob: float) -> dict:
        t = text(token)
        return {"token": t, "logprob": logprob, "bytes": list(t.encode())}

    return [
        {**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
        for e in entries
    ]


class CompletionLogprobs:
    """The ``logprobs`` object of one completions choice, built token by
    token; `offset` is the choice's text length so far."""

    def __init__(self, text: TokenText) -> None:
        self.text = text
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.offset = 0

    def add(self, token: int, entry: TokenLogprob | None) -> None:
        """Appends `token` with its logprob (None: a prompt's first token).
        Its top_logprobs hold the most likely tokens and the token itself,
        as vLLM's."""
        t = self.text(token)
        self.tokens.append(t)
        self.text_offset.append(self.offset)
        self.offset += len(t)
        self.token_logprobs.append(None if entry is None else entry.logprob)
        if entry is None:
            self.top_logprobs.append(None)
            return
        top = {self.text(i): lp for i, lp in entry.top}
        top.setdefault(t, entry.logprob)
        self.top_logprobs.append(top)

    def as_json(self, start: int = 0) -> dict:
        """The lists from entry `start` on (a streamed chunk's new tokens)."""
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }
