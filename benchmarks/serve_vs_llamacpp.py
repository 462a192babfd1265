"""`pagedkv serve` beside llama.cpp's `llama-server` on the same GGUF
(SmolLM2-135M-Instruct, Q4_1), over OpenAI's streaming chat API.

    python benchmarks/serve_vs_llamacpp.py [--servers pagedkv-f32,pagedkv-bf16,llamacpp]
        [--workloads one-client,32-clients,shared-prefix] [--quick] [--json PATH]
        [--llama-server PATH | --build-llama] [--time-limit 300] [--rounds 1]

Each server runs alone (a subprocess on a loopback port, stopped before the
next starts): each `pagedkv serve` variant (a row of PAGEDKV_VARIANTS: extra
flags), and llama.cpp as `llama-server -m GGUF -t <physical cores> -np 32
-c 65536`. Every request is greedy (temperature 0) with `ignore_eos`, so it
generates exactly max_tokens tokens on every server; the count is read from
the stream's usage (`stream_options.include_usage`) and checked. Workloads:

- one-client: 8 short chats x 128 tokens, one at a time: output tokens/s,
  inter-token latency p50 (ms/token) and time to first token p50.
- 32-clients: 64 short chats x 128 tokens from 32 concurrent clients, each
  sending its next chat when its last one ends: output tokens/s over the
  run, time to first token p50 / p99, inter-token latency p50.
- shared-prefix: 32 clients, 64 distinct questions after one fixed system
  prompt of about 930 tokens (SYSTEM_PROMPT): output tokens/s and seconds
  until all 64 are done, capped at --time-limit seconds per server (then
  the row says how many finished).

Each workload starts with one short warm-up request, so compiling and
loading are not counted. Time to first token is the first chunk with text;
inter-token latency the gaps between chunks with text. Prints one markdown
table (rows: workloads, columns: servers, then each pagedkv variant's figure
divided by llama.cpp's), after the CPU, its ISA flags, llama.cpp's version
and the date. A server that does not start is a failed column, not a crash.
`--quick` is a smoke run with small counts. `--rounds N` runs every
server N times, alternating, and shows the medians, then each round's
tokens/s ratio (this host's neighbours move a row by 10-20% between runs).

The header names the code path each side runs: the ISA pagedkv's kernels
were compiled for (the host's, or PAGEDKV_CPU_TARGET's) and how llama.cpp
was built. On an AVX-512 host, `PAGEDKV_CPU_TARGET=x86-64-v3` with
`--llama-server` pointing at a build with GGML_NATIVE off and only AVX2,
FMA, F16C and BMI2 on compares the two AVX2 code paths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

from harness.serve_bench import PROMPTS
from harness.threads import thread_cpu_seconds
from llamacpp import (
    MODEL,
    Server,
    ServerError,
    add_llama_arguments,
    cpu_info,
    gguf_tokenizer,
    llama_server_command,
    llama_server_from_arguments,
    machine_line,
    pagedkv_commit,
    pagedkv_serve_command,
)
from pagedkv.models.fetch import fetch_gguf
from pagedkv.models.tokenizer import FAMILY_CHAT_TEMPLATES

LLAMACPP = "llamacpp"
PAGEDKV_VARIANTS = {
    "pagedkv-f32": ["--weights", "f32"],
    "pagedkv-bf16": ["--weights", "bf16"],
    "pagedkv-gguf": ["--weights", "gguf"],
    "pagedkv-gguf-f16kv": ["--weights", "gguf", "--kv-dtype", "float16"],
}
"""`pagedkv serve` flags of each pagedkv column: a new variant is one line."""
LLAMA_ARGS = ["-np", "32", "-c", "65536"]
"""llama-server's slots and context (2048 tokens per slot), after -m and -t."""
DEFAULT_SERVERS = "pagedkv-f32,pagedkv-bf16,pagedkv-gguf,llamacpp"
START_TIMEOUT = 1200.0
"""Seconds a server may take to answer /health (pagedkv compiles on a cold cache)."""
REQUEST_TIMEOUT = 600.0

