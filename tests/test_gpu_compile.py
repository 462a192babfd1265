"""Every GPU path compiles for NVIDIA GPUs through MAX's virtual devices.

CI has no GPU: the virtual device runs the whole compile of each op's GPU
branch, so GPU-only compile errors fail here. Each architecture needs a
fresh process (the virtual device is set before any device exists).
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("arch,flags", [("sm_90", []), ("sm_80", ["--no-demo"])])
def test_gpu_paths_compile(arch, flags):
    """Every op, and on sm_90 the demo's model graphs (minutes: one arch is enough)."""
    result = subprocess.run(
        [sys.executable, "-m", "pagedkv.gpu_check", arch, *flags],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert f"{arch}:" in result.stdout and "ops compiled" in result.stdout
    assert ("demo graphs compiled" in result.stdout) == (not flags)
