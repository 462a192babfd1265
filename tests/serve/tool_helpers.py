"""What the tool-call tests share: the tools offered (and how to check a
call against them), the question that asks for one, a content format, a
stream driven piece by piece, and the grammar engine over SmolLM2's
tokenizer with a check that a grammar lets a text come."""

from __future__ import annotations

import json
from pathlib import Path

from pagedkv.models.tool_call_stream import ToolCallStream
from pagedkv.models.tool_calls import ToolUse

DATA = Path(__file__).parent.parent / "data"
HERMES_TEMPLATE = DATA / "hermes_chat_template.jinja"
LLAMA3_TEMPLATE = DATA / "llama3_tools_chat_template.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 32},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, CLOCK]
UNFOLLOWABLE = {"type": "function", "function": {"name": "a", "parameters": {
    "type": "object", "properties": {"x": {"type": "nonsense"}}}}}  # fmt: skip
"""A tool whose parameters the grammar engine refuses."""
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
MAX_TOKENS = 96
HANG_GUARD = 600.0


def weather_arguments(arguments: str) -> bool:
    """Whether arguments (a JSON string) are get_weather's: a city of at
    most 32 characters and a unit, nothing else."""
    value = json.loads(arguments)
    return (
        set(value) == {"city", "unit"}
        and isinstance(value["city"], str)
        and len(value["city"]) <= 32
        and value["unit"] in ("celsius", "fahrenheit")
    )


def call_follows(name: str, arguments: str) -> bool:
    """Whether a call names one of TOOLS with arguments it takes."""
    if name == "now":
        return json.loads(arguments) == {}
    return name == "get_weather" and weather_arguments(arguments)


def follows_tools(call) -> bool:
    """Whether an OpenAI client's tool call is one of TOOLS, well formed."""
    function = call.function
    return call.type == "function" and call.id and call_follows(function.name, function.arguments)


def streamed(use: ToolUse, text: str, sizes) -> tuple[str, list[dict], list]:
    """text pushed through use's stream in pieces of the given sizes (in
    turn): (content sent, call deltas, the stream's whole calls)."""
    stream, sent, deltas, at, k = ToolCallStream(use), [], [], 0, 0
    while at < len(text):
        size = sizes[k % len(sizes)]
        content, calls = stream.push(text[at : at + size])
        sent.append(content)
        deltas += calls
        at, k = at + size, k + 1
    rest, calls = stream.finish()
    return "".join(sent) + rest, deltas + calls, stream.calls


ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "integer", "minimum": -1000,
    "maximum": 1000}}, "required": ["answer"], "additionalProperties": False}}}  # fmt: skip
"""A content format: an object holding one integer. Bounded, so that no
sampled answer can run to max_tokens in its digits."""


def allows(grammars, grammar: str, text: str) -> bool:
    """Whether the grammar lets the tokens of text come, in order
    (grammars: the `grammars` fixture)."""
    tokenizer, engine = grammars
    state = engine.start(grammar)
    for token in tokenizer.encode(text):
        if not state.allowed()[token]:
            return False
        state.advance(token)
    return True
