"""Where a one-request decode step's time goes, op by op and phase by phase:
the kernels' phases on the cores, MAX's time between and around the ops,
and the step's Python between two `execute` calls.

    git apply benchmarks/kernel_investigations/step_timeline.diff
    python benchmarks/kernel_investigations/step_timeline.py [--model gemma3-270m] [--tokens 64]
    git apply -R benchmarks/kernel_investigations/step_timeline.diff

The patch makes the kernels print a clock reading (CLOCK_MONOTONIC, ns) as
each layer or product op starts and, from `parallel_phases`, each core's
start and end of every phase; the engine prints one before and after each
`execute`. This script runs `LLM.generate` of one prompt, keeps the lines
of the timed generation (fd 1 goes to a file meanwhile) and sums them over
its steps. Without the patch it finds no lines and says so. The prints
cost a few microseconds an op: the step's total is a little above the
unpatched one's. docs/performance.md, "One client: where the time goes",
holds what it showed.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile

from pagedkv.models import load

LAYER_PHASES = (
    "quantize x",
    "Q|K|V product",
    "bias, QK-norm",
    "RoPE, append",
    "attention",
    "merge",
    "quantize o",
    "wo product",
    "sandwich norm",
    "quantize h",
    "gate|up product",
    "quantize act",
    "down product",
    "sandwich norm",
)


def captured_lines(model: str, tokens: int) -> list[str]:
    """The patched kernels' and engine's lines of one timed generation (the
    warm-up's are dropped)."""
    llm = load(model)
    lines = []
    for prompt, count in (("Hello there.", 8), ("Tell me a long story about a dragon.", tokens)):
        sys.stdout.flush()
        saved = os.dup(1)
        with tempfile.TemporaryFile("w+") as f:
            os.dup2(f.fileno(), 1)
            try:
                llm.generate([prompt], max_new_tokens=count)
                sys.stdout.flush()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
            f.seek(0)
            lines = [line for line in f.read().splitlines() if line.startswith("PKV")]
    return lines


def report(lines: list[str]) -> None:
    ops, python_gaps, entries, exits, between = [], [], [], [], collections.defaultdict(list)
    enter = pre = post = last_end = None
    kind = None
    for line in lines:
        f = line.split()
        if f[0] == "PKVPY":
            if f[1] == "pre":
                if post is not None:
                    python_gaps.append(int(f[2]) - post)
                pre, enter, kind = int(f[2]), None, None
            else:
                post = int(f[2])
                exits.append(post - last_end)
        elif f[0] == "PKVENTER":
            enter = int(f[1])
            if kind is None:
                entries.append(enter - pre)
            else:
                between[kind].append(enter - last_end)
        else:  # PKVTRACE phases rounds workers t0 t1 (start,end,tasks) per worker and phase
            count, rounds, workers, t0, t1 = map(int, f[1:6])
            records = [tuple(map(int, r.split(","))) for r in f[6:]]
            n = count * rounds
            per_worker = [records[w * n : (w + 1) * n] for w in range(workers)]
            ops.append((count, rounds, t0, per_worker, enter))
            kind = f"after an op of {rounds} layer(s)" if count == 14 else "after a product"
            last_end = t1
    if not ops:
        sys.exit("no timings printed: apply step_timeline.diff first (see the docstring)")
    steps = len(python_gaps) + 1
    wall: collections.Counter[str] = collections.Counter()
    checks = wakes = 0
    for count, rounds, t0, per_worker, enter in ops:
        n = count * rounds
        starts = [min(w[i][0] for w in per_worker if w[i][0]) for i in range(n)]
        ends = [max(w[i][1] for w in per_worker) for i in range(n)]
        checks += t0 - enter
        wakes += starts[0] - t0
        for i in range(n):
            until = starts[i + 1] if i + 1 < n else ends[-1]
            name = LAYER_PHASES[i % count] if count == 14 else "output head"
            wall[name] += until - starts[i]
    us = 1e3 * steps
    print(f"{steps} decode steps, {len(ops) / steps:.0f} ops a step; microseconds a step:")
    print("| where | us |\n|---|---|")
    for name, ns in wall.most_common():
        print(f"| {name} | {ns / us:.0f} |")
    print(f"| an op's checks before its phases | {checks / us:.0f} |")
    print(f"| waking the cores for an op's phases | {wakes / us:.0f} |")
    for name, gaps in sorted(between.items()):
        print(f"| MAX between ops, {name} (median {statistics.median(gaps) / 1e3:.0f} each) "
              f"| {sum(gaps) / us:.0f} |")  # fmt: skip
    for name, gaps in (("MAX from execute to the first op", entries),
                       ("MAX from the last op to execute's return", exits),
                       ("Python between two executes", python_gaps)):  # fmt: skip
        print(f"| {name} (median) | {statistics.median(gaps) / 1e3:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    report(captured_lines(args.model, args.tokens))


if __name__ == "__main__":
    main()
