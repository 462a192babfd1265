"""`pagedkv generate`: answers prompts with a real model, streaming text.

All prompts are served together (continuous batching). Text mode streams
the answers in prompt order: the first prompt's answer as it is generated,
then each next one (what it generated meanwhile at once, then the rest as it
comes). `--json` prints one object per prompt, one per line, in prompt order.
Load failures are one line on stderr and exit status 2; a prompt that cannot
be served is reported in its place and the run exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


class _OrderedStream:
    """Prints each prompt's text in prompt order while all are generated."""

    def __init__(self, prompts: list[str], as_json: bool) -> None:
        self.prompts = prompts
        self.as_json = as_json
        self.pending = [""] * len(prompts)
        self.done = [False] * len(prompts)
        self.current = 0
        if not as_json:
            self._header(0)

    def on_text(self, index: int, text: str, finished: bool) -> None:
        if self.as_json:
            return
        if index == self.current:
            sys.stdout.write(text)
        else:
            self.pending[index] += text
        self.done[index] = self.done[index] or finished
        while self.current < len(self.prompts) and self.done[self.current]:
            self.current += 1
            sys.stdout.write("\n")
            if self.current < len(self.prompts):
                self._header(self.current)
                sys.stdout.write(self.pending[self.current])
        sys.stdout.flush()

    def _header(self, index: int) -> None:
        sys.stdout.write(f"\n>>> {self.prompts[index]}\n")


def run_generate(args: argparse.Namespace) -> int:
    """The `generate` subcommand; returns the exit status."""
    from ..graphs.structured import response_format_grammar
    from ..models import ModelError
    from ..models.forms import load_from_arguments

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.max_new_tokens < 1:
        say("pagedkv generate: error: --max-new-tokens must be at least 1")
        return 2
    try:
        response_format = json.loads(args.response_format) if args.response_format else None
        if response_format is not None and not isinstance(response_format, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        say(f"pagedkv generate: error: --response-format must be a JSON object ({e})")
        return 2
    try:
        response_format_grammar(response_format)  # its kind, before the model loads
    except ValueError as e:
        say(f"pagedkv generate: error: {e}")
        return 2
    try:
        llm = load_from_arguments(args, say)
    except ModelError as e:
        say(f"pagedkv generate: error: {e}")
        return 2
    stream = _OrderedStream(args.prompts, args.json)
    t0 = time.perf_counter()
    try:
        completions = llm.generate(
            args.prompts,
            max_new_tokens=args.max_new_tokens,
            chat=args.chat,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            system_prompt=args.system,
            on_text=stream.on_text,
            response_format=response_format,
        )
    except ValueError as e:
        say(f"pagedkv generate: error: {e}")
        return 2
    seconds = time.perf_counter() - t0
    for c in completions:
        if args.json:
            print(json.dumps(c.as_json(), ensure_ascii=False), flush=True)
        elif c.error is not None:
            print(f"\n>>> {c.prompt}\nerror: {c.error}")
    generated = sum(len(c.token_ids) for c in completions)
    say(
        f"{len(completions)} prompts, {generated} tokens in {seconds:.1f} s "
        f"({generated / max(seconds, 1e-9):.1f} tokens/s)"
    )
    return 1 if any(c.error for c in completions) else 0
