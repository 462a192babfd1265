"""conftest.py for FlashInfer's tests run against pagedkv (copied in by
tools/run_flashinfer_tests.py; not a test of this repository).

It maps ``import flashinfer`` to pagedkv, answers the CUDA device queries the
tests make (FlashInfer's FA2 capability, the host's memory), keeps a covering sample of each
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

compat.install()
# The tests gate on the GPU generation; the CPU stands in for an sm_80 GPU.
torch.cuda.get_device_capability = lambda *args, **kwargs: compat.utils.FA2_CAPABILITY


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
    with open(RESULTS, "a") as f:
        f.write(
            json.dumps(
                {
                    "nodeid": report.nodeid,
                    "when": report.when,
                    "outcome": report.outcome,
                    "message": message,
                }
            )
            + "\n"
        )
