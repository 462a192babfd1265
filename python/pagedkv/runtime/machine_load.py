"""How busy the rest of the machine is: the CPU other processes use.

`settle_max_threads_once` leaves MAX's threads alone on a machine that other
work keeps busy: there, workers made nicer than a busy process get a small
share of the core they share with it, and every phase of a step waits for
them (docs/performance.md, "The server's own threads").
"""

from __future__ import annotations

import os
import sys
import time

_wait = time.sleep
"""How a window passes (tests replace it)."""


def _machine_busy_ticks() -> int:
    """Clock ticks all cores have spent running anything (/proc/stat's cpu
    line: user, nice, system, irq, softirq; not idle, I/O wait or steal,
    the time the hypervisor gave to other machines)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
    return user + nice + system + irq + softirq


def cpu_ticks(stat_path: str) -> int:
    """Clock ticks (utime + stime) in a /proc stat file: a process's
    (/proc/<pid>/stat, all its threads) or one thread's
    (/proc/<pid>/task/<tid>/stat). Raises OSError where it cannot be read."""
    with open(stat_path) as f:
        # Fields after the parenthesized name: utime and stime are the 12th
        # and 13th (stat(5)'s 14th and 15th).
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _own_ticks() -> int:
    """Clock ticks this process's threads have run."""
    return cpu_ticks("/proc/self/stat")


def other_processes_cores(window_s: float = 0.1) -> float:
    """Cores' worth of CPU that processes other than this one used over the
    next `window_s` seconds (0.0 off Linux or where /proc cannot be read).
    Counted in clock ticks (usually 10 ms), so a figure under about
    2 / (window_s * 100) cores is noise.

    Examples
    --------
    >>> from pagedkv.runtime.machine_load import other_processes_cores
    >>> other_processes_cores() < 0.5  # on an otherwise idle machine  # doctest: +SKIP
    True
    """
    if not window_s > 0:
        raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
    if not sys.platform.startswith("linux"):
        return 0.0
    try:
        machine, own = _machine_busy_ticks(), _own_ticks()
        _wait(window_s)
        machine, own = _machine_busy_ticks() - machine, _own_ticks() - own
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(machine - own, 0) / os.sysconf("SC_CLK_TCK") / window_s
