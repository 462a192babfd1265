"""Structured outputs: samples whose text must follow a grammar (a JSON
schema, any JSON object, a regular expression, one of given strings or a
GBNF grammar), as OpenAI's `response_format`, vLLM's `structured_outputs`
and llama.cpp's `json_schema` and `grammar` ask.

llguidance (the grammar engine of llama.cpp's and vLLM's guidance backends)
keeps each sample's parse over the model's own tokenizer and gives, before
each token, the tokens that keep the text within the grammar. The
scheduler sets every other token's logit to -inf before it chooses (after
the logit bias and penalties) and advances the parse by the token chosen;
the logprobs it reports stay the model's own. A sample ends ("stop") when
the grammar is complete and allows no more text, or when it chooses a stop
token, which the grammar allows only where the text is complete; a sample
cut by max_tokens ends unfinished ("length"), as OpenAI's do.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping

import numpy as np

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How the JSON is laid out: on one line, as Python's `json.dumps` writes
it. With any whitespace allowed, small models fill objects with newlines
until max_tokens; a schema's own "x-guidance" options take precedence."""


def response_format_grammar(response_format: Mapping | None) -> str | None:
    """The grammar of a `response_format`: OpenAI's types, None for
    {"type": "text"} (or no format), any JSON object for {"type":
    "json_object"}, the schema's JSON for {"type": "json_schema",
    "json_schema": {"schema": {...}}}; and pagedkv's {"type": "regex",
    "regex": "..."} (a whole match, Rust's regex syntax), {"type":
    "choice", "choice": ["...", ...]} (one of the strings) and {"type":
    "grammar", "grammar": "root ::= ..."} (llama.cpp's GBNF). Raises
    ValueError for anything else.

    Examples
    --------
    >>> response_format_grammar({"type": "text"}) is None
    True
    >>> "json_schema" in response_format_grammar({"type": "json_object"})
    True
    """
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    from llguidance import LLMatcher

    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise ValueError('response_format json_schema needs {"json_schema": {"schema": {...}}}')
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
    if kind == "regex":
        regex = response_format.get("regex")
        if not isinstance(regex, str):
            raise ValueError('response_format regex needs {"regex": "..."}')
        return LLMatcher.grammar_from_regex(regex)
    if kind == "grammar":
        return _gbnf_grammar(response_format.get("grammar"))
    if kind == "choice":
        choice = response_format.get("choice")
        if not isinstance(choice, list | tuple) or not choice or not all(map(_text, choice)):
            raise ValueError('response_format choice needs {"choice": ["...", ...]}')
        # Lark's string literals take JSON's escapes.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, choice)))
    raise ValueError(
        'response_format type must be "text", "json_object", "json_schema", "regex", '
        f'"choice" or "grammar", got {kind!r}'
    )


def _gbnf_grammar(text: object) -> str:
    """A llama.cpp GBNF grammar (its `root` rule the whole answer) in
    llguidance's terms."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

    if not isinstance(text, str) or not text:
        raise ValueError('response_format grammar needs {"grammar": "root ::= ..."}')
    try:
        return LLMatcher.grammar_from_lark(gbnf_to_lark(text))
    except GbnfToLarkError as e:
        raise ValueError(f"not a GBNF grammar: {e}") from None


def _text(value: object) -> bool:
    return isinstance(value, str) and value != ""


def after_reasoning(grammar: str, opened: bool) -> str:
    """`grammar` after a reasoning model's `<think>...</think>` block and
    the whitespace behind it: a block the answer may open (`opened` False)
    or one the prompt opened, so the answer starts inside it and must close
    it. The block is free text up to the first `</think>`.

    Examples
    --------
    >>> "thought" in after_reasoning(response_format_grammar({"type": "json_object"}), False)
    True
    """
    spec = json.loads(grammar) if grammar.lstrip().startswith("{") else None
    inner = [dict(g) for g in spec["grammars"]] if spec else [{"lark_grammar": grammar}]
    name = inner[0].setdefault("name", "answer")
    if opened:
        start, thought = f"start: thought WS @{name}", 'thought[lazy]: TEXT "</think>"'
    else:
        start, thought = f"start: (thought WS)? @{name}", 'thought[lazy]: "<think>" TEXT "</think>"'
    # A lazy lexeme ends at the first "</think>"; WS takes what follows it.
    top = "\n".join(["%llguidance {}", start, thought, r"TEXT: /(.|\n)*/", r"WS: /[ \t\n]*/"])
    first = {"name": "thinking", "lark_grammar": top}
    return json.dumps({**(spec or {}), "grammars": [first, *inner]})


def one_of(*grammars: str) -> str:
    """A grammar whose whole text follows one of `grammars` (llguidance's:
    lark text, or a JSON spec of grammars whose first is the start). Their
    start grammars are renamed apart; other names must not collide.

    Examples
    --------
    >>> "@alt_0 | @regex_1" in one_of('start: "a"', response_format_grammar({"type": "regex",
    ...                                                                    "regex": "[0-9]+"}))
    True
    """
    parts, starts = [], []
    for k, grammar in enumerate(grammars):
        spec = json.loads(grammar) if grammar.lstrip().startswith("{") else None
        inner = [dict(g) for g in spec["grammars"]] if spec else [{"lark_grammar": grammar}]
        inner[0]["name"] = f"{inner[0].get('name') or 'alt'}_{k}"
        starts.append(f"@{inner[0]['name']}")
        parts += inner
    names = [g["name"] for g in parts if g.get("name")]
    if len(names) != len(set(names)):
        raise ValueError(f"grammars to combine share names: {names}")
    top = "\n".join(["%llguidance {}", "start: " + " | ".join(starts)])
    return json.dumps({"grammars": [{"name": "one_of", "lark_grammar": top}, *parts]})


def grammar_given(response_format: Mapping | None) -> bool:
    """Whether a `response_format` asks for more than free text."""
    return response_format is not None and response_format.get("type") != "text"


def request_format(
    response_format: Mapping | None,
    structured_outputs: Mapping | None = None,
    json_schema: Mapping | None = None,
    grammar: str | None = None,
) -> tuple[str, dict | None]:
    """(the field, the `response_format`) of a request that names its
    output format in at most one of OpenAI's `response_format`, vLLM's
    `structured_outputs` or llama.cpp's `json_schema` or `grammar` (GBNF);
    ("response_format", None) when none does. Raises ValueError naming the
    fields when more than one does."""
    given = {
        "response_format": response_format if grammar_given(response_format) else None,
        "structured_outputs": structured_outputs or None,
        "json_schema": json_schema,
        "grammar": grammar,
    }
    named = [name for name, value in given.items() if value is not None]
    if len(named) > 1:
        raise ValueError(f"give one output format, not {' and '.join(named)}")
    if not named:
        return "response_format", None
    name = named[0]
    if name == "structured_outputs":
        return name, structured_outputs_format(structured_outputs)
    if name == "json_schema":
        return name, {"type": "json_schema", "json_schema": {"schema": json_schema}}
    if name == "grammar":
        return name, {"type": "grammar", "grammar": grammar}
    return name, dict(response_format)


STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice"}
"""vLLM's `structured_outputs` keys, by the `response_format` type each is."""


