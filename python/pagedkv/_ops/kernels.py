"""Running pagedkv's Mojo ops from Python.

Each eager call runs its op as a one-op MAX graph whose every dim is symbolic,
so one compile serves every batch, length, page count, page size and head
count. Graphs are compiled once per process and kept, keyed by what the op
needs at compile time (dtypes, ranks, layout, device, op parameters). A
compile costs seconds (MAX's graph pipeline, even for one op) and is kept on
disk (_compile_cache.py), so a later process loads it in milliseconds; a call
costs some tens of microseconds.

Ops write their results into arrays the wrapper allocated (in-place MAX ops),
so outputs come back as the caller's kind of array with no copy.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, Module, TensorType, ops

from .compile_cache import load_or_compile
from .cpu_target import apply_cpu_target
from .paths import cache_root, mojo_ops_path
from .tensors import Array, Device, accelerator, is_torch, to_buffer

_package_lock = threading.Lock()

KERNEL_PACKAGE_NAME = "mojo_ops.mojoc"
"""The compiler names a package after its file's stem: it must be "mojo_ops"."""


def build_kernel_package_in_background() -> None:
    """Starts building the kernel package on a thread, so that a program that
    has other start-up work (reading a model) overlaps the build with it; the
    first `kernel_package()` call then waits for it."""
    threading.Thread(target=kernel_package, name="pagedkv-kernel-package", daemon=True).start()


@functools.cache
def kernel_package() -> Path:
    """mojo_ops compiled to a .mojoc, built once per source version.

    MAX would otherwise re-run `mojo precompile` (seconds) for every graph that
    names the source directory; the package is cached under
    pagedkv's cache directory (`cache_root`), keyed by a hash of the
    sources and the compiler version; where that directory cannot be
    written, in a temporary folder for this process alone. Thread-safe: a
    second caller waits for the first one's build.
    """
    with _package_lock:
        return _build_kernel_package()


def kernel_package_path() -> Path:
    """Where this source version's kernel package lives (it may not exist
    yet): a folder of the cache directory named by a hash of the Mojo
    sources and the compiler's version."""
    from importlib.metadata import version

    source = mojo_ops_path()
    digest = hashlib.sha256(version("mojo-compiler").encode())
    for path in sorted(source.rglob("*.mojo")):
        digest.update(str(path.relative_to(source)).encode())
        digest.update(path.read_bytes())
    return cache_root() / digest.hexdigest()[:20] / KERNEL_PACKAGE_NAME


