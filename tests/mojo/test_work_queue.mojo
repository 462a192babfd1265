"""Unit test of `parallel_dynamic`: every task runs exactly once, whatever the
number of tasks against the number of cores (none, one, fewer, many), and
tasks of very uneven cost still all run.
"""

from std.atomic import Atomic
from std.memory.alloc import unsafe_alloc
from std.testing import assert_equal

from mojo_ops.work_queue import parallel_dynamic


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
