"""The CPU attention kernel compiles for an Arm (NEON) target.

CI runs on x86 only: an Arm build of
`benchmarks/kernel_investigations/decode_cpu_chunk.mojo`, which instantiates
`attention_task` (decode and prefill paths) for bfloat16 and float32 K/V,
catches code that assumes x86's vector widths (NEON's float32 vectors hold 4
lanes, against a decode tile of 8 rows). It checks that the code compiles,
not what it computes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mojo() -> str | None:
    beside = Path(sys.executable).parent / "mojo"
    return str(beside) if beside.exists() else shutil.which("mojo")


@pytest.mark.skipif(mojo() is None, reason="needs the mojo compiler")
def test_cpu_attention_compiles_for_arm(tmp_path):
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
            str(ROOT / "benchmarks" / "kernel_investigations" / "decode_cpu_chunk.mojo"),
            "-o",
            str(tmp_path / "chunk.s"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-8000:]
    assert "fmla" in (tmp_path / "chunk.s").read_text()
