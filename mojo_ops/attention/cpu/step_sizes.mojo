"""How much one step of the CPU task's inner loops takes: FMA chains,
(row, token) dot products, the head_dim granule, runs of a row, heads
taken together (see task.mojo for the task as a whole)."""

from std.sys import size_of

from ...simd.widen import VECTOR_REGISTERS, W


comptime CHAINS = VECTOR_REGISTERS // 2
"""Independent FMA chains a V pass keeps in flight, half the registers:
the other half hold the V block, the probabilities and the loads in flight.
With AVX-512 that is twice FMA latency x ports (4 x 2), so the widening and
loads between a tile's FMAs leave no port idle; with AVX2, 16 chains would
spill to the stack (docs/design.md, "Kernel notes")."""

comptime DOTS_PER_STEP = W
"""(Head, token) dot products scored together: one vector of sums, so that
the reduction's shuffles are shared by a whole vector."""

comptime MIN_HEAD_DIM = 64
"""The head_dim granule: head_dim is a run-time value (one compiled kernel
serves all), a multiple of MIN_HEAD_DIM (four AVX-512 float32 vectors,
eight AVX2 ones)."""

comptime RUN_BYTES = 256
"""Bytes of one K or V row that a step of single-row tiles (GQA group 1)
reads in a run before the next row. A step reads its tokens' and heads'
rows side by side, and the L1 fills from L2 far faster from few long runs
than from many short ones. Larger tiles keep one BLOCK: a step's q slices
would outnumber the registers and be reloaded for every token
(docs/design.md, "Kernel notes")."""


def row_run[kv_dtype: DType]() -> Int:
    """Elements of a K or V row a step of single-row tiles reads in a run:
    RUN_BYTES, at most two MIN_HEAD_DIM granules (a head_dim of an odd
    number of granules is read in runs of one)."""
    return min(RUN_BYTES // size_of[kv_dtype](), 2 * MIN_HEAD_DIM)


def v_heads[kv_dtype: DType]() -> Int:
    """KV heads of one query row each whose V a step folds in together:
    as many as CHAINS accumulators hold when each head takes a run of
    `row_run` elements (float32: 4 heads, 16-bit and fp8: 2)."""
    return max(CHAINS // (row_run[kv_dtype]() // W), 1)


def paired_heads[kv_dtype: DType]() -> Int:
    """KV heads of one query row each (GQA group 1) that a step scores
    together (V: `v_heads`; group 2: half as many, scores and V): each
    token's run of adjacent head rows read in order is then 2 KiB at
    head_dim 128 (float32: 4 heads, 16-bit: 8), instead of one head's
    256-512 B piece of many tokens' rows."""
    return 4 if size_of[kv_dtype]() >= 4 else 8
