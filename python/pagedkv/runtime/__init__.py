"""MAX runtime workarounds and host-memory helpers.

Not part of the kernels' API: tools that make MAX run better on a given
machine. `demote_max_poller` moves MAX's CPU runtime poller out of the
workers' way (max_poller.py); `huge_page_zeros` allocates host pools on
2 MiB pages (huge_pages.py).
"""

from .huge_pages import huge_page_zeros
from .max_poller import demote_max_poller, demote_max_poller_once

__all__ = ["demote_max_poller", "demote_max_poller_once", "huge_page_zeros"]
