"""Runs the Mojo unit tests (tests/mojo/test_*.mojo) with `mojo run -I .`.

Mojo 1.2 has no `mojo test`; each file is a program whose main() asserts with
std.testing and exits non-zero on failure.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MOJO_TESTS = sorted((ROOT / "tests" / "mojo").glob("test_*.mojo"))


def mojo_binary() -> str:
    beside_python = Path(sys.executable).parent / "mojo"
    found = str(beside_python) if beside_python.exists() else shutil.which("mojo")
    if found is None:
        pytest.fail("the mojo compiler is not installed (pip install 'mojo==1.2.*')")
    return found


@pytest.mark.parametrize("path", MOJO_TESTS, ids=lambda p: p.name)
def test_mojo_unit(path: Path):
    result = subprocess.run(
        [mojo_binary(), "run", "-I", str(ROOT), str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout


def test_there_are_mojo_unit_tests():
    assert MOJO_TESTS, "tests/mojo holds no test_*.mojo files"
