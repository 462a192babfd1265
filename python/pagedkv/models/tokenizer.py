"""The model's tokenizer and chat template, built from the GGUF's metadata
as llama.cpp builds them (and HF transformers, from the files the tests
hold).

Two kinds of vocabulary:

- `gpt2`: byte-level BPE: the `tokenizers` library's BPE model over the
  file's tokens and merges, and a byte-level decoder. Text is split before
  the merges as the vocabulary was trained to split it, by the file's
  `tokenizer.ggml.pre`, with llama.cpp's regular expressions for that name
  (`BYTE_LEVEL_SPLITS`: Llama 3's digits in threes, Qwen's one by one,
  SmolLM's one by one before GPT-2's split, ...); a name pagedkv does not
  know is refused, as llama.cpp refuses it, rather than split wrongly.
  Llama 3's and Tekken's take a piece the vocabulary holds whole as one
  token (`WHOLE_TOKENS_AND_BOS`).
- `llama` (SentencePiece BPE, Gemma's): spaces written as "▁", bytes
  the vocabulary lacks as <0xNN> tokens, and, since the file lists no
  merges, the merges rebuilt from the vocabulary: every split of a token
  into two tokens, best first by the token's place in the file (Gemma's
  scores do not follow its merge order; its token order does). A token of
  spaces alone is stored as real spaces and renamed to "▁"s first.

Either way the tokens the file marks as control (type 3) are added as
special tokens, so `<|im_start|>` or `<start_of_turn>` in a prompt stays one
token, and user-defined ones (type 4, Gemma's runs of newlines) as plain
added tokens. A prompt starts with BOS where the file says so
(`tokenizer.ggml.add_bos_token`), else as llama.cpp decides: for a
SentencePiece vocabulary, and for Llama 3's and Tekken's byte-level ones.
The chat template is the file's Jinja template (or, for a family whose files
carry none, its documented turn format), rendered in a sandbox with
transformers' settings (trim_blocks, lstrip_blocks) and the BOS and EOS
texts.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import ModelError

CONTROL = 3
"""llama.cpp's token type of a control (special) token."""
USER_DEFINED = 4
"""llama.cpp's token type of a user-defined token (matched whole, not special)."""

GEMMA_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
"""Gemma's documented turn format (its instruction-tuned models' template,
without the `<bos>`, which `prompt_ids` adds): a system prompt joins the
first user turn; the assistant's role is "model"."""
FAMILY_CHAT_TEMPLATES = {"gemma2": GEMMA_CHAT_TEMPLATE, "gemma3": GEMMA_CHAT_TEMPLATE}
"""The chat template of a family whose GGUFs carry none."""
END_OF_TURN = (
    "<end_of_turn>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
)
"""Tokens that end a model's turn besides EOS, where the vocabulary has
them (the common ones of llama.cpp's end-of-generation set: an instruct
file's EOS is often its end of turn, a base file's its end of text)."""


TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)
"""What pagedkv gives every chat template itself (not a request's to set)."""


