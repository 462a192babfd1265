"""GGUF's block formats as the quantized products read them: weight codes and
per-block scales, repacked into panels of columns.

A GGUF weight [N, K] (N output features, K inputs) is stored as blocks of
QK = 32 consecutive inputs of one output row; a block holds a scale d (and,
in the "_1" formats, a min m) and 32 codes q, and element i is

    Q4_0: d * (q_i - 8)      q 4-bit        Q8_0: d * q_i   q signed 8-bit
    Q4_1: d * q_i + m        q 4-bit        Q5_0: d * (q_i - 16)   q 5-bit
    Q5_1: d * q_i + m        q 5-bit

Q4_K's super-blocks of 256 inputs are eight such blocks of 32 with a
6-bit scale and min each, under a float16 scale and min of the super-block:
element i of sub-block j is (d * sc_j) * q_i - (dmin * m_j). pagedkv keeps
its bits: the 4-bit codes, each block's sc_j and m_j as a byte and each
super-block's d and -dmin as float16, 4.63 bits a weight (the file's 4.5
pack the 6-bit pairs tighter); the product multiplies d * sc_j and
-dmin * m_j itself, exact in float32 (11 bits of mantissa times 6). Q5_K
is Q4_K with 5-bit codes (5.63 bits a weight; the file's 5.5).

Q6_K's super-blocks of 256 inputs are sixteen blocks of 16 with an 8-bit
scale each under a float16 one: element i of sub-block j is
(d * sc_j) * (q_i - 32), q 6-bit. pagedkv keeps its bits: the 6-bit codes
(zero point 32), each block of 32's two int8 scales (one for each half of
16 inputs) and each super-block's float16 d, 6.56 bits a weight as in the
file; the product multiplies d * sc_j itself.

pagedkv repacks the blocks (`pagedkv._ops.quantized_panels`) into panels of
PANEL = 16 output columns, [ceil(N / 16), panel_bytes(format, K)] bytes. A
panel holds, for its blocks b = 0 .. K/32 - 1 in turn, their codes, then all
their scales, then (formats with a min) all their mins:

    codes:  K/32 x code_bytes     the codes of 16 columns x 32 inputs
    scales: K/32 x 16 float16     d of each column's block (Q4_K, Q5_K:
                                  int8 sc_j; Q6_K: K/32 x 2 x 16 int8 sc_j,
                                  by half)
    mins:   K/32 x 16 float16     m of each column's block (Q4_1, Q5_1;
                                  Q4_K, Q5_K: int8 m_j)
    super:  K/256 x 16 float16    the K-quants: d of each column's super-block,
                                  then (Q4_K, Q5_K) K/256 x 16 float16 -dmin

padded to a multiple of 64 bytes. A block's codes come in groups of 64
bytes, 4 bytes per column (column c at bytes 4c .. 4c + 3), so that one
vector register of bytes holds 4 consecutive inputs of 16 (AVX-512), 8
(AVX2) or 4 (NEON) columns, as a byte dot product wants them:

    4-bit: group g (of 4) byte 4c + j = q[c][8g + j] | q[c][8g + 4 + j] << 4
    8-bit: group g (of 8) byte 4c + j = q[c][4g + j]

A 5- or 6-bit block's low four bits are a 4-bit block's groups; after them
come its top bits. 5-bit: one group, bit 2g + h of its byte 4c + j the top
bit of q[c][8g + 4h + j] (5.5 bits a weight with the scale, as in the
file). 6-bit: two groups, t = 0 and 1, bits 4(g - 2t) + 2h and the next of
byte 4c + j of group t the top two bits of q[c][8g + 4h + j] (g = 2t, 2t + 1).

Columns past N in the last panel have zero codes and zero scales.
"""

comptime QK = 32
"""Inputs per quantization block."""
comptime PANEL = 16
"""Output columns per panel (pagedkv._ops.contract.QUANT_PANEL)."""
comptime GROUP_BYTES = 64
"""Bytes of a group of codes: 4 bytes of each of a panel's 16 columns."""
comptime PANEL_ALIGN = 64
"""Bytes a panel's size is rounded up to, so every panel starts aligned."""

