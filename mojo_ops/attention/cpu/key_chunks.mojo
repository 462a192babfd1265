"""A task's keys in chunks of CHUNK token rows: the rows' offsets in the
pool (a chunk may span pages), the blocks in which a task reads them, and
the prefetcher that asks for the next block while it reads one."""

from std.sys import size_of
from std.sys.intrinsics import PrefetchOptions, prefetch

from ...cache.paged_kv_cache import PagedKVCache, Ptr

comptime CHUNK = 32
"""Tokens per chunk: two AVX-512 vectors of scores per query head."""

comptime RowOffsets = Ptr[DType.int64]
"""Element offsets of a chunk's token rows from the pool base (head 0)."""


struct BlockPrefetch[kv_dtype: DType](TrivialRegisterPassable):
    """Asks for the rows of the task's next block while it reads this one:
    one row of the next block for each row it consumes, in memory order.

    A task reads a chunk's K, then its V, in blocks of a few tokens, all the
    task's heads of each block's tokens before the next block (see
    `block_tokens` in block_sizes.mojo), so a run of reads stays within a few adjacent token
    rows, which the hardware prefetchers then stream. The rows asked for
    here are the next block's (K, V, or the next chunk's K): far enough
    ahead to cover the memory's latency, and in address order.
    """

    var base: Ptr[Self.kv_dtype]
    """The target block's K (or V) pages at the task's first head."""
    var rows: RowOffsets
    var first: Int
    """The target block's first token, an index into rows."""
    var count: Int
    """The target block's tokens; 0 asks for nothing."""
    var heads: Int
    var head_stride: Int
    var row_elems: Int
    var token_major: Bool
    """NHD: a token's heads are adjacent; HND: a head's tokens are."""
    var visit0: Int
    """How many rows of the current block the task consumed before this
    head's first: (head - first head) x the block's tokens."""
    var block_first: Int
    """The current block's first token."""
    var block_len: Int
    """The current block's tokens."""
    var rows_total: Int
    """The target block's rows to ask for: count x heads (0 when disabled)."""
    var run_first: Int
    """Where the target block's rows are one run in memory order (NHD, the
    task's heads a whole token row, its tokens adjacent in a page): the
    first row's offset from base, row i lying i rows further. Else -1, and
    each row's offset comes from the row table. The run spares each row a
    division and a table load (docs/design.md, "Kernel notes")."""

    def __init__(
        out self,
        base: Ptr[Self.kv_dtype],
        rows: RowOffsets,
        first: Int,
        count: Int,
        heads: Int,
        head_stride: Int,
        row_elems: Int,
        token_major: Bool,
    ):
        """A prefetcher for the target block of `count` tokens from `first`
        of rows; `for_head` places it in the current block."""
        self.base = base
        self.rows = rows
        self.first = first
        self.count = count
        self.heads = heads
        self.head_stride = head_stride
        self.row_elems = row_elems
        self.token_major = token_major
        self.visit0 = 0
        self.block_first = 0
        self.block_len = 0
        self.rows_total = count * heads
        self.run_first = -1
        if count > 0 and token_major and head_stride == row_elems:
            var first_row = Int(rows[unsafe_offset=first])
            var token_elems = heads * row_elems
            var adjacent = True
            for t in range(1, count):
                var row = Int(rows[unsafe_offset=first + t])
                adjacent = adjacent and row == first_row + t * token_elems
            if adjacent:
                self.run_first = first_row

    def for_head(self, head: Int, block_first: Int, block_tokens: Int) -> Self:
        """The prefetcher for the task's `head`-th head (from 0) in the current
        block of block_tokens tokens from block_first."""
        var placed = self
        placed.visit0 = head * block_tokens
        placed.block_first = block_first
        placed.block_len = block_tokens
        return placed

    def for_sub_block(
        self, head: Int, heads: Int, block_first: Int, first: Int, tokens: Int
    ) -> Self:
        """The prefetcher for the task's `head`-th head (from 0) of `heads` in
        a sub-block of `tokens` tokens from `first`, in the current block
        from block_first: each sub-block's rows, all its heads, are consumed
        before the next sub-block's."""
        var placed = self.for_head(head, first, tokens)
        placed.visit0 += (first - block_first) * heads
        return placed

    def disabled(self) -> Self:
        """The same prefetcher asking for nothing (a head's later tiles)."""
        var quiet = self
        quiet.rows_total = 0
        return quiet

    @always_inline
    def after_row(self, j: Int, head: Int = 0):
        """The task consumed row j (a token of the chunk) of its head, or of
        the head `head` places after it."""
        self.fetch(self.visit0 + head * self.block_len + j - self.block_first)

    @always_inline
    def row_offset(self, i: Int) -> Int:
        """The offset from base of the target block's row i in memory order:
        token by token (NHD) or head by head (HND); i < count x heads."""
        if self.run_first >= 0:
            return self.run_first + i * self.row_elems
        var t: Int
        var h: Int
        if self.token_major:
            t = i // self.heads
            h = i - t * self.heads
        else:
            h = i // self.count
            t = i - h * self.count
        return (
            Int(self.rows[unsafe_offset=self.first + t]) + h * self.head_stride
        )

    @always_inline
    def fetch(self, i: Int):
        """Asks for the target block's row i, in memory order."""
        if i >= self.rows_total:
            return
        var p = self.base.unsafe_offset(self.row_offset(i))
        comptime line_elems = max(64 // size_of[Self.kv_dtype](), 1)
        var e = 0
        while e < self.row_elems:
            prefetch[PrefetchOptions().for_read().medium_locality()](
                p.unsafe_offset(e)
            )
            e += line_elems

    def fetch_all(self):
        """Asks for the whole target block at once (a task's first)."""
        for i in range(self.rows_total):
            self.fetch(i)


@always_inline
def chunk_rows(
    cache: PagedKVCache, b: Int, first: Int, end: Int, rows: RowOffsets
) -> Int:
    """Fills rows with the offsets of tokens first.. of request b (up to
    CHUNK, stopping at end); returns how many."""
    var n = min(CHUNK, end - first)
    var page_size = cache.page_size()
    var ts = cache.token_stride()
    var j = 0
    while j < n:
        var tok = first + j
        var slot = tok % page_size
        var base = cache.page_id(b, tok) * cache.page_stride + slot * ts
        var run = min(page_size - slot, n - j)
        for r in range(run):
            rows[unsafe_offset=j + r] = Int64(base + r * ts)
        j += run
    return n
