"""Two `pagedkv serve` replicas behind `pagedkv route`: KV-aware routing
(Dynamo's KV indexer reading the replicas' KV events) against round-robin,
in one run, on a workload of many system prompts.

    python benchmarks/routing.py [--prompts 20] [--per-prompt 6] [--clients 8]
        [--kv-memory BYTES] [--max-tokens 16] [--quick]

The workload: `--prompts` distinct system prompts of about 330 tokens (a
tenant's instructions each), `--per-prompt` questions after each, in one
shuffled order, `--clients` concurrent streaming clients. Each replica's
pool (`--kv-memory`, default 128 MiB: about 5,800 tokens of SmolLM2's
float16 cache, less what the requests in flight hold) cannot keep all
twenty system prompts but keeps half of them, as a fleet's replicas hold a
share of its tenants'. For each policy, fresh replicas (cold caches,
each warmed with one short request) and a fresh router; the answers' usage
says how many prompt tokens each replica served from its cache. The
policies alternate for `--rounds` rounds each. Prints each round, then the
prefix-hit rate (cached / prompt tokens), time to first token p50 and p99,
seconds for the whole workload and output tokens/s, per policy (the
rounds' mean) and as KV-aware / round-robin, after the CPU and its ISA
flags.

The replicas share this machine's cores: absolute times are not a
cluster's, but both policies run on the same replicas' code and cores.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from datetime import datetime

import httpx
import numpy as np
from serve_vs_llamacpp import Workload, replay, warm_up

from harness.compare import comparison_rows
from llamacpp import MODEL, Server, ServerError, cpu_info, machine_line, pagedkv_commit

WORDS = (
    "account billing contract delivery engine filter garden harbor invoice journey kettle ledger "
    "meadow network orchard parcel quarry ribbon signal timber uniform valley window yarn zephyr "
    "amber beacon canyon dolphin ember falcon glacier horizon island jasmine koala lantern mosaic"
).split()


def system_prompt(k: int, words: int) -> str:
    """Tenant k's instructions: about `words` words, none shared with another tenant's
    past its first few tokens."""
    rng = random.Random(k)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are the assistant of tenant {k}. Follow these notes: {body}."


def chats(prompts: int, per_prompt: int, words: int, seed: int) -> list[list[dict]]:
    jobs = [
        [
            {"role": "system", "content": system_prompt(k, words)},
            {"role": "user", "content": f"Question {q} of tenant {k}: what should I do next?"},
        ]
        for k in range(prompts)
        for q in range(per_prompt)
    ]
    random.Random(seed).shuffle(jobs)
    return jobs


def run_policy(policy: str, args, jobs: list[list[dict]]) -> dict:
    """Fresh replicas and router for one policy; the workload's figures."""
    ports = [str(free) for free in _free_ports(2)]
    events = [f"tcp://127.0.0.1:{p}" for p in ports]
    replicas = [
        Server(f"replica-{i}", _serve(args, events[i]), start_timeout=900.0) for i in range(2)
    ]
    router = None
    try:
        for r in replicas:
            r.start()
            warm_up(r.url, MODEL)
        command = [sys.executable, "-m", "pagedkv", "route", "--policy", policy]
        for r in replicas:
            command += ["--replica", r.url]
        command += ["--kv-events", ",".join(events), "--indexer-port", str(_free_ports(1)[0])]
        router = Server(f"router-{policy}", command, start_timeout=120.0).start()
        w = Workload(policy, args.clients, len(jobs), args.max_tokens)
        answers, seconds, _ = asyncio.run(replay(router.url, w, jobs))
        stats = httpx.get(router.url + "/router/stats", timeout=10).json()
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()
    ok = [a for a in answers if a.error is None]
    ttft = np.array([a.ttft for a in ok])
    return {
        "policy": policy,
        "finished": len(ok),
        "errors": len(answers) - len(ok),
        "hit_rate": sum(a.cached_tokens for a in ok) / max(1, sum(a.prompt_tokens for a in ok)),
        "ttft_p50": float(np.percentile(ttft, 50)) if ok else float("nan"),
        "ttft_p99": float(np.percentile(ttft, 99)) if ok else float("nan"),
        "seconds": seconds,
        "tokens_per_s": sum(a.tokens for a in ok) / seconds,
        "routed": stats["routed"],
    }


def _serve(args, events: str) -> list[str]:
    return [
        sys.executable, "-m", "pagedkv", "serve", "--kv-memory", str(args.kv_memory),
        "--kv-events", events,
    ]  # fmt: skip


def _free_ports(n: int) -> list[int]:
    from pagedkv.serve.server import free_port

    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def mean_run(rounds: list[dict]) -> dict:
    """The rounds' figures averaged (counts summed)."""
    first = rounds[0]
    out = {
        k: float(np.mean([r[k] for r in rounds])) for k, v in first.items() if isinstance(v, float)
    }
    out["routed"] = [int(x) for x in np.sum([r["routed"] for r in rounds], axis=0)]
    out["finished"] = sum(r["finished"] for r in rounds)
    out["errors"] = sum(r["errors"] for r in rounds)
    return out


def table(results: list[dict]) -> str:
    kv, rr = results
    keys = ("hit_rate", "ttft_p50", "ttft_p99", "seconds", "tokens_per_s")
    lines = comparison_rows(("KV-aware", "round-robin", "KV-aware / round-robin"), kv, rr, keys)
    lines.append(f"| requests per replica | {kv['routed']} | {rr['routed']} | |")
    lines.append(f"| finished / errors | {kv['finished']} / {kv['errors']} | "
                 f"{rr['finished']} / {rr['errors']} | |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--per-prompt", type=int, default=6)
    p.add_argument("--words", type=int, default=250, help="words per system prompt")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-memory", type=int, default=128 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per policy")
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 prompts x 2, 1 round")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.per_prompt, args.clients, args.rounds = 4, 2, 4, 1
    jobs = chats(args.prompts, args.per_prompt, args.words, args.seed)
    print(machine_line(cpu_info()), flush=True)
    print(f"pagedkv {pagedkv_commit()}, {datetime.now():%Y-%m-%d %H:%M}", flush=True)
    print(
        f"{len(jobs)} chats ({args.prompts} system prompts x {args.per_prompt}), "
        f"{args.clients} clients, {args.max_tokens} tokens each, "
        f"--kv-memory {args.kv_memory} per replica",
        flush=True,
    )
    runs: dict[str, list[dict]] = {"kv": [], "round-robin": []}
    for _ in range(args.rounds):  # alternating: the host's drift falls on both
        for policy in runs:
            try:
                runs[policy].append(run_policy(policy, args, jobs))
            except ServerError as e:
                print(f"{policy}: failed: {e}", file=sys.stderr)
                return 1
            r = runs[policy][-1]
            print(
                f"  {policy}: hit rate {r['hit_rate']:.1%}, TTFT p50 {r['ttft_p50']:.2f} s, "
                f"{r['seconds']:.1f} s",
                flush=True,
            )
    results = [mean_run(runs["kv"]), mean_run(runs["round-robin"])]
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
