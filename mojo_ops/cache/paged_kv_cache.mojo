"""`PagedKVCache`: a register-passable view of a paged K/V pool and its page table.

The pool has FlashInfer's shape, either one tensor holding K and V,

    NHD: [max_num_pages, 2, page_size, num_kv_heads, head_dim]
    HND: [max_num_pages, 2, num_kv_heads, page_size, head_dim]

or two tensors (K and V) with the `2` axis dropped. Which request owns which
pages is a CSR page table: request `b` owns the pages
`kv_indices[kv_indptr[b] : kv_indptr[b + 1]]`, and its last page holds
`kv_last_page_len[b]` tokens.

The struct holds only pointers and integers, so a CPU loop or a GPU kernel takes
it by value. Each shape parameter is either a compile-time value or `DYNAMIC`,
in which case the value comes from the run-time field of the same name: one
compiled op then serves every value, and kernels that need a static value
(head_dim for register tiling) specialise only that one.
"""

from std.builtin.device_passable import DevicePassable, DeviceTypeEncoder
from std.sys import size_of
from std.utils import Index

from layout import coord
from layout.tma_async import TMATensorTile
from max.gpu.host import DeviceBuffer, DeviceContext
from max.gpu.host.nvidia.tma import TensorMapSwizzle, create_tma_descriptor

comptime DYNAMIC = -1
"""A shape parameter known only at run time."""

comptime Ptr[dtype: DType] = Pointer[Scalar[dtype], MutUntrackedOrigin]
"""A raw pointer whose lifetime the caller (the graph runtime) manages."""

comptime IndexPtr = Ptr[DType.int32]


comptime INT8_ROW_SCALE_BYTES = 4
"""Bytes of one row's scale in an int8 pool: a float32."""


def row_scale_elems[dtype: DType]() -> Int:
    """Elements a `dtype` pool's page holds per (token, head) row past the
    rows themselves: 4 for int8, whose pages (K's half, V's half) are the
    rows' head_dim codes and then each row's float32 scale
    (cache/int8_rows.mojo); 0 for every other dtype."""
    return INT8_ROW_SCALE_BYTES if dtype == DType.int8 else 0


def tma_element[dtype: DType]() -> DType:
    """The element type a TMA descriptor moves `dtype` as: 1-byte types as
    uint8 (the descriptor has no fp8 e5m2; a copy needs no element type)."""
    comptime if size_of[dtype]() == 1:
        return DType.uint8
    return dtype


comptime KVTile[dtype: DType, rows: Int, cols: Int] = TMATensorTile[
    tma_element[dtype](), coord[rows, cols]
]
"""A TMA descriptor fetching boxes of `rows` tokens x `cols` elements of one
head from a K or V pool of `dtype` (see `PagedKVCache.create_tma_tile`)."""


struct KVLayout(Equatable, TrivialRegisterPassable):
    """Order of the token and head axes inside a page."""

    var value: Int

    comptime NHD = KVLayout(0)
    """[page_size, num_kv_heads, head_dim]: a token's heads are adjacent."""
    comptime HND = KVLayout(1)
    """[num_kv_heads, page_size, head_dim]: a head's tokens are adjacent."""

    def __init__(out self, value: Int):
        self.value = value

    def __eq__(self, other: Self) -> Bool:
        return self.value == other.value


struct KV(Equatable, TrivialRegisterPassable):
    """Selects the key or the value half of the cache."""

    var value: Int

    comptime K = KV(0)
    comptime V = KV(1)

    def __init__(out self, value: Int):
        self.value = value

    def __eq__(self, other: Self) -> Bool:
        return self.value == other.value


