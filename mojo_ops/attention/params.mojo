"""Run-time options of paged attention (decode and prefill), FlashInfer's meaning.

Scores are kept in base 2 (`exp2`, `log2`) as FlashInfer does: the log2(e)
factor is folded into the scale once, and the log-sum-exp returned to users is
FlashInfer's base-2 LSE.

    s = q . k * sm_scale * q_scale * k_scale
    s = cap * tanh(s / cap)               if logits_soft_cap > 0
    s = s + slope(head) * (kv_pos - q_pos) if pos_encoding == ALIBI
    p = softmax(s) over kv_pos in [q_pos - window_left, q_pos]  (all if -1)
    o = (p . v) * v_scale

With ROPE_LLAMA, q and k are rotated (rotate-half, Llama style) by their
positions / rope_scale with base rope_theta before the dot product.
"""

from std.builtin.device_passable import DevicePassable, DeviceTypeEncoder
from std.math import cos, exp2, log2, sin, tanh
from std.utils.numerics import neg_inf

comptime LOG2E: Float32 = 1.4426950408889634

comptime POS_NONE = 0
comptime POS_ROPE_LLAMA = 1
comptime POS_ALIBI = 2

# Slots of the op's host parameter tensors, float_params [8] and
# int_params [8] (written by python/pagedkv/_plan/work.py; the codes' Python
# twins are in python/pagedkv/_ops/contract.py).
comptime F_SM_SCALE = 0
comptime F_SOFT_CAP = 1
comptime F_ROPE_SCALE = 2
comptime F_ROPE_THETA = 3
comptime F_QK_SCALE = 4
"""The product q_scale * k_scale."""
comptime F_V_SCALE = 5
comptime INT_WINDOW_LEFT = 0
comptime INT_POS_ENCODING = 1
comptime INT_HEADS_PER_TASK = 2
"""KV heads per CPU task."""
comptime INT_CAUSAL = 3
comptime INT_MAX_ROWS = 4
"""Query rows in a work item at most."""
comptime INT_GPU_KERNEL = 5
"""The GPU decode kernel plan() chose (GPU_KERNEL_* in gpu/dispatch.mojo)."""
comptime INT_KV_SPLIT = 6
"""Whether work items split requests' keys (decode) or queries (prefill)."""


struct AttentionParams(DevicePassable, TrivialRegisterPassable):
    var q_scale_log2: Float32
    """Multiplies q . k: sm_scale * q_scale * k_scale * log2(e), or, with a soft
    cap, sm_scale * q_scale * k_scale / cap (the tanh's argument)."""
    var soft_cap_log2: Float32
    """The soft cap times log2(e), or 0 without a soft cap."""
    var v_scale: Float32
    var window_left: Int
    var pos_encoding: Int
    var causal: Bool
    """Whether a query sees only keys at or before its own position."""
    var rope_rcp_scale: Float64
    var rope_log2_theta: Float64

    comptime device_type: AnyType = Self

    def _to_device_type(
        self, mut encoder: Some[DeviceTypeEncoder], target: MutOpaquePointer[_]
    ):
        encoder.encode(self, target)

    @staticmethod
    def get_type_name() -> String:
        return "AttentionParams"

    def __init__(
        out self,
        sm_scale: Float32,
        soft_cap: Float32,
        rope_scale: Float32,
        rope_theta: Float32,
        qk_scale: Float32,
        v_scale: Float32,
        window_left: Int,
        pos_encoding: Int,
        causal: Bool = True,
    ):
        if soft_cap > 0:
            self.q_scale_log2 = sm_scale * qk_scale / soft_cap
            self.soft_cap_log2 = soft_cap * LOG2E
        else:
            self.q_scale_log2 = sm_scale * qk_scale * LOG2E
            self.soft_cap_log2 = 0
        self.v_scale = v_scale
        self.window_left = window_left
        self.pos_encoding = pos_encoding
        self.causal = causal
        self.rope_rcp_scale = 1 / Float64(rope_scale)
        self.rope_log2_theta = log2(Float64(rope_theta))

    @always_inline
    def has_soft_cap(self) -> Bool:
        return self.soft_cap_log2 > 0

    @always_inline
    def first_visible(self, q_pos: Int) -> Int:
        """The first kv position a query at q_pos sees."""
        if self.window_left < 0:
            return 0
        return max(q_pos - self.window_left, 0)

    @always_inline
    def visible[
        width: Int
    ](
        self,
        distance: SIMD[DType.float32, width],
        in_range: SIMD[DType.bool, width],
    ) -> SIMD[DType.bool, width]:
        """Which keys, at distance = kv_pos - q_pos, a query may see."""
        var seen = in_range
        if self.causal:
            seen = seen & distance.le(0)
        if self.window_left >= 0:
            seen = seen & distance.ge(Float32(-self.window_left))
        return seen

    @always_inline
    def finish_scores[
        width: Int
    ](
        self,
        raw: SIMD[DType.float32, width],
        alibi_log2: Float32,
        distance: SIMD[DType.float32, width],
    ) -> SIMD[DType.float32, width]:
        """Base-2 scores from pre-scaled dot products.

        raw: q . k already multiplied by q_scale_log2. distance: kv_pos - q_pos.
        alibi_log2: the head's ALiBi slope * log2(e) (0 when ALiBi is off).
        """
        var s = raw
        if self.has_soft_cap():
            s = self.soft_cap_log2 * tanh(raw)
        return s + alibi_log2 * distance


