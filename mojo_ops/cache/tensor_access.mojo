"""Raw access to op tensors: pointers, host copies of small index arrays, copies.
"""

from extensibility import ManagedTensorSlice
from max.gpu.host import DeviceBuffer, DeviceContext, HostBuffer
from std.sys import size_of

from .paged_kv_cache import IndexPtr, Ptr


@always_inline
def ptr_of(t: ManagedTensorSlice) -> Ptr[t.dtype]:
    """The data pointer of an op tensor (device memory for a GPU op)."""
    return rebind[Ptr[t.dtype]](t.unsafe_ptr())


@always_inline
def num_elements(t: ManagedTensorSlice) -> Int:
    var n = 1
    comptime for i in range(t.rank):
        n *= t.dim_size(i)
    return n


struct HostIndices(Movable):
    """An int32 array readable on the host.

    On the CPU it views the op's tensor; for a GPU op it is a host copy, so
    the same validation code serves both targets. An op enqueues the copies
    of every array it checks, then waits once (`host_ready`): one
    synchronization per op, not one per array.
    """

    var ptr: IndexPtr
    """Valid once `host_ready` has returned (on the CPU, at once), and only
    while this value lives. Mojo ends a value's life right after its last
    use, even inside an expression, and the pointer's untracked origin does
    not extend it: code that reads the copy takes the HostIndices (borrowed
    for the call), never its bare pointer."""
    var _host: Optional[HostBuffer[DType.int32]]

    def __init__(
        out self, ptr: IndexPtr, var host: Optional[HostBuffer[DType.int32]]
    ):
        self.ptr = ptr
        self._host = host^

    @staticmethod
    def enqueue[
        target: StaticString
    ](
        t: ManagedTensorSlice[dtype=DType.int32, ...], ctx: DeviceContext
    ) raises -> Self:
        """Starts the host copy of t (a view on the CPU); read it after
        `host_ready`."""
        comptime if target == "cpu":
            return Self(ptr_of(t), None)
        else:
            var n = max(num_elements(t), 1)
            var host = ctx.enqueue_create_host_buffer[DType.int32](n)
            if num_elements(t) > 0:
                var device = DeviceBuffer[DType.int32](
                    ctx, t.unsafe_ptr(), num_elements(t), owning=False
                )
                ctx.enqueue_copy(dst_buf=host, src_buf=device)
            var ptr = rebind[IndexPtr](host.unsafe_ptr())
            return Self(ptr, host^)

    @always_inline
    def __getitem__(self, i: Int) -> Int:
        """Element i, read while this value (and so its copy) lives."""
        return Int(self.ptr[unsafe_offset=i])


def host_ready[target: StaticString](ctx: DeviceContext) raises:
    """Waits for the host copies enqueued so far (none on the CPU)."""
    comptime if target != "cpu":
        ctx.synchronize()


comptime VECTOR_BYTES = 64
"""Bytes moved per vector on the CPU (one AVX-512 register, two AVX2)."""

comptime GPU_VECTOR_BYTES = 16
"""Bytes per thread per load on a GPU: one 128-bit transaction."""


@always_inline
def vector_width[dtype: DType, bytes: Int]() -> Int:
    return max(bytes // size_of[dtype](), 1)
