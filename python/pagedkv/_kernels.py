"""Running pagedkv's Mojo ops from Python.

Each eager call runs its op as a one-op MAX graph whose every dim is symbolic,
so one compile serves every batch, length, page count, page size and head
count. Graphs are compiled once per process and kept, keyed by what the op
needs at compile time (dtypes, ranks, layout, device, op parameters). A
compile costs seconds (MAX's graph pipeline, even for one op); a cached load
from MAX's disk cache about a second; a call some tens of microseconds.

Ops write their results into arrays the wrapper allocated (in-place MAX ops),
so outputs come back as the caller's kind of array with no copy.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType, ops

from ._tensors import Array, Device, to_buffer


def mojo_ops_path() -> Path:
    """The Mojo kernel package: inside the installed package, or at the top
    of a source checkout (editable installs)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "mojo_ops", here.parents[1] / "mojo_ops"):
        if (candidate / "__init__.mojo").is_file():
            return candidate
    raise RuntimeError(f"pagedkv: cannot find the mojo_ops kernel package near {here}")


@dataclass(frozen=True)
class Operand:
    """How one op argument enters the graph.

    mutable: written in place (a MAX buffer); else a read-only tensor.
    on_host: stays in host memory even for a GPU op (small metadata that the
        op reads on the host, as MAX's own ops take their max lengths).
    """

    dtype: DType
    rank: int
    mutable: bool = False
    on_host: bool = False


@dataclass(frozen=True)
class OpSpec:
    """What compiling an op depends on: its name, operands and parameters."""

    name: str
    operands: tuple[Operand, ...]
    parameters: tuple[tuple[str, Any], ...] = ()

    @staticmethod
    def of(name: str, operands: Sequence[Operand], **parameters: Any) -> OpSpec:
        return OpSpec(name, tuple(operands), tuple(sorted(parameters.items())))


@dataclass
class CompileStats:
    """Graph compiles (or disk-cache loads) done in this process."""

    graphs: int = 0
    seconds: float = 0.0


compile_stats = CompileStats()
_lock = threading.Lock()


@functools.cache
def session(device: Device) -> Any:
    from max.driver import CPU
    from max.engine import InferenceSession

    devices = [CPU()]
    if device.is_gpu:
        devices.append(accelerator(device))
    return InferenceSession(devices=devices)


def _graph_type(i: int, operand: Operand, device: Device) -> Any:
    dims = [f"a{i}_{axis}" for axis in range(operand.rank)]
    ref = DeviceRef.CPU() if operand.on_host else device.graph_ref()
    cls = BufferType if operand.mutable else TensorType
    return cls(operand.dtype, dims, device=ref)


@functools.cache
def compiled_op(spec: OpSpec, device: Device) -> Any:
    """The loaded one-op graph for this spec and device (compiled on first use)."""
    with _lock:
        t0 = time.perf_counter()
        with Graph(
            spec.name,
            input_types=[_graph_type(i, o, device) for i, o in enumerate(spec.operands)],
            custom_extensions=[mojo_ops_path()],
        ) as graph:
            ops.inplace_custom(
                spec.name,
                device=device.graph_ref(),
                values=list(graph.inputs),
                parameters=dict(spec.parameters) or None,
            )
            graph.output()
        model = session(device).load(graph)
        compile_stats.graphs += 1
        compile_stats.seconds += time.perf_counter() - t0
        return model


_KERNEL_MESSAGE = re.compile(r"pagedkv: (.*)")


@contextmanager
def kernel_errors() -> Iterator[None]:
    """Re-raises a kernel's own check as a plain ValueError with its message."""
    try:
        yield
    except ValueError as e:
        found = _KERNEL_MESSAGE.search(str(e))
        if found is None:
            raise
        raise ValueError(found.group(1)) from None


def run_op(spec: OpSpec, arrays: Sequence[Array], device: Device) -> None:
    """Runs a registered in-place op on arrays matching spec.operands."""
    model = compiled_op(spec, device)
    buffers = [to_buffer(array) for array in arrays]
    if device.is_gpu:
        # Eager calls order MAX's stream against torch's: what torch wrote is
        # done before the op reads it, and the op is done when the call returns.
        import torch

        torch.cuda.current_stream(device.index).synchronize()
    with kernel_errors():
        model.execute(*buffers)
    if device.is_gpu:
        accelerator(device).synchronize()


@functools.cache
def accelerator(device: Device) -> Any:
    from max.driver import Accelerator

    return Accelerator(device.index)


def debug_enabled() -> bool:
    """PAGEDKV_DEBUG=1 turns on the expensive checks (full page-table audits)."""
    return os.environ.get("PAGEDKV_DEBUG", "") not in ("", "0")
