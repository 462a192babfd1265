"""The benchmarks' timing loop (no kernels: fake workloads)."""

import threading
import time

from pagedkv.bench.anchors import burst_speedup, time_round_robin


def test_a_slow_anchor_stops_early_and_the_fast_ones_get_every_rep():
    calls: list[str] = []

    def slow() -> None:
        calls.append("slow")
        time.sleep(0.05)

    def fast() -> None:
        calls.append("fast")

    timings = time_round_robin(
        {"slow": slow, "fast": fast}, reps=10, max_s=0.08, flush=False, min_reps=3
    )
    assert timings["fast"].runs == 10
    assert timings["slow"].runs == 3
    assert timings["slow"].median_ms >= 50
    # Interleaved while both run: a fast run between the first two slow ones.
    timed = calls[2:]  # after one warm-up call each
    first = timed.index("slow")
    assert "fast" in timed[first : timed.index("slow", first + 1)]


def test_burst_speedup_is_the_work_done_in_parallel_over_one_thread():
    # Sleeping releases the GIL: two threads do two bursts in one burst's time.
    def parallel(i: int) -> None:
        time.sleep(0.02)

    assert 1.7 < burst_speedup(20, threads=2, idle_s=0, reps=3, work=parallel) < 2.2

    # The same bursts behind one lock run one after the other.
    lock = threading.Lock()

    def serialized(i: int) -> None:
        with lock:
            time.sleep(0.02)

    assert 0.8 < burst_speedup(20, threads=2, idle_s=0, reps=3, work=serialized) < 1.2
