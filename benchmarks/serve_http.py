"""`pagedkv serve` under N concurrent streaming clients, beside offline
`LLM.generate` on the same prompts (the way vLLM's serving benchmark runs:
a fixed set of chat prompts, each client sends its next one as soon as its
last answer ends).

    python benchmarks/serve_http.py [--clients 8,32] [--prompts 64] [--max-tokens 64]

The offline run comes first in this process; then the server runs as a
`pagedkv serve` subprocess on a loopback port (so that clients and server do
not share an interpreter) and each client count is replayed against it.
Prints output tokens/s, time to first token and inter-token latency
(p50/p99) per client count, and the server's share of offline throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np

from harness.serve_bench import PROMPTS
from pagedkv.models import load
from pagedkv.serve.server import free_port

MODEL = "smollm2-135m-instruct"


def offline(prompts: list[str], max_tokens: int) -> float:
    """Output tokens/s of LLM.generate over all prompts at once (after a warm-up)."""
    llm = load(MODEL)
    llm.generate(prompts[:4], max_new_tokens=4)
    t0 = time.perf_counter()
    done = llm.generate(prompts, max_new_tokens=max_tokens)
    seconds = time.perf_counter() - t0
    return sum(len(c.token_ids) for c in done) / seconds


async def one_request(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int):
    """(output tokens, ttft, inter-token gaps) of one streamed chat request."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    times, tokens = [], 0
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c["delta"].get("content") for c in chunk["choices"]):
                times.append(time.perf_counter())
    return tokens, times[0] - t0, np.diff(times).tolist()


async def replay(url: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results = []
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:

        async def worker():
            while not queue.empty():
                results.append(await one_request(http, url, queue.get_nowait(), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        seconds = time.perf_counter() - t0
    ttft = np.array([r[1] for r in results])
    itl = np.array([g for r in results for g in r[2]])
    return {
        "clients": clients,
        "tokens_per_s": sum(r[0] for r in results) / seconds,
        "ttft_p50": np.percentile(ttft, 50),
        "ttft_p99": np.percentile(ttft, 99),
        "itl_p50": np.percentile(itl, 50),
        "itl_p99": np.percentile(itl, 99),
    }


def start_server(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedkv", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagedkv serve exited with status {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("pagedkv serve did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="8,32", help="comma-separated client counts")
    parser.add_argument("--prompts", type=int, default=64, help="requests per client count")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    base = offline(prompts, args.max_tokens)
    print(f"offline LLM.generate: {base:.1f} output tokens/s ({len(prompts)} prompts at once)")
    port = free_port()
    proc = start_server(port)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(replay(url, prompts[:4], 4, 4))  # warm-up
        print("clients  tokens/s  of offline  TTFT p50/p99 (s)  ITL p50/p99 (ms)")
        for clients in (int(c) for c in args.clients.split(",")):
            r = asyncio.run(replay(url, prompts, clients, args.max_tokens))
            print(
                f"{clients:7d}  {r['tokens_per_s']:8.1f}  {r['tokens_per_s'] / base:9.0%}  "
                f"{r['ttft_p50']:6.2f} / {r['ttft_p99']:6.2f}    "
                f"{1e3 * r['itl_p50']:6.1f} / {1e3 * r['itl_p99']:6.1f}",
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"(cpu count {os.cpu_count()}; server: pagedkv serve defaults)")


if __name__ == "__main__":
    main()
