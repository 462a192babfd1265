"""`demote_max_poller`: which threads it finds and what it changes."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

import pagedkv.runtime
from pagedkv.runtime import max_poller
from pagedkv.runtime.max_poller import MAX_WORKER_PREFIX, waking_threads

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc and sets SCHED_IDLE"
)

TEST_WAKES_PER_S = 200.0
WINDOW_S = 0.2
WAKES_IN_WINDOW = int(4 * TEST_WAKES_PER_S * WINDOW_S)
"""Wake-ups a window lasts in these tests: 4x what the rate threshold asks
over WINDOW_S. Windows end by count, not by time (see `max_poller._wait`),
so a loaded machine makes a test slower, never wrong."""
HANG_GUARD_S = 300.0
"""Only a guard against waiting forever (a broken test); no result depends on it."""


class FakePoller:
    """A thread that wakes again and again (sleeping 0.1 ms at a time, as
    MAX's poller waits 0.2 ms), beside one that sleeps until told to stop."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.ready = threading.Barrier(3)
        self.tids: dict[str, int] = {}
        self.wakes = 0
        self.changed = threading.Condition()
        self.threads = [
            threading.Thread(target=self._poll, daemon=True),
            threading.Thread(target=self._sleep, daemon=True),
        ]

    def _poll(self) -> None:
        self.tids["poller"] = threading.get_native_id()
        self.ready.wait()
        while not self.stop.is_set():
            time.sleep(0.0001)  # blocks: one voluntary context switch
            with self.changed:
                self.wakes += 1
                self.changed.notify_all()

    def _sleep(self) -> None:
        self.tids["sleeper"] = threading.get_native_id()
        self.ready.wait()
        self.stop.wait()

    def wait_for_wakes(self, window_s: float) -> None:
        """max_poller's window, ended once the poller has woken
        WAKES_IN_WINDOW more times, however long that takes."""
        del window_s
        with self.changed:
            target = self.wakes + WAKES_IN_WINDOW
            if not self.changed.wait_for(lambda: self.wakes >= target, HANG_GUARD_S):
                pytest.fail("the fake poller stopped waking")

    def __enter__(self) -> FakePoller:
        for t in self.threads:
            t.start()
        self.ready.wait()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def test_finds_the_thread_that_wakes_often_and_not_the_sleeping_ones(monkeypatch):
    with FakePoller() as fake:
        monkeypatch.setattr(max_poller, "_wait", fake.wait_for_wakes)
        found = waking_threads(WINDOW_S, TEST_WAKES_PER_S)
    assert fake.tids["poller"] in found
    assert fake.tids["sleeper"] not in found
    assert threading.get_native_id() not in found


def test_demotes_only_the_poller_to_sched_idle(monkeypatch):
    with FakePoller() as fake:
        monkeypatch.setattr(max_poller, "_wait", fake.wait_for_wakes)
        demoted = pagedkv.runtime.demote_max_poller(WINDOW_S, TEST_WAKES_PER_S)
        policies = {name: os.sched_getscheduler(tid) for name, tid in fake.tids.items()}
    assert fake.tids["poller"] in demoted
    assert policies["poller"] == os.SCHED_IDLE
    assert policies["sleeper"] == os.SCHED_OTHER
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_no_timing_assumption_in_the_window(monkeypatch):
    """A window that a loaded machine stretches finds the same threads: the
    wait here takes ten times longer than the fake poller's count needs."""
    with FakePoller() as fake:

        def slow_window(window_s: float) -> None:
            fake.wait_for_wakes(window_s)
            fake.wait_for_wakes(window_s)

        monkeypatch.setattr(max_poller, "_wait", slow_window)
        found = waking_threads(WINDOW_S, TEST_WAKES_PER_S)
    assert fake.tids["poller"] in found and fake.tids["sleeper"] not in found


@pytest.mark.parametrize("window_s", [0, -0.1])
def test_a_window_that_is_not_positive_is_refused(window_s):
    with pytest.raises(ValueError, match="window_s must be a positive"):
        pagedkv.runtime.demote_max_poller(window_s)


def test_finds_max_runtime_poller_and_keeps_results_exact(monkeypatch):
    """MAX 26.7 keeps a poller from its first execute: if this fails after a
    MAX upgrade, the poller may be gone and max_poller.py obsolete.

    The window ends once some thread other than this one and MAX's workers
    has woken enough times for the rate threshold (counted, not timed)."""
    indptr = np.array([0, 2, 5], np.int32)
    last = np.array([3, 1], np.int32)
    before = pagedkv.get_seq_lens(indptr, last, 4)
    me = threading.get_native_id()
    need = 2 * max_poller.POLLER_WAKES_PER_S * WINDOW_S

    def until_a_thread_woke_enough(window_s: float) -> None:
        start = max_poller._voluntary_switches()
        give_up = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < give_up:
            now = max_poller._voluntary_switches()
            if any(
                tid != me
                and tid in start
                and count - start[tid] > need
                and not max_poller._thread_name(tid).startswith(MAX_WORKER_PREFIX)
                for tid, count in now.items()
            ):
                return
            time.sleep(0.01)
        pytest.fail("no thread of MAX's runtime kept waking")

    monkeypatch.setattr(max_poller, "_wait", until_a_thread_woke_enough)
    demoted = pagedkv.runtime.demote_max_poller(WINDOW_S)
    assert demoted, "no thread of MAX's runtime woke often"
    for tid in demoted:
        with open(f"/proc/self/task/{tid}/comm") as f:
            assert not f.read().startswith(MAX_WORKER_PREFIX)
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    after = pagedkv.get_seq_lens(indptr, last, 4)
    np.testing.assert_array_equal(before, [7, 9])
    np.testing.assert_array_equal(after, before)
