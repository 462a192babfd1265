"""The model's tokenizer and chat template, built from the GGUF's metadata
exactly as HF transformers builds them from the same file.

A `gpt2` GGUF vocabulary is byte-level BPE: the `tokenizers` library's BPE
model over the file's tokens and merges, a byte-level pre-tokenizer (no
prefix space) and decoder, and the tokens the file marks as control (type 3)
added as special tokens, so `<|im_start|>` in a prompt stays one token. The
chat template is the file's Jinja template, rendered in a sandbox with
transformers' settings (trim_blocks, lstrip_blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ModelError

CONTROL = 3
"""llama.cpp's token type of a control (special) token."""


@dataclass
class ChatTokenizer:
    """Text to token ids and back, and chat messages to a prompt."""

    tokenizer: object
    """A `tokenizers.Tokenizer`."""
    bos_token_id: int | None
    eos_token_id: int
    chat_template: str | None
    special_ids: frozenset[int]

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, object]) -> ChatTokenizer:
        """Builds the tokenizer a GGUF describes (tokenizer.ggml.* keys)."""
        from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
        from tokenizers.models import BPE

        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelError(f"tokenizer kind {kind!r}: pagedkv builds byte-level BPE (gpt2) only")
        tokens = list(metadata["tokenizer.ggml.tokens"])
        types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
        vocab = {token: i for i, token in enumerate(tokens)}
        tokenizer = Tokenizer(
            BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        control = [t for t, kind in zip(tokens, types, strict=True) if kind == CONTROL]
        tokenizer.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t in control]
        )
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        return cls(
            tokenizer=tokenizer,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=int(metadata["tokenizer.ggml.eos_token_id"]),
            chat_template=metadata.get("tokenizer.chat_template"),
            special_ids=frozenset(vocab[t] for t in control),
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special tokens written in it stay whole).
        Raises ValueError for text that is not valid Unicode (a lone
        surrogate, which JSON's escapes can carry)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the text holds a lone surrogate at character {e.start}") from None
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The chat template applied to messages [{"role": ..., "content": ...}]."""
        if not self.chat_template:
            raise ModelError("this model has no chat template: generate with chat=False")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt
        )

    def chat_prompt(self, user_message: str, system_prompt: str | None = None) -> list[int]:
        """Token ids of a one-turn chat: the system prompt (the template's
        default when None), the user's message, the assistant's header."""
        messages = [{"role": "user", "content": user_message}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        return self.encode(self.render_chat(messages))


class TextStream:
    """Incremental decoding of a growing list of ids: push() returns the
    text the new token completes, holding back a trailing partial UTF-8
    character (decoded as U+FFFD) until its bytes arrive."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[self.emitted :], len(text)
        return new
