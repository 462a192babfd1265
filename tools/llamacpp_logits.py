"""Does pagedkv compute what llama.cpp computes on the same GGUF? Top-1
agreement and log-probability error of pagedkv's logits against llama.cpp's,
teacher-forced on llama.cpp's own greedy tokens, after the two tokenizers
are compared on the prompts, a few harder texts and the prompts as chats
(each side's template and BOS).

    python tools/llamacpp_logits.py [--model gemma3-270m] [--prompts 8] [--tokens 64]
        [--weights f32|bf16|gguf] [--kv-dtype float32]
        [--llama-server PATH | --build-llama] [--json PATH]

llama.cpp: `llama-server -np 1` on the model's GGUF (the file pagedkv loads)
answers `/completion` (its native API) for each chat prompt, given as token
ids from pagedkv's tokenizer and chat template so both see the same input:
greedy (temperature 0, `ignore_eos`, so every prompt runs `--tokens` steps),
with `n_probs` 10 and `post_sampling_probs` false, which gives, at every step,
its chosen token and the log-probabilities (log-softmax of its raw logits)
of its 10 most likely tokens.

pagedkv: the model loaded in this process (`pagedkv.models.load`, given
`--weights`, `--kv-dtype` or `--dtype` only when they are set) prefills the same prompts and then
decodes llama.cpp's tokens, one step per token for all prompts in a batch,
so both score the same sequences. At each step: does pagedkv's argmax equal
llama.cpp's (the token it chose, except where EOS was its argmax: with
ignore_eos it takes the runner-up), and pagedkv's log-softmax at llama.cpp's
top-10 token ids minus llama.cpp's log-probabilities. Prints the agreement
rate, the mean and max absolute log-probability error (over the top 10 and
over the chosen token), and each disagreement with llama.cpp's margin
between the two tokens (a disagreement at a near tie is rounding; a large
margin is a bug).

llama.cpp's quantized matrix products (Q4_1 weights) quantize the
activations to 8 bits and its KV cache is float16, so on the Q4_1 GGUF the
figures measure that rounding as much as pagedkv; `--gguf` with a float32
GGUF (`llama-quantize --allow-requantize Q4_1.gguf F32.gguf F32`) and
`--llama-args "-ctk f32 -ctv f32"` compares both in float32.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from harness.serve_bench import PROMPTS  # noqa: E402
from llamacpp import (  # noqa: E402 - benchmarks/llamacpp.py, shared with the server comparison
    MODEL,
    Server,
    add_llama_arguments,
    cpu_info,
    gguf_tokenizer,
    llama_server_command,
    llama_server_from_arguments,
    pagedkv_commit,
)
from pagedkv.models.fetch import fetch_gguf  # noqa: E402

N_PROBS = 10
TOKENIZER_TEXTS = (
    "In 2024, 1234567 people paid $3.14159 each (about 9.99% more).",
    "I'M sure you'll SEE what they'd do; DON'T worry.",
    "def square(x):\n    return x**2  # squared\n\n\tdone",
    "  spaces around   and CamelCase HTTPServer iPhone  ",
    "über café naïve Ελληνικά русский 中文 日本語 🙂🙂 ¿qué? «quotes» — dashes…",
)
"""Texts beside the chat prompts whose token ids both sides must agree on:
digits, contractions, code, whitespace runs and other scripts, where
byte-level pre-tokenizers differ."""


def llama_steps(url: str, prompt: list[int], tokens: int) -> list[dict]:
    """llama.cpp's greedy continuation of `prompt`: per step the token it
    chose ("id", "logprob"), the argmax of its logits and its top-N_PROBS
    {id: logprob}. With ignore_eos llama.cpp never chooses EOS, so where EOS
    is its argmax it chooses the runner-up: "argmax" is what compares."""
    body = {
        "prompt": prompt,
        "n_predict": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "n_probs": N_PROBS,
        "post_sampling_probs": False,
        "cache_prompt": False,
        "return_tokens": True,
    }
    r = httpx.post(url + "/completion", json=body, timeout=600)
    r.raise_for_status()
    answer = r.json()
    steps = [
        {
            "id": p["id"],
            "logprob": p["logprob"],
            "argmax": p["top_logprobs"][0]["id"],
            "top": {t["id"]: t["logprob"] for t in p["top_logprobs"]},
        }
        for p in answer.get("completion_probabilities", [])
    ]
    # llama.cpp leaves out the probabilities of a token that ends inside a
    # UTF-8 character (random weights choose such byte tokens): the steps
    # are compared up to the first token it left out (none, where that is
    # the first).
    common = 0
    for step, token in zip(steps, answer["tokens"], strict=False):
        if step["id"] != token:
            break
        common += 1
    return steps[:common]


def token_mismatches(url: str, tokenizer, texts: list[str], chats: list[str]) -> list[dict]:
    """Where the two tokenizers give different ids, with both lists: each
    text through llama.cpp's `/tokenize` (special tokens parsed, BOS added
    where the model's prompts start with one) and pagedkv's `prompt_ids`;
    each of `chats` as a one-turn chat, rendered and tokenized by each side
    (llama.cpp's `/apply-template`, then `/tokenize`; pagedkv's
    `chat_prompt`)."""

    def post(path: str, body: dict) -> dict:
        r = httpx.post(url + path, json=body, timeout=60)
        r.raise_for_status()
        return r.json()

    def llama_ids(text: str) -> list[int]:
        return post("/tokenize", {"content": text, "add_special": True})["tokens"]

    mismatches = []
    for text in texts:
        theirs, ours = llama_ids(text), tokenizer.prompt_ids(text)
        if theirs != ours:
            mismatches.append({"text": text, "llama_cpp": theirs, "pagedkv": ours})
    for message in chats:
        turn = [{"role": "user", "content": message}]
        theirs = llama_ids(post("/apply-template", {"messages": turn})["prompt"])
        ours = tokenizer.chat_prompt(message)
        if theirs != ours:
            mismatches.append({"text": f"chat: {message}", "llama_cpp": theirs, "pagedkv": ours})
    return mismatches


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


def teacher_force(llm, prompts: list[list[int]], steps: list[list[dict]]) -> list[list[dict]]:
    """pagedkv's log-softmax at each of llama.cpp's steps (prefill, then one
    decode step per llama.cpp token, every prompt in one batch)."""
    ids = [f"llamacpp-cmp{i}" for i in range(len(prompts))]
    for rid in ids:
        llm.manager.add(rid)
    out: list[list[dict]] = [[] for _ in prompts]
    try:
        rows = llm.engine.prefill(ids, prompts)
        live = list(range(len(prompts)))
        t = 0
        while live:
            for i, row in zip(live, rows, strict=True):
                lp = log_softmax(row)
                want = steps[i][t]
                out[i].append(
                    {
                        "argmax": int(np.argmax(row)),
                        "chosen": float(lp[want["id"]]),
                        "top": {tok: float(lp[tok]) for tok in want["top"]},
                    }
                )
            t += 1
            live = [i for i in live if t < len(steps[i])]
            if live:
                rows = llm.engine.decode(
                    [ids[i] for i in live], [steps[i][t - 1]["id"] for i in live]
                )
    finally:
        for rid in ids:
            if rid in llm.manager:
                llm.manager.release(rid)
    return out


def compare(steps: list[list[dict]], ours: list[list[dict]]) -> dict:
    """Agreement of the argmaxes and log-probability errors over every step
    of every prompt."""
    agree, errors, chosen_errors, disagreements, masked = 0, [], [], [], 0
    for p, (theirs, mine) in enumerate(zip(steps, ours, strict=True)):
        for t, (a, b) in enumerate(zip(theirs, mine, strict=True)):
            errors.extend(abs(b["top"][tok] - lp) for tok, lp in a["top"].items())
            chosen_errors.append(abs(b["chosen"] - a["logprob"]))
            masked += a["id"] != a["argmax"]
            if b["argmax"] == a["argmax"]:
                agree += 1
                continue
            # None: pagedkv's argmax is not in llama.cpp's top N_PROBS at all.
            theirs_of_ours = a["top"].get(b["argmax"])
            margin = None if theirs_of_ours is None else a["top"][a["argmax"]] - theirs_of_ours
            disagreements.append(
                {
                    "prompt": p,
                    "step": t,
                    "llama_cpp": a["argmax"],
                    "pagedkv": b["argmax"],
                    "llama_cpp_margin": margin,
                }
            )
    total = sum(len(s) for s in steps)
    return {
        "steps": total,
        "agreement": agree / total,
        "eos_argmax_steps": masked,
        "disagreements": disagreements,
        "top10_abs_err_mean": float(np.mean(errors)),
        "top10_abs_err_max": float(np.max(errors)),
        "chosen_abs_err_mean": float(np.mean(chosen_errors)),
        "chosen_abs_err_max": float(np.max(chosen_errors)),
    }


def margin_text(margin: float | None) -> str:
    if margin is None:
        return f"pagedkv's token is not in llama.cpp's top {N_PROBS}"
    return f"{margin:.4f} nats"


def print_report(report: dict, options: dict, args, tokenizer) -> None:
    """The comparison as a few lines: agreement, errors, disagreements."""
    gguf_name = report["model"]
    pagedkv_desc = ", ".join(f"{k} {v}" for k, v in options.items())
    print(f"pagedkv ({pagedkv_desc}, {report['pagedkv']['commit']}) against llama.cpp")
    print(f"  llama.cpp: {report['llama_cpp']}; model {gguf_name}")
    if args.llama_args:
        print(f"  llama-server flags: {args.llama_args}")
    print(
        f"  {len(report['prompts'])} chat prompts x {args.tokens} greedy steps = "
        f"{report['steps']} steps, teacher-forced on llama.cpp's tokens"
    )
    texts, mismatched = report["tokenized_texts"], report["token_mismatches"]
    print(f"  tokenization: {texts - len(mismatched)} of {texts} texts and chats alike")
    for m in mismatched[:3]:
        print(f"    {m['text']!r}: llama.cpp {m['llama_cpp']}, pagedkv {m['pagedkv']}")
    print(
        f"  top-1 agreement: {report['agreement']:.2%} "
        f"({report['steps'] - len(report['disagreements'])} of {report['steps']})"
    )
    r = report
    print(
        f"  |log-prob error| over llama.cpp's top {N_PROBS}: mean {r['top10_abs_err_mean']:.4f}, "
        f"max {r['top10_abs_err_max']:.4f}"
    )
    print(
        f"  |log-prob error| of llama.cpp's chosen token: mean {r['chosen_abs_err_mean']:.4f}, "
        f"max {r['chosen_abs_err_max']:.4f}"
    )
    if r["eos_argmax_steps"]:
        print(
            f"  ({r['eos_argmax_steps']} steps where EOS was llama.cpp's argmax and, with "
            "ignore_eos, it went on with the runner-up; argmaxes are compared)"
        )
    for d in report["disagreements"][:10]:
        print(
            f"  disagreement: prompt {d['prompt']} step {d['step']}: llama.cpp "
            f"{tokenizer.decode([d['llama_cpp']])!r}, pagedkv {tokenizer.decode([d['pagedkv']])!r}"
            f" (llama.cpp's margin {margin_text(d['llama_cpp_margin'])})"
        )


def arguments() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL, help="a catalogue model (default %(default)s)")
    parser.add_argument("--prompts", type=int, default=8, help="chat prompts (default 8)")
    parser.add_argument("--tokens", type=int, default=64, help="greedy steps each (default 64)")
    parser.add_argument(
        "--weights", default=None, help="pagedkv's weights: f32, bf16 or gguf (load's default)"
    )
    parser.add_argument("--kv-dtype", default=None, help="pagedkv's KV dtype (load's default)")
    parser.add_argument(
        "--dtype", default=None, help="pagedkv's dtype, for a load() that takes one"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="llama-server's -t (default: physical cores)"
    )
    parser.add_argument(
        "--gguf",
        default=None,
        help="the GGUF both load (default: the model's, as pagedkv fetches it)",
    )
    parser.add_argument(
        "--llama-args",
        default="",
        help="extra llama-server flags, one string (e.g. '-ctk f32 -ctv f32': float32 KV)",
    )
    parser.add_argument("--json", default=None, help="write the report to this file")
    add_llama_arguments(parser)
    args = parser.parse_args()
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be in [1, {len(PROMPTS)}]")
    return args


def main() -> int:
    args = arguments()
    found = llama_server_from_arguments(args)
    if found is None:
        return 2
    binary, version = found
    gguf = Path(args.gguf) if args.gguf else fetch_gguf(args.model)
    tokenizer = gguf_tokenizer(gguf)
    questions = list(PROMPTS[: args.prompts])
    prompts = [tokenizer.chat_prompt(q) for q in questions]
    threads = args.threads or cpu_info()["physical_cores"]

    extra = ["-np", "1", "-c", "4096", *shlex.split(args.llama_args)]
    command = llama_server_command(binary, gguf, threads, *extra)
    texts = [*questions, *TOKENIZER_TEXTS]
    with Server("llama-server", command) as server:
        mismatches = token_mismatches(server.url, tokenizer, texts, questions)
        steps = [llama_steps(server.url, p, args.tokens) for p in prompts]
    kept = [i for i, s in enumerate(steps) if s]
    if len(kept) < len(prompts):
        print(f"  {len(prompts) - len(kept)} prompts left out: llama.cpp gave no probabilities")
    questions, prompts, steps = ([xs[i] for i in kept] for xs in (questions, prompts, steps))

    from pagedkv.models import load

    given = {"weights": args.weights, "kv_dtype": args.kv_dtype, "dtype": args.dtype}
    options = {k: v for k, v in given.items() if v is not None}
    try:
        llm = load(args.model, gguf=args.gguf, **options)
    except TypeError as e:  # an option this pagedkv's load() does not take
        print(f"error: pagedkv.models.load: {e}", file=sys.stderr)
        return 2
    options["kv_cache"] = str(llm.manager.dtype).rsplit(".", 1)[-1]  # DType.float32 -> float32
    ours = teacher_force(llm, prompts, steps)
    report = compare(steps, ours)
    report.update(
        {
            "model": gguf.name,
            "pagedkv": {**options, "commit": pagedkv_commit()},
            "llama_cpp": version,
            "llama_server": shlex.join(command),
            "prompts": questions,
            "tokens_per_prompt": args.tokens,
            "top_n": N_PROBS,
            "tokenized_texts": len(texts) + len(questions),
            "token_mismatches": mismatches,
        }
    )

    print_report(report, options, args, tokenizer)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
