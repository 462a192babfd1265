"""`demote_max_poller`: which threads it finds and what it changes."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

import pagedkv
from pagedkv.max_poller import MAX_WORKER_PREFIX, waking_threads

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc and sets SCHED_IDLE"
)

TEST_WAKES_PER_S = 200.0
"""Below the fake poller's rate even on a loaded CI machine (it sleeps
0.1 ms at a time: thousands of wake-ups a second when the core is free)."""


class FakePoller:
    """A thread that wakes every 0.1 ms, as MAX's poller does every 0.2 ms,
    beside one that sleeps until told to stop."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.ready = threading.Barrier(3)
        self.tids: dict[str, int] = {}
        self.threads = [
            threading.Thread(target=self._poll, daemon=True),
            threading.Thread(target=self._sleep, daemon=True),
        ]

    def _poll(self) -> None:
        self.tids["poller"] = threading.get_native_id()
        self.ready.wait()
        while not self.stop.is_set():
            time.sleep(0.0001)

    def _sleep(self) -> None:
        self.tids["sleeper"] = threading.get_native_id()
        self.ready.wait()
        self.stop.wait()

    def __enter__(self) -> FakePoller:
        for t in self.threads:
            t.start()
        self.ready.wait()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def test_finds_the_thread_that_wakes_often_and_not_the_sleeping_ones():
    with FakePoller() as fake:
        found = waking_threads(0.2, TEST_WAKES_PER_S)
    assert fake.tids["poller"] in found
    assert fake.tids["sleeper"] not in found
    assert threading.get_native_id() not in found


def test_demotes_only_the_poller_to_sched_idle():
    with FakePoller() as fake:
        demoted = pagedkv.demote_max_poller(0.2, TEST_WAKES_PER_S)
        policies = {name: os.sched_getscheduler(tid) for name, tid in fake.tids.items()}
    assert fake.tids["poller"] in demoted
    assert policies["poller"] == os.SCHED_IDLE
    assert policies["sleeper"] == os.SCHED_OTHER
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


@pytest.mark.parametrize("window_s", [0, -0.1])
def test_a_window_that_is_not_positive_is_refused(window_s):
    with pytest.raises(ValueError, match="window_s must be a positive"):
        pagedkv.demote_max_poller(window_s)


def test_finds_max_runtime_poller_and_keeps_results_exact():
    """MAX 26.7 keeps a poller from its first execute: if this fails after a
    MAX upgrade, the poller may be gone and max_poller.py obsolete."""
    indptr = np.array([0, 2, 5], np.int32)
    last = np.array([3, 1], np.int32)
    before = pagedkv.get_seq_lens(indptr, last, 4)
    demoted = pagedkv.demote_max_poller(0.2)
    assert demoted, "no thread of MAX's runtime woke 1,000 times a second"
    for tid in demoted:
        with open(f"/proc/self/task/{tid}/comm") as f:
            assert not f.read().startswith(MAX_WORKER_PREFIX)
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    after = pagedkv.get_seq_lens(indptr, last, 4)
    np.testing.assert_array_equal(before, [7, 9])
    np.testing.assert_array_equal(after, before)
