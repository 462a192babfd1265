"""Unit test of `parallel_dynamic`: every task runs exactly once, whatever the
number of tasks against the number of cores (none, one, fewer, many), and
tasks of very uneven cost still all run; of `parallel_row_blocks`: every
row falls in exactly one block, whatever the block size (including 0, taken
as 1, and more than the rows); and of `parallel_phases`: every task of every
phase runs once, and each starts only after every task of the phases before
it has finished (a slow task early in a phase holds the next phase back),
with empty phases between.
"""

from std.atomic import Atomic
from std.memory.alloc import unsafe_alloc
from std.testing import assert_equal

from mojo_ops.work_queue import (
    Phases,
    parallel_dynamic,
    parallel_phases,
    parallel_row_blocks,
)


def main() raises:
    var checked = 0
    for num_tasks in [0, 1, 2, 3, 17, 1000]:
        var runs = unsafe_alloc[Scalar[DType.int64]](max(num_tasks, 1))
        for t in range(num_tasks):
            runs[unsafe_offset=t] = 0

        def task(t: Int) {var runs}:
            # Task 0 is long: the other cores must take the rest meanwhile.
            var spin = 200_000 if t == 0 else 10
            var x = Float64(t)
            for _ in range(spin):
                x = x * 0.999 + 1.0
            _ = Atomic.fetch_add(runs.unsafe_offset(t), Int64(1 + Int(x < 0)))

        parallel_dynamic(task, num_tasks)
        for t in range(num_tasks):
            assert_equal(
                runs[unsafe_offset=t], 1, String("task ", t, " of ", num_tasks)
            )
            checked += 1
        runs.unsafe_free()
    print("parallel_dynamic:", checked, "tasks passed")

    checked = 0
    for rows in [0, 1, 7, 64, 1001]:
        for per in [0, 1, 3, 64, 5000]:
            var covered = unsafe_alloc[Scalar[DType.int64]](max(rows, 1))
            for r in range(rows):
                covered[unsafe_offset=r] = 0

            def block(first: Int, end: Int) {var covered, var rows}:
                # A block past the rows or an empty one would be a bug.
                var bad = Int(first >= end or end > rows)
                for r in range(first, min(end, rows)):
                    _ = Atomic.fetch_add(
                        covered.unsafe_offset(r), Int64(1 + 100 * bad)
                    )

            parallel_row_blocks(block, rows, per)
            for r in range(rows):
                assert_equal(
                    covered[unsafe_offset=r],
                    1,
                    String("row ", r, " of ", rows, " in blocks of ", per),
                )
                checked += 1
            covered.unsafe_free()
    print("parallel_row_blocks:", checked, "rows passed")

    checked = 0
    var counts = [3, 0, 1, 40, 0, 7, 1000]
    var phases = Phases()
    var total = 0
    for n in counts:
        _ = phases.add(n)
        total += n
    # Per phase: tasks finished; per task: how many tasks of the phases
    # before had finished when it started (all of them, or it ran early).
    var finished = unsafe_alloc[Scalar[DType.int64]](len(counts))
    var seen = unsafe_alloc[Scalar[DType.int64]](total)
    var runs = unsafe_alloc[Scalar[DType.int64]](total)
    for p in range(len(counts)):
        finished[unsafe_offset=p] = 0
    for t in range(total):
        seen[unsafe_offset=t] = 0
        runs[unsafe_offset=t] = 0
    var first = unsafe_alloc[Int](len(counts))
    var at = 0
    for p in range(len(counts)):
        first[unsafe_offset=p] = at
        at += counts[p]

    def phase_task(p: Int, t: Int) {var finished, var seen, var runs, var first}:
        var before = Int64(0)
        for q in range(p):
            before += Atomic.fetch_add(finished.unsafe_offset(q), Int64(0))
        var slot = first[unsafe_offset=p] + t
        seen[unsafe_offset=slot] = before
        var spin = 200_000 if t == 0 else 10
        var x = Float64(t)
        for _ in range(spin):
            x = x * 0.999 + 1.0
        _ = Atomic.fetch_add(runs.unsafe_offset(slot), Int64(1 + Int(x < 0)))
        _ = Atomic.fetch_add(finished.unsafe_offset(p), Int64(1))

    parallel_phases(phase_task, phases)
    var done_before = 0
    for p in range(len(counts)):
        for t in range(counts[p]):
            var slot = first[unsafe_offset=p] + t
            assert_equal(runs[unsafe_offset=slot], 1, String("phase ", p, " task ", t))
            assert_equal(
                Int(seen[unsafe_offset=slot]),
                done_before,
                String("phase ", p, " task ", t, " started early"),
            )
            checked += 1
        done_before += counts[p]
    print("parallel_phases:", checked, "tasks passed")
