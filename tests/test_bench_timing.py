"""The benchmarks' timing loop (no kernels: fake workloads)."""

import time

from pagedkv.bench.anchors import time_round_robin


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
