"""What a grammar costs a sample per token: the mask of the tokens that keep
its text within the grammar (llguidance's bitmask, unpacked to one bool per
token) and the advance by the chosen token, over a fixed answer, for each
kind of grammar the server builds: JSON formats, the three tool-call
formats (auto and required) and a format after a reasoning block.

    python benchmarks/grammar_mask.py [--model smollm2-135m-instruct] [--repeats 5]

The model's tokenizer only (no weights are read beyond the GGUF's
metadata). Prints the median and 90th percentile per token, and the one-off
costs: the engine's token tables (once per model) and the first check of
each grammar (once per distinct grammar, remembered after).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from llamacpp import cpu_info, machine_line
from pagedkv.graphs.structured import Grammars, after_reasoning, response_format_grammar
from pagedkv.models import MODELS
from pagedkv.models.tokenizer import load_tokenizer
from pagedkv.models.tool_calls import ToolUse, read_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "kelvin"]}},
            "required": ["city", "unit"],
        },
    },
}
ARGUMENTS = {"city": "Paris", "unit": "celsius"}
PROSE = (
    "The weather in Paris is usually mild in spring, with showers and sunny spells; "
    "take a light coat and an umbrella, and check the forecast the evening before."
)


def cases() -> list[tuple[str, str, str]]:
    """(name, grammar, an answer it takes)."""
    tools = read_tools([WEATHER])
    call = {"name": "get_weather", "arguments": ARGUMENTS}
    hermes_call = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    llama3_call = json.dumps({"name": "get_weather", "parameters": ARGUMENTS})
    schema = {"type": "json_schema", "json_schema": {"schema": WEATHER["function"]["parameters"]}}
    json_object = response_format_grammar({"type": "json_object"})
    return [
        ("json_object", json_object, json.dumps({"answer": PROSE})),
        ("json_schema", response_format_grammar(schema), json.dumps(ARGUMENTS)),
        ("generic tools, auto (reply)", ToolUse(tools).grammar(), json.dumps({"response": PROSE})),
        (
            "generic tools, required",
            ToolUse(tools, "required").grammar(),
            json.dumps({"tool_calls": [call]}),
        ),
        ("hermes tools, auto (prose)", ToolUse(tools, "auto", True, "hermes").grammar(), PROSE),
        (
            "hermes tools, auto (prose, then a call)",
            ToolUse(tools, "auto", True, "hermes").grammar(),
            f"Let me look.\n{hermes_call}",
        ),
        (
            "hermes tools, required",
            ToolUse(tools, "required", True, "hermes").grammar(),
            hermes_call,
        ),
        ("llama3 tools, auto (prose)", ToolUse(tools, "auto", False, "llama3").grammar(), PROSE),
        (
            "llama3 tools, required",
            ToolUse(tools, "required", False, "llama3").grammar(),
            llama3_call,
        ),
        (
            "json_object after a <think> block",
            after_reasoning(json_object, opened=False),
            f"<think>\n{PROSE}\n</think>\n\n" + json.dumps({"answer": "mild"}),
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=5, help="passes over each answer")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    vocab = tokenizer.tokenizer.get_vocab_size()
    grammars = Grammars(tokenizer.tokenizer, vocab, tokenizer.stop_ids)
    t0 = time.perf_counter()
    grammars.start(response_format_grammar({"type": "json_object"}))
    tables = time.perf_counter() - t0
    print(machine_line(cpu_info()))
    print(f"model: {args.model} ({vocab} tokens); token tables built in {tables:.2f} s\n")
    print("| grammar | tokens | first check (ms) | mask + advance p50 (us) | p90 (us) |")
    print("|---|---|---|---|---|")
    for name, grammar, answer in cases():
        t0 = time.perf_counter()
        error = grammars.error(grammar)
        check = time.perf_counter() - t0
        if error is not None:
            raise SystemExit(f"{name}: {error}")
        ids = tokenizer.encode(answer)
        times = []
        for _ in range(args.repeats):
            state = grammars.start(grammar)
            for token in ids:
                t0 = time.perf_counter()
                allowed = state.allowed()
                state.advance(token)
                times.append(time.perf_counter() - t0)
                if not allowed[token]:
                    raise SystemExit(f"{name}: the grammar refuses its own answer")
        p50, p90 = np.percentile(times, [50, 90]) * 1e6
        print(f"| {name} | {len(ids)} | {check * 1e3:.1f} | {p50:.0f} | {p90:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