def structured_outputs_format(spec: Mapping) -> dict:
    """vLLM's `structured_outputs` ({"json": schema}, {"regex": "..."} or
    {"choice": [...]}; {"json_object": true}) as a `response_format`.
    Raises ValueError unless it names exactly one of them."""
    named = [key for key in (*STRUCTURED_OUTPUTS, "json_object") if spec.get(key)]
    if len(named) != 1:
        raise ValueError(
            'structured_outputs takes one of "json", "regex", "choice" or "json_object"'
        )
    key = named[0]
    if key == "json_object":
        return {"type": "json_object"}
    if key == "json":
        schema = spec["json"]
        schema = json.loads(schema) if isinstance(schema, str) else schema
        return {"type": "json_schema", "json_schema": {"schema": schema}}
    return {"type": key, key: spec[key]}


VERDICTS_KEPT = 256
"""Grammars whose check `Grammars.error` remembers."""


class Grammars:
    """The grammar engine over one model's tokenizer: checks grammars and
    starts each sample's parse. Its token tables (about a second for a
    vocabulary of 50,000) are built on first use.

    Args:
        tokenizer: the model's `tokenizers.Tokenizer`.
        vocab_size: the model's logits per row (at least the tokenizer's).
        stop_ids: the tokens that end a sample (EOS, end of turn): allowed
            where the text is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self._source = tokenizer
        self._verdicts: dict[str, str | None] = {}

    @functools.cached_property
    def _tokenizer(self):
        from llguidance import LLTokenizer

        return LLTokenizer(self._source.to_str(), n_vocab=self.vocab_size, eos_token=self.stop_ids)

    def error(self, grammar: str) -> str | None:
        """Why `grammar` cannot be followed (an unknown schema keyword, a
        malformed expression), or None. A request is checked where it
        arrives and again where it is queued: the verdicts of the last
        `VERDICTS_KEPT` grammars are kept, so only the first check compiles."""
        from llguidance import LLMatcher

        if grammar not in self._verdicts:
            if len(self._verdicts) >= VERDICTS_KEPT:
                del self._verdicts[next(iter(self._verdicts))]
            self._verdicts[grammar] = LLMatcher.validate_grammar(grammar, self._tokenizer) or None
        return self._verdicts[grammar]

    def start(self, grammar: str) -> GrammarState:
        """A new sample's parse of `grammar` (checked by `error` first)."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._tokenizer, grammar, log_level=0)
        return GrammarState(matcher, self.vocab_size, self.stop_ids)


class GrammarState:
    """One sample's parse: which tokens may come next."""

    def __init__(self, matcher, vocab_size: int, stop_ids: list[int]) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._stop_ids = stop_ids

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens that keep the text within the grammar
        (only the stop tokens where the parse failed, so that it ends)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool)
        if not allowed.any():
            allowed[self._stop_ids] = True
        return allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """logits [vocab] with every token the grammar forbids at -inf (a
        new array)."""
        masked = logits.copy()
        masked[~self.allowed()] = -np.inf
        return masked

    def advance(self, token: int) -> bool:
        """Takes the chosen token; False where the grammar forbids it (a
        token chosen from masked logits is forbidden only when the parse
        has failed): the sample should end."""
        return bool(self._matcher.consume_token(token))

    @property
    def complete(self) -> bool:
        """The grammar allows no more text (the sample is done)."""
        return self._matcher.is_stopped()
