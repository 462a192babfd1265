"""Where a decode step of a served batch goes, in process: a GGUF model's
decode step of B requests that share a prompt of P tokens (each with 16
tokens of its own), the same step with the shared prompt cut to 16 tokens
(the difference is the prefix's attention), and each of the step's
quantized products alone at B rows (ms and GOP/s).

    python benchmarks/decode_step.py [--model smollm2-135m-instruct]
        [--batch 32] [--prefix 926] [--steps 30]

PAGEDKV_CPU_TARGET=x86-64-v3 runs the AVX2 code path (one target a process:
run the script once per target and compare).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType

from harness.serve_bench import cpu_model
from harness.threads import pin_max_workers
from pagedkv import graph_ops
from pagedkv._ops.cpu_target import kernel_isa_line
from pagedkv._ops.kernels import session
from pagedkv._ops.tensors import CPU
from pagedkv.models import load


def median_ms(call, steps: int) -> float:
    """The median of `steps` timed calls, after three untimed ones."""
    for _ in range(3):
        call()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def decode_step_ms(llm, batch: int, prefix: int, steps: int) -> float:
    """One decode step of `batch` requests forked from one `prefix`-token
    prompt, each with 16 tokens of its own (the requests are released)."""
    rng = np.random.default_rng(0)
    engine, manager = llm.engine, llm.manager
    parent, ids = "prompt", [f"r{i}" for i in range(batch)]
    manager.add(parent)
    engine.prefill([parent], [rng.integers(100, 10000, prefix).tolist()])
    for i in ids:
        manager.fork(parent, i)
        engine.prefill([i], [rng.integers(100, 10000, 16).tolist()])
    try:
        return median_ms(lambda: engine.decode(ids, [5] * batch), steps)
    finally:
        for i in [parent, *ids]:
            manager.release(i)


def product_rows(llm, rows: int, steps: int) -> list[tuple[str, str, int, int, float]]:
    """(name, format, N, K, ms) of each distinct quantized product of the
    model at `rows` rows, the output head's included."""
    found = {}
    for name, w in llm.quantized.items():
        kind = name.rsplit(".", 1)[-1]  # layers.<i>.<product>: one of each
        found.setdefault((kind, w.format, w.out_features, w.in_features), w)
    return [
        (kind, fmt, n, k, product_ms(w, rows, steps))
        for (kind, fmt, n, k), w in sorted(found.items())
    ]


def product_ms(w, rows: int, steps: int) -> float:
    """The median time of the quantized product of `rows` random rows by w
    (a `QuantizedWeight`), as a graph of its own."""
    cpu = DeviceRef.CPU()
    types = [
        TensorType(DType.float32, [rows, w.in_features], cpu),
        TensorType(DType.uint8, w.panels.shape, cpu),
    ]
    with Graph("product", input_types=types, custom_extensions=graph_ops.custom_extensions()) as g:
        x, panels = (v.tensor for v in g.inputs)
        g.output(graph_ops.qlinear(x, panels, w.format, w.out_features))
    model = session(CPU).load(g)
    rng = np.random.default_rng(0)
    x = Buffer.from_numpy(rng.standard_normal((rows, w.in_features)).astype(np.float32))
    panels = Buffer.from_numpy(np.ascontiguousarray(w.panels))
    return median_ms(lambda: model.execute(x, panels), steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=926)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    pin_max_workers()
    llm = load(args.model, weights="gguf")
    print(f"CPU: {cpu_model()}\n{kernel_isa_line()}")
    print(f"{llm.name}, {llm.manager.dtype} cache, {args.batch} requests\n")
    print("| decode step | ms |\n|---|---|")
    for prefix in (args.prefix, 16):
        ms = decode_step_ms(llm, args.batch, prefix, args.steps)
        print(f"| after a shared {prefix}-token prompt | {ms:.1f} |")
    print(f"\n| product at {args.batch} rows | format | N x K | ms | GOP/s |")
    print("|---|---|---|---|---|")
    for kind, fmt, n, k, ms in product_rows(llm, args.batch, args.steps):
        gops = 2 * args.batch * n * k / ms / 1e6
        print(f"| {kind} | {fmt} | {n} x {k} | {ms:.3f} | {gops:.0f} |")


if __name__ == "__main__":
    main()
