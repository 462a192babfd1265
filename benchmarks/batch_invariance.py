"""What batch-invariant decode costs: SmolLM2's GGUF decode step with the
engine's fixed key splits (the default) and with splits sized to the batch,
alternating in one process, at one request and at 32.

    python benchmarks/batch_invariance.py [--rounds 3] [--steps 30]

Prints the median step time of each mode per shape and their ratio, with
the CPU model and ISA.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from llamacpp import cpu_info, machine_line
from pagedkv.graphs.engine import BATCH_INVARIANT_CHUNK
from pagedkv.models import load

SHAPES = ((1, 1000), (1, 3000), (32, 600))
"""(requests, prompt tokens) of each decode batch."""


def step_ms(engine, batch: int, prompt: int, chunk, steps: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    engine.decode_chunk = chunk
    ids = [f"r{i}" for i in range(batch)]
    for i in ids:
        engine.manager.add(i, [])
    engine.prefill(ids, [rng.integers(100, 40000, prompt).tolist() for _ in ids])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.decode(ids, [7] * batch)
        times.append(time.perf_counter() - t0)
    for i in ids:
        engine.manager.release(i)
    return float(np.median(times[3:])) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    engine = load(weights="gguf").engine
    fixed = -(-BATCH_INVARIANT_CHUNK // engine.manager.page_size) * engine.manager.page_size
    print("CPU:", machine_line(cpu_info()))
    print("| requests x prompt | invariant ms | batch-sized ms | ratio |")
    print("|---|---|---|---|")
    for batch, prompt in SHAPES:
        runs = {fixed: [], None: []}
        for r in range(args.rounds):
            for chunk in (fixed, None):
                runs[chunk].append(step_ms(engine, batch, prompt, chunk, args.steps, r))
        a, b = np.median(runs[fixed]), np.median(runs[None])
        print(f"| {batch} x {prompt} | {a:.2f} | {b:.2f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
