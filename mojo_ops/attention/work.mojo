"""The work list of an attention call, decided once by `plan()` in Python.

A work item is a tile of one request's query rows (consecutive tokens, each
with all its heads) against a run of that request's keys [kv_first, kv_end).
Decode has one query per request and may split its keys across several items
(split-K, flash-decoding), whose partial states are merged afterwards;
prefill tiles its queries and gives each tile all the keys it can see. An
item of no queries is padding (a fixed work list's unused capacity, outside
every request's range in request_items): the kernels skip it.

A shared decode item (CPU only) takes the queries of q_count consecutive
requests b, b + 1, .. (decode's query rows are in request order) against a
run of keys whose pages they all share, read through request b's page
table: a shared prefix is read once for all of them. Each of those
requests lists an item at the same place among its own items (the others
with no queries), whose partial state slot the shared item fills
(`partial_slot`) and whose position is its query's (`query_pos`): a window
masks each row at its own position. The planner shares no keys under a
custom mask or with rotation inside the kernel.
"""

from std.builtin.device_passable import DevicePassable, DeviceTypeEncoder

from ..cache.paged_kv_cache import IndexPtr, Ptr

comptime ITEM_FIELDS = 6
"""Fields of an item: request, first query row (in q), query rows, position
of the first query, first key, end key."""


struct AttentionWork(DevicePassable, TrivialRegisterPassable):
    var items: IndexPtr
    """[num_items, ITEM_FIELDS]."""
    var num_items: Int
    var request_items: IndexPtr
    """[batch_size + 1]: request b's items are request_items[b] .. [b + 1]."""
    var partial_o: Ptr[DType.float32]
    """[num_items, num_qo_heads, head_dim]: states of key-split items."""
    var partial_lse: Ptr[DType.float32]
    """[num_items, num_qo_heads]."""
    var kv_split: Bool
    """Whether a request's items split its keys (decode) rather than its
    queries (prefill)."""

    comptime device_type: AnyType = Self

    def _to_device_type(
        self, mut encoder: Some[DeviceTypeEncoder], target: MutOpaquePointer[_]
    ):
        encoder.encode(self, target)

    @staticmethod
    def get_type_name() -> String:
        return "AttentionWork"

    def __init__(
        out self,
        items: IndexPtr,
        num_items: Int,
        request_items: IndexPtr,
        partial_o: Ptr[DType.float32],
        partial_lse: Ptr[DType.float32],
        kv_split: Bool,
    ):
        self.items = items
        self.num_items = num_items
        self.request_items = request_items
        self.partial_o = partial_o
        self.partial_lse = partial_lse
        self.kv_split = kv_split

    @always_inline
    def _field(self, item: Int, field: Int) -> Int:
        return Int(self.items[unsafe_offset=ITEM_FIELDS * item + field])

    @always_inline
    def request(self, item: Int) -> Int:
        return self._field(item, 0)

    @always_inline
    def q_row(self, item: Int) -> Int:
        """Row of the item's first query in q [rows, num_qo_heads, head_dim]."""
        return self._field(item, 1)

    @always_inline
    def q_count(self, item: Int) -> Int:
        return self._field(item, 2)

    @always_inline
    def q_pos(self, item: Int) -> Int:
        """Sequence position of the item's first query."""
        return self._field(item, 3)

    @always_inline
    def kv_first(self, item: Int) -> Int:
        return self._field(item, 4)

    @always_inline
    def kv_end(self, item: Int) -> Int:
        return self._field(item, 5)

    @always_inline
    def items_of(self, b: Int) -> Int:
        return Int(self.request_items[unsafe_offset=b + 1]) - Int(
            self.request_items[unsafe_offset=b]
        )

    @always_inline
    def query_request(self, item: Int, t: Int) -> Int:
        """The request of the item's query t: b + t for a shared decode
        item, the item's request for a prefill tile."""
        return self.request(item) + t if self.kv_split else self.request(item)

    @always_inline
    def query_pos(self, item: Int, t: Int) -> Int:
        """The sequence position of the item's query t: that of its own
        item (`partial_slot`) for a key-split item, whose queries are
        requests of their own lengths; q_pos + t for a prefill tile, whose
        queries are consecutive tokens."""
        if self.kv_split:
            return self.q_pos(self.partial_slot(item, t))
        return self.q_pos(item) + t

    @always_inline
    def partial_slot(self, item: Int, t: Int) -> Int:
        """The partial state slot of query t of a key-split item: the item
        at the same place among request b + t's items (the item itself for
        its first query)."""
        var b = self.request(item)
        return (
            item
            + Int(self.request_items[unsafe_offset=b + t])
            - Int(self.request_items[unsafe_offset=b])
        )

    @always_inline
    def writes_partial(self, b: Int) -> Bool:
        """Whether request b's items hold partial states to merge."""
        return self.kv_split and self.items_of(b) > 1
