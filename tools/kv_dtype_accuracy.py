"""What an 8-bit KV cache costs in accuracy: the same model with its cache
in float16 (the reference) and in another dtype, teacher-forced on the
reference's own greedy tokens.

    python tools/kv_dtype_accuracy.py [--model smollm2-135m-instruct]
        [--weights gguf] [--kv-dtype float8_e4m3fn] [--prompts 16] [--tokens 64]

For each chat prompt (benchmarks/harness/serve_bench.py's), the float16
model generates up to `--tokens` greedy tokens; then each model
prefills prompt + those tokens in one pass, keeping the logits after every
token, so both score the same sequences through their own caches. Prints,
over the generated positions: how often the argmax agrees, and the mean and
largest absolute difference of the log-softmax at the reference's token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from harness.serve_bench import PROMPTS  # noqa: E402
from llamacpp import cpu_info, machine_line, pagedkv_commit  # noqa: E402
from pagedkv.graphs.sampling import log_softmax  # noqa: E402
from pagedkv.models import load  # noqa: E402


def scored_rows(llm, sequences: list[list[int]]) -> list[np.ndarray]:
    """Each sequence's logits after every token, one prefill each."""
    rows = []
    for i, tokens in enumerate(sequences):
        rid = f"score-{i}"
        llm.manager.add(rid, [])
        try:
            _, every = llm.engine.prefill([rid], [tokens], every_row=[True])
        finally:
            llm.manager.release(rid)
        rows.append(every[0])
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--weights", default="gguf")
    p.add_argument("--kv-dtype", default="float8_e4m3fn")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    print(machine_line(cpu_info()), f"pagedkv {pagedkv_commit()}", sep="\n", flush=True)
    reference = load(args.model, args.weights, kv_dtype="float16")
    prompts = [reference.prompt_ids(PROMPTS[i % len(PROMPTS)]) for i in range(args.prompts)]
    answers = reference.generate(
        [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)], max_new_tokens=args.tokens
    )
    sequences = [p + list(a.token_ids) for p, a in zip(prompts, answers, strict=True)]
    want = scored_rows(reference, sequences)
    del reference
    other = load(args.model, args.weights, kv_dtype=args.kv_dtype)
    got = scored_rows(other, sequences)
    agree, errors = 0, []
    for prompt, seq, a, b in zip(prompts, sequences, got, want, strict=True):
        for pos in range(len(prompt) - 1, len(seq) - 1):
            chosen = seq[pos + 1]
            agree += int(np.argmax(a[pos]) == np.argmax(b[pos]))
            errors.append(abs(log_softmax(a[pos])[chosen] - log_softmax(b[pos])[chosen]))
    steps = len(errors)
    print(
        f"{args.model} ({args.weights} weights), {args.kv_dtype} cache against float16: "
        f"top-1 agreement {agree}/{steps} ({agree / steps:.1%}), log-probability error at "
        f"the chosen token mean {np.mean(errors):.4f}, max {np.max(errors):.4f} nats"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
