"""A one-warp probe of the tensor-core fragments a decode kernel relies on:
ld_matrix (plain and transposed) from 128-byte-swizzled shared memory, as
the TMA writes K and V stages, mma.sync m16n8k16 in bfloat16, and an
accumulator reused as the next product's A operand (P = softmax(S) feeding
P.V). The Python side checks every output against NumPy.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu import lane_id
from max.gpu.compute.mma import ld_matrix, mma
from max.gpu.host import DeviceContext
from max.gpu.memory import AddressSpace
from max.gpu.sync import barrier
from std.memory import stack_allocation

comptime BF16 = DType.bfloat16
comptime F32 = DType.float32
comptime ROW = 64
"""Elements per shared row: one 128-byte swizzle row of bfloat16."""


@always_inline
def swizzled(row: Int, col: Int) -> Int:
    """Offset of (row, col) with 16-byte vector v of row r at v ^ (r % 8)."""
    return row * ROW + (((col // 8) ^ (row & 7)) * 8) + col % 8


def probe_kernel(
    a: Pointer[Scalar[BF16], MutAnyOrigin],
    k: Pointer[Scalar[BF16], MutAnyOrigin],
    v: Pointer[Scalar[BF16], MutAnyOrigin],
    s_out: Pointer[Scalar[F32], MutAnyOrigin],
    o_out: Pointer[Scalar[F32], MutAnyOrigin],
):
    """One warp. a [16, 16] (rows x dims), k [16, 16] (tokens x dims),
    v [16, 8] (tokens x dims): s_out [16, 16] = a . k^T, o_out [16, 8] =
    bf16(s) . v."""
    var lane = Int(lane_id())
    var a_s = stack_allocation[
        16 * ROW, BF16, address_space=AddressSpace.SHARED
    ]()
    var k_s = stack_allocation[
        16 * ROW, BF16, address_space=AddressSpace.SHARED
    ]()
    var v_s = stack_allocation[
        16 * ROW, BF16, address_space=AddressSpace.SHARED
    ]()
    for i in range(lane, 256, 32):
        a_s[unsafe_offset=swizzled(i // 16, i % 16)] = a[unsafe_offset=i]
        k_s[unsafe_offset=swizzled(i // 16, i % 16)] = k[unsafe_offset=i]
    for i in range(lane, 128, 32):
        v_s[unsafe_offset=swizzled(i // 8, i % 8)] = v[unsafe_offset=i]
    barrier()

    # A: matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15), lanes 0-15 then 16-31.
    var a_frag = ld_matrix[8](
        a_s.unsafe_offset(swizzled(lane % 16, (lane // 16) * 8))
    )
    # K as B (col-major B is K's token-major rows): matrices (tokens 0-7,
    # dims 0-7), (tokens 0-7, dims 8-15), (tokens 8-15, ...), (...).
    var k_frag = ld_matrix[8](
        k_s.unsafe_offset(
            swizzled((lane // 16) * 8 + lane % 8, ((lane // 8) % 2) * 8)
        )
    )
    var g = lane // 4
    var t = lane % 4
    var s0 = SIMD[F32, 4](0)
    var s1 = SIMD[F32, 4](0)
    mma(s0, a_frag, k_frag.slice[4, offset=0](), s0)
    mma(s1, a_frag, k_frag.slice[4, offset=4](), s1)
    comptime for nt in range(2):
        var s = s0 if nt == 0 else s1
        s_out[unsafe_offset=g * 16 + nt * 8 + 2 * t] = s[0]
        s_out[unsafe_offset=g * 16 + nt * 8 + 2 * t + 1] = s[1]
        s_out[unsafe_offset=(g + 8) * 16 + nt * 8 + 2 * t] = s[2]
        s_out[unsafe_offset=(g + 8) * 16 + nt * 8 + 2 * t + 1] = s[3]

    # P = bf16(S) as A: the two token tiles' accumulators, in order.
    var p = s0.join(s1).cast[BF16]()
    # V as B, transposed on load: matrices (tokens 0-7 | 8-15, dims 0-7).
    var v_frag = ld_matrix[4, transpose=True](
        v_s.unsafe_offset(swizzled(lane % 16, 0))
    )
    var o = SIMD[F32, 4](0)
    mma(o, p, v_frag, o)
    o_out[unsafe_offset=g * 8 + 2 * t] = o[0]
    o_out[unsafe_offset=g * 8 + 2 * t + 1] = o[1]
    o_out[unsafe_offset=(g + 8) * 8 + 2 * t] = o[2]
    o_out[unsafe_offset=(g + 8) * 8 + 2 * t + 1] = o[3]


@extensibility.register("mma_probe")
struct MmaProbe:
    @staticmethod
    def execute[
        target: StaticString
    ](
        s_out: OutputTensor[dtype=F32, rank=2, ...],
        o_out: OutputTensor[dtype=F32, rank=2, ...],
        a: InputTensor[dtype=BF16, rank=2, ...],
        k: InputTensor[dtype=BF16, rank=2, ...],
        v: InputTensor[dtype=BF16, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target == "cpu":
            raise Error("mma_probe runs on NVIDIA GPUs only")
        else:
            ctx.enqueue_function[probe_kernel](
                a.to_device_buffer(ctx),
                k.to_device_buffer(ctx),
                v.to_device_buffer(ctx),
                s_out.to_device_buffer(ctx),
                o_out.to_device_buffer(ctx),
                grid_dim=1,
                block_dim=32,
            )
