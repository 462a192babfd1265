"""Every GPU path compiles for NVIDIA GPUs through MAX's virtual devices.

CI has no GPU: the virtual device runs the whole compile of each op's GPU
branch, so GPU-only compile errors fail here (the slow set, which CI
runs: `python -m pytest -m slow`). Each architecture needs a
fresh process (the virtual device is set before any device exists). The
processes start when the suite is collected and run beside the CPU tests
(background.py, conftest.py); each test waits for its architecture's.
"""

from __future__ import annotations

import sys

import pytest

import background

GPU_COMPILE_TIMEOUT_S = 1800
"""A cold sm_90 compile takes about 7.5 minutes alone on 2 cores, and longer
beside the CPU tests."""


def gpu_check_argv(arch: str, flags: list[str]) -> list[str]:
    """The command that compiles every GPU path for arch."""
    return [sys.executable, "-m", "pagedkv._ops.gpu_check", arch, *flags]


@pytest.mark.parametrize(
    "arch,flags",
    [
        # Each is minutes of a core that the main suite's cold run spends on
        # compiling the CPU tests' graphs ahead (warm_graphs.py): both in the
        # slow set, which CI runs. sm_80 compiles the same generic kernels as
        # sm_90 without the Hopper one; sm_90 adds the demo's model graphs
        # (MAX's own GPU kernels) to every op.
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