@always_inline
def alibi_slope(head: Int, num_heads: Int) -> Float32:
    """FlashInfer's (and Press et al.'s) ALiBi slope of a query head."""
    var n = 1
    while n * 2 <= num_heads:
        n *= 2
    if head < n:
        return exp2(-8.0 * Float32(head + 1) / Float32(n))
    return exp2(-4.0 * Float32(2 * (head - n) + 1) / Float32(n))


@always_inline
def rope_inv_freq(params: AttentionParams, i: Int, head_dim: Int) -> Float64:
    """Angle per position of rotary pair i: theta^(-2i/D) / rope_scale."""
    return (
        exp2(-Float64(2 * i) / Float64(head_dim) * params.rope_log2_theta)
        * params.rope_rcp_scale
    )


comptime TWO_PI: Float64 = 6.283185307179586


@always_inline
def rope_angle64[
    width: Int
](inv_freq: SIMD[DType.float64, width], pos: Int) -> SIMD[DType.float64, width]:
    """The angle pos * inv_freq, reduced to [-pi, pi] in float64: at position 10^4 a
    float32 product would already be off by 1e-3 radians."""
    var angle = inv_freq * Float64(pos)
    return angle - TWO_PI * round(angle / TWO_PI)


@always_inline
def rope_angle[
    width: Int
](inv_freq: SIMD[DType.float64, width], pos: Int) -> SIMD[DType.float32, width]:
    """`rope_angle64` rounded to float32 (for float32 sin and cos)."""
    return rope_angle64(inv_freq, pos).cast[DType.float32]()


@always_inline
def rope_rotate(
    x: Pointer[Float32, MutUntrackedOrigin],
    inv_freq: Pointer[Float64, MutUntrackedOrigin],
    pos: Int,
    head_dim: Int,
):
    """Rotates x [head_dim] in place, Llama's rotate-half: pairs (i, i + D/2).

    inv_freq holds head_dim / 2 float64 frequencies; head_dim / 2 is a
    multiple of 8.
    """
    comptime w = 8
    var half = head_dim // 2
    for c in range(half // w):
        # Rotated in float64 on the CPU: the result is rounded once, so
        # RoPE adds no error beyond float32's own (the GPU rotates in float32).
        var angle = rope_angle64[w](
            inv_freq.unsafe_offset(c * w).unsafe_load[width=w](), pos
        )
        var cs = cos(angle)
        var sn = sin(angle)
        var lo = (
            x.unsafe_offset(c * w).unsafe_load[width=w]().cast[DType.float64]()
        )
        var hi = (
            x.unsafe_offset(half + c * w)
            .unsafe_load[width=w]()
            .cast[DType.float64]()
        )
        x.unsafe_offset(c * w).unsafe_store(
            (lo * cs - hi * sn).cast[DType.float32]()
        )
        x.unsafe_offset(half + c * w).unsafe_store(
            (hi * cs + lo * sn).cast[DType.float32]()
        )


@always_inline
def empty_lse() -> Float32:
    return neg_inf[DType.float32]()
