"""Compiles every GPU path for a GPU this machine may not have.

MAX's virtual devices run the whole GPU compile (a `comptime assert` in a GPU
branch fires here), so a GPU-only bug fails in CI instead of on the first GPU
that runs the code. Needs a fresh process: the virtual device must be set
before any device exists. Run as ``python -m pagedkv._ops.gpu_check sm_90``
(``--no-demo`` leaves out the demo's model graphs, the slow part).
"""

from __future__ import annotations

import os
import sys
import time


def compile_for(arch: str, api: str = "cuda") -> int:
    """Compiles every op for `arch` in this (fresh) process; returns the op count."""
    import max.driver as driver

    driver.set_virtual_device_api(api)
    driver.set_virtual_device_target_arch(arch)
    driver.set_virtual_device_count(1)

    from ..precompile import op_specs
    from .kernels import prepare
    from .tensors import Device

    specs = op_specs(CACHE_DTYPES, DECODE_DTYPES, MLA_DTYPES)
    prepare(specs, Device("gpu"))
    return len(specs)


def compile_demo_graphs() -> None:
    """Compiles `pagedkv demo --device gpu`'s prefill and decode step graphs
    (after compile_for set up the virtual device), in float32 and in
    bfloat16, whose products take graph_ops.linear's float32 path on a GPU."""
    from max.dtype import DType

    from ..graphs.model import DecoderConfig, init_weights
    from ..graphs.step_models import compile_step_graphs
    from .tensors import Device

    config = DecoderConfig(num_layers=2, num_qo_heads=8, num_kv_heads=2, hidden_size=512)
    weights = init_weights(config, 0)
    for dtype in (DType.float32, DType.bfloat16):
        compile_step_graphs(config, weights, 16, dtype, Device("gpu"))


CACHE_DTYPES = ("float32", "float16", "bfloat16")
DECODE_DTYPES = (
    ("float32", "float32"),
    ("float16", "float16"),
    ("bfloat16", "bfloat16"),
    ("float16", "float8_e4m3fn"),
    ("bfloat16", "float8_e5m2"),
)
MLA_DTYPES = (("bfloat16", "bfloat16"), ("bfloat16", "float8_e4m3fn"))
"""MLA dtype pairs the GPU check compiles: DeepSeek's bfloat16, and its fp8
cache (each pair is a compile of its own)."""


def main(argv: list[str] | None = None) -> int:
    """Compiles every GPU path for each architecture in argv (default sm_90), each
    in a process of its own; `--no-demo` skips the demo graphs. Returns the exit status.

    A child process per architecture: the virtual device is process-wide, and
    MAX's virtual-device teardown can abort a process after a successful
    compile, which the child's os._exit avoids.
    """
    import subprocess

    args = list(argv if argv is not None else sys.argv[1:])
    flags = [a for a in args if a == "--no-demo"]
    for arch in [a for a in args if a != "--no-demo"] or ["sm_90"]:
        result = subprocess.run([sys.executable, "-m", "pagedkv._ops.gpu_check", arch, *flags])
        if result.returncode:
            return result.returncode
    return 0


def compile_here(arch: str, demo: bool) -> int:
    """Compiles every GPU path for `arch` in this process; returns the exit status."""
    t0 = time.perf_counter()
    count = compile_for(arch)
    print(f"{arch}: {count} ops compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    if demo:
        t0 = time.perf_counter()
        compile_demo_graphs()
        print(f"{arch}: demo graphs compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    archs = [a for a in argv if a != "--no-demo"]
    code = compile_here(archs[0], "--no-demo" not in argv) if len(archs) == 1 else main(argv)
    sys.stdout.flush()
    # The verdict is printed; skip the teardown that can abort (see main).
    os._exit(code)
