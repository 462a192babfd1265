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
from std.memory.alloc import unsafe_alloc
from std.ffi import external_call
from std.sys import llvm_intrinsic
from std.sys.info import CompilationTarget
from std.time import perf_counter_ns

comptime MAX_PHASES = 16
"""Phases one `parallel_phases` call takes at most."""


comptime LINE_WORDS = 8
"""64-bit words in a 64-byte cache line."""

comptime SPIN_NS_BEFORE_YIELD = 100_000
"""How long a waiting core spins before it starts yielding the core to
other threads: longer than any wait a phase's own tasks cause (a task is a
few to some tens of microseconds), so a core yields only when the task it
waits for is not running, its thread descheduled."""

comptime TURNS_PER_CLOCK_READ = 64
"""Spins between two reads of the clock while a core waits."""


struct Waiter:
    """One core's wait at a phase's end: `pause` (x86) while the wait is
    short, `sched_yield` once it has lasted SPIN_NS_BEFORE_YIELD.

    Why not yield sooner: a yield hands the core to whatever else is
    runnable (MAX's demoted poller, a neighbour process, however low its
    priority) for up to a time slice, and a decode step ends hundreds of
    phases: a waiter that yielded after a few microseconds made a decode
    step several times as long beside a single niced busy loop
    (docs/design.md, "Kernel notes"). Why yield at all: when the thread running the awaited task is
    descheduled (more runnable threads than cores: two processes' workers),
    a waiter that only spun would hold a core that thread may need."""

    var turn: Int
    var start: Int

    def __init__(out self):
        self.turn = 0
        self.start = 0

    @always_inline
    def wait(mut self):
        """One turn of the wait."""
        self.turn += 1
        if self.turn % TURNS_PER_CLOCK_READ == 0:
            var now = perf_counter_ns()
            if self.start == 0:
                self.start = now
            elif now - self.start >= SPIN_NS_BEFORE_YIELD:
                _ = external_call["sched_yield", Int32]()
                return
        comptime if CompilationTarget.is_x86():
            llvm_intrinsic["llvm.x86.sse2.pause", NoneType]()


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
](func: FuncType, phases: Phases, rounds: Int = 1) raises:
    """Runs func(p, t) for every task t of every phase p on all cores: the
    phases in order, the tasks of a phase in any order and at once, each
    core taking the next unclaimed task; returns when all are done.

    With `rounds` > 1 the phases run that many times over, round r's phase
    p as func(r * phases.count + p, t): a stack of layers whose phases
    have the same task counts, on one dispatch to the cores.

    Tasks do not raise: an op checks its operands before its phases start,
    so a bad call writes nothing."""
    if phases.count > MAX_PHASES:
        raise Error("pagedkv: more than ", MAX_PHASES, " phases")
    var workers = min(parallelism_level(None), phases.max_tasks())
    if workers <= 1:
        for r in range(rounds):
            for p in range(phases.count):
                for t in range(Int(phases.tasks[p])):
                    func(r * phases.count + p, t)
        return
    # Each phase's two counters on a 64-byte line of their own: the cores
    # write them, and a line shared with another phase's would move between
    # the cores on every claim of either.
    var lines = rounds * phases.count * LINE_WORDS
    var counters = unsafe_alloc[Int64](2 * lines, alignment=64)
    for i in range(2 * lines):
        counters[unsafe_offset=i] = 0
    var claimed = counters
    var done = counters.unsafe_offset(lines)

    def worker(
        _w: Int,
    ) {imm func, var phases, var rounds, var claimed, var done}:
        for i in range(rounds * phases.count):
            var n = Int(phases.tasks[i % phases.count])
            var next_task = claimed.unsafe_offset(i * LINE_WORDS)
            var finished = done.unsafe_offset(i * LINE_WORDS)
            # A core counts the tasks it ran and adds them once, when it
            # finds none left: one write to the shared count per core and
            # phase, not one per task.
            var ran = 0
            while True:
                var t = Int(Atomic.fetch_add(next_task, 1))
                if t >= n:
                    break
                func(i, t)
                ran += 1
            if ran > 0:
                _ = Atomic.fetch_add(finished, Int64(ran))
            var waiter = Waiter()
            while Int(Atomic.load[ordering=Ordering.ACQUIRE](finished)) < n:
                waiter.wait()

    sync_parallelize(worker, workers)
    counters.unsafe_free()


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
