"""Soak `pagedkv serve` with faults: 64 clients for a bounded time over a
pool small enough to force preemption, then checks that nothing leaked.

    python benchmarks/soak.py [--minutes 60] [--short] [--clients 64] [--json FILE]

The server runs in this process on a loopback port (so the manager's
validator can be sampled between steps); the clients are asyncio streams
over HTTP. Each client loops: a chat, a completion or a Responses API
request (a whole one's input items read back), short or long, some on one
shared system prompt, some chats offering a tool (some of those with a
response format beside it), some with n = 2 or 3, some streamed and dropped
mid-answer, some cancelled before their first token. Every `--every`
seconds it samples the manager's validator, free and cached pages, the
process's RSS and the window's latency percentiles.

At the end, with the clients gone and the server idle: the free pages are
what they were at the start (cached prefix pages count as free), RSS after
warm-up did not grow beyond `--rss-slack`, p99 inter-token latency of the
last quarter is within `--p99-slack` of the first's, and a sample of the
completed greedy answers is rerun one at a time and compared token for token
(answers whose prompt sits at a near-tie may flip under recompute; those
mismatches are counted, not hidden). Exit status 1 if a check fails.
`--short` is the CI mode: 2 minutes, 16 clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from harness.serve_bench import PROMPTS
from llamacpp import cpu_info, machine_line
from pagedkv.models import load
from pagedkv.serve import ServerThread

MODEL = "smollm2-135m-instruct"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "track_parcel",
            "description": "Where a parcel is",
            "parameters": {
                "type": "object",
                "properties": {"tracking_number": {"type": "string", "maxLength": 20}},
                "required": ["tracking_number"],
            },
        },
    }
]
"""Offered to a fifth of the chats (tool_choice auto or required), a third
of those with ANSWER_FORMAT beside them."""
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
    "required": ["answer"], "additionalProperties": False}}}  # fmt: skip
"""The content format of a tool chat's answer that calls no tool."""
SYSTEM = (
    "You are a careful assistant for a shipping company. Answer in two short "
    "sentences, name the policy you rely on, and never invent tracking numbers. "
) * 6


