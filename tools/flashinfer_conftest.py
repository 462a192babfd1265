"""conftest.py for FlashInfer's tests run against pagedkv (copied in by
tools/run_flashinfer_tests.py; not a test of this repository).

It maps ``import flashinfer`` to pagedkv, answers the CUDA device queries the
tests make (the GPU generation a file targets, else FlashInfer's FA2
capability; the host's memory), keeps a covering sample of each
test function's parameter grid, bounds each test's time, and writes every
outcome to $PAGEDKV_FI_RESULTS as JSON lines.
"""

import json
import os
import random
import signal

import pytest
import torch

import pagedkv.flashinfer_compat as compat
from pagedkv.flashinfer_compat import utils as compat_utils

compat.install()

GENERATIONS = {
    name: tuple(capability)
    for name, capability in json.loads(os.environ.get("PAGEDKV_FI_GENERATIONS", "{}")).items()
}
"""Test files written for one GPU generation, and the capability the CPU
answers them with (run_flashinfer_tests.GENERATIONS); others get FA2's."""
_capability = [compat_utils.FA2_CAPABILITY]


def _stand_in_capability(*args, **kwargs):
    """The generation the running (or importing) test file targets."""
    return _capability[0]


def _target(path) -> None:
    _capability[0] = GENERATIONS.get(os.path.basename(str(path)), compat_utils.FA2_CAPABILITY)


# Answered for every device: the tests ask about "cuda" devices, which here
# are the CPU. Replaced before any test module imports the names, so their
# own bindings and compat's is_sm*_supported read the stand-in.
compat_utils.get_compute_capability = _stand_in_capability
torch.cuda.get_device_capability = _stand_in_capability


def pytest_collectstart(collector):
    """A module's import-time checks (skipif marks) see its generation."""
    if isinstance(collector, pytest.Module):
        _target(collector.path)


def pytest_runtest_setup(item):
    _target(item.path)


class _StandInProperties:
    """What the tests' helpers read of a device (clear_cuda_cache)."""

    name = "CPU stand-in"
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    multi_processor_count = os.cpu_count() or 1


# Memory queries, answered for the CPU. torch.cuda.synchronize is left to
# fail: the tests that call it go on to CUDA graphs or CUDA subprocesses.
torch.cuda.get_device_properties = lambda *args, **kwargs: _StandInProperties()
torch.cuda.memory_reserved = lambda *args, **kwargs: 0

SEED = int(os.environ.get("PAGEDKV_FI_SEED", "0"))
TIMEOUT_S = int(os.environ.get("PAGEDKV_FI_TIMEOUT", "120"))
RESULTS = os.environ.get("PAGEDKV_FI_RESULTS")
FULL_GRID = os.environ.get("PAGEDKV_FI_FULL_GRID") == "1"


def _covering(items):
    """A small subset of one test function's items in which every value of
    every parameter appears at least once (greedy set cover, seeded order)."""
    rng = random.Random(SEED)
    items = list(items)
    rng.shuffle(items)

    def pairs(item):
        params = getattr(getattr(item, "callspec", None), "params", {})
        return {(k, repr(v)) for k, v in params.items()}

    uncovered = set().union(*(pairs(i) for i in items)) if items else set()
    chosen = []
    while uncovered:
        best = max(items, key=lambda i: len(pairs(i) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen or items[:1]


def pytest_collection_modifyitems(session, config, items):
    if FULL_GRID:
        return
    groups = {}
    for item in items:
        groups.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
    keep = {id(i) for group in groups.values() for i in _covering(group)}
    deselected = [i for i in items if id(i) not in keep]
    items[:] = [i for i in items if id(i) in keep]
    config.hook.pytest_deselected(items=deselected)


def _alarm(signum, frame):
    raise TimeoutError(f"test ran past {TIMEOUT_S} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)


def pytest_collectreport(report):
    """A file that fails to import counts as one failure, with its error."""
    if RESULTS is None or not report.failed:
        return
    message = str(report.longrepr).strip().splitlines()
    _record(report.nodeid, "collect", "failed", message[-1] if message else "")


def pytest_runtest_logreport(report):
    if RESULTS is None:
        return
    if report.when != "call" and report.outcome == "passed":
        return
    if report.when == "teardown" and report.outcome != "failed":
        return
    message = ""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        message = crash.message
    elif isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    elif report.longrepr is not None:
        message = str(report.longrepr).splitlines()[-1]
    _record(report.nodeid, report.when, report.outcome, message)


def _record(nodeid: str, when: str, outcome: str, message: str) -> None:
    with open(RESULTS, "a") as f:
        record = {"nodeid": nodeid, "when": when, "outcome": outcome, "message": message}
        f.write(json.dumps(record) + "\n")
