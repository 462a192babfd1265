"""The CPU attention and linear kernels compile for an Arm (NEON) target.

CI runs on x86 only: Arm builds of
`benchmarks/kernel_investigations/decode_cpu_chunk.mojo`, which instantiates
`attention_task` (decode and prefill paths) for bfloat16 and float32 K/V,
and of `tests/mojo/arm_linear.mojo` (`linear_cpu` in both dtypes) catch
code that assumes x86's vector widths (NEON's float32 vectors hold 4 lanes,
against a decode tile of 8 rows and a panel of 64 columns). They check that
the code compiles, not what it computes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def mojo() -> str | None:
    beside = Path(sys.executable).parent / "mojo"
    return str(beside) if beside.exists() else shutil.which("mojo")


ARM_PROGRAMS = [
    # Seconds to minutes of Arm code generation each: CI's slow set.
    pytest.param(
        ROOT / "benchmarks" / "kernel_investigations" / "decode_cpu_chunk.mojo",
        marks=pytest.mark.slow,
    ),
    pytest.param(ROOT / "tests" / "mojo" / "arm_linear.mojo", marks=pytest.mark.slow),
]


@pytest.mark.skipif(mojo() is None, reason="needs the mojo compiler")
@pytest.mark.parametrize("program", ARM_PROGRAMS, ids=["decode_cpu_chunk", "arm_linear"])
def test_cpu_kernels_compile_for_arm(tmp_path, program):
    result = subprocess.run(
        [
            mojo(),
            "build",
            "-I",
            str(ROOT),
            "--target-triple",
            "aarch64-unknown-linux-gnu",
            "--target-cpu",
            "neoverse-v2",
            "--emit",
            "asm",
            str(program),
            "-o",
            str(tmp_path / "program.s"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-8000:]
    assert "fmla" in (tmp_path / "program.s").read_text()