SYSTEM_PROMPT = """\
You are Sol, the support assistant of Lumen Home Energy, a company that sells and services \
home solar panels, the Lumen Cell home battery and the Lumen Hub controller. Follow this manual \
in every answer.

1. Tone. Be friendly, calm and brief. Use plain words, short sentences and at most five bullet \
points. Never blame the customer. If you do not know something, say so and offer to connect the \
customer with a human agent.

2. Products. The Lumen Cell stores 10 kilowatt-hours and can be stacked up to three units for \
30 kilowatt-hours. It delivers 5 kilowatts of continuous power and 7 kilowatts for ten seconds \
when a motor starts. The Lumen Hub is the wall controller that decides when to charge the \
battery, when to use it and when to sell power back to the grid. Lumen solar panels come in \
two sizes: the Lumen 400, rated at 400 watts, and the Lumen 450, rated at 450 watts. All panels \
are black, weigh 21 kilograms and measure 1.7 by 1.1 meters.

3. The app. Customers see their home in the Lumen app for phones and tablets. The home screen \
shows four numbers: solar power now, home use now, battery level and grid power. A green arrow \
means power flows to the grid, an orange arrow means power comes from the grid. The History \
tab shows days, weeks, months and years. The Settings tab holds the three battery modes.

4. Battery modes. Self Use keeps solar power in the battery for the evening and is the default. \
Time of Use charges the battery when grid power is cheap and uses it when grid power is \
expensive; the customer enters the cheap and expensive hours from their bill. Backup Only keeps \
the battery full for power cuts and uses it for nothing else. A change of mode takes effect \
within five minutes.

5. Power cuts. When the grid fails, the Hub opens its switch in under 20 milliseconds and the \
house runs on the battery and the panels. Only the circuits wired to the backup panel keep \
power; these are usually the fridge, lights, internet router and a few outlets. The app sends \
a notice when a power cut starts and when it ends. If the battery is below 10 percent during a \
power cut, the Hub turns the backup circuits off to protect the battery and turns them on again \
when the sun has charged it to 20 percent.

6. Lights on the Lumen Cell. Solid white means normal. Slow blinking white means charging. Solid \
blue means the battery is in Backup Only mode. Blinking yellow means the battery is too hot or \
too cold and has paused; it resumes by itself between 0 and 45 degrees Celsius. Solid red means \
a fault: ask the customer to read the four-digit code in the app under Settings, Devices, and \
open a ticket.

7. Common questions. Panels make less power on cloudy days, in winter and when dirty; rain \
cleans them, and customers must never climb on the roof to clean them. Output drops by about \
0.4 percent a year as panels age. If the app shows no data, ask the customer to check that the \
Hub's light is green and that the home Wi-Fi works; the Hub keeps data for 30 days.

8. Warranty. Panels: 25 years on power output and 15 years on parts. Lumen Cell: 10 years or \
6,000 full cycles, whichever comes first. Lumen Hub: 10 years. Installation work: 5 years. The \
warranty follows the house if it is sold.

9. Safety. Never tell a customer to open the Lumen Cell, the Hub or the panel junction boxes. \
If a customer smells burning or sees smoke, tell them to leave the area, call the fire \
department and then call Lumen's emergency line at 1-800-555-0199, open day and night.

10. Visits. A technician visit can be booked in the app under Help, Book a visit, on weekdays \
from 8 am to 6 pm. A visit outside the warranty costs 95 dollars plus parts.

Answer the customer's question now, using only this manual."""
"""The shared-prefix workload's system prompt: a fixed support manual (926
tokens by the GGUF's tokenizer; the script prints the count it measures)."""

