"""A task's keys in chunks of CHUNK token rows: the rows' offsets in the
pool (a chunk may span pages), and the prefetcher that asks for rows ahead
in the order the task consumes them."""

from std.sys import size_of
from std.sys.intrinsics import PrefetchOptions, prefetch

from .paged_kv_cache import PagedKVCache, Ptr

comptime CHUNK = 32
"""Tokens per chunk: two AVX-512 vectors of scores per query head."""

comptime RowOffsets = Ptr[DType.int64]
"""Element offsets of a chunk's token rows from the pool base (head 0)."""

comptime PREFETCH_BYTES = 4096
"""How far ahead, in the order the task consumes rows, rows are asked for
into L2: enough misses in flight for one core to stream at full speed
(measured best of 2, 4 and 8 KiB, L1 or L2, on a 2-core Ice Lake). A distance in
bytes, not rows: narrow rows (16-bit, fp8, small head_dim) need more rows
ahead for the same misses in flight."""


struct RowPrefetch[kv_dtype: DType](TrivialRegisterPassable):
    """Prefetches PREFETCH_BYTES of rows ahead along a task's consumption order:
    one KV head's K rows of a chunk, then its V rows, then the next head's
    (or the next chunk's first head's) K rows.

    Hardware prefetchers do not follow this order (a head's rows are 512 B
    runs in different 4 KiB pages of an NHD page), so without it the core
    waits on each row's miss.
    """

    var k: Ptr[Self.kv_dtype]
    var v: Ptr[Self.kv_dtype]
    var rows: RowOffsets
    var n: Int
    var next_k: Ptr[Self.kv_dtype]
    var next_rows: RowOffsets
    var next_n: Int
    var row_elems: Int
    var distance: Int
    """Rows ahead: PREFETCH_BYTES of rows, at most one chunk."""

    def __init__(
        out self,
        k: Ptr[Self.kv_dtype],
        v: Ptr[Self.kv_dtype],
        rows: RowOffsets,
        n: Int,
        next_k: Ptr[Self.kv_dtype],
        next_rows: RowOffsets,
        next_n: Int,
        row_elems: Int,
    ):
        self.row_elems = row_elems
        var row_bytes = max(row_elems * size_of[Self.kv_dtype](), 64)
        self.distance = min(max(PREFETCH_BYTES // row_bytes, 1), CHUNK)
        self.k = k
        self.v = v
        self.rows = rows
        self.n = n
        self.next_k = next_k
        self.next_rows = next_rows
        self.next_n = next_n

    def disabled(self) -> Self:
        """The same prefetcher asking for nothing (a group's later tiles)."""
        return Self(
            self.k, self.v, self.rows, 0, self.next_k, self.next_rows, 0, 0
        )

    @always_inline
    def after_k_row(self, j: Int):
        var target = j + self.distance
        if target < self.n:
            self._fetch(self.k, self.rows, target)
        elif target - self.n < self.n:
            self._fetch(self.v, self.rows, target - self.n)

    @always_inline
    def after_v_row(self, j: Int):
        var target = j + self.distance
        if target < self.n:
            self._fetch(self.v, self.rows, target)
        elif target - self.n < self.next_n:
            self._fetch(self.next_k, self.next_rows, target - self.n)

    @always_inline
    def _fetch(self, base: Ptr[Self.kv_dtype], rows: RowOffsets, j: Int):
        comptime line_elems = max(64 // size_of[Self.kv_dtype](), 1)
        var p = base.unsafe_offset(Int(rows[unsafe_offset=j]))
        var i = 0
        while i < self.row_elems:
            prefetch[PrefetchOptions().for_read().medium_locality()](
                p.unsafe_offset(i)
            )
            i += line_elems


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
