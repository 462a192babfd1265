"""The step graphs' linear layers on the CPU: pagedkv's product over packed
weight panels (graph_ops.linear) beside MAX's matmul and torch's, on the
same data, in one run.

The shapes are SmolLM2-135M's products (a decoder layer's and the logits'),
at a decode step's rows (1 and 32 requests) and a prefill's (256 tokens).
Caches are flushed before each call: a model's weights stream from memory
at every step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .anchors import Timing, rows_by_case, time_round_robin


@dataclass(frozen=True)
class LinearShape:
    label: str
    k: int
    n: int


LINEAR_SHAPES = (
    LinearShape("qkv", 576, 960),
    LinearShape("o", 576, 576),
    LinearShape("gate, up", 576, 1536),
    LinearShape("down", 1536, 576),
    LinearShape("logits", 576, 49152),
)
ROWS = (1, 32, 256)


@dataclass
class LinearRow:
    shape: LinearShape
    dtype: str
    m: int
    name: str
    timing: Timing

    @property
    def gflops(self) -> float:
        return 2 * self.m * self.shape.k * self.shape.n / self.timing.median_ms / 1e6


def _models(dtype: str, shapes: tuple[LinearShape, ...]) -> dict[str, object]:
    """One compiled module: per shape, a graph of pagedkv's op and one of
    MAX's matmul (named "pagedkv k x n", "max k x n")."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, Module, TensorType

    from pagedkv import graph_ops
    from pagedkv._ops.kernels import prepare
    from pagedkv._ops.linear_panels import linear_panels_shape
    from pagedkv._ops.tensors import Device

    dt, cpu = DType[dtype], DeviceRef.CPU()

    def graphs(module: Module) -> None:
        for s in shapes:
            for impl in ("pagedkv", "max"):
                w_shape = linear_panels_shape(s.k, s.n) if impl == "pagedkv" else (s.k, s.n)
                types = [TensorType(dt, ["m", s.k], cpu), TensorType(dt, w_shape, cpu)]
                extensions = graph_ops.custom_extensions()
                with Graph(
                    f"{impl} {s.k} x {s.n}",
                    input_types=types,
                    custom_extensions=extensions,
                    module=module,
                ) as g:
                    x, w = (v.tensor for v in g.inputs)
                    g.output(graph_ops.linear(x, w, s.n) if impl == "pagedkv" else x @ w)

    return prepare([], Device("cpu"), graphs=graphs, key=("linear bench", dtype, shapes))


def run_linear_bench(
    shapes=LINEAR_SHAPES, dtypes=("float32", "bfloat16"), rows=ROWS, reps: int = 20
) -> list[LinearRow]:
    import torch
    from max.driver import Buffer

    from pagedkv._ops.linear_panels import pack_linear_weight

    out: list[LinearRow] = []
    for dtype in dtypes:
        models = _models(dtype, tuple(shapes))
        tdt = getattr(torch, dtype)
        for s in shapes:
            torch.manual_seed(0)
            w = torch.randn(s.k, s.n).to(tdt)
            panels = Buffer.from_dlpack(pack_linear_weight(w))
            plain = Buffer.from_dlpack(w)
            for m in rows:
                x = torch.randn(m, s.k).to(tdt)
                xb = Buffer.from_dlpack(x)
                ours, theirs = models[f"pagedkv {s.k} x {s.n}"], models[f"max {s.k} x {s.n}"]
                fns = {
                    "pagedkv": functools.partial(ours.execute, xb, panels),
                    "max": functools.partial(theirs.execute, xb, plain),
                    "torch": functools.partial(torch.matmul, x, w),
                }
                for name, t in time_round_robin(fns, reps=reps, max_s=2.0).items():
                    out.append(LinearRow(s, dtype, m, name, t))
                    print(
                        f"  {s.label:9s} {s.k:5d} x {s.n:5d} {dtype:8s} M={m:4d} {name:8s} "
                        f"{t.median_ms:8.3f} ms {out[-1].gflops:7.1f} GFLOP/s",
                        flush=True,
                    )
    return out


def format_linear_table(rows: list[LinearRow]) -> str:
    """pagedkv's GFLOP/s per (shape, dtype, M) and its speed as a multiple of
    MAX's matmul and torch's."""
    lines = [
        f"{'product':9s} {'K x N':>13s} {'dtype':8s} {'M':>4s} {'pagedkv ms':>10s} "
        f"{'GFLOP/s':>8s} {'x MAX':>6s} {'x torch':>7s}"
    ]
    for (s, dtype, m), g in rows_by_case(rows, "m").items():
        ours = g["pagedkv"].timing.median_ms
        lines.append(
            f"{s.label:9s} {s.k:5d} x {s.n:5d} {dtype:8s} {m:4d} {ours:10.3f} "
            f"{g['pagedkv'].gflops:8.1f} {g['max'].timing.median_ms / ours:6.2f} "
            f"{g['torch'].timing.median_ms / ours:7.2f}"
        )
    return "\n".join(lines)
