"""What chunked prefill does to running streams, in process: 8 streams
decode while one long prompt arrives; for each prefill budget (the
scheduler's `max_prefill_tokens`), the longest gap between two tokens of a
stream, the long request's time to its first token and the run's time.

    python benchmarks/chunked_prefill.py [--model smollm2-135m-instruct]
        [--prompt 3000] [--budgets 4096,1024,512,256]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from harness.serve_bench import cpu_model
from harness.threads import pin_max_workers
from pagedkv._ops.cpu_target import kernel_isa_line
from pagedkv.graphs.scheduler import Request, Scheduler
from pagedkv.models import load

STREAMS = 8
STREAM_TOKENS = 96
ARRIVAL_STEP = 8


def one_run(llm, budget: int, prompt_tokens: int, salt: int) -> tuple[float, float, float]:
    """(longest stream gap, long request's first-token time, run) in seconds."""
    rng = np.random.default_rng(salt)  # prompts of their own: no prefix hits
    vocab = llm.config.vocab_size
    streams = [
        Request(f"s{i}", tuple(rng.integers(100, vocab, 16).tolist()), STREAM_TOKENS)
        for i in range(STREAMS)
    ]
    long = tuple(rng.integers(100, vocab, prompt_tokens).tolist())
    requests = [*streams, Request("long", long, 4, arrival_step=ARRIVAL_STEP)]
    last: dict[str, float] = {}
    gaps: list[float] = []
    arrived: list[float] = []

    def on_step(step, generated, running) -> None:
        if step == ARRIVAL_STEP and not arrived:
            arrived.append(time.perf_counter())

    def on_token(s, token) -> None:
        now = time.perf_counter()
        rid = s.request.request_id
        if rid in last and rid != "long":
            gaps.append(now - last[rid])
        last.setdefault("first:" + rid, now)
        last[rid] = now

    scheduler = Scheduler(llm.engine, max_prefill_tokens=budget)
    t0 = time.perf_counter()
    scheduler.run(requests, on_step=on_step, on_token=on_token)
    return max(gaps), last["first:long"] - arrived[0], time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt", type=int, default=3000)
    parser.add_argument("--budgets", default="4096,1024,512,256")
    args = parser.parse_args()
    pin_max_workers()
    llm = load(args.model)
    print(f"CPU: {cpu_model()}\n{kernel_isa_line()}")
    print(f"{llm.name}: {STREAMS} streams of {STREAM_TOKENS} tokens; a {args.prompt}-token")
    print(f"prompt arrives at step {ARRIVAL_STEP}\n")
    print("| max_prefill_tokens | longest stream gap (ms) | long prompt's TTFT (s) | run (s) |")
    print("|---|---|---|---|")
    budgets = [int(b) for b in args.budgets.split(",")]
    one_run(llm, budgets[0], args.prompt, salt=0)  # warm-up: compiles, allocates
    for i, budget in enumerate(budgets):
        gap, ttft, total = one_run(llm, budget, args.prompt, salt=i + 1)
        print(f"| {budget} | {1e3 * gap:.0f} | {ttft:.2f} | {total:.1f} |", flush=True)


if __name__ == "__main__":
    main()