QUESTIONS = (
    "How much energy does one Lumen Cell store?",
    "Can I stack more than one battery?",
    "What is the largest battery setup I can have?",
    "How much power can the battery deliver at once?",
    "What does the Lumen Hub do?",
    "Which solar panel sizes do you sell?",
    "What is the difference between the Lumen 400 and the Lumen 450?",
    "What do the four numbers on the app's home screen mean?",
    "What does a green arrow in the app mean?",
    "Why is there an orange arrow in my app?",
    "Which battery mode is the default?",
    "How does Time of Use mode work?",
    "Where do I find my cheap and expensive hours?",
    "What is Backup Only mode for?",
    "How long does it take for a new battery mode to work?",
    "What happens in my house when the grid fails?",
    "How fast does the Hub switch to the battery in a power cut?",
    "Which outlets keep working during a power cut?",
    "Will my fridge stay on during a blackout?",
    "What happens if the battery gets very low during a power cut?",
    "When do the backup circuits come back on after the battery runs low?",
    "My battery light is solid white. Is that normal?",
    "Why is the light on my battery blinking slowly?",
    "The battery light is solid blue. What does that mean?",
    "Why is the light on my battery blinking yellow?",
    "My battery paused because it is cold. What should I do?",
    "At what temperatures does the battery work?",
    "The light on my battery is solid red. What do I do?",
    "Where do I find the fault code of my battery?",
    "Why did my panels make so little power today?",
    "Do my panels make less power in winter?",
    "Should I wash my solar panels?",
    "Can I climb on my roof to clean the panels?",
    "How much power do panels lose each year?",
    "My panels are ten years old. How much weaker are they?",
    "The app shows no data. What should I check?",
    "What color should the Hub's light be?",
    "Will I lose my data if my Wi-Fi was down for a week?",
    "How long does the Hub keep data without internet?",
    "How long is the warranty on the panels' power output?",
    "How long are the panel parts covered?",
    "What is the warranty on the Lumen Cell?",
    "Does the battery warranty end after a number of cycles?",
    "How long is the Lumen Hub covered?",
    "Is the installation work under warranty?",
    "I am selling my house. What happens to the warranty?",
    "Can I open the battery to look inside?",
    "Is it safe to open the Hub?",
    "I smell something burning near my battery. What should I do?",
    "There is smoke coming from the Hub! Help!",
    "What is the emergency phone number?",
    "Is the emergency line open at night?",
    "How do I book a technician visit?",
    "On which days can a technician come?",
    "What hours do technicians work?",
    "How much does a visit cost outside the warranty?",
    "Can a technician come on Saturday?",
    "Can I run my air conditioner from the battery?",
    "Can the battery start a pump with a big motor?",
    "How many batteries do I need for 20 kilowatt-hours?",
    "Does the battery sell power back to the grid?",
    "Can I use the app on a tablet?",
    "Who decides when my battery charges?",
    "Which mode keeps my battery full all the time?",
)
"""64 distinct questions for the shared-prefix workload."""
assert len(set(QUESTIONS)) == 64


@dataclass(frozen=True)
class Workload:
    name: str
    clients: int
    requests: int
    max_tokens: int
    shared_prefix: bool = False
    time_limit: float | None = None
    model: str = MODEL
    """The catalogue model the requests name (the servers serve it)."""


WORKLOADS = {
    "one-client": Workload("one-client", 1, 8, 128),
    "32-clients": Workload("32-clients", 32, 64, 128),
    "shared-prefix": Workload("shared-prefix", 32, 64, 128, shared_prefix=True),
}
QUICK = {
    "one-client": Workload("one-client", 1, 2, 16),
    "32-clients": Workload("32-clients", 8, 16, 16),
    "shared-prefix": Workload("shared-prefix", 8, 16, 16, shared_prefix=True),
}


@dataclass
class Answer:
    """One streamed request, as the client saw it."""

    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None


