"""The workloads of serve_vs_llamacpp.py through pagedkv's scheduler in
process: no HTTP server and no client, so what the served figures would be
if neither took any CPU (on a 2-core machine they share the cores with
MAX's workers).

    python benchmarks/engine_ceiling.py [--model gemma3-270m]
        [--workloads one-client,32-clients,shared-prefix] [--rounds 1]

Each workload's requests go to one `Scheduler` as `pagedkv serve` builds it
(the GGUF's own weights, the int8 cache, its prefill budget, a detokenizer
per sample), with the workload's clients as its sequence limit: a client's
next request starts as soon as its last one ends, as a closed loop of
clients that take no time would send it. The prefix cache is emptied before
each round (a served round starts a new server), after one short warm-up
request. Prints tokens/s, the seconds for all, and the prefill and decode
calls' share, after the CPU and the ISA pagedkv's kernels were compiled for.

MAX's workers are left unpinned, as `pagedkv serve` leaves them
(MODULAR_ENABLE_AFFINITY=1 before the run pins them one per core).
PAGEDKV_CPU_TARGET=x86-64-v3 runs the AVX2 path.
"""

from __future__ import annotations

import argparse
import statistics

from serve_vs_llamacpp import WORKLOADS, Workload, conversations

from harness.serve_bench import cpu_model
from pagedkv._ops.cpu_target import kernel_isa_line
from pagedkv.graphs.scheduler import Request, Scheduler
from pagedkv.models import load
from pagedkv.models.chat import chat_prompt
from pagedkv.models.tokenizer import TextStream
from pagedkv.serve.engine import DEFAULT_MAX_PREFILL_TOKENS


def run_workload(llm, w: Workload, tag: str) -> dict:
    """One round of workload w through a new scheduler: its figures."""
    tok = llm.tokenizer
    scheduler = Scheduler(
        llm.engine,
        eos_token_ids=tok.stop_ids,
        detokenizer=lambda: TextStream(tok).push,
        max_num_seqs=w.clients,
        max_prefill_tokens=DEFAULT_MAX_PREFILL_TOKENS,
    )
    llm.manager.reset_prefix_cache()
    hello = chat_prompt(tok, [{"role": "user", "content": "Say hello."}]).ids
    scheduler.run([Request(f"{tag}-warm-up", tuple(hello), 4, ignore_eos=True)])
    requests = [
        Request(f"{tag}-{i}", tuple(chat_prompt(tok, chat).ids), w.max_tokens, ignore_eos=True)
        for i, chat in enumerate(conversations(w))
    ]
    sequences, stats = scheduler.run(requests)
    tokens = sum(len(s.tokens) for s in sequences)
    if tokens != w.requests * w.max_tokens:
        raise RuntimeError(f"{w.name}: {tokens} tokens, not {w.requests} x {w.max_tokens}")
    return {
        "tokens_per_s": tokens / stats.seconds,
        "seconds": stats.seconds,
        "prefills": len(stats.prefill_step_seconds),
        "prefill_s": sum(stats.prefill_step_seconds),
        "decodes": len(stats.decode_step_seconds),
        "decode_s": sum(stats.decode_step_seconds),
        "decode_ms_median": 1e3 * statistics.median(stats.decode_step_seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    workloads = [WORKLOADS[name] for name in args.workloads.split(",")]
    llm = load(args.model, weights="gguf")
    print(f"CPU: {cpu_model()}\n{kernel_isa_line()}\n{llm.name}, {llm.manager.dtype} cache\n")
    print("| workload | round | tokens/s | all done (s) | prefill calls | decode calls |")
    print("|---|---|---|---|---|---|")
    for w in workloads:
        for r in range(args.rounds):
            f = run_workload(llm, w, f"{w.name}-{r}")
            print(
                f"| {w.name} | {r + 1} | {f['tokens_per_s']:.1f} | {f['seconds']:.1f} | "
                f"{f['prefills']}, {f['prefill_s']:.2f} s | {f['decodes']}, "
                f"{f['decode_s']:.2f} s (median {f['decode_ms_median']:.1f} ms) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
