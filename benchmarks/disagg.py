"""Prefill/decode disaggregation beside one combined server, in one run:
`pagedkv serve --role prefill` + `--role decode` behind `pagedkv route
--prefill --decode` (1P+1D), then one `pagedkv serve`, on the same
machine and workload.

    python benchmarks/disagg.py [--prompts 16] [--per-prompt 2] [--clients 8]
        [--max-tokens 64] [--quick]

The workload: `--prompts` distinct system prompts of about 330 tokens
(benchmarks/routing.py's tenants), `--per-prompt` questions after each,
shuffled, from `--clients` concurrent streaming clients, greedy with
`ignore_eos`. Prints time to first token p50 and p99, inter-token latency
p50, output tokens/s and seconds for all, per setup and as 1P+1D / one,
then the decode instance's page-transfer counters, after the CPU and its
ISA flags.

On one machine the two instances share its cores (and the prompt's pages
cross loopback, not a network): this measures what the handshake, the
NIXL read and the split cost, not the gain of giving prefill and decode
their own GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import datetime

import httpx
import numpy as np
from routing import chats
from serve_vs_llamacpp import Workload, replay, warm_up

from harness.compare import comparison_rows
from llamacpp import MODEL, Server, ServerError, cpu_info, machine_line, pagedkv_commit


def figures(answers, seconds: float) -> dict:
    ok = [a for a in answers if a.error is None]
    ttft = np.array([a.ttft for a in ok])
    gaps = np.concatenate([a.gaps for a in ok if a.gaps]) if ok else np.array([np.nan])
    return {
        "finished": len(ok),
        "errors": len(answers) - len(ok),
        "first_error": next((a.error for a in answers if a.error), None),
        "ttft_p50": float(np.percentile(ttft, 50)) if ok else float("nan"),
        "ttft_p99": float(np.percentile(ttft, 99)) if ok else float("nan"),
        "itl_p50": float(np.percentile(gaps, 50)),
        "tokens_per_s": sum(a.tokens for a in ok) / seconds,
        "seconds": seconds,
    }


def serve(*flags: str) -> list[str]:
    return [sys.executable, "-m", "pagedkv", "serve", *flags]


def run_split(jobs, w: Workload, prefill_flags: tuple[str, ...] = ()) -> tuple[dict, dict]:
    prefill = Server("prefill", serve("--role", "prefill", *prefill_flags), start_timeout=900.0)
    decode = Server("decode", serve("--role", "decode"), start_timeout=900.0)
    proxy = None
    try:
        for s in (prefill, decode):
            s.start()
            warm_up(s.url, MODEL)
        command = [sys.executable, "-m", "pagedkv", "route", "--prefill", prefill.url]
        proxy = Server("proxy", [*command, "--decode", decode.url], start_timeout=120.0).start()
        warm_up(proxy.url, MODEL)
        answers, seconds, _ = asyncio.run(replay(proxy.url, w, jobs))
        stats = httpx.get(decode.url + "/kv_transfer/stats", timeout=10).json()
    finally:
        for s in (proxy, prefill, decode):
            if s is not None:
                s.stop()
    return figures(answers, seconds), stats


def run_one(jobs, w: Workload) -> dict:
    with Server("one", serve(), start_timeout=900.0) as one:
        warm_up(one.url, MODEL)
        answers, seconds, _ = asyncio.run(replay(one.url, w, jobs))
    return figures(answers, seconds)


def table(split: dict, one: dict) -> str:
    keys = ("ttft_p50", "ttft_p99", "itl_p50", "tokens_per_s", "seconds")
    lines = comparison_rows(("1P+1D", "one server", "1P+1D / one"), split, one, keys)
    lines.append(
        f"| finished / errors | {split['finished']} / {split['errors']} | "
        f"{one['finished']} / {one['errors']} | |"
    )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--per-prompt", type=int, default=2)
    p.add_argument("--words", type=int, default=250)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--nixl-progress-thread",
        action="store_true",
        help="give the prefill instance nixl's progress thread (serve's flag)",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 prompts x 1, 8 tokens")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.per_prompt, args.max_tokens = 4, 1, 8
    jobs = chats(args.prompts, args.per_prompt, args.words, args.seed)
    w = Workload("disagg", args.clients, len(jobs), args.max_tokens)
    print(machine_line(cpu_info()), flush=True)
    print(f"pagedkv {pagedkv_commit()}, {datetime.now():%Y-%m-%d %H:%M}", flush=True)
    print(
        f"{len(jobs)} chats ({args.prompts} system prompts x {args.per_prompt}), "
        f"{args.clients} clients, {args.max_tokens} tokens each",
        flush=True,
    )
    try:
        flags = ("--nixl-progress-thread",) if args.nixl_progress_thread else ()
        split, stats = run_split(jobs, w, flags)
        one = run_one(jobs, w)
    except ServerError as e:
        print(f"failed: {e}", file=sys.stderr)
        return 1
    print(table(split, one))
    print(
        f"decode instance: {stats['pulled_pages']} pages read ({stats['pulled_bytes']} bytes "
        f"in {stats['read_seconds']:.3f} s), {stats['skipped_pages']} held already, "
        f"{stats['failures']} failures"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
