"""Unit test of `parallel_dynamic`: every task runs exactly once, whatever the
number of tasks against the number of cores (none, one, fewer, many), and
tasks of very uneven cost still all run; and of `parallel_row_blocks`: every
row falls in exactly one block, whatever the block size (including 0, taken
as 1, and more than the rows).
"""

from std.atomic import Atomic
from std.memory.alloc import unsafe_alloc
from std.testing import assert_equal

from mojo_ops.work_queue import parallel_dynamic, parallel_row_blocks


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