@dataclass
class Tally:
    started: int = 0
    completed: int = 0
    dropped: int = 0
    cancelled: int = 0
    errors: dict[int, int] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)
    """Seconds between two chunks of one stream, since the last sample (the
    sampler empties it: the server shares this process, so the soak's own
    bookkeeping must not grow)."""
    greedy: list[tuple[dict, str]] = field(default_factory=list)
    """(request body, its answer) of the first completed greedy requests."""
    keep_greedy: int = 0


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def body_for(rng: random.Random) -> tuple[str, dict, str]:
    """(path, body, fault) of one client request."""
    question = rng.choice(PROMPTS)
    long = rng.random() < 0.3
    fault = rng.choices(["none", "drop", "cancel"], [0.8, 0.12, 0.08])[0]
    greedy = rng.random() < 0.6
    common = {
        "model": MODEL,
        "max_tokens": rng.choice([8, 16, 48, 96]) if not long else 160,
        "temperature": 0 if greedy else 0.8,
        "n": rng.choice([1, 1, 1, 2, 3]),
        "stream": fault != "none" or rng.random() < 0.5,
    }
    if not greedy:
        common["seed"] = rng.randrange(1 << 30)
    kind = rng.random()
    if kind < 0.1:
        body = {"model": MODEL, "input": question * (4 if long else 1),
                "max_output_tokens": common["max_tokens"], "temperature": common["temperature"],
                "stream": common["stream"]}  # fmt: skip
        return "/v1/responses", body, fault
    if kind < 0.75:
        messages = [{"role": "user", "content": question * (4 if long else 1)}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        if rng.random() < 0.2:
            common |= {"tools": TOOLS, "tool_choice": rng.choice(["auto", "required"])}
            if rng.random() < 1 / 3:
                common["response_format"] = ANSWER_FORMAT
        return "/v1/chat/completions", {**common, "messages": messages}, fault
    return "/v1/completions", {**common, "prompt": question * (4 if long else 1)}, fault


async def client(c: httpx.AsyncClient, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        path, body, fault = body_for(rng)
        tally.started += 1
        try:
            if not body["stream"]:
                r = await c.post(path, json=body)
                if r.status_code != 200:
                    tally.errors[r.status_code] = tally.errors.get(r.status_code, 0) + 1
                    continue
                tally.completed += 1
                if path == "/v1/responses":
                    # A stored response's input items, as an agent reads them back.
                    items = await c.get(f"/v1/responses/{r.json()['id']}/input_items")
                    if items.status_code != 200:
                        tally.errors[items.status_code] = tally.errors.get(items.status_code, 0) + 1
                if (
                    path != "/v1/responses"
                    and body["temperature"] == 0
                    and body["n"] == 1
                    and (len(tally.greedy) < tally.keep_greedy)
                ):
                    tally.greedy.append((body, answer_of(r.json()["choices"][0])))
                continue
            await stream_one(c, path, body, fault, rng, tally)
        except httpx.HTTPError:
            tally.errors[-1] = tally.errors.get(-1, 0) + 1


async def stream_one(c, path, body, fault, rng, tally: Tally) -> None:
    stop_after = rng.randrange(1, 6) if fault == "drop" else None
    if fault == "cancel":
        # Gone before the first token: the request is cancelled in the queue.
        try:
            await asyncio.wait_for(c.post(path, json=body), timeout=rng.uniform(0.01, 0.2))
        except asyncio.TimeoutError:
            tally.cancelled += 1
        return
    async with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            tally.errors[r.status_code] = tally.errors.get(r.status_code, 0) + 1
            return
        last, chunks = time.monotonic(), 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if chunks:
                tally.gaps.append(now - last)
            last, chunks = now, chunks + 1
            if stop_after is not None and chunks >= stop_after:
                tally.dropped += 1
                return
    tally.completed += 1


def read_pool(manager) -> tuple[int, int]:
    """The manager's free and cached pages, after its validator passed
    (run on the engine thread, between steps)."""
    manager.validate()
    return manager.num_free_pages, manager.num_cached_pages


def percentile_ms(gaps: list[float], q: float) -> float:
    return float(np.percentile(gaps, q)) * 1e3 if gaps else float("nan")


async def soak(server, args, tally: Tally) -> list[dict]:
    samples = []
    t0 = time.monotonic()
    until = t0 + args.minutes * 60
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=server.url, timeout=args.hang_guard, limits=limits) as c:
        tasks = [asyncio.create_task(client(c, i, until, tally)) for i in range(args.clients)]
        while not all(t.done() for t in tasks):
            await asyncio.sleep(args.every)
            free, cached = await asyncio.to_thread(
                server.engine.between_steps, lambda: read_pool(server.engine.manager)
            )
            window, tally.gaps = tally.gaps, []
            samples.append(
                {
                    "t": round(time.monotonic() - t0, 1),
                    "free_pages": free,
                    "cached_pages": cached,
                    "rss_mb": round(rss_mb(), 1),
                    "itl_p50_ms": round(percentile_ms(window, 50), 2),
                    "itl_p99_ms": round(percentile_ms(window, 99), 2),
                    "completed": tally.completed,
                    "preemptions": server.engine.stats.preemptions,
                }
            )
            print(json.dumps(samples[-1]), flush=True)
        await asyncio.gather(*tasks)
    return samples


def answer_of(choice: dict) -> str:
    """What a greedy answer said: its text, or its message's content and
    calls (their ids aside)."""
    if "text" in choice:
        return choice["text"]
    message = choice["message"]
    calls = [call["function"] for call in message.get("tool_calls") or ()]
    return json.dumps([message["content"], calls])


async def rerun(server, greedy: list[tuple[dict, str]], count: int) -> tuple[int, int]:
    """Reruns `count` completed greedy answers one at a time: (same, differ)."""
    same = differ = 0
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
        for body, answer in greedy[:count]:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = (await c.post(path, json={**body, "stream": False})).json()["choices"][0]
            again = answer_of(r)
            same, differ = (same + 1, differ) if again == answer else (same, differ + 1)
    return same, differ


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--short", action="store_true", help="CI mode: 2 minutes, 16 clients")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--weights", default="gguf")
    parser.add_argument("--kv-pages", type=int, default=48, help="pages in the pool (small)")
    parser.add_argument("--rerun", type=int, default=24, help="greedy answers rerun at the end")
    parser.add_argument("--rss-slack", type=float, default=0.10, help="RSS growth allowed")
    parser.add_argument("--p99-slack", type=float, default=0.5, help="p99 ITL growth allowed")
    parser.add_argument("--hang-guard", type=float, default=600.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.short:
        args.minutes, args.clients, args.every = 2.0, 16, 5.0
    print("CPU:", machine_line(cpu_info()))
    # A first small load tells a page's bytes; the second sizes the pool.
    probe = load(MODEL, weights=args.weights, kv_memory=16 << 20)
    page_bytes = (16 << 20) // probe.manager.num_pages
    del probe
    # Answers are rerun alone and compared token for token: batch-invariant
    # decode keeps each one independent of what shared its batch.
    llm = load(
        MODEL, weights=args.weights, kv_memory=args.kv_pages * page_bytes, batch_invariant=True
    )
    tally = Tally(keep_greedy=args.rerun)
    with ServerThread(llm, max_num_seqs=64) as server:
        start_free = server.engine.between_steps(lambda: llm.manager.num_free_pages)
        samples = asyncio.run(soak(server, args, tally))
        assert server.engine.wait_idle(args.hang_guard)
        end_free = server.engine.between_steps(lambda: llm.manager.num_free_pages)
        server.engine.between_steps(llm.manager.validate)
        same, differ = asyncio.run(rerun(server, tally.greedy, args.rerun))
    warm = [s["rss_mb"] for s in samples[len(samples) // 4 :]] or [rss_mb()]
    # p99 of the first and last quarters: the median of their windows' p99s.
    p99s = [s["itl_p99_ms"] for s in samples if not np.isnan(s["itl_p99_ms"])]
    quarter = max(len(p99s) // 4, 1)
    first = float(np.median(p99s[:quarter])) if p99s else float("nan")
    last = float(np.median(p99s[-quarter:])) if p99s else float("nan")
    result = {
        "minutes": args.minutes,
        "clients": args.clients,
        "weights": args.weights,
        "requests": tally.started,
        "completed": tally.completed,
        "dropped_mid_stream": tally.dropped,
        "cancelled_before_first_token": tally.cancelled,
        "errors": tally.errors,
        "preemptions": samples[-1]["preemptions"] if samples else 0,
        "free_pages_start_end": [start_free, end_free],
        "rss_mb_after_warmup_min_max": [min(warm), max(warm)],
        "itl_p99_ms_first_last_quarter": [round(first, 2), round(last, 2)],
        "rerun_same_differ": [same, differ],
    }
    checks = {
        "no page leaked": end_free == start_free,
        "no 5xx": not any(code >= 500 for code in tally.errors),
        "RSS flat after warm-up": max(warm) <= min(warm) * (1 + args.rss_slack),
        "p99 did not drift": last <= first * (1 + args.p99_slack),
    }
    result["checks"] = checks
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"result": result, "samples": samples}, f, indent=2)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
