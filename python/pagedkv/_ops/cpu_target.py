"""The CPU the kernels are compiled for.

MAX compiles pagedkv's CPU kernels for the host's CPU: its widest vectors
and the dot products it has (AVX-512 with VNNI and BF16 on a Zen 4 or a
recent Xeon, AVX2 elsewhere, NEON on Arm), each a `comptime` branch of the
kernels. PAGEDKV_CPU_TARGET names another LLVM CPU instead (`x86-64-v3`:
AVX2 and FMA without AVX-512 or VNNI; `znver3`, `skylake-avx512`,
`neoverse-n1`, `generic`), through MAX's virtual CPU target. The kernels
then take that CPU's branches, so one host runs and tests another's code
path, and the compiled artifacts suit hosts of that CPU. It applies from
the first compile of the process on; the compile cache names artifacts by
it (compile_cache.host_digest).

`kernel_isa()` runs a probe op compiled like every other kernel and says
which branches the compile took. The host's CPU is the one LLVM names from
the CPUID model number, which a virtual machine may report for a CPU with
fewer features than the one it runs on; `kernel_isa_line()` then names the
features left unused (`unused_cpu_features`).
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
from max.dtype import DType

from .contract import CPU_ISA_FIELDS, CPU_ISA_OP

ENV = "PAGEDKV_CPU_TARGET"


def apply_cpu_target() -> str:
    """Sets MAX's virtual CPU target from PAGEDKV_CPU_TARGET, if set and
    not already the target; returns the target ("" for the host's CPU).

    Called before the process's first compile (`kernels.session`).

    Raises
    ------
    ValueError
        The variable names a CPU LLVM does not know, or "native".
    """
    import max.driver

    wanted = os.environ.get(ENV, "").strip()
    if wanted and wanted != max.driver.get_virtual_cpu_target():
        check_cpu_name(wanted)
        max.driver.set_virtual_cpu_target(wanted)
    return max.driver.get_virtual_cpu_target()


@functools.cache
def check_cpu_name(cpu: str) -> None:
    """Raises ValueError unless LLVM knows `cpu` for this host's
    architecture: MAX takes any name and an unknown one aborts the process
    at its first compile, so the Mojo compiler is asked first (about a
    second: it compiles an empty module for that CPU)."""
    if cpu == "native":
        raise ValueError(f"{ENV}=native: unset it to compile for the host's CPU")
    if cpu == "generic":  # MAX's own name for the architecture's baseline
        return
    from mojo.run import subprocess_run_mojo

    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.mojo"
        empty.write_text("")
        result = subprocess_run_mojo(
            ["build", "--target-cpu", cpu, "--emit", "asm", str(empty), "-o", str(empty) + ".s"],
            capture_output=True,
            text=True,
        )
    if result.returncode != 0:
        said = result.stderr.strip().splitlines() or ["the Mojo compiler refused it"]
        raise ValueError(f"{ENV}={cpu!r}: {said[-1].split('error:', 1)[-1].strip()}")


@functools.cache
def kernel_isa() -> dict[str, int]:
    """What the CPU kernels were compiled for, by field of CPU_ISA_FIELDS:
    flags (0 or 1) and the float32 lanes and vector registers.

    Examples
    --------
    >>> from pagedkv._ops.cpu_target import kernel_isa
    >>> kernel_isa()["f32_lanes"] in (4, 8, 16)
    True
    """
    from .kernels import run_op
    from .tensors import CPU

    values = np.zeros(len(CPU_ISA_FIELDS), np.int32)
    run_op(isa_probe_spec(), [values], CPU)
    return dict(zip(CPU_ISA_FIELDS, (int(v) for v in values), strict=True))


def isa_probe_spec():
    """The probe op `kernel_isa` runs: it fills one int32 per field of
    CPU_ISA_FIELDS. A program that prepares its ops together may include it."""
    from .kernels import Operand, OpSpec

    return OpSpec.of(CPU_ISA_OP, [Operand(DType.int32, 1, mutable=True)])


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where
    there is no such file, or no flags line: not Linux, not x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def unused_cpu_features(isa: Mapping[str, int], flags: Iterable[str]) -> list[str]:
    """The x86 features the kernels branch on that the CPU has (`flags`,
    /proc/cpuinfo's names) and a compile reporting `isa` (`kernel_isa()`)
    did not take.

    MAX compiles for the CPU that LLVM names from the CPUID model number,
    with that CPU's features. A virtual machine may report a model number
    whose CPU has fewer features than the one it runs on: LLVM reads
    model 167 as Rocket Lake, a CPU without AVX512_BF16, while the Xeon
    behind it has it (docs/performance.md, "An Intel Xeon with AMX").

    Examples
    --------
    >>> isa = {"avx2": 1, "avx512f": 1, "vnni": 1, "dot_bf16": 0}
    >>> unused_cpu_features(isa, {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"})
    ['avx512_bf16']
    """
    flags = set(flags)
    vnni = "avx512_vnni" if isa["avx512f"] else "avx_vnni"
    taken = (("avx2", "avx2"), ("avx512f", "avx512f"), ("vnni", vnni), ("dot_bf16", "avx512_bf16"))
    return [flag for field, flag in taken if flag in flags and not isa[field]]


def kernel_isa_line() -> str:
    """`kernel_isa()` in words, with the target it came from: for the
    first lines of a benchmark's output. A host compile that leaves some of
    the CPU's features unused (`unused_cpu_features`) says which."""
    import max.driver

    isa = kernel_isa()
    vectors = " ".join(name for name in ("avx2", "avx512f") if isa[name]) or "baseline vectors"
    int8 = "/".join(name for name in ("vnni", "maddubs", "sdot") if isa[name]) or "widening"
    target = max.driver.get_virtual_cpu_target()
    line = (
        f"kernels compiled for {target or 'the host CPU'}: {vectors}, int8 dot products by "
        f"{int8}{' (and AMX tiles at 16 rows or more)' if isa['amx'] else ''}, "
        f"bf16 dot products {'yes' if isa['dot_bf16'] else 'no'}, "
        f"{isa['f32_lanes']} float32 lanes, {isa['vector_registers']} vector registers"
    )
    unused = [] if target or not isa["x86"] else unused_cpu_features(isa, cpu_flags())
    if unused:
        line += (
            f" (this CPU's {', '.join(unused)} unused: LLVM's name for it lacks them; "
            f"{ENV} can name a CPU that has them)"
        )
    return line
