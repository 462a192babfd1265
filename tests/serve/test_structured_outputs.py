"""Structured outputs (`response_format`, vLLM's `structured_outputs`,
llama.cpp's `json_schema` and `grammar`): answers that follow a JSON
schema, are JSON objects, match a regular expression, are one of given
strings or follow a GBNF grammar, from `LLM.generate` and over HTTP.

The schema is checked here by hand (keys, types, bounds), not by the
grammar engine that enforced it; the same prompts answered without a
format are not such JSON, so the format is what makes them so.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from pagedkv.graphs.structured import Grammars, response_format_grammar
from pagedkv.models import load
from pagedkv.serve import ServerThread

WARM_GRAPHS = ("smollm2-gguf",)
"""Compiled ahead beside the suite's first tests (warm_graphs.py)."""

MODEL = "smollm2-135m-instruct"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
PROMPTS = [
    "Name a large city, its country and its population in millions.",
    "Tell me about Tokyo.",
]
MAX_TOKENS = 96
HANG_GUARD = 600.0


def follows_schema(text: str) -> bool:
    """Whether text is one JSON object that SCHEMA accepts."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if not isinstance(value, dict) or set(value) != set(SCHEMA["required"]):
        return False
    names = [value["city"], value["country"]]
    number = value["population_millions"]
    return (
        all(isinstance(s, str) and len(s) <= 24 for s in names)
        and type(number) is int
        and 0 <= number <= 100
    )


@pytest.fixture(scope="module")
def llm():
    return load(MODEL)


def test_the_grammar_allows_what_continues_the_text(llm):
    """At the start of a JSON object only tokens that open one are allowed;
    once `{"a": 1}` is in, only the stop tokens are."""
    grammars = Grammars(llm.tokenizer.tokenizer, llm.config.vocab_size, llm.tokenizer.stop_ids)
    state = grammars.start(response_format_grammar({"type": "json_object"}))
    allowed = state.allowed().nonzero()[0]
    assert len(allowed) > 0
    assert all(llm.tokenizer.decode([int(t)]).startswith("{") for t in allowed)
    assert not state.allowed()[sorted(llm.tokenizer.stop_ids)].any()
    for token in llm.tokenizer.prompt_ids('{"a": 1}'):
        assert state.advance(token)
    assert state.complete
    assert set(state.allowed().nonzero()[0]) <= set(llm.tokenizer.stop_ids)
    assert not grammars.start(response_format_grammar(FORMAT)).advance(min(llm.tokenizer.stop_ids))


def test_generate_follows_a_json_schema_greedy_and_sampled(llm):
    free = llm.generate(PROMPTS, max_new_tokens=MAX_TOKENS)
    assert not any(follows_schema(c.text) for c in free)
    for kw in ({}, {"temperature": 0.9, "seed": 3}):
        answers = llm.generate(PROMPTS, max_new_tokens=MAX_TOKENS, response_format=FORMAT, **kw)
        for c in answers:
            assert c.finish_reason == "stop" and follows_schema(c.text), c.text
    llm.manager.validate()
    assert llm.manager.num_used_pages == 0


def test_a_regular_expression_and_a_choice(llm):
    """The whole answer matches the expression, or is one of the strings."""
    phone = llm.generate(
        ["What is a phone number?"],
        max_new_tokens=MAX_TOKENS,
        response_format={"type": "regex", "regex": r"[0-9]{3}-[0-9]{4}"},
    )[0]
    assert phone.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.text)
    choices = ["positive", "negative", 'it "depends"']
    for prompt in ("I love this film!", "This film was awful."):
        answer = llm.generate(
            [f"Is this review positive or negative? {prompt}"],
            response_format={"type": "choice", "choice": choices},
        )[0]
        assert answer.finish_reason == "stop" and answer.text in choices


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
        {"type": "regex", "regex": "(unclosed"},
        {"type": "choice", "choice": "yes"},
        {"type": "choice", "choice": []},
        {"type": "grammar", "grammar": 'root ::= ( "yes" '},
    ],
)
def test_a_format_that_cannot_be_followed_raises(llm, response_format):
    with pytest.raises(ValueError, match="json_schema|cannot be followed|needs|GBNF"):
        llm.generate(PROMPTS[:1], response_format=response_format)


def test_over_http_streamed_and_not_and_refused(llm):
    with ServerThread(llm) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": PROMPTS[1]}]
        r = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            response_format=FORMAT,
            n=2,
            temperature=0.9,
            seed=5,
        )
        for choice in r.choices:
            assert choice.finish_reason == "stop" and follows_schema(choice.message.content)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            response_format=FORMAT,
            stream=True,
        )
        chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
        assert chunks[-1].finish_reason == "stop"
        assert follows_schema("".join(c.delta.content or "" for c in chunks))
        bad = {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}
        for body in ({"response_format": bad}, {"response_format": {"type": "xml"}}):
            r = httpx.post(
                server.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": messages, **body},
                timeout=HANG_GUARD,
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "response_format"
        labels = ["yes", "no"]
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is the sky blue?"}],
            extra_body={"structured_outputs": {"choice": labels}},
        )
        assert r.choices[0].message.content in labels
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is the sky blue?"}],
            extra_body={"grammar": 'root ::= "Yes." | "No."'},
        )
        assert r.choices[0].message.content in ("Yes.", "No.")
        r = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            extra_body={"json_schema": SCHEMA},
        )
        assert follows_schema(r.choices[0].message.content)
        for body, param in (
            ({"grammar": 'root ::= ( "yes" '}, "grammar"),
            ({"grammar": "root ::= x", "json_schema": SCHEMA}, "json_schema"),
            ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
            ({"structured_outputs": {"regex": "a", "choice": labels}}, "structured_outputs"),
            (
                {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
                "structured_outputs",
            ),
        ):
            r = httpx.post(
                server.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": messages, **body},
                timeout=HANG_GUARD,
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        completion = client.completions.create(
            model=MODEL,
            prompt="A large city as JSON:",
            max_tokens=MAX_TOKENS,
            extra_body={"response_format": FORMAT},
        )
        assert follows_schema(completion.choices[0].text), completion.choices[0]
        assert server.engine.wait_idle(HANG_GUARD)
    llm.manager.validate()
