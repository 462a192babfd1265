"""Slow checks that run in their own process, started early, awaited late.

A check that takes minutes in a subprocess (the GPU compile of one
architecture) starts as soon as the suite is collected (`start`, from
conftest.py), so that it runs beside the CPU tests on another core instead of
after them; its test then waits for it (`result`). A test run alone starts
its check itself.
"""

from __future__ import annotations

import subprocess
import tempfile
from typing import IO

_runs: dict[str, tuple[subprocess.Popen, IO[str], IO[str]]] = {}


def start(key: str, argv: list[str]) -> None:
    """Starts argv in the background under key, unless it already runs."""
    if key in _runs:
        return
    # Files, not pipes: a check that writes more than a pipe holds would
    # block until someone reads it.
    out = tempfile.TemporaryFile("w+")
    err = tempfile.TemporaryFile("w+")
    _runs[key] = (subprocess.Popen(argv, stdout=out, stderr=err, text=True), out, err)


def running(key: str) -> bool:
    """Whether the run under key was started and has not ended."""
    return key in _runs and _runs[key][0].poll() is None


def result(key: str, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """The finished run of argv under key (started now if it was not)."""
    start(key, argv)
    proc, out, err = _runs.pop(key)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        out.close()
        err.close()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def stop_all() -> None:
    """Kills the runs nobody waited for (a session cut short by -x or ^C)."""
    for proc, out, err in _runs.values():
        proc.kill()
        proc.wait()
        out.close()
        err.close()
    _runs.clear()
