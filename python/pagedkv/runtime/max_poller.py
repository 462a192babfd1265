"""MAX's CPU runtime poller, moved out of the kernels' way.

From its first `execute`, MAX's CPU runtime keeps a thread that waits on a
condition variable with a timeout of about 200 us, for the life of the
process, busy or idle: about 5,000 wake-ups a second (counted in
/proc/self/task on MAX 26.7). Each wake-up lands on a core that one of
MAX's workers is computing on; under SCHED_IDLE the thread still runs, but
only on a core nothing else wants, so it stops preempting the workers
(decode ran up to 1.15x as fast on a 2-vCPU VM: docs/design.md).

MAX offers no setting for this thread, so `demote_max_poller` finds it by
what it does: the threads of this process that wake far more often than
anything idle should. Call it once MAX has run something (the thread starts
with the first `execute`), at a moment when this process computes nothing.
"""

from __future__ import annotations

import os
import sys
import threading
import time

POLLER_WAKES_PER_S = 1000.0
"""Wake-ups a second above which an idle thread counts as a poller: MAX's
wakes about 5,000 times; MAX's workers and torch's sleep when idle."""

MAX_WORKER_PREFIX = "🔥 Thread"
"""The name MAX gives its worker threads, which are never demoted."""


def _voluntary_switches() -> dict[int, int]:
    """Voluntary context switches (wake-ups after a wait) of each thread of
    this process, by thread id."""
    counts = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        field = status.split("\nvoluntary_ctxt_switches:", 1)[1].split()[0]
        counts[int(tid)] = int(field)
    return counts


_wait = time.sleep
"""How a window passes: tests replace it with a wait for a given number of
wake-ups, so that what they check does not depend on the machine's load."""


def _thread_name(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def waking_threads(
    window_s: float = 0.05, min_wakes_per_s: float = POLLER_WAKES_PER_S
) -> list[int]:
    """Ids of this process's threads that woke more than `min_wakes_per_s`
    times a second over `window_s` seconds, the caller's thread and MAX's
    workers excepted. Linux only ([] elsewhere); call it while the process
    is otherwise idle, or busy threads count too."""
    if not window_s > 0:
        raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
    if not sys.platform.startswith("linux"):
        return []
    before = _voluntary_switches()
    _wait(window_s)
    after = _voluntary_switches()
    me = threading.get_native_id()
    return [
        tid
        for tid, count in after.items()
        if tid != me
        and tid in before
        and (count - before[tid]) / window_s > min_wakes_per_s
        and not _thread_name(tid).startswith(MAX_WORKER_PREFIX)
    ]


def demote_max_poller(
    window_s: float = 0.05, min_wakes_per_s: float = POLLER_WAKES_PER_S
) -> list[int]:
    """Puts MAX's runtime poller (see the module docstring) under
    SCHED_IDLE, so that it runs only on an idle core; returns the ids of
    the threads demoted ([] when none was found, or off Linux).

    Call it after MAX's first `execute` in this process, while the process
    computes nothing. Calling it again is harmless. It changes no other
    thread, and nothing in MAX's results."""
    demoted = []
    for tid in waking_threads(window_s, min_wakes_per_s):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # the thread ended meanwhile
            continue
        demoted.append(tid)
    return demoted
