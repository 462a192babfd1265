"""The work list of a decode step, decided once by `plan()`.

A work item is a run of one request's tokens [first, end); a request whose
tokens are split across several items (split-K, flash-decoding) has its
partial states merged afterwards. Each item is processed for every KV head,
all query heads of the head's group together.
"""

from std.builtin.device_passable import DevicePassable, DeviceTypeEncoder

from .paged_kv_cache import IndexPtr, Ptr


struct DecodeWork(DevicePassable, TrivialRegisterPassable):
    var items: IndexPtr
    """[num_items, 3]: request, first token, end token."""
    var num_items: Int
    var request_items: IndexPtr
    """[batch_size + 1]: request b's items are request_items[b] .. [b + 1]."""
    var partial_o: Ptr[DType.float32]
    """[num_items, num_qo_heads, head_dim]: states of split requests."""
    var partial_lse: Ptr[DType.float32]
    """[num_items, num_qo_heads]."""

    comptime device_type: AnyType = Self

    def _to_device_type(
        self, mut encoder: Some[DeviceTypeEncoder], target: MutOpaquePointer[_]
    ):
        encoder.encode(self, target)

    @staticmethod
    def get_type_name() -> String:
        return "DecodeWork"

    def __init__(
        out self,
        items: IndexPtr,
        num_items: Int,
        request_items: IndexPtr,
        partial_o: Ptr[DType.float32],
        partial_lse: Ptr[DType.float32],
    ):
        self.items = items
        self.num_items = num_items
        self.request_items = request_items
        self.partial_o = partial_o
        self.partial_lse = partial_lse

    @always_inline
    def request(self, item: Int) -> Int:
        return Int(self.items[unsafe_offset=3 * item])

    @always_inline
    def first(self, item: Int) -> Int:
        return Int(self.items[unsafe_offset=3 * item + 1])

    @always_inline
    def end(self, item: Int) -> Int:
        return Int(self.items[unsafe_offset=3 * item + 2])

    @always_inline
    def items_of(self, b: Int) -> Int:
        return Int(self.request_items[unsafe_offset=b + 1]) - Int(
            self.request_items[unsafe_offset=b]
        )

    @always_inline
    def is_split(self, b: Int) -> Bool:
        return self.items_of(b) > 1
