"""graph_ops.qlinear: products with GGUF-quantized weights against float64.

The reference is written independently of the kernel: the weights are
dequantized by the `gguf` package (the GGUF format's own reference code),
and the activations are quantized per block of 32 as the op documents
(d = max|x| / 127, q = round-half-even(x * 127 / max|x|), in float32) by
the NumPy model's `quantize_activations`. The op's only other rounding is
float32 accumulation over the blocks, so the tolerance is tight; a prologue
computed in a different order may move one code of a block by one step,
which the tolerance allows.
Packing is checked bitwise: the panels hold the GGUF's codes and scales.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from max.driver import Buffer
from max.dtype import DType
from max.graph import DeviceRef, Graph, Module, TensorType

from pagedkv import graph_ops
from pagedkv._ops.quantized_panels import (
    pack_quantized_weight,
    quantized_panel_bytes,
    quantized_panels_shape,
)
from pagedkv.graphs.numpy_reference import quantize_activations
from suite_graphs import ops_graph, suite_graph, suite_model

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# (format, N, K, prologue, residual, x dtype): a partial panel, several
# panels, K of many blocks, each prologue, the epilogue and bfloat16 x.
PRODUCTS = [
    ("Q4_0", 40, 96, "none", False, DType.float32),
    ("Q4_1", 50, 64, "rms_norm", True, DType.float32),
    ("Q8_0", 33, 160, "none", True, DType.float32),
    ("Q4_1", 64, 64, "swiglu", True, DType.float32),
    ("Q8_0", 16, 32, "rms_norm", False, DType.float32),
    ("Q4_0", 24, 64, "none", False, DType.bfloat16),
    ("Q4_K", 40, 256, "none", True, DType.float32),
    ("Q4_K", 20, 512, "rms_norm", False, DType.bfloat16),
    ("Q6_K", 33, 256, "none", True, DType.float32),
    ("Q6_K", 16, 512, "swiglu", False, DType.float32),
    ("Q5_0", 40, 96, "none", True, DType.float32),
    ("Q5_0", 33, 64, "swiglu", False, DType.float32),
    ("Q5_1", 48, 96, "rms_norm", True, DType.float32),
    ("Q5_1", 33, 64, "none", False, DType.bfloat16),
    ("Q5_K", 40, 256, "none", True, DType.float32),
    ("Q5_K", 24, 512, "swiglu", False, DType.bfloat16),
]
ROWS = [1, 2, 5, 6, 7, 13, 50, 97]
EPS = 1e-5


def x_width(k: int, prologue: str) -> int:
    return 2 * k if prologue == "swiglu" else k


@suite_graph("qlinear_products")
def qlinear_products(module: Module) -> None:
    cpu = DeviceRef.CPU()
    types = []
    for fmt, n, k, prologue, _, dt in PRODUCTS:
        types += [
            TensorType(dt, ["m", x_width(k, prologue)], cpu),
            TensorType(DType.uint8, quantized_panels_shape(fmt, n, k), cpu),
            TensorType(DType.float32, [k], cpu),
            TensorType(DType.float32, ["m", n], cpu),
        ]
    with ops_graph(module, "qlinear_products", types) as g:
        outs = []
        for i, (fmt, n, _, prologue, residual, _) in enumerate(PRODUCTS):
            x, w, gamma, res = (v.tensor for v in g.inputs[4 * i : 4 * i + 4])
            outs.append(
                graph_ops.qlinear(
                    x,
                    w,
                    fmt,
                    n,
                    rms_norm=(gamma, EPS) if prologue == "rms_norm" else None,
                    swiglu=prologue == "swiglu",
                    residual=res if residual else None,
                )
            )
        g.output(*outs)


@pytest.fixture
def qlinear_model():
    return suite_model("qlinear_products")


SUPER_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def gguf_blocks(rng: np.random.Generator, fmt: str, w: np.ndarray) -> np.ndarray:
    """w [N, K] in GGUF blocks of fmt: quantized by `gguf`, or for the
    K-quants (which `gguf` does not quantize) random super-blocks: any bytes
    are a valid one, with float16 scales set to a weight scale near w's."""
    n, k = w.shape
    shape = (n, k // 256, 1)
    if fmt in ("Q4_K", "Q5_K"):
        raw = rng.integers(0, 256, (n, k // 256, SUPER_BLOCK_BYTES[fmt]), dtype=np.uint8)
        raw[..., 0:2] = rng.uniform(0.002, 0.004, shape).astype(np.float16).view(np.uint8)
        raw[..., 2:4] = rng.uniform(0.01, 0.03, shape).astype(np.float16).view(np.uint8)
        return raw.reshape(n, -1)
    if fmt == "Q6_K":
        raw = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
        raw[..., 208:210] = rng.uniform(2e-4, 4e-4, shape).astype(np.float16).view(np.uint8)
        return raw.reshape(n, -1)
    return quants.quantize(w, GGMLQuantizationType[fmt])


def prologue_rows(x: np.ndarray, prologue: str, gamma: np.ndarray) -> np.ndarray:
    """What the op quantizes, in float32: x, RMSNorm(x) * gamma, or SwiGLU."""
    x = x.astype(np.float32)
    if prologue == "rms_norm":
        scale = 1 / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + EPS)
        return (x * scale.astype(np.float32) * gamma).astype(np.float32)
    if prologue == "swiglu":
        k = x.shape[1] // 2
        gate, up = x[:, :k], x[:, k:]
        return (gate / (1 + np.exp(-gate)) * up).astype(np.float32)
    return x


def reference(x, raw, fmt, prologue, gamma, residual):
    """(y, tolerance) of the product in float64 (see the module docstring)."""
    w = quants.dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float64)
    rows = prologue_rows(x, prologue, gamma)
    xq = quantize_activations(rows)
    scales = np.abs(rows).reshape(len(rows), -1, 32).max(axis=-1) / 127
    y = xq @ w.T
    magnitude = np.abs(xq) @ np.abs(w.T)
    one_step = np.abs(w).max() * scales.max(axis=1, keepdims=True)
    if residual is not None:
        y = y + residual
    return y, 1e-5 * magnitude + 1.01 * one_step + 1e-6


@pytest.mark.parametrize("rows", ROWS)
def test_qlinear_matches_float64(qlinear_model, rows):
    rng = np.random.default_rng(rows)
    args, cases = [], []
    for fmt, n, k, prologue, residual, dt in PRODUCTS:
        w = rng.standard_normal((n, k)).astype(np.float32)
        raw = gguf_blocks(rng, fmt, w)
        x = rng.standard_normal((rows, x_width(k, prologue))).astype(np.float32)
        if dt == DType.bfloat16:
            x_arg = torch.from_numpy(x).to(torch.bfloat16)
            x = x_arg.float().numpy()
        else:
            x_arg = x
        gamma = (1 + 0.3 * rng.standard_normal(k)).astype(np.float32)
        res = rng.standard_normal((rows, n)).astype(np.float32)
        args += [x_arg, pack_quantized_weight(raw, fmt, n, k).panels, gamma, res]
        cases.append(reference(x, raw, fmt, prologue, gamma, res if residual else None))
    outs = qlinear_model.execute(*(Buffer.from_dlpack(a) for a in args))
    for out, (want, tol), product in zip(outs, cases, PRODUCTS, strict=True):
        got = out.to_numpy()
        assert got.shape == want.shape and got.dtype == np.float32, product
        err = np.abs(got.astype(np.float64) - want)
        assert (err <= tol).all(), f"{product}: error {err.max()} (tolerance {tol.min()})"


def test_a_rows_product_does_not_depend_on_the_rows_beside_it(qlinear_model):
    """Rows 0-2 of a 50-row product are bit for bit those of the same 3
    rows alone: each row is quantized and multiplied on its own, whichever
    tile takes it (AMX's 16-row tiles where the CPU has them, the register
    tiles of fewer rows), which batch-invariant decode relies on."""
    rng = np.random.default_rng(5)
    full, alone = [], []
    for fmt, n, k, prologue, _, dt in PRODUCTS:
        raw = gguf_blocks(rng, fmt, rng.standard_normal((n, k)).astype(np.float32))
        panels = pack_quantized_weight(raw, fmt, n, k).panels
        x = rng.standard_normal((50, x_width(k, prologue))).astype(np.float32)
        x_arg = torch.from_numpy(x).to(torch.bfloat16) if dt == DType.bfloat16 else x
        gamma = (1 + 0.3 * rng.standard_normal(k)).astype(np.float32)
        res = rng.standard_normal((50, n)).astype(np.float32)
        full += [x_arg, panels, gamma, res]
        alone += [x_arg[:3], panels, gamma, res[:3]]
    outs = [qlinear_model.execute(*(Buffer.from_dlpack(a) for a in args)) for args in (full, alone)]
    for got, want, product in zip(*outs, PRODUCTS, strict=True):
        np.testing.assert_array_equal(got.to_numpy()[:3], want.to_numpy(), err_msg=str(product))


MAX_CODE_BYTES = {
    "Q4_0": (2, 18, 0xFF),
    "Q4_1": (4, 20, 0xFF),
    "Q5_0": (2, 22, 0xFF),
    "Q5_1": (4, 24, 0xFF),
    "Q8_0": (2, 34, 0x7F),
    "Q4_K": (16, 144, 0xFF),
    "Q5_K": (16, 176, 0xFF),
    "Q6_K": (0, 192, 0xFF),
}
"""(first, end, value): the bytes of a block (a super-block for the
K-quants) that hold its codes, and the value that makes every code its
largest (4 bits: 15, 5 bits: 31, 6 bits: 63, Q8_0: 127)."""


@pytest.mark.parametrize("rows", [3, 18])
@pytest.mark.parametrize("sign", [1, -1])
def test_largest_codes_by_largest_activations_sum_exactly(qlinear_model, sign, rows):
    """Every code at its largest, every activation at +-127: the dot
    products' partial sums are as large as they get, so a sum kept in too
    narrow an integer (int16 pairs without VNNI: simd/int8_dot.mojo's
    pair_dot_steps) wraps and misses the reference by far. 18 rows take
    AMX's tile products where the CPU has them (16 rows, then 2)."""
    rng = np.random.default_rng(11)
    args, cases = [], []
    for fmt, n, k, prologue, _, dt in PRODUCTS:
        raw = gguf_blocks(rng, fmt, rng.standard_normal((n, k)).astype(np.float32))
        first, end, value = MAX_CODE_BYTES[fmt]
        blocks = raw.reshape(n, -1, SUPER_BLOCK_BYTES.get(fmt, end))
        blocks[..., first:end] = value
        raw = blocks.reshape(raw.shape)
        x = np.full((rows, x_width(k, prologue)), 1.0, np.float32)
        if prologue == "swiglu":
            x[:, k:] = sign  # silu(1) * sign in every input
        else:
            x *= sign
        x_arg = torch.from_numpy(x).to(torch.bfloat16) if dt == DType.bfloat16 else x
        gamma = np.ones(k, np.float32)
        args += [x_arg, pack_quantized_weight(raw, fmt, n, k).panels, gamma]
        args.append(np.zeros((rows, n), np.float32))
        cases.append(reference(x, raw, fmt, prologue, gamma, None))
    outs = qlinear_model.execute(*(Buffer.from_dlpack(a) for a in args))
    for out, (want, tol), product in zip(outs, cases, PRODUCTS, strict=True):
        err = np.abs(out.to_numpy().astype(np.float64) - want)
        assert (err <= tol).all(), f"{product}: error {err.max()} (tolerance {tol.min()})"


def test_quantized_activations_stay_close_to_float(qlinear_model):
    """Against the unquantized product, the error is what 8-bit activations
    allow: each input rounded by up to half a step of max|x| / 127 (about
    0.6% of its spread as an RMS), summed at random over K, so the output's
    error is about 0.6% of its own RMS and rarely past 5 times that."""
    rng = np.random.default_rng(7)
    fmt, n, k = "Q4_1", 50, 64
    args = []
    for f, nn, kk, prologue, _, dt in PRODUCTS:
        raw = gguf_blocks(rng, f, rng.standard_normal((nn, kk)).astype(np.float32))
        x = rng.standard_normal((64, x_width(kk, prologue))).astype(np.float32)
        x_arg = torch.from_numpy(x).to(torch.bfloat16) if dt == DType.bfloat16 else x
        args += [x_arg, pack_quantized_weight(raw, f, nn, kk).panels]
        args += [np.ones(kk, np.float32), np.zeros((64, nn), np.float32)]
        if (f, nn, kk) == (fmt, n, k):
            w = quants.dequantize(raw, GGMLQuantizationType[f]).astype(np.float64)
            want = prologue_rows(x, prologue, np.ones(kk, np.float32)).astype(np.float64) @ w.T
    got = qlinear_model.execute(*(Buffer.from_dlpack(a) for a in args))[1].to_numpy()
    rel = np.abs(got - want) / np.sqrt((want**2).mean())
    assert np.sqrt((rel**2).mean()) < 0.01
    assert rel.max() < 0.05


def unpack_panels(panels: np.ndarray, fmt: str, n: int, k: int):
    """The codes [n, k], scales [n, k/32] (Q6_K: [n, k/32, 2]) and mins (or
    None) read back from the panels by the layout block_formats.mojo
    documents, and the padding columns' codes and scales. The K-quants'
    scales and mins are float32 products of their int8 multiples and their
    super-blocks' float16 factors, as the product forms them."""
    blocks = k // 32
    bits = {"Q8_0": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5}.get(fmt, 4)
    scale = np.int8 if fmt in SUPER_BLOCK_BYTES else np.float16
    parts = 2 if fmt == "Q6_K" else 1
    scale_bytes = blocks * parts * 16 * np.dtype(scale).itemsize
    code_bytes = 32 * 16 * bits // 8
    p = panels.shape[0]
    block_codes = panels[:, : blocks * code_bytes].reshape(p, blocks, code_bytes)
    # A 5- or 6-bit block's nibbles come first, as a 4-bit block's.
    codes_raw = block_codes[..., : 256 if bits <= 6 else code_bytes].reshape(p, blocks, -1, 16, 4)
    if bits <= 6:
        lo, hi = codes_raw & 0x0F, codes_raw >> 4
        codes = np.stack([lo, hi], axis=-2)  # [P, B, g, c, h, j]
        if bits > 4:
            # The top bits: bit (2 (g mod n) + h) t of byte 4c + j in top
            # group g // n (n = 4 groups a 5-bit one covers, 2 a 6-bit one).
            t, per = bits - 4, 8 // (2 * (bits - 4))
            g = np.arange(4)[:, None, None]
            tops = block_codes[..., 256:].reshape(p, blocks, -1, 16, 1, 4)[:, :, g // per]
            tops = tops.reshape(p, blocks, 4, 16, 1, 4)
            place = ((g % per) * 2 + np.arange(2)[:, None]) * t
            place = place.reshape(4, 1, 2, 1).astype(np.uint8)
            codes = codes | (((tops >> place) & ((1 << t) - 1)) << 4)
        codes = codes.transpose(0, 3, 1, 2, 4, 5).reshape(p * 16, k)
    else:
        codes = codes_raw.transpose(0, 3, 1, 2, 4).reshape(p * 16, k).view(np.int8)
    at = blocks * code_bytes
    scales = panels[:, at : at + scale_bytes].copy().view(scale).reshape(p, blocks, parts, 16)
    scales = scales.transpose(0, 3, 1, 2).reshape(p * 16, blocks, parts)
    scales = scales[..., 0] if parts == 1 else scales
    at += scale_bytes
    mins = None
    if fmt in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        mins = panels[:, at : at + scale_bytes].copy().view(scale).reshape(p, blocks, 16)
        mins = mins.transpose(0, 2, 1).reshape(p * 16, blocks)
        at += scale_bytes
    if fmt in SUPER_BLOCK_BYTES:

        def supers(at: int) -> np.ndarray:
            """The super-blocks' float16 factors from `at`, per block of 32."""
            f = panels[:, at : at + k // 256 * 32].copy().view(np.float16)
            f = f.reshape(p, k // 256, 16).transpose(0, 2, 1).reshape(p * 16, -1)
            return f.astype(np.float32).repeat(8, axis=1)

        scale_of = supers(at)
        scales = scales.astype(np.float32) * (scale_of if parts == 1 else scale_of[..., None])
        if mins is not None:
            mins = mins.astype(np.float32) * supers(at + k // 256 * 32)
    mins = None if mins is None else mins[:n]
    return codes[:n], scales[:n], mins, codes[n:], scales[n:]


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_keeps_the_gguf_blocks_bit_for_bit(fmt):
    rng = np.random.default_rng(3)
    n, k = 37, 96
    raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[fmt])
    packed = pack_quantized_weight(raw, fmt, n, k)
    assert packed.panels.shape == quantized_panels_shape(fmt, n, k)
    assert packed.panels.shape[1] % 64 == 0
    codes, scales, mins, pad_codes, pad_scales = unpack_panels(packed.panels, fmt, n, k)
    size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[fmt]
    blocks = raw.reshape(n, k // 32, size)
    assert scales.tobytes() == blocks[..., 0:2].copy().view(np.float16)[..., 0].tobytes()
    if fmt == "Q8_0":
        assert codes.tobytes() == blocks[..., 2:].copy().view(np.int8).reshape(n, k).tobytes()
    elif fmt in ("Q5_0", "Q5_1"):
        # Input j: the low nibble of byte j (j < 16) or the high one of byte
        # j - 16, with bit j of the 32-bit qh (after d, and Q5_1's m) on top.
        at = 2 if fmt == "Q5_0" else 4
        qh = blocks[..., at : at + 4].copy().view("<u4")
        top = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        qs = blocks[..., at + 4 :]
        want = (np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | top).reshape(n, k)
        assert codes.tobytes() == want.tobytes()
    else:
        qs = blocks[..., 4:] if fmt == "Q4_1" else blocks[..., 2:]
        want = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
        assert codes.tobytes() == want.tobytes()
    if mins is not None:
        assert mins.tobytes() == blocks[..., 2:4].copy().view(np.float16)[..., 0].tobytes()
    assert not pad_codes.any() and not pad_scales.view(np.uint16).any()


@pytest.mark.parametrize("layout", ["Q5_0", "Q8_0"])
def test_q5_0_packs_in_its_own_bits_or_as_q8_0_exactly(layout):
    """Q5_0 packs in its own 5.5 bits a weight (a fifth group of top bits
    beside the nibbles), or, asked for Q8_0 (a fused product whose other
    parts are Q8_0), as signed codes less 16: either way the panels
    dequantize to what `gguf` dequantizes, bit for bit. Q4_1, with a min,
    does not pack as Q8_0."""
    rng = np.random.default_rng(4)
    n, k = 21, 128
    kind = GGMLQuantizationType.Q5_0
    raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), kind)
    packed = pack_quantized_weight(raw, "Q5_0", n, k, None if layout == "Q5_0" else layout)
    assert (packed.format, packed.panels.shape) == (layout, quantized_panels_shape(layout, n, k))
    codes, scales, _, _, _ = unpack_panels(packed.panels, layout, n, k)
    signed = codes.astype(np.int16) - 16 if layout == "Q5_0" else codes.view(np.int8)
    values = signed.reshape(n, k // 32, 32) * scales.astype(np.float32)[..., None]
    np.testing.assert_array_equal(values.reshape(n, k), quants.dequantize(raw, kind))
    assert signed.min() >= -16 and signed.max() <= 15
    if layout == "Q5_0":
        assert packed.panels.shape[1] == -(-(k // 32) * (5 * 16 * 32 // 8 + 32) // 64) * 64
    with pytest.raises(ValueError, match="does not pack as Q8_0"):
        q41 = quants.quantize(
            rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType.Q4_1
        )
        pack_quantized_weight(q41, "Q4_1", n, k, "Q8_0")


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_are_packed_exactly(fmt):
    """A K-quant's blocks of 32 as the product reads them, in their own
    bits: Q4_K's 4-bit codes with each block's 6-bit scale and min as bytes
    and each super-block's float16 d and -dmin (4.63 bits a weight), Q5_K's
    the same with 5-bit codes (5.63 bits); Q6_K's
    6-bit codes (zero point 32), each half block's int8 scale and each
    super-block's float16 d (6.56 bits). Their products are exact in
    float32; the panels dequantize to what `gguf` dequantizes, bit for bit."""
    rng = np.random.default_rng(5)
    n, k = 21, 512
    raw = gguf_blocks(rng, fmt, np.zeros((n, k), np.float32))
    packed = pack_quantized_weight(raw, fmt, n, k)
    assert (packed.format, packed.panels.shape) == (fmt, quantized_panels_shape(fmt, n, k))
    codes, scales, mins, pad_codes, pad_scales = unpack_panels(packed.panels, fmt, n, k)
    if fmt == "Q6_K":
        assert mins is None and codes.min() >= 0 and codes.max() <= 63
        values = (codes.astype(np.float32) - 32).reshape(n, k // 16, 16) * scales.reshape(n, -1, 1)
        assert packed.panels.shape[1] * 8 / (16 * k) < 6.6  # bits a weight
    else:
        bits = {"Q4_K": 4, "Q5_K": 5}[fmt]
        assert codes.min() >= 0 and codes.max() == 2**bits - 1
        values = codes.reshape(n, k // 32, 32) * scales[..., None] + mins[..., None]
        assert packed.panels.shape[1] * 8 / (16 * k) < bits + 0.7  # bits a weight
    want = quants.dequantize(raw, GGMLQuantizationType[fmt])
    np.testing.assert_array_equal(values.reshape(n, k), want)
    assert not pad_codes.any() and not pad_scales.any()
    with pytest.raises(ValueError, match="super-blocks of 256"):
        pack_quantized_weight(raw[:, : raw.shape[1] // 2], fmt, n, 288)  # K not a multiple of 256


def test_bad_quantized_operands_are_refused():
    with pytest.raises(ValueError, match="Q4_0, Q4_1, Q5_0, Q5_1, Q8_0"):
        quantized_panel_bytes("Q2_K", 64)
    with pytest.raises(ValueError, match="bytes in blocks"):
        pack_quantized_weight(np.zeros(10, np.uint8), "Q4_1", 2, 64)
    with pytest.raises(ValueError, match="bytes in blocks"):
        pack_quantized_weight(np.zeros(40, np.uint8), "Q4_1", 2, 48)  # K not a multiple of 32
    cpu = DeviceRef.CPU()
    types = [
        TensorType(DType.float32, ["m", 64], cpu),
        TensorType(DType.uint8, quantized_panels_shape("Q4_1", 20, 64), cpu),
        TensorType(DType.float32, [32], cpu),
        TensorType(DType.float32, ["m", "k"], cpu),
    ]
    with Graph("bad_qlinear", input_types=types) as g:
        x, w, gamma, dynamic = (v.tensor for v in g.inputs)
        with pytest.raises(ValueError, match="Q4_0, Q4_1, Q5_0, Q5_1, Q8_0"):
            graph_ops.qlinear(x, w, "Q2_K", 20)
        with pytest.raises(ValueError, match="packed as uint8"):
            graph_ops.qlinear(x, w, "Q4_1", 40)
        with pytest.raises(ValueError, match="packed as uint8"):
            graph_ops.qlinear(x, w, "Q8_0", 20)
        with pytest.raises(ValueError, match="rms_norm weight"):
            graph_ops.qlinear(x, w, "Q4_1", 20, rms_norm=(gamma, EPS))
        with pytest.raises(ValueError, match="one prologue"):
            graph_ops.qlinear(x, w, "Q4_1", 20, rms_norm=(gamma, EPS), swiglu=True)
        with pytest.raises(ValueError, match="static K"):
            graph_ops.qlinear(dynamic, w, "Q4_1", 20)
