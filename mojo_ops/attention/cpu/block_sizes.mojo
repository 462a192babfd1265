"""How many tokens a block of the CPU task's K or V reads, all its heads of
a block before the next, and whether the next block is prefetched meanwhile
(see task.mojo for the task as a whole, read_order.mojo for the walk)."""

from std.sys import size_of

from ...simd.widen import VECTOR_REGISTERS
from .key_chunks import CHUNK
from .step_sizes import DOTS_PER_STEP, paired_heads


comptime BLOCK_BYTES = 16 << 10
"""What a block of a task's heads and tokens should read, K or V: blocks of
a few tokens read faster than head by head (docs/design.md, "Kernel
notes"), and small ones keep the kernel's step structure (whole tiles of
rows per head)."""

comptime GROUP_BLOCK_TOKENS = 8
"""With 16 vector registers, the fewest tokens a block of heads of three or
more query rows each takes, where they fit GROUP_BLOCK_MAX_BYTES. Such a
block is one sub-block (see `sub_block_tokens`): each head's q rows are
loaded for scoring, and its accumulators loaded and stored for the V pass,
once per slice of head_dim and block, so more tokens share those loads.
Where BLOCK_BYTES already holds 8 tokens or more, that size stays
(docs/design.md, "Kernel notes")."""

comptime GROUP_BLOCK_MAX_BYTES = 32 << 10
"""The most a block of GROUP_BLOCK_TOKENS reads, K or V, prefetched: 32
KiB, the L1 of a core with 16 vector registers."""


comptime PREFETCH_MAX_BYTES = (32 << 10) if VECTOR_REGISTERS >= 32 else (
    16 << 10
)
"""The largest block whose successor is prefetched while it is read. A
larger block (the steps' tokens across many wide heads, such as 32 float32
heads of group 1: 16 KiB a token) is read as runs of many token rows at
once, which the hardware prefetchers stream faster alone; with AVX2's
smaller steps that block is 2 tokens (32 KiB). See docs/design.md, "Kernel
notes"."""

comptime STREAMED_BLOCK = 16 if VECTOR_REGISTERS >= 32 else 4
"""Tokens per block when the hardware prefetchers alone fetch it (see
PREFETCH_MAX_BYTES): that many token rows read side by side, the fastest
count for each register file (docs/design.md, "Kernel notes")."""


comptime SUB_BLOCK_BYTES = (8 << 10) if VECTOR_REGISTERS >= 32 else (
    GROUP_BLOCK_MAX_BYTES
)
"""What a sub-block of a block reads: see `sub_block_tokens`."""


@no_inline
def wanted_tokens(head_rows: Int, token_bytes: Int) -> Int:
    """Tokens a block of a task's heads of head_rows query rows each aims
    for, token_bytes a token: BLOCK_BYTES, or with 16 registers and three
    or more rows at least GROUP_BLOCK_TOKENS within GROUP_BLOCK_MAX_BYTES."""
    var wanted = max(BLOCK_BYTES // token_bytes, 1)
    comptime if VECTOR_REGISTERS < 32:
        if head_rows > 2:
            var fewest = min(
                GROUP_BLOCK_TOKENS, GROUP_BLOCK_MAX_BYTES // token_bytes
            )
            wanted = max(wanted, fewest)
    return wanted


@no_inline
def prefetch_max_bytes(head_rows: Int) -> Int:
    """The largest block of a task's heads of head_rows query rows each
    whose successor is prefetched: PREFETCH_MAX_BYTES, or with 16 registers
    and three or more rows GROUP_BLOCK_MAX_BYTES.

    Not inlined (neither is `wanted_tokens`), though called once per task:
    inlined, their branch on head_rows changed the compiler's code for the
    task's inner loops and slowed them (docs/design.md, "Kernel notes")."""
    comptime if VECTOR_REGISTERS < 32:
        if head_rows > 2:
            return GROUP_BLOCK_MAX_BYTES
    return PREFETCH_MAX_BYTES


def sub_block_tokens[kv_dtype: DType](heads: Int, head_dim: Int) -> Int:
    """Tokens per sub-block for a task's `heads` KV heads of three or more
    query rows each: within a block, each head takes a sub-block's tokens
    before the next head, and all heads a sub-block before the next one.

    Fewer tokens per head keep the reads closer to address order, which the
    hardware prefetchers follow; more keep more independent FMA chains and
    reuse each accumulator load. With 32 vector registers, float32 rows (4
    KiB a token at 8 heads) go token by token; narrower rows, half the
    bytes for the same arithmetic, take SUB_BLOCK_BYTES. With 16 registers
    a V pass's accumulators are loaded and stored for every sub-block, so
    the whole block is one sub-block (docs/design.md, "Kernel notes")."""
    comptime if size_of[kv_dtype]() >= 4 and VECTOR_REGISTERS >= 32:
        return 1
    return max(SUB_BLOCK_BYTES // (heads * head_dim * size_of[kv_dtype]()), 1)


def step_tokens[kv_dtype: DType](heads: Int, head_rows: Int) -> Int:
    """The tokens every scoring step of a task takes divide this (see
    `walk_heads`)."""
    comptime paired = paired_heads[kv_dtype]()
    if head_rows == 1:
        return DOTS_PER_STEP // paired if heads % paired == 0 else DOTS_PER_STEP
    if head_rows == 2:
        return (
            DOTS_PER_STEP // paired if heads % (paired // 2)
            == 0 else DOTS_PER_STEP // 2
        )
    # Tiles of 8, 4, 2, 1 rows take 2, 4, 8, 16 tokens a step (AVX-512), one
    # of 3 as many as one of 4: DOTS_PER_STEP over head_rows' lowest set bit
    # is a multiple of every tile's tokens.
    return DOTS_PER_STEP // min(head_rows & -head_rows, 8)


def prefetches_block[
    kv_dtype: DType
](tokens: Int, heads: Int, head_rows: Int, head_dim: Int) -> Bool:
    """Whether a block of `tokens` tokens of a task's `heads` KV heads of
    head_rows query rows each is prefetched while its predecessor is read:
    within `prefetch_max_bytes`."""
    var block_bytes = tokens * heads * head_dim * size_of[kv_dtype]()
    return block_bytes <= prefetch_max_bytes(head_rows)


def block_tokens[
    kv_dtype: DType
](heads: Int, head_rows: Int, head_dim: Int) -> Int:
    """Tokens per block of a task with `heads` KV heads of head_rows query
    rows each: `wanted_tokens`, rounded up to a multiple of the steps'
    tokens, or STREAMED_BLOCK where that is past `prefetch_max_bytes`. One head
    (prefill) has nothing to interleave: its block is the chunk."""
    if heads == 1:
        return CHUNK
    var step = step_tokens[kv_dtype](heads, head_rows)
    var token_bytes = heads * head_dim * size_of[kv_dtype]()
    var wanted = wanted_tokens(head_rows, token_bytes)
    var block = min((wanted + step - 1) // step * step, CHUNK)
    if not prefetches_block[kv_dtype](block, heads, head_rows, head_dim):
        return STREAMED_BLOCK
    return block