def _build_kernel_package() -> Path:
    package = kernel_package_path()
    if package.is_file():
        return package
    try:
        return _precompile(package)
    except OSError:
        # A cache directory this process cannot write: the package is built
        # for this process alone, in a folder removed when it exits.
        folder = Path(tempfile.mkdtemp(prefix="pagedkv-kernels-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        return _precompile(folder / KERNEL_PACKAGE_NAME)


def _precompile(package: Path) -> Path:
    """Compiles the Mojo sources into `package` (whole or absent, whatever
    runs beside); raises OSError where its folder cannot be written."""
    from mojo.run import subprocess_run_mojo

    source = mojo_ops_path()
    staging = package.parent / f".staging.{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess_run_mojo(
            ["precompile", str(source), "-o", str(staging / package.name)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"pagedkv: compiling {source} failed:\n{result.stderr}")
        os.replace(staging / package.name, package)
    finally:
        for leftover in staging.glob("*"):
            leftover.unlink()
        staging.rmdir()
    return package


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


MAX_BUSY_WAIT_ENV = "MODULAR_THREAD_BUSY_WAIT_US"
"""MAX's setting of how long its idle workers spin. Any non-empty value
makes MAX 26.7 abort the process as a session starts: importing
`max.engine` made the CPU device with the default, and the session asks
for another."""


def check_max_environment() -> None:
    """Raises ValueError where MAX's environment would abort the process
    as the first session starts (MAX_BUSY_WAIT_ENV set)."""
    if os.environ.get(MAX_BUSY_WAIT_ENV):
        raise ValueError(
            f"{MAX_BUSY_WAIT_ENV} is set: MAX would abort the process as its session "
            "starts (its CPU device already exists with the default); unset it"
        )


@functools.cache
def session(device: Device) -> Any:
    from max.driver import CPU
    from max.engine import InferenceSession

    check_max_environment()
    apply_cpu_target()  # before anything compiles: it applies from then on
    devices = [CPU()]
    if device.is_gpu:
        devices.append(accelerator(device))
    return InferenceSession(devices=devices)


def _graph_type(i: int, operand: Operand, device: Device) -> Any:
    dims = [f"a{i}_{axis}" for axis in range(operand.rank)]
    ref = DeviceRef.CPU() if operand.on_host else device.graph_ref()
    cls = BufferType if operand.mutable else TensorType
    return cls(operand.dtype, dims, device=ref)


_models: dict[tuple[OpSpec, Device], Any] = {}


def _graph_name(spec: OpSpec) -> str:
    return spec.name + "_" + _spec_tag(spec)


def _add_graph(spec: OpSpec, device: Device, module: Any = None) -> Graph:
    with Graph(
        _graph_name(spec),
        input_types=[_graph_type(i, o, device) for i, o in enumerate(spec.operands)],
        custom_extensions=[kernel_package()],
        module=module,
    ) as graph:
        ops.inplace_custom(
            spec.name,
            device=device.graph_ref(),
            values=list(graph.inputs),
            parameters=dict(spec.parameters) or None,
        )
        graph.output()
    return graph


def _spec_tag(spec: OpSpec) -> str:
    """A stable graph name suffix (graph names must be unique in a module)."""
    return hashlib.sha1(repr((spec.operands, spec.parameters)).encode()).hexdigest()[:10]


def prepare(
    specs: Iterable[OpSpec],
    device: Device,
    graphs: Callable[[Module], None] | None = None,
    key: Hashable = None,
    weights_registry: Any = None,
) -> dict[str, Any]:
    """Compiles the specs that are not loaded yet, all in one MAX module.

    MAX's graph compile has a large fixed cost (seconds); one module of many
    one-op graphs pays it once, so a program that knows which ops it will run
    (a test suite, a server at start-up) should prepare them together. A
    caller with graphs of its own passes `graphs`, which adds them to the
    module, and `key`, which says what they are (it names the compiled
    artifact on disk: see _compile_cache), with their weights; returns the
    module's loaded models by graph name.
    """
    # A caller's module gets every spec, loaded before or not: what the
    # module holds must not depend on what this process compiled first.
    todo = list(dict.fromkeys(specs))
    with _lock:
        if graphs is None:
            todo = [s for s in todo if (s, device) not in _models]
            if not todo:
                return {}

        def build() -> Module:
            module = Module()
            if graphs is not None:
                graphs(module)
            for spec in todo:
                _add_graph(spec, device, module)
            return module

        t0 = time.perf_counter()
        models = load_or_compile(
            session(device),
            ("ops", tuple(todo), key),
            device,
            build,
            custom_extensions=[kernel_package()],
            weights_registry=weights_registry,
        )
        for spec in todo:
            _models[(spec, device)] = models[_graph_name(spec)]
        compile_stats.graphs += len(todo)
        compile_stats.seconds += time.perf_counter() - t0
        return models


def compiled_op(spec: OpSpec, device: Device) -> Any:
    """The loaded one-op graph for this spec and device (compiled on first use)."""
    model = _models.get((spec, device))
    if model is None:
        prepare([spec], device)
        model = _models[(spec, device)]
    return model


_KERNEL_MESSAGE = re.compile(r"pagedkv: (.*)")


def kernel_error(e: ValueError) -> ValueError:
    """A kernel's own check (raised through MAX) as a plain ValueError with
    its message; any other error as it is."""
    found = _KERNEL_MESSAGE.search(str(e))
    return e if found is None else ValueError(found.group(1))


def run_op(spec: OpSpec, arrays: Sequence[Array], device: Device) -> None:
    """Runs a registered in-place op on arrays matching spec.operands."""
    run_model(compiled_op(spec, device), arrays, device)


def run_model(model: Any, arrays: Sequence[Array], device: Device) -> None:
    """Runs a loaded op (from `compiled_op`) on arrays matching its operands;
    for callers that run one op many times and keep the model."""
    # An array passed twice (a one-tensor pool is both k_cache and v_cache)
    # is wrapped once: wrapping a torch tensor costs microseconds.
    wrapped: dict[int, Any] = {}
    buffers = []
    for array in arrays:
        buffer = wrapped.get(id(array))
        if buffer is None:
            buffer = wrapped[id(array)] = to_buffer(array, stream_ordered=True)
        buffers.append(buffer)
    try:
        if device.is_gpu:
            with stream_ordered(arrays, device):
                model.execute(*buffers)
        else:
            # No context manager on the CPU: entering and leaving one costs
            # tens of microseconds once a decode step has evicted Python's
            # code.
            model.execute(*buffers)
    except ValueError as e:
        error = kernel_error(e)
        if error is e:
            raise
        raise error from None


@contextmanager
def stream_ordered(arrays: Sequence[Array], device: Device) -> Iterator[None]:
    """Orders the MAX executions inside it against torch's current stream.

    MAX runs a model on its own CUDA stream, ordered against torch's current
    stream by events both ways (no host synchronization): the model starts
    after what torch enqueued before, and torch work enqueued after starts
    after the model, as if the model were a torch kernel. A no-op on the CPU.
    """
    if not device.is_gpu:
        yield
        return
    import torch

    current = torch.cuda.current_stream(device.index)
    stream = max_stream(device)
    stream.wait_stream(current)
    for array in arrays:
        if is_torch(array) and array.is_cuda:
            # The caching allocator must not hand this memory out again
            # before MAX's stream is done with it.
            array.record_stream(stream)
    yield
    current.wait_stream(stream)


@functools.cache
def max_stream(device: Device) -> Any:
    """MAX's stream on a GPU, as a torch stream (to order work against)."""
    import torch

    handle = accelerator(device).default_queue.native_stream_handle
    return torch.cuda.ExternalStream(handle, device=torch.device("cuda", device.index))


def debug_enabled() -> bool:
    """PAGEDKV_DEBUG=1 turns on the expensive checks (full page-table audits)."""
    return os.environ.get("PAGEDKV_DEBUG", "") not in ("", "0")
