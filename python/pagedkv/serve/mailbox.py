"""Handing the engine thread's events to the event loop, a step's worth at
a time.

The engine thread emits one event per request per step: 32 streams make 32
events within a millisecond. Scheduling each with `call_soon_threadsafe`
wakes the loop 32 times (a write to its self-pipe each) and makes the two
threads trade the GIL as often. A mailbox queues the events and schedules
one drain: events posted before the loop gets to it ride along, in the
order they were posted.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


class LoopMailbox:
    """Calls posted from other threads, run on `loop` in posting order.

    Examples
    --------
    >>> import asyncio
    >>> async def main():
    ...     box, got = LoopMailbox(asyncio.get_running_loop()), []
    ...     for i in range(3):
    ...         box.post(got.append, i)
    ...     await asyncio.sleep(0)
    ...     return got
    >>> asyncio.run(main())
    [0, 1, 2]
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], object], Any]] = []
        self._scheduled = False

    def post(self, fn: Callable[[Any], object], arg: Any) -> None:
        """Runs fn(arg) on the loop soon; callable from any thread."""
        with self._lock:
            self._pending.append((fn, arg))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for fn, arg in pending:
            fn(arg)
