"""MAX's CPU threads as the benchmarks set them: the workers pinned one per
core, the runtime's poller demoted (see the end of this docstring).

On a 2-vCPU VM the kernel's scheduler sometimes wakes MAX's second worker on
the vCPU its first worker runs on and leaves both there for the rest of a
short call: the call then runs on one core. In a loop of decode calls at
(16, 1024) bfloat16, caches flushed before each, about a third took 4.0-4.6
ms instead of 2.5-3.0 (a scheduler trace showed both workers on one vCPU).
MAX pins its workers one per core when MODULAR_ENABLE_AFFINITY=1 is set
before the process first uses MAX, as a server on such a machine would set
it; the benchmarks do the same, and say so. The library does not: changed
after MAX has started, the variable makes MAX abort.

MAX's runtime also keeps a poller thread that wakes about 5,000 times a
second and preempts a worker each time (pagedkv/runtime/max_poller.py). The timing
loop demotes it to SCHED_IDLE after its warm-up calls, for every function it
times, anchors and plain reads included; PAGEDKV_BENCH_DEMOTE_POLLER=0 leaves
it alone, to measure the difference.

`thread_cpu_seconds` reads what each thread of a process has used: the
serving benchmark's CPU per token, by thread, for a server's own threads
against its compute threads.
"""

from __future__ import annotations

import os

from pagedkv.runtime.machine_load import cpu_ticks
from pagedkv.runtime.max_poller import demote_max_poller

AFFINITY_VARIABLE = "MODULAR_ENABLE_AFFINITY"
POLLER_VARIABLE = "PAGEDKV_BENCH_DEMOTE_POLLER"
_poller_demoted = False


def pin_max_workers() -> None:
    """Sets MODULAR_ENABLE_AFFINITY=1 unless the environment already sets it.
    Call first thing in a benchmark's main, before anything uses MAX."""
    os.environ.setdefault(AFFINITY_VARIABLE, "1")


def workers_pinned() -> bool:
    """Whether MAX pins its CPU workers in this process (by the variable)."""
    return os.environ.get(AFFINITY_VARIABLE, "") not in ("", "0")


def demote_poller_for_timing() -> None:
    """Demotes MAX's runtime poller (runtime/max_poller.py) unless
    PAGEDKV_BENCH_DEMOTE_POLLER=0. Call before timing, while the process is
    idle and after MAX's first execute."""
    global _poller_demoted
    if os.environ.get(POLLER_VARIABLE, "1") != "0" and demote_max_poller():
        _poller_demoted = True


def poller_demoted() -> bool:
    """Whether the timing loop demoted MAX's poller in this process."""
    return _poller_demoted


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) each thread of process `pid` has used,
    summed by thread name with trailing digits dropped (MAX names its
    workers "🔥 Thread0", "🔥 Thread1"; Python's threads are all "python").
    {} where /proc cannot be read (not Linux, the process gone)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    seconds: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip().rstrip("0123456789") or "thread"
            used = cpu_ticks(f"/proc/{pid}/task/{tid}/stat") / ticks
        except OSError:  # the thread ended meanwhile
            continue
        seconds[name] = seconds.get(name, 0.0) + used
    return seconds
