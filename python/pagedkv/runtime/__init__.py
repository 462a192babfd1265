"""MAX runtime workarounds and host-memory helpers.

Not part of the kernels' API: tools that make MAX run better on a given
machine. `demote_max_poller` moves MAX's CPU runtime poller out of the
workers' way (max_poller.py), `nice_max_workers` makes the workers give
way to the Python threads between steps (max_workers.py), and
`settle_max_threads_once` does both once for a step loop (step_loop.py);
`huge_page_zeros` allocates host pools on 2 MiB pages (huge_pages.py);
`name_os_thread` names a thread for the OS (thread_names.py).
"""

from .huge_pages import huge_page_zeros
from .max_poller import demote_max_poller
from .max_workers import nice_max_workers
from .step_loop import settle_max_threads_once
from .thread_names import name_os_thread

__all__ = [
    "demote_max_poller",
    "huge_page_zeros",
    "name_os_thread",
    "nice_max_workers",
    "settle_max_threads_once",
]
