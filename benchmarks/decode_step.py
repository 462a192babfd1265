"""Where a decode step of a served batch goes, in process: a GGUF model's
decode step of B requests that share a prompt of P tokens (each with 16
tokens of its own, or each count of `--own` in turn: a served request's own
tokens grow as it answers), the same step with the shared prompt cut to 16
tokens (the difference is the prefix's attention), and each of the step's
quantized products alone at B rows (ms and GOP/s). With one request, the
step against its floor: the packed weights' bytes at the machine's best
plain read (measured in the same run).

    python benchmarks/decode_step.py [--model smollm2-135m-instruct | --gguf PATH]
        [--batch 32] [--prefix 926] [--own 16,80,150] [--steps 30]

PAGEDKV_CPU_TARGET=x86-64-v3 runs the AVX2 code path (one target a process:
run the script once per target and compare).
"""

from __future__ import annotations

import argparse

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType

from harness.anchors import read_bandwidth_gbps, time_round_robin
from harness.serve_bench import cpu_model
from harness.threads import pin_max_workers
from pagedkv import graph_ops
from pagedkv._ops.cpu_target import kernel_isa_line
from pagedkv._ops.kernels import session
from pagedkv._ops.tensors import CPU
from pagedkv.models import load


def forked_batch(llm, tag: str, batch: int, prefix: int, own: int = 16) -> list[str]:
    """Ids of `batch` requests forked from one `prefix`-token prompt, each
    with `own` tokens of its own, prefilled."""
    rng = np.random.default_rng(prefix)
    engine, manager = llm.engine, llm.manager
    parent, ids = f"{tag}-prompt", [f"{tag}-{i}" for i in range(batch)]
    manager.add(parent)
    engine.prefill([parent], [rng.integers(100, 10000, prefix).tolist()])
    for i in ids:
        manager.fork(parent, i)
        engine.prefill([i], [rng.integers(100, 10000, own).tolist()])
    return ids


def distinct_products(llm) -> dict[str, object]:
    """One `QuantizedWeight` of each product of the model, by name (the
    output head's included)."""
    found = {}
    for name, w in sorted(llm.quantized.items()):
        if name != "embed":  # rows looked up, not a product
            found.setdefault(name.rsplit(".", 1)[-1], w)  # layers.<i>.<product>
    return found


def product_call(w, rows: int):
    """A call of the quantized product of `rows` random rows by w (a
    `QuantizedWeight`), as a graph of its own."""
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
    return lambda: model.execute(x, panels)


def token_counts(text: str) -> list[int]:
    """Comma-separated counts of at least 1 token, as `--own` takes them."""
    counts = [int(n) for n in text.split(",")]
    if min(counts) < 1:
        raise ValueError(text)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--gguf", help="a Llama, Qwen or Gemma GGUF of your own instead")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=926)
    parser.add_argument(
        "--own",
        type=token_counts,
        default=[16],
        help="each request's own tokens: counts, comma-separated (default 16)",
    )
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    pin_max_workers()
    llm = load(args.model, weights="gguf", gguf=args.gguf)
    print(f"CPU: {cpu_model()}\n{kernel_isa_line()}")
    engine, b = llm.engine, args.batch
    print(f"{llm.name}, {llm.manager.dtype} cache, {b} requests\n")
    owns = args.own
    # (shared prompt, own tokens): each own count after the prompt, and the
    # first after a 16-token one.
    shapes = dict.fromkeys([(args.prefix, n) for n in owns] + [(16, owns[0])])
    batches = {(p, n): forked_batch(llm, f"p{p}o{n}", b, p, n) for p, n in shapes}
    steps = {k: (lambda ids=ids: engine.decode(ids, [5] * b)) for k, ids in batches.items()}
    # Interleaved, so that a drift in the machine's speed hits all alike.
    timed = time_round_robin(steps, reps=args.steps, max_s=60.0, flush=False)
    print("| decode step | own tokens (at the first step) | ms (median) | ms (best) |")
    print("|---|---|---|---|")
    for (p, n), t in timed.items():
        print(f"| after a shared {p}-token prompt | {n} | {t.median_ms:.1f} | {t.min_ms:.1f} |")
    if b == 1:
        # The products' bytes (a step reads each once; not the embedding's).
        nbytes = sum(q.panels.nbytes for name, q in llm.quantized.items() if name != "embed")
        gbps = read_bandwidth_gbps()
        floor_ms = nbytes / gbps / 1e6
        step_ms = timed[16, owns[0]].median_ms
        print(
            f"\none request's step: {nbytes / 1e6:.0f} MB of packed weights at {gbps:.1f} GB/s"
            f" (the best plain read) is {floor_ms:.1f} ms; the step ({step_ms:.1f} ms) reads"
            f" at {nbytes / step_ms / 1e6:.1f} GB/s, {100 * floor_ms / step_ms:.0f}% of it"
        )
    weights = distinct_products(llm)
    calls = {name: product_call(w, b) for name, w in weights.items()}
    timed = time_round_robin(calls, reps=args.steps, max_s=60.0, flush=False)
    print(f"\n| product at {b} rows | format | N x K | ms (median) | GOP/s |")
    print("|---|---|---|---|---|")
    for name, w in weights.items():
        n, k, ms = w.out_features, w.in_features, timed[name].median_ms
        print(f"| {name} | {w.format} | {n} x {k} | {ms:.3f} | {2 * b * n * k / ms / 1e6:.0f} |")


if __name__ == "__main__":
    main()
