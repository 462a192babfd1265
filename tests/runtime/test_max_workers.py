"""`nice_max_workers` and `settle_max_threads_once`: which threads they
change, by how much, and only once."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from pagedkv.runtime import max_workers, name_os_thread, step_loop
from pagedkv.runtime.max_poller import MAX_WORKER_PREFIX

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc and sets thread niceness"
)


class NamedThread:
    """A thread that names itself (its /proc comm) and sleeps until stopped."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.tid = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        assert name_os_thread(self.name)
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
    monkeypatch.setattr(step_loop, "other_processes_cores", lambda window_s: 0.0)
    monkeypatch.setattr(step_loop, "_settled", False)
    monkeypatch.setenv("PAGEDKV_SETTLE_MAX_THREADS", "0")
    assert step_loop.settle_max_threads_once() is False
    assert calls == []
    monkeypatch.delenv("PAGEDKV_SETTLE_MAX_THREADS")
    assert step_loop.settle_max_threads_once() is True
    assert calls == ["poller", "workers"]
    assert step_loop.settle_max_threads_once() is False
    assert calls == ["poller", "workers"]


@pytest.mark.parametrize(
    ("setting", "busy", "settles"),
    [(None, 0.4, True), (None, 0.5, False), (None, 1.7, False), ("1", 1.7, True)],
)
def test_a_busy_machine_leaves_max_threads_alone_unless_told(
    monkeypatch, caplog, setting, busy, settles
):
    """Unset, the variable lets the machine's load decide (from BUSY_CORES
    of other processes' CPU on, nothing is changed, and the log says why);
    =1 settles whatever the load, without watching it."""
    calls, watched = [], []
    monkeypatch.setattr(step_loop, "demote_max_poller", lambda: calls.append("poller"))
    monkeypatch.setattr(step_loop, "nice_max_workers", lambda: calls.append("workers"))
    monkeypatch.setattr(
        step_loop, "other_processes_cores", lambda window_s: watched.append(window_s) or busy
    )
    monkeypatch.setattr(step_loop, "_settled", False)
    if setting is None:
        monkeypatch.delenv("PAGEDKV_SETTLE_MAX_THREADS", raising=False)
    else:
        monkeypatch.setenv("PAGEDKV_SETTLE_MAX_THREADS", setting)
    with caplog.at_level("WARNING", logger="pagedkv.runtime"):
        assert step_loop.settle_max_threads_once() is settles
    assert calls == (["poller", "workers"] if settles else [])
    assert watched == ([] if setting == "1" else [step_loop.LOAD_WINDOW_S])
    assert ("keep their priority" in caplog.text) is (not settles)
    # Decided once, for the process's life.
    assert step_loop.settle_max_threads_once() is False
