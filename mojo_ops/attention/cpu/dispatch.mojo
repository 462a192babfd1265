"""Running attention's work items on all CPU cores, then merging the
partial states of key-split requests (called by run_attention, in
attention/run.mojo)."""

from ...cache.paged_kv_cache import DYNAMIC, KVLayout, PagedKVCache, Ptr
from ...merge.merge_states import merge_row
from ...simd.widen import F32
from ...work_queue import Phases, parallel_phases
from ..custom_mask import CustomMask
from ..params import AttentionParams
from ..work import AttentionWork
from .step_sizes import MIN_HEAD_DIM
from .task import attention_task


struct AttentionPhases[q_dtype: DType, kv_dtype: DType, layout: KVLayout](
    TrivialRegisterPassable
):
    """Attention on the CPU as two phases of tasks: the work items, each over
    a block of heads_per_task KV heads (`attention_task`); then, where any
    request's keys were split across items, one merge per request of their
    partial states into its output rows."""

    var cache: PagedKVCache[
        Self.kv_dtype, Self.layout, DYNAMIC, DYNAMIC, DYNAMIC
    ]
    var q: Ptr[Self.q_dtype]
    var o: Ptr[Self.q_dtype]
    var lse: Ptr[F32]
    var work: AttentionWork
    var params: AttentionParams
    var mask: CustomMask
    var num_qo_heads: Int
    var heads_per_task: Int
    var batch_size: Int
    var any_split: Bool

    def __init__(
        out self,
        cache: PagedKVCache[Self.kv_dtype, Self.layout, ...],
        q: Ptr[Self.q_dtype],
        o: Ptr[Self.q_dtype],
        lse: Ptr[F32],
        work: AttentionWork,
        params: AttentionParams,
        mask: CustomMask,
        num_qo_heads: Int,
        heads_per_task: Int,
        batch_size: Int,
        any_split: Bool,
    ) raises:
        # One compiled kernel for every head dim (a multiple of 64): the
        # vector loops over head_dim run at run time.
        if cache.head_dim() % MIN_HEAD_DIM != 0:
            raise Error(
                "pagedkv: head_dim ",
                cache.head_dim(),
                " is not a multiple of 64",
            )
        self.cache = cache.specialized[DYNAMIC, DYNAMIC, DYNAMIC]()
        self.q = q
        self.o = o
        self.lse = lse
        self.work = work
        self.params = params
        self.mask = mask
        self.num_qo_heads = num_qo_heads
        self.heads_per_task = heads_per_task
        self.batch_size = batch_size
        self.any_split = any_split

    def item_tasks(self) -> Int:
        var kv_heads = self.cache.num_kv_heads()
        var blocks = (kv_heads + self.heads_per_task - 1) // self.heads_per_task
        return self.work.num_items * blocks

    def run_item(self, t: Int):
        attention_task(
            self.cache,
            self.q,
            self.o,
            self.lse,
            self.work,
            self.params,
            self.mask,
            self.num_qo_heads,
            self.heads_per_task,
            t,
        )

    def merge_tasks(self) -> Int:
        return self.batch_size if self.any_split else 0

    def run_merge(self, b: Int):
        for qo in range(self.num_qo_heads):
            merge_split_head(
                self.work,
                self.o,
                self.lse,
                self.num_qo_heads,
                self.cache.head_dim(),
                b,
                qo,
                0,
                1,
            )


def run_attention_cpu[
    q_dtype: DType
](
    cache: PagedKVCache,
    q_ptr: Ptr[q_dtype],
    o_ptr: Ptr[q_dtype],
    lse_ptr: Ptr[F32],
    work: AttentionWork,
    params: AttentionParams,
    num_qo_heads: Int,
    head_dim: Int,
    batch_size: Int,
    any_split: Bool,
    heads_per_task: Int,
    mask: CustomMask,
) raises:
    """Runs the work items and then the merges (`AttentionPhases`) on all
    cores, in one dispatch."""
    var phases = AttentionPhases[q_dtype, cache.dtype, cache.layout](
        cache,
        q_ptr,
        o_ptr,
        lse_ptr,
        work,
        params,
        mask,
        num_qo_heads,
        heads_per_task,
        batch_size,
        any_split,
    )

    def task(p: Int, t: Int) {var phases}:
        if p == 0:
            phases.run_item(t)
        else:
            phases.run_merge(t)

    var counts = Phases()
    _ = counts.add(phases.item_tasks())
    _ = counts.add(phases.merge_tasks())
    parallel_phases(task, counts)


def merge_split_head[
    q_dtype: DType
](
    work: AttentionWork,
    output: Ptr[q_dtype],
    lse: Ptr[F32],
    num_qo_heads: Int,
    head_dim: Int,
    b: Int,
    qo: Int,
    first: Int,
    step: Int,
):
    """Merges the partial states of request b's key-split items, if any, for
    query head qo into its query's output row (elements first, first + step,
    ... of it: see `merge_row`)."""
    if not work.writes_partial(b):
        return
    var item0 = Int(work.request_items[unsafe_offset=b])
    var row = work.q_row(item0)
    merge_row(
        work.partial_o.unsafe_offset((item0 * num_qo_heads + qo) * head_dim),
        num_qo_heads * head_dim,
        work.partial_lse.unsafe_offset(item0 * num_qo_heads + qo),
        num_qo_heads,
        work.items_of(b),
        head_dim,
        output.unsafe_offset((row * num_qo_heads + qo) * head_dim),
        lse.unsafe_offset(row * num_qo_heads + qo),
        first,
        step,
    )
