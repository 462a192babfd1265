"""`nice_max_workers` and `settle_max_threads_once`: which threads they
change, by how much, and only once."""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import pytest

from pagedkv.runtime import max_workers, step_loop
from pagedkv.runtime.max_poller import MAX_WORKER_PREFIX

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc and sets thread niceness"
)

PR_SET_NAME = 15


class NamedThread:
    """A thread that names itself (its /proc comm) and sleeps until stopped."""

    def __init__(self, name: str) -> None:
        self.name = name.encode()
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.tid = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(self.name), 0, 0, 0)
        self.tid = threading.get_native_id()
        self.ready.set()
        self.stop.wait()

    def __enter__(self) -> NamedThread:
        self.thread.start()
        assert self.ready.wait(60), "the thread did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    @property
    def niceness(self) -> int:
        return os.getpriority(os.PRIO_PROCESS, self.tid)


def test_workers_become_nicer_than_the_caller_and_no_one_else(monkeypatch):
    """A thread named as MAX names its workers is found and ends `niceness`
    nicer than the calling thread, once (a second call changes nothing); a
    thread of another name is not found. The process's real MAX workers are
    left out of the change, so that later tests run as before."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    with NamedThread(MAX_WORKER_PREFIX + "7") as worker, NamedThread("other") as other:
        found = max_workers.max_worker_threads()
        assert worker.tid in found
        assert other.tid not in found
        monkeypatch.setattr(max_workers, "max_worker_threads", lambda: [worker.tid])
        assert max_workers.nice_max_workers(3) == [worker.tid]
        assert worker.niceness == min(base + 3, 19)
        assert other.niceness == base
        assert max_workers.nice_max_workers(3) == []
        assert worker.niceness == min(base + 3, 19)
        # A smaller niceness never makes a worker less nice.
        assert max_workers.nice_max_workers(1) == []
        assert worker.niceness == min(base + 3, 19)


def test_negative_niceness_is_refused():
    with pytest.raises(ValueError, match="niceness"):
        max_workers.nice_max_workers(-1)


def test_settle_runs_once_and_can_be_turned_off(monkeypatch):
    calls = []
    monkeypatch.setattr(step_loop, "demote_max_poller", lambda: calls.append("poller"))
    monkeypatch.setattr(step_loop, "nice_max_workers", lambda: calls.append("workers"))
    monkeypatch.setattr(step_loop, "_settled", False)
    monkeypatch.setenv("PAGEDKV_SETTLE_MAX_THREADS", "0")
    assert step_loop.settle_max_threads_once() is False
    assert calls == []
    monkeypatch.delenv("PAGEDKV_SETTLE_MAX_THREADS")
    assert step_loop.settle_max_threads_once() is True
    assert calls == ["poller", "workers"]
    assert step_loop.settle_max_threads_once() is False
    assert calls == ["poller", "workers"]
