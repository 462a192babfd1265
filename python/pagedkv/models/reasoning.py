"""Reasoning in a chat answer: the `<think>...</think>` block that Qwen 3,
QwQ, DeepSeek-R1's distillations and SmolLM3 write before their answer,
returned apart from it as `reasoning_content` (the field DeepSeek's API
and llama.cpp's server use).

A model reasons where its chat template speaks of `<think>` (`template_reasons`).
Its answer reasons where it opens with `<think>`, or where the prompt
itself ends inside an opened block (DeepSeek-R1's templates write the tag
into the generation prompt); the reasoning runs to `</think>`, and an
answer cut before that tag is all reasoning. Whitespace between the block
and the answer is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.graphs.stop_strings import partial_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
FORMATS = ("auto", "none")
"""How answers are split: "auto" (where the template reasons) or "none"
(the block stays in the content), as llama.cpp's `--reasoning-format`."""


def template_reasons(chat_template: str | None) -> bool:
    """Whether a chat template speaks of `<think>` blocks."""
    return bool(chat_template) and THINK_OPEN in chat_template


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an opened `<think>` block."""
    return prompt.rstrip().endswith(THINK_OPEN)


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a whole answer; reasoning None where the
    answer does not reason. `opened`: the prompt ended inside a block.

    Examples
    --------
    >>> split_reasoning("<think>\\nIt is 4.\\n</think>\\n\\nFour.")
    ('It is 4.', 'Four.')
    >>> split_reasoning("Four.")
    (None, 'Four.')
    """
    stream = ReasoningStream(opened)
    reasoning, content = stream.push(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning if stream.reasoned else None), content + more_content


@dataclass
class ReasoningStream:
    """A streamed answer split as it grows: `push` returns the (reasoning,
    content) text that can go out now, holding back what may be a tag.

    Args:
        opened: the prompt ended inside a `<think>` block.
    """

    opened: bool = False
    reasoned: bool = False
    """Whether the answer holds a reasoning block (known once it opens)."""
    _state: str = field(init=False, default="start")
    """"start" (before any text but whitespace), "reasoning", "content"."""
    _held: str = field(init=False, default="")
    _reasoning_started: bool = field(init=False, default=False)
    _content_started: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.opened:
            self._state, self.reasoned = "reasoning", True

    def push(self, piece: str) -> tuple[str, str]:
        """Takes the next text; returns (reasoning, content) to send now."""
        text = self._held + piece
        self._held = ""
        reasoning = content = ""
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if not stripped or THINK_OPEN.startswith(stripped):
                    self._held = text  # whitespace, or the start of the tag
                    return reasoning, content
                if stripped.startswith(THINK_OPEN):
                    self._state, self.reasoned = "reasoning", True
                    text = stripped[len(THINK_OPEN) :]
                    continue
                self._state = "content"
            if self._state == "reasoning" and not self._reasoning_started:
                text = text.lstrip()  # the whitespace that opens the block
                if not text:
                    return reasoning, content
                self._reasoning_started = True
            if self._state == "reasoning":
                end = text.find(THINK_CLOSE)
                if end < 0:
                    # Held: what may begin the tag, and trailing whitespace
                    # (dropped where the tag follows it).
                    body = text[: len(text) - partial_suffix(text, [THINK_CLOSE])]
                    reasoning += body.rstrip()
                    self._held = text[len(body.rstrip()) :]
                    return reasoning, content
                reasoning += text[:end].rstrip()
                self._state = "content"
                text = text[end + len(THINK_CLOSE) :]
                continue
            if not self._content_started and self.reasoned:
                text = text.lstrip()
                if not text:
                    return reasoning, content
            self._content_started = True
            content += text
            text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held back at the end of the answer."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held.rstrip(), ""
        return "", held if not self.reasoned else held.lstrip()