def conversations(w: Workload) -> list[list[dict]]:
    """The workload's requests' messages, in the order clients take them."""
    if w.shared_prefix:
        return [
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
            for q in (QUESTIONS * (w.requests // len(QUESTIONS) + 1))[: w.requests]
        ]
    return [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(w.requests)]


async def one_request(
    http: httpx.AsyncClient, url: str, messages: list[dict], w: Workload
) -> Answer:
    """Streams one chat completion; the token count comes from its usage chunk."""
    max_tokens = w.max_tokens
    body = {
        "model": w.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    answer = Answer()
    t0 = time.perf_counter()
    times = []
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                answer.error = f"HTTP {r.status_code}: {text[:200]}"
                return answer
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    answer.error = f"stream error: {chunk['error']}"[:300]
                    return answer
                usage = chunk.get("usage")
                if usage:
                    answer.tokens = usage["completion_tokens"]
                    answer.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    answer.cached_tokens = details.get("cached_tokens") or 0
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", ())):
                    times.append(time.perf_counter())
    except httpx.HTTPError as e:
        answer.error = f"{type(e).__name__}: {e}"
        return answer
    answer.seconds = time.perf_counter() - t0
    if not times:
        answer.error = "no text streamed"
        return answer
    answer.ttft = times[0] - t0
    answer.gaps = np.diff(times).tolist()
    return answer


async def replay(
    url: str, w: Workload, chats: list[list[dict]] | None = None
) -> tuple[list[Answer], float, bool]:
    """Runs the workload (its conversations, or `chats`): `clients` workers
    take the next one when their last one ends. Returns the answers, the
    seconds from the first request to the last answer (or to the time limit)
    and whether the limit cut the run short (unfinished requests are
    cancelled)."""
    queue = deque(conversations(w) if chats is None else chats)
    answers: list[Answer] = []
    # A new connection per request: llama-server closes idle keep-alive
    # connections, and a request sent on one as it closes fails.
    limits = httpx.Limits(max_connections=w.clients + 4, max_keepalive_connections=0)
    timeout = httpx.Timeout(REQUEST_TIMEOUT, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:

        async def worker() -> None:
            while queue:
                answers.append(await one_request(http, url, queue.popleft(), w))

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(w.clients)]
        done, pending = await asyncio.wait(tasks, timeout=w.time_limit)
        seconds = time.perf_counter() - t0
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()  # a bug in the client, not a failed request: raise it
    return answers, seconds, bool(pending)


def summarize(w: Workload, answers: list[Answer], seconds: float, cut: bool) -> dict:
    """The workload's figures (times in seconds) and its failures."""
    ok = [a for a in answers if a.error is None]
    errors = [a.error for a in answers if a.error is not None]
    wrong = [a.tokens for a in ok if a.tokens != w.max_tokens]
    gaps = [g for a in ok for g in a.gaps]
    ttft = [a.ttft for a in ok]

    def pct(values, q):
        return float(np.percentile(values, q)) if values else None

    return {
        "clients": w.clients,
        "requests": w.requests,
        "max_tokens": w.max_tokens,
        "finished": len(ok),
        "time_limit": w.time_limit,
        "time_limit_hit": cut,
        "seconds": seconds,
        "output_tokens": sum(a.tokens for a in ok),
        "tokens_per_s": sum(a.tokens for a in ok) / seconds if ok else None,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(gaps, 50),
        "itl_p99": pct(gaps, 99),
        "prompt_tokens": sorted({a.prompt_tokens for a in ok}),
        "cached_tokens_mean": float(np.mean([a.cached_tokens for a in ok])) if ok else None,
        "token_count_mismatches": wrong,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def warm_up(url: str, model: str) -> None:
    """One short request, so compiling and first allocations are not timed."""
    chat = [{"role": "user", "content": "Say hello."}]  # in no workload: caches nothing they use
    warm = Workload("warm-up", 1, 1, 4, model=model)
    answers, _, _ = asyncio.run(replay(url, warm, [chat]))
    if answers[0].error is not None:
        raise ServerError(f"the warm-up request failed: {answers[0].error}")


def engine_steps(url: str) -> dict[str, float] | None:
    """pagedkv's step histogram from /metrics: seconds and counts of its
    prefill and decode calls so far (None for a server without it)."""
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    found = re.findall(r'^pagedkv_step_seconds_(sum|count)\{phase="(\w+)"\} (\S+)$', text, re.M)
    return {f"{phase}_{what}": float(v) for what, phase, v in found} or None


def step_share(before: dict | None, after: dict | None, seconds: float) -> dict:
    """The engine's calls during a workload: prefill and decode seconds and
    counts, and the share of the wall time they took."""
    if not before or not after:
        return {}
    got = {k: after[k] - before.get(k, 0.0) for k in after}
    got["engine_share"] = (got.get("prefill_sum", 0.0) + got.get("decode_sum", 0.0)) / seconds
    return {"steps": got}


def pagedkv_isa_line() -> str:
    """What pagedkv's kernels are compiled for (`kernel_isa_line`), asked in
    a process of its own: the probe starts MAX's runtime, whose poller
    would then wake thousands of times a second in this client (about a
    tenth of a core) and take that from whichever server it measures."""
    probe = "from pagedkv._ops.cpu_target import kernel_isa_line; print(kernel_isa_line())"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False
    )
    return result.stdout.strip() or f"kernels unknown ({result.stderr.strip()[-200:]})"


def cpu_per_token(before: dict, after: dict, tokens: int) -> dict:
    """The server's CPU milliseconds per output token during a workload, by
    thread name (`thread_cpu_seconds`): on a machine of few cores, what its
    threads besides the compute ones use is taken from the computing."""
    if not before or not after or not tokens:
        return {}
    used = {name: 1e3 * (after[name] - before.get(name, 0.0)) / tokens for name in after}
    return {"cpu_ms_per_token": {k: v for k, v in sorted(used.items()) if v > 0}}


def run_server(
    name: str, command: list[str], workloads: list[Workload], keep_log: bool = False
) -> dict:
    """Starts one server, runs the workloads against it, stops it. Records
    the 1-minute load average before each workload (other work on the
    machine shows there)."""
    result = {"command": shlex.join(command), "workloads": {}, "load_before": {}}
    server = Server(name, command, start_timeout=START_TIMEOUT, keep_log=keep_log)
    print(f"\n{name}: {shlex.join(command)}", flush=True)
    try:
        server.start()
        result["start_seconds"] = server.start_seconds
        print(f"  healthy after {server.start_seconds:.1f} s", flush=True)
        for w in workloads:
            if server.proc is None or server.proc.poll() is not None:
                raise ServerError(f"{name} exited: {server.log_tail(3)}")
            warm_up(server.url, w.model)
            result["load_before"][w.name] = os.getloadavg()[0]
            steps = engine_steps(server.url)
            cpu, client_cpu = thread_cpu_seconds(server.proc.pid), time.process_time()
            answers, seconds, cut = asyncio.run(replay(server.url, w))
            client_cpu = time.process_time() - client_cpu
            r = summarize(w, answers, seconds, cut)
            r |= step_share(steps, engine_steps(server.url), seconds)
            r |= cpu_per_token(cpu, thread_cpu_seconds(server.proc.pid), r["output_tokens"])
            if r["output_tokens"]:
                r["client_cpu_ms_per_token"] = 1e3 * client_cpu / r["output_tokens"]
            result["workloads"][w.name] = r
            print(f"  {w.name}: {progress_line(r)}", flush=True)
    except ServerError as e:
        result["failed"] = str(e)
        print(f"  failed: {e}", flush=True)
    finally:
        server.stop()
        if keep_log:
            print(f"  log: {server.log_path}", flush=True)
    return result


def progress_line(r: dict) -> str:
    if not r["finished"]:
        return f"no request finished ({r['errors']} errors: {r['first_error']})"
    line = (
        f"{r['finished']}/{r['requests']} done in {r['seconds']:.1f} s, "
        f"{r['tokens_per_s']:.1f} tokens/s, TTFT p50 {r['ttft_p50']:.3f} s, "
        f"ITL p50 {1e3 * r['itl_p50']:.1f} ms, prompt tokens {r['prompt_tokens'][:3]}"
    )
    if "steps" in r:
        st = r["steps"]
        line += (
            f"; engine calls {100 * st['engine_share']:.0f}% of the time: "
            f"{st.get('prefill_count', 0):.0f} prefills {st.get('prefill_sum', 0):.1f} s, "
            f"{st.get('decode_count', 0):.0f} decode steps {st.get('decode_sum', 0):.1f} s"
        )
    if r.get("cpu_ms_per_token"):
        used = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_token"].items())
        line += f"; server CPU ms per token by thread: {used}"
    if r.get("client_cpu_ms_per_token"):
        line += f"; this client's CPU {r['client_cpu_ms_per_token']:.2f} ms per token"
    if r["errors"]:
        line += f", {r['errors']} errors ({r['first_error']})"
    if r["token_count_mismatches"]:
        line += f", token counts != {r['max_tokens']}: {r['token_count_mismatches'][:5]}"
    return line


# ---------------------------------------------------------------------- table

ROWS = {
    "one-client": [
        ("tokens/s", "tokens_per_s", 1.0, "{:.1f}"),
        ("ms/token (ITL p50)", "itl_p50", 1e3, "{:.1f}"),
        ("TTFT p50 (ms)", "ttft_p50", 1e3, "{:.0f}"),
    ],
    "32-clients": [
        ("tokens/s", "tokens_per_s", 1.0, "{:.1f}"),
        ("TTFT p50 (s)", "ttft_p50", 1.0, "{:.2f}"),
        ("TTFT p99 (s)", "ttft_p99", 1.0, "{:.2f}"),
        ("ITL p50 (ms)", "itl_p50", 1e3, "{:.1f}"),
    ],
    "shared-prefix": [
        ("tokens/s", "tokens_per_s", 1.0, "{:.1f}"),
        ("time for all (s)", "seconds", 1.0, "{:.1f}"),
    ],
}


def cell(r: dict | None, key: str, scale: float, fmt: str) -> tuple[str, float | None]:
    """A table cell's text and its value (None where there is no figure)."""
    if r is None:
        return "failed", None
    if key == "seconds" and (r["time_limit_hit"] or r["finished"] < r["requests"]):
        return f"{r['finished']} of {r['requests']} done after {r['seconds']:.0f} s", None
    if r[key] is None:
        return "failed", None
    mark = "*" if r["token_count_mismatches"] or r["errors"] else ""
    return fmt.format(scale * r[key]) + mark, r[key]


def format_table(header: list[str], results: dict, workloads: list[Workload]) -> str:
    """The markdown table: rows workload x metric, columns servers then
    each pagedkv column divided by llama.cpp's."""
    names = [n for n in results if n != LLAMACPP] + [n for n in results if n == LLAMACPP]
    ratios = [n for n in names if n != LLAMACPP] if LLAMACPP in names else []
    lines = [*header, ""]
    columns = ["workload", "metric", *names, *(f"{n} / llama.cpp" for n in ratios)]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    notes = []
    for w in workloads:
        label = f"{w.name} ({w.requests} x {w.max_tokens} tokens, {w.clients} clients)"
        for metric, key, scale, fmt in ROWS[w.name]:
            texts, values = [], {}
            for n in names:
                text, value = cell(results[n]["workloads"].get(w.name), key, scale, fmt)
                texts.append(text)
                values[n] = value
            for n in ratios:
                a, b = values[n], values[LLAMACPP]
                texts.append(f"{a / b:.2f}x" if a is not None and b else "-")
            lines.append(f"| {label} | {metric} | " + " | ".join(texts) + " |")
            label = ""
    if ratios:
        notes.append(
            "Ratios are the pagedkv figure divided by llama.cpp's: above 1 is better for "
            "tokens/s, worse for times."
        )
    loads = [
        f"{n} {', '.join(f'{v:.1f}' for v in results[n]['load_before'].values())}"
        for n in names
        if results[n]["load_before"]
    ]
    if loads:
        notes.append(
            f"1-minute load average before each workload (this machine has {os.cpu_count()} "
            f"logical cores): {'; '.join(loads)}."
        )
    for n in names:
        if "failed" in results[n]:
            notes.append(f"{n}: {results[n]['failed']}")
        for wname, r in results[n]["workloads"].items():
            if r["token_count_mismatches"] or r["errors"]:
                notes.append(
                    f"* {n}, {wname}: {len(r['token_count_mismatches'])} requests generated "
                    f"other than {r['max_tokens']} tokens, {r['errors']} failed "
                    f"({r['first_error'] or r['token_count_mismatches'][:5]})"
                )
    return "\n".join(lines + [""] + notes)


MEDIAN_KEYS = ("seconds", "tokens_per_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
"""A workload's figures that `median_result` takes the median of."""


def median_result(runs: list[dict]) -> dict:
    """One server's rounds as one result: each workload's figures the
    median over the rounds that ran it (None where one of them has none),
    its failures and token counts those of all rounds together."""
    if len(runs) == 1:
        return runs[0]
    merged = {"command": runs[0]["command"], "workloads": {}, "load_before": {}}
    failures = [r["failed"] for r in runs if "failed" in r]
    if failures:
        merged["failed"] = "; ".join(failures)
    for name in runs[0]["workloads"]:
        done = [r["workloads"][name] for r in runs if name in r["workloads"]]
        w = dict(done[0])
        for key in MEDIAN_KEYS:
            values = [d[key] for d in done]
            w[key] = None if None in values else float(np.median(values))
        w["finished"] = min(d["finished"] for d in done)
        w["time_limit_hit"] = any(d["time_limit_hit"] for d in done)
        w["errors"] = sum(d["errors"] for d in done)
        w["token_count_mismatches"] = [x for d in done for x in d["token_count_mismatches"]]
        merged["workloads"][name] = w
        merged["load_before"][name] = max(r["load_before"].get(name, 0.0) for r in runs)
    return merged


def round_ratios(rounds: dict[str, list[dict]], workloads: list[Workload]) -> str:
    """Each round's tokens/s of every pagedkv column over llama.cpp's, per
    workload: how far the host moved the ratio between rounds."""
    if LLAMACPP not in rounds:
        return ""
    lines = ["Tokens/s ratios by round (pagedkv / llama.cpp):"]
    for name in (n for n in rounds if n != LLAMACPP):
        for w in workloads:
            ratios = []
            for ours, theirs in zip(rounds[name], rounds[LLAMACPP], strict=True):
                a = ours["workloads"].get(w.name, {}).get("tokens_per_s")
                b = theirs["workloads"].get(w.name, {}).get("tokens_per_s")
                ratios.append(f"{a / b:.2f}x" if a and b else "-")
            lines.append(f"- {name}, {w.name}: {', '.join(ratios)}")
    return "\n".join(lines)


def llama_template_args(gguf: Path) -> list[str]:
    """llama-server flags that give it pagedkv's chat template where the
    GGUF carries none (Gemma's turn format): the same prompts on both sides.
    Without them llama.cpp falls back to a template of its own choosing."""
    template = gguf_tokenizer(gguf).chat_template
    if template not in FAMILY_CHAT_TEMPLATES.values():
        return []  # the GGUF's own, which llama.cpp reads too
    path = Path(tempfile.gettempdir()) / f"pagedkv-{gguf.stem}-chat-template.jinja"
    # llama.cpp's Jinja context adds BOS itself when the vocabulary asks.
    path.write_text(template)
    return ["--jinja", "--chat-template-file", str(path)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--servers",
        default=DEFAULT_SERVERS,
        help=f"comma-separated, in order: {', '.join([*PAGEDKV_VARIANTS, LLAMACPP])} "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated (default %(default)s)"
    )
    parser.add_argument("--model", default=MODEL, help="a catalogue model (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="small counts: a smoke run")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=300.0,
        help="seconds each server gets for shared-prefix (default %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="llama-server's -t (default: the machine's physical cores)",
    )
    parser.add_argument(
        "--pagedkv-args", default="", help="extra flags for every pagedkv serve, one string"
    )
    parser.add_argument(
        "--llama-args",
        default="",
        help="extra llama-server flags after -np 32 -c 65536, one string (e.g. '--poll 0')",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every server this many times, alternating (the table shows medians, and "
        "each round's tokens/s ratio follows it; default %(default)s)",
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the servers' output in temporary files"
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument(
        "--gguf",
        default=None,
        type=Path,
        help="a GGUF file both servers load instead of --model's (which then only names it)",
    )
    add_llama_arguments(parser)
    return parser


def main() -> int:
    parser = _parser()
    args = parser.parse_args()

    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in servers if s != LLAMACPP and s not in PAGEDKV_VARIANTS]
    table = QUICK if args.quick else WORKLOADS
    wanted = [x.strip() for x in args.workloads.split(",") if x.strip()]
    unknown += [x for x in wanted if x not in table]
    if unknown:
        parser.error(f"unknown server or workload: {', '.join(unknown)}")
    limit = min(args.time_limit, 120.0) if args.quick else args.time_limit
    workloads = [
        replace(table[x], time_limit=limit if table[x].shared_prefix else None, model=args.model)
        for x in wanted
    ]

    cpu = cpu_info()
    threads = args.threads or cpu["physical_cores"]
    gguf = args.gguf.resolve() if args.gguf else fetch_gguf(args.model)
    if not gguf.is_file():
        parser.error(f"no GGUF file at {gguf}")
    llama, version = None, "not run"
    if LLAMACPP in servers:
        found = llama_server_from_arguments(args)
        if found is None:
            return 2
        llama, version = found
    prefix_tokens = len(gguf_tokenizer(gguf).encode(SYSTEM_PROMPT))
    header = [
        f"CPU: {machine_line(cpu)}",
        f"llama.cpp: {version}; -t {threads} {shlex.join(LLAMA_ARGS)} {args.llama_args}".strip()
        if llama
        else "llama.cpp: not run",
        f"pagedkv: {pagedkv_commit()}; {pagedkv_isa_line()}",
        f"date: {datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"model: {gguf.name}; temperature 0, ignore_eos, usage-counted tokens; "
        f"shared-prefix system prompt {prefix_tokens} tokens",
    ]
    print("\n".join(header), flush=True)

    commands = {}
    for name in servers:
        if name == LLAMACPP:
            extra = LLAMA_ARGS + llama_template_args(gguf) + shlex.split(args.llama_args)
            commands[name] = llama_server_command(llama, gguf, threads, *extra)
        else:
            extra = PAGEDKV_VARIANTS[name] + shlex.split(args.pagedkv_args)
            if args.gguf:
                extra = ["--gguf", str(gguf), *extra]
            commands[name] = pagedkv_serve_command("--model", args.model, *extra)
    rounds: dict[str, list[dict]] = {name: [] for name in servers}
    for r in range(args.rounds):
        # Every other round runs the servers in reverse, so that a machine
        # that drifts over the run favours none of them.
        for name in servers if r % 2 == 0 else servers[::-1]:
            if args.rounds > 1:
                print(f"\nround {r + 1} of {args.rounds}", end="", flush=True)
            rounds[name].append(run_server(name, commands[name], workloads, args.keep_logs))
    results = {name: median_result(runs) for name, runs in rounds.items()}

    print()
    print(format_table(header, results, workloads))
    if args.rounds > 1:
        print(round_ratios(rounds, workloads))
    if args.json:
        record = {
            "cpu": cpu,
            "llama_cpp": version,
            "llama_threads": threads,
            "header": header,
            "workloads": [asdict(w) for w in workloads],
            "servers": results,
            "rounds": rounds,
        }
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
