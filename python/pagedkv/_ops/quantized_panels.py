"""GGUF-quantized weights packed for pagedkv's quantized product op.

A GGUF weight [N, K] (N output features, K inputs) is rows of blocks of 32
inputs, each block a scale (and a min) and 32 codes of 4 or 8 bits. The op
reads them repacked into panels of QUANT_PANEL = 16 output columns,
``[ceil(N / 16), quantized_panel_bytes(format, K)]`` bytes: per panel, the
codes of its blocks arranged for byte dot products, then their float16
scales, then their float16 mins (formats with a min); the K-quants keep
their blocks' 6- or 8-bit scales (and mins) as bytes, with each
super-block's float16 scale (and min) after them. The codes and scales
are the GGUF's own, bit for bit; only their order changes
(mojo_ops/quantized/block_formats.mojo describes the layout). A model packs
its weights once, when it loads them, and ``graph_ops.qlinear`` multiplies
by them in a step graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .contract import QUANT_FORMATS, QUANT_PANEL

QK = 32
"""Inputs per quantization block."""
PANEL_ALIGN = 64

_CODE_BITS = {
    "Q4_0": 4,
    "Q4_1": 4,
    "Q5_0": 5,
    "Q5_1": 5,
    "Q8_0": 8,
    "Q4_K": 4,
    "Q5_K": 5,
    "Q6_K": 6,
}
_HAS_MIN = {"Q4_1", "Q5_1", "Q4_K", "Q5_K"}
_SCALE_BYTES = {"Q4_K": 1, "Q5_K": 1, "Q6_K": 1}
"""Bytes of a packed scale or min where not float16's 2 (the K-quants':
int8 multiples of their super-block's float16 scale, `_SUPER_SCALED`)."""
_SUPER_SCALED = {"Q4_K", "Q5_K", "Q6_K"}
"""Formats whose panels end with each super-block's float16 scale (and,
with a min, its float16 -dmin)."""
_SCALES_PER_BLOCK = {"Q6_K": 2}
"""Scales of a block of 32 inputs where not 1: Q6_K's halves of 16."""
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
QK_K = 256
"""Inputs per K-quant super-block."""
_SUPER_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
PACKED_AS = {
    "Q4_0": "Q4_0",
    "Q4_1": "Q4_1",
    "Q5_0": "Q5_0",
    "Q5_1": "Q5_1",
    "Q8_0": "Q8_0",
    "Q4_K": "Q4_K",
    "Q5_K": "Q5_K",
    "Q6_K": "Q6_K",
}
"""The layout each GGUF format is packed in, exactly: each its own (the
K-quants' 6-bit scales and mins as a byte each)."""
ZERO_POINTS = {"Q4_0": 8, "Q5_0": 16}
"""Formats whose codes are unsigned with a zero point (w = d (q - z)): their
codes less z fit a signed byte, so they also pack as Q8_0, exactly (what a
fused product whose parts differ takes, `pack_quantized_weight`'s layout)."""


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's weight in a GGUF block format, packed in panels.

    Attributes:
        format: the packed layout, a GGUF type's name ("Q4_0", "Q4_1", "Q5_0",
            "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"; `PACKED_AS`).
        out_features: N.
        in_features: K, a multiple of 32.
        panels: uint8 [ceil(N / 16), quantized_panel_bytes(format, K)].
    """

    format: str
    out_features: int
    in_features: int
    panels: np.ndarray

    @property
    def format_code(self) -> int:
        """The op's `format` parameter: GGML's type id."""
        return QUANT_FORMATS[self.format]


def check_format(fmt: str) -> None:
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"quantized products take {', '.join(QUANT_FORMATS)} weights, not {fmt!r}")


def quantized_panel_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one packed panel of a weight with `in_features` inputs."""
    check_format(fmt)
    blocks = in_features // QK
    code_bytes = QK * QUANT_PANEL * _CODE_BITS[fmt] // 8
    scales = _SCALES_PER_BLOCK.get(fmt, 1) + (1 if fmt in _HAS_MIN else 0)
    scale_bytes = _SCALE_BYTES.get(fmt, 2) * QUANT_PANEL * scales
    size = blocks * (code_bytes + scale_bytes)
    if fmt in _SUPER_SCALED:
        size += in_features // QK_K * QUANT_PANEL * 2 * (2 if fmt in _HAS_MIN else 1)
    return -(-size // PANEL_ALIGN) * PANEL_ALIGN


def quantized_panels_shape(fmt: str, out_features: int, in_features: int) -> tuple[int, int]:
    """The packed shape of a weight [out_features, in_features]."""
    return (-(-out_features // QUANT_PANEL), quantized_panel_bytes(fmt, in_features))


def _block_rows(
    raw: np.ndarray, fmt: str, n: int, k: int, inputs: int, size: int, kind: str
) -> np.ndarray:
    """raw as [n, k / inputs, size] bytes: n rows of blocks of `inputs`
    inputs, `size` bytes each; ValueError if its size or k does not fit."""
    if k % inputs or raw.size != n * (k // inputs) * size:
        raise ValueError(
            f"a {fmt} weight [{n}, {k}] is {n * (k // inputs) * size} bytes in {kind} of "
            f"{inputs} inputs, got {raw.size} bytes"
        )
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // inputs, size)


def _k_quant_blocks(raw: np.ndarray, fmt: str, n: int, k: int) -> dict[str, np.ndarray]:
    """A K-quant's super-blocks of 256 as blocks of 32: codes [n, k / 32,
    32], each block's scale multiples (and mins) as bytes and each
    super-block's float16 scale (and -min) [n, k / 256].

    Q4_K: d, dmin (float16), 12 bytes of eight 6-bit scales sc_j and mins
    m_j, 128 bytes of codes (byte l of 32-byte chunk c holds input l of
    sub-block 2c in its low nibble, of 2c + 1 in its high one): sc_j and m_j
    [n, k / 32], d and -dmin. Q5_K: the same with 32 bytes qh between the
    scales and the codes, bit j of qh byte l the top bit of input l of
    sub-block j. Q6_K: `_q6_k_blocks`.
    """
    blocks = _block_rows(raw, fmt, n, k, QK_K, _SUPER_BLOCK_BYTES[fmt], "super-blocks")
    if fmt == "Q6_K":
        return _q6_k_blocks(blocks, n, k)
    q = blocks[..., 4:16].astype(np.uint8)
    # Sub-blocks 0-3: the low 6 bits of bytes j and j + 4; sub-blocks 4-7:
    # a nibble of byte j + 4 and the top 2 bits of bytes j - 4 and j.
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    code_start = 16 if fmt == "Q4_K" else 48
    qs = blocks[..., code_start:].reshape(n, k // QK_K, 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k // QK_K, 8, QK)
    if fmt == "Q5_K":
        qh = blocks[..., 16:48]  # [n, S, l]
        codes |= ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4
    return {
        "d": sc.reshape(n, k // QK),
        "m": m.reshape(n, k // QK),
        "super": blocks[..., 0:2].copy().view(np.float16)[..., 0],
        "super_min": -blocks[..., 2:4].copy().view(np.float16)[..., 0],
        "codes": codes.reshape(n, k // QK, QK),
    }


def _q6_k_blocks(blocks: np.ndarray, n: int, k: int) -> dict[str, np.ndarray]:
    """Q6_K super-blocks [n, S, 210] as `_k_quant_blocks` gives them. In
    each half of 128 inputs, input l + 32t (l < 32, t < 4) has its low
    nibble in ql byte l (t even) or l + 32 (t odd), low (t < 2) or high,
    and its top two bits at bits 2t of qh byte l."""
    ql = blocks[..., 0:128].reshape(n, -1, 2, 2, 32)  # [n, S, half, byte run, l]
    qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
    d = blocks[..., 208:210].copy().view(np.float16)  # [n, S, 1]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # [n, S, half, t, l]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    return {
        "d": blocks[..., 192:208].view(np.int8).reshape(n, k // QK, 2),
        "super": d[..., 0].astype(np.float16),
        "codes": (low | (high << 4)).reshape(n, k // QK, QK),
    }


def _blocks(raw: np.ndarray, fmt: str, n: int, k: int) -> dict[str, np.ndarray]:
    """The scale, min and codes [n, k / 32, ...] of the GGUF blocks in raw."""
    if fmt in _SUPER_BLOCK_BYTES:
        return _k_quant_blocks(raw, fmt, n, k)
    blocks = _block_rows(raw, fmt, n, k, QK, _BLOCK_BYTES[fmt], "blocks")
    parts = {"d": blocks[..., 0:2].copy().view(np.float16)[..., 0]}
    if fmt == "Q8_0":
        parts["codes"] = blocks[..., 2:34].view(np.int8)
        return parts
    # d, then (with a min) m, then (5-bit codes) the 32-bit qh, then qs.
    at = 4 if fmt in _HAS_MIN else 2
    if fmt in _HAS_MIN:
        parts["m"] = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    if _CODE_BITS[fmt] == 5:
        # Input j < 16: the low nibble of byte j and bit j of qh; input
        # j + 16: the high nibble and bit j + 16.
        qh = blocks[..., at : at + 4].copy().view("<u4")  # [n, blocks, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        qs = blocks[..., at + 4 : at + 20]
        parts["codes"] = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | high
        return parts
    qs = blocks[..., at : at + 16]
    # A 4-bit block's byte j holds input j (low nibble) and input j + 16.
    parts["codes"] = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return parts


def pack_quantized_weight(
    raw: np.ndarray, fmt: str, out_features: int, in_features: int, layout: str | None = None
):
    """Packs a GGUF weight's blocks into the product op's panels.

    Parameters
    ----------
    raw : numpy.ndarray
        The weight's GGUF data, uint8, ``out_features`` rows of
        ``in_features / 32`` blocks (any shape with that many bytes, e.g.
        what ``gguf.GGUFReader`` gives as a tensor's ``data``); read, not
        modified.
    fmt : str
        Its GGUF type: "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K" or
        "Q6_K".
    out_features, in_features : int
        N and K of the weight [N, K]; K a multiple of 32 (of 256 for the
        K-quants).
    layout : str, optional
        The packed layout: `PACKED_AS[fmt]` (the default), or "Q8_0" for a
        format with a zero point (`ZERO_POINTS`), exactly.

    Returns
    -------
    QuantizedWeight
        Its format is the packed layout's; the panels, uint8
        ``[ceil(N / 16), quantized_panel_bytes(format, K)]``; columns past
        N are zero.

    Examples
    --------
    >>> import numpy as np
    >>> from gguf import GGMLQuantizationType, quants
    >>> from pagedkv._ops.quantized_panels import pack_quantized_weight
    >>> w = np.random.default_rng(0).standard_normal((20, 64)).astype(np.float32)
    >>> raw = quants.quantize(w, GGMLQuantizationType.Q4_1)
    >>> packed = pack_quantized_weight(raw, "Q4_1", 20, 64)
    >>> packed.panels.shape
    (2, 640)
    """
    if fmt not in PACKED_AS:
        raise ValueError(f"quantized products take {', '.join(PACKED_AS)} weights, not {fmt!r}")
    layout = layout or PACKED_AS[fmt]
    if layout not in (PACKED_AS[fmt], "Q8_0" if fmt in ZERO_POINTS else None):
        raise ValueError(f"a {fmt} weight does not pack as {layout}")
    n, k = int(out_features), int(in_features)
    parts = _blocks(raw, fmt, n, k)
    if layout != PACKED_AS[fmt]:  # a zero point's codes as signed bytes
        parts["codes"] = (parts["codes"].astype(np.int16) - ZERO_POINTS[fmt]).astype(np.int8)
    fmt = layout
    panels = -(-n // QUANT_PANEL)
    blocks = k // QK

    def by_panel(a: np.ndarray) -> np.ndarray:
        """a [n, ...] zero-padded to [panels, 16, ...]."""
        padded = np.zeros((panels * QUANT_PANEL, *a.shape[1:]), a.dtype)
        padded[:n] = a
        return padded.reshape(panels, QUANT_PANEL, *a.shape[1:])

    codes = by_panel(parts["codes"].view(np.uint8))  # [P, 16, B, 32]
    bits = _CODE_BITS[fmt]
    if bits <= 6:
        # Input 8g + 4h + j of column c: group g, byte 4c + j, nibble h;
        # its top bits (5- or 6-bit codes) in the groups after the nibbles'
        # (block_formats.mojo).
        c = codes.reshape(panels, QUANT_PANEL, blocks, 4, 2, 4).transpose(0, 2, 3, 1, 5, 4)
        packed_codes = (c[..., 0] & 0x0F) | ((c[..., 1] & 0x0F) << 4)  # [P, B, g, c, j]
        if bits > 4:
            top_bits = bits - 4
            per_group = 8 // (2 * top_bits)  # nibble groups per group of top bits
            g = np.arange(4)
            place = ((g % per_group)[:, None, None, None] * 2 + np.arange(2)) * top_bits
            top = ((c >> 4) & ((1 << top_bits) - 1)) << place.astype(np.uint8)
            top = top.reshape(panels, blocks, 4 // per_group, per_group, QUANT_PANEL, 4, 2)
            top = top.sum(axis=(3, 6), dtype=np.uint8)  # [P, B, t, c, j]
            packed_codes = np.concatenate(
                [packed_codes.reshape(panels, blocks, -1), top.reshape(panels, blocks, -1)], 2
            )
    else:
        # Input 4g + j of column c: group g, byte 4c + j.
        packed_codes = codes.reshape(panels, QUANT_PANEL, blocks, 8, 4).transpose(0, 2, 3, 1, 4)
    sections = [packed_codes.reshape(panels, -1)]
    names = ("d", "m") if fmt in _HAS_MIN else ("d",)
    if fmt in _SUPER_SCALED:
        names += ("super", "super_min") if fmt in _HAS_MIN else ("super",)
    for name in names:
        scales = np.moveaxis(by_panel(parts[name]), 1, -1)  # [P, B or S, (2,) 16]
        sections.append(np.ascontiguousarray(scales).view(np.uint8).reshape(panels, -1))
    width = quantized_panel_bytes(fmt, k)
    out = np.zeros((panels, width), np.uint8)
    used = sum(s.shape[1] for s in sections)
    out[:, :used] = np.concatenate(sections, axis=1)
    return QuantizedWeight(fmt, n, k, out)