# The formats, by GGML's type ids (pagedkv._ops.contract.QUANT_FORMATS).
comptime Q4_0 = 2
comptime Q4_1 = 3
comptime Q5_0 = 6
comptime Q5_1 = 7
comptime Q8_0 = 8
comptime Q4_K = 12
comptime Q5_K = 13
comptime Q6_K = 14


def is_supported(fmt: Int) -> Bool:
    return (
        fmt == Q4_0
        or fmt == Q4_1
        or fmt == Q5_0
        or fmt == Q5_1
        or fmt == Q8_0
        or fmt == Q4_K
        or fmt == Q5_K
        or fmt == Q6_K
    )


def code_bits(fmt: Int) -> Int:
    """Bits of one weight code."""
    if fmt == Q5_0 or fmt == Q5_1 or fmt == Q5_K:
        return 5
    if fmt == Q6_K:
        return 6
    return 8 if fmt == Q8_0 else 4


def nibble_bits(fmt: Int) -> Int:
    """Bits of a code in its groups: 4 (its low nibble) for codes of 4 to 6
    bits, 8 for bytes."""
    return 4 if code_bits(fmt) <= 6 else 8


def has_super_scales(fmt: Int) -> Bool:
    """Whether a block's scales (and mins) are int8 multiples of its
    super-block's float16 scale (and min), multiplied by the product itself:
    the K-quants."""
    return fmt == Q4_K or fmt == Q5_K or fmt == Q6_K


def super_blocks(k_dim: Int) -> Int:
    """Super-blocks of 256 inputs in k_dim (a super-scale format's)."""
    return k_dim // (8 * QK)


def has_min(fmt: Int) -> Bool:
    """Whether blocks carry a min m (w = d * q + m) rather than a zero point."""
    return fmt == Q4_1 or fmt == Q5_1 or fmt == Q4_K or fmt == Q5_K


def scale_bytes(fmt: Int) -> Int:
    """Bytes of one block's scale (and of its min): float16, or an int8
    multiple of the super-block's (`has_super_scales`)."""
    return 1 if has_super_scales(fmt) else 2


def scales_per_block(fmt: Int) -> Int:
    """Scales of one block of 32 inputs: Q6_K's halves of 16 have one each."""
    return 2 if fmt == Q6_K else 1


def zero_point(fmt: Int, signed_codes: Bool) -> Int:
    """The code z with w = d * (q - z), as the product reads the codes: Q4_0's
    8; Q8_0's codes are stored signed, and read either as they are (z = 0)
    or, where the dot product takes unsigned bytes, flipped to q + 128."""
    if fmt == Q4_0:
        return 8
    if fmt == Q5_0:
        return 16
    if fmt == Q6_K:
        return 32
    if fmt == Q8_0 and not signed_codes:
        return 128
    return 0


def code_groups(fmt: Int) -> Int:
    """Groups of GROUP_BYTES in one block's codes, the top bits' group of a
    5-bit block not counted."""
    return QK * PANEL * nibble_bits(fmt) // 8 // GROUP_BYTES


def code_bytes(fmt: Int) -> Int:
    """Bytes of one block's codes in a panel, the top bits' group included."""
    return QK * PANEL * code_bits(fmt) // 8


def panel_bytes(fmt: Int, k_dim: Int) -> Int:
    """Bytes of one panel of a weight with k_dim inputs."""
    var blocks = k_dim // QK
    var scales = (
        scale_bytes(fmt)
        * PANEL
        * (scales_per_block(fmt) + (1 if has_min(fmt) else 0))
    )
    var size = blocks * (code_bytes(fmt) + scales)
    if has_super_scales(fmt):
        size += super_blocks(k_dim) * PANEL * 2 * (2 if has_min(fmt) else 1)
    return (size + PANEL_ALIGN - 1) // PANEL_ALIGN * PANEL_ALIGN
