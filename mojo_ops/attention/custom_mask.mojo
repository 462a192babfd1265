"""A prefill's custom attention mask, FlashInfer's packed form.

Request b's mask is a [qo_len, kv_len] boolean matrix, row-major, packed
into bits little-endian (bit i of byte k is element 8k + i) from its own
byte offset; key j of a query is visible where its bit is 1 (and where the
window, if any, lets it). plan() turns that into one bit offset per query row
of q (`row_bits`: where the row's key 0 lies), so a task needs no request
bookkeeping; the packed bytes come with BIT_READ_PADDING zero bytes after
them, so a read of a row's last bits never leaves the buffer.
"""

from std.builtin.device_passable import DevicePassable, DeviceTypeEncoder
from std.memory import bitcast

from ..cache.paged_kv_cache import IndexPtr, Ptr

comptime BIT_READ_PADDING = 8
"""Zero bytes after the packed mask: `lanes` reads 8 bytes from any bit."""


struct CustomMask(DevicePassable, TrivialRegisterPassable):
    var bits: Ptr[DType.uint8]
    """The packed masks of all requests, then BIT_READ_PADDING zero bytes."""
    var row_bits: IndexPtr
    """[rows of q]: the bit offset of key 0 of each query row's mask row."""
    var enabled: Bool
    """False: no custom mask (every call but a masked prefill)."""

    comptime device_type: AnyType = Self

    def _to_device_type(
        self, mut encoder: Some[DeviceTypeEncoder], target: MutOpaquePointer[_]
    ):
        encoder.encode(self, target)

    @staticmethod
    def get_type_name() -> String:
        return "CustomMask"

    def __init__(
        out self, bits: Ptr[DType.uint8], row_bits: IndexPtr, enabled: Bool
    ):
        self.bits = bits
        self.row_bits = row_bits
        self.enabled = enabled

    @always_inline
    def lanes[width: Int](self, bit: Int) -> SIMD[DType.bool, width]:
        """Whether keys bit, bit + 1, ..., bit + width - 1 of the packed mask
        are visible."""
        comptime assert width + 7 <= 64, "one 8-byte read per vector"
        var raw = self.bits.unsafe_offset(bit >> 3).unsafe_load[width=8]()
        var word = bitcast[DType.uint64, 1](raw) >> UInt64(bit & 7)
        var lane = SIMD[DType.uint64, width]()
        comptime for i in range(width):
            lane[i] = UInt64(i)
        return ((SIMD[DType.uint64, width](word) >> lane) & 1).ne(0)

    @always_inline
    def visible(self, row: Int, key: Int) -> Bool:
        """Whether query row `row` of q may see the request's key `key`: its
        bit, or True without a custom mask."""
        if not self.enabled:
            return True
        var bit = Int(self.row_bits[unsafe_offset=row]) + key
        return (self.bits[unsafe_offset=bit >> 3] >> UInt8(bit & 7)) & 1 != 0
