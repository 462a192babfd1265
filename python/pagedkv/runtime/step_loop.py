"""What a loop of step graphs does once to MAX's runtime threads: its
poller demoted (max_poller.py), its workers made nicer than the Python
threads (max_workers.py). Off with PAGEDKV_SETTLE_MAX_THREADS=0."""

from __future__ import annotations

import os

from .max_poller import demote_max_poller
from .max_workers import nice_max_workers

_settled = False


def settle_max_threads_once() -> bool:
    """Demotes MAX's poller and nices its workers the first time this
    process calls it (after its first `execute`: MAX starts both with it);
    returns whether this call did so. It costs the calling thread one
    50 ms window, once."""
    global _settled
    if _settled or os.environ.get("PAGEDKV_SETTLE_MAX_THREADS", "1") == "0":
        return False
    _settled = True
    demote_max_poller()
    nice_max_workers()
    return True
