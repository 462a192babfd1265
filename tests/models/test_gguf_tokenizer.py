"""A GGUF's tokenizer as llama.cpp builds it: byte-level BPE vocabularies
split text before their merges as the file's `tokenizer.ggml.pre` names,
and generation stops at llama.cpp's end-of-turn tokens.

The splits' reference is llama.cpp's own expressions for
each name, in the forms its engine runs (`llama-vocab.cpp`: contractions
spelled out case by case, Tekken's letter classes rewritten as lookaheads),
applied here with the `regex` module, piece after piece: not the strings
pagedkv compiles.
"""

from __future__ import annotations

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.models.errors import ModelError
from pagedkv.models.tokenizer import BYTE_LEVEL_SPLITS, ChatTokenizer

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA_CPP = {
    "gpt-2": [
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ],
    "smollm": [
        r"\p{N}",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ],
    "llama-bpe": [
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
    "qwen2": [
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
    "qwen35": [
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
    "tekken": [
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
    "gpt-4o": [
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
        + _CONTRACTIONS
        + r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
        + _CONTRACTIONS
        + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
}
"""llama.cpp's expressions for one name of each family."""

TEXTS = [
    "In 2024, 1234567 people paid $3.14159 each.",
    "I'M here; you'll SEE what they'd do. DON'T",
    "def f(x):\n    return x**2  # squares\n\n\n\tend",
    "  leading and trailing spaces   ",
    "line one\r\nline two\n\n  indented\n",
    "CamelCaseWords and HTTPServer and iPhone",
    "über café naïve Ελληνικά русский 中文字符 日本語のテキスト",
    "emoji 🙂🙂 and ¿qué? «quotes» — dashes…",
    "a1b22c333d4444 9.99% (x+y)/2 == z!!!",
    "<|im_start|>user\nHello<|im_end|>",
]


def reference_pieces(text: str, expressions: list[str]) -> list[str]:
    """The pieces llama.cpp's splitter makes: each expression in turn over
    each piece of the one before, matches and the text between them kept."""
    pieces = [text]
    for expression in expressions:
        split = []
        for piece in pieces:
            at = 0
            for m in regex.finditer(expression, piece):
                if m.start() > at:
                    split.append(piece[at : m.start()])
                if m.end() > m.start():
                    split.append(m.group())
                at = m.end()
            if at < len(piece):
                split.append(piece[at:])
        pieces = split
    return pieces


def tokenizer_with_pre(
    pre: str | None, extra: tuple[str, ...] = (), chat_template: str | None = None, **keys: object
) -> ChatTokenizer:
    """A tiny byte-level vocabulary (its merges do not matter to the split),
    with `extra` control tokens after its own and `keys` as
    `tokenizer.ggml.{key}`: "a", "b", "ab", "c", "abc", "<|im_start|>" (EOS,
    id 5), "<s>" (BOS, id 6); the one merge "a b"."""
    tokens = ["a", "b", "ab", "c", "abc", "<|im_start|>", "<s>", *extra]
    metadata = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3, 3] + [3] * len(extra),
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 5,
        "tokenizer.ggml.bos_token_id": 6,
        **{f"tokenizer.ggml.{key}": value for key, value in keys.items()},
    }
    if pre is not None:
        metadata["tokenizer.ggml.pre"] = pre
    if chat_template is not None:
        metadata["tokenizer.chat_template"] = chat_template
    return ChatTokenizer.from_gguf_metadata(metadata)


def pagedkv_pieces(tokenizer: ChatTokenizer, text: str) -> list[str]:
    return [text[a:b] for _, (a, b) in tokenizer.tokenizer.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP))
def test_text_splits_as_llama_cpp_splits_it(pre):
    tokenizer = tokenizer_with_pre(pre)
    for text in TEXTS:
        assert pagedkv_pieces(tokenizer, text) == reference_pieces(text, LLAMA_CPP[pre]), text


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2", "qwen35"])
def test_any_text_splits_as_llama_cpp_splits_it(pre):
    """Tekken's and GPT-4o's letter classes are left to the fixed texts:
    llama.cpp's lookahead rewrite of them differs from the original for
    accented lowercase letters."""
    tokenizer = tokenizer_with_pre(pre)

    # Assigned characters only: the two regular expression engines' Unicode
    # tables are of different versions.
    @settings(max_examples=150, deadline=None)
    @given(st.text(st.characters(codec="utf-8", exclude_categories=("Cn", "Co")), max_size=40))
    def splits(text):
        assert pagedkv_pieces(tokenizer, text) == reference_pieces(text, LLAMA_CPP[pre])

    splits()


def test_the_families_split_differently():
    """The table is not one expression under many names: digits alone tell
    GPT-2 (runs), Llama 3 (threes) and Qwen (ones) apart."""
    pieces = {
        pre: pagedkv_pieces(tokenizer_with_pre(pre), " 12345")
        for pre in ("gpt-2", "llama-bpe", "qwen2", "smollm")
    }
    assert pieces == {
        "gpt-2": [" 12345"],
        "llama-bpe": [" ", "123", "45"],
        "qwen2": [" ", "1", "2", "3", "4", "5"],
        "smollm": [" ", "1", "2", "3", "4", "5"],
    }
    assert BYTE_LEVEL_SPLITS["llama3"] == BYTE_LEVEL_SPLITS["llama-bpe"]


def test_a_file_without_a_pre_tokenizer_splits_as_gpt_2():
    tokenizer = tokenizer_with_pre(None)
    for text in TEXTS:
        assert pagedkv_pieces(tokenizer, text) == reference_pieces(text, LLAMA_CPP["gpt-2"])


def test_an_unknown_pre_tokenizer_is_refused():
    with pytest.raises(ModelError, match="pre-tokenizer 'made-up'.*llama-bpe"):
        tokenizer_with_pre("made-up")


def test_special_tokens_stay_whole_after_the_split():
    tokenizer = tokenizer_with_pre("llama-bpe")
    assert tokenizer.encode("<|im_start|>ab") == [5, 2]


def test_llama_3_takes_a_piece_its_vocabulary_holds_whole():
    """No merge makes "abc" from "ab" and "c"; Llama 3's vocabulary still
    takes the whole piece as its token (llama.cpp's ignore_merges), GPT-2's
    merges what its merges can."""
    assert tokenizer_with_pre("llama-bpe").encode("abc") == [4]
    assert tokenizer_with_pre("gpt-2").encode("abc") == [2, 3]


@pytest.mark.parametrize(
    "pre,add_bos_token,bos",
    [
        ("llama-bpe", None, True),  # llama.cpp's default for Llama 3
        ("llama-bpe", False, False),
        ("qwen2", None, False),  # byte-level default: none
        ("qwen2", True, True),
    ],
)
def test_a_prompt_starts_with_bos_as_llama_cpp_decides(pre, add_bos_token, bos):
    keys = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
    tokenizer = tokenizer_with_pre(pre, **keys)
    assert tokenizer.prompt_ids("ab") == [6, 2] if bos else [2]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_a_chat_template_gets_the_bos_and_eos_texts_and_one_bos_starts_the_prompt(pre):
    """Llama 3's template writes {{ bos_token }} and ends each turn in its
    end-of-turn text; with BOS added as well the prompt still holds one."""
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    tokenizer = tokenizer_with_pre(pre, chat_template=template)
    assert tokenizer.chat_prompt("ab") == [6, 2, 5]
    tokenizer = tokenizer_with_pre(pre, chat_template=template.replace("{{ bos_token }}", ""))
    assert tokenizer.chat_prompt("ab") == ([6] if pre == "llama-bpe" else []) + [2, 5]


def test_generation_stops_at_the_end_of_turn_tokens_the_vocabulary_has():
    """Llama 3's instruct turns end in <|eot_id|>, ChatML's in <|im_end|>,
    whichever token the file names EOS; a token that is not an end of turn
    does not stop."""
    tokenizer = tokenizer_with_pre("llama-bpe", ("<|eot_id|>", "<|im_end|>", "<|python_tag|>"))
    assert tokenizer.stop_ids == {5, 7, 8}


def test_a_tokenizer_missing_its_merges_is_refused():
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a"],
        "tokenizer.ggml.eos_token_id": 0,
    }
    with pytest.raises(ModelError, match="lacks 'tokenizer.ggml.merges'"):
        ChatTokenizer.from_gguf_metadata(metadata)