@dataclass
class ChatTokenizer:
    """Text to token ids and back, and chat messages to a prompt."""

    tokenizer: object
    """A `tokenizers.Tokenizer`."""
    bos_token_id: int | None
    eos_token_id: int
    chat_template: str | None
    special_ids: frozenset[int]

    add_bos: bool = False
    """Whether a prompt starts with `bos_token_id` (`prompt_ids`)."""
    stop_ids: frozenset[int] = frozenset()
    """Tokens that end generation: EOS and the family's end-of-turn tokens."""
    template_defaults: Mapping[str, object] = field(default_factory=dict)
    """Variables the chat template gets unless a request gives its own
    (vLLM's `--default-chat-template-kwargs`)."""

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, object]) -> ChatTokenizer:
        """Builds the tokenizer a GGUF describes (tokenizer.ggml.* keys)."""
        from tokenizers import AddedToken

        kind = metadata.get("tokenizer.ggml.model")
        if kind not in _BUILDERS:
            raise ModelError(
                f"tokenizer kind {kind!r}: pagedkv builds byte-level BPE (gpt2) and "
                "SentencePiece BPE (llama)"
            )
        try:
            tokens = list(metadata["tokenizer.ggml.tokens"])
            tokenizer, vocab = _BUILDERS[kind](metadata, tokens)
        except KeyError as e:
            raise ModelError(f"the GGUF's {kind} tokenizer lacks {e}") from None
        types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        control = [t for t, kind in zip(tokens, types, strict=True) if kind == CONTROL]
        tokenizer.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t in control]
        )
        user_defined = [
            t for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED and t in vocab
        ]
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        if "tokenizer.ggml.eos_token_id" not in metadata:
            raise ModelError("the GGUF's tokenizer names no end-of-sequence token")
        eos = int(metadata["tokenizer.ggml.eos_token_id"])
        family = metadata.get("general.architecture")
        template = metadata.get("tokenizer.chat_template") or FAMILY_CHAT_TEMPLATES.get(family)
        return cls(
            tokenizer=tokenizer,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=eos,
            chat_template=template,
            special_ids=frozenset(vocab[t] for t in control if t in vocab),
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", _adds_bos(metadata))),
            stop_ids=frozenset({eos, *(vocab[t] for t in END_OF_TURN if t in vocab)}),
        )

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of a whole prompt: `encode(text)`, after BOS when the
        model's prompts start with one."""
        bos = [self.bos_token_id] if self.add_bos and self.bos_token_id is not None else []
        return bos + self.encode(text)

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
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
        template_kwargs: Mapping[str, object] | None = None,
    ) -> str:
        """The chat template applied to messages [{"role": ..., "content": ...}]
        (and OpenAI's `tools` where the template renders them), given the
        model's `bos_token` and `eos_token` texts and the helpers templates
        call (`tojson`, `raise_exception`, `strftime_now`) as transformers
        and llama.cpp give them. Where `prompt_ids` adds BOS, a BOS the
        template writes first is left out (llama.cpp's rule), so the prompt
        starts with one BOS, not two. `template_kwargs`: more variables the
        template reads (Qwen 3's `enable_thinking`: vLLM's and llama.cpp's
        `chat_template_kwargs`), over `template_defaults`. Raises ValueError where the template
        refuses the messages (`raise_exception`, a missing field)."""
        if not self.chat_template:
            raise ModelError("this model has no chat template: generate with chat=False")
        from jinja2 import TemplateError

        bos, eos = (
            "" if i is None else self.tokenizer.id_to_token(i) or ""
            for i in (self.bos_token_id, self.eos_token_id)
        )
        extra = {**self.template_defaults, **(template_kwargs or {})}
        if any(not isinstance(k, str) or k in TEMPLATE_VARIABLES for k in extra):
            raise ValueError(f"chat_template_kwargs may not name {sorted(TEMPLATE_VARIABLES)}")
        try:
            text = _template(self.chat_template).render(
                **extra,
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos,
                eos_token=eos,
            )
        except (TemplateError, TypeError) as e:  # TypeError: a message field of the wrong type
            raise ValueError(f"the chat template refused the messages: {e}") from None
        return text[len(bos) :] if self.add_bos and bos and text.startswith(bos) else text

    def chat_prompt(self, user_message: str, system_prompt: str | None = None) -> list[int]:
        """Token ids of a one-turn chat: the system prompt (the template's
        default when None), the user's message, the assistant's header."""
        messages = [{"role": "user", "content": user_message}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        return self.prompt_ids(self.render_chat(messages))


@functools.lru_cache(maxsize=8)
def _template(source: str):
    """A chat template compiled in a sandbox with transformers' helpers:
    `tojson` without HTML escaping (Jinja's own escapes `<`), and
    `raise_exception` and `strftime_now`."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
"""GPT-2's pre-tokenizer expression (the `tokenizers` byte-level default)."""
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _splits(names: str, *expressions: str) -> dict[str, tuple[str, ...]]:
    return dict.fromkeys(names.split(), expressions)


BYTE_LEVEL_SPLITS: dict[str, tuple[str, ...]] = {
    **_splits("default gpt-2 phi-2 mpt olmo jais roberta-bpe exaone4 mellum", GPT2_SPLIT),
    **_splits(
        "smollm starcoder refact command-r codeshell exaone minerva-7b", r"\p{N}", GPT2_SPLIT
    ),
    **_splits(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 dbrx smaug-bpe",
        LLAMA3_SPLIT,
    ),
    **_splits("qwen2 deepseek-r1-qwen stablelm2 megrez kormo", QWEN2_SPLIT),
    **_splits("qwen35", QWEN35_SPLIT),
    **_splits("tekken", TEKKEN_SPLIT),
    **_splits("gpt-4o llama4 kanana2", GPT4O_SPLIT),
}
"""The expressions that split text before the merges, by the GGUF's
`tokenizer.ggml.pre`, applied in order (each splits the pieces of the one
before): llama.cpp's for that name (`llama-vocab.cpp`), in their original
`tokenizer.json` forms. A file without the key is split as "default" (GPT-2's
expression; llama.cpp warns that such a file tokenizes as it was not
trained)."""


WHOLE_TOKENS_AND_BOS = frozenset(
    "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 tekken".split()
)
"""The `tokenizer.ggml.pre` names whose byte-level vocabularies take a
piece of the split that the vocabulary holds whole as one token, without
merging it (`ignore_merges`, Llama 3's), and start a prompt with BOS unless
the file says otherwise (llama.cpp's `ignore_merges` and `add_bos`)."""


def _adds_bos(metadata: dict[str, object]) -> bool:
    """Whether a prompt starts with BOS when the file does not say
    (`tokenizer.ggml.add_bos_token`): a SentencePiece vocabulary's does, a
    byte-level one's where `WHOLE_TOKENS_AND_BOS` names its pre-tokenizer,
    as llama.cpp decides."""
    kind = metadata.get("tokenizer.ggml.model")
    return kind == "llama" or metadata.get("tokenizer.ggml.pre") in WHOLE_TOKENS_AND_BOS


def byte_level_split(pre: str | None) -> tuple[str, ...]:
    """The expressions of `BYTE_LEVEL_SPLITS` for a `tokenizer.ggml.pre`
    value (None: "default"); raises ModelError for a name not in it."""
    name = pre or "default"
    if name not in BYTE_LEVEL_SPLITS:
        raise ModelError(
            f"byte-level BPE pre-tokenizer {name!r}: pagedkv splits text as "
            f"{', '.join(sorted(BYTE_LEVEL_SPLITS))}"
        )
    return BYTE_LEVEL_SPLITS[name]


def _byte_level(metadata: dict[str, object], tokens: list[str]):
    """A `gpt2` vocabulary: byte-level BPE with the file's merges, text split
    first by `byte_level_split`."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

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
            ignore_merges=metadata.get("tokenizer.ggml.pre") in WHOLE_TOKENS_AND_BOS,
        )
    )
    splits = byte_level_split(metadata.get("tokenizer.ggml.pre"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(e), behavior="isolated") for e in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, vocab


def _sentencepiece(metadata: dict[str, object], tokens: list[str]):
    """A `llama` vocabulary (SentencePiece BPE with byte fallback, no prefix
    space), merges rebuilt from the token order (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for rank, token in enumerate(tokens):
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                merges.append((rank, -i, left, right))
    # transformers' order: by the merged token's place, the longer left part first.
    merges.sort(key=lambda m: (m[0], m[1]))
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=[(left, right) for _, _, left, right in merges],
            dropout=None,
            unk_token=None if unk is None else tokens[int(unk)],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tokenizer, vocab


_BUILDERS = {"gpt2": _byte_level, "llama": _sentencepiece}


class TextStream:
    """Incremental decoding of a growing list of ids: push() returns the
    text the new token completes, holding back a trailing partial UTF-8
    character (decoded as U+FFFD) until its bytes arrive.

    Each push decodes a window of a few ids, not the whole list (which
    would cost time quadratic in the answer's length): the ids since the
    last emitted text, after the ids of the text emitted before it, whose
    decoding is subtracted. The context keeps what a decoder does at a
    token's start (a SentencePiece space, a byte sequence) as it is in the
    whole list, so the pieces join into decode(ids)."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        """Where the context window starts."""
        self.read_offset = 0
        """Ids before this are emitted as text."""

    def push(self, token: int) -> str:
        self.ids.append(token)
        window = self.ids[self.prefix_offset :]
        seen = self.tokenizer.decode(window[: self.read_offset - self.prefix_offset])
        text = self.tokenizer.decode(window)
        if text.endswith("\ufffd") or len(text) <= len(seen):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(seen) :]


def load_tokenizer(name: str, gguf: str | None = None) -> ChatTokenizer:
    """The chat tokenizer of a catalogue model, from its GGUF's metadata
    alone (no weights are read): what a router needs to see prompts as the
    model's replicas do.

    Raises:
        ModelError: unknown name, failed fetch, or an unreadable GGUF.

    Examples
    --------
    >>> load_tokenizer("smollm2-135m-instruct").prompt_ids("Hi")  # doctest: +SKIP
    [12289]
    """
    from pathlib import Path

    from gguf import GGUFReader

    from .catalog import model_spec
    from .fetch import fetch_gguf

    path = Path(gguf) if gguf is not None else fetch_gguf(model_spec(name).name)
    try:
        reader = GGUFReader(path)
        metadata = {key: field.contents() for key, field in reader.fields.items()}
    except Exception as e:  # noqa: BLE001 - any parse failure is a corrupt file
        raise ModelError(f"{path} is not a readable GGUF ({type(e).__name__}: {e})") from None
    return ChatTokenizer.from_gguf_metadata(metadata)
