"""Running CPU tasks on every core, each core taking the next task when it is
free, in phases that follow one another on one dispatch to the cores.

`sync_parallelize(func, n)` hands task i to worker i mod workers up front, so
a core that runs slower (a neighbour's interrupts, time stolen by a
hypervisor, tasks of uneven cost) leaves the others idle at the end, a
visible share of a decode step (docs/design.md, "Kernel notes"). Here each
core pulls task numbers from a shared counter instead.

Each call of `sync_parallelize` also costs about ten microseconds of
waking the cores (docs/performance.md), as much as a small product takes
to stream its weight. An op made of dependent steps (quantize the
activations, then multiply; or a whole decoder layer) therefore runs them
as phases of one call (`parallel_phases`): a core that finds no task left
in its phase waits, spinning, until every task of the phase is done, then
moves to the next. A core that joins late starts where the others are (it
finds the finished phases' tasks all taken), so no core ever waits for
another to arrive, only for tasks already taken to finish.
"""

from max.algorithm import sync_parallelize
from max.runtime.asyncrt import parallelism_level
from std.atomic import Atomic, Ordering
from std.memory import stack_allocation
from std.ffi import external_call
from std.sys import llvm_intrinsic
from std.sys.info import CompilationTarget

comptime MAX_PHASES = 16
"""Phases one `parallel_phases` call takes at most."""


comptime LINE_WORDS = 8
"""64-bit words in a 64-byte cache line."""

comptime SPINS_BEFORE_YIELD = 256
"""Spins a waiting core makes before it yields the core to another thread
at each turn: a few microseconds, about what a task of a small product
takes."""


@always_inline
def wait_turn(turn: Int):
    """One turn of a wait: a `pause` (x86) for the first SPINS_BEFORE_YIELD
    turns, then `sched_yield`. On a VM the scheduler may put two of MAX's
    workers on one core; a waiter that only spun would then hold the core
    that the task it waits for needs, for a whole time slice."""
    if turn < SPINS_BEFORE_YIELD:
        comptime if CompilationTarget.is_x86():
            llvm_intrinsic["llvm.x86.sse2.pause", NoneType]()
    else:
        _ = external_call["sched_yield", Int32]()


struct Phases(TrivialRegisterPassable):
    """Task counts of the phases of one `parallel_phases` call, in order."""

    var tasks: SIMD[DType.int64, MAX_PHASES]
    var count: Int

    def __init__(out self):
        self.tasks = 0
        self.count = 0

    def add(mut self, tasks: Int) -> Int:
        """Appends a phase of `tasks` tasks (0 skips it); returns its index."""
        self.tasks[self.count] = Int64(tasks)
        self.count += 1
        return self.count - 1

    def max_tasks(self) -> Int:
        return Int(self.tasks.reduce_max())


def parallel_phases[
    FuncType: def(Int, Int) -> None,
](func: FuncType, phases: Phases) raises:
    """Runs func(p, t) for every task t of every phase p on all cores: the
    phases in order, the tasks of a phase in any order and at once, each
    core taking the next unclaimed task; returns when all are done.

    Tasks do not raise: an op checks its operands before its phases start,
    so a bad call writes nothing."""
    if phases.count > MAX_PHASES:
        raise Error("pagedkv: more than ", MAX_PHASES, " phases")
    var workers = min(parallelism_level(None), phases.max_tasks())
    if workers <= 1:
        for p in range(phases.count):
            for t in range(Int(phases.tasks[p])):
                func(p, t)
        return
    # Each phase's two counters on a 64-byte line of their own: the cores
    # write them, and a line shared with another phase's would move between
    # the cores on every claim of either.
    var claimed = stack_allocation[
        MAX_PHASES * LINE_WORDS, Scalar[DType.int64], alignment=64
    ]()
    var done = stack_allocation[
        MAX_PHASES * LINE_WORDS, Scalar[DType.int64], alignment=64
    ]()
    for p in range(MAX_PHASES):
        claimed[unsafe_offset=p * LINE_WORDS] = 0
        done[unsafe_offset=p * LINE_WORDS] = 0

    def worker(_w: Int) {imm func, var phases, var claimed, var done}:
        for p in range(phases.count):
            var n = Int(phases.tasks[p])
            var next_task = claimed.unsafe_offset(p * LINE_WORDS)
            var finished = done.unsafe_offset(p * LINE_WORDS)
            # A core counts the tasks it ran and adds them once, when it
            # finds none left: one write to the shared count per core and
            # phase, not one per task.
            var ran = 0
            while True:
                var t = Int(Atomic.fetch_add(next_task, 1))
                if t >= n:
                    break
                func(p, t)
                ran += 1
            if ran > 0:
                _ = Atomic.fetch_add(finished, Int64(ran))
            var turn = 0
            while Int(Atomic.load[ordering=Ordering.ACQUIRE](finished)) < n:
                wait_turn(turn)
                turn += 1

    sync_parallelize(worker, workers)


def parallel_dynamic[
    FuncType: def(Int) -> None,
](func: FuncType, num_tasks: Int) raises:
    """Runs func(0) ... func(num_tasks - 1) on all cores, each core taking
    the next unclaimed task; returns when all are done."""

    def task(_p: Int, t: Int) {imm func}:
        func(t)

    var phases = Phases()
    _ = phases.add(num_tasks)
    parallel_phases(task, phases)


@always_inline
def row_blocks(rows: Int, rows_per_task: Int) -> Int:
    """Tasks of `rows_per_task` rows (at least 1) that cover `rows`."""
    var per = max(rows_per_task, 1)
    return (rows + per - 1) // per


@always_inline
def row_block(t: Int, rows: Int, rows_per_task: Int) -> Tuple[Int, Int]:
    """Rows [first, end) of task t of `row_blocks(rows, rows_per_task)`."""
    var per = max(rows_per_task, 1)
    return (t * per, min((t + 1) * per, rows))


def parallel_row_blocks[
    FuncType: def(Int, Int) -> None,
](func: FuncType, rows: Int, rows_per_task: Int) raises:
    """Runs func(first, end) over rows [0, rows) in blocks of rows_per_task
    rows, the blocks taken from the shared counter as in `parallel_dynamic`:
    a task per block, not per row, so that the work of a task dwarfs its
    dispatch."""

    def block(t: Int) {imm func, var rows, var rows_per_task}:
        var r = row_block(t, rows, rows_per_task)
        func(r[0], r[1])

    parallel_dynamic(block, row_blocks(rows, rows_per_task))
