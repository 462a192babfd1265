"""Attention options shared by decode and prefill, and the work split of a batch.

The options have FlashInfer's meaning (see mojo_ops/attention/params.mojo for
the exact formulas); they travel to the kernels as two small host tensors, so
changing them never recompiles anything.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np
from max.dtype import DType

from .._checks import INT32_MAX, check_float, check_int, check_plan_size
from .._ops.contract import (
    CPU_HEAD_DIMS,
    CPU_MAX_HEAD_DIM,
    F_QK_SCALE,
    F_ROPE_SCALE,
    F_ROPE_THETA,
    F_SM_SCALE,
    F_SOFT_CAP,
    F_V_SCALE,
    FLOAT_PARAMS,
    GPU_KERNEL_AUTO,
    GPU_KERNEL_GENERIC,
    GPU_KERNEL_MMA,
    GPU_KERNEL_TMA,
    HEAD_DIMS,
    INT_CAUSAL,
    INT_GPU_KERNEL,
    INT_HEADS_PER_TASK,
    INT_KV_SPLIT,
    INT_MAX_ROWS,
    INT_PARAMS,
    INT_POS_ENCODING,
    INT_WINDOW_LEFT,
    ITEM_FIELDS,
    MIN_HEAD_DIM,
    POS_ENCODING_MODES,
)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """FlashInfer's ALiBi slopes (Press et al.) of num_heads query heads, as
    mojo_ops/attention/params.mojo's alibi_slope computes them."""
    n = 1 << (num_heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    slopes += [2.0 ** (-4.0 * (2 * (h - n) + 1) / n) for h in range(n, num_heads)]
    return np.array(slopes, np.float64)


def decode_alibi_lse_shift(seq_lens: np.ndarray, num_qo_heads: int) -> np.ndarray:
    """What FlashInfer's decode kernels add to the base-2 LSE under ALiBi:
    they bias key j by slope * j, the kernels here by slope * (j - (L - 1))
    (as FlashInfer's prefill does), so o is the same and the decode LSE is
    slope * (L - 1) * log2(e) higher. [B, Hq] float32; 0 for an empty request."""
    last = np.maximum(seq_lens.astype(np.float64) - 1, 0)
    return (last[:, None] * alibi_slopes(num_qo_heads)[None, :] * math.log2(math.e)).astype(
        np.float32
    )


def check_heads(num_qo_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """Raises unless both are positive and the query heads split evenly over
    the KV heads (GQA); returns them as ints."""
    num_qo_heads = check_int("num_qo_heads", num_qo_heads, 1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
    if num_qo_heads % num_kv_heads:
        raise ValueError(
            f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    return num_qo_heads, num_kv_heads


def as_dtype(x: object, name: str) -> DType:
    """A dtype given as a MAX DType, a torch or NumPy dtype, or a string."""
    if isinstance(x, DType):
        return x
    text = str(x).removeprefix("torch.")
    try:
        return DType[text]
    except KeyError:
        pass
    try:
        return DType.from_numpy(np.dtype(x))
    except TypeError as e:
        raise TypeError(f"{name}: {x!r} is not a dtype") from e


@dataclass(frozen=True)
class AttentionOptions:
    """Validated scalar options of one plan(): integers that fit the kernels'
    int32, floats that are finite numbers (NaN and infinities raise
    ValueError)."""

    head_dim: int
    pos_encoding_mode: str = "NONE"
    window_left: int = -1
    logits_soft_cap: float | None = None
    sm_scale: float | None = None
    rope_scale: float | None = None
    rope_theta: float | None = None

    def __post_init__(self) -> None:
        if self.head_dim not in CPU_HEAD_DIMS:
            raise ValueError(
                f"head_dim must be a multiple of {MIN_HEAD_DIM} up to {CPU_MAX_HEAD_DIM}"
                f" ({', '.join(map(str, HEAD_DIMS))} on a GPU), got {self.head_dim}"
            )
        if self.pos_encoding_mode not in POS_ENCODING_MODES:
            raise ValueError(
                f"pos_encoding_mode must be one of {sorted(POS_ENCODING_MODES)}, "
                f"got {self.pos_encoding_mode!r}"
            )
        # The kernels compare positions against -window_left in int32.
        check_int("window_left", self.window_left, -1, INT32_MAX - 1)
        for name in ("logits_soft_cap", "sm_scale", "rope_scale", "rope_theta"):
            value = getattr(self, name)
            if value is not None:
                check_float(name, value, positive=True)

    @classmethod
    def of_plan(cls, head_dim: int, planned: Mapping[str, object]) -> AttentionOptions:
        """The options of a wrapper's plan(): the PLAN_OPTIONS among its
        arguments by name (`planned`, FlashInfer's names), window_left as an
        int and a logits_soft_cap of 0 off, as FlashInfer's."""
        options = {name: planned[name] for name in PLAN_OPTIONS}
        options["window_left"] = check_int("window_left", options["window_left"], -1, INT32_MAX - 1)
        # FlashInfer's 0 is off; NaN is truthy and reaches the check.
        options["logits_soft_cap"] = options["logits_soft_cap"] or None
        return cls(head_dim, **options)

    @property
    def scale(self) -> float:
        """sm_scale, or FlashInfer's default 1 / sqrt(head_dim)."""
        return self.sm_scale if self.sm_scale is not None else 1 / math.sqrt(self.head_dim)

    def float_params(
        self, q_scale: float | None, k_scale: float | None, v_scale: float | None
    ) -> np.ndarray:
        sm_scale = self.scale
        qk_scale = (1.0 if q_scale is None else q_scale) * (1.0 if k_scale is None else k_scale)
        params = np.zeros(FLOAT_PARAMS, np.float32)
        params[F_SM_SCALE] = sm_scale
        params[F_SOFT_CAP] = self.logits_soft_cap or 0.0
        params[F_ROPE_SCALE] = self.rope_scale or 1.0
        params[F_ROPE_THETA] = self.rope_theta or 1e4
        params[F_QK_SCALE] = qk_scale
        params[F_V_SCALE] = 1.0 if v_scale is None else v_scale
        return params

    def int_params(
        self,
        heads_per_task: int,
        causal: bool,
        max_queries: int,
        kv_split: bool,
        gpu_kernel: int = 0,
    ) -> np.ndarray:
        """The op's int_params (slots named in _op_contract); kv_split: the
        work items split keys (decode), not queries (prefill)."""
        params = np.zeros(INT_PARAMS, np.int32)
        params[INT_WINDOW_LEFT] = self.window_left
        params[INT_POS_ENCODING] = POS_ENCODING_MODES[self.pos_encoding_mode]
        params[INT_HEADS_PER_TASK] = heads_per_task
        params[INT_CAUSAL] = causal
        params[INT_MAX_ROWS] = max_queries
        params[INT_GPU_KERNEL] = gpu_kernel
        params[INT_KV_SPLIT] = kv_split
        return params


PLAN_OPTIONS = tuple(f.name for f in fields(AttentionOptions) if f.name != "head_dim")
"""The attention options every paged wrapper's plan() takes by these names
(FlashInfer's): AttentionOptions' fields but head_dim."""


DECODE_BACKENDS = ("auto", "generic", "tma", "mma", "fa2", "fa3", "trtllm-gen")
"""GPU decode kernels: "tma" is the Hopper kernel (mojo_ops/attention/gpu/sm90.mojo),
"mma" its tensor-core form (gpu/tensor_core.mojo: q.K and p.V as mma.sync,
16-bit q and cache of one dtype, head dims 64 and 128, up to 16 query heads
per KV head), "generic" the kernel for every GPU; "auto" runs the
tensor-core kernel at 8 or more query heads per KV head, the Hopper kernel
below that, each where it applies (sm_90, the batch's dtypes and shape: the
kernel decides), and the generic one elsewhere. FlashInfer's names run unchanged:
"fa2" (its kernel for every GPU) is the generic kernel, "fa3" (its Hopper
kernel) the Hopper one, "trtllm-gen" (its Blackwell kernel, which code
written for sm_100 asks for) "auto"."""
HOPPER_BACKENDS = ("tma", "mma", "fa3")
MMA_MAX_GROUP = 16
PREFILL_BACKENDS = ("auto", "fa2", "fa3", "trtllm-gen")
"""Prefill has one kernel a device: FlashInfer's "auto", "fa2", "fa3" and
"trtllm-gen" (its Hopper and Blackwell kernels, which code written for sm_90
or sm_100 asks for) name it."""
RAGGED_ONLY_BACKENDS = ("cutlass", "fmha_v2")
"""FlashInfer's ragged-prefill kernels of its own (the SM100 FMHA and
TRT-LLM's fmha_v2): on the ragged wrapper they too name pagedkv's one
prefill kernel."""


def check_backend(backend: str, known: tuple[str, ...]) -> None:
    """Raises for a backend name outside `known`; FlashInfer's names for
    kernels pagedkv does not have ("fa3", "cudnn", "trtllm-gen") say so."""
    if backend in known:
        return
    why = f"backend must be one of {known}, got {backend!r}"
    if backend in ("fa3", "cudnn", "trtllm-gen"):
        why += f": pagedkv has no {backend} kernel"
    raise ValueError(why)


TMA_BOX_ROWS = 16
TMA_MAX_GROUP = 8


def decode_kernel(
    backend: str,
    is_gpu: bool,
    kv_layout: str,
    page_size: int | None,
    group: int,
    pos_encoding_mode: str,
) -> int:
    """int_params[INT_GPU_KERNEL] for a decode backend; raises if "tma" cannot run this
    batch (the kernel checks its GPU and dtypes itself, and "auto" falls back
    there). page_size None: not known yet (a symbolic graph dimension)."""
    check_backend(backend, DECODE_BACKENDS)
    if backend in ("auto", "trtllm-gen"):
        return GPU_KERNEL_AUTO if is_gpu else GPU_KERNEL_GENERIC
    if backend in ("generic", "fa2"):
        return GPU_KERNEL_GENERIC
    assert backend in HOPPER_BACKENDS
    problems = []
    if not is_gpu:
        problems.append("the page table is on the CPU (it needs an sm_90 GPU)")
    if kv_layout != "NHD":
        problems.append(f"kv_layout is {kv_layout} (it needs NHD)")
    if page_size is not None and page_size % TMA_BOX_ROWS:
        problems.append(f"page_size {page_size} is not a multiple of {TMA_BOX_ROWS}")
    max_group = MMA_MAX_GROUP if backend == "mma" else TMA_MAX_GROUP
    if group > max_group:
        problems.append(f"{group} query heads per KV head (at most {max_group})")
    if pos_encoding_mode == "ROPE_LLAMA":
        problems.append("RoPE on the fly is not supported (rotate q and k before the cache)")
    if problems:
        raise ValueError(f"backend={backend!r} cannot run this batch: " + "; ".join(problems))
    return GPU_KERNEL_MMA if backend == "mma" else GPU_KERNEL_TMA


CPU_MAX_TASK_ROWS = 64
"""Query rows (a query token's head) one CPU task scores together: their
state lives on the heap, their K/V reads are shared."""

CPU_MAX_SHARED_ROWS = 128
"""Query rows a shared decode item (`share_decode_prefixes`) takes at most:
more than a task's usual, as each chunk of the shared keys is widened and
transposed once for all of them, which pays where int8 keys are widened to
float32 (AVX2; docs/performance.md, "AVX2 products one vector of columns
at a time")."""


def heads_per_task(num_qo_heads: int, num_kv_heads: int) -> int:
    """KV heads per CPU task: all of them when their query heads fit, so an
    NHD page is read token row by token row, in memory order."""
    group = num_qo_heads // num_kv_heads
    return max(1, min(num_kv_heads, CPU_MAX_TASK_ROWS // group))


GPU_BLOCKS_PER_SM = 2
"""Decode thread blocks planned per SM. The Hopper kernel asks for two at
once (`nvvm.minctasm`), and planning for 2 beats 3, 4 and 6 (docs/design.md):
a block past a whole wave waits for one."""


def parallel_slots(is_gpu: bool) -> int:
    """Work items that run at once: 4 per CPU core (the task queue evens out
    their lengths), or GPU_BLOCKS_PER_SM thread blocks per SM."""
    if is_gpu:
        return GPU_BLOCKS_PER_SM * gpu_sm_count()
    return 4 * cpu_count()


@functools.cache
def cpu_count() -> int:
    """The machine's CPUs (asked once: the call costs microseconds)."""
    return os.cpu_count() or 1


@functools.cache
def gpu_sm_count() -> int:
    """SMs of the first CUDA GPU torch sees; an H100 SXM's 132 without one
    (a plan built for a virtual device or a graph compiled ahead of time)."""
    try:
        import torch
    except ImportError:
        return 132
    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(0).multi_processor_count


GPU_MAX_ROWS = 8
"""Query rows per GPU thread block (MAX_ROWS in mojo_ops/attention/gpu/generic.mojo)."""


WORK_ITEM_BYTES = 160
"""Host bytes a work item takes while a plan builds its list: its six int32
fields and the int64 temporaries NumPy makes on the way (about a dozen)."""


def item_array(*fields: np.ndarray) -> np.ndarray:
    """Work items [I, ITEM_FIELDS]: request, first query row, query rows,
    first query's position, first key, end key (mojo_ops/attention/work.mojo)."""
    assert len(fields) == ITEM_FIELDS
    return np.ascontiguousarray(np.stack(fields, axis=1).astype(np.int32))


def decode_work(
    seq_lens: np.ndarray,
    page_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    per_task: int,
    options: AttentionOptions,
    is_gpu: bool,
    min_chunk: int = 256,
    fixed_chunk: int | None = None,
    max_splits: int | None = None,
    shared_prefix: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Work items of a decode step over requests of seq_lens [B] tokens in
    pages of page_size: one query per request, its visible keys
    split into page-aligned chunks (flash-decoding) when the batch alone would
    leave cores (or SMs) idle.

    Chunks are sized so that (items x head blocks) fills about
    parallel_slots() workers; a head block is the KV heads one CPU task covers,
    or the query rows one GPU thread block covers. Every request has at least
    one item, so an empty one gets o = 0, lse = -inf. fixed_chunk (tokens, a
    page multiple) replaces that choice: FlashInfer's fixed_split_size and
    disable_split_kv. max_splits, if given, lengthens the chunks until no
    request has more items than that (a captured step's fixed work list,
    `decode_split_cap`). shared_prefix [B] (CPU, no fixed_chunk):
    tokens of each request's prefix whose pages a neighbour in the batch
    shares (`shared_prefix_tokens`); its keys are split apart from the
    rest, in chunks of `shared_prefix_chunk`, for `share_decode_prefixes`.
    Returns items [I, 6] and request_items [B + 1].
    """
    seq_lens = np.asarray(seq_lens).astype(np.int64)
    if options.window_left < 0:
        first_visible = np.zeros_like(seq_lens)
    else:
        first_visible = np.maximum(seq_lens - 1 - options.window_left, 0)
    group = num_qo_heads // num_kv_heads
    if is_gpu:
        head_blocks = num_kv_heads * -(-group // GPU_MAX_ROWS)
    else:
        head_blocks = -(-num_kv_heads // per_task)
    # Chunks start on page boundaries of the sequence, counted from 0.
    aligned = first_visible // page_size * page_size
    span = seq_lens - aligned
    if fixed_chunk is not None:
        chunk = fixed_chunk
    elif is_gpu:
        chunk = gpu_chunk(span, head_blocks, page_size, min_chunk)
    else:
        per_block_slots = max(parallel_slots(is_gpu) // head_blocks, 1)
        chunk = max(min_chunk, -(-int((seq_lens - first_visible).sum()) // per_block_slots))
        chunk = -(-chunk // page_size) * page_size
    if max_splits is not None:
        longest_pages = -(-int(span.max(initial=0)) // page_size)
        chunk = max(chunk, -(-longest_pages // max_splits) * page_size)
    if shared_prefix is not None and not is_gpu:
        shared_chunk = shared_prefix_chunk(shared_prefix, page_size, min_chunk, aligned)
        return shared_prefix_items(
            seq_lens, shared_prefix, chunk, shared_chunk, first_visible, aligned
        )
    counts = np.maximum(-(-span // chunk), 1)
    request_items = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    request = np.repeat(np.arange(len(seq_lens)), counts)
    k = np.arange(int(request_items[-1])) - request_items[request]
    if is_gpu and fixed_chunk is None:
        # Even chunks, a page apart at most: a request's chunks run side by
        # side on the SMs, so the longest sets the pace (1008 + 16 tokens
        # would take as long as 1008 + 1008).
        pages, n = -(-span[request] // page_size), counts[request]
        start, stop = k * pages // n * page_size, (k + 1) * pages // n * page_size
    else:
        start, stop = k * chunk, (k + 1) * chunk
    first = np.maximum(aligned[request] + start, first_visible[request])
    end = np.maximum(np.minimum(aligned[request] + stop, seq_lens[request]), first)
    items = item_array(request, request, np.ones_like(request), seq_lens[request] - 1, first, end)
    return items, request_items


def shared_prefix_chunk(
    shared_prefix: np.ndarray, page_size: int, min_chunk: int, start: np.ndarray | None = None
) -> int:
    """Keys of each decode item over a shared prefix (whole pages): the
    longest shared prefix (from each request's start [B], its first visible
    key's page under a window) split once per core, and min_chunk at least.
    An item's setup (its queries loaded and coded, its partial states
    written and merged) is paid once per item, and a shared item's run is
    long: one per core keeps the cores even at the fewest items."""
    span = np.asarray(shared_prefix) - (0 if start is None else np.asarray(start))
    longest = int(np.max(span, initial=0))
    chunk = max(min_chunk, -(-longest // cpu_count()))
    return -(-chunk // page_size) * page_size


def shared_prefix_items(
    seq_lens: np.ndarray,
    shared_prefix: np.ndarray,
    chunk: int,
    shared_chunk: int,
    first_visible: np.ndarray,
    start: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode items (CPU) whose keys split at each request's shared prefix:
    the prefix's visible part in pieces of a grid of shared_chunk keys from
    key 0 (the queries of many requests share each piece:
    `shared_prefix_chunk`), then the rest in chunks of `chunk`.

    Under a window (first_visible [B], each request's first visible key)
    the prefix's pieces start at start [B], the page of that key, so that
    requests whose windows start in one page cut the prefix alike; the
    kernel masks each row's keys before its window. A request that shares
    nothing it can see gets the items the plain plan gives it. Returns
    items and request_items as `decode_work` does."""
    prefix = np.clip(np.asarray(shared_prefix, np.int64), start, seq_lens)
    first_cell = start // shared_chunk
    heads = np.where(prefix > start, -(-prefix // shared_chunk) - first_cell, 0)
    tails = np.maximum(-(-(seq_lens - prefix) // chunk), 1)
    request_items = np.concatenate([[0], np.cumsum(heads + tails)]).astype(np.int32)
    request = np.repeat(np.arange(len(seq_lens)), heads + tails)
    k = np.arange(int(request_items[-1])) - request_items[request]
    in_head = k < heads[request]
    cell = first_cell[request] + k
    tail = prefix[request] + (k - heads[request]) * chunk
    first = np.where(
        in_head,
        np.maximum(cell * shared_chunk, start[request]),
        np.maximum(tail, first_visible[request]),
    )
    end = np.minimum(
        np.where(in_head, np.minimum((cell + 1) * shared_chunk, prefix[request]), tail + chunk),
        seq_lens[request],
    )
    items = item_array(request, request, np.ones_like(request), seq_lens[request] - 1, first, end)
    return items, request_items


def common_prefix_pages(kv_indptr: np.ndarray, kv_indices: np.ndarray) -> np.ndarray:
    """[B - 1]: how many leading page ids requests b and b + 1 of a page
    table (kv_indptr [B + 1], kv_indices) have in common."""
    lens = np.diff(kv_indptr)
    if len(lens) < 2 or len(kv_indices) == 0:
        return np.zeros(max(len(lens) - 1, 0), np.int64)
    used = np.arange(int(lens.max())) < lens[:, None]
    table = np.full(used.shape, -1, np.int64)
    table[used] = kv_indices[: int(kv_indptr[-1])]
    same = (table[:-1] == table[1:]) & used[:-1] & used[1:]
    # Leading equal pages: the first False, with one appended to every row.
    return np.argmin(np.pad(same, ((0, 0), (0, 1))), axis=1)


def shared_prefix_tokens(common: np.ndarray, seq_lens: np.ndarray, page_size: int) -> np.ndarray:
    """[B]: tokens of each request's prefix that a neighbour shares (pages
    in common with the request before or after it, `common_prefix_pages`),
    at most its length less one: its last key, the new token's, is its own."""
    before = np.concatenate([[0], common])
    after = np.concatenate([common, [0]])
    return np.minimum(np.maximum(before, after) * page_size, np.maximum(seq_lens - 1, 0))


def share_decode_prefixes(
    items: np.ndarray,
    request_items: np.ndarray,
    common: np.ndarray,
    page_size: int,
    group: int,
) -> np.ndarray:
    """Decode work items (CPU) in which consecutive requests that share a
    prefix's pages read them once: where requests b, b + 1, .. have the same
    c-th item (same first and end key, inside the pages they have in common,
    `common_prefix_pages`), request b's item takes all their queries (up to
    CPU_MAX_SHARED_ROWS rows of a KV head) and theirs none; the shared item
    writes their partial states into their own items' slots
    (mojo_ops/attention/work.mojo). Items of one query per request (rows in
    request order); returns a new array,
    or `items` itself when nothing is shared.

    A shared item sums its rows in another order than an item of one
    request, so logits depend in their last bits on who shares a prefix.
    """
    if not common.any():
        return items
    counts = np.diff(request_items)
    most = max(CPU_MAX_SHARED_ROWS // group, 1)
    # [C, B]: request b's c-th item, where it has one.
    c = np.arange(int(counts.max()))[:, None]
    has = c < counts[None, :]
    at = np.where(has, request_items[None, :-1] + c, 0)
    first, end = items[at, 4], items[at, 5]
    linked = (
        has[:, :-1]
        & has[:, 1:]
        & (first[:, :-1] == first[:, 1:])
        & (end[:, :-1] == end[:, 1:])
        & (-(-end[:, :-1] // page_size) <= common[None, :])
    )
    # Runs of linked requests along b: each request's place in its run and
    # the run's last request; every `most`-th place leads an item.
    b = np.broadcast_to(np.arange(len(counts)), has.shape)
    no = np.zeros((len(c), 1), bool)
    after_link = np.concatenate([no, linked], axis=1)
    place = b - np.maximum.accumulate(np.where(after_link, 0, b), axis=1)
    before_link = np.concatenate([linked, no], axis=1)
    last = np.minimum.accumulate(np.where(before_link, len(counts), b)[:, ::-1], axis=1)[:, ::-1]
    queries = np.where(place % most == 0, np.minimum(most, last - b + 1), 0)
    items = items.copy()
    items[at[has], 2] = queries[has]
    return items


GPU_CHUNK_CHOICES = 64
"""Most chunk sizes gpu_chunk weighs (splits of the longest request into 1, 2,
.. parts), bounding plan()'s cost."""

GPU_ITEM_START_PAGES = 4
"""What starting a decode thread block costs, in pages it could have read
instead: its first loads' latency and its partial state's write and merge.
Counting it keeps gpu_chunk from cutting requests that already fill two
waves into many short chunks for a slightly fuller last wave: at (64, 8192,
32, 8) on an H100 one chunk a request ran in 0.90x the time of the 19 that
the count without it chose (docs/gpu.md)."""


def decode_split_cap(
    batch_size: int, num_qo_heads: int, num_kv_heads: int, per_task: int, is_gpu: bool
) -> int:
    """Work items per request that a batch of batch_size decodes needs at most
    to fill the machine: the parallel slots over the batch's head blocks (see
    decode_work), at least 1. A use_cuda_graph decode wrapper fixes its work
    list at batch_size times this many items."""
    group = num_qo_heads // num_kv_heads
    if is_gpu:
        head_blocks = num_kv_heads * -(-group // GPU_MAX_ROWS)
    else:
        head_blocks = -(-num_kv_heads // per_task)
    return max(1, -(-parallel_slots(is_gpu) // (max(batch_size, 1) * head_blocks)))


def gpu_chunk(span: np.ndarray, head_blocks: int, page_size: int, min_chunk: int) -> int:
    """Keys per decode work item on a GPU (a page multiple), for requests
    whose visible keys span `span` [B] tokens from a page boundary.

    Thread blocks run in waves of parallel_slots(True), a wave lasting as long
    as its longest chunk plus a block's start (GPU_ITEM_START_PAGES). Of the
    chunks that cut the longest request into 1, 2, 3, .. even parts (at least
    min_chunk keys), this takes the one whose waves x (chunk + start) is
    least, and the larger of equals (fewer items to merge).
    """
    pages = -(-span // page_size)
    longest = max(int(pages.max(initial=0)), 1)
    chunks = np.unique(-(-longest // np.arange(1, GPU_CHUNK_CHOICES + 1)))[::-1]
    chunks = chunks[(chunks >= -(-min_chunk // page_size)) | (chunks == longest)]
    items = np.maximum(-(-pages[None, :] // chunks[:, None]), 1).sum(axis=1)
    waves = -(-(head_blocks * items) // parallel_slots(True))
    cost = waves * (chunks + GPU_ITEM_START_PAGES)
    return int(chunks[np.argmin(cost)]) * page_size  # argmin: the first, largest, of equals


def prefill_tile(group: int, is_gpu: bool) -> int:
    """Query tokens per prefill work item: a CPU task's CPU_MAX_TASK_ROWS rows
    of one KV head, or 16 tokens on a GPU (spread over blocks of GPU_MAX_ROWS
    rows)."""
    return 16 if is_gpu else max(CPU_MAX_TASK_ROWS // group, 1)


def prefill_work(
    seq_lens: np.ndarray,
    qo_indptr: np.ndarray,
    group: int,
    options: AttentionOptions,
    causal: bool,
    is_gpu: bool,
    align: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Work items of a prefill over requests of seq_lens [B] cached tokens
    (queries included): tiles of each request's query tokens, each
    with every key one of its queries may see (causal and window bounds).

    Request b's n_b queries are its last n_b tokens: query i sits at position
    seq_len - n_b + i. A CPU tile holds up to CPU_MAX_TASK_ROWS query rows of
    one KV head (tokens x group heads), so every key row read serves them
    all. With `align` (a power of two) tiles are at most that many tokens and
    start at positions that are multiples of it, so a query's tile, and with
    it every sum the kernel makes for it, is the same whether the prompt is
    prefilled whole or in pieces that start at multiples of `align`
    (batch-invariant prefill). Returns items [I, 6], request_items [B + 1]
    and the most queries in a tile.
    """
    seq_lens = np.asarray(seq_lens).astype(np.int64)
    qo_indptr = qo_indptr.astype(np.int64)
    counts = np.diff(qo_indptr)
    tile = prefill_tile(group, is_gpu)
    if align is not None:  # a power of two that divides align
        tile = 1 << (min(tile, align).bit_length() - 1)
    starts = seq_lens - counts  # each request's first query position
    # Tile k of request b covers positions [lo, hi): the grid of `tile`
    # starts from the first query (no align) or from position 0 (align).
    offset = np.zeros_like(starts) if align is None else starts % tile
    tiles = np.where(counts > 0, -(-(counts + offset) // tile), 0)
    check_plan_size("the work items of qo_indptr's queries", int(tiles.sum()), WORK_ITEM_BYTES)
    request_items = np.concatenate([[0], np.cumsum(tiles)]).astype(np.int32)
    request = np.repeat(np.arange(len(counts)), tiles)
    k = np.arange(int(request_items[-1])) - request_items[request]
    lo = np.maximum(k * tile - offset[request], 0)
    hi = np.minimum((k + 1) * tile - offset[request], counts[request])
    q0, queries = lo, hi - lo
    q_pos = starts[request] + q0
    if options.window_left < 0:
        first = np.zeros_like(q_pos)
    else:
        first = np.maximum(q_pos - options.window_left, 0)
    end = np.minimum(q_pos + queries, seq_lens[request]) if causal else seq_lens[request]
    # A causal tile of queries before position 0 (more queries than keys) sees no key.
    end = np.maximum(end, first)
    items = item_array(request, qo_indptr[request] + q0, queries, q_pos, first, end)
    return items, request_items, int(queries.max()) if len(queries) else 1


def check_gpu_head_dim(head_dim: int) -> None:
    """Raises unless the GPU kernels are compiled for head_dim (the CPU
    kernel takes every multiple of MIN_HEAD_DIM up to CPU_MAX_HEAD_DIM)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"head_dim {head_dim} runs on the CPU only; on a GPU it must be one of {HEAD_DIMS}"
        )
