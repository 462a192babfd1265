"""The benchmarks' timing loop (no kernels: fake workloads)."""

import threading

import pytest

from harness.anchors import Timing, burst_speedup, time_round_robin
from harness.decode_bench import (
    DecodeShape,
    KVDtypeRow,
    MachineSpeed,
    Row,
    format_kv_dtype_table,
    format_table,
)
from harness.prefill_bench import PrefillRow, PrefillShape, format_prefill_table


class SimulatedClock:
    """Seconds that advance only when a workload says so: exact, unlike a VM's."""

    def __init__(self) -> None:
        self.now = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


def test_a_slow_anchor_stops_early_and_the_fast_ones_get_every_rep():
    calls: list[str] = []
    clock = SimulatedClock()

    def slow() -> None:
        calls.append("slow")
        clock.advance(0.05)

    def fast() -> None:
        calls.append("fast")
        clock.advance(1e-6)

    timings = time_round_robin(
        {"slow": slow, "fast": fast}, reps=10, max_s=0.08, flush=False, min_reps=3, clock=clock
    )
    assert timings["fast"].runs == 10
    assert timings["slow"].runs == 3
    assert timings["slow"].median_ms == pytest.approx(50)
    # Interleaved while both run: a fast run between the first two slow ones.
    timed = calls[2:]  # after one warm-up call each
    first = timed.index("slow")
    assert "fast" in timed[first : timed.index("slow", first + 1)]


def test_burst_speedup_is_the_work_done_in_parallel_over_one_thread():
    # Bursts that overlap perfectly: thread 0's burst spans the wall time, the
    # others run alongside it.
    clock = SimulatedClock()

    def parallel(i: int) -> None:
        if i == 0:
            clock.advance(0.02)

    speedup = burst_speedup(20, threads=3, idle_s=0, reps=3, work=parallel, clock=clock)
    assert speedup == pytest.approx(3.0)

    # Bursts that do not overlap at all: each adds its own time.
    def serialized(i: int) -> None:
        clock.advance(0.02)

    speedup = burst_speedup(20, threads=3, idle_s=0, reps=3, work=serialized, clock=clock)
    assert speedup == pytest.approx(1.0)

    # Half-overlapped: 3 bursts of 20 ms take 40 ms at once, so 60 / 40.
    def half(i: int) -> None:
        clock.advance(0.02 if i == 0 else 0.01)

    speedup = burst_speedup(20, threads=3, idle_s=0, reps=3, work=half, clock=clock)
    assert speedup == pytest.approx(1.5)


def test_decode_table_ratios_come_from_the_rows_medians():
    shape = DecodeShape(16, 1024, 32, 8)
    nbytes = shape.kv_bytes(2)

    def row(name: str, median_ms: float, min_ms: float) -> Row:
        timing = Timing(median_ms, min_ms, 15, 0.0)
        return Row(shape, "bfloat16", name, timing, nbytes / median_ms / 1e6, None)

    rows = [
        row("pagedkv", 4.0, 3.0),
        row("max_builtin", 40.0, 40.0),
        row("torch_sdpa_gqa", 12.0, 12.0),
        row("torch_sdpa_fold", 6.0, 6.0),
        row("read_numpy", 6.0, 6.0),
        row("read_torch", 3.2, 3.0),  # the faster read: pagedkv at 80% of it
    ]
    bandwidth = nbytes / 2.0 / 1e6  # pagedkv's median reads at half of it
    table = format_table(MachineSpeed(bandwidth, 2, {5.0: 1.5}), rows)
    cells = table.splitlines()[-1].split()  # the label is 4 cells, then the dtype
    # ms, GB/s, %BW, MAX ms, xMAX, gqa ms, xgqa, fold ms, xfold, %BWbest, %read, steal
    assert cells[5:] == [
        "4.000", f"{nbytes / 4e6:.1f}", "50%", "40.000", "10.00", "12.000", "3.00",
        "6.000", "1.50", "67%", "80%", "0.0%",
    ]  # fmt: skip


def test_kv_dtype_table_times_each_dtype_against_bfloat16_at_its_shape():
    small, large = DecodeShape(16, 1024, 32, 8), DecodeShape(32, 2048, 32, 8)

    def row(shape: DecodeShape, kv_dtype: str, median_ms: float) -> KVDtypeRow:
        return KVDtypeRow(shape, kv_dtype, Timing(median_ms, median_ms, 20, 0.0), 1.0)

    rows = [
        row(small, "bfloat16", 4.0),
        row(small, "float8_e4m3fn", 5.0),
        row(large, "float8_e4m3fn", 9.0),
        row(large, "bfloat16", 12.0),
    ]
    ratios = [line.split()[-1] for line in format_kv_dtype_table(rows).splitlines()[1:]]
    assert ratios == ["1.00", "1.25", "0.75", "1.00"]
    # No bfloat16 row at a shape: no ratio.
    assert format_kv_dtype_table(rows[1:2]).splitlines()[-1].split()[-1] == "-"


def test_prefill_table_ratio_is_torch_time_over_pagedkv_time():
    shape = PrefillShape(1, 2048)
    assert shape.flops() == 4 * 128 * 32 * 2048 * 2049 / 2

    def row(name: str, median_ms: float) -> PrefillRow:
        timing = Timing(median_ms, median_ms, 8, 0.0)
        return PrefillRow(shape, "float32", name, timing, shape.flops() / median_ms / 1e6, 1e-6)

    table = format_prefill_table([row("pagedkv", 400.0), row("torch_sdpa", 300.0)])
    cells = table.splitlines()[-1].split()  # the label is 4 cells, then the dtype
    # pagedkv ms, GFLOP/s, torch ms, GFLOP/s, xtorch, max|diff|
    assert cells[5:] == [
        "400.00", f"{shape.flops() / 4e8:.1f}", "300.00", f"{shape.flops() / 3e8:.1f}",
        "0.75", "1.00e-06",
    ]  # fmt: skip
