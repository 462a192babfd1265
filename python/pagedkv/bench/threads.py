"""MAX's CPU worker threads, pinned one per core for the benchmarks.

On a 2-vCPU VM the kernel's scheduler sometimes wakes MAX's second worker on
the vCPU its first worker runs on and leaves both there for the rest of a
short call: the call then runs on one core. In a loop of decode calls at
(16, 1024) bfloat16, caches flushed before each, about a third took 4.0-4.6
ms instead of 2.5-3.0 (a scheduler trace showed both workers on one vCPU).
MAX pins its workers one per core when MODULAR_ENABLE_AFFINITY=1 is set
before the process first uses MAX, as a server on such a machine would set
it; the benchmarks do the same, and say so. The library does not: changed
after MAX has started, the variable makes MAX abort.
"""

from __future__ import annotations

import os

AFFINITY_VARIABLE = "MODULAR_ENABLE_AFFINITY"


def pin_max_workers() -> None:
    """Sets MODULAR_ENABLE_AFFINITY=1 unless the environment already sets it.
    Call first thing in a benchmark's main, before anything uses MAX."""
    os.environ.setdefault(AFFINITY_VARIABLE, "1")


def workers_pinned() -> bool:
    """Whether MAX pins its CPU workers in this process (by the variable)."""
    return os.environ.get(AFFINITY_VARIABLE, "") not in ("", "0")
