"""graph_ops.packed_rows: rows of a packed GGUF weight (an embedding lookup)
against the `gguf` package's dequantization of the same blocks, bit for bit.

The op documents that it computes each element as `gguf` (and llama.cpp)
do, one float32 rounding per operation in the same order, so the check is
exact. The blocks are random bytes, every code and every 6-bit scale
pattern possible, with finite float16 scales of either sign.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from max.driver import Buffer
from max.dtype import DType
from max.graph import DeviceRef, Module, TensorType

from pagedkv import graph_ops
from pagedkv._ops.quantized_panels import pack_quantized_weight, quantized_panels_shape
from suite_graphs import ops_graph, suite_graph, suite_model

# (format, N, K): every format, a partial last panel where N allows, several
# blocks (and super-blocks).
CASES = [
    ("Q4_0", 40, 96),
    ("Q4_1", 50, 64),
    ("Q5_0", 33, 96),
    ("Q5_1", 48, 64),
    ("Q8_0", 33, 160),
    ("Q4_K", 40, 512),
    ("Q5_K", 24, 256),
    ("Q6_K", 33, 512),
]
FLOAT16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
"""Byte offsets of each block's float16 scale (and min, or super-block
min) in ggml's block structs."""


@suite_graph("packed_rows")
def packed_rows_graph(module: Module) -> None:
    cpu = DeviceRef.CPU()
    types = []
    for fmt, n, k in CASES:
        types += [
            TensorType(DType.uint8, quantized_panels_shape(fmt, n, k), cpu),
            TensorType(DType.int32, [f"m_{fmt}"], cpu),
        ]
    with ops_graph(module, "packed_rows", types) as g:
        values = [v.tensor for v in g.inputs]
        g.output(
            *(
                graph_ops.packed_rows(values[2 * i], values[2 * i + 1], fmt, (n, k))
                for i, (fmt, n, k) in enumerate(CASES)
            )
        )


@pytest.fixture
def rows_model():
    return suite_model("packed_rows")


def random_blocks(rng: np.random.Generator, fmt: str, n: int, k: int) -> np.ndarray:
    """A weight [n, k] in fmt's GGUF blocks: random bytes, the float16
    fields finite, of either sign, some of them zero."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in FLOAT16_FIELDS[fmt]:
        half = rng.uniform(-0.1, 0.1, (n, k // block)).astype(np.float16)
        half[rng.random(half.shape) < 0.05] = 0
        raw[..., at : at + 2] = half[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def run(model, cases: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    args = [a for panels, ids in cases for a in (panels, ids)]
    return [out.to_numpy() for out in model.execute(*(Buffer.from_dlpack(a) for a in args))]


@pytest.mark.parametrize("m", [1, 3, 16, 37])
def test_rows_equal_the_gguf_dequantization_bit_for_bit(rows_model, m):
    """Any ids (repeats, the first and last rows, a partial last panel) in
    tasks of several rows."""
    rng = np.random.default_rng(m)
    cases, wants = [], []
    for fmt, n, k in CASES:
        raw = random_blocks(rng, fmt, n, k)
        ids = rng.integers(0, n, m).astype(np.int32)
        ids[0] = n - 1
        if m > 2:
            ids[1], ids[2] = 0, ids[0]
        cases.append((pack_quantized_weight(raw, fmt, n, k).panels, ids))
        wants.append(quants.dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float32)[ids])
    for got, want, case in zip(run(rows_model, cases), wants, CASES, strict=True):
        assert got.shape == want.shape and got.dtype == np.float32, case
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), case


def test_no_ids_give_no_rows(rows_model):
    rng = np.random.default_rng(0)
    cases = [
        (
            pack_quantized_weight(random_blocks(rng, fmt, n, k), fmt, n, k).panels,
            np.zeros(0, np.int32),
        )
        for fmt, n, k in CASES
    ]
    for got, (_, _, k) in zip(run(rows_model, cases), CASES, strict=True):
        assert got.shape == (0, k)


@pytest.mark.parametrize("bad", [-1, "n"])
def test_an_id_outside_the_rows_raises(rows_model, bad):
    """N itself is out (the last panel's padding columns are not rows)."""
    rng = np.random.default_rng(1)
    cases = []
    for fmt, n, k in CASES:
        ids = np.array([0, n if bad == "n" else bad], np.int32)
        cases.append((pack_quantized_weight(random_blocks(rng, fmt, n, k), fmt, n, k).panels, ids))
    with pytest.raises(Exception, match="outside the vocabulary"):
        run(rows_model, cases)


def test_packed_rows_refuses_mismatched_operands():
    from max.graph import Graph

    cpu = DeviceRef.CPU()
    shape = quantized_panels_shape("Q4_0", 40, 96)
    types = [TensorType(DType.uint8, shape, cpu), TensorType(DType.int64, ["m"], cpu)]
    with Graph("packed_rows_checks", input_types=types) as g:
        w, ids = (v.tensor for v in g.inputs)
        with pytest.raises(ValueError, match="packed as uint8"):
            graph_ops.packed_rows(w, ids, "Q4_1", (40, 96))
        with pytest.raises(ValueError, match="int32"):
            graph_ops.packed_rows(w, ids, "Q4_0", (40, 96))
        with pytest.raises(ValueError, match="takes"):
            graph_ops.packed_rows(w, ids, "Q2_K", (40, 96))
