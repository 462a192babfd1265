import os
import sys
import threading
import time

import pytest

from harness.threads import thread_cpu_seconds
from pagedkv.runtime import name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def spin_named(name: str, cpu_seconds: float, spun: threading.Barrier, done: threading.Event):
    """Names the calling thread (as the kernel sees it), uses cpu_seconds
    of its own CPU time however long that takes, then waits for `done`
    (an ended thread leaves /proc/<pid>/task)."""
    assert name_os_thread(name)
    start = time.thread_time()
    while time.thread_time() - start < cpu_seconds:
        pass
    spun.wait(60)
    done.wait(60)


def test_cpu_seconds_are_summed_by_thread_name_without_its_number():
    """Two threads named spin1 and spin2 that each use 0.2 s of CPU count
    together under "spin"; a name nothing uses is absent."""
    before = thread_cpu_seconds(os.getpid())
    spun, done = threading.Barrier(3), threading.Event()
    threads = [
        threading.Thread(target=spin_named, args=(f"spin{i}", 0.2, spun, done)) for i in (1, 2)
    ]
    for t in threads:
        t.start()
    try:
        spun.wait(60)
        after = thread_cpu_seconds(os.getpid())
    finally:
        done.set()
        for t in threads:
            t.join()
    assert "spin" not in before
    # /proc counts in clock ticks: each thread's figure may be a tick short.
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert 0.4 - 2 * tick <= after.get("spin", 0.0) < 5
    assert "spin1" not in after and "spin2" not in after


def test_a_process_that_is_gone_has_no_threads():
    assert thread_cpu_seconds(2**22 + 12345) == {}
