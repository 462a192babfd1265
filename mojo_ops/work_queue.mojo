"""Running CPU tasks on every core, each core taking the next task when it is
free.

`sync_parallelize(func, n)` hands task i to worker i mod workers up front, so
a core that runs slower (a neighbour's interrupts, time stolen by a
hypervisor, tasks of uneven cost) leaves the others idle at the end, a
visible share of a decode step (docs/design.md, "Kernel notes"). Here each
core pulls task numbers from a shared counter instead.
"""

from max.algorithm import sync_parallelize
from max.runtime.asyncrt import parallelism_level
from std.atomic import Atomic
from std.memory import stack_allocation


def parallel_dynamic[
    FuncType: def(Int) raises -> None,
](func: FuncType, num_tasks: Int) raises:
    """Runs func(0) ... func(num_tasks - 1) on all cores, in order of task
    number, each core taking the next unclaimed task; returns when all are
    done."""
    var workers = min(parallelism_level(None), num_tasks)
    if workers <= 1:
        for t in range(num_tasks):
            func(t)
        return
    var next_task = stack_allocation[1, Scalar[DType.int64]]()
    next_task[unsafe_offset=0] = 0

    def worker(_w: Int) raises {imm func, var next_task, var num_tasks}:
        while True:
            var t = Int(Atomic.fetch_add(next_task, 1))
            if t >= num_tasks:
                return
            func(t)

    sync_parallelize(worker, workers)


def parallel_row_blocks[
    FuncType: def(Int, Int) raises -> None,
](func: FuncType, rows: Int, rows_per_task: Int) raises:
    """Runs func(first, end) over rows [0, rows) in blocks of rows_per_task
    rows, the blocks taken from the shared counter as in `parallel_dynamic`:
    a task per block, not per row, so that the work of a task dwarfs its
    dispatch."""
    var per = max(rows_per_task, 1)

    def block(t: Int) raises {imm func, var per, var rows}:
        func(t * per, min((t + 1) * per, rows))

    parallel_dynamic(block, (rows + per - 1) // per)
