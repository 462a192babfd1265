"""The calling thread's name as the operating system shows it.

Python 3.11-3.13 name their threads for Python only: `top -H`, `ps -L` and
/proc show every thread of a server as "python". The serving engine's
thread names itself, so that its CPU can be told apart from the HTTP
loop's (the main thread, still "python") and from MAX's workers (which MAX
names "🔥 Thread<n>").
"""

from __future__ import annotations

import ctypes
import sys

PR_SET_NAME = 15
"""prctl(2)'s option that names the calling thread."""
MAX_NAME_BYTES = 15
"""What Linux keeps of a thread's name (16 bytes with the final NUL)."""


def name_os_thread(name: str) -> bool:
    """Names the calling thread for the OS (Linux; its first 15 bytes);
    returns whether it did. Elsewhere, or where prctl fails, it does
    nothing. Raises TypeError for a name that is not a string.

    Examples
    --------
    >>> from pagedkv.runtime import name_os_thread
    >>> name_os_thread("pagedkv-engine")  # doctest: +SKIP
    True
    """
    if not isinstance(name, str):
        raise TypeError(f"a thread's name is a string, got {name!r}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        raw = name.encode()[:MAX_NAME_BYTES]
        return libc.prctl(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0
    except OSError:  # no C library to load
        return False
