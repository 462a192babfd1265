"""Every GPU path compiles for NVIDIA GPUs through MAX's virtual devices.

CI has no GPU: the virtual device runs the whole compile of each op's GPU
branch, so GPU-only compile errors fail here. Each architecture needs a
fresh process (the virtual device is set before any device exists). The
processes start when the suite is collected and run beside the CPU tests
(background.py, conftest.py); each test waits for its architecture's.
"""

from __future__ import annotations

import sys

import background
import pytest

GPU_COMPILE_TIMEOUT_S = 1800
"""A cold sm_90 compile takes about 7.5 minutes alone on 2 cores, and longer
beside the CPU tests."""


def gpu_check_argv(arch: str, flags: list[str]) -> list[str]:
    """The command that compiles every GPU path for arch."""
    return [sys.executable, "-m", "pagedkv._ops.gpu_check", arch, *flags]


@pytest.mark.parametrize(
    "arch,flags",
    [
        ("sm_90", ["--no-demo"]),
        # sm_80 compiles the same generic kernels as sm_90 without the Hopper
        # one, and the demo's model graphs add MAX's own GPU kernels (minutes,
        # and no pagedkv op the ops check leaves out): both in the slow set,
        # which CI runs, so the main suite's CPU goes to the CPU tests.
        pytest.param("sm_80", ["--no-demo"], marks=pytest.mark.slow, id="sm_80"),
        pytest.param("sm_90", [], marks=pytest.mark.slow, id="sm_90-demo"),
    ],
)
def test_gpu_paths_compile(arch, flags):
    """Every op, and with no flags the demo's model graphs too."""
    argv = gpu_check_argv(arch, flags)
    result = background.result(" ".join(argv), argv, GPU_COMPILE_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert f"{arch}:" in result.stdout and "ops compiled" in result.stdout
    assert ("demo graphs compiled" in result.stdout) == (not flags)
