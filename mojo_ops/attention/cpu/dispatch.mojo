"""Running attention's work items on all CPU cores, then merging the
partial states of key-split requests (called by run_attention, in
attention/run.mojo)."""

from max.algorithm import sync_parallelize

from ...cache.paged_kv_cache import DYNAMIC, PagedKVCache, Ptr
from ...merge.merge_states import merge_row
from ...simd.widen import F32
from ...work_queue import parallel_dynamic
from ..custom_mask import CustomMask
from ..params import AttentionParams
from ..work import AttentionWork
from .step_sizes import MIN_HEAD_DIM
from .task import attention_task


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
    """The work items, each over blocks of heads_per_task KV heads, as tasks
    that the cores take in turn (`attention_task`); then, where any_split,
    the partial states of key-split requests merged into their output
    rows."""
    # One compiled kernel for every head dim (a multiple of 64): the
    # vector loops over head_dim run at run time.
    if head_dim % MIN_HEAD_DIM != 0:
        raise Error("pagedkv: head_dim ", head_dim, " is not a multiple of 64")
    var blocks = (cache.num_kv_heads() + heads_per_task - 1) // heads_per_task
    var dynamic = cache.specialized[DYNAMIC, DYNAMIC, DYNAMIC]()

    def run_task(
        t: Int,
    ) {
        var dynamic,
        var q_ptr,
        var o_ptr,
        var lse_ptr,
        var work,
        var params,
        var num_qo_heads,
        var heads_per_task,
        var mask,
    }:
        attention_task(
            dynamic,
            q_ptr,
            o_ptr,
            lse_ptr,
            work,
            params,
            mask,
            num_qo_heads,
            heads_per_task,
            t,
        )

    parallel_dynamic(run_task, work.num_items * blocks)
    if any_split:
        # A task per request: a batch of one merges inline, on the
        # calling thread (spreading its heads over the cores costs more
        # in wake-ups than the merge itself).
        def merge_task(
            b: Int,
        ) {var work, var o_ptr, var lse_ptr, var num_qo_heads, var head_dim}:
            for qo in range(num_qo_heads):
                merge_split_head(
                    work,
                    o_ptr,
                    lse_ptr,
                    num_qo_heads,
                    head_dim,
                    b,
                    qo,
                    0,
                    1,
                )

        sync_parallelize(merge_task, batch_size)


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