struct PagedKVCache[
    dtype: DType,
    layout: KVLayout,
    static_page_size: Int = DYNAMIC,
    static_num_kv_heads: Int = DYNAMIC,
    static_head_dim: Int = DYNAMIC,
](DevicePassable, TrivialRegisterPassable):
    """A paged K/V pool and the CSR page table of one batch.

    Parameters:
        dtype: Element type of the pool.
        layout: `KVLayout.NHD` or `KVLayout.HND`.
        static_page_size: Tokens per page, or `DYNAMIC`.
        static_num_kv_heads: KV heads, or `DYNAMIC`.
        static_head_dim: Elements per head, or `DYNAMIC`.
    """

    var k_pages: Ptr[Self.dtype]
    """Page 0 of the K pool."""
    var v_pages: Ptr[Self.dtype]
    """Page 0 of the V pool."""
    var page_stride: Int
    """Elements from one page to the next (the same for K and V)."""
    var num_pages: Int
    """Pages in the pool."""
    var kv_indptr: IndexPtr
    """[batch_size + 1]: request b owns kv_indices[kv_indptr[b]:kv_indptr[b+1]]."""
    var kv_indices: IndexPtr
    """[kv_indptr[batch_size]]: page ids, in token order."""
    var kv_last_page_len: IndexPtr
    """[batch_size]: tokens in each request's last page."""
    var batch_size: Int
    var _page_size: Int
    var _num_kv_heads: Int
    var _head_dim: Int

    comptime device_type: AnyType = Self

    def _to_device_type(
        self, mut encoder: Some[DeviceTypeEncoder], target: MutOpaquePointer[_]
    ):
        encoder.encode(self, target)

    @staticmethod
    def get_type_name() -> String:
        return "PagedKVCache"

    def __init__(
        out self,
        k_pages: Ptr[Self.dtype],
        v_pages: Ptr[Self.dtype],
        page_stride: Int,
        num_pages: Int,
        kv_indptr: IndexPtr,
        kv_indices: IndexPtr,
        kv_last_page_len: IndexPtr,
        batch_size: Int,
        page_size: Int,
        num_kv_heads: Int,
        head_dim: Int,
    ):
        """Views K and V pools that have their own base pointers."""
        self.k_pages = k_pages
        self.v_pages = v_pages
        self.page_stride = page_stride
        self.num_pages = num_pages
        self.kv_indptr = kv_indptr
        self.kv_indices = kv_indices
        self.kv_last_page_len = kv_last_page_len
        self.batch_size = batch_size
        self._page_size = page_size
        self._num_kv_heads = num_kv_heads
        self._head_dim = head_dim

    @staticmethod
    def page_elems(page_size: Int, num_kv_heads: Int, head_dim: Int) -> Int:
        """Elements of K (or of V) in one page."""
        return (
            page_size
            * num_kv_heads
            * (head_dim + row_scale_elems[Self.dtype]())
        )

    @staticmethod
    def from_pool(
        pool: Ptr[Self.dtype],
        num_pages: Int,
        kv_indptr: IndexPtr,
        kv_indices: IndexPtr,
        kv_last_page_len: IndexPtr,
        batch_size: Int,
        page_size: Int,
        num_kv_heads: Int,
        head_dim: Int,
    ) -> Self:
        """Views one pool [num_pages, 2, ...page...]: K then V in each page."""
        var half = Self.page_elems(page_size, num_kv_heads, head_dim)
        return Self(
            pool,
            pool.unsafe_offset(half),
            2 * half,
            num_pages,
            kv_indptr,
            kv_indices,
            kv_last_page_len,
            batch_size,
            page_size,
            num_kv_heads,
            head_dim,
        )

    @staticmethod
    def from_pools(
        k_pool: Ptr[Self.dtype],
        v_pool: Ptr[Self.dtype],
        num_pages: Int,
        kv_indptr: IndexPtr,
        kv_indices: IndexPtr,
        kv_last_page_len: IndexPtr,
        batch_size: Int,
        page_size: Int,
        num_kv_heads: Int,
        head_dim: Int,
    ) -> Self:
        """Views separate K and V pools, each [num_pages, ...page...]."""
        return Self(
            k_pool,
            v_pool,
            Self.page_elems(page_size, num_kv_heads, head_dim),
            num_pages,
            kv_indptr,
            kv_indices,
            kv_last_page_len,
            batch_size,
            page_size,
            num_kv_heads,
            head_dim,
        )

    def specialized[
        page_size: Int, num_kv_heads: Int, head_dim: Int
    ](self) -> PagedKVCache[
        Self.dtype, Self.layout, page_size, num_kv_heads, head_dim
    ]:
        """The same view with shape parameters fixed (or left DYNAMIC) at compile
        time; the caller has checked that the run-time values match."""
        return PagedKVCache[
            Self.dtype, Self.layout, page_size, num_kv_heads, head_dim
        ](
            self.k_pages,
            self.v_pages,
            self.page_stride,
            self.num_pages,
            self.kv_indptr,
            self.kv_indices,
            self.kv_last_page_len,
            self.batch_size,
            self._page_size,
            self._num_kv_heads,
            self._head_dim,
        )

    def bitcast[
        element: DType
    ](self) -> PagedKVCache[
        element,
        Self.layout,
        Self.static_page_size,
        Self.static_num_kv_heads,
        Self.static_head_dim,
    ]:
        """The same bytes read as `element` (of the same size): fp8 pools travel
        through the graph as uint8, since MAX has no fp8 tensors on the CPU."""
        comptime assert (
            row_scale_elems[element]() == row_scale_elems[Self.dtype]()
        ), "an int8 pool's pages hold their rows' scales"
        comptime assert (
            size_of[element]() == size_of[Self.dtype]()
        ), "bitcast needs an element type of the same size"
        return PagedKVCache[
            element,
            Self.layout,
            Self.static_page_size,
            Self.static_num_kv_heads,
            Self.static_head_dim,
        ](
            rebind[Ptr[element]](self.k_pages),
            rebind[Ptr[element]](self.v_pages),
            self.page_stride,
            self.num_pages,
            self.kv_indptr,
            self.kv_indices,
            self.kv_last_page_len,
            self.batch_size,
            self._page_size,
            self._num_kv_heads,
            self._head_dim,
        )

    # ---- shape -------------------------------------------------------------

    @always_inline
    def page_size(self) -> Int:
        comptime if Self.static_page_size != DYNAMIC:
            return Self.static_page_size
        return self._page_size

    @always_inline
    def num_kv_heads(self) -> Int:
        comptime if Self.static_num_kv_heads != DYNAMIC:
            return Self.static_num_kv_heads
        return self._num_kv_heads

    @always_inline
    def head_dim(self) -> Int:
        comptime if Self.static_head_dim != DYNAMIC:
            return Self.static_head_dim
        return self._head_dim

    @always_inline
    def token_stride(self) -> Int:
        """Elements between consecutive tokens of one head in a page."""
        comptime if Self.layout == KVLayout.NHD:
            return self.num_kv_heads() * self.head_dim()
        return self.head_dim()

    @always_inline
    def head_stride(self) -> Int:
        """Elements between consecutive heads of one token in a page."""
        comptime if Self.layout == KVLayout.NHD:
            return self.head_dim()
        return self.page_size() * self.head_dim()

    @always_inline
    def row_scales[kv: KV](self, page: Int) -> Ptr[DType.float32]:
        """The row scales of K's (or V's) half of an int8 pool's page
        (see `row_scale_elems`): the scale of (token t, head h) at
        `scale_index(t, h)`."""
        comptime assert row_scale_elems[Self.dtype]() > 0, "an int8 pool"
        var rows = self.page_size() * self.num_kv_heads() * self.head_dim()
        return rebind[Ptr[DType.float32]](
            self._base[kv]().unsafe_offset(page * self.page_stride + rows)
        )

    @always_inline
    def scale_index(self, t: Int, head: Int) -> Int:
        """Where (token slot t, head) sits among a page's row scales: in
        the page's own token and head order."""
        comptime if Self.layout == KVLayout.NHD:
            return t * self.num_kv_heads() + head
        return head * self.page_size() + t

    # ---- page table --------------------------------------------------------

    @always_inline
    def num_pages_of(self, b: Int) -> Int:
        """Pages owned by request b."""
        return Int(self.kv_indptr[unsafe_offset=b + 1]) - Int(
            self.kv_indptr[unsafe_offset=b]
        )

    @always_inline
    def cache_length(self, b: Int) -> Int:
        """Tokens cached for request b (0 for a request that owns no pages)."""
        var pages = self.num_pages_of(b)
        if pages <= 0:
            return 0
        return (pages - 1) * self.page_size() + Int(
            self.kv_last_page_len[unsafe_offset=b]
        )

    @always_inline
    def holds(self, b: Int, tok: Int) -> Bool:
        """Whether token `tok` of request b has a slot in the pool: b a
        request of the batch, tok within its cache length and its page a
        page of the pool. A writer that trusts its page table (the step
        graphs' own, on a GPU) tests each token with it before it writes, so
        a wrong table loses rows instead of writing outside the pool.
        """
        if b < 0 or b >= self.batch_size or tok < 0:
            return False
        if tok >= self.cache_length(b):
            return False
        var page = self.page_id(b, tok)
        return page >= 0 and page < self.num_pages

    @always_inline
    def page_id(self, b: Int, tok: Int) -> Int:
        """Physical page holding token `tok` of request b."""
        var first = Int(self.kv_indptr[unsafe_offset=b])
        return Int(
            self.kv_indices[unsafe_offset=first + tok // self.page_size()]
        )

    @always_inline
    def row_idx(self, b: Int, tok: Int) -> Int:
        """Physical row of token `tok` of request b.

        The pool is viewed as a matrix whose rows are `token_stride()` elements
        wide, so the element (head, d) of that token sits at
        `row_idx(b, tok) * token_stride() + col_idx(head) + d` from the base of
        K (or of V). Not for an int8 pool, whose pages hold their row scales
        past their rows (the TMA tiles, which use it, run on GPUs, which
        take no int8 pools).
        """
        var rows_per_page = self.page_stride // self.token_stride()
        return self.page_id(b, tok) * rows_per_page + tok % self.page_size()

    @always_inline
    def col_idx(self, head: Int) -> Int:
        """Offset of a head inside the row space of `row_idx`."""
        return head * self.head_stride()

    @always_inline
    def _base[kv: KV](self) -> Ptr[Self.dtype]:
        comptime if kv == KV.K:
            return self.k_pages
        return self.v_pages

    @always_inline
    def page_ptr[kv: KV](self, page: Int, head: Int) -> Ptr[Self.dtype]:
        """Token 0 of `head` in physical page `page`; token t is t * token_stride() on.
        """
        return self._base[kv]().unsafe_offset(
            page * self.page_stride + head * self.head_stride()
        )

    @always_inline
    def block_paged_ptr[
        kv: KV
    ](self, b: Int, tok: Int, head: Int, d: Int = 0) -> Ptr[Self.dtype]:
        """Element d of `head` at token `tok` of request b.

        The tokens from `tok` to the end of its page follow at steps of
        `token_stride()`.
        """
        return self._base[kv]().unsafe_offset(
            self.page_id(b, tok) * self.page_stride
            + (tok % self.page_size()) * self.token_stride()
            + self.col_idx(head)
            + d
        )

    @always_inline
    def load[
        kv: KV, width: Int = 1
    ](self, b: Int, head: Int, tok: Int, d: Int) -> SIMD[Self.dtype, width]:
        """Elements d..d+width of `head` at token `tok` of request b."""
        return self.block_paged_ptr[kv](b, tok, head, d).unsafe_load[
            width=width
        ]()

    @always_inline
    def store[
        kv: KV
    ](self, b: Int, head: Int, tok: Int, d: Int, val: SIMD[Self.dtype, ...]):
        """Writes elements d..d+width of `head` at token `tok` of request b."""
        self.block_paged_ptr[kv](b, tok, head, d).unsafe_store(val)

    def create_tma_tile[
        kv: KV,
        box_rows: Int,
        box_cols: Int,
        swizzle: TensorMapSwizzle = TensorMapSwizzle.SWIZZLE_128B,
    ](self, ctx: DeviceContext) raises -> KVTile[
        Self.dtype, box_rows, box_cols
    ]:
        """A TMA descriptor over the K (or V) pool of an NHD cache.

        The pool is seen as the matrix of `row_idx` rows, `token_stride()`
        elements wide, so the box at coordinates (col_idx(head) + d,
        row_idx(b, tok)) holds tokens tok .. tok + box_rows of that head
        (box_rows must divide the page size, so a box never leaves its page)
        and elements d .. d + box_cols, stored in shared memory with
        `swizzle`.
        """
        comptime assert (
            Self.layout == KVLayout.NHD
        ), "TMA tiles need an NHD pool: an HND page's rows are one head's"
        var width = self.token_stride()
        var rows_per_page = self.page_stride // width
        # The V view starts a half page in, so it ends P rows after the
        # last page's start, like the K view.
        var rows = (self.num_pages - 1) * rows_per_page + self.page_size()
        comptime element = tma_element[Self.dtype]()
        var pool = DeviceBuffer[element](
            ctx,
            rebind[Ptr[element]](self._base[kv]()),
            rows * width,
            owning=False,
        )
        return KVTile[Self.dtype, box_rows, box_cols](
            create_tma_descriptor[element, 2, swizzle](
                pool,
                Index(rows, width),
                Index(width, 1),
                Index(box_rows, box_cols),
            )
        )

    def empty_cache(self) -> Bool:
        """True when no request of the batch has a cached token."""
        for b in range(self.batch_size):
            if self.cache_length(b) > 0:
                return False
        return True

    def max_context_length(self) -> Int:
        """The longest cache length in the batch."""
        var longest = 0
        for b in range(self.batch_size):
            longest = max(longest, self.cache_length(b))
        return longest
