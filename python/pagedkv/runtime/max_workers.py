"""MAX's CPU worker threads, made to give way to the Python thread that
drives them.

MAX's workers spin while they wait for work, between two `execute` calls
too: in a serving loop they spin through the Python work of every step
(page tables, sampling, streaming the text), on the cores that work needs.
On a small machine the kernel's scheduler then preempts the Python thread
for a whole time slice now and then: one decode step of SmolLM2 in five to
seven took 3-4 ms longer, a p90 of 9.3-9.5 ms against a p50 of 6.4 on a
2-core VM (docs/design.md). With the workers a few steps nicer than the
Python threads, a waking Python thread preempts a spinning worker at once,
and the p90 fell to 6.6-7.8 ms. During a step the Python thread sleeps in
`execute`, so the workers still have the cores to themselves; against
other busy processes they get a smaller share.
"""

from __future__ import annotations

import os
import sys

from .max_poller import MAX_WORKER_PREFIX, _thread_name

WORKER_NICENESS = 5
"""How much nicer than the calling thread MAX's workers are made."""


def max_worker_threads() -> list[int]:
    """Ids of this process's MAX CPU worker threads (named by MAX), [] off
    Linux or before MAX has started them."""
    if not sys.platform.startswith("linux"):
        return []
    return [
        int(tid)
        for tid in os.listdir("/proc/self/task")
        if _thread_name(int(tid)).startswith(MAX_WORKER_PREFIX)
    ]


def nice_max_workers(niceness: int = WORKER_NICENESS) -> list[int]:
    """Makes each of MAX's worker threads at least `niceness` nicer than the
    calling thread (never less nice than it is); returns the ids changed.

    Examples
    --------
    >>> from pagedkv.runtime import nice_max_workers
    >>> nice_max_workers()  # after the first MAX call  # doctest: +SKIP
    [8539, 8540]
    """
    if niceness < 0:
        raise ValueError(
            f"niceness must be >= 0 (a worker cannot be made less nice), got {niceness}"
        )
    target = min(os.getpriority(os.PRIO_PROCESS, 0) + niceness, 19)
    changed = []
    for tid in max_worker_threads():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
                changed.append(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return changed
