"""A server command's end on SIGTERM, through its own cleanup.

uvicorn takes SIGTERM while it serves (it stops accepting and lets the
requests in flight finish) and, once shut down, raises the signal again
under the handler it found. Under the default handler the process dies
right there, before the command's ``finally`` clauses run: the processes
it started outlive it and what it owes its subscribers is never sent.
`cleanup_before_sigterm` turns that SIGTERM into an exception for the
block it wraps, so that the block's cleanup runs, then ends the process by
SIGTERM as uvicorn meant to.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

__all__ = ["cleanup_before_sigterm"]


class _Terminated(BaseException):
    """SIGTERM arrived within `cleanup_before_sigterm`."""


@contextlib.contextmanager
def cleanup_before_sigterm() -> Iterator[None]:
    """Within it, SIGTERM raises an exception that unwinds the block
    (running its ``finally`` clauses); on leaving, a process that got one
    ends by SIGTERM, with the default handler's exit status. A second
    SIGTERM during the cleanup cuts it short the same way.

    Examples
    --------
    >>> with cleanup_before_sigterm():  # doctest: +SKIP
    ...     try:
    ...         uvicorn.run(app)
    ...     finally:
    ...         indexer.terminate()
    """

    def raise_terminated(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    terminated = False
    try:
        yield
    except _Terminated:
        terminated = True
    finally:
        signal.signal(signal.SIGTERM, previous)
    if terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
