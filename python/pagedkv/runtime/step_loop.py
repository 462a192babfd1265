"""What a loop of step graphs does once to MAX's runtime threads: its
poller demoted (max_poller.py), its workers made nicer than the Python
threads (max_workers.py), unless other processes keep the machine busy
(machine_load.py). PAGEDKV_SETTLE_MAX_THREADS=0 never settles them, =1
always does; unset, the machine's load decides."""

from __future__ import annotations

import logging
import os

from .machine_load import other_processes_cores
from .max_poller import demote_max_poller
from .max_workers import nice_max_workers

log = logging.getLogger("pagedkv.runtime")

SETTLE_VARIABLE = "PAGEDKV_SETTLE_MAX_THREADS"
BUSY_CORES = 0.5
"""Cores' worth of CPU other processes use, over LOAD_WINDOW_S, from which
the machine counts as shared: beside a busy process, settled threads lose
far more than they gain on an idle machine (docs/performance.md, "The
server's own threads")."""
LOAD_WINDOW_S = 0.1
"""How long the machine's load is watched before deciding (10 clock ticks
a core at the usual 100 a second)."""

_settled = False


def settle_max_threads_once() -> bool:
    """Demotes MAX's poller and nices its workers the first time this
    process calls it (after its first `execute`: MAX starts both with it);
    returns whether this call did so.

    With PAGEDKV_SETTLE_MAX_THREADS unset, it first watches the machine
    for LOAD_WINDOW_S and leaves MAX's threads alone where other processes
    use BUSY_CORES or more (a warning says so): an unprivileged process
    cannot make its threads less nice again, so the choice holds for the
    process's life. It costs the calling thread those windows (0.15 s),
    once."""
    global _settled
    if _settled:
        return False
    setting = os.environ.get(SETTLE_VARIABLE, "")
    if setting == "0":
        return False
    _settled = True
    if setting != "1":
        busy = other_processes_cores(LOAD_WINDOW_S)
        if busy >= BUSY_CORES:
            log.warning(
                "pagedkv: other processes keep %.1f cores busy: MAX's threads keep their priority "
                "(%s=1 settles them anyway)",
                busy,
                SETTLE_VARIABLE,
            )
            return False
    demote_max_poller()
    nice_max_workers()
    return True
