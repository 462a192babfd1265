"""The step-timeline rig's patch (benchmarks/kernel_investigations/
step_timeline.diff) still applies to the kernels and engine it times: a
change to those files that moves the patched lines must regenerate it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "benchmarks" / "kernel_investigations" / "step_timeline.diff"


def test_the_step_timeline_patch_applies():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout of the repository")
    result = subprocess.run(
        ["git", "apply", "--check", str(PATCH)], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
